// The `moe(...)` layer: a Mixture-of-Experts feed-forward block with Megatron-Core's options
// and defaults (docs/moe.md). It lowers to the routing and expert ops of ir/ops/routing.cc and
// ir/ops/experts.cc:
//
//   logits  = x W_r^T                        (f32, router_dtype)
//   probs, experts = kiln.moe_router(logits, bias?)
//   rows, offsets, counts = kiln.moe_dispatch(experts, probs)
//   h       = grouped_matmul(moe_permute(x, rows), W1, offsets)       [?R, 2F] (swiglu) or [?R, F]
//   y       = grouped_matmul(act(h), W2, offsets)                     [?R, H]
//   out     = moe_unpermute(y, rows, probs) (+ the shared experts' MLP of x)
//
// The balancing losses join the training loss once (ModelLowering::addAuxLoss); the per-expert
// counts and the losses become step statistics (ModelLowering::addStat). `ep = N` pins the
// layer's expert parallelism: the dispatch's `ep` attribute, which the shard pass prefers to --ep.
#include <fmt/format.h>

#include <cmath>

#include "frontend/model_lowering.h"

namespace kiln::frontend {
namespace {

using CallArgs = ModelLowering::CallArgs;

struct MoeOptions {
  int64_t experts = 0, topk = 2, hidden = 0;
  Val act = Val::builtin("swiglu");
  std::string router = "softmax";
  bool pre_softmax = false;
  int64_t groups = 1, group_topk = 1;
  double capacity_factor = 0;  // 0: dropless
  std::string drop_policy = "probs";
  bool pad_to_capacity = false;
  int64_t shared_experts = 0, shared_hidden = 0;
  double aux_loss = 0, seq_aux_loss = 0, z_loss = 0, expert_bias = 0, scale = 1.0;
  int64_t ep = 0;  // 0: the --ep flag's EP size (the shard pass reads the dispatch's pin)
};

const std::vector<std::string>& moeParams() {
  static const std::vector<std::string> k = {"x",
                                             "experts",
                                             "topk",
                                             "hidden",
                                             "act",
                                             "router",
                                             "pre_softmax",
                                             "groups",
                                             "group_topk",
                                             "capacity_factor",
                                             "drop_policy",
                                             "pad_to_capacity",
                                             "shared_experts",
                                             "shared_hidden",
                                             "aux_loss",
                                             "seq_aux_loss",
                                             "z_loss",
                                             "expert_bias",
                                             "router_dtype",
                                             "topk_scale",
                                             "name",
                                             "ep"};
  return k;
}

int64_t sizeArg(ModelLowering& L, const ModelLowering::Bound& b, size_t i, const char* what, int64_t dflt) {
  if (!b.get(i)) return dflt;
  int64_t n = L.intArg(*b.get(i), b.locs[i], what);
  if (n <= 0 || n > (int64_t{1} << 30))
    L.fail(b.locs[i], fmt::format("{} must be a positive size, got {}", what, n));
  return n;
}

double coeffArg(ModelLowering& L, const ModelLowering::Bound& b, size_t i, const char* what) {
  if (!b.get(i)) return 0;
  double c = L.numberArg(*b.get(i), b.locs[i], what);
  if (!(c >= 0) || !std::isfinite(c)) L.fail(b.locs[i], fmt::format("{} must be >= 0, got {}", what, c));
  return c;
}

MoeOptions parseOptions(ModelLowering& L, const ModelLowering::Bound& b, const Location& loc) {
  MoeOptions o;
  o.experts = sizeArg(L, b, 1, "experts", 0);
  if (!o.experts) L.fail(loc, "moe needs 'experts = E'");
  o.topk = sizeArg(L, b, 2, "topk", 2);
  if (o.topk > o.experts) L.fail(b.locs[2], fmt::format("topk {} exceeds the {} experts", o.topk, o.experts));
  o.hidden = sizeArg(L, b, 3, "hidden", 0);
  if (!o.hidden) L.fail(loc, "moe needs 'hidden = F' (each expert's FFN size)");
  if (b.get(4)) o.act = *b.get(4), L.checkNotError(o.act);
  if (b.get(5)) {
    o.router = L.wordArg(*b.get(5), b.locs[5], "router");
    if (o.router != "softmax" && o.router != "sigmoid")
      L.fail(b.locs[5], fmt::format("router must be softmax or sigmoid, got '{}'", o.router));
  }
  if (b.get(6)) o.pre_softmax = L.boolArg(*b.get(6), b.locs[6], "pre_softmax");
  if (o.pre_softmax && o.router != "softmax")
    L.fail(b.locs[6], "pre_softmax applies to the softmax router only");
  o.groups = sizeArg(L, b, 7, "groups", 1);
  o.group_topk = sizeArg(L, b, 8, "group_topk", 1);
  if (o.groups > 1 && !b.get(8)) L.fail(b.locs[7], "group-limited routing (groups > 1) needs group_topk");
  if (o.experts % o.groups)
    L.fail(b.locs[7], fmt::format("{} groups do not divide the {} experts", o.groups, o.experts));
  if (o.group_topk > o.groups)
    L.fail(b.locs[8], fmt::format("group_topk {} exceeds the {} groups", o.group_topk, o.groups));
  if (o.groups > 1 && o.topk % o.group_topk)
    L.fail(b.locs[8], fmt::format("group_topk {} must divide topk {}", o.group_topk, o.topk));
  if (o.groups > 1 && o.topk > o.group_topk * (o.experts / o.groups))
    L.fail(b.locs[8], fmt::format("topk {} exceeds the experts of {} groups of {}", o.topk, o.group_topk,
                                  o.experts / o.groups));
  if (const Val* cf = b.get(9)) {
    L.checkNotError(*cf);
    if (!(cf->kind == Val::Kind::Word && cf->s == "none")) {
      o.capacity_factor = L.numberArg(*cf, b.locs[9], "capacity_factor");
      if (!(o.capacity_factor > 0) || !std::isfinite(o.capacity_factor))
        L.fail(b.locs[9], fmt::format("capacity_factor must be positive or none, got {}", o.capacity_factor));
    }
  }
  if (b.get(10)) {
    o.drop_policy = L.wordArg(*b.get(10), b.locs[10], "drop_policy");
    if (o.drop_policy != "probs" && o.drop_policy != "position")
      L.fail(b.locs[10], fmt::format("drop_policy must be probs or position, got '{}'", o.drop_policy));
  }
  if (b.get(11)) o.pad_to_capacity = L.boolArg(*b.get(11), b.locs[11], "pad_to_capacity");
  if (o.pad_to_capacity && o.capacity_factor == 0)
    L.fail(b.locs[11], "pad_to_capacity needs a capacity_factor");
  o.shared_experts = b.get(12) ? L.intArg(*b.get(12), b.locs[12], "shared_experts") : 0;
  if (o.shared_experts < 0 || o.shared_experts > 1024)
    L.fail(b.locs[12], fmt::format("shared_experts must lie in [0, 1024], got {}", o.shared_experts));
  o.shared_hidden = sizeArg(L, b, 13, "shared_hidden", o.hidden);
  o.aux_loss = coeffArg(L, b, 14, "aux_loss");
  o.seq_aux_loss = coeffArg(L, b, 15, "seq_aux_loss");
  o.z_loss = coeffArg(L, b, 16, "z_loss");
  o.expert_bias = coeffArg(L, b, 17, "expert_bias");
  if (b.get(18)) {
    std::string dt = L.wordArg(*b.get(18), b.locs[18], "router_dtype");
    if (dt != "f32")
      L.fail(b.locs[18], fmt::format("router_dtype must be f32 (routing is computed in f32), got '{}'", dt));
  }
  if (b.get(19)) {
    o.scale = L.numberArg(*b.get(19), b.locs[19], "topk_scale");
    if (!(o.scale > 0)) L.fail(b.locs[19], "topk_scale must be positive");
  }
  if (b.get(21)) {
    // The layer's EP size whatever --ep says: its experts split evenly, E / ep per rank.
    o.ep = L.intArg(*b.get(21), b.locs[21], "ep");
    if (o.ep <= 0) L.fail(b.locs[21], fmt::format("ep must be a positive integer, got {}", o.ep));
    if (o.experts % o.ep)
      L.fail(b.locs[21], fmt::format("ep = {} does not divide the {} experts", o.ep, o.experts));
  }
  return o;
}

bool isSwiglu(const Val& act) { return act.kind == Val::Kind::Func && !act.fn && act.s == "swiglu"; }

// silu(a) * b of h = [a | b] split along the last axis (Megatron's chunk order).
ir::Value* swigluHalves(ModelLowering& L, ir::Value* h, int64_t f) {
  int64_t axis = h->type().rank() - 1;
  ir::Value* a = L.emit(ir::OpCode::Slice, {h}, {{"axis", axis}, {"start", int64_t{0}}, {"limit", f}});
  ir::Value* g = L.emit(ir::OpCode::Slice, {h}, {{"axis", axis}, {"start", f}, {"limit", 2 * f}});
  return L.emit(ir::OpCode::Mul, {L.emit(ir::OpCode::Silu, {a}), g});
}

ir::Value* param(ModelLowering& L, const std::string& name, ir::DType dt, std::vector<int64_t> dims,
                 const Val& init, const Location& loc, ir::AttrDict extra = {}) {
  ir::Shape s;
  for (int64_t d : dims) s.push_back(ir::Dim::fixed(d));
  ir::Value* p = L.makeParam(name, ir::TensorType(dt, std::move(s)), init, loc, std::move(extra));
  L.builder().setLocation(loc);
  return p;
}

Val normalInit(ModelLowering& L, double std, const Location& loc) {
  Val r = L.recordArg(Val::builtin("normal"), loc, "init");
  r.fields = {{"mean", Val::number(0)}, {"std", Val::number(std)}};
  return r;
}

}  // namespace

Val lowerMoe(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, moeParams(), 1);
  ir::Value* x = L.tensorArg(*b.get(0), b.locs[0], "moe's input");
  const ir::TensorType& xt = x->type();
  if (!ir::isFloat(xt.dtype()) || xt.rank() < 2 || xt.rank() > 3 || !xt.dim(xt.rank() - 1).isStatic())
    L.fail(b.locs[0],
           fmt::format("moe needs a float [N, H] or [B, T, H] input with a static H, got {}", typeStr(xt)));
  MoeOptions o = parseOptions(L, b, a.loc);
  const std::string name = L.layerName(a, "moe", b.get(20));
  const ir::DType dt = xt.dtype();
  const int64_t h = xt.dim(xt.rank() - 1).size();

  // Tokens as rows: [B, T, H] -> [T*B, H] (T must be static: a dim is a factor times one symbol).
  int64_t seq_len = 0;
  ir::Value* x2 = x;
  if (xt.rank() == 3) {
    if (!xt.dim(1).isStatic())
      L.fail(b.locs[0], fmt::format("moe over [B, T, H] needs a static T, got {}", typeStr(xt)));
    seq_len = xt.dim(1).size();
    L.builder().setLocation(a.loc);
    x2 = L.reshape(x, {xt.dim(0).times(seq_len), xt.dim(2)});
  }
  if (o.seq_aux_loss > 0 && !seq_len)
    L.fail(b.locs[15], "seq_aux_loss needs a [B, T, H] input (the sequences are its rows)");

  // Router, in f32. Megatron initializes it like the other linear layers (normal, std 0.02).
  const Val init = normalInit(L, 0.02, a.loc);
  ir::Value* wr = param(L, name + ".router.weight", ir::DType::f32, {o.experts, h}, init, a.loc);
  ir::Value* xf = dt == ir::DType::f32 ? x2 : L.emit(ir::OpCode::Cast, {x2}, {{"to", std::string("f32")}});
  ir::Value* logits =
      L.emit(ir::OpCode::Matmul, {xf, wr}, {{"transpose_b", true}, {"kiln.precision", "f32"}});
  logits->setNameHint(name + ".logits");

  std::vector<ir::Value*> router_in{logits};
  if (o.expert_bias > 0) {
    // Aux-loss-free balancing: the bias moves selection, is no trainable weight, and is
    // updated by the train step from this layer's counts (docs/moe.md).
    router_in.push_back(param(L, name + ".router.expert_bias", ir::DType::f32, {o.experts},
                              Val::builtin("zeros"), a.loc,
                              {{"trainable", false},
                               {"expert_bias_rate", o.expert_bias},
                               {"expert_bias_counts", name + ".counts"}}));
  }
  ir::AttrDict router_attrs{
      {"topk", o.topk},     {"score", o.router},          {"pre_softmax", o.pre_softmax},
      {"groups", o.groups}, {"group_topk", o.group_topk}, {"scale", o.scale}};
  auto router = L.builder().create(ir::OpCode::MoeRouter, router_in, router_attrs);
  if (!router) L.fail(a.loc, router.status().message());
  ir::Value* probs = (*router)->result(0);
  ir::Value* experts = (*router)->result(1);

  ir::AttrDict dispatch_attrs{{"experts", o.experts},
                              {"capacity_factor", o.capacity_factor},
                              {"drop_policy", o.drop_policy},
                              {"pad_to_capacity", o.pad_to_capacity}};
  // The layer's EP pin: the shard pass spreads its experts over this many ranks.
  if (o.ep > 0) dispatch_attrs["ep"] = o.ep;
  auto dispatch = L.builder().create(ir::OpCode::MoeDispatch, {experts, probs}, std::move(dispatch_attrs));
  if (!dispatch) L.fail(a.loc, dispatch.status().message());
  ir::Value* rows = (*dispatch)->result(0);
  ir::Value* offsets = (*dispatch)->result(1);
  ir::Value* counts = (*dispatch)->result(2);

  // The experts: fc1 [E, H, F or 2F], fc2 [E, F, H], one grouped GEMM each.
  const bool gated = isSwiglu(o.act);
  const double std_out = 0.02;
  ir::Value* w1 =
      param(L, name + ".experts.fc1", dt, {o.experts, h, gated ? 2 * o.hidden : o.hidden}, init, a.loc);
  ir::Value* w2 =
      param(L, name + ".experts.fc2", dt, {o.experts, o.hidden, h}, normalInit(L, std_out, a.loc), a.loc);
  ir::Value* xp = L.emit(ir::OpCode::MoePermute, {x2, rows, probs}, {{"apply_probs", false}});
  xp->setNameHint(name + ".permuted");
  ir::Value* hid = L.emit(ir::OpCode::GroupedMatmul, {xp, w1, offsets});
  ir::Value* act = gated ? swigluHalves(L, hid, o.hidden) : L.activate(o.act, hid, a.loc);
  L.builder().setLocation(a.loc);
  act->setNameHint(name + ".act");
  ir::Value* y = L.emit(ir::OpCode::GroupedMatmul, {act, w2, offsets});
  ir::Value* out = L.emit(ir::OpCode::MoeUnpermute, {y, rows, probs}, {{"apply_probs", true}});

  if (o.shared_experts > 0) {
    // The shared experts, always on: one dense MLP of n * shared_hidden (Megatron's
    // moe_shared_expert_intermediate_size), with the routed experts' activation.
    const int64_t f2 = o.shared_experts * o.shared_hidden;
    ir::Value* s1 = param(L, name + ".shared.fc1.weight", dt, {gated ? 2 * f2 : f2, h}, init, a.loc);
    ir::Value* s2 = param(L, name + ".shared.fc2.weight", dt, {h, f2}, normalInit(L, std_out, a.loc), a.loc);
    ir::Value* sh = L.emit(ir::OpCode::Matmul, {x2, s1}, {{"transpose_b", true}});
    ir::Value* sa = gated ? swigluHalves(L, sh, f2) : L.activate(o.act, sh, a.loc);
    L.builder().setLocation(a.loc);
    out = L.emit(ir::OpCode::Add, {out, L.emit(ir::OpCode::Matmul, {sa, s2}, {{"transpose_b", true}})});
  }

  // Balancing losses, each scaled by its coefficient inside its op.
  auto aux = [&](const char* what, double coeff, int64_t seq) {
    ir::Value* v = L.emit(ir::OpCode::MoeAuxLoss, {logits, experts},
                          {{"coeff", coeff}, {"score", o.router}, {"topk", o.topk}, {"seq_len", seq}});
    L.addAuxLoss(fmt::format("{}.{}", name, what), v);
  };
  if (o.aux_loss > 0) aux("aux_loss", o.aux_loss, 0);
  if (o.seq_aux_loss > 0) aux("seq_aux_loss", o.seq_aux_loss, seq_len);
  if (o.z_loss > 0)
    L.addAuxLoss(name + ".z_loss", L.emit(ir::OpCode::MoeZLoss, {logits}, {{"coeff", o.z_loss}}));
  L.addStat(name + ".counts", counts);
  L.addMoeLayer({{"name", name},
                 {"experts", o.experts},
                 {"topk", o.topk},
                 {"tokens_per_sample", seq_len ? seq_len : int64_t{1}},
                 {"capacity_factor", o.capacity_factor}});

  if (seq_len) out = L.reshape(out, xt.shape());
  return Val::ofTensor(out);
}

}  // namespace kiln::frontend
