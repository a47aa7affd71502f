// The dependences between the ops of one block that any reordering must keep: a value's
// producer before its users (SSA), and, for ops that write operands in place (optimizer
// updates: ir::writtenOperands, also inside a fused group), every earlier reader of a written
// value before the writer, the writers of one value in their original order, and later readers
// of a written value after its writer. Updates of different parameters are not ordered. Fusion (which may move a
// group) and scheduling (which reorders the block) both order ops by this graph.
#pragma once

#include <functional>
#include <unordered_map>
#include <vector>

#include "ir/ir.h"

namespace kiln::passes {

// True when the op, or an op in its regions, has side effects (writes state in place).
bool writesInPlace(const ir::Op& op);

class BlockDependences {
 public:
  explicit BlockDependences(const ir::Block& block);

  const std::vector<ir::Op*>& ops() const { return ops_; }
  int position(const ir::Op* op) const { return pos_.at(op); }
  // Positions of the ops that must run before ops()[i] (no duplicates).
  const std::vector<int>& predecessors(int i) const { return preds_[static_cast<size_t>(i)]; }
  const std::vector<int>& successors(int i) const { return succs_[static_cast<size_t>(i)]; }

 private:
  void addEdge(int from, int to);
  std::vector<ir::Op*> ops_;
  std::unordered_map<const ir::Op*, int> pos_;
  std::vector<std::vector<int>> preds_, succs_;
};

// Rewrites the block's op order to a topological order of its dependences (the terminator
// last), choosing among ready ops the one `better(a, b)` ranks first (positions in the current
// order). Returns whether the order changed.
bool reorderBlock(ir::Block& block, const std::function<bool(int a, int b)>& better);

}  // namespace kiln::passes
