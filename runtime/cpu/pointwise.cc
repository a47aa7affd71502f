#include "runtime/cpu/pointwise.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "ir/op_def.h"
#include "ir/scalar_fn.h"
#include "runtime/cpu/cpu_features.h"
#include "runtime/cpu/kernels/broadcast.h"

namespace kiln::runtime::cpu {
namespace {

// Elements per chunk: a few slots of 4 KB stay in the L1 cache.
constexpr int64_t kChunk = 1024;

// The chunk loops, compiled once for the baseline and once for AVX-512: the same C++, so the same
// results (this file is compiled with -ffp-contract=off: no fused multiply-add appears in one
// variant and not the other). Each loop is simple enough for the compiler to vectorise.
#define KILN_POINTWISE_LOOPS(ns, attr)                                                              \
  namespace ns {                                                                                    \
  template <ir::ScalarFn F>                                                                         \
  attr void apply(const float* a, const float* b, float* out, int64_t n) {                          \
    if constexpr (ir::arityOf(F) == 1) {                                                            \
      for (int64_t i = 0; i < n; ++i) out[i] = ir::scalar::apply<F, float>(a[i]);                   \
    } else {                                                                                        \
      for (int64_t i = 0; i < n; ++i) out[i] = ir::scalar::apply<F, float>(a[i], b[i]);             \
    }                                                                                               \
  }                                                                                                 \
  /* activation_grad(x = a, dy = b) = dy * f'(x), as the activation_grad kernel computes it. */     \
  template <ir::ScalarFn D>                                                                         \
  attr void gradient(const float* a, const float* b, float* out, int64_t n) {                       \
    for (int64_t i = 0; i < n; ++i) out[i] = b[i] * ir::scalar::apply<D, float>(a[i]);              \
  }                                                                                                 \
  attr void copy(const float* a, const float*, float* out, int64_t n) {                             \
    for (int64_t i = 0; i < n; ++i) out[i] = a[i];                                                  \
  }                                                                                                 \
  /* ir::floatToBf16 and back, without its branch: a NaN keeps its sign and payload, quieted. */    \
  attr void roundBf16(float* x, int64_t n) {                                                        \
    uint32_t* u = reinterpret_cast<uint32_t*>(x);                                                   \
    for (int64_t i = 0; i < n; ++i) {                                                               \
      const uint32_t v = u[i];                                                                      \
      const uint32_t rounded = (v + 0x7fffu + ((v >> 16) & 1u)) & 0xffff0000u;                      \
      const uint32_t nan = (v & 0xffff0000u) | 0x400000u;                                           \
      u[i] = (v & 0x7fffffffu) > 0x7f800000u ? nan : rounded;                                       \
    }                                                                                               \
  }                                                                                                 \
  attr void widenBf16(const uint16_t* src, float* out, int64_t n) {                                 \
    uint32_t* u = reinterpret_cast<uint32_t*>(out);                                                 \
    for (int64_t i = 0; i < n; ++i) u[i] = static_cast<uint32_t>(src[i]) << 16;                     \
  }                                                                                                 \
  /* The values are bf16 already (roundBf16 ran): the high half is the bf16. */                     \
  attr void narrowBf16(const float* x, uint16_t* dst, int64_t n) {                                  \
    const uint32_t* u = reinterpret_cast<const uint32_t*>(x);                                       \
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(u[i] >> 16);                     \
  }                                                                                                 \
  /* The loops by role, for makeLoops. */                                                          \
  struct Isa {                                                                                      \
    template <ir::ScalarFn F>                                                                       \
    static constexpr PointwiseProgram::ChunkFn kApply = &apply<F>;                                  \
    template <ir::ScalarFn D>                                                                       \
    static constexpr PointwiseProgram::ChunkFn kGradient = &gradient<D>;                            \
    static constexpr PointwiseProgram::ChunkFn kCopy = &copy;                                       \
    static constexpr void (*kRoundBf16)(float*, int64_t) = &roundBf16;                              \
    static constexpr void (*kWidenBf16)(const uint16_t*, float*, int64_t) = &widenBf16;             \
    static constexpr void (*kNarrowBf16)(const float*, uint16_t*, int64_t) = &narrowBf16;           \
  };                                                                                                \
  }

KILN_POINTWISE_LOOPS(baseline, )
KILN_POINTWISE_LOOPS(avx512, __attribute__((target("avx512f"))))
#undef KILN_POINTWISE_LOOPS

constexpr size_t kNumScalarFns = 0
#define KILN_EACH(Name, arity) +1
#include "ir/scalar_fn_each.def"
    ;

// One ISA's loops, chosen once per process by the CPU's features.
struct Loops {
  PointwiseProgram::ChunkFn apply[kNumScalarFns] = {};
  PointwiseProgram::ChunkFn gradient[kNumScalarFns] = {};
  PointwiseProgram::ChunkFn copy = nullptr;
  void (*round_bf16)(float*, int64_t) = nullptr;
  void (*widen_bf16)(const uint16_t*, float*, int64_t) = nullptr;
  void (*narrow_bf16)(const float*, uint16_t*, int64_t) = nullptr;
};

// One ISA's loops (Isa: baseline::Isa or avx512::Isa) as a table.
template <class Isa>
Loops makeLoops() {
  Loops l;
  l.copy = Isa::kCopy;
  l.round_bf16 = Isa::kRoundBf16;
  l.widen_bf16 = Isa::kWidenBf16;
  l.narrow_bf16 = Isa::kNarrowBf16;
#define KILN_UNARY(Name, ...) l.apply[static_cast<size_t>(ir::ScalarFn::Name)] = Isa::template kApply<ir::ScalarFn::Name>;
#define KILN_BINARY(Name, ...) l.apply[static_cast<size_t>(ir::ScalarFn::Name)] = Isa::template kApply<ir::ScalarFn::Name>;
#define KILN_ACTIVATION(Name, ...)                                                         \
  l.apply[static_cast<size_t>(ir::ScalarFn::Name)] = Isa::template kApply<ir::ScalarFn::Name>; \
  l.gradient[static_cast<size_t>(ir::ScalarFn::Name##Derivative)] =                          \
      Isa::template kGradient<ir::ScalarFn::Name##Derivative>;
#include "ir/scalar_fn.def"
#undef KILN_UNARY
#undef KILN_BINARY
#undef KILN_ACTIVATION
  return l;
}

const Loops& loops() {
  static const Loops l = hostCpu().avx512f ? makeLoops<avx512::Isa>() : makeLoops<baseline::Isa>();
  return l;
}

bool isFloatStorage(ir::DType t) { return t == ir::DType::f32 || t == ir::DType::bf16; }

bool allOneFloatType(const ir::Op& op) {
  const ir::DType t = op.result()->type().dtype();
  if (!isFloatStorage(t)) return false;
  for (ir::Value* v : op.operands())
    if (v->type().dtype() != t) return false;
  return true;
}

// The activation_grad's derivative function.
std::optional<ir::ScalarFn> derivativeOf(const ir::Op& op) {
  const std::optional<ir::ScalarFn> fn = ir::findScalarFn(ir::ScalarFnKind::Activation, op.strAttr("activation"));
  if (!fn) return std::nullopt;
  return ir::scalarFnInfo(*fn).partner;
}

}  // namespace

bool isPointwiseStep(const ir::Op& op) {
  if (op.numResults() != 1) return false;
  if (op.is(ir::OpCode::Cast))
    return op.numOperands() == 1 && isFloatStorage(op.operand(0)->type().dtype()) &&
           isFloatStorage(op.result()->type().dtype());
  if (op.is(ir::OpCode::ActivationGrad)) return op.numOperands() == 2 && allOneFloatType(op) && derivativeOf(op);
  if (op.is(ir::OpCode::Compare)) return false;
  const std::optional<ir::ScalarFn> fn = ir::scalarFnOf(op);
  if (!fn) return false;
  const ir::ScalarFnInfo& info = ir::scalarFnInfo(*fn);
  return info.isOp() && !info.isPredicate() && static_cast<int>(op.numOperands()) == info.arity &&
         allOneFloatType(op);
}

Expected<PointwiseProgram> PointwiseProgram::compile(const std::vector<OpRef>& ops) {
  PointwiseProgram p;
  const Loops& l = loops();
  // Slots: the inputs first, then one per step; step results are numbered after all inputs are
  // known, so collect the inputs in a first pass.
  std::vector<int> produced;  // buffer id per step
  for (const OpRef& r : ops) {
    if (!r.op || !isPointwiseStep(*r.op))
      return Status::errorf("'{}' is not a pointwise step", r.op ? r.op->name() : std::string("(null)"));
    for (int id : r.operands)
      if (std::find(produced.begin(), produced.end(), id) == produced.end() &&
          std::find(p.inputs_.begin(), p.inputs_.end(), id) == p.inputs_.end())
        p.inputs_.push_back(id);
    produced.push_back(r.result);
  }
  const int num_inputs = static_cast<int>(p.inputs_.size());
  auto slot = [&](int id, size_t before) {
    // The latest step before `before` that produced it, else the input.
    for (size_t s = before; s-- > 0;)
      if (produced[s] == id) return num_inputs + static_cast<int>(s);
    return static_cast<int>(std::find(p.inputs_.begin(), p.inputs_.end(), id) - p.inputs_.begin());
  };
  for (size_t s = 0; s < ops.size(); ++s) {
    const OpRef& r = ops[s];
    const ir::Op& op = *r.op;
    Step step;
    step.a = slot(r.operands[0], s);
    if (op.is(ir::OpCode::Cast)) {
      step.fn = l.copy;
    } else if (op.is(ir::OpCode::ActivationGrad)) {
      step.fn = l.gradient[static_cast<size_t>(*derivativeOf(op))];
      step.b = slot(r.operands[1], s);
    } else {
      const ir::ScalarFn fn = *ir::scalarFnOf(op);
      step.fn = l.apply[static_cast<size_t>(fn)];
      if (ir::arityOf(fn) == 2) step.b = slot(r.operands[1], s);
      step.broadcasts = ir::arityOf(fn) == 2;
    }
    if (!step.fn) return Status::errorf("'{}' has no pointwise loop", op.name());
    step.round_bf16 = op.result()->type().dtype() == ir::DType::bf16;
    step.result = r.result;
    step.stored = r.stored;
    p.steps_.push_back(step);
  }
  return p;
}

std::vector<int> PointwiseProgram::storedResults() const {
  std::vector<int> out;
  for (const Step& s : steps_)
    if (s.stored) out.push_back(s.result);
  return out;
}

Expected<bool> PointwiseProgram::run(std::vector<ir::TensorView>& views, ThreadPool& pool) const {
  const size_t num_inputs = inputs_.size();
  const size_t num_slots = num_inputs + steps_.size();
  auto view = [&](int id) -> ir::TensorView& { return views[static_cast<size_t>(id)]; };

  // Run-time shapes, step by step, as the op-by-op kernels would set them.
  std::vector<const std::vector<int64_t>*> shape(num_slots, nullptr);
  for (size_t i = 0; i < num_inputs; ++i) shape[i] = &view(inputs_[i]).shape;
  std::vector<std::vector<int64_t>> step_shapes(steps_.size());
  for (size_t s = 0; s < steps_.size(); ++s) {
    const Step& st = steps_[s];
    if (st.b < 0) {
      step_shapes[s] = *shape[static_cast<size_t>(st.a)];
    } else if (st.broadcasts) {
      auto r = broadcastConcrete({shape[static_cast<size_t>(st.a)], shape[static_cast<size_t>(st.b)]});
      if (!r) return r.status();
      step_shapes[s] = std::move(*r);
    } else {
      if (*shape[static_cast<size_t>(st.a)] != *shape[static_cast<size_t>(st.b)]) return false;
      step_shapes[s] = *shape[static_cast<size_t>(st.a)];
    }
    shape[num_inputs + s] = &step_shapes[s];
  }
  const std::vector<int64_t>& result_shape = step_shapes.back();
  for (const auto& s : step_shapes)
    if (s != result_shape) return false;

  // A stored result that shares storage with an input other than element for element (or with an
  // input a later step still reads) would be written before a later chunk, or a later step, reads
  // what it overwrote: it goes to the spill buffer, copied over after the pass. Two stored results
  // never share storage in a valid memory plan (both are live after the group).
  int64_t numel = 1;
  for (int64_t d : result_shape) numel *= d;
  auto range = [&](int id, int64_t elements) {
    const ir::TensorView& v = view(id);
    const auto* b = static_cast<const uint8_t*>(v.data);
    return std::make_pair(b, b + elements * ir::dtypeBytes(v.dtype));
  };
  auto overlap = [](std::pair<const uint8_t*, const uint8_t*> x, std::pair<const uint8_t*, const uint8_t*> y) {
    return x.first < y.second && y.first < x.second;
  };
  std::vector<int64_t> spill_at(steps_.size(), -1);
  int64_t spill_bytes = 0;
  for (size_t s = 0; s < steps_.size(); ++s) {
    if (!steps_[s].stored) continue;
    const ir::TensorView& out_view = view(steps_[s].result);
    const auto out = range(steps_[s].result, numel);
    bool spill = false;
    for (size_t i = 0; i < num_inputs && !spill; ++i) {
      const ir::TensorView& in = view(inputs_[i]);
      if (!overlap(out, range(inputs_[i], in.numel()))) continue;
      bool read_later = false;
      for (size_t t = s + 1; t < steps_.size(); ++t)
        read_later |= steps_[t].a == static_cast<int>(i) || steps_[t].b == static_cast<int>(i);
      spill = read_later || in.data != out_view.data || in.dtype != out_view.dtype || in.shape != result_shape;
    }
    for (size_t t = s + 1; t < steps_.size(); ++t)
      if (steps_[t].stored && overlap(out, range(steps_[t].result, numel))) return false;
    if (spill) {
      spill_at[s] = spill_bytes;
      spill_bytes += (out.second - out.first + 63) / 64 * 64;
    }
  }
  if (spill_.size() < static_cast<size_t>(spill_bytes)) spill_.resize(static_cast<size_t>(spill_bytes));

  for (const Step& st : steps_) view(st.result).shape = result_shape;
  if (numel == 0) return true;

  std::vector<const std::vector<int64_t>*> input_shapes(shape.begin(), shape.begin() + static_cast<long>(num_inputs));
  const BroadcastIter it(result_shape, input_shapes);
  const int64_t inner = it.innerSize(), outer = it.outerSize();
  const int64_t chunks_per_row = (inner + kChunk - 1) / kChunk;
  const int64_t chunk_len = std::min(inner, kChunk);
  std::vector<int64_t> inner_stride(num_inputs);
  for (size_t i = 0; i < num_inputs; ++i) inner_stride[i] = it.innerStride(i);
  const Loops& l = loops();

  // About 32K elements per task keeps the pool's scheduling small against the work.
  pool.parallelFor(outer * chunks_per_row, std::max<int64_t>(1, 32768 / chunk_len), [&](int64_t c0, int64_t c1) {
    thread_local std::vector<float> scratch;
    scratch.resize(num_slots * static_cast<size_t>(kChunk));
    std::vector<const float*> at(num_slots);
    std::vector<int64_t> offs(num_inputs);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r = c / chunks_per_row, j0 = (c % chunks_per_row) * kChunk;
      const int64_t n = std::min(kChunk, inner - j0);
      it.rowOffsets(r, offs);
      for (size_t i = 0; i < num_inputs; ++i) {
        const ir::TensorView& v = view(inputs_[i]);
        float* buf = scratch.data() + i * static_cast<size_t>(kChunk);
        const int64_t stride = inner_stride[i], start = offs[i] + j0 * stride;
        if (v.dtype == ir::DType::f32 && stride == 1) {
          at[i] = v.as<float>() + start;  // read in place
          continue;
        }
        if (stride == 1) {
          l.widen_bf16(v.as<uint16_t>() + start, buf, n);
        } else if (stride == 0) {
          const float x = v.dtype == ir::DType::f32 ? v.as<float>()[start] : ir::bf16ToFloat(v.as<uint16_t>()[start]);
          std::fill(buf, buf + n, x);
        } else {
          for (int64_t j = 0; j < n; ++j)
            buf[j] = v.dtype == ir::DType::f32 ? v.as<float>()[start + j * stride]
                                               : ir::bf16ToFloat(v.as<uint16_t>()[start + j * stride]);
        }
        at[i] = buf;
      }
      for (size_t s = 0; s < steps_.size(); ++s) {
        const Step& st = steps_[s];
        const size_t out_slot = num_inputs + s;
        const ir::DType dtype = view(st.result).dtype;
        void* dst = spill_at[s] >= 0 ? static_cast<void*>(spill_.data() + spill_at[s]) : view(st.result).data;
        const int64_t flat = r * inner + j0;
        // An f32 result that is stored is computed straight into its storage.
        float* out = st.stored && dtype == ir::DType::f32 ? static_cast<float*>(dst) + flat
                                                            : scratch.data() + out_slot * static_cast<size_t>(kChunk);
        st.fn(at[static_cast<size_t>(st.a)], st.b >= 0 ? at[static_cast<size_t>(st.b)] : nullptr, out, n);
        if (st.round_bf16) l.round_bf16(out, n);
        if (st.stored && dtype == ir::DType::bf16) l.narrow_bf16(out, static_cast<uint16_t*>(dst) + flat, n);
        at[out_slot] = out;
      }
    }
  });
  for (size_t s = 0; s < steps_.size(); ++s)
    if (spill_at[s] >= 0)
      std::memcpy(view(steps_[s].result).data, spill_.data() + spill_at[s],
                  static_cast<size_t>(numel * ir::dtypeBytes(view(steps_[s].result).dtype)));
  return true;
}

}  // namespace kiln::runtime::cpu
