#include "codegen/lower_cpu.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "ir/arena_plan.h"
#include "ir/op_def.h"

namespace kiln::codegen {
namespace {

struct Pending {
  int stream;
  Instruction instr;
  int record_event = -1;  // recorded on `stream` right after this instruction
};

class CpuLowering {
 public:
  CpuLowering(const ir::SymbolBindings& symbols) : symbols_(symbols) {}

  Expected<Program> run(const ir::Function& f) {
    program_.function = f.name();
    program_.symbols = symbols_;
    if (f.body().empty()) return Status::errorf("function @{} has no body", f.name());
    for (ir::Op* op : f.entry().opList()) KILN_RETURN_IF_ERROR(lowerOp(*op));
    assemble();
    KILN_RETURN_IF_ERROR(validate(program_));
    return std::move(program_);
  }

 private:
  Status located(const ir::Op& op, Status s) { return std::move(s).withLocation(op.location()); }

  Expected<int> newBuffer(const ir::Op& op, BufferKind kind, std::string name, const ir::TensorType& type) {
    auto bytes = type.bytes(symbols_);
    if (!bytes) {
      std::string missing;
      for (const ir::Dim& d : type.shape())
        if (!d.sym().empty() && !symbols_.count(d.sym())) missing = d.sym();
      return located(op, Status::errorf("'{}': symbol '{}' of {} is not bound (set it, e.g. --batch)", op.name(),
                                        missing, type.str()));
    }
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
    auto id = newBuffer(op, kind, name, op.result()->type());
    if (!id) return id.status();
    by_name[name] = *id;
    buffer_of_[op.result()] = *id;
    return Status::ok();
  }

  Status lowerOp(const ir::Op& op) {
    if (!op.def())
      return located(op, Status::errorf("op '{}' is not in the op table; the CPU backend cannot run it", op.name()));
    if (op.name() == "kiln.input") return lowerSource(op, BufferKind::Input, inputs_);
    if (op.name() == "kiln.parameter") return lowerSource(op, BufferKind::Parameter, params_);
    if (op.name() == "func.return") {
      for (ir::Value* v : op.operands()) {
        int id = buffer_of_.at(v);
        Buffer& b = program_.buffers[static_cast<size_t>(id)];
        if (b.kind == BufferKind::Temp) b.kind = BufferKind::Output;
        program_.results.push_back(id);
      }
      return Status::ok();
    }
    // The CPU runs a fused group (passes/fusion.cc) op by op on the group's stream; the CUDA
    // backend runs it as one kernel.
    if (op.name() == "kiln.fused" && !op.regions().empty() && !op.regions().front()->empty())
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
    for (ir::Value* v : op.operands()) {
      auto it = buffer_of_.find(v);
      if (it == buffer_of_.end())
        return located(op, Status::errorf("'{}' reads a value the CPU lowering has not seen (a block argument?)",
                                          op.name()));
      in.operands.push_back(it->second);
    }
    for (ir::Value* r : op.results()) {
      std::string hint = r->nameHint().empty() ? "" : r->nameHint();
      auto id = newBuffer(op, BufferKind::Temp, hint, r->type());
      if (!id) return id.status();
      in.results.push_back(*id);
      buffer_of_[r] = *id;
    }
    // Optimizer updates write their parameter and state in place.
    std::vector<int> written;
    for (unsigned i : ir::writtenOperands(op)) written.push_back(in.operands[i]);
    const int step = static_cast<int>(launch_at_.size());
    // Waiting for the latest launch of a stream covers its earlier ones: one wait per stream.
    std::map<int, int> latest;  // producer stream -> index in pending_
    for (int earlier : hazards_.add(step, stream, in.operands, written, in.results)) {
      const Pending& prod = pending_[static_cast<size_t>(launch_at_[static_cast<size_t>(earlier)])];
      int& at = latest.try_emplace(prod.stream, -1).first->second;
      at = std::max(at, launch_at_[static_cast<size_t>(earlier)]);
    }
    for (const auto& [_, launch] : latest) addWait(stream, launch);
    launch_at_.push_back(static_cast<int>(pending_.size()));
    pending_.push_back({stream, std::move(in)});
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
    for (const auto& inner : body.ops()) {
      if (inner->name() == "kiln.yield") {
        for (unsigned i = 0; i < inner->numOperands() && i < op.numResults(); ++i)
          buffer_of_[op.result(i)] = buffer_of_.at(inner->operand(i));
        continue;
      }
      KILN_RETURN_IF_ERROR(lowerOp(*inner));
    }
    group_stream_ = outer;
    return Status::ok();
  }

  // `stream` waits for the launch at pending_[launch]: that launch records an event (one per
  // launch), the stream waits on it, unless it already waited for that launch or a later one of
  // the same stream.
  void addWait(int stream, int launch) {
    Pending& prod = pending_[static_cast<size_t>(launch)];
    int& joined = joined_.try_emplace({stream, prod.stream}, -1).first->second;
    if (launch <= joined) return;
    joined = launch;
    if (prod.record_event < 0) prod.record_event = program_.num_events++;
    Instruction wait;
    wait.kind = InstrKind::WaitEvent;
    wait.event = prod.record_event;
    pending_.push_back({stream, std::move(wait)});
  }

  void assemble() {
    std::map<int, Stream> streams;
    streams[0].id = 0;
    int seq = 0;
    auto emit = [&](int s, Instruction in) {
      in.seq = seq++;
      streams[s].id = s;
      streams[s].instrs.push_back(std::move(in));
    };
    // A launch's record must precede any wait on it: waits are added after it in pending_.
    for (Pending& p : pending_) {
      int event = p.record_event;
      int s = p.stream;
      emit(s, std::move(p.instr));
      if (event >= 0) {
        Instruction rec;
        rec.kind = InstrKind::RecordEvent;
        rec.event = event;
        emit(s, std::move(rec));
      }
    }
    for (auto& [_, s] : streams) program_.streams.push_back(std::move(s));
  }

  const ir::SymbolBindings& symbols_;
  Program program_;
  std::unordered_map<const ir::Value*, int> buffer_of_;
  std::map<std::string, int> inputs_, params_;
  ir::StreamHazards hazards_;  // steps: launches in order
  std::vector<int> launch_at_;  // launch -> its index in pending_
  std::vector<Pending> pending_;
  std::map<std::pair<int, int>, int> joined_;  // (stream, other stream) -> latest launch waited for
  int group_stream_ = 0;  // the stream of the fused group being lowered
};

}  // namespace

Expected<Program> lowerForCpu(const ir::Function& f, const ir::SymbolBindings& symbols,
                              const CpuLoweringOptions& options) {
  auto p = CpuLowering(symbols).run(f);
  if (!p) return p.status();
  if (options.plan_memory) KILN_RETURN_IF_ERROR(planMemory(*p, options.memory));
  return p;
}

}  // namespace kiln::codegen
