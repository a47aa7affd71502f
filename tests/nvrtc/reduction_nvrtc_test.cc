// The reduction kernels (codegen/emit/reduction.cc) compile with NVRTC for the A100 and the
// H100/H200: the op cases' folds and folds at production shapes (R1's bias gradients, bf16 and
// behind a producer chain, a 100M-element loss, long rows), whose ColumnReduce slabs and Row
// chunks exist only at those sizes. Label nvrtc: no GPU needed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "runtime/cuda/nvrtc_compiler.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

// The folds at the shapes the models run: [B, N] -> [N] at B = 16384 (f32, bf16, fed by
// relu(x) * dy), a loss over 100M elements, four rows of 25M.
std::vector<OpCase> productionFolds() {
  std::vector<OpCase> cases;
  for (DType t : {DType::f32, DType::bf16}) {
    CaseBuilder b(std::string("bias_grad_16384x1024_") + std::string(ir::dtypeName(t)));
    b.opWithType("kiln.sum_to", {b.input("x", t, S({16384, 1024}))}, TensorType(t, S({1024})));
    cases.push_back(b.take());
  }
  {
    CaseBuilder b("relu_backward_bias_grad_16384x3456");
    Value* x = b.input("x", DType::f32, S({16384, 3456}));
    Value* dy = b.input("dy", DType::f32, S({16384, 3456}));
    Value* g = b.op("kiln.mul", {b.op("kiln.relu", {x})->result(), dy})->result();
    b.opWithType("kiln.sum_to", {g}, TensorType(DType::f32, S({3456})));
    cases.push_back(b.take());
  }
  for (const char* kind : {"mean", "max"}) {
    CaseBuilder b(std::string("loss_100M_") + kind);
    b.op("kiln.reduce", {b.input("x", DType::f32, S({100000000}))},
         {{"kind", Attribute(kind)}, {"axes", Attribute::ints({0})}});
    cases.push_back(b.take());
  }
  {
    CaseBuilder b("rows_4x25M");
    b.op("kiln.reduce", {b.input("x", DType::bf16, S({4, 25000000}))},
         {{"kind", Attribute("sum")}, {"axes", Attribute::ints({1})}});
    cases.push_back(b.take());
  }
  return cases;
}

TEST(NvrtcReductions, FoldsCompileForSm80AndSm90) {
  const fs::path dir = fs::temp_directory_path() / ("kiln-nvrtc-reduction-" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto nvrtc = cuda::NvrtcCompiler::create(dir.string());
  if (!nvrtc) GTEST_SKIP() << nvrtc.status().message();

  std::vector<OpCase> cases = productionFolds();
  for (OpCase& c : allOpCases())
    if (c.name.rfind("reduce", 0) == 0 || c.name.rfind("sum_to", 0) == 0) cases.push_back(std::move(c));
  std::vector<codegen::LoweredGroup> groups;
  std::vector<const codegen::Kernel*> kernels;
  int column_kernels = 0, two_pass = 0;
  for (const OpCase& c : cases) {
    auto g = codegen::lowerGroup(c.group, c.symbols);
    ASSERT_TRUE(g) << c.name << ": " << g.status().message();
    groups.push_back(g.take());
  }
  for (const codegen::LoweredGroup& g : groups) {
    two_pass += g.kernels.size() == 2;
    for (const codegen::Kernel& k : g.kernels) {
      kernels.push_back(&k);
      column_kernels += k.kind == codegen::KernelKind::ColumnReduce;
    }
  }
  // Every production fold is cut in two passes; the op cases add slabs, chunks and single passes.
  EXPECT_GE(two_pass, 6 + 4);
  EXPECT_GT(column_kernels, 10);
  codegen::CudaModule m = codegen::emitModule(kernels);
  for (const char* arch : {"sm_80", "sm_90"}) {
    auto r = (*nvrtc)->compile(m, arch);
    ASSERT_TRUE(r) << arch << ": " << r.status().message();
    EXPECT_GT(r->cubin.size(), 1000u) << arch;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln::testing
