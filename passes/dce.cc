// Dead code elimination: removes pure ops none of whose results is used. Ops with side effects
// (optimizer updates), sources (inputs, parameters: part of the model's interface) and
// terminators always stay.
#include "ir/op_def.h"
#include "passes/pass_registry.h"

namespace kiln::passes {

class DCEPass : public RegisteredPass<DCEPass> {
 public:
  KILN_PASS_INFO(DCEPass)

  Expected<bool> run(ir::Module& m) override {
    bool changed = false;
    for (auto& f : m.functions()) changed |= sweepBlock(f->entry());
    return changed;
  }

 private:
  static bool removable(const ir::Op& op) {
    if (!op.hasTrait(ir::kPure) || op.hasTrait(ir::kSideEffect) || op.hasTrait(ir::kTerminator)) return false;
    for (ir::Value* r : op.results())
      if (r->hasUses()) return false;
    return true;
  }

  // Back to front, so that a chain of dead ops goes in one sweep: erasing a user frees its
  // operands' producers, which come earlier.
  static bool sweepBlock(ir::Block& b) {
    bool changed = false;
    std::vector<ir::Op*> ops = b.opList();
    for (auto it = ops.rbegin(); it != ops.rend(); ++it) {
      ir::Op* op = *it;
      if (removable(*op)) {
        b.erase(op);
        changed = true;
        continue;
      }
      for (auto& r : op->regions())
        for (auto& blk : r->blocks()) changed |= sweepBlock(*blk);
    }
    return changed;
  }
};

Expected<std::unique_ptr<Pass>> createDCEPass(const PassContext&, const PassOptions&) {
  return makePass<DCEPass>();
}

}  // namespace kiln::passes
