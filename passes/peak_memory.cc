#include "passes/peak_memory.h"

#include <map>
#include <unordered_map>

#include "ir/arena_plan.h"
#include "ir/op_def.h"

namespace kiln::passes {
namespace {

constexpr int64_t kAlignment = 64;

// Instructions and buffers as the CPU lowering makes them.
class Flattener {
 public:
  explicit Flattener(const ir::SymbolBindings& s) : symbols_(s) {}

  Status block(const ir::Block& b) {
    for (const auto& op : b.ops()) KILN_RETURN_IF_ERROR(lower(*op));
    return Status::ok();
  }

  std::vector<ir::ArenaStep> steps;
  std::vector<ir::ArenaBuffer> buffers;

 private:
  Expected<int> newBuffer(const ir::Op& op, const ir::TensorType& t, bool arena) {
    auto bytes = t.checkedBytes(symbols_);
    if (!bytes) {
      const std::string name = op.is(ir::OpCode::Input) || op.is(ir::OpCode::Parameter)
                                   ? fmt::format(" \"{}\"", op.strAttr("name"))
                                   : "";
      return Status::error(fmt::format("'{}'{}: {}", op.name(), name, bytes.status().message()),
                           op.location());
    }
    buffers.push_back({*bytes, t, arena, false});
    return static_cast<int>(buffers.size()) - 1;
  }

  Status lower(const ir::Op& op) {
    if (op.is(ir::OpCode::Input) || op.is(ir::OpCode::Parameter)) {
      auto& by_name = op.is(ir::OpCode::Input) ? inputs_ : params_;
      std::string name = op.strAttr("name");
      if (!by_name.count(name)) {
        KILN_ASSIGN_OR_RETURN(auto id, newBuffer(op, op.result()->type(), false));
        by_name[name] = id;
      }
      buffer_of_[op.result()] = by_name[name];
      return Status::ok();
    }
    if (op.is(ir::OpCode::Return)) {
      for (const ir::Value* v : op.operands())
        if (buffer_of_.count(v)) {
          ir::ArenaBuffer& b = buffers[static_cast<size_t>(buffer_of_.at(v))];
          b.live_to_end = b.in_arena;
        }
      return Status::ok();
    }
    if (op.is(ir::OpCode::Fused) && !op.regions().empty() && !op.regions().front()->empty()) {
      const ir::Block& body = op.regions().front()->front();
      for (unsigned i = 0; i < body.numArguments() && i < op.numOperands(); ++i)
        if (buffer_of_.count(op.operand(i))) buffer_of_[body.argument(i)] = buffer_of_.at(op.operand(i));
      int outer = group_stream_;
      if (const ir::Attribute* st = op.attr("kiln.stream"); st && st->isInt()) group_stream_ = static_cast<int>(st->asInt());
      for (const auto& inner : body.ops()) {
        if (inner->is(ir::OpCode::Yield)) {
          for (unsigned i = 0; i < inner->numOperands() && i < op.numResults(); ++i)
            if (buffer_of_.count(inner->operand(i))) buffer_of_[op.result(i)] = buffer_of_.at(inner->operand(i));
          continue;
        }
        KILN_RETURN_IF_ERROR(lower(*inner));
      }
      group_stream_ = outer;
      return Status::ok();
    }
    ir::ArenaStep s;
    s.stream = group_stream_;
    if (const ir::Attribute* st = op.attr("kiln.stream"); st && st->isInt()) s.stream = static_cast<int>(st->asInt());
    s.in_place = ir::inPlaceKind(op.name());
    for (const ir::Value* v : op.operands()) {
      // A function argument (IR tests; models take none) lives outside the arena like an input.
      if (!buffer_of_.count(v)) {
        KILN_ASSIGN_OR_RETURN(auto id, newBuffer(op, v->type(), false));
        buffer_of_[v] = id;
      }
      s.operands.push_back(buffer_of_.at(v));
    }
    for (const ir::Value* r : op.results()) {
      KILN_ASSIGN_OR_RETURN(auto id, newBuffer(op, r->type(), true));
      s.results.push_back(id);
      buffer_of_[r] = id;
    }
    // The waits codegen's lowering turns into events (codegen/lower_cpu.cc).
    std::vector<int> written;
    for (unsigned i : ir::writtenOperands(op)) written.push_back(s.operands[i]);
    s.waits = hazards_.add(static_cast<int>(steps.size()), s.stream, s.operands, written, s.results);
    steps.push_back(std::move(s));
    return Status::ok();
  }

  const ir::SymbolBindings& symbols_;
  std::unordered_map<const ir::Value*, int> buffer_of_;
  std::map<std::string, int> inputs_, params_;
  ir::StreamHazards hazards_;
  int group_stream_ = 0;  // the stream of the fused group being flattened
};

}  // namespace

Expected<int64_t> estimatePeakBytes(const ir::Function& f, const ir::SymbolBindings& symbols) {
  if (f.body().empty()) return int64_t{0};
  Flattener fl(symbols);
  KILN_RETURN_IF_ERROR(fl.block(f.entry()));
  return ir::planArena(fl.steps, fl.buffers, {kAlignment, true}).peak;
}

}  // namespace kiln::passes
