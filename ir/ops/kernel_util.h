// Shared helpers for the CPU reference kernels and costs of the op table (ir/ops/*.cc).
//
// Kernels are written once as templates over an element "tag" that says how an element is
// stored and in which type it is computed: f32 and f64 compute in their own type, bf16 is
// stored as 16 bits and computed in f32, integers in their own type. Accumulations (sums,
// dot products) run in `Acc` (double for floats) so the reference is as accurate as it can be.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ir/op_def.h"
#include "ir/tensor_view.h"

namespace kiln::ir::kernels {

struct F32 {
  using Storage = float;
  using Compute = float;
  using Acc = double;
  static Compute load(Storage v) { return v; }
  static Storage store(double c) { return static_cast<float>(c); }
};
struct F64 {
  using Storage = double;
  using Compute = double;
  using Acc = double;
  static Compute load(Storage v) { return v; }
  static Storage store(double c) { return c; }
};
struct BF16 {
  using Storage = uint16_t;
  using Compute = float;
  using Acc = double;
  static Compute load(Storage v) { return bf16ToFloat(v); }
  static Storage store(double c) { return floatToBf16(static_cast<float>(c)); }
};
struct I32 {
  using Storage = int32_t;
  using Compute = int32_t;
  using Acc = int64_t;
  static Compute load(Storage v) { return v; }
  static Storage store(int64_t c) { return static_cast<int32_t>(c); }
};
struct I64 {
  using Storage = int64_t;
  using Compute = int64_t;
  using Acc = int64_t;
  static Compute load(Storage v) { return v; }
  static Storage store(int64_t c) { return c; }
};
struct I1 {
  using Storage = uint8_t;
  using Compute = int64_t;
  using Acc = int64_t;
  static Compute load(Storage v) { return v != 0; }
  static Storage store(int64_t c) { return c != 0; }
};

inline Status unsupportedDType(const Op& op, DType t) {
  return Status::errorf("'{}' has no CPU kernel for element type {}", op.name(), dtypeName(t));
}

// Calls fn(Tag{}) for a floating-point dtype with a CPU kernel (f32, f64, bf16).
template <class Fn>
Status visitFloat(const Op& op, DType t, Fn&& fn) {
  switch (t) {
    case DType::f32:
      return fn(F32{});
    case DType::f64:
      return fn(F64{});
    case DType::bf16:
      return fn(BF16{});
    default:
      return unsupportedDType(op, t);
  }
}
// Floats and the integer types i32, i64.
template <class Fn>
Status visitNumeric(const Op& op, DType t, Fn&& fn) {
  switch (t) {
    case DType::i32:
      return fn(I32{});
    case DType::i64:
      return fn(I64{});
    default:
      return visitFloat(op, t, std::forward<Fn>(fn));
  }
}
// Numeric types and i1.
template <class Fn>
Status visitAny(const Op& op, DType t, Fn&& fn) {
  if (t == DType::i1) return fn(I1{});
  return visitNumeric(op, t, std::forward<Fn>(fn));
}

template <class Tag>
typename Tag::Storage* data(const TensorView& v) {
  return static_cast<typename Tag::Storage*>(v.data);
}

// Element i of any numeric tensor as a double (slow; for small side inputs such as weights).
double loadAsDouble(const TensorView& v, int64_t i);
// Element i of an integer tensor (ids, lengths, class labels).
inline int64_t loadIndex(const TensorView& v, int64_t i) {
  return v.dtype == DType::i32 ? static_cast<const int32_t*>(v.data)[i]
                               : static_cast<const int64_t*>(v.data)[i];
}

inline std::vector<int64_t> rowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i)
    s[static_cast<size_t>(i)] = s[static_cast<size_t>(i) + 1] * shape[static_cast<size_t>(i) + 1];
  return s;
}

// Strides that read `in` (a shape broadcastable to `out`, aligned on the right) while walking
// `out`: 0 along broadcast dims.
std::vector<int64_t> broadcastStrides(const std::vector<int64_t>& in, const std::vector<int64_t>& out);

// Numpy broadcast of run-time shapes; an error names the op and both shapes.
Expected<std::vector<int64_t>> broadcastRuntime(const Op& op, const std::vector<int64_t>& a,
                                                const std::vector<int64_t>& b);

// Sets a result's run-time shape; it may only shrink the buffer the caller allocated.
Status setResultShape(const Op& op, TensorView& result, std::vector<int64_t> shape);

std::string shapeString(const std::vector<int64_t>& shape);  // "[2, 3]"
// "[1, 2]": the multi-index of linear position i in shape.
std::string indexString(const std::vector<int64_t>& shape, int64_t i);

// Walks every index of `shape` in row-major order and calls fn(linear, offsets) where
// offsets[k] is the element offset of operand k under strides[k].
template <size_t N, class Fn>
void forEachIndex(const std::vector<int64_t>& shape, const std::array<std::vector<int64_t>, N>& strides,
                  Fn&& fn) {
  const int64_t rank = static_cast<int64_t>(shape.size());
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (numel == 0) return;
  const int64_t inner = rank ? shape.back() : 1;
  std::array<int64_t, N> inner_stride{};
  for (size_t k = 0; k < N; ++k) inner_stride[k] = rank ? strides[k].back() : 0;
  std::vector<int64_t> idx(static_cast<size_t>(rank), 0);
  std::array<int64_t, N> base{}, off{};
  for (int64_t o = 0; o < numel; o += inner) {
    for (int64_t j = 0; j < inner; ++j) {
      for (size_t k = 0; k < N; ++k) off[k] = base[k] + j * inner_stride[k];
      fn(o + j, off);
    }
    for (int64_t d = rank - 2; d >= 0; --d) {
      const size_t du = static_cast<size_t>(d);
      ++idx[du];
      for (size_t k = 0; k < N; ++k) base[k] += strides[k][du];
      if (idx[du] < shape[du]) break;
      for (size_t k = 0; k < N; ++k) base[k] -= strides[k][du] * shape[du];
      idx[du] = 0;
    }
  }
}

// ---- Costs ------------------------------------------------------------------------------------

// Bytes of a type under bindings, bounded dims at their bound; 0 if a symbol is unbound.
double typeBytes(const TensorType& t, const SymbolBindings& symbols);
double typeElements(const TensorType& t, const SymbolBindings& symbols);
// Bytes read (every operand once) plus bytes written (every result).
double operandAndResultBytes(const Op& op, const SymbolBindings& symbols);
// flops_per_element per result element; bytes of all operands and results.
OpCost elementwiseCost(const Op& op, const SymbolBindings& symbols, double flops_per_element);

}  // namespace kiln::ir::kernels
