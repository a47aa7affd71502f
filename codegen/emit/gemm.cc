// The GEMM emitter: a kiln.matmul, alone or with the epilogue of a fused `gemm_epilogue` group,
// as ONE cuBLASLt call (LoweredGroup::gemm); it emits no kernels.
#include "codegen/emit/emitter_registry.h"
#include "ir/op_def.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// A matmul, optionally with its epilogue (bias add, then relu or gelu, then an output cast),
// as ONE cuBLASLt call. Only what cuBLASLt computes as the ops do is accepted, with one
// allowance (XLA's "excess precision"): a bf16 or f16 product that the group at once widens
// back to f32 (mixed precision's `cast(matmul(bf16, bf16), f32)`) is taken from cuBLASLt's f32
// accumulator without the rounding in between, so bias and activation run in cuBLASLt's f32
// epilogue and only the result is stored. The CPU rounds there; the results differ by at most
// that rounding.
Status lowerGemm(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& mm = *ops.front();
  if (!mm.is(ir::OpCode::Matmul))
    return Status::errorf("a GEMM group starts with {}, not kiln.matmul", opLabel(mm));
  GemmCall call;
  const Value* cur = mm.result();
  const Value* bias = nullptr;
  // The group's ops after the matmul, less a widening cast right after a low-precision
  // product (taken as the accumulator's own f32).
  size_t first = 1;
  DType tm = mm.result()->type().dtype();
  if (ops.size() > 1 && ir::isWideningCast(mm, *ops[1])) {
    for (const ir::Use& u : cur->uses())
      if (u.user != ops[1])
        return Status::errorf("{} has another user; cuBLASLt writes only the epilogue's final result",
                              opLabel(mm));
    cur = ops[1]->result();
    tm = DType::f32;
    first = 2;
  }
  for (size_t i = first; i < ops.size(); ++i) {
    const Op& e = *ops[i];
    bool consumes =
        e.numOperands() > 0 && (e.operand(0) == cur || (e.numOperands() > 1 && e.operand(1) == cur));
    if (!consumes) return Status::errorf("{} does not consume the GEMM's result", opLabel(e));
    for (const ir::Use& u : cur->uses())
      if (u.user != &e)
        return Status::errorf("{} has another user; cuBLASLt writes only the epilogue's final result",
                              opLabel(*ops[i - 1]));
    if (i > first && ops[i - 1]->is(ir::OpCode::Cast))
      return Status::errorf("{} follows the output cast", opLabel(e));
    if (e.is(ir::OpCode::Add) && i == first && e.numOperands() == 2) {
      bias = e.operand(0) == cur ? e.operand(1) : e.operand(0);
      if (bias->type().rank() != 1)
        return Status::errorf("{} adds {}, not a bias vector", opLabel(e), bias->type().str());
    } else if ((e.is(ir::OpCode::Relu) || e.is(ir::OpCode::Gelu)) && call.activation.empty()) {
      call.activation = shortOpName(e);
    } else if (e.is(ir::OpCode::Cast)) {
    } else {
      return Status::errorf("{} has no cuBLASLt epilogue (a bias add, then relu or gelu, then a cast)",
                            opLabel(e));
    }
    cur = e.result();
  }
  DType ta = mm.operand(0)->type().dtype(), tb = mm.operand(1)->type().dtype();
  DType tc = cur->type().dtype();
  if (ta != tb || (ta != DType::f32 && ta != DType::bf16 && ta != DType::f16))
    return Status::errorf("{}: cuBLASLt multiplies f32, bf16 or f16 pairs, not {} x {}", opLabel(mm),
                          ir::dtypeName(ta), ir::dtypeName(tb));
  if (ops.size() > 1) {
    if (ta == DType::f32 && tc != DType::f32)
      return Status::errorf("{}: cuBLASLt has no f32 x f32 -> {} GEMM", opLabel(mm), ir::dtypeName(tc));
    if (tc != DType::f32 && tc != ta)
      return Status::errorf("{}: cuBLASLt has no {} x {} -> {} GEMM", opLabel(mm), ir::dtypeName(ta),
                            ir::dtypeName(ta), ir::dtypeName(tc));
    if (tm != DType::f32 && tc == DType::f32)  // widened after a bias or activation: not exact
      return Status::errorf("{}: the epilogue widens a {} product; cuBLASLt would skip its rounding",
                            opLabel(mm), ir::dtypeName(tm));
    if (bias && bias->type().dtype() != tc)
      return Status::errorf("{}: a {} bias on a {} output; cuBLASLt's bias has the output's type",
                            opLabel(mm), ir::dtypeName(bias->type().dtype()), ir::dtypeName(tc));
  }
  call.a = gl.groupBuffer(mm.operand(0), false);
  call.b = gl.groupBuffer(mm.operand(1), false);
  if (bias) call.bias = gl.groupBuffer(bias, false);
  call.c = gl.groupBuffer(cur, true);
  gl.setGemm(mm, call);
  return Status::ok();
}

}  // namespace

void registerGemmEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::Matmul, {"gemm", lowerGemm});
  r.addFusedEmitter("gemm_epilogue", lowerGemm);
}

}  // namespace kiln::codegen::emit
