// Sequence features (docs/language.md, "Sequences"): padded [B, L, D] sequences from
// `embeddings(..., pool = none)` applied to variable-length ids, their lengths, masks, masked
// pooling, and DIN's target attention (Zhou et al. 2018). Everything lowers to existing IR ops
// (compare, select, reduce, matmul, concat, broadcast), so autodiff and the backends take them
// as they are; padding is masked in each of them.
#include <fmt/format.h>

#include "frontend/model_lowering.h"

namespace kiln::frontend {

using CallArgs = ModelLowering::CallArgs;

ir::Value* sequenceMask(ModelLowering& L, ir::Value* lengths, int64_t len, ir::DType dt, ir::Value** inside) {
  const ir::DType it = lengths->type().dtype();
  ir::AttrArray pos;
  for (int64_t t = 0; t < len; ++t) pos.push_back(t);
  ir::Value* iota =
      L.emitTyped(ir::OpCode::Constant, {}, ir::TensorType(it, {ir::Dim::fixed(1), ir::Dim::fixed(len)}),
                  {{"value", ir::Attribute(std::move(pos))}});
  ir::Value* column = L.reshape(lengths, {lengths->type().dim(0), ir::Dim::fixed(1)});
  ir::Value* in = L.emit(ir::OpCode::Compare, {iota, column}, {{"predicate", "lt"}});  // [B, len]
  if (inside) *inside = in;
  return L.emit(ir::OpCode::Select, {in, L.scalarConstant(1.0, dt), L.scalarConstant(0.0, dt)});
}

namespace {

// An integer [B] lengths tensor from a value: a tensor, a sequence's carried lengths, or a
// variable-length sparse input.
ir::Value* lengthsOf(ModelLowering& L, const Val& v, const Location& loc, bool tensor_ok) {
  L.checkNotError(v);
  if (v.kind == Val::Kind::Tensor && v.lengths) return v.lengths;
  if (v.kind == Val::Kind::Sparse) {
    if (v.sparse.size() != 1 || !v.sparse[0].lengths)
      L.fail(loc, fmt::format("lengths come from one variable-length feature (ids[B] max_hotness(L)), got {}",
                              describe(v)));
    return v.sparse[0].lengths;
  }
  if (tensor_ok && v.kind == Val::Kind::Tensor && v.tensor) {
    const auto& t = v.tensor->type();
    if (t.rank() != 1 || !ir::isInteger(t.dtype()) || !t.dim(0).isSymbolic())
      L.fail(loc, fmt::format("lengths must be an integer [B] tensor, got {}", typeStr(t)));
    return v.tensor;
  }
  L.fail(loc, fmt::format("{} carries no lengths: give a variable-length input, a sequence from "
                          "embeddings(..., pool = none), or an integer [B] tensor",
                          describe(v)));
}

// A float [B, L, D] sequence with L static.
ir::Value* sequenceArg(ModelLowering& L, const Val& v, const Location& loc, const char* what) {
  ir::Value* x = floatTensor(L, v, loc, what);
  const auto& t = x->type();
  if (t.rank() != 3 || !t.dim(1).isStatic() || !t.dim(2).isStatic())
    L.fail(loc, fmt::format("{} must be a padded sequence [B, L, D] with L and D static, got {}", what,
                            typeStr(t)));
  return x;
}

// mask [B, L] as [B, L, 1], to scale the rows of a [B, L, D] sequence.
ir::Value* rowMask(ModelLowering& L, ir::Value* mask, const ir::Dim& batch, int64_t len) {
  return L.reshape(mask, {batch, ir::Dim::fixed(len), ir::Dim::fixed(1)});
}

void checkBatch(ModelLowering& L, ir::Value* x, ir::Value* lengths, const Location& loc) {
  if (!(x->type().dim(0) == lengths->type().dim(0)))
    L.fail(loc, fmt::format("the sequence {} and its lengths {} have different batches", typeStr(x->type()),
                            typeStr(lengths->type())));
}

// lengths(x): the i32[B] lengths of a variable-length input or of a padded sequence.
Val fnLengths(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x"}, 1);
  return Val::ofTensor(lengthsOf(L, *b.get(0), b.locs[0], false));
}

// sequence_mask(lengths, maxlen, dtype = f32): [B, maxlen], 1 below the length, else 0 (as
// TensorFlow's tf.sequence_mask, in a float dtype so that it multiplies).
Val fnSequenceMask(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"lengths", "maxlen", "dtype"}, 2);
  ir::Value* lengths = lengthsOf(L, *b.get(0), b.locs[0], true);
  int64_t len = positiveInt(L, *b.get(1), b.locs[1], "maxlen");
  if (len > 65536) L.fail(b.locs[1], fmt::format("maxlen is at most 65536, got {}", len));
  ir::DType dt = ir::DType::f32;
  if (b.get(2)) {
    auto p = ir::parseDType(L.wordArg(*b.get(2), b.locs[2], "dtype"));
    if (!p || !ir::isFloat(*p) || *p == ir::DType::f64)
      L.fail(b.locs[2], "sequence_mask's dtype must be f32, bf16 or f16");
    dt = *p;
  }
  L.builder().setLocation(a.loc);
  return Val::ofTensor(sequenceMask(L, lengths, len, dt));
}

// sequence_pool(x, lengths, mode = mean): [B, L, D] to [B, D] over the first lengths[b] rows
// (DeepCTR's SequencePoolingLayer): sum, mean (an empty sequence gives zeros) or max (zeros
// for an empty one).
Val fnSequencePool(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "lengths", "mode"}, 1);
  ir::Value* x = sequenceArg(L, *b.get(0), b.locs[0], "sequence_pool's input");
  ir::Value* lengths =
      sequenceLengths(L, *b.get(0), b.get(1), b.get(1) ? b.locs[1] : b.locs[0], "sequence_pool");
  checkBatch(L, x, lengths, a.loc);
  std::string mode = b.get(2) ? L.wordArg(*b.get(2), b.locs[2], "mode") : "mean";
  if (mode != "mean" && mode != "sum" && mode != "max")
    L.fail(b.locs[2], fmt::format("sequence_pool's mode must be mean, sum or max, got '{}'", mode));
  L.builder().setLocation(a.loc);
  const ir::Dim batch = x->type().dim(0);
  const int64_t len = x->type().dim(1).size();
  const ir::DType dt = x->type().dtype();
  ir::Value* inside = nullptr;
  ir::Value* mask = sequenceMask(L, lengths, len, dt, &inside);  // [B, L]
  ir::Value* count = reduce(L, mask, "sum", {1}, true);          // [B, 1], min(length, L)
  if (mode == "max") {
    ir::Value* in3 = L.reshape(inside, {batch, ir::Dim::fixed(len), ir::Dim::fixed(1)});
    ir::Value* kept = L.emit(ir::OpCode::Select, {in3, x, L.scalarConstant(-1e30, dt)});
    ir::Value* top = reduce(L, kept, "max", {1}, false);
    ir::Value* some = L.emit(ir::OpCode::Compare, {count, L.scalarConstant(0.0, dt)}, {{"predicate", "gt"}});
    return Val::ofTensor(L.emit(ir::OpCode::Select, {some, top, L.scalarConstant(0.0, dt)}));
  }
  ir::Value* sum = reduce(L, L.emit(ir::OpCode::Mul, {x, rowMask(L, mask, batch, len)}), "sum", {1}, false);
  if (mode == "sum") return Val::ofTensor(sum);
  ir::Value* denom = L.emit(ir::OpCode::Max, {count, L.scalarConstant(1.0, dt)});
  return Val::ofTensor(L.emit(ir::OpCode::Div, {sum, denom}));
}

// din_attention(query [B, D], keys [B, L, D], lengths, hidden = [80, 40], act = dice, softmax
// = false): DIN's local activation unit (Zhou et al. 2018). An MLP over concat(q, k, q - k,
// q * k) scores each key; padded keys get weight 0, and the scores are NOT normalized (the
// paper keeps their sum, the intensity of the user's interest) unless softmax = true (then a
// softmax over the valid keys). The result is the weighted sum of the keys, [B, D].
Val fnDinAttention(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"query", "keys", "lengths", "hidden", "act", "softmax", "name"}, 2);
  ir::Value* q = floatTensor(L, *b.get(0), b.locs[0], "din_attention's query");
  ir::Value* keys = sequenceArg(L, *b.get(1), b.locs[1], "din_attention's keys");
  ir::Value* lengths =
      sequenceLengths(L, *b.get(1), b.get(2), b.get(2) ? b.locs[2] : b.locs[1], "din_attention");
  checkBatch(L, keys, lengths, a.loc);
  const ir::Dim batch = keys->type().dim(0);
  const int64_t len = keys->type().dim(1).size(), dim = keys->type().dim(2).size();
  const ir::DType dt = keys->type().dtype();
  if (q->type().rank() != 2 || !(q->type().dim(0) == batch) || !(q->type().dim(1) == ir::Dim::fixed(dim)) ||
      q->type().dtype() != dt)
    L.fail(b.locs[0], fmt::format("din_attention's query must be {} for keys {}, got {}",
                                  typeStr(ir::TensorType(dt, {batch, ir::Dim::fixed(dim)})),
                                  typeStr(keys->type()), typeStr(q->type())));
  std::vector<int64_t> hidden =
      b.get(3) ? L.intsArg(*b.get(3), b.locs[3], "hidden") : std::vector<int64_t>{80, 40};
  for (int64_t h : hidden) positiveInt(L, Val::integer(h), b.locs[3], "a hidden size");
  Val act = b.get(4) ? *b.get(4) : Val::builtin("dice");
  L.checkNotError(act);
  if (act.kind != Val::Kind::Func)
    L.fail(b.locs[4], fmt::format("act must be a function, got {}", describe(act)));
  const bool normalize = b.get(5) ? L.boolArg(*b.get(5), b.locs[5], "softmax") : false;
  std::string name = L.layerName(a, "din_attention", b.get(6));
  Val init = initRecord(L, nullptr, a.loc, "xavier_uniform");

  L.builder().setLocation(a.loc);
  const ir::Shape seq{batch, ir::Dim::fixed(len), ir::Dim::fixed(dim)};
  ir::Value* qt =
      L.emitTyped(ir::OpCode::Broadcast, {L.reshape(q, {batch, ir::Dim::fixed(1), ir::Dim::fixed(dim)})},
                  ir::TensorType(dt, seq));
  ir::Value* h = L.emit(ir::OpCode::Concat,
                        {qt, keys, L.emit(ir::OpCode::Sub, {qt, keys}), L.emit(ir::OpCode::Mul, {qt, keys})},
                        {{"axis", int64_t{2}}});  // [B, L, 4D]
  for (size_t i = 0; i < hidden.size(); ++i) {
    h = linearLayer(L, h, hidden[i], true, init, fmt::format("{}.{}", name, i), a.loc);
    h = L.activate(act, h, a.loc);
  }
  ir::Value* score =
      linearLayer(L, h, 1, true, init, fmt::format("{}.{}", name, hidden.size()), a.loc);  // [B, L, 1]
  L.builder().setLocation(a.loc);
  ir::Value* inside = nullptr;
  ir::Value* mask = rowMask(L, sequenceMask(L, lengths, len, dt, &inside), batch, len);
  ir::Value* weight;
  if (normalize) {
    ir::Value* in3 = L.reshape(inside, {batch, ir::Dim::fixed(len), ir::Dim::fixed(1)});
    ir::Value* kept = L.emit(ir::OpCode::Select, {in3, score, L.scalarConstant(-1e30, dt)});
    weight = L.emit(ir::OpCode::Mul, {L.emit(ir::OpCode::Softmax, {kept}, {{"axis", int64_t{1}}}), mask});
  } else {
    weight = L.emit(ir::OpCode::Mul, {score, mask});
  }
  return Val::ofTensor(reduce(L, L.emit(ir::OpCode::Mul, {weight, keys}), "sum", {1}, false));
}

}  // namespace

ir::Value* sequenceLengths(ModelLowering& L, const Val& x, const Val* explicit_lengths, const Location& loc,
                           const char* what) {
  if (explicit_lengths) return lengthsOf(L, *explicit_lengths, loc, true);
  if (x.kind == Val::Kind::Tensor && x.lengths) return x.lengths;
  L.fail(loc, fmt::format("{} needs the lengths of its padded sequence: this value carries none (pass "
                          "lengths = lengths(input))",
                          what));
}

void addSequenceBuiltins(std::map<std::string, BuiltinInfo>& m) {
  m["lengths"] = {fnLengths, "the i32[B] lengths of a variable-length input or padded sequence"};
  m["sequence_mask"] = {fnSequenceMask, "[B, L] mask: 1 below each sample's length, else 0"};
  m["sequence_pool"] = {fnSequencePool, "masked sum, mean or max over a padded [B, L, D] sequence"};
  m["din_attention"] = {fnDinAttention, "DIN's target attention over a padded sequence of keys"};
}

}  // namespace kiln::frontend
