// Issue 12, defect 8: checked arithmetic for sizes from users and files (ir/checked.h), and the
// tensor sizes built on it: an overflow is nullopt or an error, never a wrapped value.
#include "ir/checked.h"

#include <gtest/gtest.h>

#include "ir/types.h"

namespace kiln {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

TEST(Checked, MulAndAddStopAtTheInt64Range) {
  EXPECT_EQ(checkedMul(3037000499, 3037000499), int64_t{9223372030926249001});
  EXPECT_EQ(checkedMul(3037000500, 3037000500), std::nullopt);
  EXPECT_EQ(checkedMul(kMax, 1), kMax);
  EXPECT_EQ(checkedMul(kMin, -1), std::nullopt);
  EXPECT_EQ(checkedMul(int64_t{1} << 62, 2), std::nullopt);
  EXPECT_EQ(checkedAdd(kMax - 1, 1), kMax);
  EXPECT_EQ(checkedAdd(kMax, 1), std::nullopt);
  EXPECT_EQ(checkedAdd(kMin, -1), std::nullopt);
  EXPECT_EQ(checkedMulU(uint64_t{1} << 32, uint64_t{1} << 32), std::nullopt);
  EXPECT_EQ(checkedAddU(UINT64_MAX, 0), UINT64_MAX);
  EXPECT_EQ(checkedAddU(UINT64_MAX, 1), std::nullopt);
}

TEST(Checked, ParsesWholeIntegersWithoutSaturating) {
  EXPECT_EQ(parseInt64("0"), int64_t{0});
  EXPECT_EQ(parseInt64("+5"), int64_t{5});
  EXPECT_EQ(parseInt64("-17"), int64_t{-17});
  EXPECT_EQ(parseInt64("9223372036854775807"), kMax);
  EXPECT_EQ(parseInt64("-9223372036854775808"), kMin);
  // strtoll gives LLONG_MAX / LLONG_MIN for these.
  EXPECT_EQ(parseInt64("9223372036854775808"), std::nullopt);
  EXPECT_EQ(parseInt64("-9223372036854775809"), std::nullopt);
  EXPECT_EQ(parseInt64("99999999999999999999999"), std::nullopt);
  for (const char* bad : {"", "-", "+", "1e3", " 1", "1 ", "0x10", "12a", "--1"})
    EXPECT_EQ(parseInt64(bad), std::nullopt) << "'" << bad << "'";
  EXPECT_EQ(parseUint64("18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(parseUint64("18446744073709551616"), std::nullopt);
  EXPECT_EQ(parseUint64("-1"), std::nullopt);
}

TEST(Checked, TensorSizesBeyondInt64AreErrorsNotWrappedCounts) {
  using ir::Dim;
  using ir::DType;
  using ir::TensorType;
  // 10^7 rows of 10^12 f32: 4 * 10^19 bytes, which wrapped to 3106511852580896768.
  TensorType table(DType::f32, {Dim::fixed(10000000), Dim::fixed(1000000000000)});
  EXPECT_EQ(table.numElements({}), std::nullopt);
  EXPECT_EQ(table.bytes({}), std::nullopt);
  auto n = table.checkedNumElements({});
  ASSERT_FALSE(n);
  EXPECT_EQ(n.status().message(), "!kiln.tensor<10000000x1000000000000xf32> has more than 2^63-1 elements");

  // The elements fit and the bytes do not: 2^62 f32.
  TensorType wide(DType::f32, {Dim::fixed(int64_t{1} << 62)});
  EXPECT_EQ(wide.numElements({}), int64_t{1} << 62);
  auto b = wide.checkedBytes({});
  ASSERT_FALSE(b);
  EXPECT_NE(b.status().message().find("holds more than 2^63-1 bytes"), std::string::npos)
      << b.status().message();

  // A symbolic dim whose factor times the bound value overflows; the message names the binding.
  TensorType batch(DType::f32, {Dim::symbol("B", 26), Dim::fixed(13)});
  EXPECT_EQ(Dim::symbol("B", 26).evaluate({{"B", int64_t{1} << 59}}), std::nullopt);
  auto e = batch.checkedBytes({{"B", int64_t{1} << 59}});
  ASSERT_FALSE(e);
  EXPECT_NE(e.status().message().find("26*B"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("at B=576460752303423488"), std::string::npos) << e.status().message();
  // An unbound symbol is said to be unbound, not an overflow.
  auto u = batch.checkedBytes({});
  ASSERT_FALSE(u);
  EXPECT_EQ(u.status().message(),
            "symbol 'B' of !kiln.tensor<26*Bx13xf32> is not bound (set it, e.g. --batch)");
  EXPECT_EQ(batch.checkedBytes({{"B", 4}}).isOk() ? *batch.checkedBytes({{"B", 4}}) : -1, 4 * 26 * 13 * 4);

  // Reshape checks compare symbolic products: an overflowing one is flagged, not compared wrapped.
  EXPECT_TRUE(ir::symbolicProduct(table.shape()).overflow);
  EXPECT_FALSE(ir::symbolicProduct(batch.shape()).overflow);
}

}  // namespace
}  // namespace kiln
