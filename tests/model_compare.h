// Comparing a model's tensors computed by a backend under test (the GPU, the generated CUDA on
// the host) with the CPU executor's, shared by gpu_model_test and simt_model_test.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "ir/tensor_view.h"

namespace kiln::testing {

inline double valueAt(const ir::HostTensor& t, int64_t i) {
  switch (t.view.dtype) {
    case ir::DType::bf16: return ir::bf16ToFloat(t.as<uint16_t>()[i]);
    case ir::DType::f64: return t.as<double>()[i];
    default: return t.as<float>()[i];
  }
}

// Elements of `got` off by more than `tol` relative to `want` (|got - want| / (1e-3 + |want|);
// a NaN on either side is off), and the worst of them.
//
// Tests bound the fraction that is off rather than the worst element: Adagrad's first step
// moves a weight by about lr * g / |g|, so where a gradient sums to nearly zero, rounding in a
// different order moves that weight differently. Such elements are a handful per million; a
// bug (a wrong index, a missed update) shifts whole rows.
struct TensorDiff {
  int64_t off = 0, total = 0;
  double worst = 0;
  int64_t worst_at = -1;
  double got_at_worst = 0, want_at_worst = 0;
  std::string str() const {
    return fmt::format("{} of {} elements off; worst [{}]: {} vs {} (relative {:.3g})", off, total, worst_at,
                       got_at_worst, want_at_worst, worst);
  }
};

inline TensorDiff compareTensors(const ir::HostTensor& got, const ir::HostTensor& want, double tol) {
  TensorDiff d;
  d.total = want.numel();
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = valueAt(got, i), w = valueAt(want, i);
    double rel = std::fabs(g - w) / (1e-3 + std::fabs(w));
    if (std::isnan(rel)) rel = std::isnan(g) && std::isnan(w) ? 0 : INFINITY;
    if (rel > tol) ++d.off;
    if (rel > d.worst || d.worst_at < 0) {
      d.worst = rel;
      d.worst_at = i;
      d.got_at_worst = g;
      d.want_at_worst = w;
    }
  }
  return d;
}

// The tolerance of a parameter or optimizer state after a few steps, by its storage type.
inline double stateTolerance(ir::DType t) { return t == ir::DType::bf16 ? 2e-2 : 2e-3; }

}  // namespace kiln::testing
