// The GEMM emitter: a kiln.matmul, alone or with the epilogue of a fused `gemm_epilogue` group
// (a bias add, activation and cast after it, a bias gradient beside it, or an activation's
// backward after it), as ONE cuBLASLt call (LoweredGroup::gemm); it emits no kernels.
#include "codegen/emit/emitter_registry.h"
#include "ir/op_def.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// A matmul, optionally with its epilogue (bias add, then relu or gelu, then an output cast),
// as ONE cuBLASLt call. Before the activation the epilogue may also add a matrix of the output's
// type: cuBLASLt's C with beta = 1, so D = act(A B + C + bias) reads C where a kernel of its own
// would read the product back (a residual connection, or a gradient summed over two paths).
// Only what cuBLASLt computes as the ops do is accepted, with two allowances. One is XLA's
// "excess precision": a bf16 or f16 product that the group at once widens back to f32 (mixed
// precision's `cast(matmul(bf16, bf16), f32)`) is taken from cuBLASLt's f32 accumulator without
// the rounding in between, so bias and activation run in cuBLASLt's f32 epilogue and only the
// result is stored. The CPU rounds there; the results differ by at most that rounding.
//
// A kiln.sum_to in the group (the fusion pass's bias-gradient sibling, passes/fusion.cc) is the
// bias gradient cuBLASLt writes beside a weight gradient: it must fold the leading dim K of an
// operand stored [K, X] (A with transpose_a, B without transpose_b) to [X]. It reads that operand
// or the f32 value the operand was narrowed from (mixed precision's cast to bf16 for the GEMM):
// cuBLASLt then sums the bf16 values it multiplies, as a bf16 backward does, where the CPU sums
// their f32 originals; they differ by at most the rounding of each term (the other allowance).
Status biasGradientOf(const Op& mm, const Op& sum, GemmCall& call) {
  // Values as outside the fused region: a region's arguments stand for the fused op's operands.
  const Value* g = outerValue(sum.operand(0));
  auto reads = [&](unsigned i) {
    const Value* v = outerValue(mm.operand(i));
    if (v == g) return true;
    const Op* d = v->definingOp();
    return d && d->is(ir::OpCode::Cast) && d->operand(0) == g && g->type().dtype() == DType::f32 &&
           (v->type().dtype() == DType::bf16 || v->type().dtype() == DType::f16);
  };
  const ir::TensorType& gt = g->type();
  const ir::TensorType& st = sum.result()->type();
  if (gt.rank() != 2 || st.rank() != 1 || !(st.dim(0) == gt.dim(1)))
    return Status::errorf("{} folds {} to {}: a bias gradient folds the leading dim of a matrix",
                          opLabel(sum), gt.str(), st.str());
  if (mm.operand(0)->type().rank() != 2 || mm.operand(1)->type().rank() != 2)
    return Status::errorf("{}: a bias gradient needs an unbatched GEMM", opLabel(mm));
  if (reads(0) && mm.boolAttr("transpose_a"))
    call.bias_gradient_of = 'a';
  else if (reads(1) && !mm.boolAttr("transpose_b"))
    call.bias_gradient_of = 'b';
  else
    return Status::errorf(
        "{} does not fold the K dim of an operand of {} (A stored [K, M] or B stored [K, N])", opLabel(sum),
        opLabel(mm));
  return Status::ok();
}

// A kiln.activation_grad of relu or gelu right after the product (its dy) is cuBLASLt's DRELU or
// DGELU epilogue, which reads the derivative's argument through the aux pointer: the GELU input
// itself, or the bit mask the ReLU's own GEMM wrote beside its output (RELU_AUX; that ReLU carries
// attribute kiln.relu_mask, and codegen/cuda_program.cc checks the pairing). Both are exact: the
// mask is x > 0 at the stored output, which is where the CPU's derivative of relu is 1.
Status lowerGemm(GroupLowering& gl, const std::vector<const Op*>& all) {
  // The bias-gradient sum_to runs beside the GEMM, not after it: set it apart.
  std::vector<const Op*> ops;
  const Op* sum = nullptr;
  for (const Op* op : all) {
    if (!op->is(ir::OpCode::SumTo)) {
      ops.push_back(op);
    } else if (sum) {
      return Status::errorf("{}: a GEMM writes one bias gradient", opLabel(*op));
    } else {
      sum = op;
    }
  }
  if (ops.empty() || !ops.front()->is(ir::OpCode::Matmul))
    return Status::errorf("a GEMM group starts with {}, not kiln.matmul",
                          opLabel(ops.empty() ? *sum : *ops.front()));
  const Op& mm = *ops.front();
  GemmCall call;
  if (sum) KILN_RETURN_IF_ERROR(biasGradientOf(mm, *sum, call));
  const Value* cur = mm.result();
  const Value* bias = nullptr;
  const Value* aux = nullptr;
  const Value* residual = nullptr;
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
    if (e.is(ir::OpCode::Add) && e.numOperands() == 2 && (i == first || ops[i - 1]->is(ir::OpCode::Add))) {
      // Before the activation: a bias vector, and a matrix of the result's type (C, beta = 1).
      const Value* other = e.operand(0) == cur ? e.operand(1) : e.operand(0);
      if (other->type().rank() == 1 && !bias) {
        bias = other;
      } else if (other->type() == e.result()->type() && other != cur && !residual) {
        residual = other;
      } else {
        return Status::errorf("{} adds {}: an epilogue adds one bias vector and one matrix of the product's type",
                              opLabel(e), other->type().str());
      }
    } else if ((e.is(ir::OpCode::Relu) || e.is(ir::OpCode::Gelu)) && call.activation.empty() &&
               call.activation_grad.empty()) {
      call.activation = shortOpName(e);
      call.writes_relu_mask = e.is(ir::OpCode::Relu) && e.boolAttr("kiln.relu_mask");
    } else if (e.is(ir::OpCode::ActivationGrad) && i == first && e.operand(1) == cur && e.operand(0) != cur) {
      // dy * f'(aux): the product is dy; aux is the ReLU's output (whose buffer carries the
      // mask its forward GEMM wrote) or the GELU's input.
      call.activation_grad = e.strAttr("activation");
      if (call.activation_grad != "relu" && call.activation_grad != "gelu")
        return Status::errorf("{}: cuBLASLt has no {} backward epilogue (relu and gelu only)", opLabel(e),
                              call.activation_grad);
      aux = e.operand(0);
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
  if (!call.activation_grad.empty() && ops.size() != first + 1)
    return Status::errorf("{}: an activation backward epilogue ends the group", opLabel(mm));
  if (call.activation_grad == "gelu" && aux->type().dtype() != tc)
    return Status::errorf("{}: a {} GELU input for a {} output; cuBLASLt reads it in the output's type",
                          opLabel(mm), ir::dtypeName(aux->type().dtype()), ir::dtypeName(tc));
  if (sum && (bias || !call.activation.empty() || !call.activation_grad.empty()))
    return Status::errorf("{}: cuBLASLt's bias gradient epilogue takes no bias or activation", opLabel(mm));
  if (residual && (sum || mm.operand(0)->type().rank() != 2 || mm.operand(1)->type().rank() != 2))
    return Status::errorf("{}: cuBLASLt adds C to an unbatched product without a bias gradient", opLabel(mm));
  if (residual && residual->type().dtype() != tc)
    return Status::errorf("{}: a {} matrix added to a {} output; cuBLASLt's C has the output's type", opLabel(mm),
                          ir::dtypeName(residual->type().dtype()), ir::dtypeName(tc));
  if (sum && sum->result()->type().dtype() != tc)
    return Status::errorf("{}: a {} bias gradient of a {} GEMM; cuBLASLt's has the output's type",
                          opLabel(*sum), ir::dtypeName(sum->result()->type().dtype()), ir::dtypeName(tc));
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
  if (sum) call.bias = gl.groupBuffer(sum->result(), true);
  if (aux) call.aux = gl.groupBuffer(aux, false);
  if (residual) call.residual = gl.groupBuffer(residual, false);
  gl.setGemm(mm, call);
  return Status::ok();
}

}  // namespace

void registerGemmEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::Matmul, {"gemm", lowerGemm});
  r.addFusedEmitter("gemm_epilogue", lowerGemm);
}

}  // namespace kiln::codegen::emit
