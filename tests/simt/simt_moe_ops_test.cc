// The MoE ops lowered by codegen/emit/moe.cc (attributes, shapes, bounded dims, buffer binding),
// built with their OpDefs' verification (ir/ops/routing.cc, experts.cc), their kernels run on the
// host (simt) against the plain loops of moe_checks.h, and the ops' CPU references checked
// against the same loops.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "ir/builder.h"
#include "ir/op_def.h"
#include "tests/simt/host_module.h"
#include "tests/simt/moe_checks.h"

namespace kiln::testing::moe {
namespace {

using ir::Attribute;
using ir::Dim;
using ir::TensorType;
using ir::Value;

ir::Shape S(std::initializer_list<int64_t> dims) {
  ir::Shape s;
  for (int64_t d : dims) s.push_back(Dim::fixed(d));
  return s;
}

// One op over given inputs: lowered, run on simt, and (when it has one) run by its CPU
// reference. Results come back as host tensors.
class OpRun {
 public:
  OpRun() {
    f_ = &module_.addFunction("f");
    f_->body().addBlock();
    b_.setInsertionPointToEnd(f_->entry());
  }
  // An input holding `data`. For a bounded leading dim, `runtime_rows` is how many rows the batch
  // has: the kernels get the whole bound (the rest is slack they must not need), the CPU
  // reference a tensor of just those rows.
  template <typename T>
  Value* input(const std::string& name, DType t, ir::Shape shape, const std::vector<T>& data,
               int64_t runtime_rows = -1) {
    auto op =
        b_.createWithTypes("kiln.input", {}, {TensorType(t, std::move(shape))}, {{"name", Attribute(name)}});
    EXPECT_TRUE(op) << op.status().message();
    Value* v = (*op)->result();
    auto concrete = codegen::concreteShape(v->type(), symbols_);
    EXPECT_TRUE(concrete);
    ir::HostTensor h(t, *concrete);
    EXPECT_EQ(h.storage.size(), data.size() * sizeof(T)) << name;
    std::memcpy(h.storage.data(), data.data(), std::min(h.storage.size(), data.size() * sizeof(T)));
    inputs_[v] = h;
    if (runtime_rows >= 0) runtime_rows_[v] = runtime_rows;
    return v;
  }
  ir::Op* op(const std::string& name, const std::vector<Value*>& operands,
             const std::vector<TensorType>& types, ir::AttrDict attrs) {
    auto r = b_.createWithTypes(name, operands, types, std::move(attrs));
    EXPECT_TRUE(r) << r.status().message();
    op_ = r ? *r : nullptr;
    return op_;
  }
  void bind(const std::string& sym, int64_t v) { symbols_[sym] = v; }
  // The lowering's error for the op ("" when it lowers).
  std::string loweringError() {
    auto g = codegen::lowerGroup({op_}, symbols_);
    return g ? "" : g.status().message();
  }

  // Lowers and runs the op on simt; the values it wrote, by value.
  std::map<const Value*, ir::HostTensor> simt() {
    std::map<const Value*, ir::HostTensor> out;
    auto g = codegen::lowerGroup({op_}, symbols_);
    EXPECT_TRUE(g) << g.status().message();
    if (!g) return out;
    std::vector<const codegen::Kernel*> ks;
    for (const codegen::Kernel& k : g->kernels) ks.push_back(&k);
    auto m = simt::HostModule::compile(codegen::emitModule(ks));
    EXPECT_TRUE(m) << m.status().message();
    if (!m) return out;
    std::vector<simt::GuardedBuffer> bufs;
    for (const codegen::GroupBuffer& b : g->buffers) {
      const size_t bytes = static_cast<size_t>(b.elements * ir::dtypeBytes(b.dtype));
      auto buf = simt::GuardedBuffer::allocate(std::max<size_t>(bytes, 1),
                                               static_cast<size_t>(ir::dtypeBytes(b.dtype)));
      EXPECT_TRUE(buf);
      if (b.value && inputs_.count(b.value))
        std::memcpy(buf->data(), inputs_.at(b.value).storage.data(), bytes);
      else
        std::memset(buf->data(), 0xff, bytes);  // poison: NaN, -1
      bufs.push_back(buf.take());
    }
    for (size_t k = 0; k < g->kernels.size(); ++k) {
      std::string name;
      codegen::emitKernel(g->kernels[k], &name);
      std::vector<void*> args;
      for (int b : g->args[k]) args.push_back(bufs[static_cast<size_t>(b)].data());
      Status s = (*m)->launch(name, codegen::launchConfig(g->kernels[k]), args);
      EXPECT_TRUE(s.isOk()) << s.message();
    }
    for (size_t i = 0; i < g->buffers.size(); ++i) {
      const codegen::GroupBuffer& b = g->buffers[i];
      if (!b.value || !b.written) continue;
      auto shape = codegen::concreteShape(b.value->type(), symbols_);
      ir::HostTensor h(b.dtype, *shape);
      std::memcpy(h.storage.data(), bufs[i].data(), h.storage.size());
      out[b.value] = h;
    }
    return out;
  }

  // The op's CPU reference on the same inputs (null without one): written operands and results.
  std::unique_ptr<std::map<const Value*, ir::HostTensor>> cpu() {
    if (!op_ || !op_->def()->cpu) return nullptr;
    auto out = std::make_unique<std::map<const Value*, ir::HostTensor>>();
    std::map<const Value*, ir::HostTensor> state = inputs_;
    for (const auto& [v, rows] : runtime_rows_) state.at(v).view.shape[0] = rows;
    std::vector<const ir::TensorView*> in;
    for (Value* v : op_->operands()) in.push_back(&state.at(v).view);
    std::vector<ir::TensorView*> res;
    for (Value* r : op_->results()) {
      (*out)[r] = ir::HostTensor(r->type().dtype(), *codegen::concreteShape(r->type(), symbols_));
      res.push_back(&(*out)[r].view);
    }
    ir::CpuContext ctx;
    ctx.symbols = &symbols_;
    Status s = op_->def()->cpu(*op_, in, res, ctx);
    EXPECT_TRUE(s.isOk()) << s.message();
    for (Value* v : op_->operands())
      if (op_->def()->has(ir::kSideEffect)) (*out)[v] = state.at(v);
    return out;
  }

  // simt's values against `want` (per written value) and the CPU reference, within tol. A
  // bounded result of the reference holds only its run-time rows: those are compared.
  void expect(const std::map<const Value*, std::vector<double>>& want, double tol) {
    auto got = simt();
    for (const auto& [v, w] : want) {
      ASSERT_TRUE(got.count(v)) << "the kernels did not write " << v->type().str();
      expectValues(got.at(v).view, w, tol, "simt vs the loops");
    }
    if (auto ref = cpu()) {
      for (const auto& [v, w] : want) {
        ASSERT_TRUE(ref->count(v));
        const ir::TensorView& t = ref->at(v).view;
        const bool bounded = !v->type().shape().empty() && v->type().shape()[0].isBounded();
        const size_t n = bounded ? std::min(w.size(), static_cast<size_t>(t.numel())) : w.size();
        expectValues(t, std::vector<double>(w.begin(), w.begin() + static_cast<int64_t>(n)), tol,
                     "the CPU reference vs the loops");
      }
    }
  }

 private:
  static double at(const ir::TensorView& t, int64_t i) {
    switch (t.dtype) {
      case DType::f32:
        return t.as<float>()[i];
      case DType::bf16:
        return ir::bf16ToFloat(t.as<uint16_t>()[i]);
      case DType::i32:
        return t.as<int32_t>()[i];
      default:
        return NAN;
    }
  }
  static void expectValues(const ir::TensorView& t, const std::vector<double>& w, double tol,
                           const char* what) {
    ASSERT_EQ(t.numel(), static_cast<int64_t>(w.size())) << what;
    int bad = 0;
    for (int64_t i = 0; i < t.numel() && bad < 5; ++i)
      if (!(std::abs(at(t, i) - w[static_cast<size_t>(i)]) <=
            tol * (1 + std::abs(w[static_cast<size_t>(i)])))) {
        ADD_FAILURE() << what << " [" << i << "]: " << at(t, i) << " vs " << w[static_cast<size_t>(i)];
        ++bad;
      }
  }

  ir::Module module_;
  ir::Function* f_ = nullptr;
  ir::Builder b_;
  ir::SymbolBindings symbols_;
  std::map<const Value*, ir::HostTensor> inputs_;
  std::map<const Value*, int64_t> runtime_rows_;
  ir::Op* op_ = nullptr;
};

template <typename T>
std::vector<double> asDoubles(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

TEST(SimtMoeOps, RouterAndItsGradientReadTheirAttributes) {
  emit::RouterShape r;
  r.tokens = 20, r.experts = 64, r.topk = 6, r.sigmoid = true, r.bias = true, r.groups = 8, r.group_topk = 3;
  r.scale = 2.5;
  const int64_t N = r.tokens, E = r.experts, K = r.topk;
  std::vector<float> logits = normal(static_cast<size_t>(N * E), 81, 2.0f),
                     bias = normal(static_cast<size_t>(E), 82, 0.05f);
  std::vector<int> want_e;
  std::vector<double> want_p;
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> row(logits.begin() + n * E, logits.begin() + (n + 1) * E);
    std::vector<int> e;
    std::vector<double> p;
    routeToken(r, row.data(), bias.data(), e, p);
    want_e.insert(want_e.end(), e.begin(), e.end());
    want_p.insert(want_p.end(), p.begin(), p.end());
  }
  OpRun run;
  Value* l = run.input("logits", DType::f32, S({N, E}), logits);
  Value* b = run.input("bias", DType::f32, S({E}), bias);
  ir::Op* op = run.op("kiln.moe_router", {l, b},
                      {TensorType(DType::f32, S({N, K})), TensorType(DType::i32, S({N, K}))},
                      {{"topk", Attribute(K)},
                       {"score", Attribute(std::string("sigmoid"))},
                       {"groups", Attribute(int64_t{8})},
                       {"group_topk", Attribute(int64_t{3})},
                       {"scale", Attribute(2.5)}});
  run.expect({{op->result(0), want_p}, {op->result(1), asDoubles(want_e)}}, 1e-5);

  // The gradient for that selection against finite differences of the probs.
  std::vector<float> dprobs = normal(static_cast<size_t>(N * K), 83);
  std::vector<double> want_g(static_cast<size_t>(N * E));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) {
      auto objective = [&](double delta) {
        std::vector<double> row(logits.begin() + n * E, logits.begin() + (n + 1) * E);
        row[static_cast<size_t>(e)] += delta;
        std::vector<int> chosen(want_e.begin() + n * K, want_e.begin() + (n + 1) * K);
        std::vector<double> p = probsOfSelection(r, row, chosen);
        double sum = 0;
        for (int64_t j = 0; j < K; ++j)
          sum += dprobs[static_cast<size_t>(n * K + j)] * p[static_cast<size_t>(j)];
        return sum;
      };
      want_g[static_cast<size_t>(n * E + e)] = (objective(1e-5) - objective(-1e-5)) / 2e-5;
    }
  OpRun grad;
  Value* gl = grad.input("logits", DType::f32, S({N, E}), logits);
  Value* ge = grad.input("experts", DType::i32, S({N, K}), want_e);
  Value* gd = grad.input("dprobs", DType::f32, S({N, K}), dprobs);
  ir::Op* gop = grad.op("kiln.moe_router_grad", {gl, ge, gd}, {TensorType(DType::f32, S({N, E}))},
                        {{"topk", Attribute(K)},
                         {"score", Attribute(std::string("sigmoid"))},
                         {"groups", Attribute(int64_t{8})},
                         {"group_topk", Attribute(int64_t{3})},
                         {"scale", Attribute(2.5)}});
  grad.expect({{gop->result(), want_g}}, 2e-4);
}

TEST(SimtMoeOps, TopkTakeAndScatterAlongAnAxis) {
  const int64_t A = 3, n = 10, C = 4, k = 3;
  std::vector<float> x = normal(static_cast<size_t>(A * n * C), 91);
  std::vector<double> values;
  std::vector<int> indices(static_cast<size_t>(A * k * C));
  values.resize(indices.size());
  for (int64_t a = 0; a < A; ++a)
    for (int64_t c = 0; c < C; ++c) {
      std::vector<double> row;
      for (int64_t i = 0; i < n; ++i) row.push_back(x[static_cast<size_t>((a * n + i) * C + c)]);
      std::vector<int> top = topIndices(row, k);
      for (int64_t j = 0; j < k; ++j) {
        indices[static_cast<size_t>((a * k + j) * C + c)] = top[static_cast<size_t>(j)];
        values[static_cast<size_t>((a * k + j) * C + c)] =
            row[static_cast<size_t>(top[static_cast<size_t>(j)])];
      }
    }
  {
    OpRun run;
    Value* xv = run.input("x", DType::f32, S({A, n, C}), x);
    ir::Op* op = run.op("kiln.topk", {xv},
                        {TensorType(DType::f32, S({A, k, C})), TensorType(DType::i32, S({A, k, C}))},
                        {{"k", Attribute(k)}, {"axis", Attribute(int64_t{1})}});
    run.expect({{op->result(0), values}, {op->result(1), asDoubles(indices)}}, 0);
  }
  {
    OpRun run;
    Value* xv = run.input("x", DType::f32, S({A, n, C}), x);
    Value* iv = run.input("idx", DType::i32, S({A, k, C}), indices);
    ir::Op* op = run.op("kiln.take_along_axis", {xv, iv}, {TensorType(DType::f32, S({A, k, C}))},
                        {{"axis", Attribute(int64_t{1})}});
    run.expect({{op->result(), values}}, 0);
  }
  {
    // Repeated indices add.
    std::vector<int> idx = indices;
    idx[0] = idx[static_cast<size_t>(C)];
    std::vector<float> g = normal(indices.size(), 92);
    std::vector<double> want(static_cast<size_t>(A * n * C));
    for (int64_t a = 0; a < A; ++a)
      for (int64_t j = 0; j < k; ++j)
        for (int64_t c = 0; c < C; ++c) {
          const size_t at = static_cast<size_t>((a * k + j) * C + c);
          want[static_cast<size_t>((a * n + idx[at]) * C + c)] += g[at];
        }
    OpRun run;
    Value* gv = run.input("g", DType::f32, S({A, k, C}), g);
    Value* iv = run.input("idx", DType::i32, S({A, k, C}), idx);
    ir::Op* op = run.op("kiln.scatter_along_axis", {gv, iv}, {TensorType(DType::f32, S({A, n, C}))},
                        {{"axis", Attribute(int64_t{1})}, {"size", Attribute(n)}});
    run.expect({{op->result(), want}}, 1e-6);
  }
}

TEST(SimtMoeOps, BalancingLossesPerSequence) {
  emit::AuxLossShape a;
  a.tokens = 24, a.experts = 12, a.topk = 2, a.seq_len = 6, a.coeff = 0.01;
  const int64_t N = a.tokens, E = a.experts, K = a.topk;
  std::vector<float> logits = normal(static_cast<size_t>(N * E), 101);
  std::vector<int> experts;
  std::vector<float> probs;
  routing(N, K, E, 102, experts, probs);
  std::vector<double> l(logits.begin(), logits.end());
  ir::AttrDict attrs{{"coeff", Attribute(0.01)},
                     {"topk", Attribute(K)},
                     {"seq_len", Attribute(int64_t{6})},
                     {"score", Attribute(std::string("softmax"))}};
  {
    OpRun run;
    Value* lv = run.input("logits", DType::f32, S({N, E}), logits);
    Value* ev = run.input("experts", DType::i32, S({N, K}), experts);
    ir::Op* op = run.op("kiln.moe_aux_loss", {lv, ev}, {TensorType(DType::f32, {})}, attrs);
    run.expect({{op->result(), {auxLoss(a, l, experts)}}}, 1e-5);
  }
  {
    const float g = 2.0f;
    std::vector<double> want(l.size());
    for (size_t i = 0; i < l.size(); ++i) {
      std::vector<double> up = l, down = l;
      up[i] += 1e-4;
      down[i] -= 1e-4;
      want[i] = g * (auxLoss(a, up, experts) - auxLoss(a, down, experts)) / 2e-4;
    }
    OpRun run;
    Value* lv = run.input("logits", DType::f32, S({N, E}), logits);
    Value* ev = run.input("experts", DType::i32, S({N, K}), experts);
    Value* gv = run.input("g", DType::f32, {}, std::vector<float>{g});
    ir::Op* op = run.op("kiln.moe_aux_loss_grad", {lv, ev, gv}, {TensorType(DType::f32, S({N, E}))}, attrs);
    run.expect({{op->result(), want}}, 1e-3);
  }
  {
    double want = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double m = *std::max_element(l.begin() + n * E, l.begin() + (n + 1) * E);
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(l[static_cast<size_t>(n * E + e)] - m);
      want += (m + std::log(z)) * (m + std::log(z));
    }
    OpRun run;
    Value* lv = run.input("logits", DType::f32, S({N, E}), logits);
    ir::Op* op = run.op("kiln.moe_z_loss", {lv}, {TensorType(DType::f32, {})}, {{"coeff", Attribute(0.001)}});
    run.expect({{op->result(), {0.001 * want / static_cast<double>(N)}}}, 1e-5);
  }
}

// Dispatch with padding into a bounded rows type, then the permutation ops and a grouped GEMM
// over those rows, each lowered from its op.
TEST(SimtMoeOps, DispatchPermuteAndGroupedGemmOverBoundedRows) {
  const int64_t B = 16, T = 2, N = B * T, K = 2, E = 6, H = 20, M = 12;
  const double cf = 1.0;
  std::vector<int> experts;
  std::vector<float> probs;
  routing(N, K, E, 111, experts, probs);
  emit::DispatchShape d{N, E, K, emit::expertCapacity(N, K, E, cf), false, true, 0};
  // N = T*B tokens: the padded rows bound is ?((f + E)*N) with f = ceil(k*max(cf,1)) = 2, which
  // leaves slack past R = E*C.
  const int64_t bound = (2 + E) * N;
  d.rows = bound;
  Dispatched want = dispatchReference(d, experts, probs);
  ASSERT_LT(want.offsets.back(), bound);
  ir::Shape rows_shape{Dim::bounded(Dim::symbol("B", (2 + E) * T))};
  ir::Shape tokens_k{Dim::symbol("B", T), Dim::fixed(K)};
  {
    OpRun run;
    run.bind("B", B);
    Value* ev = run.input("experts", DType::i32, tokens_k, experts);
    Value* pv = run.input("probs", DType::f32, tokens_k, probs);
    ir::Op* op = run.op("kiln.moe_dispatch", {ev, pv},
                        {TensorType(DType::i32, rows_shape), TensorType(DType::i32, S({E + 1})),
                         TensorType(DType::i32, S({E}))},
                        {{"experts", Attribute(E)},
                         {"capacity_factor", Attribute(cf)},
                         {"drop_policy", Attribute(std::string("position"))},
                         {"pad_to_capacity", Attribute(true)}});
    run.expect({{op->result(0), asDoubles(want.rows)},
                {op->result(1), asDoubles(want.offsets)},
                {op->result(2), asDoubles(want.counts)}},
               0);
  }
  std::vector<float> x = normal(static_cast<size_t>(N * H), 112);
  const std::vector<int>& rows = want.rows;
  {
    std::vector<double> y(static_cast<size_t>(bound * H));
    for (int64_t r = 0; r < bound; ++r)
      for (int64_t h = 0; h < H; ++h)
        if (rows[static_cast<size_t>(r)] >= 0)
          y[static_cast<size_t>(r * H + h)] =
              x[static_cast<size_t>(rows[static_cast<size_t>(r)] / K * H + h)] *
              probs[static_cast<size_t>(rows[static_cast<size_t>(r)])];
    OpRun run;
    run.bind("B", B);
    Value* xv = run.input("x", DType::f32, S({N, H}), x);
    Value* rv = run.input("rows", DType::i32, rows_shape, rows);
    Value* pv = run.input("probs", DType::f32, S({N, K}), probs);
    ir::Op* op =
        run.op("kiln.moe_permute", {xv, rv, pv}, {TensorType(DType::f32, {rows_shape[0], Dim::fixed(H)})},
               {{"apply_probs", Attribute(true)}});
    run.expect({{op->result(), y}}, 1e-6);
  }
  std::vector<float> y = normal(static_cast<size_t>(bound * H), 113);
  {
    std::vector<double> out(static_cast<size_t>(N * H)), dots(static_cast<size_t>(N * K));
    for (int64_t r = 0; r < bound; ++r) {
      const int s = rows[static_cast<size_t>(r)];
      if (s < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        out[static_cast<size_t>(s / K * H + h)] += y[static_cast<size_t>(r * H + h)];  // without apply_probs
        dots[static_cast<size_t>(s)] +=
            y[static_cast<size_t>(r * H + h)] * x[static_cast<size_t>(s / K * H + h)];
      }
    }
    OpRun run;
    run.bind("B", B);
    Value* yv = run.input("y", DType::f32, {rows_shape[0], Dim::fixed(H)}, y);
    Value* rv = run.input("rows", DType::i32, rows_shape, rows);
    Value* pv = run.input("probs", DType::f32, S({N, K}), probs);
    ir::Op* op = run.op("kiln.moe_unpermute", {yv, rv, pv}, {TensorType(DType::f32, S({N, H}))},
                        {{"apply_probs", Attribute(false)}});
    run.expect({{op->result(), out}}, 1e-5);
    OpRun dot;
    dot.bind("B", B);
    Value* av = dot.input("a", DType::f32, {rows_shape[0], Dim::fixed(H)}, y);
    Value* r2 = dot.input("rows", DType::i32, rows_shape, rows);
    Value* bv = dot.input("b", DType::f32, S({N, H}), x);
    Value* pl = dot.input("probs_like", DType::f32, S({N, K}), probs);
    ir::Op* dop = dot.op("kiln.moe_row_dot", {av, r2, bv, pl}, {TensorType(DType::f32, S({N, K}))}, {});
    dot.expect({{dop->result(), dots}}, 1e-5);
  }
  {
    // w as [E, M, K] (transpose_b), the rows past R zero.
    std::vector<float> w = normal(static_cast<size_t>(E * M * H), 114);
    std::vector<double> out(static_cast<size_t>(bound * M));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = want.offsets[static_cast<size_t>(e)]; r < want.offsets[static_cast<size_t>(e + 1)];
           ++r)
        for (int64_t m = 0; m < M; ++m) {
          double acc = 0;
          for (int64_t h = 0; h < H; ++h)
            acc += y[static_cast<size_t>(r * H + h)] * w[static_cast<size_t>((e * M + m) * H + h)];
          out[static_cast<size_t>(r * M + m)] = acc;
        }
    OpRun run;
    run.bind("B", B);
    const int64_t R = want.offsets.back();
    Value* xv = run.input("x", DType::f32, {rows_shape[0], Dim::fixed(H)}, y, R);
    Value* wv = run.input("w", DType::f32, S({E, M, H}), w);
    Value* ov = run.input("offsets", DType::i32, S({E + 1}), want.offsets);
    ir::Op* op =
        run.op("kiln.grouped_matmul", {xv, wv, ov}, {TensorType(DType::f32, {rows_shape[0], Dim::fixed(M)})},
               {{"transpose_b", Attribute(true)}});
    run.expect({{op->result(), out}}, 1e-4);
    // The weight gradient, as [E, M, K] (transpose).
    std::vector<float> dy = normal(static_cast<size_t>(bound * M), 115);
    std::vector<double> wg(static_cast<size_t>(E * M * H));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = want.offsets[static_cast<size_t>(e)]; r < want.offsets[static_cast<size_t>(e + 1)];
           ++r)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t h = 0; h < H; ++h)
            wg[static_cast<size_t>((e * M + m) * H + h)] +=
                y[static_cast<size_t>(r * H + h)] * dy[static_cast<size_t>(r * M + m)];
    OpRun grad;
    grad.bind("B", B);
    Value* gx = grad.input("x", DType::f32, {rows_shape[0], Dim::fixed(H)}, y, R);
    Value* gd = grad.input("dy", DType::f32, {rows_shape[0], Dim::fixed(M)}, dy, R);
    Value* go = grad.input("offsets", DType::i32, S({E + 1}), want.offsets);
    ir::Op* gop = grad.op("kiln.grouped_matmul_wgrad", {gx, gd, go}, {TensorType(DType::f32, S({E, M, H}))},
                          {{"transpose", Attribute(true)}});
    grad.expect({{gop->result(), wg}}, 1e-4);
  }
}

TEST(SimtMoeOps, ZLossGradientAndSoftmaxRouting) {
  const int64_t N = 9, E = 40, K = 3;
  std::vector<float> logits = normal(static_cast<size_t>(N * E), 121, 2.0f);
  std::vector<double> l(logits.begin(), logits.end());
  {
    const float g = 0.75f;
    std::vector<double> want(l.size());
    for (int64_t n = 0; n < N; ++n) {
      const double m = *std::max_element(l.begin() + n * E, l.begin() + (n + 1) * E);
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(l[static_cast<size_t>(n * E + e)] - m);
      for (int64_t e = 0; e < E; ++e)
        want[static_cast<size_t>(n * E + e)] = g * 0.01 * 2 * (m + std::log(z)) *
                                               std::exp(l[static_cast<size_t>(n * E + e)] - m) / z /
                                               static_cast<double>(N);
    }
    OpRun run;
    Value* lv = run.input("logits", DType::f32, S({N, E}), logits);
    Value* gv = run.input("g", DType::f32, {}, std::vector<float>{g});
    ir::Op* op = run.op("kiln.moe_z_loss_grad", {lv, gv}, {TensorType(DType::f32, S({N, E}))},
                        {{"coeff", Attribute(0.01)}});
    run.expect({{op->result(), want}}, 1e-5);
  }
  for (bool pre : {false, true}) {
    emit::RouterShape r;
    r.tokens = N, r.experts = E, r.topk = K, r.pre_softmax = pre;
    std::vector<int> want_e;
    std::vector<double> want_p;
    for (int64_t n = 0; n < N; ++n) {
      std::vector<int> e;
      std::vector<double> p;
      routeToken(r, l.data() + n * E, nullptr, e, p);
      want_e.insert(want_e.end(), e.begin(), e.end());
      want_p.insert(want_p.end(), p.begin(), p.end());
    }
    OpRun run;
    Value* lv = run.input("logits", DType::f32, S({N, E}), logits);
    ir::Op* op = run.op("kiln.moe_router", {lv},
                        {TensorType(DType::f32, S({N, K})), TensorType(DType::i32, S({N, K}))},
                        {{"topk", Attribute(K)}, {"pre_softmax", Attribute(pre)}});
    run.expect({{op->result(0), want_p}, {op->result(1), asDoubles(want_e)}}, 1e-5);
  }
}

// Dropping by probs without padding, then a bf16 grouped GEMM (tensor cores) over its rows.
TEST(SimtMoeOps, DropByProbsThenABf16GroupedGemm) {
  const int64_t N = 60, K = 2, E = 5, H = 24, M = 40;
  std::vector<int> experts;
  std::vector<float> probs;
  routing(N, K, E, 131, experts, probs);
  emit::DispatchShape d{N, E, K, emit::expertCapacity(N, K, E, 0.75), true, false, N * K};
  Dispatched want = dispatchReference(d, experts, probs);
  ASSERT_EQ(want.counts.back(), 0);  // an empty expert
  ir::Shape rows_shape{Dim::bounded(Dim::fixed(N * K))};
  {
    OpRun run;
    Value* ev = run.input("experts", DType::i32, S({N, K}), experts);
    Value* pv = run.input("probs", DType::f32, S({N, K}), probs);
    ir::Op* op = run.op("kiln.moe_dispatch", {ev, pv},
                        {TensorType(DType::i32, rows_shape), TensorType(DType::i32, S({E + 1})),
                         TensorType(DType::i32, S({E}))},
                        {{"experts", Attribute(E)}, {"capacity_factor", Attribute(0.75)}});
    run.expect({{op->result(0), asDoubles(want.rows)},
                {op->result(1), asDoubles(want.offsets)},
                {op->result(2), asDoubles(want.counts)}},
               0);
  }
  std::mt19937 rng(132);
  auto bf16 = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (uint16_t& h : v) h = toBf16(static_cast<float>(static_cast<int>(rng() % 16) - 8) / 8.0f);
    return v;
  };
  const std::vector<uint16_t> x = bf16(static_cast<size_t>(N * K * H)),
                              w = bf16(static_cast<size_t>(E * H * M));
  const int64_t R = want.offsets.back();
  std::vector<double> y(static_cast<size_t>(N * K * M));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = want.offsets[static_cast<size_t>(e)]; r < want.offsets[static_cast<size_t>(e + 1)]; ++r)
      for (int64_t m = 0; m < M; ++m) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h)
          acc += fromBf16(x[static_cast<size_t>(r * H + h)]) *
                 fromBf16(w[static_cast<size_t>((e * H + h) * M + m)]);
        y[static_cast<size_t>(r * M + m)] = acc;
      }
  OpRun run;
  Value* xv = run.input("x", DType::bf16, {rows_shape[0], Dim::fixed(H)}, x, R);
  Value* wv = run.input("w", DType::bf16, S({E, H, M}), w);
  Value* ov = run.input("offsets", DType::i32, S({E + 1}), want.offsets);
  ir::Op* op = run.op("kiln.grouped_matmul", {xv, wv, ov},
                      {TensorType(DType::bf16, {rows_shape[0], Dim::fixed(M)})}, {});
  run.expect({{op->result(), y}}, 1.0 / 128);
}

TEST(SimtMoeOps, WhatTheKernelsCannotRunIsAnErrorNamingTheOp) {
  {
    // More experts than a warp's registers hold.
    OpRun run;
    Value* l = run.input("logits", DType::f32, S({2, 2048}), std::vector<float>(4096));
    run.op("kiln.moe_router", {l}, {TensorType(DType::f32, S({2, 2})), TensorType(DType::i32, S({2, 2}))},
           {{"topk", Attribute(int64_t{2})}});
    const std::string e = run.loweringError();
    EXPECT_NE(e.find("kiln.moe_router"), std::string::npos) << e;
    EXPECT_NE(e.find("1024"), std::string::npos) << e;
  }
  {
    OpRun run;
    Value* x = run.input("x", DType::f64, S({8, 4}), std::vector<double>(32));
    Value* w = run.input("w", DType::f64, S({2, 4, 4}), std::vector<double>(32));
    Value* o = run.input("offsets", DType::i32, S({3}), std::vector<int>{0, 4, 8});
    run.op("kiln.grouped_matmul", {x, w, o}, {TensorType(DType::f64, S({8, 4}))}, {});
    const std::string e = run.loweringError();
    EXPECT_NE(e.find("kiln.grouped_matmul"), std::string::npos) << e;
    EXPECT_NE(e.find("f64"), std::string::npos) << e;
  }
}

TEST(SimtMoeOps, ExpertBiasUpdateWritesTheBiasInPlace) {
  const std::vector<float> bias{0.5f, -0.25f, 0.0f, 1.0f};
  const std::vector<int> counts{4, 0, 2, 2};  // mean 2
  OpRun run;
  Value* bv = run.input("bias", DType::f32, S({4}), bias);
  Value* cv = run.input("counts", DType::i32, S({4}), counts);
  run.op("kiln.moe_expert_bias_update", {bv, cv}, {}, {{"rate", Attribute(0.25)}});
  run.expect({{bv, {0.25, 0.0, 0.0, 1.0}}}, 0);
}

}  // namespace
}  // namespace kiln::testing::moe
