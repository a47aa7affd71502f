#include "passes/dependence.h"

#include <algorithm>
#include <queue>
#include <unordered_map>

#include "ir/collective.h"
#include "ir/op_def.h"

namespace kiln::passes {

bool writesInPlace(const ir::Op& op) {
  if (!ir::writtenOperands(op).empty()) return true;
  for (const auto& r : op.regions())
    for (const auto& b : r->blocks())
      for (const auto& inner : b->ops())
        if (writesInPlace(*inner)) return true;
  return false;
}

BlockDependences::BlockDependences(const ir::Block& block) : ops_(block.opList()) {
  const int n = static_cast<int>(ops_.size());
  preds_.resize(ops_.size());
  succs_.resize(ops_.size());
  for (int i = 0; i < n; ++i) pos_[ops_[static_cast<size_t>(i)]] = i;
  // Values captured from this block by ops nested in a region count as operands of the op
  // holding the region.
  auto topLevel = [&](ir::Op* user) {
    while (user && !pos_.count(user)) {
      ir::Block* b = user->parentBlock();
      user = b && b->parentRegion() ? b->parentRegion()->parentOp() : nullptr;
    }
    return user;
  };
  // Operands of the op and of the ops nested in it (a fused group may name a parameter it
  // updates directly); `written`: those the op or a nested op updates in place.
  // A group's block argument stands for the group op's operand of that number.
  auto outer = [](ir::Value* v) {
    while (v->isBlockArgument() && v->parentBlock() && v->parentBlock()->parentRegion()) {
      const ir::Op* group = v->parentBlock()->parentRegion()->parentOp();
      if (!group || v->index() >= group->numOperands()) break;
      v = group->operand(v->index());
    }
    return v;
  };
  std::function<void(const ir::Op&, std::vector<ir::Value*>&, std::vector<ir::Value*>&)> collect =
      [&](const ir::Op& op, std::vector<ir::Value*>& read, std::vector<ir::Value*>& written) {
        for (ir::Value* v : op.operands()) read.push_back(outer(v));
        for (unsigned i : ir::writtenOperands(op)) written.push_back(outer(op.operand(i)));
        for (const auto& r : op.regions())
          for (const auto& b : r->blocks())
            for (const auto& inner : b->ops()) collect(*inner, read, written);
      };
  // Per written value: its last writer and the readers since, as positions.
  std::unordered_map<const ir::Value*, int> last_writer;
  // Every rank issues its collectives in the same order (the n-th of one rank meets the n-th of
  // the others), and ranks' programs differ: no reordering may swap two of them.
  int last_collective = -1;
  for (int i = 0; i < n; ++i) {
    ir::Op* op = ops_[static_cast<size_t>(i)];
    if (ir::isCollective(*op)) {
      if (last_collective >= 0) addEdge(last_collective, i);
      last_collective = i;
    }
    std::vector<ir::Value*> read, written;
    collect(*op, read, written);
    for (ir::Value* v : read) {
      if (v->definingOp() && pos_.count(v->definingOp())) addEdge(pos_[v->definingOp()], i);
      // A value updated in place earlier: its readers see the update.
      if (auto w = last_writer.find(v); w != last_writer.end()) addEdge(w->second, i);
    }
    if (op->hasTrait(ir::kTerminator)) {
      for (int j = 0; j < i; ++j) addEdge(j, i);
      continue;
    }
    for (ir::Value* v : written) {
      // Readers of the old value come first, whatever op they are.
      for (const ir::Use& u : v->uses()) {
        ir::Op* reader = topLevel(u.user);
        if (reader && reader != op && pos_[reader] < i) addEdge(pos_[reader], i);
      }
      last_writer[v] = i;
    }
  }
}

void BlockDependences::addEdge(int from, int to) {
  auto& p = preds_[static_cast<size_t>(to)];
  if (from == to || std::find(p.begin(), p.end(), from) != p.end()) return;
  p.push_back(from);
  succs_[static_cast<size_t>(from)].push_back(to);
}

bool reorderBlock(ir::Block& block, const std::function<bool(int a, int b)>& better) {
  BlockDependences deps(block);
  const auto& ops = deps.ops();
  const int n = static_cast<int>(ops.size());
  std::vector<int> waiting(ops.size());
  for (int i = 0; i < n; ++i) waiting[static_cast<size_t>(i)] = static_cast<int>(deps.predecessors(i).size());
  std::vector<int> ready, order;
  for (int i = 0; i < n; ++i)
    if (!waiting[static_cast<size_t>(i)]) ready.push_back(i);
  while (!ready.empty()) {
    auto best = std::min_element(ready.begin(), ready.end(), [&](int a, int b) { return better(a, b); });
    int i = *best;
    ready.erase(best);
    order.push_back(i);
    for (int s : deps.successors(i))
      if (--waiting[static_cast<size_t>(s)] == 0) ready.push_back(s);
  }
  assert(static_cast<int>(order.size()) == n && "dependence cycle in a block");
  bool changed = false;
  for (int k = 0; k < n; ++k) changed |= order[static_cast<size_t>(k)] != k;
  if (!changed) return false;
  std::vector<std::unique_ptr<ir::Op>> held;
  for (int i : order) held.push_back(block.remove(ops[static_cast<size_t>(i)]));
  for (auto& op : held) block.push_back(std::move(op));
  return true;
}

}  // namespace kiln::passes
