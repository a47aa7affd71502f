// The math of the generated kernels, checked on the CPU: each op case is lowered to kernel IR,
// run by the kernel interpreter (the arithmetic the CUDA code does), and compared with the op's
// CPU reference on the same random inputs. Outputs are poisoned (NaN) beforehand, so an element
// a kernel forgets to write fails the comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "codegen/kernel_interpreter.h"
#include "codegen/kernel_lowering.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

using codegen::LoweredGroup;

class KernelSemantics : public ::testing::TestWithParam<int> {};

TEST_P(KernelSemantics, InterpretedKernelsMatchCpuReference) {
  auto prepared = prepareCase(GetParam(), 1234);
  ASSERT_TRUE(prepared) << prepared.status().message();
  const OpCase& c = prepared->c;
  const CaseRun* run = &prepared->run;
  const LoweredGroup& g = prepared->group;
  SCOPED_TRACE(c.name);
  if (c.expected_kernels) {
    EXPECT_EQ(g.kernels.size(), c.expected_kernels);
  }
  for (const codegen::Kernel& k : g.kernels)
    if (k.kind == codegen::KernelKind::Source)
      GTEST_SKIP() << "kernel '" << k.name << "' is CUDA source the interpreter cannot run; simt_ops_test runs it";
  std::vector<ir::HostTensor> storage = groupStorage(g, *run);
  std::vector<void*> ptrs;
  for (ir::HostTensor& t : storage) ptrs.push_back(t.view.data);
  Status s = codegen::interpretGroup(g, ptrs);
  ASSERT_TRUE(s.isOk()) << s.message();
  EXPECT_GT(expectGroupMatchesReference(g, storage, *run, c.tol, "kernel"), 0);
}

INSTANTIATE_TEST_SUITE_P(AllOps, KernelSemantics, ::testing::Range(0, static_cast<int>(allOpCases().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return allOpCases()[static_cast<size_t>(info.param)].name;
                         });

// Independent of any CPU reference: a hand-computed softmax row and pooled bag.
TEST(KernelSemanticsByHand, SoftmaxRow) {
  CaseBuilder b("softmax");
  b.op("kiln.softmax", {b.input("x", DType::f32, S({1, 3}))});
  OpCase c = b.take();
  auto g = codegen::lowerGroup(c.group, {});
  ASSERT_TRUE(g);
  float x[3] = {1, 2, 3}, y[3] = {-1, -1, -1};
  std::vector<void*> bufs(g->buffers.size());
  for (size_t i = 0; i < g->buffers.size(); ++i) bufs[i] = g->buffers[i].written ? static_cast<void*>(y) : x;
  ASSERT_TRUE(codegen::interpretGroup(*g, bufs).isOk());
  double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(y[0], std::exp(1.0) / z, 1e-6);
  EXPECT_NEAR(y[1], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(y[2], std::exp(3.0) / z, 1e-6);
}

TEST(KernelSemanticsByHand, EmbeddingIdOutOfRangeIsAnError) {
  CaseBuilder b("bag");
  Value* t = b.param("tables.3", DType::f32, S({4, 2}));
  b.op("kiln.embedding_bag", {t, b.input("ids", DType::i64, S({2, 2}))});
  OpCase c = b.take();
  auto g = codegen::lowerGroup(c.group, {});
  ASSERT_TRUE(g);
  float table[8] = {1, 2, 3, 4, 5, 6, 7, 8}, out[4];
  int64_t ids[4] = {0, 3, 1, 9};
  int32_t err[2];
  std::vector<void*> bufs;
  for (const auto& buf : g->buffers)
    bufs.push_back(buf.name == "tables.3" ? static_cast<void*>(table) : buf.name == "ids" ? static_cast<void*>(ids)
                   : buf.dtype == DType::i32 ? static_cast<void*>(err) : static_cast<void*>(out));
  Status s = codegen::interpretGroup(*g, bufs);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("tables.3"), std::string::npos) << s.message();
  EXPECT_FLOAT_EQ(out[0], 1 + 7);  // sample 0 pools rows 0 and 3
  EXPECT_FLOAT_EQ(out[1], 2 + 8);
  EXPECT_FLOAT_EQ(out[2], 3);  // sample 1: row 1, the bad id contributes nothing
}

// 600 bags in one group, 240 of them jagged: the lookups and the lengths' scans are cut into
// several launches, each under CUDA's 4 KB of parameters, and every pooled row still matches the
// CPU reference, as does the table an out-of-range id in a later launch is reported as.
TEST(KernelSemanticsManyTables, LookupsAndScansSplitUnderFourKilobytes) {
  CaseBuilder b("many_bags");
  const int64_t batch = 3;
  for (int i = 0; i < 600; ++i) {
    const std::string n = std::to_string(i);
    Value* t = b.param("tables." + n, DType::f32, S({5, 2 + i % 3}));
    if (i % 5 < 2)
      b.op("kiln.embedding_bag", {t, b.input("cats." + n, DType::i64, S({7}), Fill::Ids, 5),
                                  b.input("cats." + n + ".lengths", DType::i32, S({batch}), Fill::Lengths, 7)});
    else
      b.op("kiln.embedding_bag", {t, b.input("cats." + n, DType::i32, S({batch, 2}), Fill::Ids, 5)},
           {{"mode", Attribute(i % 2 ? "mean" : "sum")}});
  }
  OpCase c = b.take();
  std::mt19937 rng(5);
  auto run = runReference(c, rng);
  ASSERT_TRUE(run) << run.status().message();
  auto g = codegen::lowerGroup(c.group, c.symbols);
  ASSERT_TRUE(g) << g.status().message();
  int scans = 0, lookups = 0;
  for (const codegen::Kernel& k : g->kernels) {
    EXPECT_LE(k.buffers.size() * sizeof(void*), 4096u) << k.name;
    scans += k.kind == codegen::KernelKind::BagOffsets;
    lookups += k.kind == codegen::KernelKind::EmbeddingForward;
  }
  EXPECT_EQ(scans, 2);    // 240 tables x 2 buffers + the flag
  EXPECT_GE(lookups, 5);  // 3 buffers a table (table, ids, out), 4 when jagged: 2,040 in all
  std::vector<ir::HostTensor> storage = groupStorage(*g, *run);
  std::vector<void*> ptrs;
  for (ir::HostTensor& t : storage) ptrs.push_back(t.view.data);
  Status s = codegen::interpretGroup(*g, ptrs);
  ASSERT_TRUE(s.isOk()) << s.message();
  EXPECT_EQ(expectGroupMatchesReference(*g, storage, *run, 1e-5, "kernel"), 600);

  // Table 599's ids are read by the last lookup launch.
  for (size_t i = 0; i < g->buffers.size(); ++i)
    if (g->buffers[i].value && g->buffers[i].value->definingOp()->strAttr("name") == "cats.599")
      storage[i].as<int32_t>()[1] = 5;  // rows [0, 5)
  s = codegen::interpretGroup(*g, ptrs);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("tables.599"), std::string::npos) << s.message();
}

// Jagged bags by hand: lengths {2, 0, 3} over 5 ids, mean pooling; the empty bag gives zeros.
TEST(KernelSemanticsByHand, JaggedBagsPoolTheirOffsets) {
  CaseBuilder b("jagged");
  Value* t = b.param("tables.0", DType::f32, S({4, 2}));
  b.op("kiln.embedding_bag", {t, b.input("ids", DType::i64, S({5})), b.input("lengths", DType::i32, S({3}))},
       {{"mode", Attribute("mean")}});
  OpCase c = b.take();
  auto g = codegen::lowerGroup(c.group, {});
  ASSERT_TRUE(g) << g.status().message();
  ASSERT_EQ(g->kernels.size(), 2u);
  EXPECT_EQ(g->kernels[0].kind, codegen::KernelKind::BagOffsets);
  float table[8] = {1, 2, 3, 4, 5, 6, 7, 8}, out[6] = {-1, -1, -1, -1, -1, -1};
  int64_t ids[5] = {0, 3, 1, 1, 2}, offsets[4] = {-1, -1, -1, -1};
  int32_t lengths[3] = {2, 0, 3}, err[2] = {0, 0};
  std::vector<void*> bufs;
  for (const auto& buf : g->buffers)
    bufs.push_back(buf.name == "tables.0"  ? static_cast<void*>(table)
                   : buf.name == "ids"     ? static_cast<void*>(ids)
                   : buf.name == "lengths" ? static_cast<void*>(lengths)
                   : buf.dtype == DType::i64 ? static_cast<void*>(offsets)
                   : buf.dtype == DType::i32 ? static_cast<void*>(err)
                                             : static_cast<void*>(out));
  Status s = codegen::interpretGroup(*g, bufs);
  ASSERT_TRUE(s.isOk()) << s.message();
  EXPECT_EQ(offsets[0], 0);
  EXPECT_EQ(offsets[1], 2);
  EXPECT_EQ(offsets[2], 2);
  EXPECT_EQ(offsets[3], 5);
  EXPECT_FLOAT_EQ(out[0], (1 + 7) / 2.0f);  // rows 0 and 3
  EXPECT_FLOAT_EQ(out[1], (2 + 8) / 2.0f);
  EXPECT_FLOAT_EQ(out[2], 0);  // empty
  EXPECT_FLOAT_EQ(out[3], 0);
  EXPECT_FLOAT_EQ(out[4], (3 + 3 + 5) / 3.0f);  // rows 1, 1, 2
  EXPECT_FLOAT_EQ(out[5], (4 + 4 + 6) / 3.0f);

  // Lengths claiming more ids than there are: an error naming the lengths, reads stay in bounds.
  lengths[2] = 4;
  s = codegen::interpretGroup(*g, bufs);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("lengths"), std::string::npos) << s.message();
  EXPECT_EQ(offsets[3], 5);
  // Fewer (a bounded ids buffer with padding) is fine: the padding is never read.
  lengths[2] = 1;
  ids[3] = ids[4] = 99;
  s = codegen::interpretGroup(*g, bufs);
  ASSERT_TRUE(s.isOk()) << s.message();
  EXPECT_FLOAT_EQ(out[4], 3);
}

// Jagged weight gradient by hand: lengths {2, 0, 1} over a 6-id buffer (3 padding positions
// holding bad ids, never checked), mean mode; then a bad id inside a bag is an error.
TEST(KernelSemanticsByHand, JaggedWeightGradFindsEachIdsBag) {
  CaseBuilder b("jagged_weight_grad");
  Value* t = b.param("tables.0", DType::f32, S({4, 2}));
  ir::Op* op = b.op("kiln.embedding_bag_weight_grad",
                    {t, b.input("ids", DType::i64, S({6})), b.input("lengths", DType::i32, S({3})),
                     b.input("grad", DType::f32, S({3, 2}))},
                    {{"mode", Attribute("mean")}});
  OpCase c = b.take();
  auto g = codegen::lowerGroup(c.group, {});
  ASSERT_TRUE(g) << g.status().message();
  ASSERT_EQ(g->kernels.size(), 2u);
  float table[8] = {1, 2, 3, 4, 5, 6, 7, 8}, grad[6] = {1, 2, 3, 4, 5, 6};
  float dw[6] = {-1, -1, -1, -1, -1, -1};
  int64_t ids[6] = {0, 3, 1, 99, -5, 99}, offsets[4] = {-1, -1, -1, -1};
  int32_t lengths[3] = {2, 0, 1}, err[2] = {0, 0};
  std::vector<void*> bufs;
  for (const auto& buf : g->buffers)
    bufs.push_back(buf.value == op->result()   ? static_cast<void*>(dw)
                   : buf.name == "tables.0"    ? static_cast<void*>(table)
                   : buf.name == "ids"         ? static_cast<void*>(ids)
                   : buf.name == "lengths"     ? static_cast<void*>(lengths)
                   : buf.name == "grad"        ? static_cast<void*>(grad)
                   : buf.dtype == DType::i64   ? static_cast<void*>(offsets)
                                               : static_cast<void*>(err));
  Status s = codegen::interpretGroup(*g, bufs);
  ASSERT_TRUE(s.isOk()) << s.message();
  EXPECT_FLOAT_EQ(dw[0], (1 * 1 + 2 * 2) / 2.0f);  // bag 0 (2 ids), row 0 . grad[0]
  EXPECT_FLOAT_EQ(dw[1], (7 * 1 + 8 * 2) / 2.0f);  // row 3 . grad[0]
  EXPECT_FLOAT_EQ(dw[2], 3 * 5 + 4 * 6);           // bag 2 (1 id; bag 1 is empty), row 1 . grad[2]
  for (int p = 3; p < 6; ++p) EXPECT_EQ(dw[p], 0.0f) << p;  // padding

  ids[1] = 4;  // out of range [0, 4): contributes 0, the error names the table
  s = codegen::interpretGroup(*g, bufs);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("'tables.0'"), std::string::npos) << s.message();
  EXPECT_EQ(dw[1], 0.0f);
  EXPECT_FLOAT_EQ(dw[0], 2.5f);
}

TEST(KernelLowering, GroupsNeverMixStreams) {
  CaseBuilder b("streams");
  Value* x = b.input("x", DType::f32, S({4, 8}));
  Value* t0 = b.param("tables.0", DType::f32, S({10, 8}));
  Value* t1 = b.param("tables.1", DType::f32, S({10, 8}));
  ir::Op* e0 = b.op("kiln.embedding_bag", {t0, b.input("c0", DType::i64, S({4, 1}), Fill::Ids, 10)});
  ir::Op* e1 = b.op("kiln.embedding_bag", {t1, b.input("c1", DType::i64, S({4, 1}), Fill::Ids, 10)});
  e1->setAttr("kiln.stream", Attribute(int64_t{1}));
  ir::Op* a = b.op("kiln.add", {x, e0->result()});
  ir::Op* r = b.op("kiln.relu", {a->result()});
  r->setAttr("kiln.stream", Attribute(int64_t{1}));
  OpCase c = b.take();
  auto groups = codegen::groupOps(c.group);
  // [bag0] [bag1 on stream 1] [add] [relu on stream 1].
  ASSERT_EQ(groups.size(), 4u);
  for (const auto& g : groups) {
    ASSERT_EQ(g.size(), 1u);
    EXPECT_EQ(codegen::streamOf(*g.front()), g.front() == e1 || g.front() == r ? 1 : 0);
  }
}

TEST(KernelLowering, GroupsElementwiseChainsAndEmbeddingCollections) {
  CaseBuilder b("grouping");
  Value* x = b.input("x", DType::f32, S({4, 8}));
  Value* w = b.param("w", DType::f32, S({8, 8}));
  Value* t0 = b.param("tables.0", DType::f32, S({10, 8}));
  Value* t1 = b.param("tables.1", DType::f32, S({10, 8}));
  Value* e0 = b.op("kiln.embedding_bag", {t0, b.input("c0", DType::i64, S({4, 1}), Fill::Ids, 10)})->result();
  Value* mm = b.op("kiln.matmul", {x, w})->result();
  Value* r = b.op("kiln.relu", {b.op("kiln.add", {mm, e0})->result()})->result();
  Value* e1 = b.op("kiln.embedding_bag", {t1, b.input("c1", DType::i64, S({4, 1}), Fill::Ids, 10)})->result();
  b.op("kiln.mul", {r, e1});
  OpCase c = b.take();
  auto groups = codegen::groupOps(c.group);
  // [bag0, bag1] [matmul] [add, relu] [mul]: the second bag joins the first's launch.
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0].size(), 2u);
  EXPECT_EQ(groups[1][0]->name(), "kiln.matmul");
  EXPECT_EQ(groups[2].size(), 2u);
  auto g = codegen::lowerGroup(groups[1], {});
  ASSERT_TRUE(g);
  EXPECT_EQ(g->gemm, groups[1][0]);
  EXPECT_TRUE(g->kernels.empty());
}

// Dense optimizer updates wait to form one group (one multi-tensor launch): past other ops, up
// to the first op that reads a parameter one of them updates, which must see it updated.
TEST(KernelLowering, OptimizerUpdatesFormOneGroupBeforeTheirParametersAreRead) {
  CaseBuilder b("updates");
  Value* lr = b.input("lr", DType::f32, {});
  Value* step = b.input("step", DType::f32, {});
  auto update = [&](Value* p, Value* g) {
    return b.op("kiln.optimizer_update", {p, g, lr, step}, {{"kind", Attribute("sgd")}, {"lr", Attribute(0.1)}});
  };
  Value* w0 = b.param("w0", DType::f32, S({4}));
  Value* w1 = b.param("w1", DType::f32, S({4}));
  Value* w2 = b.param("w2", DType::f32, S({4}));
  ir::Op* u0 = update(w0, b.input("g0", DType::f32, S({4})));
  ir::Op* r = b.op("kiln.relu", {b.input("x", DType::f32, S({4}))});
  ir::Op* u1 = update(w1, b.input("g1", DType::f32, S({4})));
  ir::Op* reads = b.op("kiln.add", {w0, r->result()});  // after u0: the updated w0
  ir::Op* u2 = update(w2, reads->result());
  OpCase c = b.take();
  auto groups = codegen::groupOps(c.group);
  // [relu] [u0, u1] [add] [u2]
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0], std::vector<const ir::Op*>{r});
  EXPECT_EQ(groups[1], (std::vector<const ir::Op*>{u0, u1}));
  EXPECT_EQ(groups[2], std::vector<const ir::Op*>{reads});
  EXPECT_EQ(groups[3], std::vector<const ir::Op*>{u2});
  auto g = codegen::lowerGroup(groups[1], {});
  ASSERT_TRUE(g) << g.status().message();
  ASSERT_EQ(g->kernels.size(), 1u);
  EXPECT_EQ(g->kernels[0].name, "optimizer_multi_tensor");
}

TEST(KernelLowering, UnboundSymbolIsAClearError) {
  CaseBuilder b("unbound");
  b.op("kiln.relu", {b.input("x", DType::f32, {Dim::symbol("B"), Dim::fixed(3)})});
  OpCase c = b.take();
  auto g = codegen::lowerGroup(c.group, {});
  ASSERT_FALSE(g);
  EXPECT_NE(g.status().message().find("'B'"), std::string::npos) << g.status().message();
}

}  // namespace
}  // namespace kiln::testing
