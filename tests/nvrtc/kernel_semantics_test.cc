// The math of the generated kernels, checked on the CPU: each op case is lowered to kernel IR,
// run by the kernel interpreter (the arithmetic the CUDA code does), and compared with the op's
// CPU reference on the same random inputs. Outputs are poisoned (NaN) beforehand, so an element
// a kernel forgets to write fails the comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "codegen/kernel_interpreter.h"
#include "codegen/kernel_lowering.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

using codegen::LoweredGroup;

double readAsDouble(const ir::TensorView& v, int64_t i) {
  switch (v.dtype) {
    case DType::f32: return v.as<float>()[i];
    case DType::f64: return v.as<double>()[i];
    case DType::bf16: return ir::bf16ToFloat(v.as<uint16_t>()[i]);
    case DType::i32: return v.as<int32_t>()[i];
    case DType::i64: return static_cast<double>(v.as<int64_t>()[i]);
    case DType::i1: return v.as<uint8_t>()[i];
    default: return 0;
  }
}

void poison(ir::HostTensor& t) {
  if (t.view.dtype == DType::f32)
    for (int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  else if (t.view.dtype == DType::bf16)
    for (int64_t i = 0; i < t.numel(); ++i) t.as<uint16_t>()[i] = 0x7fc0;
  else
    std::memset(t.view.data, 0xA5, t.storage.size());
}

void expectClose(const ir::TensorView& got, const ir::TensorView& want, double tol, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  int bad = 0;
  for (int64_t i = 0; i < got.numel() && bad < 5; ++i) {
    double g = readAsDouble(got, i), w = readAsDouble(want, i);
    if (!(std::fabs(g - w) <= tol * (1 + std::fabs(w)))) {
      ADD_FAILURE() << what << "[" << i << "]: kernel " << g << ", reference " << w;
      ++bad;
    }
  }
}

class KernelSemantics : public ::testing::TestWithParam<int> {};

TEST_P(KernelSemantics, InterpretedKernelsMatchCpuReference) {
  std::vector<OpCase> cases = allOpCases();
  OpCase& c = cases[static_cast<size_t>(GetParam())];
  SCOPED_TRACE(c.name);
  std::mt19937 rng(1234 + static_cast<unsigned>(GetParam()));

  // Inputs, and the reference's own copies of everything it may write.
  std::map<const Value*, ir::HostTensor> ref, dev;
  for (auto& [v, fill] : c.fills) {
    auto shape = codegen::concreteShape(v->type(), c.symbols);
    ASSERT_TRUE(shape) << shape.status().message();
    ir::HostTensor t(v->type().dtype(), *shape);
    fillTensor(t, fill.first, fill.second, rng);
    ref[v] = t;
    dev[v] = t;
  }
  ir::CpuContext ctx;
  ctx.symbols = &c.symbols;
  for (const ir::Op* op : c.group) {
    ASSERT_NE(op->def()->cpu, nullptr) << op->name() << " has no CPU reference";
    std::vector<const ir::TensorView*> in;
    for (Value* v : op->operands()) in.push_back(&ref.at(v).view);
    std::vector<ir::TensorView*> out;
    for (Value* r : op->results()) {
      auto shape = codegen::concreteShape(r->type(), c.symbols);
      ASSERT_TRUE(shape);
      ref[r] = ir::HostTensor(r->type().dtype(), *shape);
      out.push_back(&ref[r].view);
    }
    Status s = op->def()->cpu(*op, in, out, ctx);
    ASSERT_TRUE(s.isOk()) << s.message();
  }

  auto lowered = codegen::lowerGroup(c.group, c.symbols);
  ASSERT_TRUE(lowered) << lowered.status().message();
  const LoweredGroup& g = *lowered;
  if (c.expected_kernels) {
    EXPECT_EQ(g.kernels.size(), c.expected_kernels);
  }
  std::vector<ir::HostTensor> storage(g.buffers.size());
  std::vector<void*> ptrs;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    const codegen::GroupBuffer& b = g.buffers[i];
    if (b.value && dev.count(b.value)) {
      storage[i] = dev.at(b.value);
    } else {
      storage[i] = ir::HostTensor(b.dtype, {b.elements});
      poison(storage[i]);
    }
    ptrs.push_back(storage[i].view.data);
  }
  Status s = codegen::interpretGroup(g, ptrs);
  ASSERT_TRUE(s.isOk()) << s.message();

  // Every value the group wrote: results and updated parameters/state.
  int checked = 0;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    const codegen::GroupBuffer& b = g.buffers[i];
    if (!b.value || !b.written) continue;
    ir::TensorView got = storage[i].view;
    got.shape = ref.at(b.value).view.shape;
    expectClose(got, ref.at(b.value).view, c.tol, g.buffers[i].name);
    ++checked;
  }
  EXPECT_GT(checked, 0);
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
