// The CPU executor against the reference interpreter (ir/interpreter.h) and against naive loops
// written here, on an MLP and an embedding model; memory plans against what the executor
// actually touches.
#include "runtime/cpu/executor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "codegen/lower_cpu.h"
#include "ir/interpreter.h"
#include "passes/fusion.h"
#include "runtime_test_util.h"

namespace kiln::runtime::cpu {
namespace {

using ir::DType;
using ir::HostTensor;
using testing::expectClose;
using testing::parseOrDie;
using testing::randomTensor;

const char* kMlp = R"(
func.func @forward() -> (!kiln.tensor<Bx4xf32>) {
  %x = "kiln.input"() {name = "dense"} : () -> !kiln.tensor<Bx13xf32>
  %w0 = "kiln.parameter"() {init = "xavier_uniform", name = "bottom.0.weight"} : () -> !kiln.tensor<32x13xf32>
  %b0 = "kiln.parameter"() {init = "normal", name = "bottom.0.bias", std = 0.1} : () -> !kiln.tensor<32xf32>
  %w1 = "kiln.parameter"() {init = "xavier_normal", name = "bottom.1.weight"} : () -> !kiln.tensor<4x32xf32>
  %b1 = "kiln.parameter"() {init = "uniform", low = -0.5, high = 0.5, name = "bottom.1.bias"} : () -> !kiln.tensor<4xf32>
  %0 = "kiln.matmul"(%x, %w0) {transpose_b = true} : (!kiln.tensor<Bx13xf32>, !kiln.tensor<32x13xf32>) -> !kiln.tensor<Bx32xf32>
  %1 = "kiln.add"(%0, %b0) : (!kiln.tensor<Bx32xf32>, !kiln.tensor<32xf32>) -> !kiln.tensor<Bx32xf32>
  %2 = "kiln.relu"(%1) : (!kiln.tensor<Bx32xf32>) -> !kiln.tensor<Bx32xf32>
  %3 = "kiln.matmul"(%2, %w1) {transpose_b = true} : (!kiln.tensor<Bx32xf32>, !kiln.tensor<4x32xf32>) -> !kiln.tensor<Bx4xf32>
  %4 = "kiln.add"(%3, %b1) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
  %5 = "kiln.sigmoid"(%4) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  "func.return"(%5) : (!kiln.tensor<Bx4xf32>) -> ()
}
)";

// Two tables: one fixed-hotness feature, one variable-length (jagged, bounded ids), pooled,
// concatenated with a dense projection, reduced to a logit, scored with BCE.
const char* kEmbeddingModel = R"(
func.func @forward() -> (!kiln.tensor<f32>, !kiln.tensor<Bx1xf32>) {
  %dense = "kiln.input"() {name = "dense", role = "dense"} : () -> !kiln.tensor<Bx3xf32>
  %label = "kiln.input"() {name = "label", role = "label"} : () -> !kiln.tensor<Bx1xf32>
  %c0 = "kiln.input"() {name = "cats.0", role = "sparse", feature = 0} : () -> !kiln.tensor<Bx2xi64>
  %c1 = "kiln.input"() {name = "cats.1", role = "sparse", feature = 1} : () -> !kiln.tensor<?(3*B)xi64>
  %l1 = "kiln.input"() {name = "cats.1.lengths", role = "lengths", feature = 1} : () -> !kiln.tensor<Bxi32>
  %t0 = "kiln.parameter"() {embedding = true, init = "normal", std = 0.5, name = "tables.0"} : () -> !kiln.tensor<20x8xf32>
  %t1 = "kiln.parameter"() {embedding = true, init = "uniform", low = -0.5, high = 0.5, name = "tables.1"} : () -> !kiln.tensor<30x8xf32>
  %wd = "kiln.parameter"() {init = "xavier_uniform", name = "dense.weight"} : () -> !kiln.tensor<8x3xf32>
  %e0 = "kiln.embedding_bag"(%t0, %c0) {mode = "sum", table = "tables.0"} : (!kiln.tensor<20x8xf32>, !kiln.tensor<Bx2xi64>) -> !kiln.tensor<Bx8xf32>
  %e1 = "kiln.embedding_bag"(%t1, %c1, %l1) {mode = "mean", table = "tables.1"} : (!kiln.tensor<30x8xf32>, !kiln.tensor<?(3*B)xi64>, !kiln.tensor<Bxi32>) -> !kiln.tensor<Bx8xf32>
  %d = "kiln.matmul"(%dense, %wd) {transpose_b = true} : (!kiln.tensor<Bx3xf32>, !kiln.tensor<8x3xf32>) -> !kiln.tensor<Bx8xf32>
  %x = "kiln.concat"(%d, %e0, %e1) {axis = 1} : (!kiln.tensor<Bx8xf32>, !kiln.tensor<Bx8xf32>, !kiln.tensor<Bx8xf32>) -> !kiln.tensor<Bx24xf32>
  %t = "kiln.tanh"(%x) : (!kiln.tensor<Bx24xf32>) -> !kiln.tensor<Bx24xf32>
  %logit = "kiln.reduce"(%t) {axes = [1], keepdims = true, kind = "sum"} : (!kiln.tensor<Bx24xf32>) -> !kiln.tensor<Bx1xf32>
  %loss = "kiln.bce_with_logits"(%logit, %label) : (!kiln.tensor<Bx1xf32>, !kiln.tensor<Bx1xf32>) -> !kiln.tensor<f32>
  "func.return"(%loss, %logit) : (!kiln.tensor<f32>, !kiln.tensor<Bx1xf32>) -> ()
}
)";

struct Compiled {
  std::unique_ptr<ir::Module> module;
  codegen::Program program;
};

Compiled compile(const char* text, int64_t batch, codegen::CpuLoweringOptions options = {}) {
  Compiled c;
  c.module = parseOrDie(text);
  EXPECT_NE(c.module, nullptr);
  auto p = codegen::lowerForCpu(*c.module->lookup("forward"), {{"B", batch}}, options);
  EXPECT_TRUE(p.isOk()) << (p.isOk() ? "" : p.status().str());
  if (p.isOk()) c.program = p.take();
  return c;
}

std::unique_ptr<CpuExecutor> makeExecutor(const codegen::Program& p, ExecutorOptions o = {}) {
  auto ex = CpuExecutor::create(p, o);
  EXPECT_TRUE(ex.isOk()) << (ex.isOk() ? "" : ex.status().str());
  return ex.isOk() ? ex.take() : nullptr;
}

std::map<std::string, HostTensor> referenceTensors(const std::map<std::string, HostTensor>& batch,
                                                   const ParameterStore& params) {
  std::map<std::string, HostTensor> all = batch;
  for (const auto& name : params.names()) all[name] = *params.find(name);
  return all;
}

Batch viewsOf(const std::map<std::string, HostTensor>& tensors) {
  Batch b;
  for (const auto& [k, v] : tensors) b[k] = v.view;
  return b;
}

TEST(CpuExecutor, MlpEqualsNaiveLoopsAndInterpreter) {
  const int64_t B = 37;
  Compiled c = compile(kMlp, B);
  ParameterStore params;
  ASSERT_TRUE(params.initializeFrom(*c.module, 1234).isOk());
  std::map<std::string, HostTensor> batch = {{"dense", randomTensor(DType::f32, {B, 13}, 9)}};

  // By hand: sigmoid(relu(x W0^T + b0) W1^T + b1).
  const float* x = batch["dense"].as<float>();
  const float *w0 = params.find("bottom.0.weight")->as<float>(), *b0 = params.find("bottom.0.bias")->as<float>();
  const float *w1 = params.find("bottom.1.weight")->as<float>(), *b1 = params.find("bottom.1.bias")->as<float>();
  HostTensor want(DType::f32, {B, 4});
  for (int64_t i = 0; i < B; ++i) {
    double h[32];
    for (int j = 0; j < 32; ++j) {
      double s = b0[j];
      for (int k = 0; k < 13; ++k) s += double(x[i * 13 + k]) * w0[j * 13 + k];
      h[j] = s > 0 ? s : 0;
    }
    for (int j = 0; j < 4; ++j) {
      double s = b1[j];
      for (int k = 0; k < 32; ++k) s += h[k] * w1[j * 32 + k];
      want.as<float>()[i * 4 + j] = static_cast<float>(1 / (1 + std::exp(-s)));
    }
  }
  auto ref = ir::interpret(*c.module->lookup("forward"), referenceTensors(batch, params), {{"B", B}});
  ASSERT_TRUE(ref.isOk()) << ref.status().str();
  for (int threads : {1, 4}) {
    auto ex = makeExecutor(c.program, {.threads = threads});
    auto got = ex->run(viewsOf(batch), params);
    ASSERT_TRUE(got.isOk()) << got.status().str();
    ASSERT_EQ(got->size(), 1u);
    expectClose((*got)[0], want, 1e-5, 1e-6, "vs naive");
    expectClose((*got)[0], (*ref)[0], 1e-5, 1e-6, "vs interpreter");
    EXPECT_EQ(ex->referenceLaunches(), 0) << "every MLP op has a fast kernel";
  }
}

// GEMM epilogues: a matmul whose result only its bias add (and activation) read runs them as one
// oneDNN product with post-ops; the MLP's first layer takes add + relu, its second the add
// (sigmoid has no post-op here). A bf16 product widened to f32 at once takes the cast too. The
// results equal the interpreter's; where the intermediate value is also a result of the
// program, nothing fuses.
const char* kBf16Layer = R"(
func.func @forward() -> (!kiln.tensor<Bx24xf32>) {
  %x = "kiln.input"() {name = "dense"} : () -> !kiln.tensor<Bx40xf32>
  %w = "kiln.parameter"() {init = "xavier_uniform", name = "w"} : () -> !kiln.tensor<24x40xf32>
  %b = "kiln.parameter"() {init = "normal", std = 0.5, name = "b"} : () -> !kiln.tensor<24xf32>
  %x16 = "kiln.cast"(%x) {to = "bf16"} : (!kiln.tensor<Bx40xf32>) -> !kiln.tensor<Bx40xbf16>
  %w16 = "kiln.cast"(%w) {to = "bf16"} : (!kiln.tensor<24x40xf32>) -> !kiln.tensor<24x40xbf16>
  %y16 = "kiln.matmul"(%x16, %w16) {transpose_b = true} : (!kiln.tensor<Bx40xbf16>, !kiln.tensor<24x40xbf16>) -> !kiln.tensor<Bx24xbf16>
  %y = "kiln.cast"(%y16) {to = "f32"} : (!kiln.tensor<Bx24xbf16>) -> !kiln.tensor<Bx24xf32>
  %z = "kiln.add"(%y, %b) : (!kiln.tensor<Bx24xf32>, !kiln.tensor<24xf32>) -> !kiln.tensor<Bx24xf32>
  %r = "kiln.gelu"(%z) : (!kiln.tensor<Bx24xf32>) -> !kiln.tensor<Bx24xf32>
  "func.return"(%r) : (!kiln.tensor<Bx24xf32>) -> ()
}
)";

TEST(CpuExecutor, GemmEpiloguesFuseAndEqualTheInterpreter) {
  const int64_t B = 53;
  struct Case {
    const char* text;
    int epilogues;
    double rtol, atol;
  };
  // bf16: the interpreter rounds the product to bf16 before the bias add; the fused product
  // does not: 2^-9 of a product of magnitude up to about 4 (40 terms of xavier weights).
  for (const Case& k : {Case{kMlp, 2, 1e-5, 1e-4}, Case{kBf16Layer, 1, 1e-2, 1e-2}}) {
    Compiled c = compile(k.text, B);
    ParameterStore params;
    ASSERT_TRUE(params.initializeFrom(*c.module, 11).isOk());
    const int64_t width = k.text == kMlp ? 13 : 40;
    std::map<std::string, HostTensor> batch = {{"dense", randomTensor(DType::f32, {B, width}, 4)}};
    auto ref = ir::interpret(*c.module->lookup("forward"), referenceTensors(batch, params), {{"B", B}});
    ASSERT_TRUE(ref.isOk()) << ref.status().str();
    for (bool fast : {true, false}) {
      auto ex = makeExecutor(c.program, {.threads = 2, .use_fast_kernels = fast});
      EXPECT_EQ(ex->gemmEpilogues(), fast ? k.epilogues : 0);
      auto got = ex->run(viewsOf(batch), params);
      ASSERT_TRUE(got.isOk()) << got.status().str();
      expectClose((*got)[0], (*ref)[0], k.rtol, k.atol, "vs interpreter");
    }
  }
  // The first layer's product is also returned: it must be written, so nothing fuses into it.
  std::string returned = kMlp;
  returned.replace(returned.find("-> (!kiln.tensor<Bx4xf32>)"), 26, "-> (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx32xf32>)");
  returned.replace(returned.find(R"("func.return"(%5) : (!kiln.tensor<Bx4xf32>) -> ())"), 49,
                   R"("func.return"(%5, %0) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx32xf32>) -> ())");
  Compiled c = compile(returned.c_str(), B);
  auto ex = makeExecutor(c.program, {.threads = 2});
  EXPECT_EQ(ex->gemmEpilogues(), 1) << "only the second layer";
}

// With a recording tracer, every launch of the program becomes one event, named by its op, on
// its stream's track, and --profile counts the same launches.
TEST(CpuExecutor, TracesEveryLaunchOnItsStream) {
  const int64_t B = 8;
  Compiled c = compile(kMlp, B);
  ParameterStore params;
  ASSERT_TRUE(params.initializeFrom(*c.module, 1).isOk());
  std::map<std::string, HostTensor> batch = {{"dense", randomTensor(DType::f32, {B, 13}, 3)}};
  Tracer tracer;
  tracer.setRecording(false);
  auto ex = makeExecutor(c.program, {.profile = true, .tracer = &tracer, .rank = 3});
  ASSERT_TRUE(ex->run(viewsOf(batch), params).isOk());
  EXPECT_TRUE(tracer.events().empty()) << "nothing while not recording";
  tracer.setRecording(true);
  ASSERT_TRUE(ex->run(viewsOf(batch), params).isOk());

  // What the program says should run, in its global order.
  std::vector<std::pair<std::string, int>> want;  // (op, track)
  for (const codegen::Stream& st : c.program.streams)
    for (const codegen::Instruction& in : st.instrs)
      if (in.kind == codegen::InstrKind::Launch) want.push_back({in.op, streamTrack(st.id)});
  std::vector<TraceEvent> events = tracer.events();
  ASSERT_EQ(events.size(), want.size());
  std::multiset<std::pair<std::string, int>> got_set, want_set(want.begin(), want.end());
  for (const TraceEvent& e : events) {
    got_set.insert({e.name, e.track});
    EXPECT_EQ(e.rank, 3);
    EXPECT_EQ(e.category,
              e.name == ir::opName(ir::OpCode::Matmul) ? TraceCategory::Gemm : TraceCategory::Kernel)
        << e.name;
    EXPECT_GE(e.dur_us, 0);
  }
  EXPECT_EQ(got_set, want_set);
  for (size_t i = 1; i < events.size(); ++i) {
    if (events[i].track == events[i - 1].track) {
      EXPECT_GE(events[i].ts_us, events[i - 1].ts_us + events[i - 1].dur_us)
          << "one thread: launches do not overlap";
    }
  }
  int64_t profiled = 0;
  for (const auto& [name, t] : ex->profile()) profiled += t.launches;
  EXPECT_EQ(profiled, static_cast<int64_t>(2 * want.size()));
}

std::map<std::string, HostTensor> embeddingBatch(int64_t B, uint32_t seed) {
  std::map<std::string, HostTensor> batch;
  batch["dense"] = randomTensor(DType::f32, {B, 3}, seed);
  batch["label"] = randomTensor(DType::f32, {B, 1}, seed + 1, 0, 1);
  batch["cats.0"] = randomTensor(DType::i64, {B, 2}, seed + 2, 0, 20);
  HostTensor lengths(DType::i32, {B});
  int64_t n = 0;
  for (int64_t b = 0; b < B; ++b) n += lengths.as<int32_t>()[b] = static_cast<int32_t>((b * 7 + seed) % 4);
  batch["cats.1.lengths"] = lengths;
  batch["cats.1"] = randomTensor(DType::i64, {n}, seed + 3, 0, 30);  // fewer than the bound 3*B
  return batch;
}

TEST(CpuExecutor, EmbeddingModelEqualsInterpreter) {
  const int64_t B = 29;
  Compiled c = compile(kEmbeddingModel, B);
  ParameterStore params;
  ASSERT_TRUE(params.initializeFrom(*c.module, 7).isOk());
  auto batch = embeddingBatch(B, 5);
  auto ref = ir::interpret(*c.module->lookup("forward"), referenceTensors(batch, params), {{"B", B}});
  ASSERT_TRUE(ref.isOk()) << ref.status().str();
  for (bool fast : {true, false})
    for (int threads : {1, 3}) {
      auto ex = makeExecutor(c.program, {.threads = threads, .use_fast_kernels = fast});
      auto got = ex->run(viewsOf(batch), params);
      ASSERT_TRUE(got.isOk()) << got.status().str();
      ASSERT_EQ(got->size(), 2u);
      expectClose((*got)[0], (*ref)[0], 1e-5, 1e-6, "loss");
      expectClose((*got)[1], (*ref)[1], 1e-5, 1e-6, "logit");
      if (fast) {
        EXPECT_GT(ex->fastLaunches(), 0);
      } else {
        EXPECT_EQ(ex->fastLaunches(), 0);
      }
    }
}

TEST(CpuExecutor, BadInputsGetClearErrors) {
  Compiled c = compile(kEmbeddingModel, 4);
  ParameterStore params;
  ASSERT_TRUE(params.initializeFrom(*c.module, 7).isOk());
  auto ex = makeExecutor(c.program);
  auto batch = embeddingBatch(4, 1);

  auto missing = batch;
  missing.erase("label");
  auto r = ex->run(viewsOf(missing), params);
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().message().find("missing input \"label\""), std::string::npos) << r.status().message();

  auto wrong = batch;
  wrong["dense"] = randomTensor(DType::f32, {5, 3}, 1);
  r = ex->run(viewsOf(wrong), params);
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().message().find("input \"dense\" is f32[5, 3]"), std::string::npos) << r.status().message();

  auto too_many = batch;
  too_many["cats.1"] = randomTensor(DType::i64, {13}, 1, 0, 30);  // bound is 3*B = 12
  r = ex->run(viewsOf(too_many), params);
  ASSERT_FALSE(r.isOk());

  auto out_of_range = batch;
  out_of_range["cats.0"].as<int64_t>()[3] = 20;
  r = ex->run(viewsOf(out_of_range), params);
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().message().find("tables.0"), std::string::npos) << r.status().message();

  ParameterStore empty;
  r = ex->run(viewsOf(batch), empty);
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().message().find("is not in the parameter store"), std::string::npos);
}

// ---- Memory plans ------------------------------------------------------------------------------

// Buffers whose live ranges overlap must not share bytes, unless one writes over the other.
void expectNoOverlap(const codegen::Program& p) {
  for (const auto& a : p.buffers)
    for (const auto& b : p.buffers) {
      if (a.id >= b.id || !a.inArena() || !b.inArena() || a.first_use < 0 || b.first_use < 0) continue;
      if (b.in_place_of == a.id || a.in_place_of == b.id) continue;
      bool live_together = a.first_use <= b.last_use && b.first_use <= a.last_use;
      bool share_bytes = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
      if (live_together && share_bytes) ADD_FAILURE() << "%b" << a.id << " and %b" << b.id << " overlap";
    }
  for (const auto& b : p.buffers) {
    if (b.inArena()) {
      EXPECT_EQ(b.offset % 64, 0);
    }
  }
}

TEST(MemoryPlan, PeakEqualsMeasuredHighWaterMark) {
  for (const char* text : {kMlp, kEmbeddingModel})
    for (int64_t batch : {1, 16, 100}) {
      Compiled c = compile(text, batch);
      expectNoOverlap(c.program);
      ParameterStore params;
      ASSERT_TRUE(params.initializeFrom(*c.module, 3).isOk());
      auto ex = makeExecutor(c.program, {.threads = 2, .poison_arena = true});
      std::map<std::string, HostTensor> in =
          text == kMlp ? std::map<std::string, HostTensor>{{"dense", randomTensor(DType::f32, {batch, 13}, 2)}}
                       : embeddingBatch(batch, 2);
      auto got = ex->run(viewsOf(in), params);
      ASSERT_TRUE(got.isOk()) << got.status().str();
      EXPECT_EQ(ex->highWaterMark(), c.program.peak_bytes) << codegen::memoryPlanStr(c.program);
      // Independently of the executor's bookkeeping: no kernel wrote past the planned peak,
      // and the top buffer was written to its end.
      EXPECT_LE(ex->scanTouchedArenaBytes(), c.program.peak_bytes);
      EXPECT_EQ(ex->scanTouchedArenaBytes(), c.program.peak_bytes);
    }
}

// Pointwise groups: the fusion pass groups the elementwise chain, the lowering marks its launches,
// and the executor runs each group as one loop over the data. The results equal, to the bit, the
// same program lowered without fusion (every op its own fast kernel), and the interpreter's. The
// chain has a bias broadcast along rows, bf16 casts between f32 steps, a value read after the
// group (written) and values read only inside it (never written), over rows longer than one chunk.
const char* kPointwiseChain = R"(
func.func @forward() -> (!kiln.tensor<Bx1300xf32>, !kiln.tensor<Bx1300xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx1300xf32>
  %y = "kiln.input"() {name = "y"} : () -> !kiln.tensor<Bx1300xf32>
  %b = "kiln.parameter"() {init = "normal", std = 0.5, name = "b"} : () -> !kiln.tensor<1300xf32>
  %0 = "kiln.mul"(%x, %y) : (!kiln.tensor<Bx1300xf32>, !kiln.tensor<Bx1300xf32>) -> !kiln.tensor<Bx1300xf32>
  %1 = "kiln.add"(%0, %x) : (!kiln.tensor<Bx1300xf32>, !kiln.tensor<Bx1300xf32>) -> !kiln.tensor<Bx1300xf32>
  %2 = "kiln.add"(%1, %b) : (!kiln.tensor<Bx1300xf32>, !kiln.tensor<1300xf32>) -> !kiln.tensor<Bx1300xf32>
  %3 = "kiln.cast"(%2) {to = "bf16"} : (!kiln.tensor<Bx1300xf32>) -> !kiln.tensor<Bx1300xbf16>
  %4 = "kiln.sigmoid"(%3) : (!kiln.tensor<Bx1300xbf16>) -> !kiln.tensor<Bx1300xbf16>
  %5 = "kiln.cast"(%4) {to = "f32"} : (!kiln.tensor<Bx1300xbf16>) -> !kiln.tensor<Bx1300xf32>
  %6 = "kiln.mul"(%5, %1) : (!kiln.tensor<Bx1300xf32>, !kiln.tensor<Bx1300xf32>) -> !kiln.tensor<Bx1300xf32>
  "func.return"(%6, %1) : (!kiln.tensor<Bx1300xf32>, !kiln.tensor<Bx1300xf32>) -> ()
}
)";

TEST(CpuExecutor, PointwiseGroupsRunAsOneLoopAndEqualTheKernels) {
  const int64_t B = 37;
  Compiled plain = compile(kPointwiseChain, B);
  Compiled fused;
  fused.module = parseOrDie(kPointwiseChain);
  passes::FusionOptions fo;
  fo.symbols = {{"B", B}};
  auto reports = passes::fuseModule(*fused.module, fo);
  ASSERT_TRUE(reports.isOk()) << reports.status().str();
  auto p = codegen::lowerForCpu(*fused.module->lookup("forward"), {{"B", B}});
  ASSERT_TRUE(p.isOk()) << p.status().str();
  fused.program = p.take();

  ParameterStore params;
  ASSERT_TRUE(params.initializeFrom(*plain.module, 5).isOk());
  std::map<std::string, HostTensor> batch = {{"x", randomTensor(DType::f32, {B, 1300}, 6, -3, 3)},
                                             {"y", randomTensor(DType::f32, {B, 1300}, 7, -3, 3)}};
  auto ref = ir::interpret(*plain.module->lookup("forward"), referenceTensors(batch, params), {{"B", B}});
  ASSERT_TRUE(ref.isOk()) << ref.status().str();
  auto one_by_one = makeExecutor(plain.program, {.threads = 2});
  EXPECT_EQ(one_by_one->pointwiseGroups(), 0) << "no fusion, no groups";
  auto want = one_by_one->run(viewsOf(batch), params);
  ASSERT_TRUE(want.isOk()) << want.status().str();

  for (int threads : {1, 2}) {
    auto ex = makeExecutor(fused.program, {.threads = threads, .poison_arena = true, .profile = true});
    EXPECT_EQ(ex->pointwiseGroups(), 1) << fused.program.str();
    EXPECT_EQ(ex->pointwiseGroupLaunches(), 7) << fused.program.str();
    auto got = ex->run(viewsOf(batch), params);
    ASSERT_TRUE(got.isOk()) << got.status().str();
    for (size_t r = 0; r < 2; ++r) {
      ASSERT_EQ((*got)[r].view.shape, (*want)[r].view.shape);
      EXPECT_EQ(std::memcmp((*got)[r].view.data, (*want)[r].view.data, static_cast<size_t>((*want)[r].view.bytes())), 0)
          << "result " << r << " differs from the op-by-op kernels'";
      expectClose((*got)[r], (*ref)[r], 1e-6, 1e-6, "vs interpreter");
    }
    // The group is one row of the profile; each of its launches still counts once.
    EXPECT_EQ(ex->profile().at("kiln.fused").launches, 1);
    EXPECT_EQ(ex->profile().at("kiln.mul").launches, 2);
    EXPECT_EQ(ex->profile().at("kiln.mul").seconds, 0);
  }
}

// PointwiseProgram::run over storage the memory plan reused: an in-place result (the same storage
// as its input, read by no later step) is written in the pass; one that overlaps its input
// shifted by an element goes through the spill buffer and still equals the op-by-op result.
// Steps whose run-time shapes differ are refused, and nothing is written.
TEST(CpuExecutor, PointwiseProgramComputesOverReusedStorage) {
  auto m = parseOrDie(R"(
func.func @forward() -> (!kiln.tensor<?(64)xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<?(64)xf32>
  %d = "kiln.input"() {name = "d"} : () -> !kiln.tensor<?(64)xf32>
  %0 = "kiln.exp"(%x) : (!kiln.tensor<?(64)xf32>) -> !kiln.tensor<?(64)xf32>
  %1 = "kiln.activation_grad"(%0, %d) {activation = "softplus"} : (!kiln.tensor<?(64)xf32>, !kiln.tensor<?(64)xf32>) -> !kiln.tensor<?(64)xf32>
  "func.return"(%1) : (!kiln.tensor<?(64)xf32>) -> ()
}
)");
  ASSERT_NE(m, nullptr);
  std::vector<const ir::Op*> ops;
  for (const auto& op : m->lookup("forward")->entry().ops())
    if (op->is(ir::OpCode::Exp) || op->is(ir::OpCode::ActivationGrad)) ops.push_back(op.get());
  ASSERT_EQ(ops.size(), 2u);
  // Buffers: 0 x, 1 d, 2 exp(x), 3 the gradient.
  auto program = PointwiseProgram::compile({{ops[0], {0}, 2, false}, {ops[1], {2, 1}, 3, true}});
  ASSERT_TRUE(program.isOk()) << program.status().str();
  ThreadPool pool(2);
  std::vector<float> x(64), d(64), storage(128);
  for (int i = 0; i < 64; ++i) {
    x[static_cast<size_t>(i)] = 0.01f * static_cast<float>(i) - 0.3f;
    d[static_cast<size_t>(i)] = 1.0f + 0.5f * static_cast<float>(i % 3);
  }
  auto views = [&](float* xs, int64_t nx, float* ds, int64_t nd, float* out) {
    std::vector<ir::TensorView> v(4);
    v[0] = {DType::f32, {nx}, xs};
    v[1] = {DType::f32, {nd}, ds};
    v[2] = {DType::f32, {64}, nullptr};
    v[3] = {DType::f32, {64}, out};
    return v;
  };
  // The gradient written over d, element for element: d is read by the step that writes it.
  std::vector<float> d_in_place = d;
  std::vector<ir::TensorView> v = views(x.data(), 64, d_in_place.data(), 64, d_in_place.data());
  auto ran = program->run(v, pool);
  ASSERT_TRUE(ran.isOk() && *ran);
  for (size_t i = 0; i < 64; ++i) {
    const float e = std::exp(x[i]);
    EXPECT_FLOAT_EQ(d_in_place[i], d[i] / (1.0f + std::exp(-e))) << i;  // softplus' = sigmoid
  }
  // Written one element past its input: a pass in place would read what it already wrote.
  for (int64_t shift : {1, -1}) {
    std::fill(storage.begin(), storage.end(), 0.0f);
    std::copy(d.begin(), d.end(), storage.begin() + 8);
    v = views(x.data(), 64, storage.data() + 8, 64, storage.data() + 8 + shift);
    ran = program->run(v, pool);
    ASSERT_TRUE(ran.isOk() && *ran);
    for (size_t i = 0; i < 64; ++i)
      EXPECT_EQ(storage[static_cast<size_t>(8 + shift) + i], d_in_place[i]) << "shift " << shift << ", element " << i;
  }
  // x and d of different run-time lengths: activation_grad's operands must agree.
  std::vector<float> before = storage;
  v = views(x.data(), 64, d.data(), 60, storage.data() + 64);
  ran = program->run(v, pool);
  ASSERT_TRUE(ran.isOk());
  EXPECT_FALSE(*ran);
  EXPECT_EQ(storage, before) << "a refused run writes nothing";
}

TEST(MemoryPlan, InPlaceChainsShareOneBuffer) {
  const char* chain = R"(
func.func @forward() -> (!kiln.tensor<Bx16xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx16xf32>
  %0 = "kiln.exp"(%x) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %1 = "kiln.tanh"(%0) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %2 = "kiln.neg"(%1) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %3 = "kiln.relu"(%2) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %4 = "kiln.sigmoid"(%3) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  "func.return"(%4) : (!kiln.tensor<Bx16xf32>) -> ()
}
)";
  const int64_t bytes = 10 * 16 * 4;  // 640: a multiple of 64
  Compiled in_place = compile(chain, 10);
  EXPECT_EQ(in_place.program.peak_bytes, bytes) << codegen::memoryPlanStr(in_place.program);
  for (int id = 2; id <= 5; ++id) EXPECT_EQ(in_place.program.buffers[static_cast<size_t>(id)].in_place_of, id - 1);

  codegen::CpuLoweringOptions no_in_place;
  no_in_place.memory.in_place = false;
  Compiled ping_pong = compile(chain, 10, no_in_place);
  EXPECT_EQ(ping_pong.program.peak_bytes, 2 * bytes) << codegen::memoryPlanStr(ping_pong.program);
  expectNoOverlap(ping_pong.program);

  // Both plans compute the same thing as the interpreter.
  std::map<std::string, HostTensor> batch = {{"x", randomTensor(DType::f32, {10, 16}, 4)}};
  auto ref = ir::interpret(*in_place.module->lookup("forward"), batch, {{"B", 10}});
  ASSERT_TRUE(ref.isOk());
  ParameterStore none;
  for (const Compiled* c : {&in_place, &ping_pong}) {
    auto got = makeExecutor(c->program)->run(viewsOf(batch), none);
    ASSERT_TRUE(got.isOk()) << got.status().str();
    expectClose((*got)[0], (*ref)[0], 1e-6, 1e-7);
  }
}

TEST(MemoryPlan, BestFitReusesFreedHoles) {
  // %a (big) dies before %c (small) is made while %b is live: %c goes into %a's hole.
  const char* text = R"(
func.func @forward() -> (!kiln.tensor<Bx8xf32>, !kiln.tensor<Bx8xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx64xf32>
  %a = "kiln.exp"(%x) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
  %b = "kiln.reduce"(%a) {axes = [1], keepdims = true, kind = "sum"} : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx1xf32>
  %w = "kiln.input"() {name = "w"} : () -> !kiln.tensor<Bx8xf32>
  %c = "kiln.mul"(%w, %b) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx8xf32>
  %d = "kiln.add"(%w, %b) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx8xf32>
  "func.return"(%c, %d) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<Bx8xf32>) -> ()
}
)";
  Compiled c = compile(text, 16);
  const auto& bufs = c.program.buffers;
  // Buffers: x, a, b, w, c, d. a: 4096 bytes at 0; b: 64 bytes above it; c and d (512 each)
  // fit in a's freed hole, so the peak is a + b.
  EXPECT_EQ(bufs[1].offset, 0);
  EXPECT_EQ(bufs[2].offset, 4096);
  EXPECT_EQ(bufs[4].offset, 0);
  EXPECT_EQ(bufs[5].offset, 512);
  EXPECT_EQ(c.program.peak_bytes, 4096 + 64);
  expectNoOverlap(c.program);
}

TEST(MemoryPlan, UnboundSymbolIsALocatedError) {
  auto m = parseOrDie(kMlp);
  auto p = codegen::lowerForCpu(*m->lookup("forward"), {});
  ASSERT_FALSE(p.isOk());
  EXPECT_NE(p.status().message().find("symbol 'B'"), std::string::npos) << p.status().message();
  EXPECT_TRUE(p.status().location().known());
}

}  // namespace
}  // namespace kiln::runtime::cpu
