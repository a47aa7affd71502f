// The generated CUDA source of each op kind, run on the host (simt): the op case's group is
// lowered, printed as CUDA, compiled by the host compiler with simt_prelude.h and launched over
// guarded host buffers (outputs and temporaries poisoned first); every value the group writes
// is compared with the op's CPU reference. This is gpu_ops_test without the GPU: it executes
// the emitted text (indexing, barriers, shuffles, atomics, launch shapes) where the kernel
// semantics test executes only the kernel IR.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_interpreter.h"
#include "codegen/kernel_lowering.h"
#include "tests/nvrtc/op_cases.h"
#include "tests/simt/host_module.h"

namespace kiln::testing {
namespace {

// Every op case's kernels in one module, compiled once (cached across the test processes).
const simt::HostModule& allCasesModule() {
  static std::unique_ptr<simt::HostModule> module = [] {
    std::vector<OpCase> cases = allOpCases();
    std::vector<codegen::LoweredGroup> groups;
    for (const OpCase& c : cases) {
      auto g = codegen::lowerGroup(c.group, c.symbols);
      if (g) groups.push_back(g.take());
    }
    std::vector<const codegen::Kernel*> kernels;
    for (const codegen::LoweredGroup& g : groups)
      for (const codegen::Kernel& k : g.kernels) kernels.push_back(&k);
    auto m = simt::HostModule::compile(codegen::emitModule(kernels));
    if (!m) ADD_FAILURE() << m.status().message();
    return m ? m.take() : nullptr;
  }();
  return *module;
}

// Runs group `g` of case `c` from `module` over guarded buffers and compares everything it
// writes with the CPU reference `run`.
void expectSimtMatchesReference(const OpCase& c, const CaseRun* run, const codegen::LoweredGroup& g,
                                const simt::HostModule& module) {
  SCOPED_TRACE(c.name);
  std::vector<ir::HostTensor> host = groupStorage(g, *run);
  clearErrorFlags(g, host);
  std::vector<simt::GuardedBuffer> bufs;
  std::vector<uint64_t> address;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    auto b = simt::GuardedBuffer::allocate(host[i].storage.size(), ir::dtypeBytes(g.buffers[i].dtype));
    ASSERT_TRUE(b) << b.status().message();
    if (!host[i].storage.empty()) std::memcpy(b->data(), host[i].storage.data(), host[i].storage.size());
    address.push_back(reinterpret_cast<uint64_t>(b->data()));
    bufs.push_back(b.take());
  }
  fillAddressTables(g, address);
  for (size_t k = 0; k < g.kernels.size(); ++k) {
    std::string name;
    codegen::emitKernel(g.kernels[k], &name);
    std::vector<void*> args;
    for (int gb : g.args[k]) args.push_back(bufs[static_cast<size_t>(gb)].data());
    Status s = module.launch(name, codegen::launchConfig(g.kernels[k]), args);
    ASSERT_TRUE(s.isOk()) << s.message();
  }
  for (size_t i = 0; i < g.buffers.size(); ++i)
    if (!host[i].storage.empty()) std::memcpy(host[i].storage.data(), bufs[i].data(), host[i].storage.size());
  expectNoErrorFlagged(g, host);
  EXPECT_GT(expectGroupMatchesReference(g, host, *run, c.tol, "simt"), 0);
}

class SimtOps : public ::testing::TestWithParam<int> {};

TEST_P(SimtOps, EmittedCudaMatchesCpuReference) {
  auto prepared = prepareCase(GetParam(), 4321);
  ASSERT_TRUE(prepared) << prepared.status().message();
  if (prepared->group.gemm) GTEST_SKIP() << "a GEMM: cuBLASLt's, not generated";
  expectSimtMatchesReference(prepared->c, &prepared->run, prepared->group, allCasesModule());
}

INSTANTIATE_TEST_SUITE_P(AllOps, SimtOps, ::testing::Range(0, static_cast<int>(allOpCases().size())),
                         [](const ::testing::TestParamInfo<int>& i) { return allOpCases()[static_cast<size_t>(i.param)].name; });

// A GPU of one SM: a wave is 8 blocks of 256 threads (2 of 1024), so grids stop at 32 (8) blocks.
Target oneSmGpu() {
  Target t = h200Target();
  t.name = "one_sm";
  t.cores = 1;
  return t;
}

// Whether a kernel's grid is smaller than its work, so its grid-stride loop goes round: a
// Pointwise kernel of more elements than its threads take (four each at most), a Row kernel of
// more outer elements than blocks, a ColumnReduce of more tiles than blocks.
bool gridStrides(const codegen::Kernel& k) {
  const int64_t grid = codegen::launchConfig(k).grid;
  switch (k.kind) {
    case codegen::KernelKind::Pointwise:
      return grid * 256 * 4 < k.spaceSize();
    case codegen::KernelKind::Row:
      return grid < k.spaceSize();
    case codegen::KernelKind::ColumnReduce: {
      const codegen::ColumnTile t = codegen::columnTile(k);
      return grid < t.slabs * t.strips;
    }
    default:
      return false;
  }
}

// Every op case, and larger ones of each kernel kind, lowered for a GPU of one SM: grids of a few
// waves take several elements, rows or tiles a block, and folds are cut into a wave's pieces of
// that GPU (bce_with_logits_two_pass: 8 slabs where an H200 gets 16). Each must still match the
// CPU reference.
TEST(SimtOnASmallGpu, GridStrideLoopsCoverEverything) {
  std::vector<OpCase> cases = allOpCases();
  {
    CaseBuilder b("pointwise_300x301");
    b.op("kiln.mul", {b.op("kiln.relu", {b.input("x", DType::f32, S({300, 301}))})->result(),
                      b.input("y", DType::f32, S({301}))});
    cases.push_back(b.take());
  }
  {
    CaseBuilder b("pointwise_vectorized_256x512");
    b.op("kiln.add", {b.input("x", DType::f32, S({256, 512})), b.input("y", DType::f32, S({256, 512}))});
    cases.push_back(b.take());
  }
  {
    CaseBuilder b("softmax_2000_rows");
    b.op("kiln.softmax", {b.input("x", DType::f32, S({2000, 33}))}, {{"axis", Attribute(int64_t{-1})}});
    cases.push_back(b.take());
  }
  {
    CaseBuilder b("sum_to_4000_columns");
    b.opWithType("kiln.sum_to", {b.input("x", DType::f32, S({50, 4000}))}, TensorType(DType::f32, S({4000})));
    cases.push_back(b.take());
  }
  const Target gpu = oneSmGpu();
  struct Lowered {
    const OpCase* c;
    CaseRun run;
    codegen::LoweredGroup group;
  };
  std::vector<Lowered> runs;
  std::map<codegen::KernelKind, int> striding;
  int two_pass_folds = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    auto g = codegen::lowerGroup(cases[i].group, cases[i].symbols, gpu);
    if (!g || g->gemm) continue;  // a case the CUDA backend refuses is SimtOps' business
    bool strides = false, two_pass = false;
    for (const codegen::Kernel& k : g->kernels)
      if (gridStrides(k)) strides = true, ++striding[k.kind];
    for (const codegen::GroupBuffer& b : g->buffers)
      two_pass = two_pass || b.name.find(".partials") != std::string::npos;
    if (!strides && !two_pass) continue;
    two_pass_folds += two_pass;
    std::mt19937 rng(4321 + static_cast<unsigned>(i));
    auto run = runReference(cases[i], rng);
    ASSERT_TRUE(run) << cases[i].name << ": " << run.status().message();
    runs.push_back({&cases[i], run.take(), g.take()});
  }
  EXPECT_GT(striding[codegen::KernelKind::Pointwise], 0);
  EXPECT_GT(striding[codegen::KernelKind::Row], 0);
  EXPECT_GT(striding[codegen::KernelKind::ColumnReduce], 0);
  EXPECT_GT(two_pass_folds, 0);
  std::vector<const codegen::Kernel*> kernels;
  for (const Lowered& l : runs)
    for (const codegen::Kernel& k : l.group.kernels) kernels.push_back(&k);
  auto module = simt::HostModule::compile(codegen::emitModule(kernels));
  ASSERT_TRUE(module) << module.status().message();
  for (const Lowered& l : runs) expectSimtMatchesReference(*l.c, &l.run, l.group, **module);
}

// Reductions cut into pieces (codegen/emit/reduction.cc: ColumnReduce slabs, Row chunks), run
// from their generated CUDA against plain host loops: ragged tiles, one row, one column, long
// folds over many blocks, bf16, a fused producer chain. Each is run again on fewer blocks (each
// taking several tiles) in another block and thread order and must give the same bits, which
// the interpreter's sequential run must give too.
struct FoldCase {
  std::string name;
  std::string op = "reduce";  // or "sum_to", "relu_mul_sum_to" (relu(x) * y summed), "cast_sum_to"
  std::string kind = "sum";
  std::vector<int64_t> shape;
  std::vector<int64_t> axes;         // reduce
  std::vector<int64_t> out_shape;    // sum_to
  DType dtype = DType::f32;
  double offset = 0;                 // added to every input: all negative for max's identity
  size_t kernels = 1;
  codegen::KernelKind first_kind = codegen::KernelKind::ColumnReduce;
};

std::vector<FoldCase> foldCases() {
  using codegen::KernelKind;
  std::vector<FoldCase> c;
  c.push_back({"bias_grad_ragged", "sum_to", "sum", {3000, 70}, {}, {70}, DType::f32, 0, 2});
  c.push_back({"one_row", "reduce", "sum", {1, 70}, {0}, {}, DType::f32, 0, 1});
  c.push_back({"one_column", "sum_to", "sum", {5000, 1}, {}, {1}, DType::f32, 0, 1});
  c.push_back({"whole_tensor_mean", "reduce", "mean", {300001}, {0}, {}, DType::f32, 0, 2});
  c.push_back({"whole_max_negative", "reduce", "max", {3, 50000, 5}, {0, 1}, {}, DType::f32, -10, 2});
  c.push_back({"batch_seq_to_columns", "sum_to", "sum", {40, 37, 19}, {}, {19}, DType::f32, 0, 2});
  c.push_back({"bf16_columns", "reduce", "sum", {4099, 33}, {0}, {}, DType::bf16, 0, 2});
  c.push_back({"bf16_cast_chain", "cast_sum_to", "sum", {4099, 33}, {}, {33}, DType::bf16, 0, 2});
  c.push_back({"relu_mul_chain", "relu_mul_sum_to", "sum", {2050, 40}, {}, {40}, DType::f32, 0, 2});
  c.push_back({"long_rows", "reduce", "sum", {3, 70001}, {1}, {}, DType::f32, 0, 2, KernelKind::Row});
  c.push_back({"long_rows_max_negative", "reduce", "max", {2, 50000}, {1}, {}, DType::f32, -10, 2, KernelKind::Row});
  c.push_back({"long_rows_two_dims", "reduce", "mean", {2, 303, 119}, {1, 2}, {}, DType::f32, 0, 2, KernelKind::Row});
  return c;
}

struct BuiltFold {
  FoldCase fc;
  OpCase c;
  const Value* x = nullptr;
  const Value* y = nullptr;  // relu_mul_sum_to's second factor
  const Value* out = nullptr;
  codegen::LoweredGroup group;
};

BuiltFold buildFold(const FoldCase& fc, const Target& target = h200Target()) {
  CaseBuilder b(fc.name);
  ir::Shape xs;
  for (int64_t d : fc.shape) xs.push_back(Dim::fixed(d));
  Value* x = b.input("x", fc.dtype, xs);
  Value* y = nullptr;
  Value* folded = x;
  if (fc.op == "relu_mul_sum_to") {
    y = b.input("y", fc.dtype, xs);
    folded = b.op("kiln.mul", {b.op("kiln.relu", {x})->result(), y})->result();
  } else if (fc.op == "cast_sum_to") {
    folded = b.op("kiln.cast", {x}, {{"to", Attribute("f32")}})->result();
  }
  ir::Op* op;
  if (fc.op == "reduce") {
    op = b.op("kiln.reduce", {folded}, {{"kind", Attribute(fc.kind)}, {"axes", Attribute::ints(fc.axes)}});
  } else {
    ir::Shape os;
    for (int64_t d : fc.out_shape) os.push_back(Dim::fixed(d));
    op = b.opWithType("kiln.sum_to", {folded}, TensorType(folded->type().dtype(), os));
  }
  BuiltFold f{fc, b.take(), x, y, op->result(), {}};
  auto g = codegen::lowerGroup(f.c.group, f.c.symbols, target);
  if (!g) throw std::runtime_error(fc.name + ": " + g.status().message());
  f.group = g.take();
  return f;
}

const std::vector<BuiltFold>& builtFolds() {
  static const std::vector<BuiltFold> folds = [] {
    std::vector<BuiltFold> v;
    for (const FoldCase& fc : foldCases()) v.push_back(buildFold(fc));
    return v;
  }();
  return folds;
}

const simt::HostModule& foldModule() {
  static std::unique_ptr<simt::HostModule> module = [] {
    std::vector<const codegen::Kernel*> kernels;
    for (const BuiltFold& f : builtFolds())
      for (const codegen::Kernel& k : f.group.kernels) kernels.push_back(&k);
    auto m = simt::HostModule::compile(codegen::emitModule(kernels));
    if (!m) ADD_FAILURE() << m.status().message();
    return m ? m.take() : nullptr;
  }();
  return *module;
}

// The inputs as the kernels read them (bf16 rounded), drawn from a fixed seed.
std::vector<float> foldInput(const FoldCase& fc, int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& e : v) {
    e = normal(rng) + static_cast<float>(fc.offset);
    if (fc.dtype == DType::bf16) e = ir::bf16ToFloat(ir::floatToBf16(e));
  }
  return v;
}

// Runs the group's kernels on simt; `grid` > 0 overrides every launch's grid. Returns the bytes
// of every group buffer afterwards.
std::vector<std::vector<unsigned char>> runFold(const BuiltFold& f, const std::vector<float>& x,
                                                const std::vector<float>& y, int64_t grid) {
  const codegen::LoweredGroup& g = f.group;
  std::vector<simt::GuardedBuffer> bufs;
  for (const codegen::GroupBuffer& gb : g.buffers) {
    const size_t bytes = static_cast<size_t>(gb.elements * ir::dtypeBytes(gb.dtype));
    auto b = simt::GuardedBuffer::allocate(bytes, static_cast<size_t>(ir::dtypeBytes(gb.dtype)));
    if (!b) throw std::runtime_error(b.status().message());
    const std::vector<float>* src = gb.value == f.x ? &x : gb.value == f.y ? &y : nullptr;
    if (!src) {
      std::memset(b->data(), 0xff, bytes);  // NaN: whatever is not written shows
    } else if (gb.dtype == DType::bf16) {
      auto* p = static_cast<uint16_t*>(b->data());
      for (size_t i = 0; i < src->size(); ++i) p[i] = ir::floatToBf16((*src)[i]);
    } else {
      std::memcpy(b->data(), src->data(), bytes);
    }
    bufs.push_back(b.take());
  }
  for (size_t k = 0; k < g.kernels.size(); ++k) {
    std::string name;
    codegen::emitKernel(g.kernels[k], &name);
    std::vector<void*> args;
    for (int gb : g.args[k]) args.push_back(bufs[static_cast<size_t>(gb)].data());
    codegen::LaunchConfig lc = codegen::launchConfig(g.kernels[k]);
    if (grid > 0) lc.grid = grid;
    Status s = foldModule().launch(name, lc, args);
    if (!s.isOk()) throw std::runtime_error(s.message());
  }
  std::vector<std::vector<unsigned char>> out;
  for (const simt::GuardedBuffer& b : bufs) {
    const auto* p = static_cast<const unsigned char*>(b.data());
    out.emplace_back(p, p + b.bytes());
  }
  return out;
}

class SimtFolds : public ::testing::TestWithParam<int> {};

TEST_P(SimtFolds, MatchHostLoopsWithTheSameBitsInAnyOrder) {
  const BuiltFold& f = builtFolds()[static_cast<size_t>(GetParam())];
  const FoldCase& fc = f.fc;
  const codegen::LoweredGroup& g = f.group;
  ASSERT_EQ(g.kernels.size(), fc.kernels);
  EXPECT_EQ(g.kernels[0].kind, fc.first_kind);
  if (fc.kernels > 1) {
    EXPECT_GT(codegen::launchConfig(g.kernels[0]).grid, 1) << "a two-pass fold on one block";
  }

  int64_t n = 1;
  for (int64_t d : fc.shape) n *= d;
  const std::vector<float> x = foldInput(fc, n, 11), y = foldInput(fc, n, 12);
  // The fold as plain loops: which dims go, then per output a sum, count and max in double.
  std::vector<bool> folded(fc.shape.size(), false);
  if (fc.op == "reduce") {
    for (int64_t a : fc.axes) folded[static_cast<size_t>(a)] = true;
  } else {
    const size_t lead = fc.shape.size() - fc.out_shape.size();
    for (size_t i = 0; i < fc.shape.size(); ++i)
      folded[i] = i < lead || (fc.out_shape[i - lead] == 1 && fc.shape[i] != 1);
  }
  int64_t outputs = 1;
  for (size_t i = 0; i < fc.shape.size(); ++i)
    if (!folded[i]) outputs *= fc.shape[i];
  std::vector<double> sum(static_cast<size_t>(outputs), 0), abs_sum(sum),
      most(static_cast<size_t>(outputs), -INFINITY);
  std::vector<int64_t> count(static_cast<size_t>(outputs), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t rest = i, o = 0, scale = 1;
    for (size_t d = fc.shape.size(); d-- > 0;) {
      const int64_t c = rest % fc.shape[d];
      rest /= fc.shape[d];
      if (!folded[d]) o += c * scale, scale *= fc.shape[d];
    }
    double v = x[static_cast<size_t>(i)];
    if (fc.op == "relu_mul_sum_to") v = std::max(v, 0.0) * y[static_cast<size_t>(i)];
    sum[static_cast<size_t>(o)] += v;
    abs_sum[static_cast<size_t>(o)] += std::fabs(v);
    most[static_cast<size_t>(o)] = std::max(most[static_cast<size_t>(o)], v);
    ++count[static_cast<size_t>(o)];
  }

  auto first = runFold(f, x, y, 0);
  size_t out_buffer = g.buffers.size();
  for (size_t i = 0; i < g.buffers.size(); ++i)
    if (g.buffers[i].value == f.out) out_buffer = i;
  ASSERT_LT(out_buffer, g.buffers.size());
  const DType out_type = g.buffers[out_buffer].dtype;
  auto outputAt = [&](const std::vector<unsigned char>& bytes, int64_t o) -> double {
    if (out_type == DType::bf16) return ir::bf16ToFloat(reinterpret_cast<const uint16_t*>(bytes.data())[o]);
    return reinterpret_cast<const float*>(bytes.data())[o];
  };
  for (int64_t o = 0; o < outputs; ++o) {
    const size_t u = static_cast<size_t>(o);
    const double got = outputAt(first[out_buffer], o);
    if (fc.kind == "max") {
      ASSERT_EQ(got, most[u]) << "output " << o;  // a max is one of the inputs, exactly
      continue;
    }
    const double want = fc.kind == "mean" ? sum[u] / static_cast<double>(count[u]) : sum[u];
    const double rounding = out_type == DType::bf16 ? std::ldexp(std::fabs(want), -8) : 0;
    const double mean_scale = fc.kind == "mean" ? static_cast<double>(count[u]) : 1;
    ASSERT_NEAR(got, want, rounding + 2e-6 * abs_sum[u] / mean_scale + 1e-6) << "output " << o;
  }

  // Fewer blocks taking several tiles each, in another shuffled order: the same bits.
  setenv("KILN_SIMT_SEED", "7", 1);
  auto again = runFold(f, x, y, 3);
  unsetenv("KILN_SIMT_SEED");
  EXPECT_EQ(again[out_buffer], first[out_buffer]) << "the result depends on the block order or the grid";
  // The interpreter folds a ColumnReduce in the same fixed order, one logical thread after
  // another (a Row kernel's block reduction it folds in row order: the same value, not the bits).
  std::vector<std::vector<unsigned char>> interpreted;
  std::vector<void*> ptrs;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    interpreted.push_back(first[i]);
    if (i == out_buffer) std::fill(interpreted.back().begin(), interpreted.back().end(), 0xff);
    ptrs.push_back(interpreted.back().data());
  }
  ASSERT_TRUE(codegen::interpretGroup(g, ptrs).isOk());
  if (fc.first_kind == codegen::KernelKind::ColumnReduce) {
    EXPECT_EQ(interpreted[out_buffer], first[out_buffer]) << "the interpreter's order is not the kernels'";
  } else {
    for (int64_t o = 0; o < outputs; ++o)
      EXPECT_NEAR(outputAt(interpreted[out_buffer], o), outputAt(first[out_buffer], o),
                  2e-6 * abs_sum[static_cast<size_t>(o)] + 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(Reductions, SimtFolds, ::testing::Range(0, static_cast<int>(foldCases().size())),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return foldCases()[static_cast<size_t>(i.param)].name;
                         });

// At production shapes (lowered only, nothing run): R1's bias gradient, a 100M-element loss and
// four 25M-element rows fill a wave of an H200's blocks (132 SMs x 8), and the second pass
// folds one partial per block of the first.
TEST(SimtFoldShapes, ProductionFoldsUseAWaveOfBlocks) {
  for (const FoldCase& fc : {FoldCase{"bias_grad_16384x1024", "sum_to", "sum", {16384, 1024}, {}, {1024}},
                             FoldCase{"loss_100M", "reduce", "mean", {100000000}, {0}, {}},
                             FoldCase{"rows_4x25M", "reduce", "sum", {4, 25000000}, {1}, {}}}) {
    SCOPED_TRACE(fc.name);
    const BuiltFold f = buildFold(fc);
    ASSERT_EQ(f.group.kernels.size(), 2u);
    const codegen::LaunchConfig first = codegen::launchConfig(f.group.kernels[0]);
    EXPECT_GE(first.grid, 132 * 8);
    EXPECT_LE(first.grid, 2 * 132 * 8);
    // The second pass folds each output's partials: one per slab (or chunk), a few hundred.
    const codegen::Kernel& second = f.group.kernels[1];
    EXPECT_GE(second.rowSize(), 8);
    EXPECT_LE(second.rowSize(), 2 * 132 * 8);
  }
  // Folds one wave finishes in a few microseconds are one kernel: a second launch would cost
  // more than it saves. 64 rows of 1024 columns; R1's last bias gradient, 16384 rows of one.
  EXPECT_EQ(buildFold({"bias_grad_64x1024", "sum_to", "sum", {64, 1024}, {}, {1024}}).group.kernels.size(), 1u);
  EXPECT_EQ(buildFold({"bias_grad_16384x1", "sum_to", "sum", {16384, 1}, {}, {1}}).group.kernels.size(), 1u);
}

// A fold's pieces fill one wave of the target's SMs, and its second pass reads as many partials
// as the first pass's grid writes. R1's [16384, 1024] -> [1024] bias gradient: 32 strips of 32
// columns; a wave of 8 blocks a SM is 1056 blocks on an H200 (132 SMs), 864 on an A100 (108), so
// ceil(1056 / 32) = 33 slabs of ceil(16384 / 33) = 497 rows, or 27 slabs of 607 rows.
TEST(SimtFoldShapes, PiecesFillAWaveOfTheTargetsSms) {
  const FoldCase fc{"bias_grad_16384x1024", "sum_to", "sum", {16384, 1024}, {}, {1024}};
  for (auto [target, slabs] : {std::pair{h200Target(), int64_t{33}}, std::pair{a100Target(), int64_t{27}}}) {
    SCOPED_TRACE(target.name);
    const BuiltFold f = buildFold(fc, target);
    ASSERT_EQ(f.group.kernels.size(), 2u);
    EXPECT_EQ(f.group.kernels[0].space, (std::vector<int64_t>{slabs, 1024}));
    EXPECT_EQ(codegen::launchConfig(f.group.kernels[0]), (codegen::LaunchConfig{slabs * 32, 256}));
    EXPECT_EQ(f.group.kernels[1].rowSize(), slabs);
    EXPECT_EQ(codegen::launchConfig(f.group.kernels[1]).grid, 32);
  }
}

// The losses' totals are folds too: a 100M-element bce_with_logits and the mean of 50M rows'
// softmax cross-entropies spread over a wave of blocks, where each was one block before.
TEST(SimtFoldShapes, LossTotalsUseAWaveOfBlocks) {
  CaseBuilder bce("bce_100M");
  bce.op("kiln.bce_with_logits", {bce.input("x", DType::f32, S({100000000})), bce.input("y", DType::f32, S({100000000}))});
  CaseBuilder xent("softmax_xent_50M_rows");
  xent.op("kiln.softmax_cross_entropy",
          {xent.input("x", DType::f32, S({50000000, 2})), xent.input("y", DType::i64, S({50000000}))});
  for (CaseBuilder* b : {&bce, &xent}) {
    OpCase c = b->take();
    SCOPED_TRACE(c.name);
    auto g = codegen::lowerGroup(c.group, c.symbols);
    ASSERT_TRUE(g) << g.status().message();
    ASSERT_GE(g->kernels.size(), 2u);
    const codegen::Kernel& total = g->kernels[g->kernels.size() - 2];  // the first pass of the total
    EXPECT_EQ(total.kind, codegen::KernelKind::ColumnReduce);
    EXPECT_GE(codegen::launchConfig(total).grid, 132 * 8);
    EXPECT_EQ(g->kernels.back().kind, codegen::KernelKind::ColumnReduce);
  }
}

// The emulator itself: what it must run, and the mistakes it must catch.
codegen::CudaModule handWritten(const std::string& kernel, const std::string& body) {
  codegen::CudaModule m;
  m.source = codegen::cudaPrelude() + "\nextern \"C\" __global__ void " + kernel + body + "\n";
  m.kernels.push_back({kernel, {}, 0, 0});
  return m;
}

TEST(Simt, BlockReduceAndScanAcrossWarps) {
  // The prelude's block reduction (shuffles + shared scratch) and the jagged-offsets scan, with
  // a block of 96 threads over 200 values: sums known in closed form.
  auto m = simt::HostModule::compile(handWritten(
      "simt_reduce_scan", R"((const float* x, float* sum, const int* len, long long* off, int* err) {
  __shared__ float scratch[32];
  float acc = 0.0f;
  for (int i = threadIdx.x; i < 200; i += blockDim.x) acc += x[i];
  const float s = kiln_block_reduce<float, kiln_fn::SumCombiner>(acc, scratch);
  if (threadIdx.x == 0) sum[blockIdx.x] = s;
  kiln_bag_offsets(len, off + blockIdx.x * 201, 200LL, 1000000LL, err, 0);
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> x(200);
  std::vector<int> len(200);
  for (int i = 0; i < 200; ++i) x[static_cast<size_t>(i)] = static_cast<float>(i), len[static_cast<size_t>(i)] = i % 7;
  std::vector<float> sum(2, -1);
  std::vector<long long> off(2 * 201, -1);
  int err[2] = {0, 0};
  ASSERT_TRUE((*m)->launch("simt_reduce_scan", {2, 96}, {x.data(), sum.data(), len.data(), off.data(), err}).isOk());
  EXPECT_EQ(sum[0], 199 * 200 / 2);
  EXPECT_EQ(sum[1], 199 * 200 / 2);
  long long want = 0;
  for (int b = 0; b < 200; ++b) {
    ASSERT_EQ(off[static_cast<size_t>(b)], want) << b;
    ASSERT_EQ(off[201 + static_cast<size_t>(b)], want) << b;
    want += b % 7;
  }
  EXPECT_EQ(off[200], want);
  EXPECT_EQ(err[0], 0);
}

TEST(Simt, BarrierNotEveryThreadReachesIsADeadlock) {
  // Lane 0 waits at __syncthreads for lanes that wait at a shuffle for lane 0: a GPU hangs.
  auto m = simt::HostModule::compile(handWritten("simt_divergent", R"((float* x) {
  if (threadIdx.x == 0) __syncthreads();
  else x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> x(32);
  Status s = (*m)->launch("simt_divergent", {1, 32}, {x.data()});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("simt_divergent"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("deadlock"), std::string::npos) << s.message();
}

TEST(Simt, AMissingBarrierShowsInTheResults) {
  // Thread 0 publishes a value in shared memory; the others read it, once without a barrier in
  // between and once with one. Threads run in a shuffled order, so without the barrier some
  // read before thread 0 wrote, as they may on a GPU.
  auto m = simt::HostModule::compile(handWritten("simt_publish", R"((float* racy, float* synced) {
  __shared__ float value;
  if (threadIdx.x == 0) value = 1.0f + blockIdx.x;
  racy[blockIdx.x * blockDim.x + threadIdx.x] = value;
  __syncthreads();
  synced[blockIdx.x * blockDim.x + threadIdx.x] = value;
  __syncthreads();
  if (threadIdx.x == 0) value = 0.0f;
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> racy(4 * 64), synced(4 * 64);
  ASSERT_TRUE((*m)->launch("simt_publish", {4, 64}, {racy.data(), synced.data()}).isOk());
  int stale = 0;
  for (size_t i = 0; i < racy.size(); ++i) {
    const float want = 1.0f + static_cast<float>(i / 64);
    EXPECT_EQ(synced[i], want) << i;
    stale += racy[i] != want;
  }
  EXPECT_GT(stale, 0) << "every thread read after thread 0 wrote: threads ran in index order";
}

TEST(Simt, ShuffleWithAnExitedLaneIsAnError) {
  auto m = simt::HostModule::compile(handWritten("simt_exited_lane", R"((float* x) {
  if (threadIdx.x == 5) return;
  x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> x(32);
  Status s = (*m)->launch("simt_exited_lane", {1, 32}, {x.data()});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("exited"), std::string::npos) << s.message();
}

TEST(Simt, WriteOnePastTheEndIsAFaultNamingTheKernel) {
  auto m = simt::HostModule::compile(handWritten("simt_overrun", R"((float* x) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i <= 1000; i += (long long)gridDim.x * blockDim.x)
    x[i] = 2.0f;
})"));
  ASSERT_TRUE(m) << m.status().message();
  auto buf = simt::GuardedBuffer::allocate(1000 * sizeof(float), sizeof(float));
  ASSERT_TRUE(buf);
  Status s = (*m)->launch("simt_overrun", {4, 256}, {buf->data()});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("simt_overrun"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("memory access fault"), std::string::npos) << s.message();
  // The process is unharmed: a correct launch afterwards succeeds.
  auto ok = simt::GuardedBuffer::allocate(1001 * sizeof(float), sizeof(float));
  ASSERT_TRUE(ok);
  EXPECT_TRUE((*m)->launch("simt_overrun", {4, 256}, {ok->data()}).isOk());
}

TEST(Simt, CompileErrorCarriesTheCompilerOutput) {
  auto m = simt::HostModule::compile(handWritten("simt_bad", "(float* x) { x[0] = undeclared_name; }"));
  ASSERT_FALSE(m);
  EXPECT_NE(m.status().message().find("undeclared_name"), std::string::npos) << m.status().message();
}

}  // namespace
}  // namespace kiln::testing
