// Mixed precision (`kiln.train.precision = "bf16"`): every f32 kiln.matmul (and
// kiln.grouped_matmul) of @forward becomes
//   cast(matmul(cast(a, bf16), cast(b, bf16)), f32)
// so GEMM inputs and outputs are stored in bf16 while the product accumulates in f32 (the CPU
// reference and cuBLASLt both accumulate bf16 GEMMs in f32). Everything else stays f32:
// parameters (the master weights), embedding tables and pooled embeddings, elementwise ops,
// losses, and the optimizer state. Run before autodiff, the backward pass follows the casts: the
// matmul gradients are computed in bf16 and cast back, so parameters receive f32 gradients.
// With precision "f32" (or none) or "f32_strict" the pass changes nothing (ir/precision.h: whether
// a GPU runs an f32 GEMM in TF32 is decided where its cuBLASLt call is made).
#include <string>
#include <vector>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/precision.h"
#include "passes/mixed_precision.h"
#include "passes/pass_registry.h"

namespace kiln::passes {
namespace {

Expected<ir::Value*> castTo(ir::Builder& b, ir::Value* v, ir::DType t) {
  return b.createValue(ir::OpCode::Cast, {v}, {{"to", std::string(ir::dtypeName(t))}});
}

}  // namespace

// Rewrites the f32 matmuls and grouped matmuls of `f` to bf16 storage (a MoE router's logits
// GEMM, marked `kiln.precision = "f32"`, stays f32: routing is computed in f32); returns whether
// anything changed.
Expected<bool> castMatmulsToBf16(ir::Function& f) {
  bool changed = false;
  for (ir::Op* op : f.entry().opList()) {
    if (!op->isAnyOf(ir::OpCode::Matmul, ir::OpCode::GroupedMatmul) ||
        op->operand(0)->type().dtype() != ir::DType::f32 || op->strAttr("kiln.precision") == "f32")
      continue;
    ir::Builder b;
    b.setInsertionPoint(op);
    b.setLocation(op->location());
    auto a16 = castTo(b, op->operand(0), ir::DType::bf16);
    if (!a16) return a16.status();
    auto w16 = castTo(b, op->operand(1), ir::DType::bf16);
    if (!w16) return w16.status();
    std::vector<ir::Value*> operands{*a16, *w16};
    if (op->is(ir::OpCode::GroupedMatmul)) operands.push_back(op->operand(2));  // the expert offsets
    auto y16 = b.createValue(op->opcode(), operands, op->attrs());
    if (!y16) return y16.status();
    auto y = castTo(b, *y16, ir::DType::f32);
    if (!y) return y.status();
    (*y)->setNameHint(op->result()->nameHint());
    op->result()->replaceAllUsesWith(*y);
    f.entry().erase(op);
    changed = true;
  }
  return changed;
}

class MixedPrecisionPass : public RegisteredPass<MixedPrecisionPass> {
 public:
  KILN_PASS_INFO(MixedPrecisionPass)

  Expected<bool> run(ir::Module& m) override {
    const std::string precision(ir::gemmPrecision(m));
    if (precision == "f32" || precision == "f32_strict") return false;  // TF32 or not is the GPU's GEMM call
    if (precision != "bf16")
      return Status::errorf("kiln.train: unknown precision '{}'; expected one of {}", precision,
                            ir::gemmPrecisionNames());
    ir::Function* forward = m.lookup("forward");
    if (!forward) return Status::error("mixed-precision: the module has no @forward function");
    return castMatmulsToBf16(*forward);
  }
};

Expected<std::unique_ptr<Pass>> createMixedPrecisionPass(const PassContext&, const PassOptions&) {
  return makePass<MixedPrecisionPass>();
}

}  // namespace kiln::passes
