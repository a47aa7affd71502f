// Shape inference: recomputes every inferred result type from the op table, in program order,
// so that a changed input type (a new batch symbol, another feature count) flows through the
// graph. Ops with stated types (reshape, broadcast, ...) are re-verified against their new
// operands, and each function's result types follow what it returns. Fails, located at the op,
// when an op's operands no longer fit together.
#include "passes/shape_inference.h"

#include "ir/builder.h"
#include "ir/op_def.h"
#include "passes/pass_registry.h"

namespace kiln::passes {
namespace {

Status fail(const ir::Op& op, const ir::Function& f, const Status& s) {
  return Status::error(fmt::format("in @{}: {}", f.name(), s.message()),
                       op.location().known() ? op.location() : f.loc);
}

Status inferBlock(ir::Block& b, const ir::Function& f, bool& changed) {
  for (ir::Op* op : b.opList()) {
    const ir::OpDef* def = op->def();
    if (!def) return fail(*op, f, Status::errorf("unknown op '{}'", op->name()));
    if (!def->has(ir::kTypeGiven) && def->infer) {
      auto types = ir::inferResultTypes(*op);
      if (!types) return fail(*op, f, types.status());
      if (types->size() != op->numResults())
        return fail(
            *op, f,
            Status::errorf("'{}' infers {} results but has {}", op->name(), types->size(), op->numResults()));
      for (unsigned i = 0; i < op->numResults(); ++i) {
        ir::Value* r = op->result(i);
        if (r->type().withSharding(std::nullopt) == (*types)[i]) continue;
        // A sharding annotation only survives when the rank it describes does.
        ir::TensorType t = (*types)[i];
        if (r->type().sharding() && r->type().rank() == t.rank()) t = t.withSharding(r->type().sharding());
        r->setType(std::move(t));
        changed = true;
      }
    }
    Status s = ir::verifyOp(*op);
    if (!s) return fail(*op, f, s);
    for (auto& r : op->regions())
      for (auto& blk : r->blocks()) KILN_RETURN_IF_ERROR(inferBlock(*blk, f, changed));
  }
  return Status::ok();
}

}  // namespace

Expected<bool> inferShapes(ir::Function& f) {
  bool changed = false;
  KILN_RETURN_IF_ERROR(inferBlock(f.entry(), f, changed));
  if (ir::Op* ret = f.returnOp()) {
    std::vector<ir::TensorType> types;
    for (ir::Value* v : ret->operands()) types.push_back(v->type());
    if (types != f.resultTypes()) {
      f.setResultTypes(std::move(types));
      changed = true;
    }
  }
  return changed;
}

class ShapeInferencePass : public RegisteredPass<ShapeInferencePass> {
 public:
  KILN_PASS_INFO(ShapeInferencePass)

  Expected<bool> run(ir::Module& m) override {
    bool changed = false;
    for (auto& f : m.functions()) {
      KILN_ASSIGN_OR_RETURN(bool c, inferShapes(*f));
      changed |= c;
    }
    return changed;
  }
};

Expected<std::unique_ptr<Pass>> createShapeInferencePass(const PassContext&, const PassOptions&) {
  return makePass<ShapeInferencePass>();
}

}  // namespace kiln::passes
