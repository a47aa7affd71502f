// A routed expert layer as a whole function, built into a CUDA program exactly as CudaExecutor
// builds it (groups, the arena plan with the bounded rows and the kernels' temporaries, streams,
// steps) and run on the host by simt::HostProgram, against the CPU executor on the same inputs:
// router (sigmoid, bias, group-limited) -> dispatch (capacity, padding) -> permute (probs applied)
// -> grouped GEMM -> unpermute, with the z and aux losses and the counts.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "codegen/lower_cpu.h"
#include "ir/parser.h"
#include "runtime/cpu/executor.h"
#include "runtime/parameter_store.h"
#include "tests/simt/host_program.h"

namespace kiln::testing {
namespace {

const char* kExpertLayer = R"(
func.func @layer() -> (!kiln.tensor<4*Bx24xf32>, !kiln.tensor<8xi32>, !kiln.tensor<f32>, !kiln.tensor<f32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<4*Bx16xf32>
  %logits = "kiln.input"() {name = "logits"} : () -> !kiln.tensor<4*Bx8xf32>
  %bias = "kiln.parameter"() {name = "bias"} : () -> !kiln.tensor<8xf32>
  %w = "kiln.parameter"() {name = "w"} : () -> !kiln.tensor<8x16x24xf32>
  %r:2 = "kiln.moe_router"(%logits, %bias) {topk = 2, score = "sigmoid", groups = 4, group_topk = 2, scale = 2.5} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<8xf32>) -> (!kiln.tensor<4*Bx2xf32>, !kiln.tensor<4*Bx2xi32>)
  %d:3 = "kiln.moe_dispatch"(%r#1, %r#0) {experts = 8, capacity_factor = 1.5, pad_to_capacity = true} : (!kiln.tensor<4*Bx2xi32>, !kiln.tensor<4*Bx2xf32>) -> (!kiln.tensor<?(44*B)xi32>, !kiln.tensor<9xi32>, !kiln.tensor<8xi32>)
  %y = "kiln.moe_permute"(%x, %d#0, %r#0) {apply_probs = true} : (!kiln.tensor<4*Bx16xf32>, !kiln.tensor<?(44*B)xi32>, !kiln.tensor<4*Bx2xf32>) -> !kiln.tensor<?(44*B)x16xf32>
  %h = "kiln.grouped_matmul"(%y, %w, %d#1) : (!kiln.tensor<?(44*B)x16xf32>, !kiln.tensor<8x16x24xf32>, !kiln.tensor<9xi32>) -> !kiln.tensor<?(44*B)x24xf32>
  %out = "kiln.moe_unpermute"(%h, %d#0, %r#0) {apply_probs = false} : (!kiln.tensor<?(44*B)x24xf32>, !kiln.tensor<?(44*B)xi32>, !kiln.tensor<4*Bx2xf32>) -> !kiln.tensor<4*Bx24xf32>
  %z = "kiln.moe_z_loss"(%logits) {coeff = 0.001} : (!kiln.tensor<4*Bx8xf32>) -> !kiln.tensor<f32>
  %aux = "kiln.moe_aux_loss"(%logits, %r#1) {coeff = 0.01, score = "sigmoid", topk = 2, seq_len = 4} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx2xi32>) -> !kiln.tensor<f32>
  "func.return"(%out, %d#2, %z, %aux) : (!kiln.tensor<4*Bx24xf32>, !kiln.tensor<8xi32>, !kiln.tensor<f32>, !kiln.tensor<f32>) -> ()
}
)";

ir::HostTensor random(std::vector<int64_t> shape, unsigned seed, float scale) {
  ir::HostTensor t(ir::DType::f32, std::move(shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = d(rng);
  return t;
}

double at(const ir::HostTensor& t, int64_t i) {
  return t.view.dtype == ir::DType::i32 ? t.as<int32_t>()[i] : t.as<float>()[i];
}

TEST(SimtMoeProgram, ARoutedExpertLayerMatchesTheCpuExecutor) {
  auto m = ir::parseModule(kExpertLayer, "<test>");
  ASSERT_TRUE(m) << m.status().str();
  const ir::Function& f = *(*m)->lookup("layer");
  const int64_t B = 8, N = 4 * B;
  const ir::SymbolBindings symbols{{"B", B}};
  ir::HostTensor x = random({N, 16}, 1, 1.0f), logits = random({N, 8}, 2, 2.0f);
  runtime::cpu::Batch batch{{"x", x.view}, {"logits", logits.view}};
  auto params = [] {
    runtime::ParameterStore p;
    p.set("bias", random({8}, 3, 0.1f));
    p.set("w", random({8, 16, 24}, 4, 0.5f));
    return p;
  };
  auto program = codegen::lowerForCpu(f, symbols);
  ASSERT_TRUE(program) << program.status().message();
  auto cpu = runtime::cpu::CpuExecutor::create(program.take());
  ASSERT_TRUE(cpu) << cpu.status().message();
  runtime::ParameterStore cpu_params = params();
  auto want = (*cpu)->run(batch, cpu_params);
  ASSERT_TRUE(want) << want.status().message();

  auto host = simt::HostProgram::create(f, symbols);
  ASSERT_TRUE(host) << host.status().message();
  EXPECT_EQ((*host)->numGemms(), 0);  // the grouped GEMM is a kernel of ours, not cuBLASLt's
  runtime::ParameterStore host_params = params();
  for (uint64_t seed : {1u, 2u}) {
    auto got = (*host)->run(batch, host_params, seed);
    ASSERT_TRUE(got) << got.status().message();
    ASSERT_EQ(got->size(), want->size());
    for (size_t r = 0; r < want->size(); ++r) {
      const ir::HostTensor& w = (*want)[r];
      const ir::HostTensor& g = (*got)[r];
      ASSERT_EQ(g.numel(), w.numel()) << "result " << r;
      for (int64_t i = 0; i < w.numel(); ++i)
        ASSERT_NEAR(at(g, i), at(w, i), 1e-4 * (1 + std::abs(at(w, i))))
            << "result " << r << " element " << i;
    }
  }
  // The counts are real tokens: at most the N k slots, and some.
  const ir::HostTensor& counts = (*want)[1];
  int64_t kept = 0;
  for (int64_t e = 0; e < 8; ++e) kept += counts.as<int32_t>()[e];
  EXPECT_LE(kept, N * 2);
  EXPECT_GT(kept, 0);
}

}  // namespace
}  // namespace kiln::testing
