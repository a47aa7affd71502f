// Fused groups (kiln.fused ops, as the fusion pass builds them) on the GPU through the
// CudaExecutor: a GEMM epilogue is ONE cuBLASLt call, bags + concat one lookup kernel, slices +
// sparse updates the accumulate and row-update kernels. Results (and updated parameters) equal
// the unfused ops' CPU references; the arena is poisoned (NaN) before every run. Everything here
// skips without a GPU (ctest label `gpu`).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "ir/builder.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/cuda/cuda_executor.h"
#include "passes/fusion.h"
#include "runtime/parameter_store.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/nvrtc/activation_gradient_case.h"
#include "tests/nvrtc/residual_case.h"
#include "tests/nvrtc/bias_gradient_case.h"
#include "tests/nvrtc/fused_groups.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

// GPU results against the reference (tests/nvrtc/op_cases.h).
void expectClose(const ir::TensorView& got, const ir::TensorView& want, double tol, const std::string& what) {
  testing::expectClose(got, want, tol, what, "GPU");
}

#ifdef KILN_HAVE_CUDA_HEADERS

// A fused GEMM epilogue (matmul + bias + activation, as the fusion pass groups it) runs as ONE
// cuBLASLt call with the epilogue; its result equals the unfused ops' CPU references.
struct EpilogueCase {
  const char* name;
  const char* activation;  // "" for a bias-only epilogue
  DType dtype;
  double tol;
  // Mixed precision's form: the bf16 product widened to f32 at once, then an f32 bias and
  // activation (one bf16-in, f32-out call that skips the product's rounding).
  bool widen = false;
};

class GpuGemmEpilogue : public ::testing::TestWithParam<EpilogueCase> {};

TEST_P(GpuGemmEpilogue, OneCublasLtCallMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const EpilogueCase ec = GetParam();
  const int64_t m = 37, n = 24, k = 50;
  ir::Module module;
  // The epilogue's numbers, not TF32's: exact f32 GEMMs (f32_strict) keep the f32 cases at 1e-4.
  module.mutableAttrs()["kiln.train"] =
      ir::Attribute(ir::AttrDict{{"precision", ir::Attribute(std::string("f32_strict"))}});
  ir::Function& f = module.addFunction("f");
  f.body().addBlock();
  ir::Builder b(f.entry());
  std::mt19937 rng(11);
  std::map<const Value*, ir::HostTensor> values;
  runtime::cpu::Batch batch;
  auto input = [&](const char* name, ir::Shape shape, DType dtype) {
    auto op = b.createWithTypes("kiln.input", {}, {TensorType(dtype, shape)}, {{"name", Attribute(name)}});
    EXPECT_TRUE(op);
    Value* v = (*op)->result();
    std::vector<int64_t> dims;
    for (const Dim& d : shape) dims.push_back(d.size());
    ir::HostTensor t(dtype, dims);
    fillTensor(t, Fill::Normal, 0, rng);
    values[v] = t;
    return v;
  };
  Value* x = input("x", S({m, k}), ec.dtype);
  Value* w = input("w", S({n, k}), ec.dtype);
  Value* bias = input("b", S({n}), ec.widen ? DType::f32 : ec.dtype);
  for (const auto& [v, t] : values) batch[v->definingOp()->strAttr("name")] = t.view;
  std::vector<ir::Op*> members;
  auto add = [&](const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    auto op = b.create(name, operands, std::move(attrs));
    EXPECT_TRUE(op) << op.status().message();
    members.push_back(*op);
    return (*op)->result();
  };
  Value* y = add("kiln.matmul", {x, w}, {{"transpose_b", Attribute(true)}});
  if (ec.widen) y = add("kiln.cast", {y}, {{"to", Attribute("f32")}});
  y = add("kiln.add", {y, bias});
  if (*ec.activation) y = add(ec.activation, {y});
  ASSERT_TRUE(b.createWithTypes("func.return", {y}, {}));
  f.setResultTypes({y->type()});
  std::vector<const ir::Op*> flat(members.begin(), members.end());
  ASSERT_TRUE(referenceRun(flat, {}, values).isOk());
  const ir::HostTensor want = values.at(y);
  fuseOps(f, members, "gemm_epilogue");

  auto session = cuda::CudaSession::create();
  ASSERT_TRUE(session) << session.status().message();
  cuda::CudaExecutorOptions options;
  options.poison_arena = true;
  auto ex = cuda::CudaExecutor::create(f, {}, *session, options);
  ASSERT_TRUE(ex) << ex.status().message();
  EXPECT_EQ((*ex)->numGemms(), 1);
  EXPECT_EQ((*ex)->numKernels(), 0) << "the epilogue runs inside cuBLASLt";
  for (int run = 0; run < 2; ++run) {  // eager, then captured
    auto out = (*ex)->run(batch);
    ASSERT_TRUE(out) << out.status().message();
    expectClose((*out)[0].view, want.view, ec.tol, std::string(ec.name) + " run " + std::to_string(run));
  }
}

INSTANTIATE_TEST_SUITE_P(Epilogues, GpuGemmEpilogue,
                         ::testing::Values(EpilogueCase{"bias_f32", "", DType::f32, 1e-4},
                                           EpilogueCase{"bias_relu_f32", "kiln.relu", DType::f32, 1e-4},
                                           EpilogueCase{"bias_gelu_f32", "kiln.gelu", DType::f32, 1e-4},
                                           EpilogueCase{"bias_relu_bf16", "kiln.relu", DType::bf16, 3e-2},
                                           EpilogueCase{"widened_bias_relu_bf16", "kiln.relu", DType::bf16, 1e-2, true}),
                         [](const ::testing::TestParamInfo<EpilogueCase>& i) {
                           return std::string(i.param.name);
                         });

// A weight gradient and the bias gradient beside it (tests/nvrtc/bias_gradient_case.h) as ONE
// cuBLASLt call with its BGRADA/BGRADB epilogue, against the unfused ops' CPU references; the
// case's tolerances cover summing g or its TF32 rounding (cuBLASLt does not say which).
class GpuBiasGradient : public ::testing::TestWithParam<BiasGradientCase> {};

TEST_P(GpuBiasGradient, OneCublasLtCallMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const BiasGradientCase bc = GetParam();
  auto bf = buildBiasGradient(bc);
  fuseOps(*bf->f, bf->group, "gemm_epilogue");
  auto session = cuda::CudaSession::create();
  ASSERT_TRUE(session) << session.status().message();
  cuda::CudaExecutorOptions options;
  options.poison_arena = true;
  auto ex = cuda::CudaExecutor::create(*bf->f, {}, *session, options);
  ASSERT_TRUE(ex) << ex.status().message();
  EXPECT_EQ((*ex)->numGemms(), 1);
  EXPECT_EQ((*ex)->numKernels(), bc.bf16 ? 1 : 0) << "only the narrowing cast of g is a kernel";
  for (int run = 0; run < 2; ++run) {  // eager, then captured
    auto out = (*ex)->run(bf->inputs);
    ASSERT_TRUE(out) << out.status().message();
    expectBiasGradientsClose(*out, *bf, bc, "GPU run " + std::to_string(run));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuBiasGradient, ::testing::ValuesIn(biasGradientCases()),
                         [](const ::testing::TestParamInfo<BiasGradientCase>& i) {
                           return std::string(i.param.name);
                         });

// A layer's activation backward as cuBLASLt's DRELU/DGELU epilogue (tests/nvrtc/
// activation_gradient_case.h), the forward GEMM writing the ReLU mask (RELU_AUX_BIAS), against
// the CPU references: the one check of the mask's layout, which only cuBLASLt writes and reads.
class GpuActivationGradient : public ::testing::TestWithParam<ActivationGradientCase> {};

TEST_P(GpuActivationGradient, DerivativeInTheGemmEpilogueMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const ActivationGradientCase ac = GetParam();
  auto af = buildActivationGradient(ac);
  auto r = af->fuseForGpu();
  ASSERT_TRUE(r) << r.status().message();
  auto session = cuda::CudaSession::create();
  ASSERT_TRUE(session) << session.status().message();
  cuda::CudaExecutorOptions options;
  options.poison_arena = true;
  auto ex = cuda::CudaExecutor::create(*af->f, {}, *session, options);
  ASSERT_TRUE(ex) << ex.status().message();
  EXPECT_EQ((*ex)->numGemms(), 2);
  EXPECT_EQ((*ex)->numKernels(), std::string(ac.activation) == "relu" ? 0 : 1);
  for (int run = 0; run < 2; ++run) {  // eager, then captured
    auto out = (*ex)->run(af->inputs);
    ASSERT_TRUE(out) << out.status().message();
    expectActivationGradientClose(*out, *af, ac, "GPU run " + std::to_string(run));
  }
}

INSTANTIATE_TEST_SUITE_P(Activations, GpuActivationGradient, ::testing::ValuesIn(activationGradientCases()),
                         [](const ::testing::TestParamInfo<ActivationGradientCase>& i) {
                           return std::string(i.param.name);
                         });

// Matrices added in GEMM epilogues as cuBLASLt's C with beta = 1 (tests/nvrtc/residual_case.h),
// before a bias and a ReLU and alone, and the sibling kernel reading their sum.
class GpuResidual : public ::testing::TestWithParam<ResidualCase> {};

TEST_P(GpuResidual, MatrixAddedAsCMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  const ResidualCase rc = GetParam();
  auto rf = buildResidual(rc);
  auto r = rf->fuseForGpu();
  ASSERT_TRUE(r) << r.status().message();
  auto session = cuda::CudaSession::create();
  ASSERT_TRUE(session) << session.status().message();
  cuda::CudaExecutorOptions options;
  options.poison_arena = true;
  auto ex = cuda::CudaExecutor::create(*rf->f, {}, *session, options);
  ASSERT_TRUE(ex) << ex.status().message();
  EXPECT_EQ((*ex)->numGemms(), 2);
  EXPECT_EQ((*ex)->numKernels(), 1);
  for (int run = 0; run < 2; ++run) {  // eager, then captured
    auto out = (*ex)->run(rf->inputs);
    ASSERT_TRUE(out) << out.status().message();
    expectResidualClose(*out, *rf, rc, "GPU run " + std::to_string(run));
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, GpuResidual, ::testing::ValuesIn(residualCases()),
                         [](const ::testing::TestParamInfo<ResidualCase>& i) { return std::string(i.param.name); });

// A function with sources as inputs and parameters, built flat, its reference computed, then
// fused; run on the GPU through the executor.
struct GpuFusedCase {
  ir::Module module;
  ir::Function* f = nullptr;
  ir::Builder b;
  std::mt19937 rng{5};
  std::map<const Value*, ir::HostTensor> values;  // sources, then the reference's results
  runtime::cpu::Batch batch;
  runtime::ParameterStore store;
  std::vector<const ir::Op*> ops;

  GpuFusedCase() {
    f = &module.addFunction("f");
    f->body().addBlock();
    b.setInsertionPointToEnd(f->entry());
  }
  Value* source(const char* kind, const std::string& name, DType t, ir::Shape shape, Fill fill,
                int64_t range) {
    auto op = b.createWithTypes(kind, {}, {TensorType(t, shape)}, {{"name", Attribute(name)}});
    EXPECT_TRUE(op) << op.status().message();
    Value* v = (*op)->result();
    std::vector<int64_t> dims;
    for (const Dim& d : shape) dims.push_back(d.size());
    ir::HostTensor h(t, dims);
    fillTensor(h, fill, range, rng);
    values[v] = h;
    if (std::string(kind) == "kiln.parameter") store.set(name, h);
    return v;
  }
  Value* input(const std::string& name, DType t, ir::Shape shape, Fill fill = Fill::Normal,
               int64_t range = 0) {
    return source("kiln.input", name, t, std::move(shape), fill, range);
  }
  Value* param(const std::string& name, DType t, ir::Shape shape, Fill fill = Fill::Normal) {
    return source("kiln.parameter", name, t, std::move(shape), fill, 0);
  }
  ir::Op* op(const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    auto r = b.create(name, operands, std::move(attrs));
    EXPECT_TRUE(r) << name << ": " << r.status().message();
    ops.push_back(*r);
    return *r;
  }
  // The function on the GPU: a session holding the case's parameters (`session`), and an
  // executor of f.
  Expected<std::unique_ptr<cuda::CudaExecutor>> executor(bool poison_arena,
                                                         runtime::Tracer* tracer = nullptr) {
    auto s = cuda::CudaSession::create();
    if (!s) return s.status();
    session = s.take();
    KILN_RETURN_IF_ERROR(session->uploadParameters(store));
    cuda::CudaExecutorOptions options;
    options.poison_arena = poison_arena;
    options.tracer = tracer;
    return cuda::CudaExecutor::create(*f, {}, session, options);
  }
  std::shared_ptr<cuda::CudaSession> session;

  // The batch views the inputs; call once every source exists.
  void bindInputs() {
    for (const auto& [v, t] : values)
      if (v->definingOp()->name() == "kiln.input") batch[v->definingOp()->strAttr("name")] = t.view;
  }
  std::vector<ir::Op*> members(size_t begin, size_t end) const {
    std::vector<ir::Op*> m;
    for (size_t i = begin; i < end; ++i) m.push_back(const_cast<ir::Op*>(ops[i]));
    return m;
  }
};

TEST(GpuFused, LookupGemmEpilogueAndReductionMatchCpuReference) {
  SKIP_WITHOUT_GPU();
  GpuFusedCase c;
  const int64_t batch = 33;
  Value* dense = c.input("dense", DType::f32, S({batch, 5}));
  Value* t0 = c.param("tables.0", DType::f32, S({50, 16}));
  Value* t1 = c.param("tables.1", DType::f32, S({20, 40}));
  Value* ids0 = c.input("cats.0", DType::i64, S({batch, 3}), Fill::Ids, 50);
  Value* ids1 = c.input("cats.1", DType::i32, S({batch, 1}), Fill::Ids, 20);
  Value* w = c.param("top.weight", DType::f32, S({12, 5 + 16 + 40}));
  Value* bias = c.param("top.bias", DType::f32, S({12}));
  Value* scale = c.input("scale", DType::f32, S({12}));
  c.bindInputs();
  Value* e0 = c.op("kiln.embedding_bag", {t0, ids0})->result();
  Value* e1 = c.op("kiln.embedding_bag", {t1, ids1})->result();
  Value* x = c.op("kiln.concat", {dense, e0, e1}, {{"axis", Attribute(int64_t{1})}})->result();
  Value* mm = c.op("kiln.matmul", {x, w}, {{"transpose_b", Attribute(true)}})->result();
  Value* h = c.op("kiln.relu", {c.op("kiln.add", {mm, bias})->result()})->result();
  Value* p = c.op("kiln.mul", {h, scale})->result();
  Value* out =
      c.op("kiln.reduce", {p}, {{"kind", Attribute("sum")}, {"axes", Attribute::ints({1})}})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {x, out}, {}));
  c.f->setResultTypes({x->type(), out->type()});
  ASSERT_TRUE(referenceRun(c.ops, {}, c.values).isOk());
  const ir::HostTensor want_x = c.values.at(x), want_out = c.values.at(out);
  fuseOps(*c.f, c.members(0, 3), "embedding");
  fuseOps(*c.f, c.members(3, 6), "gemm_epilogue");
  fuseOps(*c.f, c.members(6, 8), "reduction");

  auto ex = c.executor(/*poison_arena=*/true);
  ASSERT_TRUE(ex) << ex.status().message();
  EXPECT_EQ((*ex)->numGemms(), 1);
  EXPECT_EQ((*ex)->numKernels(), 3) << "lookup, dense-column copy, reduction";
  for (int run = 0; run < 2; ++run) {
    auto got = (*ex)->run(c.batch);
    ASSERT_TRUE(got) << got.status().message();
    expectClose((*got)[0].view, want_x.view, 1e-6, "concat run " + std::to_string(run));
    expectClose((*got)[1].view, want_out.view, 1e-4, "reduce run " + std::to_string(run));
  }
}

TEST(GpuFused, EmbeddingUpdateGroupMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  GpuFusedCase c;
  const int64_t batch = 40;
  Value* t0 = c.param("tables.0", DType::f32, S({30, 8}));
  Value* s0 = c.param("tables.0.adagrad_sum", DType::f32, S({30, 8}), Fill::Positive);
  Value* t1 = c.param("tables.1", DType::f32, S({6, 64}));
  Value* s1 = c.param("tables.1.rowwise_adagrad_sum", DType::f32, S({6}), Fill::Positive);
  Value* ids0 = c.input("cats.0", DType::i64, S({batch, 2}), Fill::Ids, 30);
  Value* ids1 = c.input("cats.1", DType::i64, S({batch, 3}), Fill::Ids, 6);
  Value* grad = c.input("grad", DType::f32, S({batch, 80}));
  Value* lr = c.input("lr", DType::f32, {}, Fill::Positive);
  Value* step = c.input("step", DType::f32, {}, Fill::Ids, 4);
  c.bindInputs();
  auto slice = [&](int64_t start, int64_t limit) {
    return c
        .op("kiln.slice", {grad},
            {{"axis", Attribute(int64_t{1})}, {"start", Attribute(start)}, {"limit", Attribute(limit)}})
        ->result();
  };
  Value* g0 = slice(8, 16);
  c.op("kiln.embedding_bag_update", {t0, ids0, g0, s0, lr, step},
       {{"optimizer", Attribute("adagrad")}, {"lr", Attribute(0.1)}});
  Value* g1 = slice(16, 80);
  c.op("kiln.embedding_bag_update", {t1, ids1, g1, s1, lr, step},
       {{"optimizer", Attribute("rowwise_adagrad")}, {"lr", Attribute(0.05)}});
  ASSERT_TRUE(c.b.createWithTypes("func.return", {}, {}));
  ASSERT_TRUE(referenceRun(c.ops, {}, c.values).isOk());  // updates c.values; c.store keeps the start
  fuseOps(*c.f, c.members(0, 4), "embedding_update");

  auto ex = c.executor(/*poison_arena=*/false);
  ASSERT_TRUE(ex) << ex.status().message();
  EXPECT_EQ((*ex)->numKernels(), 6) << "clear, accumulate, row update per table; no slice copies";
  auto got = (*ex)->run(c.batch);
  ASSERT_TRUE(got) << got.status().message();
  ASSERT_TRUE(c.session->downloadParameters(c.store).isOk());
  for (Value* p : {t0, s0, t1, s1}) {
    const std::string name = p->definingOp()->strAttr("name");
    expectClose(c.store.find(name)->view, c.values.at(p).view, 1e-5, name);
  }
}

// Two streams through the executor: the jagged lookup and the sparse update on stream 1 (as the
// schedule pass places them), the dense part on stream 0, which reads the lookup, feeds the
// update, and reads the table the update then overwrites (the update must wait for it). Eager,
// captured and replayed runs, each from the same starting parameters, equal the CPU reference.
TEST(GpuStreams, TwoStreamStepMatchesCpuReferenceEagerCapturedAndReplayed) {
  SKIP_WITHOUT_GPU();
  GpuFusedCase c;
  const int64_t batch = 40, ids = 97;
  Value* dense = c.input("dense", DType::f32, S({batch, 16}));
  Value* table = c.param("tables.0", DType::f32, S({30, 16}));
  Value* w = c.param("w", DType::f32, S({16, 16}));
  Value* cats = c.input("cats.0", DType::i64, S({ids}), Fill::Ids, 30);
  Value* lengths = c.input("cats.0.lengths", DType::i32, S({batch}), Fill::Lengths, ids);
  Value* lr = c.input("lr", DType::f32, {}, Fill::Positive);
  Value* step = c.input("step", DType::f32, {}, Fill::Ids, 3);
  c.bindInputs();
  ir::Op* bag = c.op("kiln.embedding_bag", {table, cats, lengths}, {{"mode", Attribute("mean")}});
  bag->setAttr("kiln.stream", Attribute(int64_t{1}));
  Value* h = c.op("kiln.matmul", {dense, w})->result();
  Value* sum = c.op("kiln.add", {h, bag->result()})->result();
  Value* norm =
      c.op("kiln.reduce", {table}, {{"kind", Attribute("sum")}, {"axes", Attribute::ints({0, 1})}})->result();
  ir::Op* update = c.op("kiln.embedding_bag_update", {table, cats, lengths, sum, lr, step},
                        {{"optimizer", Attribute("sgd")}, {"lr", Attribute(0.1)}, {"mode", Attribute("mean")}});
  update->setAttr("kiln.stream", Attribute(int64_t{1}));
  ASSERT_TRUE(c.b.createWithTypes("func.return", {sum, norm}, {}));
  c.f->setResultTypes({sum->type(), norm->type()});
  ASSERT_TRUE(referenceRun(c.ops, {}, c.values).isOk());  // c.store keeps the starting table

  auto ex = c.executor(/*poison_arena=*/true);
  ASSERT_TRUE(ex) << ex.status().message();
  ASSERT_EQ((*ex)->plan().streams.size(), 2u);
  for (int run = 0; run < 3; ++run) {  // eager, captured, replayed
    runtime::ParameterStore start = c.store;
    ASSERT_TRUE(c.session->uploadParameters(start).isOk());  // same sizes: same device buffers
    auto got = (*ex)->run(c.batch);
    ASSERT_TRUE(got) << "run " << run << ": " << got.status().message();
    expectClose((*got)[0].view, c.values.at(sum).view, 1e-4, "sum run " + std::to_string(run));
    expectClose((*got)[1].view, c.values.at(norm).view, 1e-4, "norm run " + std::to_string(run));
    ASSERT_TRUE(c.session->downloadParameters(start).isOk());
    expectClose(start.find("tables.0")->view, c.values.at(table).view, 1e-5, "table run " + std::to_string(run));
  }
  EXPECT_TRUE((*ex)->graphCaptured());
}

// A traced run: every kernel and GEMM once, on its stream's track, inside the host's view of
// the run, results unchanged; runs while the tracer is off still capture the graph.
TEST(GpuStreams, TracedRunTimesEveryKernelAndGemmOnItsStream) {
  SKIP_WITHOUT_GPU();
  GpuFusedCase c;
  const int64_t batch = 40, ids = 97;
  Value* dense = c.input("dense", DType::f32, S({batch, 16}));
  Value* table = c.param("tables.0", DType::f32, S({30, 16}));
  Value* w = c.param("w", DType::f32, S({16, 16}));
  Value* cats = c.input("cats.0", DType::i64, S({ids}), Fill::Ids, 30);
  Value* lengths = c.input("cats.0.lengths", DType::i32, S({batch}), Fill::Lengths, ids);
  c.bindInputs();
  ir::Op* bag = c.op("kiln.embedding_bag", {table, cats, lengths}, {{"mode", Attribute("sum")}});
  bag->setAttr("kiln.stream", Attribute(int64_t{1}));
  Value* h = c.op("kiln.matmul", {dense, w})->result();
  Value* sum = c.op("kiln.add", {h, bag->result()})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {sum}, {}));
  c.f->setResultTypes({sum->type()});
  ASSERT_TRUE(referenceRun(c.ops, {}, c.values).isOk());

  runtime::Tracer tracer;
  tracer.setRecording(false);
  auto ex = c.executor(/*poison_arena=*/false, &tracer);
  ASSERT_TRUE(ex) << ex.status().message();
  ASSERT_TRUE((*ex)->run(c.batch));  // eager, untraced
  EXPECT_TRUE(tracer.events().empty());
  tracer.setRecording(true);
  double before = tracer.nowUs();
  auto got = (*ex)->run(c.batch);
  double after = tracer.nowUs();
  ASSERT_TRUE(got) << got.status().message();
  expectClose((*got)[0].view, c.values.at(sum).view, 1e-4, "traced run");
  tracer.setRecording(false);

  int kernels = 0, gemms = 0, waits = 0;
  std::set<int> tracks;
  for (const runtime::TraceEvent& e : tracer.events()) {
    EXPECT_GE(e.ts_us, before - 50) << e.name;  // the origin is read on the host after the device
    EXPECT_LE(e.ts_us + e.dur_us, after + 50) << e.name;
    EXPECT_GE(e.dur_us, 0) << e.name;
    if (e.category == runtime::TraceCategory::Wait) {
      ++waits;
      EXPECT_EQ(e.track, runtime::kHostTrack);
      continue;
    }
    tracks.insert(e.track);
    (e.category == runtime::TraceCategory::Gemm ? gemms : kernels)++;
  }
  EXPECT_EQ(kernels, (*ex)->numKernels());
  EXPECT_EQ(gemms, (*ex)->numGemms());
  EXPECT_EQ(waits, 1);
  EXPECT_EQ(tracks, (std::set<int>{runtime::streamTrack(0), runtime::streamTrack(1)}));
  ASSERT_TRUE((*ex)->run(c.batch));
  EXPECT_TRUE((*ex)->graphCaptured());
}

// Jagged lengths that claim more ids than the batch holds: a clear error naming the lengths.
TEST(GpuStreams, BadJaggedLengthsAreAClearError) {
  SKIP_WITHOUT_GPU();
  GpuFusedCase c;
  Value* table = c.param("tables.0", DType::f32, S({10, 8}));
  Value* cats = c.input("cats.0", DType::i64, S({12}), Fill::Ids, 10);
  Value* lengths = c.input("cats.0.lengths", DType::i32, S({4}), Fill::Lengths, 12);
  c.bindInputs();
  Value* e = c.op("kiln.embedding_bag", {table, cats, lengths})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {e}, {}));
  c.f->setResultTypes({e->type()});
  auto ex = c.executor(/*poison_arena=*/false);
  ASSERT_TRUE(ex) << ex.status().message();
  c.values.at(lengths).as<int32_t>()[0] += 5;
  auto got = (*ex)->run(c.batch);
  ASSERT_FALSE(got);
  EXPECT_NE(got.status().message().find("cats.0.lengths"), std::string::npos) << got.status().message();
}

#endif  // KILN_HAVE_CUDA_HEADERS

}  // namespace
}  // namespace kiln::testing
