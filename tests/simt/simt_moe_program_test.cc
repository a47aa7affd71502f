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

// The layer's backward as the autodiff rules of docs/moe.md write it, and the expert-bias update.
// Attributes are spelled out: a parsed op gets no defaults, and the CPU reference of
// moe_unpermute reads an absent apply_probs as false where its OpDef's default is true.
const char* kExpertLayerBackward = R"(
func.func @backward() -> (!kiln.tensor<4*Bx16xf32>, !kiln.tensor<8x16x24xf32>, !kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx8xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<4*Bx16xf32>
  %logits = "kiln.input"() {name = "logits"} : () -> !kiln.tensor<4*Bx8xf32>
  %dout = "kiln.input"() {name = "dout"} : () -> !kiln.tensor<4*Bx24xf32>
  %g = "kiln.input"() {name = "g"} : () -> !kiln.tensor<f32>
  %bias = "kiln.parameter"() {name = "bias"} : () -> !kiln.tensor<8xf32>
  %w = "kiln.parameter"() {name = "w"} : () -> !kiln.tensor<8x16x24xf32>
  %r:2 = "kiln.moe_router"(%logits, %bias) {topk = 2, score = "softmax", pre_softmax = true} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<8xf32>) -> (!kiln.tensor<4*Bx2xf32>, !kiln.tensor<4*Bx2xi32>)
  %d:3 = "kiln.moe_dispatch"(%r#1, %r#0) {experts = 8, capacity_factor = 0.75, drop_policy = "position"} : (!kiln.tensor<4*Bx2xi32>, !kiln.tensor<4*Bx2xf32>) -> (!kiln.tensor<?(8*B)xi32>, !kiln.tensor<9xi32>, !kiln.tensor<8xi32>)
  %y = "kiln.moe_permute"(%x, %d#0, %r#0) : (!kiln.tensor<4*Bx16xf32>, !kiln.tensor<?(8*B)xi32>, !kiln.tensor<4*Bx2xf32>) -> !kiln.tensor<?(8*B)x16xf32>
  %dh = "kiln.moe_permute"(%dout, %d#0, %r#0) : (!kiln.tensor<4*Bx24xf32>, !kiln.tensor<?(8*B)xi32>, !kiln.tensor<4*Bx2xf32>) -> !kiln.tensor<?(8*B)x24xf32>
  %dy = "kiln.grouped_matmul"(%dh, %w, %d#1) {transpose_b = true} : (!kiln.tensor<?(8*B)x24xf32>, !kiln.tensor<8x16x24xf32>, !kiln.tensor<9xi32>) -> !kiln.tensor<?(8*B)x16xf32>
  %dw = "kiln.grouped_matmul_wgrad"(%y, %dh, %d#1) : (!kiln.tensor<?(8*B)x16xf32>, !kiln.tensor<?(8*B)x24xf32>, !kiln.tensor<9xi32>) -> !kiln.tensor<8x16x24xf32>
  %dx = "kiln.moe_unpermute"(%dy, %d#0, %r#0) {apply_probs = true} : (!kiln.tensor<?(8*B)x16xf32>, !kiln.tensor<?(8*B)xi32>, !kiln.tensor<4*Bx2xf32>) -> !kiln.tensor<4*Bx16xf32>
  %dp = "kiln.moe_row_dot"(%dy, %d#0, %x, %r#0) : (!kiln.tensor<?(8*B)x16xf32>, !kiln.tensor<?(8*B)xi32>, !kiln.tensor<4*Bx16xf32>, !kiln.tensor<4*Bx2xf32>) -> !kiln.tensor<4*Bx2xf32>
  %dl = "kiln.moe_router_grad"(%logits, %r#1, %dp, %bias) {topk = 2, score = "softmax", pre_softmax = true} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx2xi32>, !kiln.tensor<4*Bx2xf32>, !kiln.tensor<8xf32>) -> !kiln.tensor<4*Bx8xf32>
  %dz = "kiln.moe_z_loss_grad"(%logits, %g) {coeff = 0.001} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<f32>) -> !kiln.tensor<4*Bx8xf32>
  %da = "kiln.moe_aux_loss_grad"(%logits, %r#1, %g) {coeff = 0.01, score = "softmax", topk = 2} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx2xi32>, !kiln.tensor<f32>) -> !kiln.tensor<4*Bx8xf32>
  "kiln.moe_expert_bias_update"(%bias, %d#2) {rate = 0.001} : (!kiln.tensor<8xf32>, !kiln.tensor<8xi32>) -> ()
  "func.return"(%dx, %dw, %dl, %dz, %da) : (!kiln.tensor<4*Bx16xf32>, !kiln.tensor<8x16x24xf32>, !kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx8xf32>) -> ()
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

// Runs `text`'s function on the CPU executor and on simt (two stream seeds, parameters from the
// same values each time) and compares every result and the parameters afterwards.
void expectSimtMatchesCpu(const char* text, const char* name, const runtime::cpu::Batch& batch,
                          std::vector<ir::HostTensor>* cpu_results = nullptr) {
  auto m = ir::parseModule(text, "<test>");
  ASSERT_TRUE(m) << m.status().str();
  const ir::Function& f = *(*m)->lookup(name);
  const ir::SymbolBindings symbols{{"B", 8}};
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
  EXPECT_EQ((*host)->numGemms(), 0);  // the grouped GEMMs are kernels of ours, not cuBLASLt's
  for (uint64_t seed : {1u, 2u}) {
    runtime::ParameterStore host_params = params();
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
    for (const std::string& p : cpu_params.names()) {
      const ir::HostTensor& w = *cpu_params.find(p);
      const ir::HostTensor& g = *host_params.find(p);
      for (int64_t i = 0; i < w.numel(); ++i) ASSERT_NEAR(at(g, i), at(w, i), 1e-6) << p << " " << i;
    }
  }
  if (cpu_results) *cpu_results = want.take();
}

TEST(SimtMoeProgram, ARoutedExpertLayerMatchesTheCpuExecutor) {
  const int64_t N = 32;
  ir::HostTensor x = random({N, 16}, 1, 1.0f), logits = random({N, 8}, 2, 2.0f);
  std::vector<ir::HostTensor> want;
  expectSimtMatchesCpu(kExpertLayer, "layer", {{"x", x.view}, {"logits", logits.view}}, &want);
  if (HasFatalFailure()) return;
  // The counts are real tokens: at most the N k slots, and some.
  int64_t kept = 0;
  for (int64_t e = 0; e < 8; ++e) kept += want[1].as<int32_t>()[e];
  EXPECT_LE(kept, N * 2);
  EXPECT_GT(kept, 0);
}

TEST(SimtMoeProgram, ItsBackwardAndTheBiasUpdateMatchTheCpuExecutor) {
  const int64_t N = 32;
  ir::HostTensor x = random({N, 16}, 1, 1.0f), logits = random({N, 8}, 2, 2.0f),
                 dout = random({N, 24}, 5, 1.0f);
  ir::HostTensor g({ir::DType::f32, {}});
  g.as<float>()[0] = 1.5f;
  expectSimtMatchesCpu(kExpertLayerBackward, "backward",
                       {{"x", x.view}, {"logits", logits.view}, {"dout", dout.view}, {"g", g.view}});
}

}  // namespace
}  // namespace kiln::testing
