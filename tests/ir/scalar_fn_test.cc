// The scalar functions of ir/scalar_fn.def: each activation's derivative entry against central
// differences of its forward entry, the newest functions against their textbook definitions,
// and the combiners' identities. The CUDA and interpreter paths are checked against the CPU
// reference in the nvrtc and simt tests.
#include "ir/scalar_fn.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kiln::ir {
namespace {

TEST(ScalarFns, TableIsInEnumOrder) {
  for (size_t i = 0; i < scalarFns().size(); ++i) EXPECT_EQ(static_cast<size_t>(scalarFns()[i].fn), i);
  for (size_t i = 0; i < combiners().size(); ++i) EXPECT_EQ(static_cast<size_t>(combiners()[i].combiner), i);
}

TEST(ScalarFns, EveryActivationDerivativeMatchesCentralDifferences) {
  int checked = 0;
  for (const ScalarFnInfo& f : scalarFns()) {
    if (f.kind != ScalarFnKind::Activation) continue;
    ASSERT_TRUE(f.partner.has_value()) << f.spelling;
    const ScalarFnInfo& d = scalarFnInfo(*f.partner);
    EXPECT_EQ(d.kind, ScalarFnKind::Derivative);
    EXPECT_EQ(d.partner, f.fn);
    // Points away from every kink of the table's activations (relu at 0, hardswish at +-3).
    for (double x : {-5.5, -3.3, -2.1, -0.7, -0.2, 0.3, 0.9, 1.7, 2.6, 3.4, 6.2}) {
      const double h = 1e-6;
      const double fd =
          (scalar::evaluate<double>(f.fn, x + h) - scalar::evaluate<double>(f.fn, x - h)) / (2 * h);
      EXPECT_NEAR(scalar::evaluate<double>(d.fn, x), fd, 1e-7 * (1 + std::abs(fd)))
          << f.spelling << "'(" << x << ")";
    }
    ++checked;
  }
  EXPECT_GE(checked, 5);
}

TEST(ScalarFns, SoftplusIsLogOnePlusExp) {
  for (double x : {-30.0, -4.0, -0.5, 0.0, 0.5, 4.0, 30.0})
    EXPECT_NEAR(scalar::Softplus(x), std::log(1 + std::exp(x)), 1e-15 * (1 + std::abs(x))) << x;
  // Large inputs neither overflow nor lose the linear part.
  EXPECT_DOUBLE_EQ(scalar::Softplus(1000.0), 1000.0);
  EXPECT_EQ(scalar::Softplus(-1000.0f), 0.0f);
  EXPECT_FALSE(std::isinf(scalar::Softplus(100.0f)));
}

TEST(ScalarFns, HardswishIsPiecewise) {
  auto ref = [](double x) { return x <= -3 ? 0.0 : x >= 3 ? x : x * (x + 3) / 6; };
  for (double x : {-7.0, -3.0, -2.5, -1.0, 0.0, 0.5, 2.9, 3.0, 8.0})
    EXPECT_DOUBLE_EQ(scalar::Hardswish(x), ref(x)) << x;
  // PyTorch's derivative at the corners: 0 below -3, x / 3 + 0.5 on [-3, 3], 1 above.
  EXPECT_DOUBLE_EQ(scalar::HardswishDerivative(-3.0), -0.5);
  EXPECT_DOUBLE_EQ(scalar::HardswishDerivative(3.0), 1.5);
  EXPECT_DOUBLE_EQ(scalar::HardswishDerivative(-3.5), 0.0);
  EXPECT_DOUBLE_EQ(scalar::HardswishDerivative(3.5), 1.0);
}

TEST(ScalarFns, IntegerQuotientAndRemainderByZeroAreZero) {
  EXPECT_EQ(scalar::evaluate<int64_t>(ScalarFn::Div, 7, 0), 0);
  EXPECT_EQ(scalar::evaluate<int64_t>(ScalarFn::Rem, 7, 0), 0);
  EXPECT_EQ(scalar::evaluate<int64_t>(ScalarFn::Div, -7, 2), -3);
  EXPECT_TRUE(std::isinf(scalar::evaluate<double>(ScalarFn::Div, 1.0, 0.0)));
}

TEST(ScalarFns, PredicatesGiveOneOrZero) {
  EXPECT_EQ(scalar::evaluate<double>(ScalarFn::Lt, 1.0, 2.0), 1.0);
  EXPECT_EQ(scalar::evaluate<double>(ScalarFn::Ge, 1.0, 2.0), 0.0);
  EXPECT_TRUE(scalarFnInfo(ScalarFn::Or).isPredicate());
  EXPECT_FALSE(scalarFnInfo(ScalarFn::Max).isPredicate());
  EXPECT_EQ(findScalarFn(ScalarFnKind::Compare, "le"), ScalarFn::Le);
  EXPECT_EQ(findScalarFn(ScalarFnKind::Activation, "exp"), std::nullopt);
}

TEST(ScalarFns, CombinersFoldFromTheirIdentity) {
  EXPECT_EQ(scalar::identity<float>(Combiner::Sum), 0.0f);
  EXPECT_EQ(scalar::identity<float>(Combiner::Max), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(scalar::identity<int64_t>(Combiner::Max), std::numeric_limits<int64_t>::lowest());
  double sum = scalar::identity<double>(Combiner::Sum), mx = scalar::identity<double>(Combiner::Max);
  for (double x : {3.0, -1.0, 7.5, 2.0}) {
    sum = scalar::combine(Combiner::Sum, sum, x);
    mx = scalar::fold<Combiner::Max>(mx, x);
  }
  EXPECT_EQ(sum, 11.5);
  EXPECT_EQ(mx, 7.5);
}

}  // namespace
}  // namespace kiln::ir
