// A function into groups (groupOps, or the fusion pass's kiln.fused ops), each lowered by the
// emitter the EmitterRegistry names for it.
#include <algorithm>
#include <map>
#include <set>

#include "codegen/emit/emitter_registry.h"
#include "codegen/kernel_lowering.h"
#include "ir/op_def.h"

namespace kiln::codegen {

using ir::Op;
using ir::Value;

Expected<std::vector<int64_t>> concreteShape(const ir::TensorType& t, const ir::SymbolBindings& symbols) {
  std::vector<int64_t> s;
  for (const ir::Dim& d : t.shape()) {
    auto v = d.evaluate(symbols);
    if (!v)
      return Status::errorf("dimension '{}' of {} has no value (bind it, e.g. --batch)", d.str(), t.str());
    s.push_back(*v);
  }
  return s;
}

const Value* outerValue(const Value* v) {
  for (;;) {
    if (v->isBlockArgument()) {
      const ir::Block* b = v->parentBlock();
      const Op* fused = b && b->parentRegion() ? b->parentRegion()->parentOp() : nullptr;
      if (!fused || !fused->is(ir::OpCode::Fused) || v->index() >= fused->numOperands()) return v;
      v = fused->operand(v->index());
      continue;
    }
    const Value* yielded_as = nullptr;
    for (const ir::Use& u : v->uses())
      if (u.user->is(ir::OpCode::Yield)) {
        const ir::Block* b = u.user->parentBlock();
        const Op* fused = b && b->parentRegion() ? b->parentRegion()->parentOp() : nullptr;
        if (fused && fused->is(ir::OpCode::Fused) && u.operand_index < fused->numResults())
          yielded_as = fused->result(u.operand_index);
      }
    if (!yielded_as) return v;
    v = yielded_as;
  }
}

bool isSourceOrTerminator(const Op& op) {
  return op.hasTrait(ir::kSource) || op.hasTrait(ir::kTerminator) || op.is(ir::OpCode::Constant);
}

bool isPointwiseOp(const Op& op) { return emit::EmitterRegistry::get().expressionFor(op) != nullptr; }

int streamOf(const Op& op) {
  const ir::Attribute* s = op.attr("kiln.stream");
  return s && s->isInt() ? static_cast<int>(s->asInt()) : 0;
}

std::vector<std::vector<const Op*>> groupOps(const std::vector<const Op*>& ops) {
  std::vector<std::vector<const Op*>> groups;
  // Bags over sources, per stream: each stream's bags form one group at its first bag's place.
  std::map<int, std::pair<size_t, std::vector<const Op*>>> bags;
  // Dense optimizer updates, per stream, wait to form one group (one multi-tensor launch): it
  // is placed before the first op that reads or writes what one of them updates, or at the end
  // (their operands are all defined by then, so moving an update later changes nothing else).
  std::map<int, std::vector<const Op*>> updates;
  std::set<const Value*> updated;
  auto flushUpdates = [&] {
    for (auto& [_, group] : updates)
      if (!group.empty()) groups.push_back(std::move(group));
    updates.clear();
    updated.clear();
  };
  auto sourcesOnly = [](const Op* op) {
    for (const Value* v : op->operands())
      if (!v->definingOp() || !isSourceOrTerminator(*v->definingOp())) return false;
    return true;
  };
  std::vector<const Op*> current;
  std::set<const Value*> current_values;
  auto flush = [&] {
    if (!current.empty()) groups.push_back(current);
    current.clear();
    current_values.clear();
  };
  for (const Op* op : ops) {
    if (isSourceOrTerminator(*op)) continue;
    for (const Value* v : op->operands())
      if (updated.count(v)) {
        flush();
        flushUpdates();
        break;
      }
    // A kiln.fused op is a group of its own, where the fusion pass placed it; the bags before it
    // are grouped apart from those after.
    if (op->is(ir::OpCode::Fused)) {
      flush();
      for (auto& [_, slot_bags] : bags) groups[slot_bags.first] = std::move(slot_bags.second);
      bags.clear();
      groups.push_back({op});
      continue;
    }
    if (op->is(ir::OpCode::OptimizerUpdate)) {
      updates[streamOf(*op)].push_back(op);
      for (unsigned i : ir::writtenOperands(*op))
        updated.insert(op->operand(i));
      continue;
    }
    // Every bag over sources joins one group (per stream), at the first bag's place.
    if (op->is(ir::OpCode::EmbeddingBag) && sourcesOnly(op)) {
      flush();
      auto [it, first] = bags.try_emplace(streamOf(*op));
      if (first) {
        it->second.first = groups.size();
        groups.emplace_back();
      }
      it->second.second.push_back(op);
      continue;
    }
    bool joins = false;
    if (isPointwiseOp(*op) && !current.empty() && op->numResults() == 1 &&
        streamOf(*op) == streamOf(*current.back()) &&
        op->result()->type().shape() == current.back()->result()->type().shape())
      for (const Value* v : op->operands()) joins |= current_values.count(v) > 0;
    if (!joins) flush();
    current.push_back(op);
    for (const Value* r : op->results()) current_values.insert(r);
    if (!isPointwiseOp(*op)) flush();
  }
  flush();
  flushUpdates();
  for (auto& [_, slot_bags] : bags) groups[slot_bags.first] = std::move(slot_bags.second);
  return groups;
}

namespace emit {

Status lowerOps(GroupLowering& gl) {
  const std::vector<const Op*>& ops = gl.ops();
  if (ops.empty()) return Status::ok();
  const EmitterRegistry& registry = EmitterRegistry::get();
  const Op& last = *ops.back();
  const OpEmitter* emitter = registry.emitterFor(last);
  // A group of only this op, one kernel for all (every embedding_bag of a group).
  if (emitter && emitter->form == GroupForm::kManyOfTheOp &&
      std::all_of(ops.begin(), ops.end(), [&](const Op* o) { return o->name() == last.name(); }))
    return emitter->lower(gl, ops);
  bool prefix_pointwise =
      std::all_of(ops.begin(), ops.end() - 1, [](const Op* o) { return isPointwiseOp(*o); });
  if (isPointwiseOp(last) && prefix_pointwise) return registry.pointwiseChain()(gl);
  const bool takes_producers = emitter && emitter->form == GroupForm::kPointwiseInputs;
  if (!prefix_pointwise || (ops.size() > 1 && !takes_producers))
    return Status::errorf("cannot lower a group ending in {} with other ops as one unit", opLabel(last));
  // Producers of a reduction must not escape the group: they are only computed inline.
  for (size_t i = 0; i + 1 < ops.size(); ++i)
    for (const ir::Use& u : ops[i]->result()->uses())
      if (!gl.inGroup(u.user))
        return Status::errorf("{} is used outside its fused reduction group", opLabel(*ops[i]));
  if (!emitter) return Status::errorf("{} has no CUDA lowering", opLabel(last));
  return emitter->lower(gl, ops);
}

}  // namespace emit

Expected<LoweredGroup> lowerGroup(const std::vector<const Op*>& ops, const ir::SymbolBindings& symbols,
                                  const Target& target) {
  emit::GroupLowering gl(ops, symbols, gridSms(target));
  KILN_RETURN_IF_ERROR(emit::lowerOps(gl));
  return gl.take();
}

Expected<LoweredGroup> lowerFusedGroup(const std::string& kind, const std::vector<const Op*>& ops,
                                       const ir::SymbolBindings& symbols, const Target& target) {
  emit::GroupLowering gl(ops, symbols, gridSms(target));
  if (ops.empty()) return Status::error("the fused group is empty");
  emit::GroupEmitterFn lower = emit::EmitterRegistry::get().fusedEmitter(kind);
  if (!lower) return Status::errorf("the CUDA backend runs no '{}' group as one unit", kind);
  KILN_RETURN_IF_ERROR(lower(gl, ops));
  return gl.take();
}

Expected<std::vector<LoweredGroup>> lowerFunction(const ir::Function& f, const ir::SymbolBindings& symbols,
                                                  const Target& target) {
  std::vector<LoweredGroup> out;
  // Ops outside fused groups are grouped greedily between them (a fused op runs where the fusion
  // pass placed it); the dense optimizer updates wait past them (groupOps).
  std::vector<const Op*> all;
  for (const auto& op : f.entry().ops()) all.push_back(op.get());
  int fused_index = 0;
  for (const auto& group : groupOps(all)) {
    const Op* op = group.front();
    if (!op->is(ir::OpCode::Fused)) {
      KILN_ASSIGN_OR_RETURN(auto g, lowerGroup(group, symbols, target));
      g.stream = streamOf(*op);
      out.push_back(std::move(g));
      continue;
    }
    std::vector<const Op*> ops;
    if (!op->regions().empty() && !op->regions().front()->empty())
      for (const auto& inner : op->regions().front()->front().ops())
        if (!inner->hasTrait(ir::kTerminator)) ops.push_back(inner.get());
    std::string kind = op->strAttr("kind");
    // An op inside a fused group runs on the group's stream.
    const int stream = streamOf(*op);
    auto whole = lowerFusedGroup(kind, ops, symbols, target);
    if (whole) {
      whole->stream = stream;
      whole->fused_kind = kind;
      whole->fused_index = fused_index++;
      out.push_back(whole.take());
      continue;
    }
    // Not one unit on this backend: the greedy grouping over the group's ops, reason kept.
    for (const auto& group : groupOps(ops)) {
      KILN_ASSIGN_OR_RETURN(auto g, lowerGroup(group, symbols, target));
      g.stream = stream;
      g.fused_kind = kind;
      g.fused_index = fused_index;
      g.split_reason = whole.status().message();
      out.push_back(std::move(g));
    }
    ++fused_index;
  }
  return out;
}

}  // namespace kiln::codegen
