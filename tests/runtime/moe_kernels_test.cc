// The fast MoE kernels (runtime/cpu/kernels/moe.cc) against the op table's reference hooks
// (themselves checked against plain loops in tests/ops/experts_test.cc): random routings with
// dropped slots, padding rows and empty experts, f32 / bf16 / f64, from 1 to 8 threads, and the
// same run-time errors for bad rows and offsets.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ir/builder.h"
#include "runtime/cpu/kernels/kernels.h"
#include "runtime_test_util.h"

namespace kiln::runtime::cpu {
namespace {

using ir::Dim;
using ir::DType;
using ir::HostTensor;
using ir::OpCode;
using ir::TensorType;
using testing::expectClose;
using testing::randomTensor;

// A routing drawn at random: each slot goes to a random expert or is dropped; experts in
// `empty` get nothing; each expert with rows ends in `pad` padding rows (-1).
struct Routing {
  HostTensor rows, offsets;
  int64_t count = 0;
};
Routing randomRouting(int64_t tokens, int64_t k, int64_t experts, int64_t pad, std::vector<int64_t> empty,
                      std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> pick(-1, experts - 1);
  std::vector<int64_t> expert_of(static_cast<size_t>(tokens * k));
  for (int64_t& e : expert_of) {
    e = pick(rng);
    if (std::find(empty.begin(), empty.end(), e) != empty.end()) e = -1;
  }
  std::vector<int32_t> rows, offsets = {0};
  for (int64_t e = 0; e < experts; ++e) {
    const size_t before = rows.size();
    for (int64_t s = 0; s < tokens * k; ++s)
      if (expert_of[static_cast<size_t>(s)] == e) rows.push_back(static_cast<int32_t>(s));
    if (rows.size() > before) rows.insert(rows.end(), static_cast<size_t>(pad), -1);
    offsets.push_back(static_cast<int32_t>(rows.size()));
  }
  Routing r{HostTensor(DType::i32, {static_cast<int64_t>(rows.size())}),
            HostTensor(DType::i32, {experts + 1}), static_cast<int64_t>(rows.size())};
  std::copy(rows.begin(), rows.end(), r.rows.as<int32_t>());
  std::copy(offsets.begin(), offsets.end(), r.offsets.as<int32_t>());
  return r;
}

TensorType staticType(const HostTensor& t) {
  ir::Shape s;
  for (int64_t d : t.view.shape) s.push_back(Dim::fixed(d));
  return TensorType(t.view.dtype, s);
}
// The tensor's type with dim 0 bounded by `bound` (it holds fewer rows at run time).
TensorType boundedType(const HostTensor& t, int64_t bound) {
  TensorType s = staticType(t);
  ir::Shape shape = s.shape();
  shape[0] = Dim::bounded(Dim::fixed(bound));
  return TensorType(t.view.dtype, shape);
}

struct OneOp {
  std::unique_ptr<ir::Module> module = std::make_unique<ir::Module>();
  ir::Op* op = nullptr;
};
OneOp buildOp(OpCode code, const std::vector<TensorType>& types, ir::AttrDict attrs) {
  OneOp o;
  ir::Function& f = o.module->addFunction("f");
  ir::Builder b(f.entry());
  std::vector<ir::Value*> operands;
  for (size_t i = 0; i < types.size(); ++i) {
    auto in =
        b.createWithTypes(OpCode::Input, {}, {types[i]}, {{"name", ir::Attribute("x" + std::to_string(i))}});
    EXPECT_TRUE(in.isOk()) << in.status().str();
    operands.push_back((*in)->result());
  }
  auto op = b.create(code, operands, std::move(attrs));
  EXPECT_TRUE(op.isOk()) << op.status().str();
  o.op = op.isOk() ? *op : nullptr;
  return o;
}

// A result buffer at its bound size, filled with NaN so that an element a kernel forgets to write
// shows up in the comparison.
HostTensor boundResult(const ir::Value& v) {
  std::vector<int64_t> shape;
  for (const Dim& d : v.type().shape()) shape.push_back(*d.evaluate({}));
  HostTensor t(v.type().dtype(), shape);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.view.dtype == DType::bf16)
      t.as<uint16_t>()[i] = 0x7fc0;
    else if (t.view.dtype == DType::f64)
      t.as<double>()[i] = NAN;
    else
      t.as<float>()[i] = NAN;
  }
  return t;
}

// Runs the fast kernel on 1, 2, 3 and 8 threads and the reference hook, and compares.
void checkAgainstReference(OpCode code, const std::vector<HostTensor>& inputs,
                           const std::vector<TensorType>& types, ir::AttrDict attrs, double rtol, double atol,
                           const std::string& what) {
  OneOp o = buildOp(code, types, std::move(attrs));
  ASSERT_NE(o.op, nullptr) << what;
  const FastKernel* fast = findFastKernel(*o.op);
  ASSERT_NE(fast, nullptr) << "no fast kernel for " << what;
  std::vector<const ir::TensorView*> in;
  for (const HostTensor& t : inputs) in.push_back(&t.view);
  HostTensor want = boundResult(*o.op->result());
  ir::CpuContext cctx;
  Status rs = o.op->def()->cpu(*o.op, in, {&want.view}, cctx);
  ASSERT_TRUE(rs.isOk()) << rs.str();
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    HostTensor got = boundResult(*o.op->result());
    Status fs = fast->run(*o.op, in, {&got.view}, KernelContext{&pool, nullptr});
    ASSERT_TRUE(fs.isOk()) << fs.str();
    expectClose(got, want, rtol, atol, what + " threads=" + std::to_string(threads));
  }
}

double rtolOf(DType t) { return t == DType::bf16 ? 1.0 / 64 : t == DType::f32 ? 1e-5 : 1e-12; }
double atolOf(DType t) { return t == DType::bf16 ? 2e-2 : t == DType::f32 ? 1e-4 : 1e-12; }

struct Sizes {
  int64_t tokens, k, experts, pad;
  std::vector<int64_t> empty;
};
const std::vector<Sizes> kSizes = {
    {1, 1, 1, 0, {}},              // one token, one expert
    {13, 2, 4, 0, {2}},            // dropless-like, an empty expert
    {37, 3, 16, 2, {0, 5, 15}},    // more experts than threads: the pool spreads them
    {64, 2, 8, 1, {}},             // every expert busy
    {9, 2, 5, 0, {0, 1, 2, 3, 4}}  // no rows at all
};

TEST(MoeKernels, GroupedMatmulMatchesReference) {
  std::mt19937 rng(21);
  uint32_t seed = 1;
  for (const Sizes& sz : kSizes)
    for (DType t : {DType::f32, DType::bf16, DType::f64})
      for (bool tb : {false, true}) {
        const Routing rt = randomRouting(sz.tokens, sz.k, sz.experts, sz.pad, sz.empty, rng);
        std::uniform_int_distribution<int64_t> dim(1, 40);
        const int64_t k = dim(rng), m = dim(rng);
        HostTensor x = randomTensor(t, {rt.count, k}, seed++);
        HostTensor w = randomTensor(
            t, tb ? std::vector<int64_t>{sz.experts, m, k} : std::vector<int64_t>{sz.experts, k, m}, seed++);
        checkAgainstReference(OpCode::GroupedMatmul, {x, w, rt.offsets},
                              {boundedType(x, rt.count + 5), staticType(w), staticType(rt.offsets)},
                              {{"transpose_b", ir::Attribute(tb)}}, rtolOf(t), atolOf(t),
                              fmt::format("grouped_matmul {} E={} R={} K={} M={} tb={}", ir::dtypeName(t),
                                          sz.experts, rt.count, k, m, tb));
      }
}

TEST(MoeKernels, GroupedMatmulWgradMatchesReference) {
  std::mt19937 rng(22);
  uint32_t seed = 100;
  for (const Sizes& sz : kSizes)
    for (DType t : {DType::f32, DType::bf16, DType::f64})
      for (bool tr : {false, true}) {
        const Routing rt = randomRouting(sz.tokens, sz.k, sz.experts, sz.pad, sz.empty, rng);
        std::uniform_int_distribution<int64_t> dim(1, 40);
        const int64_t k = dim(rng), m = dim(rng);
        HostTensor x = randomTensor(t, {rt.count, k}, seed++);
        HostTensor dy = randomTensor(t, {rt.count, m}, seed++);
        // Sums over up to ~100 rows: bf16's rounding of the result dominates.
        checkAgainstReference(
            OpCode::GroupedMatmulWgrad, {x, dy, rt.offsets},
            {boundedType(x, rt.count + 3), boundedType(dy, rt.count + 3), staticType(rt.offsets)},
            {{"transpose", ir::Attribute(tr)}}, rtolOf(t), 4 * atolOf(t),
            fmt::format("grouped_matmul_wgrad {} E={} R={} K={} M={} transpose={}", ir::dtypeName(t),
                        sz.experts, rt.count, k, m, tr));
      }
}

TEST(MoeKernels, PermutesAndRowDotMatchReference) {
  std::mt19937 rng(23);
  uint32_t seed = 200;
  for (const Sizes& sz : kSizes)
    for (DType t : {DType::f32, DType::bf16}) {
      const Routing rt = randomRouting(sz.tokens, sz.k, sz.experts, sz.pad, sz.empty, rng);
      const int64_t h = std::uniform_int_distribution<int64_t>(1, 70)(rng);
      const int64_t bound = sz.tokens * sz.k + sz.experts * sz.pad;
      HostTensor x = randomTensor(t, {sz.tokens, h}, seed++);
      HostTensor y = randomTensor(t, {rt.count, h}, seed++);
      HostTensor probs = randomTensor(DType::f32, {sz.tokens, sz.k}, seed++, 0, 1);
      const TensorType rows_type = boundedType(rt.rows, bound);
      const std::string where = fmt::format("{} N={} k={} E={} R={} H={}", ir::dtypeName(t), sz.tokens, sz.k,
                                            sz.experts, rt.count, h);
      for (bool apply : {false, true}) {
        const ir::AttrDict attrs = {{"apply_probs", ir::Attribute(apply)}};
        checkAgainstReference(OpCode::MoePermute, {x, rt.rows, probs},
                              {staticType(x), rows_type, staticType(probs)}, attrs, rtolOf(t), atolOf(t),
                              "moe_permute " + where);
        checkAgainstReference(OpCode::MoeUnpermute, {y, rt.rows, probs},
                              {boundedType(y, bound), rows_type, staticType(probs)}, attrs, rtolOf(t),
                              atolOf(t), "moe_unpermute " + where);
      }
      checkAgainstReference(OpCode::MoeRowDot, {y, rt.rows, x, probs},
                            {boundedType(y, bound), rows_type, staticType(x), staticType(probs)}, {},
                            rtolOf(DType::f32), atolOf(DType::f32), "moe_row_dot " + where);
    }
}

// The fast kernels refuse what the references refuse, with the same message.
void expectSameError(OpCode code, const std::vector<HostTensor>& inputs, const std::string& what) {
  std::vector<TensorType> types;
  for (const HostTensor& t : inputs) types.push_back(staticType(t));
  OneOp o = buildOp(code, types, {});
  ASSERT_NE(o.op, nullptr);
  std::vector<const ir::TensorView*> in;
  for (const HostTensor& t : inputs) in.push_back(&t.view);
  HostTensor fast_out = boundResult(*o.op->result()), ref_out = boundResult(*o.op->result());
  ThreadPool pool(4);
  Status fs = findFastKernel(*o.op)->run(*o.op, in, {&fast_out.view}, KernelContext{&pool, nullptr});
  Status rs = o.op->def()->cpu(*o.op, in, {&ref_out.view}, ir::CpuContext{});
  ASSERT_FALSE(fs.isOk()) << ir::opName(code) << " accepted " << what;
  ASSERT_FALSE(rs.isOk());
  EXPECT_NE(fs.message().find(what), std::string::npos) << fs.str();
  EXPECT_EQ(fs.message(), rs.message());
}

HostTensor i32s(std::vector<int32_t> v) {
  HostTensor t(DType::i32, {static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t.as<int32_t>());
  return t;
}

TEST(MoeKernels, BadRowsAndOffsetsAreErrors) {
  HostTensor x = randomTensor(DType::f32, {4, 3}, 1), w = randomTensor(DType::f32, {2, 3, 5}, 2);
  HostTensor dy = randomTensor(DType::f32, {4, 5}, 3), probs = randomTensor(DType::f32, {2, 2}, 4);
  expectSameError(OpCode::GroupedMatmul, {x, w, i32s({0, 3, 2})}, "offsets decrease at expert 1");
  expectSameError(OpCode::GroupedMatmul, {x, w, i32s({0, 1, 3})}, "offsets[2] = 3 but there are 4 rows");
  expectSameError(OpCode::GroupedMatmul, {x, w, i32s({2, 3, 4})}, "offsets[0] = 2");
  expectSameError(OpCode::GroupedMatmulWgrad, {x, dy, i32s({0, 6, 4})},
                  "offsets[1] = 6 lies beyond the 4 rows");
  HostTensor tokens = randomTensor(DType::f32, {2, 3}, 5);
  expectSameError(OpCode::MoePermute, {tokens, i32s({0, 4, 1, 2}), probs},
                  "rows[1] = 4 lies outside the 4 slots");
  expectSameError(OpCode::MoeUnpermute, {x, i32s({3, -1, 0, 3}), probs}, "slot 3 is held by rows 0 and 3");
  expectSameError(OpCode::MoeRowDot, {x, i32s({1, 2, 1, 0}), tokens, probs},
                  "slot 1 is held by rows 0 and 2");
}

}  // namespace
}  // namespace kiln::runtime::cpu
