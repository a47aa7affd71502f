// The dense optimizer step (kiln.optimizer_update) over f32 parameters, threaded over elements.
// The math is ir/optimizer.h's denseStep, which the reference hook runs too (the optimizer chosen
// once per launch, each element in double), so a step gives the same bits whatever the thread
// count and whichever path ran it.
#include "ir/optimizer.h"
#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

inline double loadScalar(const ir::TensorView& v) {
  return v.dtype == ir::DType::f64 ? *v.as<double>() : loadF(v.data, v.dtype, 0);
}

bool supportsOptimizerUpdate(const ir::Op& op) {
  if (!ir::isDenseOptimizer(op.strAttr("kind"))) return false;
  const size_t nstate = ir::denseOptimizerState(op.strAttr("kind"), op.attrs()).size();
  for (size_t i = 0; i < 2 + nstate && i < op.numOperands(); ++i)
    if (op.operand(static_cast<unsigned>(i))->type().dtype() != ir::DType::f32) return false;
  return true;
}

Status runOptimizerUpdate(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                          const std::vector<ir::TensorView*>&, const KernelContext& ctx) {
  const std::string kind = op.strAttr("kind");
  const size_t nstate = ir::denseOptimizerState(kind, op.attrs()).size();
  const size_t s = 2 + nstate;
  if (in.size() < s + 2) return Status::errorf("'{}' ({}): expected {} operands, got {}", op.name(), kind, s + 2, in.size());
  auto h = ir::denseHyper(op, loadScalar(*in[s]), loadScalar(*in[s + 1]), op.boolAttr("scaled") ? loadScalar(*in[s + 2]) : 1.0);
  if (!h) return h.status();
  const int64_t n = in[0]->numel();
  for (size_t i = 1; i < s; ++i)
    if (in[i]->numel() != n)
      return Status::errorf("'{}': operand {} has {} elements, the parameter {}", op.name(), i, in[i]->numel(), n);
  float* p = static_cast<float*>(in[0]->data);
  const float* g = in[1]->as<float>();
  float* s0 = nstate > 0 ? static_cast<float*>(in[2]->data) : nullptr;
  float* s1 = nstate > 1 ? static_cast<float*>(in[3]->data) : nullptr;
  // Memory-bound: chunks of 64K elements keep every thread streaming.
  ctx.pool->parallelFor(n, 1 << 16, [&](int64_t b, int64_t e) { ir::denseStep<float>(*h, b, e, p, g, s0, s1); });
  return Status::ok();
}

}  // namespace

void registerOptimizerKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::OptimizerUpdate,
            {"optimizer_update", runOptimizerUpdate, supportsOptimizerUpdate});
}

}  // namespace kiln::runtime::cpu
