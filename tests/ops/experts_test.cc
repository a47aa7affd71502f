// The expert ops of docs/moe.md (moe_permute, moe_unpermute, moe_row_dot, grouped_matmul,
// grouped_matmul_wgrad): their shape rules, CPU references against plain loops written here,
// the run-time checks of rows and offsets, and the cost of the grouped GEMM. Their gradient
// rules are checked by finite differences in gradient_check_test.cc.
#include <algorithm>
#include <random>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

using A = Attribute;

std::vector<double> randomValues(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = u(rng);
  return v;
}

// A routing written out by hand: rows in expert-major order (token order within an expert),
// with some slots dropped, `pad` padding rows (-1) after each expert's rows, and expert 1 empty.
struct Routing {
  int64_t tokens, k, experts;
  std::vector<double> rows;     // slot per row, -1 for padding
  std::vector<double> offsets;  // E + 1
};
Routing makeRouting(int64_t tokens, int64_t k, int64_t experts, int64_t pad, std::mt19937& rng) {
  Routing r{tokens, k, experts, {}, {0}};
  std::uniform_int_distribution<int64_t> pick(-1, experts - 1);  // -1: dropped
  std::vector<int64_t> expert_of(static_cast<size_t>(tokens * k));
  for (int64_t& e : expert_of) {
    e = pick(rng);
    if (e == 1) e = 0;  // expert 1 gets no rows
  }
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t s = 0; s < tokens * k; ++s)
      if (expert_of[static_cast<size_t>(s)] == e) r.rows.push_back(static_cast<double>(s));
    if (e != 1)
      for (int64_t p = 0; p < pad; ++p) r.rows.push_back(-1);
    r.offsets.push_back(static_cast<double>(r.rows.size()));
  }
  return r;
}

TensorType boundedRows(DType t, int64_t bound, std::vector<int64_t> rest = {}) {
  Shape s = {Dim::bounded(Dim::fixed(bound))};
  for (int64_t d : rest) s.push_back(Dim::fixed(d));
  return TensorType(t, s);
}

// ---- Shape rules ------------------------------------------------------------------------------

struct Graph {
  Module m;
  Function& f = m.addFunction("f");
  Builder b{f.entry()};
  Value* input(const TensorType& t) {
    static int n = 0;
    auto op = b.createWithTypes("kiln.input", {}, {t}, {{"name", A("in" + std::to_string(n++))}});
    EXPECT_TRUE(op) << op.status().str();
    return (*op)->result();
  }
};

TensorType f32t(Shape s) { return TensorType(DType::f32, std::move(s)); }
TensorType i32t(Shape s) { return TensorType(DType::i32, std::move(s)); }
const Dim kN = Dim::symbol("B", 4);

TEST(ExpertShapes, TheRowDimFlowsFromRowsAndX) {
  Graph g;
  const Dim rows_dim = Dim::bounded(Dim::symbol("B", 8));  // ?(k*N) for k = 2
  Value* x = g.input(f32t({kN, Dim::fixed(16)}));
  Value* rows = g.input(i32t({rows_dim}));
  Value* probs = g.input(f32t({kN, Dim::fixed(2)}));
  Value* offsets = g.input(i32t({Dim::fixed(5)}));
  Value* w = g.input(f32t({Dim::fixed(4), Dim::fixed(16), Dim::fixed(32)}));

  auto y = g.b.createValue(OpCode::MoePermute, {x, rows, probs});
  ASSERT_TRUE(y) << y.status().str();
  EXPECT_EQ((*y)->type(), f32t({rows_dim, Dim::fixed(16)}));
  auto h = g.b.createValue(OpCode::GroupedMatmul, {*y, w, offsets});
  ASSERT_TRUE(h) << h.status().str();
  EXPECT_EQ((*h)->type(), f32t({rows_dim, Dim::fixed(32)}));
  // With transpose_b, w [E, M, K] = [4, 16, 32] maps h back to 16 columns (x's gradient).
  auto back = g.b.createValue(OpCode::GroupedMatmul, {*h, w, offsets}, {{"transpose_b", A(true)}});
  ASSERT_TRUE(back) << back.status().str();
  EXPECT_EQ((*back)->type(), f32t({rows_dim, Dim::fixed(16)}));
  auto dw = g.b.createValue(OpCode::GroupedMatmulWgrad, {*y, *h, offsets});
  ASSERT_TRUE(dw) << dw.status().str();
  EXPECT_EQ((*dw)->type(), f32t({Dim::fixed(4), Dim::fixed(16), Dim::fixed(32)}));
  auto dwt = g.b.createValue(OpCode::GroupedMatmulWgrad, {*y, *h, offsets}, {{"transpose", A(true)}});
  ASSERT_TRUE(dwt) << dwt.status().str();
  EXPECT_EQ((*dwt)->type(), f32t({Dim::fixed(4), Dim::fixed(32), Dim::fixed(16)}));
  auto out = g.b.createValue(OpCode::MoeUnpermute, {*y, rows, probs});
  ASSERT_TRUE(out) << out.status().str();
  EXPECT_EQ((*out)->type(), f32t({kN, Dim::fixed(16)}));
  auto dots = g.b.createValue(OpCode::MoeRowDot, {*y, rows, x, probs});
  ASSERT_TRUE(dots) << dots.status().str();
  EXPECT_EQ((*dots)->type(), f32t({kN, Dim::fixed(2)}));
}

// Each bad operand gets an error that names the op and says what is wrong.
void expectError(Graph& g, OpCode code, const std::vector<Value*>& operands, const std::string& what,
                 AttrDict attrs = {}) {
  auto v = g.b.createValue(code, operands, std::move(attrs));
  ASSERT_FALSE(v) << opName(code) << " accepted " << what;
  EXPECT_NE(v.status().message().find(std::string(opName(code))), std::string::npos) << v.status().str();
  EXPECT_NE(v.status().message().find(what), std::string::npos) << v.status().str();
}

TEST(ExpertShapes, BadOperandsAreErrorsNamingTheOp) {
  Graph g;
  const Dim r = Dim::bounded(Dim::symbol("B", 8));
  Value* x = g.input(f32t({kN, Dim::fixed(16)}));
  Value* xb = g.input(TensorType(DType::bf16, {r, Dim::fixed(16)}));
  Value* y = g.input(f32t({r, Dim::fixed(16)}));
  Value* rows = g.input(i32t({r}));
  Value* rows64 = g.input(TensorType(DType::i64, {r}));
  Value* other_rows = g.input(i32t({Dim::fixed(3)}));
  Value* probs = g.input(f32t({kN, Dim::fixed(2)}));
  Value* short_probs = g.input(f32t({Dim::fixed(3), Dim::fixed(2)}));
  Value* offsets = g.input(i32t({Dim::fixed(5)}));
  Value* w = g.input(f32t({Dim::fixed(4), Dim::fixed(16), Dim::fixed(32)}));
  Value* w3 = g.input(f32t({Dim::fixed(3), Dim::fixed(16), Dim::fixed(32)}));
  Value* ids = g.input(i32t({kN, Dim::fixed(16)}));

  expectError(g, OpCode::MoePermute, {x, rows64, probs}, "i32[?R]");
  expectError(g, OpCode::MoePermute, {x, rows, short_probs}, "one row per token");
  expectError(g, OpCode::MoePermute, {ids, rows, probs}, "float");
  expectError(g, OpCode::MoeUnpermute, {y, other_rows, probs}, "the same rows");
  expectError(g, OpCode::MoeRowDot, {y, rows, ids, probs}, "element types");
  expectError(g, OpCode::GroupedMatmul, {y, w3, offsets}, "one matrix per expert");
  expectError(g, OpCode::GroupedMatmul, {y, w, offsets}, "contraction", {{"transpose_b", A(true)}});
  expectError(g, OpCode::GroupedMatmul, {xb, w, offsets}, "element types");
  expectError(g, OpCode::GroupedMatmul, {y, w, rows}, "offsets");
  expectError(g, OpCode::GroupedMatmulWgrad, {y, g.input(f32t({Dim::fixed(3), Dim::fixed(8)})), offsets},
              "the same rows");
}

// ---- CPU references against plain loops ------------------------------------------------------

TEST(ExpertCpu, PermuteGathersEachRowsTokenAndScalesByItsProb) {
  std::mt19937 rng(11);
  const int64_t n = 6, k = 2, h = 3;
  const Routing rt = makeRouting(n, k, 3, 1, rng);
  const int64_t count = static_cast<int64_t>(rt.rows.size());
  const auto xv = randomValues(n * h, rng), pv = randomValues(n * k, rng);
  for (bool apply : {false, true}) {
    std::vector<double> want;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t s = static_cast<int64_t>(rt.rows[static_cast<size_t>(r)]);
      for (int64_t c = 0; c < h; ++c)
        want.push_back(s < 0 ? 0.0
                             : (apply ? pv[static_cast<size_t>(s)] : 1.0) *
                                   xv[static_cast<size_t>(s / k * h + c)]);
    }
    // rows typed ?(N*k + 8): fewer rows at run time than the bound.
    OpCall call{"kiln.moe_permute",
                {f64({n, h}, xv), i32({count}, rt.rows), f64({n, k}, pv)},
                {{"apply_probs", A(apply)}},
                {typeOf(f64({n, h}, xv)), boundedRows(DType::i32, n * k + 8), typeOf(f64({n, k}, pv))}};
    expectTensor(runOk(call), {count, h}, want, 1e-12);
  }
}

TEST(ExpertCpu, UnpermuteSumsEachTokensRowsWeightedByTheirProbs) {
  std::mt19937 rng(12);
  const int64_t n = 7, k = 3, h = 4;
  const Routing rt = makeRouting(n, k, 4, 2, rng);
  const int64_t count = static_cast<int64_t>(rt.rows.size());
  const auto yv = randomValues(count * h, rng), pv = randomValues(n * k, rng);
  for (bool apply : {false, true}) {
    std::vector<double> want(static_cast<size_t>(n * h), 0.0);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t s = static_cast<int64_t>(rt.rows[static_cast<size_t>(r)]);
      if (s < 0) continue;
      for (int64_t c = 0; c < h; ++c)
        want[static_cast<size_t>(s / k * h + c)] +=
            (apply ? pv[static_cast<size_t>(s)] : 1.0) * yv[static_cast<size_t>(r * h + c)];
    }
    OpCall call{"kiln.moe_unpermute",
                {f64({count, h}, yv), i32({count}, rt.rows), f64({n, k}, pv)},
                {{"apply_probs", A(apply)}},
                {boundedRows(DType::f64, n * k + 8, {h}), boundedRows(DType::i32, n * k + 8)}};
    expectTensor(runOk(call), {n, h}, want, 1e-12);
  }
}

TEST(ExpertCpu, UnpermuteGivesZerosToATokenWithEverySlotDropped) {
  // Token 1's slots (2, 3) are in no row.
  OpCall call{
      "kiln.moe_unpermute",
      {f32({3, 2}, {1, 2, 3, 4, 5, 6}), i32({3}, {4, 0, 1}), f32({3, 2}, {0.5, 0.25, 0.1, 0.9, 2, 0})}};
  expectTensor(runOk(call), {3, 2}, {0.5 * 3 + 0.25 * 5, 0.5 * 4 + 0.25 * 6, 0, 0, 2 * 1, 2 * 2});
}

TEST(ExpertCpu, RowDotIsEachSlotsRowDotItsToken) {
  std::mt19937 rng(13);
  const int64_t n = 5, k = 2, h = 3;
  const Routing rt = makeRouting(n, k, 3, 1, rng);
  const int64_t count = static_cast<int64_t>(rt.rows.size());
  const auto av = randomValues(count * h, rng), bv = randomValues(n * h, rng);
  std::vector<double> want(static_cast<size_t>(n * k), 0.0);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t s = static_cast<int64_t>(rt.rows[static_cast<size_t>(r)]);
    if (s < 0) continue;
    for (int64_t c = 0; c < h; ++c)
      want[static_cast<size_t>(s)] +=
          av[static_cast<size_t>(r * h + c)] * bv[static_cast<size_t>(s / k * h + c)];
  }
  OpCall call{"kiln.moe_row_dot",
              {f64({count, h}, av), i32({count}, rt.rows), f64({n, h}, bv),
               f32({n, k}, std::vector<double>(static_cast<size_t>(n * k)))}};
  HostTensor got = runOk(call);
  EXPECT_EQ(got.view.dtype, DType::f32);  // probs_like's type
  expectTensor(got, {n, k}, want, 1e-6);
}

// Expert e's rows times w[e] (w[e]^T with transpose_b), expert 1 empty.
TEST(ExpertCpu, GroupedMatmulMultipliesEachExpertsRowsByItsMatrix) {
  std::mt19937 rng(14);
  const int64_t e_count = 3, k = 4, m = 5;
  const std::vector<double> offsets = {0, 3, 3, 7};
  const int64_t count = 7;
  const auto xv = randomValues(count * k, rng), wv = randomValues(e_count * k * m, rng);
  for (bool tb : {false, true}) {
    // wv holds w[e] as [K, M]; the operand stores it transposed with transpose_b.
    std::vector<double> stored(wv.size());
    for (int64_t e = 0; e < e_count; ++e)
      for (int64_t p = 0; p < k; ++p)
        for (int64_t j = 0; j < m; ++j)
          stored[static_cast<size_t>(tb ? (e * m + j) * k + p : (e * k + p) * m + j)] =
              wv[static_cast<size_t>((e * k + p) * m + j)];
    std::vector<double> want;
    for (int64_t r = 0; r < count; ++r) {
      int64_t e = 0;
      while (r >= offsets[static_cast<size_t>(e) + 1]) ++e;
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p)
          s += xv[static_cast<size_t>(r * k + p)] * wv[static_cast<size_t>((e * k + p) * m + j)];
        want.push_back(s);
      }
    }
    const std::vector<int64_t> wshape =
        tb ? std::vector<int64_t>{e_count, m, k} : std::vector<int64_t>{e_count, k, m};
    OpCall call{"kiln.grouped_matmul",
                {f64({count, k}, xv), f64(wshape, stored), i32({e_count + 1}, offsets)},
                {{"transpose_b", A(tb)}},
                {boundedRows(DType::f64, 12, {k})}};
    expectTensor(runOk(call), {count, m}, want, 1e-12);
    // f32 accumulates in double too: only the final rounding differs.
    OpCall call32{"kiln.grouped_matmul",
                  {f32({count, k}, xv), f32(wshape, stored), i32({e_count + 1}, offsets)},
                  {{"transpose_b", A(tb)}}};
    expectTensor(runOk(call32), {count, m}, want, 1e-6);
  }
}

TEST(ExpertCpu, GroupedMatmulWgradSumsEachExpertsOuterProducts) {
  std::mt19937 rng(15);
  const int64_t e_count = 3, k = 3, m = 2;
  const std::vector<double> offsets = {0, 4, 4, 6};
  const int64_t count = 6;
  const auto xv = randomValues(count * k, rng), dv = randomValues(count * m, rng);
  for (bool t : {false, true}) {
    std::vector<double> want(static_cast<size_t>(e_count * k * m), 0.0);
    for (int64_t e = 0; e < e_count; ++e)
      for (int64_t r = static_cast<int64_t>(offsets[static_cast<size_t>(e)]);
           r < static_cast<int64_t>(offsets[static_cast<size_t>(e) + 1]); ++r)
        for (int64_t p = 0; p < k; ++p)
          for (int64_t j = 0; j < m; ++j)
            want[static_cast<size_t>(t ? (e * m + j) * k + p : (e * k + p) * m + j)] +=
                xv[static_cast<size_t>(r * k + p)] * dv[static_cast<size_t>(r * m + j)];
    OpCall call{"kiln.grouped_matmul_wgrad",
                {f64({count, k}, xv), f64({count, m}, dv), i32({e_count + 1}, offsets)},
                {{"transpose", A(t)}},
                {boundedRows(DType::f64, 9, {k}), boundedRows(DType::f64, 9, {m})}};
    HostTensor got = runOk(call);
    expectTensor(got, t ? std::vector<int64_t>{e_count, m, k} : std::vector<int64_t>{e_count, k, m}, want,
                 1e-12);
    // The empty expert's matrix is all zeros (not left over from the buffer).
    for (int64_t i = 0; i < k * m; ++i) EXPECT_EQ(values(got)[static_cast<size_t>(k * m + i)], 0.0);
  }
}

// ---- Run-time checks ---------------------------------------------------------------------------

void expectRunError(const OpCall& call, const std::string& what) {
  auto r = run(call);
  ASSERT_FALSE(r) << call.name << " accepted " << what;
  EXPECT_NE(r.status().message().find(call.name), std::string::npos) << r.status().str();
  EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().str();
}

TEST(ExpertCpu, BadOffsetsAreErrors) {
  auto x = f32({4, 2}, std::vector<double>(8, 1.0));
  auto w = f32({2, 2, 3}, std::vector<double>(12, 1.0));
  auto gmm = [&](std::vector<double> offsets) {
    return OpCall{"kiln.grouped_matmul", {x, w, i32({3}, offsets)}};
  };
  expectRunError(gmm({0, 3, 2}), "decrease at expert 1");
  expectRunError(gmm({0, 1, 3}), "offsets[2] = 3 but there are 4 rows");
  expectRunError(gmm({0, 5, 4}), "beyond the 4 rows");
  expectRunError(gmm({1, 2, 4}), "offsets[0] = 1");
  expectRunError(gmm({0, -1, 4}), "decrease at expert 0");
  OpCall wgrad{"kiln.grouped_matmul_wgrad",
               {x, f32({4, 3}, std::vector<double>(12, 1.0)), i32({3}, {0, 2, 5})}};
  expectRunError(wgrad, "beyond the 4 rows");
}

TEST(ExpertCpu, BadRowsAreErrors) {
  auto x = f32({2, 2}, {1, 2, 3, 4});
  auto probs = f32({2, 2}, {0.5, 0.5, 0.5, 0.5});
  expectRunError({"kiln.moe_permute", {x, i32({3}, {0, 4, 1}), probs}},
                 "rows[1] = 4 lies outside the 4 slots");
  expectRunError({"kiln.moe_permute", {x, i32({3}, {2, -1, 2}), probs}}, "slot 2 is held by rows 0 and 2");
  expectRunError({"kiln.moe_unpermute", {x, i32({2}, {3, 7}), probs}}, "rows[1] = 7");
  expectRunError({"kiln.moe_row_dot", {x, i32({2}, {1, 1}), x, probs}}, "slot 1 is held");
}

// ---- Cost -------------------------------------------------------------------------------------

TEST(ExpertCost, GroupedMatmulIsTwoRKMFlopsAtTheRowBound) {
  Graph g;
  const Dim r = Dim::bounded(Dim::symbol("B", 8));
  Value* x = g.input(f32t({r, Dim::fixed(16)}));
  Value* w = g.input(f32t({Dim::fixed(4), Dim::fixed(32), Dim::fixed(16)}));
  Value* offsets = g.input(i32t({Dim::fixed(5)}));
  Op* op = *g.b.create(OpCode::GroupedMatmul, {x, w, offsets}, {{"transpose_b", A(true)}});
  const SymbolBindings syms = {{"B", 100}};
  OpCost c = op->def()->cost(*op, syms);
  EXPECT_DOUBLE_EQ(c.flops, 2.0 * 800 * 16 * 32);
  EXPECT_DOUBLE_EQ(c.bytes, 4.0 * (800 * 16 + 4 * 32 * 16 + 800 * 32) + 4.0 * 5);
  Value* dy = op->result();
  Op* wgrad = *g.b.create(OpCode::GroupedMatmulWgrad, {x, dy, offsets});
  EXPECT_DOUBLE_EQ(wgrad->def()->cost(*wgrad, syms).flops, 2.0 * 800 * 16 * 32);
}

}  // namespace
}  // namespace kiln::ir::testing
