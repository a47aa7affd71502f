// Common subexpression elimination: a pure op equal to an earlier one (same name, operands,
// attributes and result types) is replaced by it. Operands of commutative ops match in either
// order. Ops with regions and ops with side effects are never merged; each region is its own
// scope, so a fused group's body never captures values from outside.
#include <unordered_map>

#include "ir/op_def.h"
#include "passes/pass_registry.h"

namespace kiln::passes {

class CSEPass : public RegisteredPass<CSEPass> {
 public:
  KILN_PASS_INFO(CSEPass)

  Expected<bool> run(ir::Module& m) override {
    bool changed = false;
    for (auto& f : m.functions()) changed |= processBlock(f->entry());
    return changed;
  }

 private:
  static bool candidate(const ir::Op& op) {
    return op.hasTrait(ir::kPure) && !op.hasTrait(ir::kSideEffect) && op.regions().empty() &&
           op.numResults() > 0;
  }

  static std::vector<ir::Value*> keyOperands(const ir::Op& op) {
    std::vector<ir::Value*> ops = op.operands();
    if (op.hasTrait(ir::kCommutative)) std::sort(ops.begin(), ops.end(), std::less<ir::Value*>());
    return ops;
  }

  static size_t hashOf(const ir::Op& op) {
    size_t h = std::hash<std::string>()(op.name());
    for (ir::Value* v : keyOperands(op)) h = h * 1000003u ^ std::hash<ir::Value*>()(v);
    return h;
  }

  static bool equivalent(const ir::Op& a, const ir::Op& b) {
    if (a.name() != b.name() || a.numResults() != b.numResults() || keyOperands(a) != keyOperands(b) ||
        a.attrs() != b.attrs())
      return false;
    for (unsigned i = 0; i < a.numResults(); ++i)
      if (!(a.result(i)->type() == b.result(i)->type())) return false;
    return true;
  }

  static bool processBlock(ir::Block& b) {
    bool changed = false;
    std::unordered_multimap<size_t, ir::Op*> seen;
    for (ir::Op* op : b.opList()) {
      for (auto& r : op->regions())
        for (auto& blk : r->blocks()) changed |= processBlock(*blk);
      if (!candidate(*op)) continue;
      size_t h = hashOf(*op);
      ir::Op* existing = nullptr;
      auto [lo, hi] = seen.equal_range(h);
      for (auto it = lo; it != hi && !existing; ++it)
        if (equivalent(*it->second, *op)) existing = it->second;
      if (!existing) {
        seen.emplace(h, op);
        continue;
      }
      for (unsigned i = 0; i < op->numResults(); ++i) op->result(i)->replaceAllUsesWith(existing->result(i));
      b.erase(op);
      changed = true;
    }
    return changed;
  }
};

Expected<std::unique_ptr<Pass>> createCSEPass(const PassContext&, const PassOptions&) {
  return makePass<CSEPass>();
}

}  // namespace kiln::passes
