// The collective ops of the op table (ir/ops/collective.cc): shape rules and verifier errors,
// costs against hand computation, the CPU reference run on N = 1..4 in-process ranks
// (LocalGroup threads, each interpreting the same function) against plain loops over every
// rank's inputs, gradient rules against f64 central differences of the loss summed over ranks,
// and the IR text round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "ir/collective.h"
#include "ir/interpreter.h"
#include "ir/ir.h"
#include "ir/op_def.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/target.h"
#include "ir/verifier.h"
#include "runtime/comm/local_group.h"
#include "runtime/comm/rank_group.h"

namespace kiln::ir {
namespace {

TensorType type(DType t, std::vector<Dim> dims) { return TensorType(t, std::move(dims)); }
std::vector<Dim> fixed(std::vector<int64_t> dims) {
  std::vector<Dim> out;
  for (int64_t d : dims) out.push_back(Dim::fixed(d));
  return out;
}
TensorType f32(std::vector<int64_t> dims) { return type(DType::f32, fixed(std::move(dims))); }
TensorType f64(std::vector<int64_t> dims) { return type(DType::f64, fixed(std::move(dims))); }
TensorType i64(std::vector<int64_t> dims) { return type(DType::i64, fixed(std::move(dims))); }

AttrDict group(int64_t n) { return {{"ranks", Attribute(n)}}; }
AttrDict groupAxis(int64_t n, int64_t axis) { return {{"ranks", Attribute(n)}, {"axis", Attribute(axis)}}; }

// One op over inputs x0, x1, ... in a fresh function; its inferred types or its error.
struct Built {
  std::unique_ptr<Module> module = std::make_unique<Module>();
  Op* op = nullptr;
};
Expected<Built> build(OpCode code, const std::vector<TensorType>& operands, AttrDict attrs,
                      const std::vector<TensorType>& result_types = {}) {
  Built b;
  Function& f = b.module->addFunction("f");
  Builder builder(f.entry());
  std::vector<Value*> xs;
  for (size_t i = 0; i < operands.size(); ++i) {
    KILN_ASSIGN_OR_RETURN(Op * in, builder.createWithTypes(OpCode::Input, {}, {operands[i]},
                                                           {{"name", Attribute("x" + std::to_string(i))}}));
    xs.push_back(in->result());
  }
  if (result_types.empty()) {
    KILN_ASSIGN_OR_RETURN(b.op, builder.create(code, xs, std::move(attrs)));
  } else {
    KILN_ASSIGN_OR_RETURN(b.op, builder.createWithTypes(code, xs, result_types, std::move(attrs)));
  }
  return b;
}
std::string errorOf(OpCode code, const std::vector<TensorType>& operands, AttrDict attrs,
                    const std::vector<TensorType>& result_types = {}) {
  auto b = build(code, operands, std::move(attrs), result_types);
  return b ? "" : b.status().message();
}

// ---- Shape rules and verifier -----------------------------------------------------------------

TEST(CollectiveShapes, InferredTypes) {
  auto ar = build(OpCode::AllReduce, {f32({6, 4})}, group(3));
  ASSERT_TRUE(ar) << ar.status().str();
  EXPECT_EQ(ar->op->result()->type(), f32({6, 4}));
  EXPECT_EQ(ar->op->strAttr("group"), "world");  // the default

  auto rs = build(OpCode::ReduceScatter, {f32({6, 4})}, group(3));
  ASSERT_TRUE(rs) << rs.status().str();
  EXPECT_EQ(rs->op->result()->type(), f32({2, 4}));
  auto rs1 = build(OpCode::ReduceScatter, {f32({4, 6})}, groupAxis(3, 1));
  ASSERT_TRUE(rs1) << rs1.status().str();
  EXPECT_EQ(rs1->op->result()->type(), f32({4, 2}));
  auto rs_sym =
      build(OpCode::ReduceScatter, {type(DType::f32, {Dim::symbol("B", 4), Dim::fixed(8)})}, group(2));
  ASSERT_TRUE(rs_sym) << rs_sym.status().str();
  EXPECT_EQ(rs_sym->op->result()->type(), type(DType::f32, {Dim::symbol("B", 2), Dim::fixed(8)}));

  auto ag = build(OpCode::AllGather, {type(DType::bf16, {Dim::symbol("B"), Dim::fixed(8)})}, group(4));
  ASSERT_TRUE(ag) << ag.status().str();
  EXPECT_EQ(ag->op->result()->type(), type(DType::bf16, {Dim::symbol("B", 4), Dim::fixed(8)}));
  auto ag1 = build(OpCode::AllGather, {f32({2, 3})}, groupAxis(4, -1));
  ASSERT_TRUE(ag1) << ag1.status().str();
  EXPECT_EQ(ag1->op->result()->type(), f32({2, 12}));

  auto a2a = build(OpCode::AllToAll, {f32({6, 4})}, group(3));
  ASSERT_TRUE(a2a) << a2a.status().str();
  EXPECT_EQ(a2a->op->result()->type(), f32({6, 4}));

  const TensorType rows = type(DType::f32, {Dim::bounded(Dim::fixed(64)), Dim::fixed(4)});
  auto a2av = build(OpCode::AllToAllV, {f32({10, 4}), i64({4})}, group(4), {rows, i64({4})});
  ASSERT_TRUE(a2av) << a2av.status().str();
  EXPECT_EQ(a2av->op->result(0)->type().str(), "!kiln.tensor<?(64)x4xf32>");
}

TEST(CollectiveShapes, VerifierErrors) {
  EXPECT_NE(errorOf(OpCode::ReduceScatter, {f32({5, 4})}, group(2)).find("5 does not divide by 2"),
            std::string::npos);
  EXPECT_NE(errorOf(OpCode::ReduceScatter, {type(DType::f32, {Dim::symbol("B", 3)})}, group(2))
                .find("does not divide"),
            std::string::npos);
  EXPECT_NE(errorOf(OpCode::AllToAll, {f32({7})}, group(3)).find("7 does not divide by 3"),
            std::string::npos);
  EXPECT_NE(errorOf(OpCode::AllGather, {f32({2, 3})}, groupAxis(2, 2)).find("axis"), std::string::npos);
  EXPECT_NE(errorOf(OpCode::AllGather, {f32({})}, group(2)).find("rank >= 1"), std::string::npos);
  EXPECT_NE(errorOf(OpCode::AllReduce, {f32({4})}, group(0)).find("ranks >= 1"), std::string::npos);
  EXPECT_NE(errorOf(OpCode::AllReduce, {f32({4})}, {}).find("ranks"), std::string::npos);
  EXPECT_NE(
      errorOf(OpCode::AllReduce, {type(DType::i1, fixed({4}))}, group(2)).find("no sum for element type i1"),
      std::string::npos);
  EXPECT_NE(errorOf(OpCode::AllReduce, {type(DType::f32, {Dim::bounded(Dim::fixed(8))})}, group(2))
                .find("data-dependent"),
            std::string::npos);

  const TensorType rows = type(DType::f32, {Dim::bounded(Dim::fixed(64)), Dim::fixed(4)});
  EXPECT_NE(errorOf(OpCode::AllToAllV, {f32({10, 4}), i64({3})}, group(4), {rows, i64({4})})
                .find("send counts must be an integer tensor of 4 elements"),
            std::string::npos);
  EXPECT_NE(
      errorOf(OpCode::AllToAllV, {f32({10, 4}), f32({4})}, group(4), {rows, i64({4})}).find("send counts"),
      std::string::npos);
  EXPECT_NE(
      errorOf(OpCode::AllToAllV, {f32({10, 5}), i64({4})}, group(4), {rows, i64({4})}).find("row shape"),
      std::string::npos);
  EXPECT_NE(errorOf(OpCode::AllToAllV, {f32({10, 4}), i64({4})}, group(4), {rows, i64({3})})
                .find("receive counts must be !kiln.tensor<4xi64>"),
            std::string::npos);
}

// ---- Costs ------------------------------------------------------------------------------------

TEST(CollectiveCost, BytesOnTheWireAndTime) {
  const double mib = 1024.0 * 1024.0;  // f32[1024, 256]
  const Target h200 = h200Target();
  struct Case {
    OpCode code;
    std::vector<TensorType> operands;
    AttrDict attrs;
    std::vector<TensorType> result_types;
    double wire;
    double steps;
  };
  const TensorType rows = type(DType::f32, {Dim::bounded(Dim::fixed(2048)), Dim::fixed(256)});
  const std::vector<Case> cases = {
      {OpCode::AllReduce, {f32({1024, 256})}, group(4), {}, 2 * 3.0 / 4 * mib, 6},
      {OpCode::ReduceScatter, {f32({1024, 256})}, group(4), {}, 3.0 / 4 * mib, 3},
      {OpCode::AllGather, {f32({256, 256})}, group(4), {}, 3.0 / 4 * mib, 3},
      // The all_to_alls post their 3 messages at once: one latency.
      {OpCode::AllToAll, {f32({1024, 256})}, group(4), {}, 3.0 / 4 * mib, 1},
      {OpCode::AllToAllV, {f32({1024, 256}), i64({4})}, group(4), {rows, i64({4})}, 3.0 / 4 * mib, 1},
  };
  for (const Case& c : cases) {
    auto b = build(c.code, c.operands, c.attrs, c.result_types);
    ASSERT_TRUE(b) << b.status().str();
    const OpCost cost = b->op->def()->cost(*b->op, {});
    EXPECT_DOUBLE_EQ(cost.comm_bytes, c.wire) << b->op->name();
    EXPECT_TRUE(isCollective(*b->op));
    const double intra = c.steps * h200.intra_node.latency_s + c.wire / h200.intra_node.bytes_per_s;
    const double inter = c.steps * h200.inter_node.latency_s + c.wire / h200.inter_node.bytes_per_s;
    EXPECT_DOUBLE_EQ(collectiveSeconds(*b->op, {}, h200, LinkScope::intra_node), intra) << b->op->name();
    EXPECT_DOUBLE_EQ(collectiveSeconds(*b->op, {}, h200, LinkScope::inter_node), inter) << b->op->name();
  }
  // One rank moves nothing.
  auto one = build(OpCode::AllReduce, {f32({1024, 256})}, group(1));
  ASSERT_TRUE(one);
  EXPECT_EQ(one->op->def()->cost(*one->op, {}).comm_bytes, 0);
  EXPECT_EQ(collectiveSeconds(*one->op, {}, h200, LinkScope::intra_node), 0);
}

// ---- Reference semantics over N ranks ---------------------------------------------------------

using Tensors = std::map<std::string, HostTensor>;

HostTensor hostTensor(DType t, std::vector<int64_t> shape, const std::function<double(int64_t)>& value) {
  HostTensor h(t, std::move(shape));
  for (int64_t i = 0; i < h.numel(); ++i) {
    if (t == DType::f32)
      h.as<float>()[i] = static_cast<float>(value(i));
    else if (t == DType::f64)
      h.as<double>()[i] = value(i);
    else
      h.as<int64_t>()[i] = static_cast<int64_t>(value(i));
  }
  return h;
}
double at(const HostTensor& t, int64_t i) {
  if (t.view.dtype == DType::f32) return t.as<float>()[i];
  if (t.view.dtype == DType::f64) return t.as<double>()[i];
  return static_cast<double>(t.as<int64_t>()[i]);
}

// Runs `f` on n LocalGroup threads, rank r with inputs[r]; every rank's results.
Expected<std::vector<std::vector<HostTensor>>> runRanks(const Function& f,
                                                        const std::vector<Tensors>& inputs) {
  const int n = static_cast<int>(inputs.size());
  std::vector<std::vector<HostTensor>> results(static_cast<size_t>(n));
  comm::LocalGroup g(n);
  g.setTimeout(std::chrono::milliseconds(20000));
  Status s = g.run([&](comm::Communicator& c) -> Status {
    comm::CommunicatorRankGroup ranks(c);
    KILN_ASSIGN_OR_RETURN(results[static_cast<size_t>(c.rank())],
                          interpret(f, inputs[static_cast<size_t>(c.rank())], {}, InterpretOptions{&ranks}));
    return Status::ok();
  });
  if (!s) return s;
  return results;
}

// Function @f returning the op's results.
Expected<Built> buildReturning(OpCode code, const std::vector<TensorType>& operands, AttrDict attrs,
                               const std::vector<TensorType>& result_types = {}) {
  KILN_ASSIGN_OR_RETURN(Built b, build(code, operands, std::move(attrs), result_types));
  Function& f = *b.module->functions().front();
  Builder builder(f.entry());
  std::vector<TensorType> types;
  for (Value* r : b.op->results()) types.push_back(r->type());
  KILN_RETURN_IF_ERROR(builder.createWithTypes(OpCode::Return, b.op->results(), {}));
  f.setResultTypes(types);
  KILN_RETURN_IF_ERROR(verify(f));
  return b;
}

const Function& firstFunction(const Built& b) { return *b.module->functions().front(); }

// Rank r's element i: distinct across ranks and positions, exact in f32.
double valueOf(int r, int64_t i) { return 100.0 * r + static_cast<double>(i) + 0.5; }

class CollectiveReference : public ::testing::TestWithParam<int> {};

TEST_P(CollectiveReference, AllReduce) {
  const int n = GetParam();
  auto b = buildReturning(OpCode::AllReduce, {f32({3, 2})}, group(n));
  ASSERT_TRUE(b) << b.status().str();
  std::vector<Tensors> in(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    in[static_cast<size_t>(r)]["x0"] =
        hostTensor(DType::f32, {3, 2}, [&](int64_t i) { return valueOf(r, i); });
  auto out = runRanks(firstFunction(*b), in);
  ASSERT_TRUE(out) << out.status().str();
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < 6; ++i) {
      double want = 0;
      for (int q = 0; q < n; ++q) want += valueOf(q, i);
      EXPECT_EQ(at((*out)[static_cast<size_t>(r)][0], i), want) << "rank " << r << " element " << i;
    }
}

// x_q is [outer, d, inner] around the axis; rank r gets the sum of segment r (d / n wide).
TEST_P(CollectiveReference, ReduceScatterAlongEachAxis) {
  const int n = GetParam();
  for (int64_t axis : {0, 1}) {
    const std::vector<int64_t> shape =
        axis == 0 ? std::vector<int64_t>{2 * n, 3} : std::vector<int64_t>{3, 2 * n};
    auto b = buildReturning(OpCode::ReduceScatter, {f32(shape)}, groupAxis(n, axis));
    ASSERT_TRUE(b) << b.status().str();
    std::vector<Tensors> in(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      in[static_cast<size_t>(r)]["x0"] =
          hostTensor(DType::f32, shape, [&](int64_t i) { return valueOf(r, i); });
    auto out = runRanks(firstFunction(*b), in);
    ASSERT_TRUE(out) << out.status().str();
    const int64_t outer = axis == 0 ? 1 : 3, d = 2 * n, inner = axis == 0 ? 3 : 1, part = d / n;
    for (int r = 0; r < n; ++r) {
      const HostTensor& y = (*out)[static_cast<size_t>(r)][0];
      ASSERT_EQ(y.numel(), outer * part * inner);
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t j = 0; j < part; ++j)
          for (int64_t k = 0; k < inner; ++k) {
            double want = 0;
            for (int q = 0; q < n; ++q) want += valueOf(q, (o * d + r * part + j) * inner + k);
            EXPECT_EQ(at(y, (o * part + j) * inner + k), want) << "axis " << axis << " rank " << r;
          }
    }
  }
}

TEST_P(CollectiveReference, AllGatherAlongEachAxis) {
  const int n = GetParam();
  for (int64_t axis : {0, 1}) {
    const std::vector<int64_t> shape = {2, 3};
    auto b = buildReturning(OpCode::AllGather, {f32(shape)}, groupAxis(n, axis));
    ASSERT_TRUE(b) << b.status().str();
    std::vector<Tensors> in(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      in[static_cast<size_t>(r)]["x0"] =
          hostTensor(DType::f32, shape, [&](int64_t i) { return valueOf(r, i); });
    auto out = runRanks(firstFunction(*b), in);
    ASSERT_TRUE(out) << out.status().str();
    const int64_t outer = axis == 0 ? 1 : 2, d = axis == 0 ? 2 : 3, inner = axis == 0 ? 3 : 1;
    for (int r = 0; r < n; ++r) {
      const HostTensor& y = (*out)[static_cast<size_t>(r)][0];
      ASSERT_EQ(y.numel(), 6 * n);
      for (int p = 0; p < n; ++p)
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t j = 0; j < d; ++j)
            for (int64_t k = 0; k < inner; ++k)
              EXPECT_EQ(at(y, (o * n * d + p * d + j) * inner + k), valueOf(p, (o * d + j) * inner + k))
                  << "axis " << axis << " rank " << r;
    }
  }
}

TEST_P(CollectiveReference, AllToAll) {
  const int n = GetParam();
  const std::vector<int64_t> shape = {2 * n, 3};
  auto b = buildReturning(OpCode::AllToAll, {f32(shape)}, group(n));
  ASSERT_TRUE(b) << b.status().str();
  std::vector<Tensors> in(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    in[static_cast<size_t>(r)]["x0"] =
        hostTensor(DType::f32, shape, [&](int64_t i) { return valueOf(r, i); });
  auto out = runRanks(firstFunction(*b), in);
  ASSERT_TRUE(out) << out.status().str();
  const int64_t seg = 2 * 3;  // elements per peer
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < seg; ++i)
        EXPECT_EQ(at((*out)[static_cast<size_t>(r)][0], p * seg + i), valueOf(p, r * seg + i))
            << "rank " << r;
}

// counts[r][p]: rows rank r sends to peer p.
void checkAllToAllV(int n, const std::vector<std::vector<int64_t>>& counts) {
  const int64_t width = 2, cap = 4 * n;
  const TensorType rows_in = type(DType::f32, {Dim::bounded(Dim::fixed(cap)), Dim::fixed(width)});
  const TensorType rows_out = type(DType::f32, {Dim::bounded(Dim::fixed(cap)), Dim::fixed(width)});
  auto b = buildReturning(OpCode::AllToAllV, {rows_in, i64({n})}, group(n), {rows_out, i64({n})});
  ASSERT_TRUE(b) << b.status().str();
  std::vector<Tensors> in(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const auto& c = counts[static_cast<size_t>(r)];
    int64_t total = 0;
    for (int64_t v : c) total += v;
    in[static_cast<size_t>(r)]["x0"] =
        hostTensor(DType::f32, {total, width}, [&](int64_t i) { return valueOf(r, i); });
    in[static_cast<size_t>(r)]["x1"] = hostTensor(
        DType::i64, {n}, [&](int64_t p) { return static_cast<double>(c[static_cast<size_t>(p)]); });
  }
  auto out = runRanks(firstFunction(*b), in);
  ASSERT_TRUE(out) << out.status().str();
  for (int r = 0; r < n; ++r) {
    const HostTensor& rows = (*out)[static_cast<size_t>(r)][0];
    const HostTensor& recv = (*out)[static_cast<size_t>(r)][1];
    std::vector<double> want;
    for (int p = 0; p < n; ++p) {
      int64_t offset = 0;  // where p's rows for r start in p's operand
      for (int q = 0; q < r; ++q) offset += counts[static_cast<size_t>(p)][static_cast<size_t>(q)];
      const int64_t c = counts[static_cast<size_t>(p)][static_cast<size_t>(r)];
      EXPECT_EQ(at(recv, p), c) << "rank " << r << " from " << p;
      for (int64_t i = offset * width; i < (offset + c) * width; ++i) want.push_back(valueOf(p, i));
    }
    ASSERT_EQ(rows.view.shape, (std::vector<int64_t>{static_cast<int64_t>(want.size()) / width, width}))
        << "rank " << r;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_EQ(at(rows, static_cast<int64_t>(i)), want[i]) << "rank " << r;
  }
}

TEST_P(CollectiveReference, AllToAllVUnevenCounts) {
  const int n = GetParam();
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < n; ++p) counts[static_cast<size_t>(r)].push_back((r + 2 * p) % 3);  // zeros included
  checkAllToAllV(n, counts);
}

TEST_P(CollectiveReference, AllToAllVEmpty) {
  const int n = GetParam();
  checkAllToAllV(n, std::vector<std::vector<int64_t>>(static_cast<size_t>(n),
                                                      std::vector<int64_t>(static_cast<size_t>(n), 0)));
  // One rank sends everything to the last; the others send nothing.
  std::vector<std::vector<int64_t>> one(static_cast<size_t>(n),
                                        std::vector<int64_t>(static_cast<size_t>(n), 0));
  one[0][static_cast<size_t>(n - 1)] = 3;
  checkAllToAllV(n, one);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectiveReference, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "N" + std::to_string(info.param);
                         });

TEST(CollectiveReference, WithoutAGroupOneRankIsTheIdentityAndMoreIsAnError) {
  auto one = buildReturning(OpCode::AllGather, {f32({2})}, group(1));
  ASSERT_TRUE(one) << one.status().str();
  auto r = interpret(firstFunction(*one),
                     {{"x0", hostTensor(DType::f32, {2}, [](int64_t i) { return i + 1.0; })}}, {});
  ASSERT_TRUE(r) << r.status().str();
  EXPECT_EQ(at((*r)[0], 1), 2.0);

  auto two = buildReturning(OpCode::AllReduce, {f32({2})}, group(2));
  ASSERT_TRUE(two);
  auto e =
      interpret(firstFunction(*two), {{"x0", hostTensor(DType::f32, {2}, [](int64_t) { return 1.0; })}}, {});
  ASSERT_FALSE(e);
  EXPECT_NE(e.status().message().find("runs over 2 ranks, but it was run without a rank group"),
            std::string::npos);

  // The op's group size must be the group's.
  std::vector<Tensors> in(3, Tensors{{"x0", hostTensor(DType::f32, {2}, [](int64_t) { return 1.0; })}});
  auto mismatch = runRanks(firstFunction(*two), in);
  ASSERT_FALSE(mismatch);
  EXPECT_NE(mismatch.status().message().find("its rank group has 3"), std::string::npos);
}

TEST(CollectiveReference, AllToAllVRunTimeErrors) {
  const TensorType rows = type(DType::f32, {Dim::bounded(Dim::fixed(4)), Dim::fixed(1)});
  auto b = buildReturning(OpCode::AllToAllV, {rows, i64({2})}, group(2), {rows, i64({2})});
  ASSERT_TRUE(b) << b.status().str();
  auto inputs = [](std::vector<int64_t> c0, int64_t rows0, std::vector<int64_t> c1, int64_t rows1) {
    std::vector<Tensors> in(2);
    in[0]["x0"] = hostTensor(DType::f32, {rows0, 1}, [](int64_t i) { return static_cast<double>(i); });
    in[0]["x1"] = hostTensor(DType::i64, {2},
                             [&](int64_t p) { return static_cast<double>(c0[static_cast<size_t>(p)]); });
    in[1]["x0"] = hostTensor(DType::f32, {rows1, 1}, [](int64_t i) { return static_cast<double>(i); });
    in[1]["x1"] = hostTensor(DType::i64, {2},
                             [&](int64_t p) { return static_cast<double>(c1[static_cast<size_t>(p)]); });
    return in;
  };
  // Counts that do not add up to the rows.
  auto bad_sum = runRanks(firstFunction(*b), inputs({1, 1}, 3, {0, 0}, 0));
  ASSERT_FALSE(bad_sum);
  EXPECT_NE(bad_sum.status().message().find("send counts add up to 2 rows but the operand has 3"),
            std::string::npos);
  // Rank 1 would receive 3 + 2 = 5 rows into a result of at most 4.
  auto overflow = runRanks(firstFunction(*b), inputs({0, 3}, 3, {2, 2}, 4));
  ASSERT_FALSE(overflow);
  EXPECT_NE(overflow.status().message().find("receives 5 rows"), std::string::npos)
      << overflow.status().str();
  // A negative count.
  auto negative = runRanks(firstFunction(*b), inputs({-1, 1}, 0, {0, 0}, 0));
  ASSERT_FALSE(negative);
  EXPECT_NE(negative.status().message().find("negative"), std::string::npos);
}

// ---- Gradients --------------------------------------------------------------------------------

// A collective y = op(x[, counts]) on every rank, the loss L = sum over ranks of sum(y_r * w_r)
// (the convention of the gradient rules), and the rule's dL/dx_r, checked against central
// differences of L in f64, perturbing one element of one rank's x at a time.
struct GradCase {
  std::string label;
  OpCode code;
  AttrDict attrs;
  std::vector<int64_t> x_shape;              // rank r's x (the same on every rank here, but a2av)
  std::vector<std::vector<int64_t>> counts;  // all_to_all_v: counts[r][p]
};

struct GradFunctions {
  std::unique_ptr<Module> module = std::make_unique<Module>();
  Function* loss = nullptr;
  Function* grad = nullptr;
};

// Builds x (and counts), the op, and w shaped like y; returns the op.
Expected<Op*> buildForward(Builder& b, const GradCase& c, int n, Value** w) {
  const bool v = c.code == OpCode::AllToAllV;
  const int64_t cap = 4 * n;
  const TensorType x_type =
      v ? type(DType::f64, {Dim::bounded(Dim::fixed(cap)), Dim::fixed(c.x_shape[1])}) : f64(c.x_shape);
  KILN_ASSIGN_OR_RETURN(Op * x, b.createWithTypes(OpCode::Input, {}, {x_type}, {{"name", Attribute("x0")}}));
  Op* op = nullptr;
  if (v) {
    KILN_ASSIGN_OR_RETURN(Op * counts,
                          b.createWithTypes(OpCode::Input, {}, {i64({n})}, {{"name", Attribute("x1")}}));
    KILN_ASSIGN_OR_RETURN(
        op, b.createWithTypes(c.code, {x->result(), counts->result()}, {x_type, i64({n})}, c.attrs));
  } else {
    KILN_ASSIGN_OR_RETURN(op, b.create(c.code, {x->result()}, c.attrs));
  }
  KILN_ASSIGN_OR_RETURN(
      Op * wop, b.createWithTypes(OpCode::Input, {}, {op->result()->type()}, {{"name", Attribute("w")}}));
  *w = wop->result();
  return op;
}

Status finish(Function& f, Builder& b, Value* v) {
  KILN_RETURN_IF_ERROR(b.createWithTypes(OpCode::Return, {v}, {}));
  f.setResultTypes({v->type()});
  return verify(f);
}

Expected<GradFunctions> buildGradFunctions(const GradCase& c, int n) {
  GradFunctions g;
  g.loss = &g.module->addFunction("loss");
  {
    Builder b(g.loss->entry());
    Value* w = nullptr;
    KILN_ASSIGN_OR_RETURN(Op * op, buildForward(b, c, n, &w));
    KILN_ASSIGN_OR_RETURN(Value * yw, b.createValue(OpCode::Mul, {op->result(), w}));
    std::vector<int64_t> axes;
    for (int64_t i = 0; i < yw->type().rank(); ++i) axes.push_back(i);
    KILN_ASSIGN_OR_RETURN(
        Value * l,
        b.createValue(OpCode::Reduce, {yw}, {{"kind", Attribute("sum")}, {"axes", Attribute::ints(axes)}}));
    KILN_RETURN_IF_ERROR(finish(*g.loss, b, l));
  }
  g.grad = &g.module->addFunction("grad");
  {
    Builder b(g.grad->entry());
    Value* w = nullptr;
    KILN_ASSIGN_OR_RETURN(Op * op, buildForward(b, c, n, &w));
    std::vector<Value*> result_grads(op->numResults(), nullptr);
    result_grads[0] = w;
    GradContext ctx{b, result_grads, {}};
    KILN_RETURN_IF_ERROR(op->def()->grad(ctx, *op));
    if (ctx.operand_grads.empty() || !ctx.operand_grads[0]) return Status::error("no gradient for x");
    for (size_t i = 1; i < ctx.operand_grads.size(); ++i)
      if (ctx.operand_grads[i]) return Status::error("the counts got a gradient");
    if (!(ctx.operand_grads[0]->type() == op->operand(0)->type()))
      return Status::error("gradient has the wrong type");
    KILN_RETURN_IF_ERROR(finish(*g.grad, b, ctx.operand_grads[0]));
  }
  return g;
}

class CollectiveGradient : public ::testing::TestWithParam<std::tuple<int, int>> {};

std::vector<GradCase> gradCases(int n) {
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < n; ++p) counts[static_cast<size_t>(r)].push_back((2 * r + p + 1) % 3);
  return {
      {"AllReduce", OpCode::AllReduce, group(n), {2, 2}, {}},
      {"ReduceScatterAxis0", OpCode::ReduceScatter, groupAxis(n, 0), {n, 2}, {}},
      {"ReduceScatterAxis1", OpCode::ReduceScatter, groupAxis(n, 1), {2, n}, {}},
      {"AllGatherAxis0", OpCode::AllGather, groupAxis(n, 0), {1, 2}, {}},
      {"AllGatherAxis1", OpCode::AllGather, groupAxis(n, 1), {2, 1}, {}},
      {"AllToAll", OpCode::AllToAll, group(n), {n, 2}, {}},
      {"AllToAllV", OpCode::AllToAllV, group(n), {0, 2}, counts},
  };
}

TEST_P(CollectiveGradient, RuleMatchesCentralDifferencesOfTheLossSummedOverRanks) {
  const int n = std::get<0>(GetParam());
  const GradCase c = gradCases(n)[static_cast<size_t>(std::get<1>(GetParam()))];
  SCOPED_TRACE(c.label + " N=" + std::to_string(n));
  auto fns = buildGradFunctions(c, n);
  ASSERT_TRUE(fns) << fns.status().str();

  // Every rank's inputs; w is shaped like the rank's actual y.
  std::vector<Tensors> in(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::vector<int64_t> x_shape = c.x_shape;
    std::vector<int64_t> y_shape;
    if (c.code == OpCode::AllToAllV) {
      int64_t sent = 0, received = 0;
      for (int p = 0; p < n; ++p) {
        sent += c.counts[static_cast<size_t>(r)][static_cast<size_t>(p)];
        received += c.counts[static_cast<size_t>(p)][static_cast<size_t>(r)];
      }
      x_shape[0] = sent;
      y_shape = {received, x_shape[1]};
      in[static_cast<size_t>(r)]["x1"] = hostTensor(DType::i64, {n}, [&](int64_t p) {
        return static_cast<double>(c.counts[static_cast<size_t>(r)][static_cast<size_t>(p)]);
      });
    }
    in[static_cast<size_t>(r)]["x0"] =
        hostTensor(DType::f64, x_shape, [&](int64_t i) { return std::sin(1.3 * r + 0.7 * i); });
    if (y_shape.empty()) {
      // The op's inferred type at rank r (all static here).
      auto b = build(c.code, {f64(c.x_shape)}, c.attrs);
      EXPECT_TRUE(b) << b.status().str();
      if (!b) return;
      for (const Dim& d : b->op->result()->type().shape()) y_shape.push_back(d.size());
    }
    in[static_cast<size_t>(r)]["w"] =
        hostTensor(DType::f64, y_shape, [&](int64_t i) { return std::cos(0.9 * r + 1.1 * i); });
  }

  auto analytic = runRanks(*fns->grad, in);
  ASSERT_TRUE(analytic) << analytic.status().str();
  auto totalLoss = [&](const std::vector<Tensors>& inputs) {
    auto r = runRanks(*fns->loss, inputs);
    EXPECT_TRUE(r) << r.status().str();
    double sum = 0;
    if (r)
      for (const auto& rank : *r) sum += at(rank[0], 0);
    return sum;
  };
  const double eps = 1e-6;
  for (int r = 0; r < n; ++r) {
    const HostTensor& dx = (*analytic)[static_cast<size_t>(r)][0];
    ASSERT_EQ(dx.view.shape, in[static_cast<size_t>(r)]["x0"].view.shape);
    for (int64_t e = 0; e < dx.numel(); ++e) {
      std::vector<Tensors> plus = in, minus = in;
      plus[static_cast<size_t>(r)]["x0"].as<double>()[e] += eps;
      minus[static_cast<size_t>(r)]["x0"].as<double>()[e] -= eps;
      const double fd = (totalLoss(plus) - totalLoss(minus)) / (2 * eps);
      EXPECT_NEAR(at(dx, e), fd, 1e-6 * (1 + std::abs(fd))) << "rank " << r << " element " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectiveGradient,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Range(0, 7)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return gradCases(1)[static_cast<size_t>(std::get<1>(info.param))].label + "_N" +
                                  std::to_string(std::get<0>(info.param));
                         });

// ---- Text round trip --------------------------------------------------------------------------

TEST(CollectiveText, PrintParseRoundTrip) {
  const std::string text =
      R"(func.func @step(%x: !kiln.tensor<8x4xf32>, %ids: !kiln.tensor<?(64)x4xf32>, %counts: !kiln.tensor<4xi64>) -> !kiln.tensor<8x4xf32> {
  %0 = "kiln.all_reduce"(%x) {group = "world", ranks = 4} : (!kiln.tensor<8x4xf32>) -> !kiln.tensor<8x4xf32>
  %1 = "kiln.reduce_scatter"(%0) {axis = 0, group = "world", ranks = 4} : (!kiln.tensor<8x4xf32>) -> !kiln.tensor<2x4xf32>
  %2 = "kiln.all_gather"(%1) {axis = 0, group = "world", ranks = 4} : (!kiln.tensor<2x4xf32>) -> !kiln.tensor<8x4xf32>
  %3 = "kiln.all_to_all"(%2) {group = "world", ranks = 4} : (!kiln.tensor<8x4xf32>) -> !kiln.tensor<8x4xf32>
  %4:2 = "kiln.all_to_all_v"(%ids, %counts) {group = "world", ranks = 4} : (!kiln.tensor<?(64)x4xf32>, !kiln.tensor<4xi64>) -> (!kiln.tensor<?(128)x4xf32>, !kiln.tensor<4xi64>)
  return %3 : !kiln.tensor<8x4xf32>
}
)";
  auto m = parseModule(text);
  ASSERT_TRUE(m) << m.status().str();
  ASSERT_TRUE(verify(**m)) << verify(**m).str();
  const std::string printed = printModule(**m);
  auto again = parseModule(printed);
  ASSERT_TRUE(again) << again.status().str() << "\n" << printed;
  EXPECT_EQ(printModule(**again), printed);
  for (const char* name : {"kiln.all_reduce", "kiln.reduce_scatter", "kiln.all_gather", "kiln.all_to_all\"",
                           "kiln.all_to_all_v"})
    EXPECT_NE(printed.find(name), std::string::npos) << name << "\n" << printed;
}

}  // namespace
}  // namespace kiln::ir

// ---- bucketize_ids ------------------------------------------------------------------------------

namespace kiln::ir {
namespace {

// bucketize_ids on one rank, its four results.
std::vector<HostTensor> bucketize(const std::vector<TensorType>& types, const Tensors& in, AttrDict attrs) {
  auto b = buildReturning(OpCode::BucketizeIds, types, std::move(attrs));
  EXPECT_TRUE(b) << b.status().str();
  if (!b) return {};
  auto r = interpret(*b->module->functions().front(), in, {});
  EXPECT_TRUE(r) << r.status().str();
  return r ? r.take() : std::vector<HostTensor>{};
}
std::vector<int64_t> ints(const HostTensor& t) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < t.view.numel(); ++i) v.push_back(t.as<int64_t>()[i]);
  return v;
}
AttrDict routing(const char* mode, std::vector<int64_t> owners, std::vector<int64_t> starts,
                 int64_t rank = 0) {
  AttrDict a{{"ranks", Attribute(int64_t{3})}, {"rank", Attribute(rank)},
             {"table", Attribute("t")},        {"rows", Attribute(int64_t{9})},
             {"mode", Attribute(mode)},        {"owners", Attribute::ints(owners)}};
  if (!starts.empty()) a["row_starts"] = Attribute::ints(starts);
  return a;
}

TEST(BucketizeIds, PartitionsRowBlocksByOwnerInSampleOrder) {
  // 3 samples of 2 ids over rows [0, 4) on rank 2, [4, 8) on rank 0, [8, 9) on rank 1.
  HostTensor ids =
      hostTensor(DType::i64, {3, 2}, [](int64_t i) { return std::vector<double>{5, 0, 8, 3, 4, 7}[i]; });
  auto out = bucketize({i64({3, 2})}, {{"x0", ids}}, routing("partition", {2, 0, 1}, {0, 4, 8, 9}, 1));
  ASSERT_EQ(out.size(), 4u);
  // To rank 0 (rows 4..7, local = id - 4): 5 (sample 0), 4, 7 (sample 2); to rank 1: 8 (sample
  // 1) as row 0; to rank 2: 0 (sample 0), 3 (sample 1).
  EXPECT_EQ(ints(out[0]), (std::vector<int64_t>{1, 0, 3, 0, 0, 3}));
  EXPECT_EQ(ints(out[1]), (std::vector<int64_t>{1, 0, 2, /*rank 1*/ 0, 1, 0, /*rank 2*/ 1, 1, 0}));
  EXPECT_EQ(ints(out[2]), (std::vector<int64_t>{3, 1, 2}));
  EXPECT_EQ(ints(out[3]), (std::vector<int64_t>{3, 3, 3}));  // rank 1 owns a block: 3 rows back to each
}

TEST(BucketizeIds, ReplicatesToEveryHolderAndTakesFlatIds) {
  HostTensor ids = hostTensor(DType::i64, {3}, [](int64_t i) { return std::vector<double>{2, 6, 1}[i]; });
  HostTensor lengths = hostTensor(DType::i64, {2}, [](int64_t i) { return std::vector<double>{2, 1}[i]; });
  auto out = bucketize({type(DType::i64, {Dim::bounded(Dim::fixed(4))}), i64({2})},
                       {{"x0", ids}, {"x1", lengths}}, routing("replicate", {0, 2}, {}));
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(ints(out[0]), (std::vector<int64_t>{2, 6, 1, 2, 6, 1}));
  EXPECT_EQ(ints(out[1]), (std::vector<int64_t>{2, 1, 0, 0, 2, 1}));
  EXPECT_EQ(ints(out[2]), (std::vector<int64_t>{3, 0, 3}));
  EXPECT_EQ(ints(out[3]), (std::vector<int64_t>{2, 2, 2}));  // rank 0 holds the table
}

// A route of table 't' (9 rows) given the id 9: a run-time error naming the table.
void expectOutOfRangeNamesTheTable(OpCode op) {
  auto b = buildReturning(op, {i64({1, 1})}, routing("partition", {0}, {0, 9}));
  ASSERT_TRUE(b) << b.status().str();
  auto r = interpret(*b->module->functions().front(),
                     {{"x0", hostTensor(DType::i64, {1, 1}, [](int64_t) { return 9.0; })}}, {});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("out of range for table 't' of 9 rows"), std::string::npos)
      << r.status().str();
}

TEST(BucketizeIds, AnIdOutOfRangeNamesTheTable) { expectOutOfRangeNamesTheTable(OpCode::BucketizeIds); }

TEST(BucketizeIds, BadRoutingIsAVerifierError) {
  EXPECT_NE(
      errorOf(OpCode::BucketizeIds, {i64({2, 1})}, routing("partition", {0, 1}, {0, 9})).find("row_starts"),
      std::string::npos);
  EXPECT_NE(
      errorOf(OpCode::BucketizeIds, {i64({2, 1})}, routing("partition", {5}, {0, 9})).find("not a rank"),
      std::string::npos);
}


// ---- dedup_ids ----------------------------------------------------------------------------------

TEST(DedupIds, DistinctIdsGoOnceToTheirOwnersInRankOrder) {
  // Rows [0, 4) on rank 2, [4, 9) on rank 0: rank 0's distinct ids first, each made local.
  // Bags [7, 2], [7, 3], [8, 2] hold the distinct 2, 3, 7, 8.
  HostTensor ids =
      hostTensor(DType::i64, {3, 2}, [](int64_t i) { return std::vector<double>{7, 2, 7, 3, 8, 2}[i]; });
  auto b = buildReturning(OpCode::DedupIds, {i64({3, 2})}, routing("partition", {2, 0}, {0, 4, 9}));
  ASSERT_TRUE(b) << b.status().str();
  auto out = interpret(*b->module->functions().front(), {{"x0", ids}}, {});
  ASSERT_TRUE(out) << out.status().str();
  ASSERT_EQ(out->size(), 3u);
  EXPECT_EQ(ints((*out)[0]), (std::vector<int64_t>{3, 4, 2, 3}));
  EXPECT_EQ(ints((*out)[1]), (std::vector<int64_t>{0, 2, 0, 3, 1, 2}));
  EXPECT_EQ(ints((*out)[2]), (std::vector<int64_t>{2, 0, 2}));
}

TEST(DedupIds, FlatIdsAgainstASetPerOwner) {
  // Random bags of a skewed stream over 3 owners against std::set per owner: every id comes
  // back through the inverse, each owner's ids are distinct and ascending, and ids past the
  // lengths' total are not sent.
  std::mt19937_64 rng(5);
  const int64_t batch = 30;
  const std::vector<int64_t> owners{1, 2, 0}, starts{0, 2, 6, 9};
  std::vector<double> lengths, ids;
  for (int64_t s = 0; s < batch; ++s) {
    lengths.push_back(static_cast<double>(rng() % 4));
    for (int k = 0; k < lengths.back(); ++k) ids.push_back(static_cast<double>(rng() % 3 ? rng() % 3 : rng() % 9));
  }
  const int64_t total = static_cast<int64_t>(ids.size());
  ids.push_back(8);  // past the total: ignored
  const int64_t m = total + 1;
  AttrDict a = routing("partition", owners, starts);
  auto b = buildReturning(OpCode::DedupIds, {i64({m}), i64({batch})}, a);
  ASSERT_TRUE(b) << b.status().str();
  auto out = interpret(*b->module->functions().front(),
                       {{"x0", hostTensor(DType::i64, {m}, [&](int64_t i) { return ids[static_cast<size_t>(i)]; })},
                        {"x1", hostTensor(DType::i64, {batch}, [&](int64_t i) { return lengths[static_cast<size_t>(i)]; })}},
                       {});
  ASSERT_TRUE(out) << out.status().str();
  const std::vector<int64_t> unique = ints((*out)[0]), inverse = ints((*out)[1]), send = ints((*out)[2]);
  std::vector<int64_t> want_unique, want_send;
  for (int64_t p = 0; p < 3; ++p) {
    std::set<int64_t> mine;
    const size_t j = static_cast<size_t>(std::find(owners.begin(), owners.end(), p) - owners.begin());
    for (int64_t i = 0; i < total; ++i) {
      const auto id = static_cast<int64_t>(ids[static_cast<size_t>(i)]);
      if (id >= starts[j] && id < starts[j + 1]) mine.insert(id - starts[j]);
    }
    want_unique.insert(want_unique.end(), mine.begin(), mine.end());
    want_send.push_back(static_cast<int64_t>(mine.size()));
  }
  EXPECT_EQ(unique, want_unique);
  EXPECT_EQ(send, want_send);
  ASSERT_EQ(inverse.size(), static_cast<size_t>(m));
  // The id back from its position: its segment's owner's row start plus the local id.
  std::vector<int64_t> segment_start{0};
  for (int64_t c : send) segment_start.push_back(segment_start.back() + c);
  for (int64_t i = 0; i < total; ++i) {
    const int64_t at = inverse[static_cast<size_t>(i)];
    const int64_t p = static_cast<int64_t>(std::upper_bound(segment_start.begin(), segment_start.end(), at) -
                                           segment_start.begin()) - 1;
    const size_t j = static_cast<size_t>(std::find(owners.begin(), owners.end(), p) - owners.begin());
    EXPECT_EQ(unique[static_cast<size_t>(at)] + starts[j], static_cast<int64_t>(ids[static_cast<size_t>(i)]))
        << "id " << i;
  }
}

TEST(DedupIds, AnIdOutOfRangeNamesTheTable) {
  expectOutOfRangeNamesTheTable(OpCode::DedupIds);
  EXPECT_NE(errorOf(OpCode::DedupIds, {i64({2, 1})}, routing("partition", {0, 1}, {0, 9})).find("row_starts"),
            std::string::npos);
}

// ---- split_hot_ids ------------------------------------------------------------------------------

AttrDict hotRows(std::vector<int64_t> hot, int64_t rows = 9) {
  return {{"table", Attribute("t")}, {"rows", Attribute(rows)}, {"hot_rows", Attribute::ints(hot)}};
}

TEST(SplitHotIds, HotIdsBecomeReplicaRowsColdIdsStayInSampleOrder) {
  // 3 samples of 2 ids; rows 2, 5 and 7 hot (replica rows 0, 1, 2).
  HostTensor ids =
      hostTensor(DType::i64, {3, 2}, [](int64_t i) { return std::vector<double>{5, 0, 8, 3, 7, 2}[i]; });
  auto b = buildReturning(OpCode::SplitHotIds, {i64({3, 2})}, hotRows({2, 5, 7}));
  ASSERT_TRUE(b) << b.status().str();
  auto out = interpret(*b->module->functions().front(), {{"x0", ids}}, {});
  ASSERT_TRUE(out) << out.status().str();
  ASSERT_EQ(out->size(), 4u);
  EXPECT_EQ(ints((*out)[0]), (std::vector<int64_t>{1, 2, 0}));
  EXPECT_EQ(ints((*out)[1]), (std::vector<int64_t>{1, 0, 2}));
  EXPECT_EQ(ints((*out)[2]), (std::vector<int64_t>{0, 8, 3}));
  EXPECT_EQ(ints((*out)[3]), (std::vector<int64_t>{1, 2, 0}));
}

TEST(SplitHotIds, FlatIdsAgainstASetMembershipCount) {
  // Random bags against an independent split: std::set membership and a running rank.
  std::mt19937_64 rng(11);
  const int64_t rows = 50, batch = 40;
  std::set<int64_t> hot_set;
  while (hot_set.size() < 7) hot_set.insert(static_cast<int64_t>(rng() % rows));
  std::vector<int64_t> hot(hot_set.begin(), hot_set.end());
  std::vector<double> lengths, ids;
  for (int64_t b = 0; b < batch; ++b) {
    lengths.push_back(static_cast<double>(rng() % 4));
    for (int k = 0; k < lengths.back(); ++k) ids.push_back(static_cast<double>(rng() % 10 < 6 ? hot[rng() % 7] : rng() % rows));
  }
  const int64_t m = static_cast<int64_t>(ids.size());
  auto b = buildReturning(OpCode::SplitHotIds, {i64({m}), i64({batch})}, hotRows(hot, rows));
  ASSERT_TRUE(b) << b.status().str();
  auto out = interpret(*b->module->functions().front(),
                       {{"x0", hostTensor(DType::i64, {m}, [&](int64_t i) { return ids[static_cast<size_t>(i)]; })},
                        {"x1", hostTensor(DType::i64, {batch}, [&](int64_t i) { return lengths[static_cast<size_t>(i)]; })}},
                       {});
  ASSERT_TRUE(out) << out.status().str();
  std::vector<int64_t> want_hot, want_hot_len, want_cold, want_cold_len;
  size_t at = 0;
  for (int64_t s = 0; s < batch; ++s) {
    int64_t nh = 0, nc = 0;
    for (int k = 0; k < lengths[static_cast<size_t>(s)]; ++k, ++at) {
      const auto id = static_cast<int64_t>(ids[at]);
      if (hot_set.count(id)) {
        want_hot.push_back(static_cast<int64_t>(std::distance(hot_set.begin(), hot_set.find(id))));
        ++nh;
      } else {
        want_cold.push_back(id);
        ++nc;
      }
    }
    want_hot_len.push_back(nh);
    want_cold_len.push_back(nc);
  }
  EXPECT_EQ(ints((*out)[0]), want_hot);
  EXPECT_EQ(ints((*out)[1]), want_hot_len);
  EXPECT_EQ(ints((*out)[2]), want_cold);
  EXPECT_EQ(ints((*out)[3]), want_cold_len);
}

TEST(SplitHotIds, AnIdOutOfRangeNamesTheTable) {
  auto b = buildReturning(OpCode::SplitHotIds, {i64({1, 1})}, hotRows({1}));
  ASSERT_TRUE(b) << b.status().str();
  auto r = interpret(*b->module->functions().front(),
                     {{"x0", hostTensor(DType::i64, {1, 1}, [](int64_t) { return -1.0; })}}, {});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("out of range for table 't' of 9 rows"), std::string::npos)
      << r.status().str();
}

TEST(SplitHotIds, HotRowsMustRiseInsideTheTable) {
  EXPECT_NE(errorOf(OpCode::SplitHotIds, {i64({2, 1})}, hotRows({3, 3})).find("ascending; entry 1 is 3"),
            std::string::npos);
  EXPECT_NE(errorOf(OpCode::SplitHotIds, {i64({2, 1})}, hotRows({9})).find("in [0, 9)"), std::string::npos);
}

// ---- compact_rows / expand_rows -------------------------------------------------------------

std::vector<double> floats(const HostTensor& t) {
  std::vector<double> v;
  for (int64_t i = 0; i < t.view.numel(); ++i) v.push_back(t.as<float>()[i]);
  return v;
}

std::vector<HostTensor> runOp(OpCode code, const std::vector<TensorType>& types, const Tensors& in, AttrDict attrs) {
  auto b = buildReturning(code, types, std::move(attrs));
  EXPECT_TRUE(b) << b.status().str();
  if (!b) return {};
  auto r = interpret(*b->module->functions().front(), in, {});
  EXPECT_TRUE(r) << r.status().str();
  return r ? r.take() : std::vector<HostTensor>{};
}

AttrDict twoRanks() { return {{"ranks", Attribute(int64_t{2})}, {"group", Attribute("world")}}; }

TEST(CompactRows, KeepsTheRowsOfSamplesWithIdsBlockByBlock) {
  // An owner's partial pools of 2 peers' 3 samples each: peer 0's samples 0 and 2 sent ids, peer
  // 1's sample 2.
  HostTensor x = hostTensor(DType::f32, {6, 2}, [](int64_t i) { return static_cast<double>(i); });
  HostTensor lengths = hostTensor(DType::i64, {6}, [](int64_t i) { return std::vector<double>{1, 0, 2, 0, 0, 3}[i]; });
  auto out = runOp(OpCode::CompactRows, {f32({6, 2}), i64({6})}, {{"x0", x}, {"x1", lengths}}, twoRanks());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].view.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(floats(out[0]), (std::vector<double>{0, 1, 4, 5, 10, 11}));
  EXPECT_EQ(ints(out[1]), (std::vector<int64_t>{2, 1}));
  // A rank's own 3 samples' gradients, for each of 2 owners by the ids it sent each.
  HostTensor g = hostTensor(DType::f32, {3, 2}, [](int64_t i) { return static_cast<double>(i); });
  HostTensor sent = hostTensor(DType::i64, {6}, [](int64_t i) { return std::vector<double>{0, 1, 1, 1, 0, 0}[i]; });
  auto back = runOp(OpCode::CompactRows, {f32({3, 2}), i64({6})}, {{"x0", g}, {"x1", sent}}, twoRanks());
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(floats(back[0]), (std::vector<double>{2, 3, 4, 5, 0, 1}));
  EXPECT_EQ(ints(back[1]), (std::vector<int64_t>{2, 1}));
}

TEST(ExpandRows, PutsRowsBackAndZerosTheRestAgainstAMaskedCopy) {
  std::mt19937_64 rng(7);
  const int64_t n = 40, d = 3;
  std::vector<double> len(n), x(n * d);
  for (auto& l : len) l = static_cast<double>(rng() % 3);  // a third of the samples sent nothing
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<double>(rng() % 1000) / 7.0;
  HostTensor xs = hostTensor(DType::f32, {n, d}, [&](int64_t i) { return x[static_cast<size_t>(i)]; });
  HostTensor ls = hostTensor(DType::i64, {n}, [&](int64_t i) { return len[static_cast<size_t>(i)]; });
  auto packed = runOp(OpCode::CompactRows, {f32({n, d}), i64({n})}, {{"x0", xs}, {"x1", ls}}, twoRanks());
  ASSERT_EQ(packed.size(), 2u);
  const int64_t m = packed[0].view.shape[0];
  auto out = runOp(OpCode::ExpandRows, {f32({m, d}), i64({n})}, {{"x0", packed[0]}, {"x1", ls}}, {});
  ASSERT_EQ(out.size(), 1u);
  std::vector<double> want(x.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < d; ++j)
      want[static_cast<size_t>(i * d + j)] = len[static_cast<size_t>(i)] > 0 ? static_cast<float>(x[static_cast<size_t>(i * d + j)]) : 0.0;
  EXPECT_EQ(floats(out[0]), want);
  // blocks = 2: a sample's rows from the two halves of lengths, summed.
  auto summed = runOp(OpCode::ExpandRows, {f32({m, d}), i64({n})}, {{"x0", packed[0]}, {"x1", ls}},
                      {{"blocks", Attribute(int64_t{2})}});
  ASSERT_EQ(summed.size(), 1u);
  std::vector<double> halves(static_cast<size_t>(n / 2 * d));
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<float>(want[i] + want[i + halves.size()]);
  EXPECT_EQ(floats(summed[0]), halves);
  // The rows must match the samples with ids, one for one.
  auto b = buildReturning(OpCode::ExpandRows, {f32({1, d}), i64({n})}, {});
  ASSERT_TRUE(b) << b.status().str();
  auto bad = interpret(*b->module->functions().front(),
                       {{"x0", hostTensor(DType::f32, {1, d}, [](int64_t) { return 1.0; })}, {"x1", ls}}, {});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("rows arrived but more samples have ids"), std::string::npos)
      << bad.status().str();
}

}  // namespace
}  // namespace kiln::ir
