// The dense optimizer emitter: every kiln.optimizer_update of a group (groupOps gathers a
// stream's updates into one group, as PyTorch's fused optimizers and apex's multi_tensor_apply
// step all parameters at once) as ONE Source launch per configuration: blocks of kDenseChunk
// elements over the tensors laid end to end, each block finding its tensor in an address table
// and stepping its elements in place. R1's 25 parameter updates were 25 Pointwise launches, most
// of a few hundred elements.
#include "codegen/emit/optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "codegen/emit/emitter_registry.h"
#include "ir/optimizer.h"

namespace kiln::codegen::emit {

ScalarCode scalarCode(DType t) {
  switch (t) {
    case DType::f64: return kScalarF64;
    case DType::bf16: return kScalarBf16;
    case DType::i32: return kScalarI32;
    case DType::i64: return kScalarI64;
    default: return kScalarF32;
  }
}

const char* floatCType(DType t) {
  switch (t) {
    case DType::f64: return "double";
    case DType::bf16: return "kiln_bf16";
    default: return "float";
  }
}

namespace {

using ir::Op;
using ir::Value;

// What one launch is specialized to: the optimizer, the tensors' types and the attributes.
struct DenseStep {
  std::string kind;  // KILN_OPT_* of the device code
  DType param = DType::f32, grad = DType::f32, state = DType::f32;
  double lr = 0, eps = 1e-8, beta1 = 0.9, beta2 = 0.999, weight_decay = 0, momentum = 0;
  bool operator==(const DenseStep&) const = default;
};

Expected<DenseStep> denseStepOf(const Op& op) {
  const std::string kind = op.strAttr("kind");
  const size_t nstate = ir::denseOptimizerState(kind, op.attrs()).size();
  DenseStep s;
  if (kind == "sgd")
    s.kind = nstate == 0 ? "KILN_OPT_SGD" : op.boolAttr("nesterov") ? "KILN_OPT_SGD_NESTEROV" : "KILN_OPT_SGD_MOMENTUM";
  else if (kind == "adagrad")
    s.kind = "KILN_OPT_ADAGRAD";
  else if (kind == "adam")
    s.kind = "KILN_OPT_ADAM";
  else if (kind == "adamw")
    s.kind = "KILN_OPT_ADAMW";
  else
    return Status::errorf("{}: no CUDA step for optimizer '{}'", opLabel(op), kind);
  s.param = op.operand(0)->type().dtype();
  s.grad = op.operand(1)->type().dtype();
  if (nstate > 0) s.state = op.operand(2)->type().dtype();
  for (DType t : {s.param, s.grad, s.state})
    if (t != DType::f32 && t != DType::bf16 && t != DType::f64)
      return Status::errorf("{}: the CUDA step takes f32, bf16 or f64 tensors", opLabel(op));
  s.lr = op.floatAttr("lr");
  s.eps = op.floatAttr("eps", 1e-8);
  s.beta1 = op.floatAttr("beta1", 0.9);
  s.beta2 = op.floatAttr("beta2", 0.999);
  s.weight_decay = op.floatAttr("weight_decay");
  s.momentum = op.floatAttr("momentum");
  return s;
}

// One launch stepping `tensors` (updates sharing `step`), their rows of `table` from `first`.
Kernel denseKernel(const DenseStep& step, int64_t tensors, int64_t first, int64_t blocks, int64_t table_rows) {
  Kernel k;
  k.name = "optimizer_multi_tensor";
  k.kind = KernelKind::Source;
  k.grid = std::max<int64_t>(1, blocks);
  k.block = 256;
  const DType compute = step.param == DType::f64 ? DType::f64 : DType::f32;
  k.source = fmt::format(
      "  kiln_opt_dense<{}, {}, {}, {}, {}>(b0 + {}LL * KILN_OPT_WORDS, {}, {:.17g}, {:.17g}, {:.17g}, {:.17g}, "
      "{:.17g}, {:.17g});\n",
      step.kind, floatCType(step.param), floatCType(step.grad), floatCType(step.state), floatCType(compute), first, tensors,
      step.lr, step.eps, step.beta1, step.beta2, step.weight_decay, step.momentum);
  k.addBuffer("optimizer.tensors", DType::i64, table_rows * kDenseWords);
  return k;
}

Status lowerOptimizerUpdates(GroupLowering& gl, const std::vector<const Op*>& ops) {
  // The updates of one step next to each other, in their first update's order.
  std::vector<std::pair<DenseStep, const Op*>> updates;
  for (const Op* op : ops) {
    KILN_ASSIGN_OR_RETURN(auto s, denseStepOf(*op));
    updates.push_back({s, op});
  }
  std::vector<DenseStep> steps;
  for (const auto& [s, _] : updates)
    if (std::find(steps.begin(), steps.end(), s) == steps.end()) steps.push_back(s);
  auto rank = [&](const DenseStep& s) { return std::find(steps.begin(), steps.end(), s) - steps.begin(); };
  std::stable_sort(updates.begin(), updates.end(),
                   [&](const auto& a, const auto& b) { return rank(a.first) < rank(b.first); });

  // The address table: a row per tensor, a last row per launch holding its block count.
  std::vector<AddressWord> words;
  std::vector<std::tuple<DenseStep, int64_t, int64_t, int64_t>> launches;  // step, first row, tensors, blocks
  for (size_t i = 0; i < updates.size();) {
    const DenseStep& step = updates[i].first;
    const int64_t first_row = static_cast<int64_t>(words.size() / kDenseWords);
    int64_t blocks = 0, tensors = 0;
    for (; i < updates.size() && updates[i].first == step; ++i, ++tensors) {
      const Op& op = *updates[i].second;
      auto operand = [&](size_t j) { return op.operand(static_cast<unsigned>(j)); };
      const size_t nstate = ir::denseOptimizerState(op.strAttr("kind"), op.attrs()).size();
      const size_t s = 2 + nstate;
      KILN_ASSIGN_OR_RETURN(auto shape, gl.shapeOf(operand(0)));
      const int64_t n = product(shape);
      std::vector<AddressWord> row(kDenseWords);
      row[kDenseParam] = {gl.groupBuffer(operand(0), true), 0};
      row[kDenseGrad] = {gl.groupBuffer(operand(1), false), 0};
      if (nstate > 0) row[kDenseState0] = {gl.groupBuffer(operand(2), true), 0};
      if (nstate > 1) row[kDenseState1] = {gl.groupBuffer(operand(3), true), 0};
      row[kDenseElements].value = n;
      row[kDenseFirstBlock].value = blocks;
      row[kDenseLr] = {gl.groupBuffer(operand(s), false), 0};
      row[kDenseStep] = {gl.groupBuffer(operand(s + 1), false), 0};
      int64_t types = scalarCode(operand(s)->type().dtype()) | scalarCode(operand(s + 1)->type().dtype()) << 4;
      if (op.boolAttr("scaled")) {
        row[kDenseScale] = {gl.groupBuffer(operand(s + 2), false), 0};
        types |= scalarCode(operand(s + 2)->type().dtype()) << 8;
      }
      row[kDenseScalarTypes].value = types;
      words.insert(words.end(), row.begin(), row.end());
      blocks += std::max<int64_t>(1, (n + kDenseChunk - 1) / kDenseChunk);
    }
    std::vector<AddressWord> last(kDenseWords);
    last[kDenseFirstBlock].value = blocks;
    words.insert(words.end(), last.begin(), last.end());
    launches.push_back({step, first_row, tensors, blocks});
  }
  const int64_t rows = static_cast<int64_t>(words.size() / kDenseWords);
  const int table = gl.addressTable("optimizer.tensors", std::move(words));
  for (const auto& [step, first, tensors, blocks] : launches)
    KILN_RETURN_IF_ERROR(
        gl.addSourceKernel(denseKernel(step, tensors, first, blocks, rows), {table}, "the optimizer step"));
  return Status::ok();
}

}  // namespace

const std::string& optimizerDeviceFunctions() {
  static const std::string text = fmt::format(
      "enum kiln_opt_word {{ KILN_OPT_PARAM = {}, KILN_OPT_GRAD = {}, KILN_OPT_STATE0 = {}, KILN_OPT_STATE1 = {}, "
      "KILN_OPT_ELEMENTS = {}, KILN_OPT_FIRST_BLOCK = {}, KILN_OPT_LR = {}, KILN_OPT_STEP = {}, KILN_OPT_SCALE = {}, "
      "KILN_OPT_SCALAR_TYPES = {}, KILN_OPT_WORDS = {}, KILN_OPT_CHUNK = {} }};\n",
      static_cast<int>(kDenseParam), static_cast<int>(kDenseGrad), static_cast<int>(kDenseState0),
      static_cast<int>(kDenseState1), static_cast<int>(kDenseElements), static_cast<int>(kDenseFirstBlock),
      static_cast<int>(kDenseLr), static_cast<int>(kDenseStep), static_cast<int>(kDenseScale),
      static_cast<int>(kDenseScalarTypes), static_cast<int>(kDenseWords), kDenseChunk) + R"CUDA(
// The optimizer step (codegen/emit/optimizer.cc): one definition of each optimizer's math per
// element, in the order of ir/ops/optimizer.cc, for the dense multi-tensor update and the
// embedding backward's row update.
enum kiln_opt_kind {
  KILN_OPT_SGD, KILN_OPT_SGD_MOMENTUM, KILN_OPT_SGD_NESTEROV, KILN_OPT_ADAGRAD, KILN_OPT_ADAM, KILN_OPT_ADAMW
};

// A scalar operand (lr, step, gradient scale) of type `code` (ScalarCode), as C.
template <typename C>
__device__ __forceinline__ C kiln_opt_scalar(long long address, long long code) {
  switch (code) {
    case 1: return (C)*(const double*)address;
    case 2: return (C)kiln_ld((const kiln_bf16*)address, 0);
    case 3: return (C)*(const int*)address;
    case 4: return (C)*(const long long*)address;
    default: return (C)*(const float*)address;
  }
}

// A step's hyperparameters in its compute type C; bias1/bias2 are Adam's 1 - beta^t.
template <typename C>
struct kiln_opt_hyper {
  C lr, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay, momentum, bias1, bias2;
};

template <int kKind, typename C>
__device__ __forceinline__ kiln_opt_hyper<C> kiln_opt_make_hyper(C lr, C step, double eps, double beta1, double beta2,
                                                                 double weight_decay, double momentum) {
  kiln_opt_hyper<C> h;
  h.lr = lr;
  h.eps = (C)eps;
  h.beta1 = (C)beta1;
  h.beta2 = (C)beta2;
  h.one_minus_beta1 = (C)(1.0 - beta1);
  h.one_minus_beta2 = (C)(1.0 - beta2);
  h.weight_decay = (C)weight_decay;
  h.momentum = (C)momentum;
  h.bias1 = h.bias2 = (C)1;
  if (kKind == KILN_OPT_ADAM || kKind == KILN_OPT_ADAMW) {
    h.bias1 = (C)1 - kiln_fn::pow(h.beta1, step);
    h.bias2 = (C)1 - kiln_fn::pow(h.beta2, step);
  }
  return h;
}

// The new value of parameter element p with gradient g (already scaled); the state at `at` of
// s0 (momentum, Adagrad's sum, Adam's m) and s1 (Adam's v) is updated in place.
template <int kKind, typename C, typename S>
__device__ __forceinline__ C kiln_opt_element(C p, C g, S* s0, S* s1, long long at, const kiln_opt_hyper<C>& h) {
  if (kKind == KILN_OPT_ADAMW) {
    if (h.weight_decay != (C)0) p = p - (h.lr * h.weight_decay) * p;
  } else if (h.weight_decay != (C)0) {
    g = g + h.weight_decay * p;
  }
  if (kKind == KILN_OPT_SGD) return p - h.lr * g;
  if (kKind == KILN_OPT_SGD_MOMENTUM || kKind == KILN_OPT_SGD_NESTEROV) {
    const C m = h.momentum * (C)kiln_ld(s0, at) + g;
    kiln_st(s0, at, m);
    return p - h.lr * (kKind == KILN_OPT_SGD_NESTEROV ? g + h.momentum * m : m);
  }
  if (kKind == KILN_OPT_ADAGRAD) {
    const C sum = (C)kiln_ld(s0, at) + g * g;
    kiln_st(s0, at, sum);
    return p - (h.lr * g) / (kiln_fn::sqrt(sum) + h.eps);
  }
  const C m = h.beta1 * (C)kiln_ld(s0, at) + h.one_minus_beta1 * g;
  const C v = h.beta2 * (C)kiln_ld(s1, at) + h.one_minus_beta2 * g * g;
  kiln_st(s0, at, m);
  kiln_st(s1, at, v);
  return p - (h.lr * (m / h.bias1)) / (kiln_fn::sqrt(v / h.bias2) + h.eps);
}

// The dense multi-tensor update: block b steps elements [c * CHUNK, (c + 1) * CHUNK) of the
// tensor whose blocks hold it (c counted from the tensor's first block), found by a binary
// search over the tensors' first blocks; tab points at this launch's first row.
template <int kKind, typename W, typename G, typename S, typename C>
__device__ void kiln_opt_dense(const long long* tab, int tensors, double lr_attr, double eps, double beta1, double beta2,
                               double weight_decay, double momentum) {
  int lo = 0, hi = tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tab[mid * KILN_OPT_WORDS + KILN_OPT_FIRST_BLOCK] <= (long long)blockIdx.x) lo = mid; else hi = mid - 1;
  }
  const long long* d = tab + lo * KILN_OPT_WORDS;
  const long long types = d[KILN_OPT_SCALAR_TYPES];
  const C lr = (C)lr_attr * kiln_opt_scalar<C>(d[KILN_OPT_LR], types & 15);
  const C scale = d[KILN_OPT_SCALE] ? kiln_opt_scalar<C>(d[KILN_OPT_SCALE], (types >> 8) & 15) : (C)1;
  const kiln_opt_hyper<C> h = kiln_opt_make_hyper<kKind, C>(
      lr, kiln_opt_scalar<C>(d[KILN_OPT_STEP], (types >> 4) & 15), eps, beta1, beta2, weight_decay, momentum);
  W* w = (W*)d[KILN_OPT_PARAM];
  const G* grad = (const G*)d[KILN_OPT_GRAD];
  S* s0 = (S*)d[KILN_OPT_STATE0];
  S* s1 = (S*)d[KILN_OPT_STATE1];
  const long long n = d[KILN_OPT_ELEMENTS];
  const long long begin = ((long long)blockIdx.x - d[KILN_OPT_FIRST_BLOCK]) * KILN_OPT_CHUNK;
  const long long end = begin + KILN_OPT_CHUNK < n ? begin + KILN_OPT_CHUNK : n;
  for (long long i = begin + threadIdx.x; i < end; i += blockDim.x)
    kiln_st(w, i, kiln_opt_element<kKind, C, S>((C)kiln_ld(w, i), (C)kiln_ld(grad, i) * scale, s0, s1, i, h));
}
)CUDA";
  return text;
}

void registerOptimizerEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::OptimizerUpdate, {"optimizer", lowerOptimizerUpdates, GroupForm::kManyOfTheOp});
}

}  // namespace kiln::codegen::emit
