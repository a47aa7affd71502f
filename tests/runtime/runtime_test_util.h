// Helpers for the runtime tests: IR from text, seeded random tensors, element access.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/parser.h"
#include "ir/tensor_view.h"

namespace kiln::runtime::testing {

inline std::unique_ptr<ir::Module> parseOrDie(const std::string& text) {
  auto m = ir::parseModule(text, "<test>");
  EXPECT_TRUE(m.isOk()) << (m.isOk() ? "" : m.status().str());
  return m.isOk() ? m.take() : nullptr;
}

// Uniform in [lo, hi) for floats; integers in [lo, hi).
inline ir::HostTensor randomTensor(ir::DType t, std::vector<int64_t> shape, uint32_t seed, double lo = -1,
                                   double hi = 1) {
  ir::HostTensor x(t, std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t i = 0; i < x.numel(); ++i) {
    double v = u(gen);
    switch (t) {
      case ir::DType::f32: x.as<float>()[i] = static_cast<float>(v); break;
      case ir::DType::f64: x.as<double>()[i] = v; break;
      case ir::DType::bf16: x.as<uint16_t>()[i] = ir::floatToBf16(static_cast<float>(v)); break;
      case ir::DType::i32: x.as<int32_t>()[i] = static_cast<int32_t>(std::floor(v)); break;
      case ir::DType::i64: x.as<int64_t>()[i] = static_cast<int64_t>(std::floor(v)); break;
      default: ADD_FAILURE() << "randomTensor: unsupported dtype";
    }
  }
  return x;
}

inline double at(const ir::HostTensor& t, int64_t i) {
  switch (t.view.dtype) {
    case ir::DType::f32: return t.as<float>()[i];
    case ir::DType::f64: return t.as<double>()[i];
    case ir::DType::bf16: return ir::bf16ToFloat(t.as<uint16_t>()[i]);
    case ir::DType::i32: return t.as<int32_t>()[i];
    case ir::DType::i64: return static_cast<double>(t.as<int64_t>()[i]);
    case ir::DType::i1: return t.as<uint8_t>()[i];
    default: return NAN;
  }
}

// Same shape, and every element within atol + rtol * |expected|.
inline void expectClose(const ir::HostTensor& got, const ir::HostTensor& want, double rtol, double atol,
                        const std::string& what = "") {
  ASSERT_EQ(got.view.shape, want.view.shape) << what;
  for (int64_t i = 0; i < want.numel(); ++i) {
    double g = at(got, i), w = at(want, i);
    if (std::isnan(w)) {
      EXPECT_TRUE(std::isnan(g)) << what << " at " << i;
      continue;
    }
    ASSERT_NEAR(g, w, atol + rtol * std::fabs(w)) << what << " at element " << i;
  }
}

}  // namespace kiln::runtime::testing
