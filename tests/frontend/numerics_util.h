// Helpers shared by the frontend's numerics tests (transformer_numerics_test.cc,
// sequence_grad_test.cc), which check compiled models against loops written in the tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "ir/tensor_view.h"

namespace kiln::frontend::testing {

// An f32 tensor of random values; `values` gets them as stored (rounded to f32), so the loops
// of a test compute on exactly what the interpreter reads.
inline ir::HostTensor randomF32(const std::vector<int64_t>& shape, std::mt19937& rng, double scale,
                                std::vector<double>& values) {
  ir::HostTensor t(ir::DType::f32, shape);
  std::normal_distribution<double> n(0.0, scale);
  values.resize(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.as<float>()[i] = static_cast<float>(n(rng));
    values[static_cast<size_t>(i)] = t.as<float>()[i];
  }
  return t;
}

}  // namespace kiln::frontend::testing
