#include "codegen/lower_cpu.h"

#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "codegen/stream_builder.h"
#include "ir/op_def.h"

namespace kiln::codegen {
namespace {

class CpuLowering {
 public:
  CpuLowering(const ir::SymbolBindings& symbols) : symbols_(symbols) {}

  Expected<Program> run(const ir::Function& f) {
    program_.function = f.name();
    program_.symbols = symbols_;
    if (f.body().empty()) return Status::errorf("function @{} has no body", f.name());
    for (ir::Op* op : f.entry().opList()) KILN_RETURN_IF_ERROR(lowerOp(*op));
    streams_.assembleInto(program_);
    KILN_RETURN_IF_ERROR(validate(program_));
    return std::move(program_);
  }

 private:
  Status located(const ir::Op& op, Status s) { return std::move(s).withLocation(op.location()); }

  Expected<int> newBuffer(const ir::Op& op, BufferKind kind, std::string name, const ir::TensorType& type) {
    auto bytes = type.checkedBytes(symbols_);
    if (!bytes) return located(op, Status::errorf("'{}': {}", op.name(), bytes.status().message()));
    Buffer b;
    b.id = static_cast<int>(program_.buffers.size());
    b.kind = kind;
    b.name = std::move(name);
    b.type = type;
    b.bytes = *bytes;
    program_.buffers.push_back(std::move(b));
    return program_.buffers.back().id;
  }

  // Inputs and parameters are one buffer per name, however many ops read them.
  Status lowerSource(const ir::Op& op, BufferKind kind, std::map<std::string, int>& by_name) {
    std::string name = op.strAttr("name");
    auto it = by_name.find(name);
    if (it != by_name.end()) {
      const Buffer& b = program_.buffers[static_cast<size_t>(it->second)];
      if (!(b.type == op.result()->type()))
        return located(op, Status::errorf("'{}' \"{}\" is declared twice with different types: {} and {}", op.name(),
                                          name, b.type.str(), op.result()->type().str()));
      buffer_of_[op.result()] = it->second;
      return Status::ok();
    }
    KILN_ASSIGN_OR_RETURN(auto id, newBuffer(op, kind, name, op.result()->type()));
    by_name[name] = id;
    buffer_of_[op.result()] = id;
    return Status::ok();
  }

  Status lowerOp(const ir::Op& op) {
    if (!op.def())
      return located(op, Status::errorf("op '{}' is not in the op table; the CPU backend cannot run it", op.name()));
    if (op.is(ir::OpCode::Input)) return lowerSource(op, BufferKind::Input, inputs_);
    if (op.is(ir::OpCode::Parameter)) return lowerSource(op, BufferKind::Parameter, params_);
    if (op.is(ir::OpCode::Return)) {
      for (ir::Value* v : op.operands()) {
        int id = buffer_of_.at(v);
        Buffer& b = program_.buffers[static_cast<size_t>(id)];
        if (b.kind == BufferKind::Temp) b.kind = BufferKind::Output;
        program_.results.push_back(id);
      }
      return Status::ok();
    }
    // A fused group's ops (passes/fusion.cc) become launches on the group's stream; the CUDA
    // backend runs the group as one kernel. The launches of a pointwise group carry
    // `kiln.group = N`: the CPU executor runs them as one loop over the data (cpu/pointwise.h).
    if (op.is(ir::OpCode::Fused) && !op.regions().empty() && !op.regions().front()->empty())
      return lowerFused(op);
    Instruction in;
    in.kind = InstrKind::Launch;
    in.op = op.name();
    in.attrs = op.attrs();
    int stream = group_stream_;
    if (const ir::Attribute* s = op.attr("kiln.stream")) {
      if (!s->isInt() || s->asInt() < 0 || s->asInt() > 1024)
        return located(op, Status::errorf("'{}': kiln.stream must be a stream number, got {}", op.name(), s->str()));
      stream = static_cast<int>(s->asInt());
      in.attrs.erase("kiln.stream");
    }
    if (pointwise_group_ >= 0) in.attrs[std::string(kGroupAttr)] = pointwise_group_;
    for (ir::Value* v : op.operands()) {
      auto it = buffer_of_.find(v);
      if (it == buffer_of_.end())
        return located(op, Status::errorf("'{}' reads a value the CPU lowering has not seen (a block argument?)",
                                          op.name()));
      in.operands.push_back(it->second);
    }
    for (ir::Value* r : op.results()) {
      std::string hint = r->nameHint().empty() ? "" : r->nameHint();
      KILN_ASSIGN_OR_RETURN(auto id, newBuffer(op, BufferKind::Temp, hint, r->type()));
      in.results.push_back(id);
      buffer_of_[r] = id;
    }
    // Optimizer updates write their parameter and state in place.
    std::vector<int> written;
    for (unsigned i : ir::writtenOperands(op)) written.push_back(in.operands[i]);
    streams_.launch(stream, std::move(in), written);
    return Status::ok();
  }

  Status lowerFused(const ir::Op& op) {
    const ir::Block& body = op.regions().front()->front();
    for (unsigned i = 0; i < body.numArguments() && i < op.numOperands(); ++i) {
      auto it = buffer_of_.find(op.operand(i));
      if (it == buffer_of_.end())
        return located(op, Status::error("'kiln.fused' reads a value the CPU lowering has not seen"));
      buffer_of_[body.argument(i)] = it->second;
    }
    int outer = group_stream_;
    if (const ir::Attribute* s = op.attr("kiln.stream"); s && s->isInt()) group_stream_ = static_cast<int>(s->asInt());
    const int outer_group = pointwise_group_;
    if (op.strAttr("kind") == "pointwise") pointwise_group_ = next_group_++;
    for (const auto& inner : body.ops()) {
      if (inner->is(ir::OpCode::Yield)) {
        for (unsigned i = 0; i < inner->numOperands() && i < op.numResults(); ++i)
          buffer_of_[op.result(i)] = buffer_of_.at(inner->operand(i));
        continue;
      }
      KILN_RETURN_IF_ERROR(lowerOp(*inner));
    }
    group_stream_ = outer;
    pointwise_group_ = outer_group;
    return Status::ok();
  }

  const ir::SymbolBindings& symbols_;
  Program program_;
  std::unordered_map<const ir::Value*, int> buffer_of_;
  std::map<std::string, int> inputs_, params_;
  StreamBuilder streams_;  // launches in order, events added where streams meet
  int group_stream_ = 0;  // the stream of the fused group being lowered
  int pointwise_group_ = -1, next_group_ = 0;  // the pointwise group being lowered, numbered in order
};

}  // namespace

Expected<Program> lowerForCpu(const ir::Function& f, const ir::SymbolBindings& symbols,
                              const CpuLoweringOptions& options) {
  KILN_ASSIGN_OR_RETURN(auto p, CpuLowering(symbols).run(f));
  if (options.plan_memory) KILN_RETURN_IF_ERROR(planMemory(p, options.memory));
  return p;
}

}  // namespace kiln::codegen
