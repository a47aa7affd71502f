// Issue 36, item 7: the roofline estimate of a step's CUDA kernels, checked against a hand count
// of a GEMM and the ReLU after it: the bytes each moves, the GEMM's flops, and each one's time at
// the target's rates (the slower of its math and its memory traffic) plus a launch each.
#include <gtest/gtest.h>

#include <algorithm>

#include "driver/roofline.h"
#include "ir/parser.h"

namespace kiln::driver {
namespace {

const char* kStep = R"(
func.func @step(%x: !kiln.tensor<Bx64xf32>, %w: !kiln.tensor<32x64xf32>) -> !kiln.tensor<Bx32xf32> {
  %0 = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx64xf32>, !kiln.tensor<32x64xf32>) -> !kiln.tensor<Bx32xf32>
  %1 = "kiln.relu"(%0) : (!kiln.tensor<Bx32xf32>) -> !kiln.tensor<Bx32xf32>
  return %1 : !kiln.tensor<Bx32xf32>
}
)";

const KernelClassCost* find(const Roofline& r, const std::string& kind) {
  auto it = std::find_if(r.classes.begin(), r.classes.end(), [&](const KernelClassCost& k) { return k.kind == kind; });
  return it == r.classes.end() ? nullptr : &*it;
}

TEST(Roofline, AGemmAndItsReluByHand) {
  auto m = ir::parseModule(kStep, "<test>");
  ASSERT_TRUE(m) << m.status().str();
  const Target h200 = h200Target();
  auto r = estimateRoofline(*(*m)->lookup("step"), 1024, h200);
  ASSERT_TRUE(r) << r.status().str();

  // precision f32 (the default): cuBLASLt runs the f32 GEMM on the tensor cores in TF32.
  const KernelClassCost* gemm = find(*r, "gemm tf32");
  ASSERT_NE(gemm, nullptr) << formatRoofline(*r);
  EXPECT_EQ(gemm->launches, 1);
  // x, w read, the product written, once each.
  const double gemm_bytes = (1024.0 * 64 + 32 * 64 + 1024 * 32) * 4;
  const double gemm_flops = 2.0 * 1024 * 64 * 32;
  EXPECT_DOUBLE_EQ(gemm->bytes, gemm_bytes);
  EXPECT_DOUBLE_EQ(gemm->flops, gemm_flops);
  EXPECT_DOUBLE_EQ(gemm->roofline_s,
                   std::max(gemm_flops / h200.gemm_flops_per_s.tf32, gemm_bytes / h200.bytes_per_s));

  const KernelClassCost* relu = find(*r, "elementwise");
  ASSERT_NE(relu, nullptr) << formatRoofline(*r);
  EXPECT_EQ(relu->launches, 1);
  const double relu_bytes = 2.0 * 1024 * 32 * 4;  // read the product, write the result
  EXPECT_DOUBLE_EQ(relu->bytes, relu_bytes);
  EXPECT_DOUBLE_EQ(relu->roofline_s, relu_bytes / h200.bytes_per_s);  // one op an element: memory bound
  EXPECT_DOUBLE_EQ(relu->memory_bound_s, relu->roofline_s);

  EXPECT_EQ(r->total.launches, 2);
  EXPECT_DOUBLE_EQ(r->total.launch_s, 2 * h200.launch_s);
  EXPECT_DOUBLE_EQ(r->total.roofline_s, gemm->roofline_s + relu->roofline_s);
  const std::string table = formatRoofline(*r);
  EXPECT_NE(table.find("launches: 2\n"), std::string::npos) << table;
}

// A weight gradient with its bias gradient beside it under bf16, as the fusion pass groups them:
// cuBLASLt reads the bf16 g and x and writes dW and db; the f32 g the sum_to names in the IR is
// never read (the epilogue sums the bf16 g), so it is no traffic of the GEMM's.
const char* kBiasGradient = R"(
func.func @step(%g: !kiln.tensor<Bx32xf32>, %x: !kiln.tensor<Bx64xbf16>) -> (!kiln.tensor<32x64xf32>, !kiln.tensor<32xf32>) {
  %g16 = "kiln.cast"(%g) {to = "bf16"} : (!kiln.tensor<Bx32xf32>) -> !kiln.tensor<Bx32xbf16>
  %r:2 = "kiln.fused"(%g, %g16, %x) ({
  ^bb0(%a: !kiln.tensor<Bx32xf32>, %b: !kiln.tensor<Bx32xbf16>, %c: !kiln.tensor<Bx64xbf16>):
    %db = "kiln.sum_to"(%a) : (!kiln.tensor<Bx32xf32>) -> !kiln.tensor<32xf32>
    %p = "kiln.matmul"(%b, %c) {transpose_a = true} : (!kiln.tensor<Bx32xbf16>, !kiln.tensor<Bx64xbf16>) -> !kiln.tensor<32x64xbf16>
    %dw = "kiln.cast"(%p) {to = "f32"} : (!kiln.tensor<32x64xbf16>) -> !kiln.tensor<32x64xf32>
    "kiln.yield"(%db, %dw) : (!kiln.tensor<32xf32>, !kiln.tensor<32x64xf32>) -> ()
  }) {kind = "gemm_epilogue"} : (!kiln.tensor<Bx32xf32>, !kiln.tensor<Bx32xbf16>, !kiln.tensor<Bx64xbf16>) -> (!kiln.tensor<32xf32>, !kiln.tensor<32x64xf32>)
  return %r#1, %r#0 : !kiln.tensor<32x64xf32>, !kiln.tensor<32xf32>
}
)";

TEST(Roofline, ABiasGradientGemmMovesWhatCublasLtReads) {
  auto m = ir::parseModule(kBiasGradient, "<test>");
  ASSERT_TRUE(m) << m.status().str();
  auto r = estimateRoofline(*(*m)->lookup("step"), 1024, h200Target());
  ASSERT_TRUE(r) << r.status().str();
  const KernelClassCost* gemm = find(*r, "gemm bf16");
  ASSERT_NE(gemm, nullptr) << formatRoofline(*r);
  EXPECT_EQ(gemm->launches, 1);
  // g and x in bf16 read, dW and db in f32 written.
  EXPECT_DOUBLE_EQ(gemm->bytes, (1024.0 * 32 + 1024 * 64) * 2 + (32 * 64 + 32) * 4) << formatRoofline(*r);
  EXPECT_EQ(find(*r, "reduction"), nullptr) << formatRoofline(*r);
}

// A GEMM with enough flops a byte (K = 1024, N = 256) that the H200's f32 rate, not its memory,
// bounds it in exact f32, and its memory in TF32.
const char* kWide = R"(
func.func @wide(%x: !kiln.tensor<Bx1024xf32>, %w: !kiln.tensor<256x1024xf32>) -> !kiln.tensor<Bx256xf32> {
  %0 = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx1024xf32>, !kiln.tensor<256x1024xf32>) -> !kiln.tensor<Bx256xf32>
  return %0 : !kiln.tensor<Bx256xf32>
}
)";

// precision f32_strict: exact f32 on the CUDA cores, at the f32 rate; f32 (the default) in TF32.
TEST(Roofline, StrictF32GemmsRunAtTheF32RateAndF32OnesInTf32) {
  const Target h200 = h200Target();
  const double bytes = (1024.0 * 1024 + 256 * 1024 + 1024 * 256) * 4, flops = 2.0 * 1024 * 1024 * 256;
  for (const char* precision : {"f32_strict", "f32"}) {
    auto m = ir::parseModule(kWide, "<test>");
    ASSERT_TRUE(m) << m.status().str();
    (*m)->mutableAttrs()["kiln.train"] =
        ir::Attribute(ir::AttrDict{{"precision", ir::Attribute(std::string(precision))}});
    auto r = estimateRoofline(*(*m)->lookup("wide"), 1024, h200);
    ASSERT_TRUE(r) << r.status().str();
    const bool strict = std::string(precision) == "f32_strict";
    ASSERT_EQ(r->classes.size(), 1u) << formatRoofline(*r);
    const KernelClassCost& gemm = r->classes[0];
    EXPECT_EQ(gemm.kind, strict ? "gemm f32" : "gemm tf32");
    const double rate = strict ? h200.gemm_flops_per_s.f32 : h200.gemm_flops_per_s.tf32;
    EXPECT_DOUBLE_EQ(gemm.roofline_s, std::max(flops / rate, bytes / h200.bytes_per_s)) << precision;
    // Compute bound in f32 (8.9 us against 1.5 us of traffic), memory bound in TF32 (1.4 us of math).
    EXPECT_DOUBLE_EQ(gemm.memory_bound_s, strict ? 0 : gemm.roofline_s) << precision;
  }
}

TEST(Roofline, ABatchOfEightTimesTheRowsMovesAboutEightTimesTheBytes) {
  auto m = ir::parseModule(kStep, "<test>");
  ASSERT_TRUE(m) << m.status().str();
  auto small = estimateRoofline(*(*m)->lookup("step"), 1024, h200Target());
  auto large = estimateRoofline(*(*m)->lookup("step"), 8192, h200Target());
  ASSERT_TRUE(small && large);
  // Everything but the [32, 64] weight scales with B.
  const double weight = 32.0 * 64 * 4;
  EXPECT_DOUBLE_EQ(large->total.bytes - weight, 8 * (small->total.bytes - weight));
}

}  // namespace
}  // namespace kiln::driver
