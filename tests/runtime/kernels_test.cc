// Each fast CPU kernel against the op's reference hook (naive loops in ir/ops/) on random
// inputs, threaded and not; the GEMM also against a naive triple loop written here.
#include <gtest/gtest.h>

#include <cstring>

#include "ir/builder.h"
#include "ir/optimizer.h"
#include "runtime/cpu/kernels/kernels.h"
#include "runtime_test_util.h"

namespace kiln::runtime::cpu {
namespace {

using ir::DType;
using ir::HostTensor;
using testing::expectClose;
using testing::randomTensor;

struct OneOp {
  std::unique_ptr<ir::Module> module;
  ir::Op* op = nullptr;
};

// One op over kiln.input operands of the inputs' static types (or `types` when given).
OneOp buildOp(const std::string& name, const std::vector<HostTensor>& inputs, ir::AttrDict attrs,
              std::vector<ir::TensorType> result_types = {}, std::vector<ir::TensorType> types = {}) {
  OneOp o;
  o.module = std::make_unique<ir::Module>();
  ir::Function& f = o.module->addFunction("f");
  ir::Builder b(f.entry());
  std::vector<ir::Value*> operands;
  for (size_t i = 0; i < inputs.size(); ++i) {
    ir::Shape s;
    for (int64_t d : inputs[i].view.shape) s.push_back(ir::Dim::fixed(d));
    ir::TensorType t = i < types.size() ? types[i] : ir::TensorType(inputs[i].view.dtype, s);
    auto in = b.createWithTypes("kiln.input", {}, {t}, {{"name", ir::Attribute("x" + std::to_string(i))}});
    EXPECT_TRUE(in.isOk()) << (in.isOk() ? "" : in.status().str());
    operands.push_back((*in)->result());
  }
  auto op = result_types.empty() ? b.create(name, operands, attrs) : b.createWithTypes(name, operands, result_types, attrs);
  EXPECT_TRUE(op.isOk()) << (op.isOk() ? "" : op.status().str());
  o.op = op.isOk() ? *op : nullptr;
  return o;
}

std::vector<int64_t> boundShape(const ir::TensorType& t, const ir::SymbolBindings& s) {
  std::vector<int64_t> out;
  for (const ir::Dim& d : t.shape()) out.push_back(*d.evaluate(s));
  return out;
}

// Runs the fast kernel and the reference hook on the same inputs and compares.
void checkAgainstReference(const std::string& name, const std::vector<HostTensor>& inputs, ir::AttrDict attrs,
                           double rtol, double atol, std::vector<ir::TensorType> result_types = {},
                           std::vector<ir::TensorType> types = {}, ir::SymbolBindings symbols = {}) {
  OneOp o = buildOp(name, inputs, attrs, result_types, types);
  ASSERT_NE(o.op, nullptr);
  const FastKernel* fast = findFastKernel(*o.op);
  ASSERT_NE(fast, nullptr) << "no fast kernel for " << name;
  ASSERT_NE(o.op->def()->cpu, nullptr) << "no reference hook for " << name;
  std::vector<const ir::TensorView*> in;
  for (const auto& t : inputs) in.push_back(&t.view);
  for (int threads : {1, 3}) {
    ThreadPool pool(threads);
    std::vector<HostTensor> got, want;
    for (ir::Value* r : o.op->results()) {
      got.emplace_back(r->type().dtype(), boundShape(r->type(), symbols));
      want.emplace_back(r->type().dtype(), boundShape(r->type(), symbols));
    }
    std::vector<ir::TensorView*> gv, wv;
    for (auto& t : got) gv.push_back(&t.view);
    for (auto& t : want) wv.push_back(&t.view);
    Status fs = fast->run(*o.op, in, gv, KernelContext{&pool, &symbols});
    ASSERT_TRUE(fs.isOk()) << fs.str();
    ir::CpuContext cctx{&symbols, 1};
    Status rs = o.op->def()->cpu(*o.op, in, wv, cctx);
    ASSERT_TRUE(rs.isOk()) << rs.str();
    for (size_t i = 0; i < got.size(); ++i) expectClose(got[i], want[i], rtol, atol, std::string(name).append(" threads=").append(std::to_string(threads)));
  }
}

TEST(FastKernels, BinaryElementwiseWithBroadcasting) {
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> shapes = {
      {{33, 17}, {33, 17}}, {{33, 17}, {17}}, {{33, 17}, {33, 1}}, {{5, 1, 7}, {1, 6, 7}},
      {{4, 3, 2}, {}},      {{1}, {9, 5}},     {{2, 3, 4, 5}, {3, 1, 5}}};
  uint32_t seed = 1;
  for (const char* op : {"kiln.add", "kiln.sub", "kiln.mul", "kiln.div", "kiln.max", "kiln.min"})
    for (const auto& [a, b] : shapes) {
      auto x = randomTensor(DType::f32, a, seed++), y = randomTensor(DType::f32, b, seed++, 0.5, 2);
      checkAgainstReference(op, {x, y}, {}, 1e-6, 1e-6);
    }
  auto base = randomTensor(DType::f32, {40, 9}, 77, 0.1, 3), expo = randomTensor(DType::f32, {9}, 78);
  checkAgainstReference("kiln.pow", {base, expo}, {}, 1e-5, 1e-6);
}

TEST(FastKernels, UnaryElementwise) {
  uint32_t seed = 100;
  for (const char* op : {"kiln.neg", "kiln.abs", "kiln.exp", "kiln.tanh", "kiln.sigmoid", "kiln.relu", "kiln.gelu",
                         "kiln.silu"})
    checkAgainstReference(op, {randomTensor(DType::f32, {129, 31}, seed++, -4, 4)}, {}, 1e-5, 1e-6);
  for (const char* op : {"kiln.log", "kiln.sqrt", "kiln.rsqrt"})
    checkAgainstReference(op, {randomTensor(DType::f32, {1000}, seed++, 0.01, 10)}, {}, 1e-5, 1e-6);
}

TEST(FastKernels, ActivationGradSliceAndPad) {
  uint32_t seed = 300;
  for (const char* act : {"relu", "silu", "gelu", "softplus", "hardswish"}) {
    auto x = randomTensor(DType::f32, {257, 33}, seed++, -4, 4),
         dy = randomTensor(DType::f32, {257, 33}, seed++);
    checkAgainstReference("kiln.activation_grad", {x, dy}, {{"activation", ir::Attribute(act)}}, 1e-5, 1e-6);
  }
  auto x = randomTensor(DType::f32, {37, 10, 6}, seed++);
  for (int64_t axis : {0, 1, 2, -1}) {
    checkAgainstReference("kiln.slice", {x},
                          {{"axis", ir::Attribute(axis)},
                           {"start", ir::Attribute(int64_t{1})},
                           {"limit", ir::Attribute(int64_t{5})}},
                          0, 0);
    checkAgainstReference("kiln.pad", {x},
                          {{"axis", ir::Attribute(axis)},
                           {"low", ir::Attribute(int64_t{2})},
                           {"high", ir::Attribute(int64_t{3})}},
                          0, 0);
  }
  checkAgainstReference("kiln.slice", {randomTensor(DType::bf16, {64, 12}, seed++)},
                        {{"axis", ir::Attribute(int64_t{1})},
                         {"start", ir::Attribute(int64_t{0})},
                         {"limit", ir::Attribute(int64_t{6})}},
                        0, 0);
}

TEST(FastKernels, Bf16StorageComputesInF32) {
  auto x = randomTensor(DType::bf16, {64, 32}, 5), y = randomTensor(DType::bf16, {32}, 6);
  // Both round the f32 result once to bf16; allow one bf16 ulp for double vs float compute.
  checkAgainstReference("kiln.mul", {x, y}, {}, 1.0 / 128, 1e-3);
  checkAgainstReference("kiln.gelu", {x}, {}, 1.0 / 128, 1e-3);
  checkAgainstReference("kiln.matmul", {x, randomTensor(DType::bf16, {16, 32}, 7)}, {{"transpose_b", true}}, 1.0 / 64, 2e-2);
}

// C = op(A) op(B) by a naive triple loop, independent of BLAS and of the reference hook.
HostTensor naiveMatmul(const HostTensor& a, const HostTensor& b, bool ta, bool tb) {
  int64_t m = ta ? a.view.shape[1] : a.view.shape[0], k = ta ? a.view.shape[0] : a.view.shape[1];
  int64_t n = tb ? b.view.shape[0] : b.view.shape[1];
  HostTensor c(DType::f32, {m, n});
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += double(a.as<float>()[ta ? p * m + i : i * k + p]) * b.as<float>()[tb ? j * k + p : p * n + j];
      c.as<float>()[i * n + j] = static_cast<float>(s);
    }
  return c;
}

TEST(FastKernels, MatmulTransposesAgainstNaiveLoops) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      auto a = randomTensor(DType::f32, ta ? std::vector<int64_t>{23, 19} : std::vector<int64_t>{19, 23}, 11);
      auto b = randomTensor(DType::f32, tb ? std::vector<int64_t>{7, 23} : std::vector<int64_t>{23, 7}, 12);
      OneOp o = buildOp("kiln.matmul", {a, b}, {{"transpose_a", ta}, {"transpose_b", tb}});
      const FastKernel* fast = findFastKernel(*o.op);
      ASSERT_NE(fast, nullptr);
      ThreadPool pool(2);
      HostTensor c(DType::f32, {19, 7});
      ASSERT_TRUE(fast->run(*o.op, {&a.view, &b.view}, {&c.view}, KernelContext{&pool, nullptr}).isOk());
      expectClose(c, naiveMatmul(a, b, ta, tb), 1e-5, 1e-5, "matmul");
      checkAgainstReference("kiln.matmul", {a, b}, {{"transpose_a", ta}, {"transpose_b", tb}}, 1e-5, 1e-5);
    }
}

TEST(FastKernels, BatchedMatmulBroadcastsBatchDims) {
  checkAgainstReference("kiln.matmul", {randomTensor(DType::f32, {3, 5, 4}, 1), randomTensor(DType::f32, {4, 6}, 2)}, {},
                        1e-5, 1e-5);
  checkAgainstReference("kiln.matmul", {randomTensor(DType::f32, {2, 1, 5, 4}, 3), randomTensor(DType::f32, {3, 6, 4}, 4)},
                        {{"transpose_b", true}}, 1e-5, 1e-5);
  checkAgainstReference("kiln.matmul", {randomTensor(DType::f32, {3, 4, 5}, 5), randomTensor(DType::f32, {3, 4, 2}, 6)},
                        {{"transpose_a", true}}, 1e-5, 1e-5);
  checkAgainstReference("kiln.matmul", {randomTensor(DType::f64, {2, 7, 3}, 7), randomTensor(DType::f64, {2, 3, 4}, 8)},
                        {}, 1e-12, 1e-12);
}

TEST(FastKernels, ReductionsOverEveryAxisPattern) {
  auto x = randomTensor(DType::f32, {6, 5, 4, 3}, 21);
  const std::vector<std::vector<int64_t>> axes = {{3}, {0}, {1}, {1, 2}, {0, 1}, {0, 2}, {1, 3}, {0, 1, 2, 3}, {-1}};
  for (const char* kind : {"sum", "mean", "max"})
    for (const auto& a : axes)
      for (bool keep : {false, true})
        checkAgainstReference("kiln.reduce", {x}, {{"kind", kind}, {"axes", ir::Attribute::ints(a)}, {"keepdims", keep}},
                              1e-5, 1e-5);
  // A long row and a tall column: the threaded paths.
  checkAgainstReference("kiln.reduce", {randomTensor(DType::f32, {3, 50000}, 22)},
                        {{"kind", "sum"}, {"axes", ir::Attribute::ints({1})}}, 1e-4, 1e-3);
  checkAgainstReference("kiln.reduce", {randomTensor(DType::f32, {5000, 64}, 23)},
                        {{"kind", "mean"}, {"axes", ir::Attribute::ints({0})}}, 1e-4, 1e-5);
}

TEST(FastKernels, EmbeddingBagFixedHotness) {
  auto table = randomTensor(DType::f32, {50, 8}, 31);
  auto ids = randomTensor(DType::i64, {40, 3}, 32, 0, 50);
  auto w = randomTensor(DType::f32, {40, 3}, 33);
  for (const char* mode : {"sum", "mean"}) {
    checkAgainstReference("kiln.embedding_bag", {table, ids}, {{"mode", mode}}, 1e-5, 1e-6);
    checkAgainstReference("kiln.embedding_bag", {table, ids, w}, {{"mode", mode}}, 1e-5, 1e-6);
  }
  auto ids32 = randomTensor(DType::i32, {40, 3}, 34, 0, 50);
  checkAgainstReference("kiln.embedding_bag", {randomTensor(DType::bf16, {50, 8}, 35), ids32}, {}, 1.0 / 128, 1e-3);
}

TEST(FastKernels, EmbeddingBagJaggedWithBoundedIds) {
  // 6 samples of 0..4 ids each: 13 ids in a buffer bounded by 4*B = 24.
  HostTensor lengths(DType::i32, {6});
  const int32_t lens[] = {2, 0, 4, 1, 3, 3};
  std::copy(lens, lens + 6, lengths.as<int32_t>());
  auto ids = randomTensor(DType::i64, {13}, 41, 0, 30);
  auto w = randomTensor(DType::f32, {13}, 42);
  auto table = randomTensor(DType::f32, {30, 5}, 43);
  ir::TensorType ids_t(DType::i64, {ir::Dim::bounded(ir::Dim::symbol("B", 4))});
  ir::TensorType w_t(DType::f32, {ir::Dim::bounded(ir::Dim::symbol("B", 4))});
  ir::TensorType len_t(DType::i32, {ir::Dim::symbol("B")});
  ir::TensorType table_t(DType::f32, {ir::Dim::fixed(30), ir::Dim::fixed(5)});
  for (const char* mode : {"sum", "mean"})
    checkAgainstReference("kiln.embedding_bag", {table, ids, lengths, w}, {{"mode", mode}}, 1e-5, 1e-6, {},
                          {table_t, ids_t, len_t, w_t}, {{"B", 6}});
}

TEST(FastKernels, EmbeddingBagRejectsIdsOutOfRange) {
  auto table = randomTensor(DType::f32, {10, 4}, 1);
  HostTensor ids(DType::i64, {3, 2});
  for (int i = 0; i < 6; ++i) ids.as<int64_t>()[i] = i;
  ids.as<int64_t>()[4] = 10;
  OneOp o = buildOp("kiln.embedding_bag", {table, ids}, {{"table", "tables.7"}});
  ThreadPool pool(2);
  HostTensor y(DType::f32, {3, 4});
  Status s = findFastKernel(*o.op)->run(*o.op, {&table.view, &ids.view}, {&y.view}, KernelContext{&pool, nullptr});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("tables.7"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("id 10 of sample 2"), std::string::npos) << s.message();
}

TEST(FastKernels, CastReshapeConstant) {
  auto x = randomTensor(DType::f32, {7, 6}, 51);
  checkAgainstReference("kiln.cast", {x}, {{"to", "bf16"}}, 0, 0);
  checkAgainstReference("kiln.cast", {randomTensor(DType::bf16, {7, 6}, 52)}, {{"to", "f32"}}, 0, 0);
  checkAgainstReference("kiln.reshape", {x}, {}, 0, 0, {ir::TensorType(DType::f32, {ir::Dim::fixed(3), ir::Dim::fixed(14)})});
  checkAgainstReference("kiln.constant", {}, {{"value", ir::Attribute(ir::AttrArray{1.5, -2.0, 3.0, 4.25})}}, 0, 0,
                        {ir::TensorType(DType::f32, {ir::Dim::fixed(2), ir::Dim::fixed(2)})});
  checkAgainstReference("kiln.constant", {}, {{"value", 7}}, 0, 0,
                        {ir::TensorType(DType::i64, {ir::Dim::symbol("B"), ir::Dim::fixed(3)})}, {}, {{"B", 5}});
}

}  // namespace
}  // namespace kiln::runtime::cpu

namespace kiln::runtime::cpu {
namespace {

// Runs an in-place op (no results: it updates its operands) through the fast kernel and the
// reference hook, each on its own copy of `values`; returns (fast, reference).
std::pair<std::vector<HostTensor>, std::vector<HostTensor>> runInPlaceBothWays(const ir::Op& op, const FastKernel& fast,
                                                                             const std::vector<HostTensor>& values,
                                                                             int threads) {
  std::vector<HostTensor> mine = values, ref = values;
  std::vector<const ir::TensorView*> mv, rv;
  for (auto& t : mine) mv.push_back(&t.view);
  for (auto& t : ref) rv.push_back(&t.view);
  ThreadPool pool(threads);
  Status s = fast.run(op, mv, {}, KernelContext{&pool, nullptr});
  EXPECT_TRUE(s.isOk()) << s.str();
  Status r = op.def()->cpu(op, rv, {}, ir::CpuContext{});
  EXPECT_TRUE(r.isOk()) << r.str();
  return {std::move(mine), std::move(ref)};
}

// kiln.embedding_bag_update: the threaded kernel and the reference hook start from the same
// table and state and must leave the same values behind, for every optimizer and id layout.
void checkEmbeddingUpdate(const std::string& optimizer, bool jagged, bool weighted, bool scaled, const std::string& mode) {
  const int64_t R = 40, D = 6, B = 25, H = 3;
  ir::Module m;
  ir::Function& f = m.addFunction("f");
  ir::Builder b(f.entry());
  auto param = [&](const std::string& name, ir::TensorType t) {
    return (*b.createWithTypes("kiln.parameter", {}, {t}, {{"name", ir::Attribute(name)}}))->result();
  };
  auto input = [&](const std::string& name, ir::TensorType t) {
    return (*b.createWithTypes("kiln.input", {}, {t}, {{"name", ir::Attribute(name)}}))->result();
  };
  auto fixed = [](std::vector<int64_t> dims, DType t) {
    ir::Shape s;
    for (int64_t d : dims) s.push_back(ir::Dim::fixed(d));
    return ir::TensorType(t, s);
  };
  std::vector<HostTensor> values;
  std::vector<ir::Value*> operands;
  operands.push_back(param("t", fixed({R, D}, DType::f32)));
  values.push_back(randomTensor(DType::f32, {R, D}, 1));
  HostTensor lengths(DType::i32, {B});
  int64_t n = 0;
  for (int64_t i = 0; i < B; ++i) n += lengths.as<int32_t>()[i] = static_cast<int32_t>(i % 4);
  // Ids from a small range so rows repeat within the batch.
  if (jagged) {
    operands.push_back(input("ids", fixed({n}, DType::i64)));
    values.push_back(randomTensor(DType::i64, {n}, 2, 0, 12));
    operands.push_back(input("len", fixed({B}, DType::i32)));
    values.push_back(lengths);
  } else {
    operands.push_back(input("ids", fixed({B, H}, DType::i32)));
    values.push_back(randomTensor(DType::i32, {B, H}, 2, 0, 12));
  }
  if (weighted) {
    auto shape = values[1].view.shape;
    operands.push_back(input("w", fixed(shape, DType::f32)));
    values.push_back(randomTensor(DType::f32, shape, 3));
  }
  operands.push_back(input("g", fixed({B, D}, DType::f32)));
  values.push_back(randomTensor(DType::f32, {B, D}, 4));
  ir::AttrDict attrs = {{"optimizer", ir::Attribute(optimizer)}, {"lr", 0.05},      {"weight_decay", 0.01},
                        {"mode", ir::Attribute(mode)},           {"weighted", weighted}, {"scaled", scaled}};
  for (const auto& slot : ir::sparseOptimizerState(optimizer, attrs)) {
    auto shape = slot.rowwise ? std::vector<int64_t>{R} : std::vector<int64_t>{R, D};
    operands.push_back(param(std::string("t.").append(slot.suffix), fixed(shape, DType::f32)));
    values.push_back(randomTensor(DType::f32, shape, 5, 0.1, 1));
  }
  for (const char* s : {"lr", "step"}) {
    operands.push_back(input(s, ir::TensorType(DType::f32, {})));
    HostTensor v(DType::f32, {});
    v.as<float>()[0] = std::string(s) == "lr" ? 0.7f : 3.0f;
    values.push_back(v);
  }
  if (scaled) {
    operands.push_back(input("scale", ir::TensorType(DType::f32, {})));
    HostTensor v(DType::f32, {});
    v.as<float>()[0] = 0.5f;
    values.push_back(v);
  }
  auto op = b.createWithTypes("kiln.embedding_bag_update", operands, {}, attrs);
  ASSERT_TRUE(op.isOk()) << op.status().str();
  const FastKernel* fast = findFastKernel(**op);
  ASSERT_NE(fast, nullptr);
  for (int threads : {1, 4}) {
    auto [mine, ref] = runInPlaceBothWays(**op, *fast, values, threads);
    for (size_t i = 0; i < values.size(); ++i)
      expectClose(mine[i], ref[i], 1e-6, 1e-7, std::string(optimizer).append(" operand ").append(std::to_string(i)));
    EXPECT_NE(mine[0].storage, values[0].storage) << "the table moved";
  }
}

// kiln.optimizer_update: the threaded kernel leaves the same bits as the reference hook for every
// dense optimizer, with weight decay and a clipping scale, over a size that several threads split.
void checkDenseUpdate(const std::string& kind, ir::AttrDict extra, bool scaled) {
  const int64_t n = 200003;
  ir::Module m;
  ir::Function& f = m.addFunction("f");
  ir::Builder b(f.entry());
  auto source = [&](const char* op, const std::string& name, ir::TensorType t) {
    return (*b.createWithTypes(op, {}, {t}, {{"name", ir::Attribute(name)}}))->result();
  };
  const ir::TensorType vec(DType::f32, ir::Shape{ir::Dim::fixed(n)}), scalar(DType::f32, ir::Shape{});
  ir::AttrDict attrs = {{"kind", ir::Attribute(kind)}, {"lr", 0.05}, {"weight_decay", 0.01}, {"scaled", scaled}};
  for (auto& [k, v] : extra) attrs[k] = v;
  std::vector<ir::Value*> operands = {source("kiln.parameter", "w", vec), source("kiln.input", "g", vec)};
  std::vector<HostTensor> values = {randomTensor(DType::f32, {n}, 1), randomTensor(DType::f32, {n}, 2)};
  for (const auto& slot : ir::denseOptimizerState(kind, attrs)) {
    operands.push_back(source("kiln.parameter", "w." + slot.suffix, vec));
    values.push_back(randomTensor(DType::f32, {n}, 3, 0.1, 1));
  }
  for (float v : {0.7f, 3.0f, 0.5f}) {  // lr factor, step, clipping scale
    if (v == 0.5f && !scaled) break;
    operands.push_back(source("kiln.input", "s" + std::to_string(values.size()), scalar));
    HostTensor t(DType::f32, {});
    t.as<float>()[0] = v;
    values.push_back(t);
  }
  auto op = b.createWithTypes("kiln.optimizer_update", operands, {}, attrs);
  ASSERT_TRUE(op.isOk()) << op.status().str();
  const FastKernel* fast = findFastKernel(**op);
  ASSERT_NE(fast, nullptr) << kind;
  for (int threads : {1, 3}) {
    auto [mine, ref] = runInPlaceBothWays(**op, *fast, values, threads);
    for (size_t i = 0; i < values.size(); ++i)
      EXPECT_EQ(std::memcmp(mine[i].view.data, ref[i].view.data, static_cast<size_t>(mine[i].view.bytes())), 0)
          << kind << " operand " << i << " with " << threads << " threads";
    EXPECT_NE(std::memcmp(mine[0].view.data, values[0].view.data, static_cast<size_t>(n) * 4), 0) << "nothing moved";
  }
}

TEST(FastKernels, DenseOptimizerUpdateMatchesReferenceBitForBit) {
  checkDenseUpdate("sgd", {}, false);
  checkDenseUpdate("sgd", {{"momentum", 0.9}}, true);
  checkDenseUpdate("sgd", {{"momentum", 0.9}, {"nesterov", true}}, false);
  checkDenseUpdate("adagrad", {}, true);
  checkDenseUpdate("adam", {}, false);
  checkDenseUpdate("adamw", {}, true);
}

TEST(FastKernels, SparseEmbeddingUpdateMatchesReference) {
  for (const char* opt : {"sgd", "adagrad", "rowwise_adagrad", "adam"}) {
    checkEmbeddingUpdate(opt, false, false, false, "sum");
    checkEmbeddingUpdate(opt, true, true, true, "mean");
  }
  checkEmbeddingUpdate("rowwise_adagrad", false, true, false, "mean");
}

}  // namespace
}  // namespace kiln::runtime::cpu
