// Data kernels: constants, reshapes (free when the planner put the result over its operand)
// and casts between the float storage types.
#include <algorithm>
#include <cstring>

#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

template <typename T>
void fillFromAttr(const ir::Attribute& v, T* out, int64_t n) {
  if (v.isArray()) {
    const auto& a = v.asArray();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[static_cast<size_t>(i)].asDouble());
  } else {
    std::fill(out, out + n, static_cast<T>(v.asDouble()));
  }
}

Status runConstant(const ir::Op& op, const std::vector<const ir::TensorView*>&,
                   const std::vector<ir::TensorView*>& out, const KernelContext&) {
  const ir::Attribute* v = op.attr("value");
  if (!v) return Status::error("'kiln.constant' has no value");
  ir::TensorView& y = *out[0];
  int64_t n = y.numel();
  if (v->isArray() && static_cast<int64_t>(v->asArray().size()) != n)
    return Status::errorf("'kiln.constant' has {} values for {} elements", v->asArray().size(), n);
  switch (y.dtype) {
    case ir::DType::f32: fillFromAttr(*v, y.as<float>(), n); break;
    case ir::DType::f64: fillFromAttr(*v, y.as<double>(), n); break;
    case ir::DType::i32: fillFromAttr(*v, y.as<int32_t>(), n); break;
    case ir::DType::i64: fillFromAttr(*v, y.as<int64_t>(), n); break;
    case ir::DType::i1: {
      auto* p = y.as<uint8_t>();
      for (int64_t i = 0; i < n; ++i)
        p[i] = (v->isArray() ? v->asArray()[static_cast<size_t>(i)].asDouble() : v->asDouble()) != 0;
      break;
    }
    case ir::DType::bf16:
      for (int64_t i = 0; i < n; ++i)
        storeF(y.data, y.dtype, i,
               static_cast<float>(v->isArray() ? v->asArray()[static_cast<size_t>(i)].asDouble() : v->asDouble()));
      break;
    default: return Status::errorf("'kiln.constant': no kernel for {}", ir::dtypeName(y.dtype));
  }
  return Status::ok();
}

bool supportsConstant(const ir::Op& op) {
  ir::DType t = op.result()->type().dtype();
  return t != ir::DType::f16 && t != ir::DType::f8e4m3 && t != ir::DType::f8e5m2;
}

// The result's dims: static and symbolic from its type, one bounded dim from the element count.
Status runReshape(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                  const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  const ir::TensorView& x = *in[0];
  ir::TensorView& y = *out[0];
  const ir::TensorType& t = op.result()->type();
  std::vector<int64_t> shape;
  int64_t known = 1, unknown_at = -1;
  for (int64_t i = 0; i < t.rank(); ++i) {
    const ir::Dim& d = t.dim(i);
    if (d.isBounded()) {
      if (unknown_at >= 0) return Status::error("'kiln.reshape' to a type with two data-dependent dims is ambiguous");
      unknown_at = i;
      shape.push_back(0);
      continue;
    }
    auto v = d.evaluate(ctx.symbols ? *ctx.symbols : ir::SymbolBindings{});
    if (!v) return Status::errorf("'kiln.reshape': symbol '{}' is not bound", d.sym());
    shape.push_back(*v);
    known *= *v;
  }
  if (unknown_at >= 0) {
    if (known == 0 || x.numel() % known != 0)
      return Status::errorf("'kiln.reshape' cannot fit {} elements into {}", x.numel(), t.str());
    shape[static_cast<size_t>(unknown_at)] = x.numel() / known;
  } else if (known != x.numel()) {
    return Status::errorf("'kiln.reshape' has {} elements at run time, {} needs {}", x.numel(), t.str(), known);
  }
  y.shape = shape;
  if (y.data != x.data) std::memcpy(y.data, x.data, static_cast<size_t>(x.bytes()));
  return Status::ok();
}

bool floatStorage(ir::DType t) { return t == ir::DType::f32 || t == ir::DType::bf16 || t == ir::DType::f64; }

Status runCast(const ir::Op&, const std::vector<const ir::TensorView*>& in, const std::vector<ir::TensorView*>& out,
               const KernelContext& ctx) {
  const ir::TensorView& x = *in[0];
  ir::TensorView& y = *out[0];
  y.shape = x.shape;
  if (x.dtype == ir::DType::f64 || y.dtype == ir::DType::f64) {
    for (int64_t i = 0, n = x.numel(); i < n; ++i) {
      double v = x.dtype == ir::DType::f64 ? x.as<double>()[i] : loadF(x.data, x.dtype, i);
      if (y.dtype == ir::DType::f64) y.as<double>()[i] = v;
      else storeF(y.data, y.dtype, i, static_cast<float>(v));
    }
    return Status::ok();
  }
  // Mixed precision's casts, typed so that the loops vectorize: the rounding of ir::floatToBf16
  // without its branch (a NaN keeps its sign and payload, quieted).
  if (x.dtype == ir::DType::f32 && y.dtype == ir::DType::bf16) {
    const uint32_t* px = static_cast<const uint32_t*>(x.data);
    uint16_t* py = y.as<uint16_t>();
    ctx.pool->parallelFor(x.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const uint32_t u = px[i];
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        py[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
      }
    });
    return Status::ok();
  }
  if (x.dtype == ir::DType::bf16 && y.dtype == ir::DType::f32) {
    const uint16_t* px = x.as<uint16_t>();
    uint32_t* py = static_cast<uint32_t*>(y.data);
    ctx.pool->parallelFor(x.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) py[i] = static_cast<uint32_t>(px[i]) << 16;
    });
    return Status::ok();
  }
  ctx.pool->parallelFor(x.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) storeF(y.data, y.dtype, i, loadF(x.data, x.dtype, i));
  });
  return Status::ok();
}

bool supportsCast(const ir::Op& op) {
  return floatStorage(op.operand(0)->type().dtype()) && floatStorage(op.result()->type().dtype());
}

// kiln.slice and kiln.pad: one contiguous block per outer index, threaded over outer indices
// (the same copies as the references, which run them one after another).
int64_t product(const std::vector<int64_t>& s, size_t b, size_t e) {
  int64_t p = 1;
  for (size_t i = b; i < e; ++i) p *= s[i];
  return p;
}

Status runSliceOrPad(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                     const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  const ir::TensorView& x = *in[0];
  ir::TensorView& r = *out[0];
  int64_t axis = op.intAttr("axis");
  if (axis < 0) axis += static_cast<int64_t>(x.shape.size());
  if (axis < 0 || axis >= static_cast<int64_t>(x.shape.size()))
    return Status::errorf("'{}': axis out of range", op.name());
  const auto a = static_cast<size_t>(axis);
  const bool slice = op.is(ir::OpCode::Slice);
  // Per outer index: `n` rows of `inner_bytes` copied from x at `from` to r at `to`.
  int64_t n, from = 0, to = 0;
  r.shape = x.shape;
  if (slice) {
    const int64_t start = op.intAttr("start"), limit = op.intAttr("limit");
    if (start < 0 || limit > x.shape[a] || start > limit)
      return Status::errorf("'{}': bounds out of range", op.name());
    n = limit - start;
    from = start;
    r.shape[a] = n;
  } else {
    const int64_t low = op.intAttr("low"), high = op.intAttr("high");
    n = x.shape[a];
    to = low;
    r.shape[a] = n + low + high;
  }
  const int64_t outer = product(x.shape, 0, a);
  const int64_t inner_bytes = product(x.shape, a + 1, x.shape.size()) * ir::dtypeBytes(x.dtype);
  const int64_t x_rows = x.shape[a], r_rows = r.shape[a];
  const auto* px = static_cast<const unsigned char*>(x.data);
  auto* pr = static_cast<unsigned char*>(r.data);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, r_rows * inner_bytes));
  ctx.pool->parallelFor(outer, grain, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      unsigned char* dst = pr + o * r_rows * inner_bytes;
      if (!slice) std::memset(dst, 0, static_cast<size_t>(r_rows * inner_bytes));  // all-zero bits are 0
      std::memcpy(dst + to * inner_bytes, px + (o * x_rows + from) * inner_bytes,
                  static_cast<size_t>(n * inner_bytes));
    }
  });
  return Status::ok();
}

}  // namespace

void registerDataKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::Constant, {"constant", runConstant, supportsConstant});
  addKernel(t, ir::OpCode::Reshape, {"reshape", runReshape, [](const ir::Op&) { return true; }});
  addKernel(t, ir::OpCode::Cast, {"cast", runCast, supportsCast});
  addKernel(t, ir::OpCode::Slice, {"slice", runSliceOrPad, [](const ir::Op&) { return true; }});
  addKernel(t, ir::OpCode::Pad, {"pad", runSliceOrPad, [](const ir::Op&) { return true; }});
}

}  // namespace kiln::runtime::cpu
