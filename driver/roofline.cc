#include "driver/roofline.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "codegen/kernel_lowering.h"
#include "ir/ops/kernel_util.h"
#include "ir/precision.h"
#include "passes/cost_model.h"

namespace kiln::driver {
namespace {

bool anyOf(const std::vector<const ir::Op*>& ops, std::initializer_list<ir::OpCode> codes) {
  for (const ir::Op* op : ops)
    for (ir::OpCode c : codes)
      if (op->is(c)) return true;
  return false;
}

// What a lowered group is, as a performance engineer reads a profile: the GEMMs by input type
// (f32 inputs in TF32 or exact f32), then the kernel families whose fixes differ (embedding forward and backward, the MoE's routing
// and grouped GEMMs, reductions, collectives), the rest elementwise or data movement.
std::string kernelClass(const codegen::LoweredGroup& g) {
  using ir::OpCode;
  if (g.gemm)
    return FlopRates::narrow(g.gemm->operand(0)->type().dtype()) ? "gemm bf16"
           : ir::allowsTf32(*g.gemm)                              ? "gemm tf32"
                                                                  : "gemm f32";
  const auto& ops = g.ops;
  if (anyOf(ops, {OpCode::GroupedMatmul, OpCode::GroupedMatmulWgrad})) return "grouped gemm";
  if (anyOf(ops, {OpCode::EmbeddingBagWeightGrad, OpCode::EmbeddingBagUpdate, OpCode::EmbeddingBagDenseGrad,
                  OpCode::EmbeddingBagGradSqnorm}))
    return "embedding backward";
  if (anyOf(ops, {OpCode::EmbeddingBag, OpCode::JaggedToPadded})) return "embedding lookup";
  if (anyOf(ops, {OpCode::OptimizerUpdate})) return "dense optimizer";
  if (anyOf(ops, {OpCode::AllReduce, OpCode::ReduceScatter, OpCode::AllGather, OpCode::AllToAll, OpCode::AllToAllV}))
    return "collective";
  if (anyOf(ops, {OpCode::MoeRouter, OpCode::MoeRouterGrad, OpCode::MoeDispatch, OpCode::MoePermute,
                  OpCode::MoeUnpermute, OpCode::MoeRowDot, OpCode::MoeRouteCounts, OpCode::MoeEpSplit,
                  OpCode::MoeSortChunks, OpCode::MoeChunkOffsets, OpCode::MoeAuxLoss, OpCode::MoeAuxLossGrad,
                  OpCode::MoeZLoss, OpCode::MoeZLossGrad, OpCode::MoeExpertBiasUpdate, OpCode::TopK,
                  OpCode::TakeAlongAxis, OpCode::ScatterAlongAxis}))
    return "moe routing";
  if (anyOf(ops, {OpCode::Reduce, OpCode::ReduceGrad, OpCode::SumTo, OpCode::Softmax, OpCode::BceWithLogits,
                  OpCode::BceWithLogitsGrad, OpCode::SoftmaxCrossEntropy, OpCode::SoftmaxCrossEntropyGrad,
                  OpCode::ScatterAdd}))
    return "reduction";
  return "elementwise";
}

std::string megabytes(double b) { return fmt::format("{:.1f}", b / 1e6); }

}  // namespace

Expected<Roofline> estimateRoofline(const ir::Function& f, int64_t batch, const Target& target) {
  const ir::SymbolBindings symbols{{"B", batch}};
  KILN_ASSIGN_OR_RETURN(auto groups, codegen::lowerFunction(f, symbols, target));
  passes::CostModel cost(target, symbols);
  Roofline r;
  r.function = f.name();
  r.batch = batch;
  r.target = target;
  std::map<std::string, KernelClassCost> by_kind;
  for (const codegen::LoweredGroup& g : groups) {
    passes::GroupCost c = cost.groupCost(g.ops);
    // A GEMM reads only the buffers its call names: a bias gradient's sum_to may read the f32
    // value the GEMM's bf16 operand was narrowed from, which cuBLASLt never touches.
    if (g.gemm) {
      std::set<const ir::Value*> bound, unbound;
      for (const codegen::GroupBuffer& b : g.buffers) bound.insert(b.value);
      for (const ir::Op* op : g.ops)
        for (const ir::Value* v : op->operands()) {
          const ir::Value* outer = codegen::outerValue(v);
          const ir::Op* d = v->definingOp();
          if (!(d && std::find(g.ops.begin(), g.ops.end(), d) != g.ops.end()) && !bound.count(outer))
            unbound.insert(outer);
        }
      for (const ir::Value* v : unbound) c.bytes -= ir::kernels::typeBytes(v->type(), symbols);
    }
    // The expert GEMMs run at the GEMM rate too (the cost model's groupCost counts kiln.matmul's
    // flops alone as GEMM flops); Kiln's grouped GEMM kernels have no TF32 path, so f32 experts
    // run at the f32 rate.
    for (const ir::Op* op : g.ops)
      if (op->is(ir::OpCode::GroupedMatmul) || op->is(ir::OpCode::GroupedMatmulWgrad)) {
        const double flops = op->def()->cost(*op, symbols).flops;
        c.gemm_flops += flops;
        if (!FlopRates::narrow(op->operand(0)->type().dtype())) c.f32_gemm_flops += flops;
      }
    c.launches = 0;
    const std::string kind = kernelClass(g);
    // A reduction's temporaries (the partials of a fold cut into pieces, codegen/emit/
    // reduction.cc; softmax cross-entropy's row losses) are written by one kernel and read back
    // by the next: bytes the ops' own count does not have.
    if (kind == "reduction")
      for (const codegen::GroupBuffer& b : g.buffers)
        if (!b.value) c.bytes += 2.0 * static_cast<double>(b.elements) * ir::dtypeBytes(b.dtype);
    const double seconds = cost.time(c);
    const bool memory_bound = c.bytes / target.bytes_per_s >= seconds;
    KernelClassCost& k = by_kind[kind];
    k.kind = kind;
    k.groups += 1;
    k.launches += g.gemm ? 1 : static_cast<int>(g.kernels.size());
    k.bytes += c.bytes;
    k.flops += c.flops;
    k.roofline_s += seconds;
    if (memory_bound) k.memory_bound_s += seconds;
  }
  r.total.kind = "total";
  for (auto& [kind, k] : by_kind) {
    k.launch_s = k.launches * target.launch_s;
    r.classes.push_back(k);
    r.total.groups += k.groups;
    r.total.launches += k.launches;
    r.total.bytes += k.bytes;
    r.total.flops += k.flops;
    r.total.roofline_s += k.roofline_s;
    r.total.memory_bound_s += k.memory_bound_s;
    r.total.launch_s += k.launch_s;
  }
  std::stable_sort(r.classes.begin(), r.classes.end(), [](const KernelClassCost& a, const KernelClassCost& b) {
    return a.roofline_s + a.launch_s > b.roofline_s + b.launch_s;
  });
  return r;
}

std::string formatRoofline(const Roofline& r) {
  const Target& t = r.target;
  std::string out = fmt::format(
      "roofline @{} at B = {} on {}: {:.2f} TB/s, GEMMs {:.0f} TFLOP/s bf16, {:.0f} tf32 and {:.0f} f32, other "
      "math {:.0f} TFLOP/s, {:.1f} us a launch\n",
      r.function, r.batch, t.name, t.bytes_per_s / 1e12, t.gemm_flops_per_s.bf16 / 1e12,
      t.gemm_flops_per_s.tf32 / 1e12, t.gemm_flops_per_s.f32 / 1e12, t.vector_flops_per_s.f32 / 1e12,
      t.launch_s * 1e6);
  out += fmt::format("  {:<20} {:>8} {:>10} {:>12} {:>12} {:>10} {:>8}\n", "class", "launches", "MB", "GFLOP",
                     "roofline ms", "launch ms", "memory");
  auto row = [&](const KernelClassCost& k) {
    const double memory_share = k.roofline_s > 0 ? k.memory_bound_s / k.roofline_s : 0;
    out += fmt::format("  {:<20} {:>8} {:>10} {:>12.2f} {:>12.3f} {:>10.3f} {:>7.0f}%\n", k.kind, k.launches,
                       megabytes(k.bytes), k.flops / 1e9, k.roofline_s * 1e3, k.launch_s * 1e3, 100 * memory_share);
  };
  for (const KernelClassCost& k : r.classes) row(k);
  row(r.total);
  out += fmt::format("roofline_ms: {:.3f}\n", r.total.roofline_s * 1e3);
  out += fmt::format("estimate_ms: {:.3f}\n", (r.total.roofline_s + r.total.launch_s) * 1e3);
  out += fmt::format("launches: {}\n", r.total.launches);
  return out;
}

}  // namespace kiln::driver
