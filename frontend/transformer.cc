// The layers of a decoder-only transformer, with Megatron's conventions: token embeddings, the
// SwiGLU gate, and multi-head self-attention with grouped-query heads, rotary position
// embeddings and a causal mask. Each lowers to existing IR ops (gather, linear, reshape,
// transpose, batched matmul, softmax, constants), so autodiff and every backend take them as is.
#include <fmt/format.h>

#include <cmath>

#include "frontend/model_lowering.h"

namespace kiln::frontend {
namespace {

using CallArgs = ModelLowering::CallArgs;

// The default weight init of these layers: Megatron's init_method_std.
Val megatronInit(ModelLowering& L, const Val* v, const Location& loc) {
  if (v) return initRecord(L, v, loc, "normal");
  Val r = initRecord(L, nullptr, loc, "normal");
  r.fields = {{"mean", Val::number(0.0)}, {"std", Val::number(0.02)}};
  return r;
}

ir::DType floatDType(ModelLowering& L, const Val* v, const Location& loc, const char* what) {
  if (!v) return ir::DType::f32;
  auto p = ir::parseDType(L.wordArg(*v, loc, "dtype"));
  if (!p || !ir::isFloat(*p) || *p == ir::DType::f64)
    L.fail(loc, fmt::format("{}'s dtype must be f32, bf16 or f16", what));
  return *p;
}

// embedding(tokens, vocab, dim): rows of a [vocab, dim] table picked by integer tokens of any
// shape, [B, T] -> [B, T, dim]. A dense kiln.gather, so its gradient is a dense scatter_add
// (the pooled sparse path of `embeddings` is for recommendation tables).
Val fnEmbedding(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"tokens", "vocab", "dim", "init", "dtype", "name"}, 3);
  ir::Value* ids = L.tensorArg(*b.get(0), b.locs[0], "embedding's tokens");
  if (!ir::isInteger(ids->type().dtype()))
    L.fail(b.locs[0],
           fmt::format("embedding's tokens must be an integer tensor, got {}", typeStr(ids->type())));
  int64_t vocab = positiveInt(L, *b.get(1), b.locs[1], "vocab");
  int64_t dim = positiveInt(L, *b.get(2), b.locs[2], "dim");
  Val init = megatronInit(L, b.get(3), b.locs[3]);
  ir::DType dt = floatDType(L, b.get(4), b.locs[4], "embedding");
  std::string name = L.layerName(a, "embedding", b.get(5));
  ir::Value* table = L.makeParam(
      name + ".weight", ir::TensorType(dt, {ir::Dim::fixed(vocab), ir::Dim::fixed(dim)}), init, a.loc);
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::Gather, {table, ids}, {{"axis", int64_t{0}}}));
}

ir::Value* sliceLast(ModelLowering& L, ir::Value* x, int64_t start, int64_t limit) {
  return L.emit(ir::OpCode::Slice, {x}, {{"axis", x->type().rank() - 1}, {"start", start}, {"limit", limit}});
}

// swiglu(x): the last dim's halves a | b give silu(a) * b (Megatron's chunk order).
Val fnSwiglu(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "swiglu's input");
  int64_t d = staticLastDim(L, x, a.loc, "swiglu");
  if (d % 2)
    L.fail(a.loc,
           fmt::format("swiglu splits the last dim in halves: it must be even, got {}", typeStr(x->type())));
  L.builder().setLocation(a.loc);
  ir::Value* gate = L.emit(ir::OpCode::Silu, {sliceLast(L, x, 0, d / 2)});
  return Val::ofTensor(L.emit(ir::OpCode::Mul, {gate, sliceLast(L, x, d / 2, d)}));
}

// ---- attention ------------------------------------------------------------------------------

struct AttentionShape {
  ir::Dim batch;
  int64_t seq = 0, model_dim = 0, heads = 0, kv_heads = 0, head_dim = 0;
};

ir::Value* constantOf(ModelLowering& L, ir::DType dt, ir::Shape shape, ir::AttrArray values) {
  return L.emitTyped(ir::OpCode::Constant, {}, ir::TensorType(dt, std::move(shape)),
                     {{"value", ir::Attribute(std::move(values))}});
}

// The rotary tables [T, hd]: angle(t, i) = t * base^(-2i/hd) for i < hd/2, repeated for the
// second half (Megatron's cat(freqs, freqs)).
std::pair<ir::Value*, ir::Value*> ropeTables(ModelLowering& L, const AttentionShape& s, double base,
                                             ir::DType dt) {
  ir::AttrArray cos, sin;
  const int64_t half = s.head_dim / 2;
  for (int64_t t = 0; t < s.seq; ++t)
    for (int64_t j = 0; j < s.head_dim; ++j) {
      double inv_freq =
          std::pow(base, -2.0 * static_cast<double>(j % half) / static_cast<double>(s.head_dim));
      double angle = static_cast<double>(t) * inv_freq;
      cos.push_back(std::cos(angle));
      sin.push_back(std::sin(angle));
    }
  ir::Shape shape{ir::Dim::fixed(s.seq), ir::Dim::fixed(s.head_dim)};
  return {constantOf(L, dt, shape, std::move(cos)), constantOf(L, dt, shape, std::move(sin))};
}

// x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] (x: [B, heads, T, hd]).
ir::Value* applyRope(ModelLowering& L, ir::Value* x, std::pair<ir::Value*, ir::Value*> table,
                     int64_t head_dim) {
  ir::Value* x1 = sliceLast(L, x, 0, head_dim / 2);
  ir::Value* x2 = sliceLast(L, x, head_dim / 2, head_dim);
  ir::Value* rotated =
      L.emit(ir::OpCode::Concat, {L.emit(ir::OpCode::Neg, {x2}), x1}, {{"axis", int64_t{3}}});
  return L.emit(ir::OpCode::Add, {L.emit(ir::OpCode::Mul, {x, table.first}),
                                  L.emit(ir::OpCode::Mul, {rotated, table.second})});
}

// [B, T, n*hd] -> [B, n, T, hd].
ir::Value* splitHeads(ModelLowering& L, ir::Value* x, const AttentionShape& s, int64_t n) {
  ir::Value* r =
      L.reshape(x, {s.batch, ir::Dim::fixed(s.seq), ir::Dim::fixed(n), ir::Dim::fixed(s.head_dim)});
  return transposeTo(L, r, {0, 2, 1, 3});
}

// Keeps scores [B, H, T, T] where the key position is at most the query's; the others get a
// large negative number (not -inf, so a backend's max-subtraction never sees inf - inf).
ir::Value* causalMask(ModelLowering& L, ir::Value* scores, int64_t seq) {
  ir::AttrArray pos;
  for (int64_t t = 0; t < seq; ++t) pos.push_back(t);
  ir::Value* query = constantOf(L, ir::DType::i32, {ir::Dim::fixed(seq), ir::Dim::fixed(1)}, pos);
  ir::Value* key = constantOf(L, ir::DType::i32, {ir::Dim::fixed(1), ir::Dim::fixed(seq)}, std::move(pos));
  ir::Value* visible = L.emit(ir::OpCode::Compare, {query, key}, {{"predicate", "ge"}});
  return L.emit(ir::OpCode::Select, {visible, scores, L.scalarConstant(-1e30, scores->type().dtype())});
}

AttentionShape attentionShape(ModelLowering& L, CallArgs& a, const ModelLowering::Bound& b, ir::Value* x) {
  const auto& t = x->type();
  if (t.rank() != 3) L.fail(b.locs[0], fmt::format("attention needs x: [B, T, D], got {}", typeStr(t)));
  AttentionShape s;
  s.batch = t.dim(0);
  if (!t.dim(1).isStatic())
    L.fail(b.locs[0], fmt::format("attention needs a static sequence length (T a number or a param), got {}",
                                  typeStr(t)));
  s.seq = t.dim(1).size();
  s.model_dim = staticLastDim(L, x, a.loc, "attention");
  s.heads = positiveInt(L, *b.get(1), b.locs[1], "heads");
  s.kv_heads = b.get(2) ? positiveInt(L, *b.get(2), b.locs[2], "kv_heads") : s.heads;
  if (s.heads % s.kv_heads)
    L.fail(b.locs[2], fmt::format("kv_heads ({}) must divide heads ({})", s.kv_heads, s.heads));
  if (b.get(6)) {
    s.head_dim = positiveInt(L, *b.get(6), b.locs[6], "head_dim");
  } else {
    if (s.model_dim % s.heads)
      L.fail(a.loc,
             fmt::format("heads ({}) must divide the model dim {} (or give head_dim)", s.heads, s.model_dim));
    s.head_dim = s.model_dim / s.heads;
  }
  if (s.seq > 65536 || s.head_dim > 65536)
    L.fail(a.loc, "attention's sequence length and head_dim are at most 65536");
  return s;
}

// attention(x, heads, kv_heads, causal, rope, rope_base, head_dim): Megatron's self-attention
// without biases. Query head h reads kv head h / (heads / kv_heads); scores are scaled by
// 1/sqrt(head_dim), masked and soft-maxed in f32.
Val fnAttention(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(
      a, {"x", "heads", "kv_heads", "causal", "rope", "rope_base", "head_dim", "init", "name", "lengths"}, 2);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "attention's input");
  AttentionShape s = attentionShape(L, a, b, x);
  bool causal = b.get(3) ? L.boolArg(*b.get(3), b.locs[3], "causal") : true;
  bool rope = b.get(4) ? L.boolArg(*b.get(4), b.locs[4], "rope") : true;
  double base = b.get(5) ? L.numberArg(*b.get(5), b.locs[5], "rope_base") : 10000.0;
  if (rope && !(base > 1)) L.fail(b.locs[5], fmt::format("rope_base must be greater than 1, got {}", base));
  if (rope && s.head_dim % 2) L.fail(a.loc, fmt::format("rope needs an even head_dim, got {}", s.head_dim));
  Val init = megatronInit(L, b.get(7), b.locs[7]);
  std::string name = L.layerName(a, "attention", b.get(8));
  const ir::DType dt = x->type().dtype();
  const int64_t group = s.heads / s.kv_heads;
  // A padded sequence (its own lengths, or lengths = ...) masks the keys at and past each
  // sample's length (PyTorch's key_padding_mask) and zeroes the padded rows of the result.
  ir::Value* lengths = nullptr;
  if (b.get(9) || b.get(0)->lengths) {
    lengths = sequenceLengths(L, *b.get(0), b.get(9), b.get(9) ? b.locs[9] : b.locs[0], "attention");
    if (!(lengths->type().dim(0) == s.batch))
      L.fail(a.loc, fmt::format("attention's lengths {} do not match x {}", typeStr(lengths->type()),
                                typeStr(x->type())));
  }

  ir::Value* q =
      splitHeads(L, linearLayer(L, x, s.heads * s.head_dim, false, init, name + ".q", a.loc), s, s.heads);
  ir::Value* k = splitHeads(L, linearLayer(L, x, s.kv_heads * s.head_dim, false, init, name + ".k", a.loc), s,
                            s.kv_heads);
  ir::Value* v = splitHeads(L, linearLayer(L, x, s.kv_heads * s.head_dim, false, init, name + ".v", a.loc), s,
                            s.kv_heads);
  L.builder().setLocation(a.loc);
  if (rope) {
    auto table = ropeTables(L, s, base, dt);
    q = applyRope(L, q, table, s.head_dim);
    k = applyRope(L, k, table, s.head_dim);
  }
  // The query heads of one kv head side by side: [B, H, T, hd] is [B, kvH, group*T, hd], so one
  // batched matmul per kv head serves its whole group without repeating k and v.
  const ir::Dim T = ir::Dim::fixed(s.seq), hd = ir::Dim::fixed(s.head_dim);
  const ir::Shape grouped{s.batch, ir::Dim::fixed(s.kv_heads), ir::Dim::fixed(group * s.seq), hd};
  ir::Value* scores = L.emit(ir::OpCode::Matmul, {L.reshape(q, grouped), k}, {{"transpose_b", true}});
  scores = L.reshape(scores, {s.batch, ir::Dim::fixed(s.heads), T, T});
  if (dt != ir::DType::f32) scores = L.emit(ir::OpCode::Cast, {scores}, {{"to", "f32"}});
  scores =
      L.emit(ir::OpCode::Mul,
             {scores, L.scalarConstant(1.0 / std::sqrt(static_cast<double>(s.head_dim)), ir::DType::f32)});
  if (causal) scores = causalMask(L, scores, s.seq);
  ir::Value* row_mask = nullptr;
  if (lengths) {
    ir::Value* inside = nullptr;
    row_mask = sequenceMask(L, lengths, s.seq, dt, &inside);  // [B, T]
    ir::Value* keys = L.reshape(inside, {s.batch, ir::Dim::fixed(1), ir::Dim::fixed(1), T});
    scores = L.emit(ir::OpCode::Select, {keys, scores, L.scalarConstant(-1e30, ir::DType::f32)});
  }
  ir::Value* probs = L.emit(ir::OpCode::Softmax, {scores}, {{"axis", int64_t{-1}}});
  if (dt != ir::DType::f32)
    probs = L.emit(ir::OpCode::Cast, {probs}, {{"to", std::string(ir::dtypeName(dt))}});
  probs = L.reshape(probs, {s.batch, ir::Dim::fixed(s.kv_heads), ir::Dim::fixed(group * s.seq), T});
  ir::Value* ctx = L.emit(ir::OpCode::Matmul, {probs, v});  // [B, kvH, group*T, hd]
  ctx = L.reshape(ctx, {s.batch, ir::Dim::fixed(s.heads), T, hd});
  ctx = transposeTo(L, ctx, {0, 2, 1, 3});
  ctx = L.reshape(ctx, {s.batch, T, ir::Dim::fixed(s.heads * s.head_dim)});
  ir::Value* out = linearLayer(L, ctx, s.model_dim, false, init, name + ".o", a.loc);
  if (!lengths) return Val::ofTensor(out);
  L.builder().setLocation(a.loc);
  Val r = Val::ofTensor(L.emit(ir::OpCode::Mul, {out, L.reshape(row_mask, {s.batch, T, ir::Dim::fixed(1)})}));
  r.lengths = lengths;
  return r;
}

}  // namespace

void addTransformerBuiltins(std::map<std::string, BuiltinInfo>& m) {
  m["embedding"] = {fnEmbedding, "token embedding lookup: [B, T] ids to [B, T, dim]"};
  m["swiglu"] = {fnSwiglu, "silu of the first half of the last dim times the second"};
  m["attention"] = {fnAttention, "causal multi-head self-attention with GQA and RoPE"};
}

}  // namespace kiln::frontend
