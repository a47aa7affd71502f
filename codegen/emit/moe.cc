// The MoE emitter: the ops of docs/moe.md (routing, balancing losses, dispatch, permutation and
// the grouped GEMMs) lowered to the Source kernels of moe_kernels.cc. Each op is a group of its
// own; its shapes and attributes are read here, checked, and baked into the kernels.
#include "codegen/emit/moe.h"

#include "codegen/emit/emitter_registry.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// Largest expert count the kernels hold: a warp-per-token router keeps 32 scores per lane in
// registers, the aux losses use a thread per expert, the dispatch scans the offsets in one block.
constexpr int64_t kMaxExperts = 1024;

Status unsupported(const Op& op, const std::string& what) {
  return Status::errorf("{} on the CUDA backend: {}", opLabel(op), what);
}

// Appends a kernel of moe_kernels.cc with its buffers bound, in order, to group buffers.
Status addKernel(GroupLowering& gl, const Op& op, Kernel k, const std::vector<int>& group_buffers) {
  return gl.addSourceKernel(std::move(k), group_buffers, opLabel(op));
}

int in(GroupLowering& gl, const Value* v) { return gl.groupBuffer(v, false); }
int out(GroupLowering& gl, const Value* v) { return gl.groupBuffer(v, true); }

// The concrete shape of v, which must have `rank` dims.
Expected<std::vector<int64_t>> shapeOfRank(GroupLowering& gl, const Op& op, const Value* v, size_t rank,
                                           const char* what) {
  KILN_ASSIGN_OR_RETURN(auto s, gl.shapeOf(v));
  if (s.size() != rank)
    return unsupported(op, fmt::format("{} must have rank {}, not {}", what, rank, s.size()));
  return s;
}

Status checkDType(const Op& op, const Value* v, DType want, const char* what) {
  if (v->type().dtype() != want)
    return unsupported(op, fmt::format("{} must be {}, not {}", what, ir::dtypeName(want),
                                       ir::dtypeName(v->type().dtype())));
  return Status::ok();
}

Status checkExperts(const Op& op, int64_t experts) {
  if (experts < 1 || experts > kMaxExperts)
    return unsupported(op, fmt::format("needs 1..{} experts, not {}", kMaxExperts, experts));
  return Status::ok();
}

// ---- Selection and routing ----

Status lowerTopk(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  if (xs.empty()) return unsupported(op, "x needs at least one dim");
  DType t = x->type().dtype();
  if (t != DType::f32 && t != DType::bf16) return unsupported(op, "x must be f32 or bf16");
  int64_t axis = op.intAttr("axis", -1), rank = static_cast<int64_t>(xs.size());
  if (axis < 0) axis += rank;
  const int64_t k = op.intAttr("k");
  if (axis < 0 || axis >= rank)
    return unsupported(op, fmt::format("axis {} is out of range", op.intAttr("axis", -1)));
  if (k < 1 || k > xs[static_cast<size_t>(axis)])
    return unsupported(op, fmt::format("k = {} is out of range", k));
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < axis; ++i) outer *= xs[static_cast<size_t>(i)];
  for (int64_t i = axis + 1; i < rank; ++i) inner *= xs[static_cast<size_t>(i)];
  return addKernel(gl, op, topkKernel(t, outer, xs[static_cast<size_t>(axis)], inner, k),
                   {in(gl, x), out(gl, op.result(0)), out(gl, op.result(1))});
}

Expected<RouterShape> routerShape(GroupLowering& gl, const Op& op) {
  RouterShape r;
  KILN_ASSIGN_OR_RETURN(auto ls, shapeOfRank(gl, op, op.operand(0), 2, "logits"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(0), DType::f32, "logits"));
  r.tokens = ls[0];
  r.experts = ls[1];
  KILN_RETURN_IF_ERROR(checkExperts(op, r.experts));
  r.topk = op.intAttr("topk", 1);
  if (r.topk < 1 || r.topk > std::min<int64_t>(32, r.experts))
    return unsupported(op, fmt::format("topk = {} must be in 1..min(32, E)", r.topk));
  const std::string score = op.strAttr("score", "softmax");
  if (score != "softmax" && score != "sigmoid") return unsupported(op, "score must be softmax or sigmoid");
  r.sigmoid = score == "sigmoid";
  r.pre_softmax = op.boolAttr("pre_softmax");
  r.groups = op.intAttr("groups", 1);
  r.group_topk = op.intAttr("group_topk", 1);
  r.scale = op.floatAttr("scale", 1.0);
  if (r.groups < 1 || r.experts % r.groups != 0 || r.group_topk < 1 || r.group_topk > r.groups ||
      r.topk % r.group_topk != 0 || r.topk / r.group_topk > r.experts / r.groups)
    return unsupported(op, fmt::format("groups = {}, group_topk = {} do not divide E = {} and topk = {}",
                                       r.groups, r.group_topk, r.experts, r.topk));
  return r;
}

Status lowerRouter(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(RouterShape r, routerShape(gl, op));
  r.bias = op.numOperands() > 1;
  std::vector<int> bufs{in(gl, op.operand(0))};
  if (r.bias) bufs.push_back(in(gl, op.operand(1)));
  bufs.push_back(out(gl, op.result(0)));
  bufs.push_back(out(gl, op.result(1)));
  return addKernel(gl, op, routerKernel(r), bufs);
}

Status lowerRouterGrad(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(RouterShape r, routerShape(gl, op));
  KILN_ASSIGN_OR_RETURN(auto es, shapeOfRank(gl, op, op.operand(1), 2, "experts"));
  r.topk = es[1];  // the selection recorded, whatever the attribute says
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(1), DType::i32, "experts"));
  return addKernel(
      gl, op, routerGradKernel(r),
      {in(gl, op.operand(0)), in(gl, op.operand(1)), in(gl, op.operand(2)), out(gl, op.result())});
}

// ---- Balancing losses ----

Expected<AuxLossShape> auxShape(GroupLowering& gl, const Op& op) {
  AuxLossShape a;
  KILN_ASSIGN_OR_RETURN(auto ls, shapeOfRank(gl, op, op.operand(0), 2, "logits"));
  KILN_ASSIGN_OR_RETURN(auto es, shapeOfRank(gl, op, op.operand(1), 2, "experts"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(0), DType::f32, "logits"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(1), DType::i32, "experts"));
  a.tokens = ls[0];
  a.experts = ls[1];
  a.topk = es[1];
  KILN_RETURN_IF_ERROR(checkExperts(op, a.experts));
  a.seq_len = op.intAttr("seq_len", 0);
  a.sigmoid = op.strAttr("score", "softmax") == "sigmoid";
  a.coeff = op.floatAttr("coeff", 0.0);
  if (a.tokens < 1) return unsupported(op, "needs at least one token");
  // The global-batch counts come with expert parallelism, which the CUDA backend does not run yet.
  if (op.numOperands() > (op.is(ir::OpCode::MoeAuxLoss) ? 2u : 3u))
    return unsupported(op, "the global-batch counts operand (expert parallelism) is not supported yet");
  if (a.seq_len < 0 || (a.seq_len > 0 && a.tokens % a.seq_len != 0))
    return unsupported(op, fmt::format("seq_len = {} does not divide the {} tokens", a.seq_len, a.tokens));
  return a;
}

int64_t sequences(const AuxLossShape& a) { return a.seq_len > 0 ? a.tokens / a.seq_len : 1; }

Status lowerAuxLoss(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(AuxLossShape a, auxShape(gl, op));
  std::vector<Kernel> ks = auxLossKernels(a);
  const int stats = gl.tempBuffer("moe_aux_stats", DType::f32, 2 * a.tokens);
  const int partial = gl.tempBuffer("moe_aux_partial", DType::f32, sequences(a));
  const int logits = in(gl, op.operand(0));
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[0]), {logits, stats}));
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[1]), {logits, in(gl, op.operand(1)), stats, partial}));
  return addKernel(gl, op, std::move(ks[2]), {partial, out(gl, op.result())});
}

Status lowerAuxLossGrad(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(AuxLossShape a, auxShape(gl, op));
  std::vector<Kernel> ks = auxLossGradKernels(a);
  const int stats = gl.tempBuffer("moe_aux_stats", DType::f32, 2 * a.tokens);
  const int counts = gl.tempBuffer("moe_aux_counts", DType::i32, sequences(a) * a.experts);
  const int logits = in(gl, op.operand(0));
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[0]), {logits, stats}));
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[1]), {in(gl, op.operand(1)), counts}));
  return addKernel(gl, op, std::move(ks[2]),
                   {logits, stats, counts, in(gl, op.operand(2)), out(gl, op.result())});
}

Status lowerZLoss(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(auto ls, shapeOfRank(gl, op, op.operand(0), 2, "logits"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(0), DType::f32, "logits"));
  KILN_RETURN_IF_ERROR(checkExperts(op, ls[1]));
  const double coeff = op.floatAttr("coeff", 0.0);
  if (op.is(ir::OpCode::MoeZLoss))
    return addKernel(gl, op, zLossKernel(ls[0], ls[1], coeff), {in(gl, op.operand(0)), out(gl, op.result())});
  return addKernel(gl, op, zLossGradKernel(ls[0], ls[1], coeff),
                   {in(gl, op.operand(0)), in(gl, op.operand(1)), out(gl, op.result())});
}

// ---- Dispatch ----

Status lowerDispatch(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(auto es, shapeOfRank(gl, op, op.operand(0), 2, "experts"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(0), DType::i32, "experts"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(1), DType::f32, "probs"));
  KILN_ASSIGN_OR_RETURN(auto rs, shapeOfRank(gl, op, op.result(0), 1, "rows"));
  DispatchShape d;
  d.tokens = es[0];
  d.topk = es[1];
  d.experts = op.intAttr("experts");
  KILN_RETURN_IF_ERROR(checkExperts(op, d.experts));
  const double cf = op.floatAttr("capacity_factor", 0.0);
  d.capacity = expertCapacity(d.tokens, d.topk, d.experts, cf);
  d.by_probs = op.strAttr("drop_policy", "probs") != "position";
  d.pad = op.boolAttr("pad_to_capacity");
  d.rows = rs[0];
  if (d.pad && cf <= 0) return unsupported(op, "pad_to_capacity needs capacity_factor > 0");
  const int64_t needed = d.pad ? d.experts * d.capacity : d.capacity > 0 ? 0 : d.tokens * d.topk;
  if (d.rows < needed)
    return unsupported(
        op, fmt::format("rows holds {} rows, fewer than the {} the routing can fill", d.rows, needed));
  std::vector<Kernel> ks = dispatchKernels(d);
  const int experts = in(gl, op.operand(0)), probs = in(gl, op.operand(1));
  const int rows = out(gl, op.result(0)), offsets = out(gl, op.result(1)), counts = out(gl, op.result(2));
  const int plan = gl.tempBuffer("moe_dispatch_plan", DType::i32, 4 * d.experts);
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[0]), {experts, probs, plan}));
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[1]), {plan, offsets, counts, rows}));
  return addKernel(gl, op, std::move(ks[2]), {experts, probs, plan, offsets, rows});
}

Status lowerExpertBiasUpdate(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(auto bs, shapeOfRank(gl, op, op.operand(0), 1, "bias"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(0), DType::f32, "bias"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(1), DType::i32, "counts"));
  // In place, as an optimizer update writes its parameter.
  return addKernel(gl, op, expertBiasUpdateKernel(bs[0], op.floatAttr("rate", 0.0)),
                   {gl.groupBuffer(op.operand(0), true), in(gl, op.operand(1))});
}

// ---- Permutation ----

struct PermuteDims {
  int64_t tokens = 0, hidden = 0, rows = 0, topk = 0;
};

// x: [N, H] (or y: [?R, H]), rows: [?R], probs: [N, k].
Expected<PermuteDims> permuteDims(GroupLowering& gl, const Op& op, const Value* tokens_hidden,
                                  const Value* rows, const Value* probs) {
  KILN_ASSIGN_OR_RETURN(auto xs, shapeOfRank(gl, op, tokens_hidden, 2, "the token rows"));
  KILN_ASSIGN_OR_RETURN(auto rs, shapeOfRank(gl, op, rows, 1, "rows"));
  KILN_ASSIGN_OR_RETURN(auto ps, shapeOfRank(gl, op, probs, 2, "probs"));
  KILN_RETURN_IF_ERROR(checkDType(op, rows, DType::i32, "rows"));
  KILN_RETURN_IF_ERROR(checkDType(op, probs, DType::f32, "probs"));
  DType t = tokens_hidden->type().dtype();
  if (t != DType::f32 && t != DType::bf16) return unsupported(op, "activations must be f32 or bf16");
  return PermuteDims{ps[0], xs[1], rs[0], ps[1]};
}

Status lowerPermute(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(PermuteDims d, permuteDims(gl, op, op.operand(0), op.operand(1), op.operand(2)));
  return addKernel(
      gl, op,
      permuteKernel(op.operand(0)->type().dtype(), d.tokens, d.topk, d.hidden, d.rows,
                    op.boolAttr("apply_probs")),
      {in(gl, op.operand(0)), in(gl, op.operand(1)), in(gl, op.operand(2)), out(gl, op.result())});
}

Status lowerUnpermute(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(PermuteDims d, permuteDims(gl, op, op.operand(0), op.operand(1), op.operand(2)));
  std::vector<Kernel> ks = unpermuteKernels(op.operand(0)->type().dtype(), d.tokens, d.topk, d.hidden, d.rows,
                                            op.boolAttr("apply_probs", true));
  const int slot_row = gl.tempBuffer("moe_slot_row", DType::i32, d.tokens * d.topk);
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[0]), {slot_row}));
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[1]), {in(gl, op.operand(1)), slot_row}));
  return addKernel(gl, op, std::move(ks[2]),
                   {in(gl, op.operand(0)), slot_row, in(gl, op.operand(2)), out(gl, op.result())});
}

Status lowerRowDot(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(PermuteDims d, permuteDims(gl, op, op.operand(0), op.operand(1), op.operand(3)));
  DType b = op.operand(2)->type().dtype();
  if (b != DType::f32 && b != DType::bf16) return unsupported(op, "b must be f32 or bf16");
  std::vector<Kernel> ks =
      rowDotKernels(op.operand(0)->type().dtype(), b, d.tokens, d.topk, d.hidden, d.rows);
  const int result = out(gl, op.result());
  KILN_RETURN_IF_ERROR(addKernel(gl, op, std::move(ks[0]), {result}));
  return addKernel(gl, op, std::move(ks[1]),
                   {in(gl, op.operand(0)), in(gl, op.operand(1)), in(gl, op.operand(2)), result});
}

// ---- Grouped GEMMs ----

Status checkGemmDType(const Op& op, DType t) {
  if (t != DType::f32 && t != DType::bf16)
    return unsupported(
        op, fmt::format("grouped GEMMs run f32 (SIMT) or bf16 (tensor cores), not {}", ir::dtypeName(t)));
  return Status::ok();
}

Status lowerGroupedMatmul(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(auto xs, shapeOfRank(gl, op, op.operand(0), 2, "x"));
  KILN_ASSIGN_OR_RETURN(auto ws, shapeOfRank(gl, op, op.operand(1), 3, "w"));
  KILN_ASSIGN_OR_RETURN(auto os, shapeOfRank(gl, op, op.operand(2), 1, "offsets"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(2), DType::i32, "offsets"));
  GroupedGemmShape s;
  s.dtype = op.operand(0)->type().dtype();
  KILN_RETURN_IF_ERROR(checkGemmDType(op, s.dtype));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(1), s.dtype, "w"));
  s.transpose_b = op.boolAttr("transpose_b");
  s.rows = xs[0];
  s.k = xs[1];
  s.experts = ws[0];
  s.m = s.transpose_b ? ws[1] : ws[2];
  if ((s.transpose_b ? ws[2] : ws[1]) != s.k || os[0] != s.experts + 1)
    return unsupported(op, "x, w and offsets disagree on K or E");
  return addKernel(
      gl, op, groupedMatmulKernel(s),
      {in(gl, op.operand(0)), in(gl, op.operand(1)), in(gl, op.operand(2)), out(gl, op.result())});
}

Status lowerGroupedWgrad(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  KILN_ASSIGN_OR_RETURN(auto xs, shapeOfRank(gl, op, op.operand(0), 2, "x"));
  KILN_ASSIGN_OR_RETURN(auto ds, shapeOfRank(gl, op, op.operand(1), 2, "dy"));
  KILN_ASSIGN_OR_RETURN(auto os, shapeOfRank(gl, op, op.operand(2), 1, "offsets"));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(2), DType::i32, "offsets"));
  WgradShape s;
  s.dtype = op.operand(0)->type().dtype();
  KILN_RETURN_IF_ERROR(checkGemmDType(op, s.dtype));
  KILN_RETURN_IF_ERROR(checkDType(op, op.operand(1), s.dtype, "dy"));
  s.rows = xs[0];
  s.k = xs[1];
  s.m = ds[1];
  s.experts = os[0] - 1;
  s.transpose = op.boolAttr("transpose");
  if (ds[0] != s.rows || s.experts < 1) return unsupported(op, "x, dy and offsets disagree on the rows or E");
  return addKernel(
      gl, op, groupedWgradKernel(s),
      {in(gl, op.operand(0)), in(gl, op.operand(1)), in(gl, op.operand(2)), out(gl, op.result())});
}

// ---- Along-axis gathers and scatters (top-k's gradient) ----

// The axis attribute of op over a rank-`rank` value, made non-negative.
Expected<size_t> alongAxis(const Op& op, size_t rank) {
  int64_t axis = op.intAttr("axis", -1);
  if (axis < 0) axis += static_cast<int64_t>(rank);
  if (axis < 0 || axis >= static_cast<int64_t>(rank))
    return unsupported(op, fmt::format("axis {} is out of range for rank {}", op.intAttr("axis", -1), rank));
  return static_cast<size_t>(axis);
}

// The index of idx at coords as i64, and whether it lies in [0, n).
std::pair<int, int> checkedIndex(ExprGraph& g, int index, int64_t n) {
  int id = g.cast(index, DType::i64);
  int ok = g.binary(ExprOp::And, g.binary(ExprOp::Ge, id, g.intConstant(0)),
                    g.binary(ExprOp::Lt, id, g.intConstant(n)));
  return {id, ok};
}

// out[..., j, ...] = x[..., idx[..., j, ...], ...]: one Pointwise kernel over out. An index out
// of range reads 0 here (the CPU reference reports it), as scatter_add's do.
Status lowerTakeAlongAxis(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  const Value* idx = op.operand(1);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  KILN_ASSIGN_OR_RETURN(auto os, gl.shapeOf(op.result()));
  KILN_ASSIGN_OR_RETURN(size_t axis, alongAxis(op, xs.size()));
  DType t = op.result()->type().dtype();
  KernelBuilder kb = KernelBuilder::pointwise("take_along_axis", os);
  ExprGraph& g = kb.g();
  std::vector<int> coords = kb.spaceCoords();
  KILN_ASSIGN_OR_RETURN(int iv, gl.valueAt(kb, idx, coords));
  auto [id, ok] = checkedIndex(g, iv, xs[axis]);
  std::vector<int> xc = coords;
  xc[axis] = g.select(ok, id, g.intConstant(0));
  KILN_ASSIGN_OR_RETURN(int v, gl.valueAt(kb, x, xc));
  v = g.cast(v, computeType(t));
  const int zero = ir::isFloat(t) ? g.constant(0.0, computeType(t)) : g.intConstant(0, computeType(t));
  kb.k.stores.push_back({gl.bind(kb, gl.groupBuffer(op.result(), true), true), rowMajorOffset(g, coords, os),
                         g.select(ok, v, zero), -1});
  return gl.finish(kb);
}

// zeros of [..., size, ...] with g[..., j, ...] added at idx[..., j, ...] along axis: a zeroing
// kernel, then one atomic add per element of g (repeated indices add; out-of-range ones add
// nothing here, the CPU reference reports them).
Status lowerScatterAlongAxis(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* upd = op.operand(0);
  const Value* idx = op.operand(1);
  KILN_ASSIGN_OR_RETURN(auto us, gl.shapeOf(upd));
  KILN_ASSIGN_OR_RETURN(auto os, gl.shapeOf(op.result()));
  KILN_ASSIGN_OR_RETURN(size_t axis, alongAxis(op, os.size()));
  DType t = op.result()->type().dtype();
  if (!ir::isFloat(t) || t == DType::f16) return unsupported(op, "the result must be f32, f64 or bf16");
  const int out_buffer = gl.groupBuffer(op.result(), true);
  {
    KernelBuilder kb = KernelBuilder::pointwise("scatter_along_axis_init", os);
    ExprGraph& g = kb.g();
    std::vector<int> coords = kb.spaceCoords();
    kb.k.stores.push_back(
        {gl.bind(kb, out_buffer, true), rowMajorOffset(g, coords, os), g.constant(0.0, computeType(t)), -1});
    KILN_RETURN_IF_ERROR(gl.finish(kb));
  }
  KernelBuilder kb = KernelBuilder::pointwise("scatter_along_axis", us);
  ExprGraph& g = kb.g();
  std::vector<int> coords = kb.spaceCoords();
  KILN_ASSIGN_OR_RETURN(int iv, gl.valueAt(kb, idx, coords));
  auto [id, ok] = checkedIndex(g, iv, os[axis]);
  std::vector<int> oc = coords;
  oc[axis] = id;
  KILN_ASSIGN_OR_RETURN(int v, gl.valueAt(kb, upd, coords));
  Store st{gl.bind(kb, out_buffer, true), rowMajorOffset(g, oc, os), g.cast(v, computeType(t)), ok};
  st.accumulate = true;
  kb.k.stores.push_back(st);
  return gl.finish(kb);
}

}  // namespace

void registerMoeEmitters(EmitterRegistry& r) {
  using ir::OpCode;
  r.addOpEmitter(OpCode::TopK, {"moe", lowerTopk});
  r.addOpEmitter(OpCode::TakeAlongAxis, {"moe", lowerTakeAlongAxis});
  r.addOpEmitter(OpCode::ScatterAlongAxis, {"moe", lowerScatterAlongAxis});
  r.addOpEmitter(OpCode::MoeRouter, {"moe", lowerRouter});
  r.addOpEmitter(OpCode::MoeRouterGrad, {"moe", lowerRouterGrad});
  r.addOpEmitter(OpCode::MoeAuxLoss, {"moe", lowerAuxLoss});
  r.addOpEmitter(OpCode::MoeAuxLossGrad, {"moe", lowerAuxLossGrad});
  r.addOpEmitter(OpCode::MoeZLoss, {"moe", lowerZLoss});
  r.addOpEmitter(OpCode::MoeZLossGrad, {"moe", lowerZLoss});
  r.addOpEmitter(OpCode::MoeDispatch, {"moe", lowerDispatch});
  r.addOpEmitter(OpCode::MoeExpertBiasUpdate, {"moe", lowerExpertBiasUpdate});
  r.addOpEmitter(OpCode::MoePermute, {"moe", lowerPermute});
  r.addOpEmitter(OpCode::MoeUnpermute, {"moe", lowerUnpermute});
  r.addOpEmitter(OpCode::MoeRowDot, {"moe", lowerRowDot});
  r.addOpEmitter(OpCode::GroupedMatmul, {"moe", lowerGroupedMatmul});
  r.addOpEmitter(OpCode::GroupedMatmulWgrad, {"moe", lowerGroupedWgrad});
}

}  // namespace kiln::codegen::emit
