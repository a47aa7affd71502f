// Element types, dimensions, shapes and tensor types.
//
// A dimension is one of
//   - static:   a known size, e.g. 128;
//   - symbolic: a named size fixed per compilation or per run, times a constant factor: `B`,
//               `26*B` (the batch of a model is `B`, tokens are `T`);
//   - bounded:  a size known only at run time, with an upper bound that is static or
//               symbolic: `?(4096)`, `?(214*B)` (multi-hot ids, tokens routed to one expert).
// Text form inside `!kiln.tensor<...>`: dims joined by `x`, then the dtype:
//   !kiln.tensor<Bx13xf32>   !kiln.tensor<?(214*B)xi64>   !kiln.tensor<f32> (a scalar)
// An optional sharding follows the dtype: `!kiln.tensor<1000000x128xf32, shard<8x1>>` says
// dim 0 is split into 8 shards across ranks and dim 1 is whole.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"

namespace kiln::ir {

// f64 is for reference computations (finite-difference gradient checks); models use the rest.
enum class DType : uint8_t { f32, f16, bf16, f8e4m3, f8e5m2, i32, i64, i1, f64 };

std::string_view dtypeName(DType t);
std::optional<DType> parseDType(std::string_view name);
int64_t dtypeBytes(DType t);  // i1 is stored as one byte
bool isFloat(DType t);
bool isInteger(DType t);  // i32, i64 (not i1)

// Values of the symbols of a compilation or a run, e.g. {"B": 16384}.
using SymbolBindings = std::map<std::string, int64_t, std::less<>>;

class Dim {
 public:
  enum class Kind : uint8_t { Static, Symbolic, Bounded };

  Dim() = default;
  static Dim fixed(int64_t size) { return Dim(Kind::Static, size, ""); }
  static Dim symbol(std::string name, int64_t factor = 1) {
    return Dim(Kind::Symbolic, factor, std::move(name));
  }
  // A run-time size at most `bound` (which must not itself be bounded).
  static Dim bounded(const Dim& bound) { return Dim(Kind::Bounded, bound.factor_, bound.sym_); }

  Kind kind() const { return kind_; }
  bool isStatic() const { return kind_ == Kind::Static; }
  bool isSymbolic() const { return kind_ == Kind::Symbolic; }
  bool isBounded() const { return kind_ == Kind::Bounded; }
  // Static size; only for static dims.
  int64_t size() const { return factor_; }
  // factor * symbol (or factor alone when there is no symbol).
  int64_t factor() const { return factor_; }
  const std::string& sym() const { return sym_; }
  // The bound of a bounded dim, the dim itself otherwise.
  Dim upperBound() const;
  // Scales a static or symbolic dim by k (e.g. B -> 26*B). Bounded dims scale their bound.
  Dim times(int64_t k) const { return Dim(kind_, factor_ * k, sym_); }

  // Size under `bindings` (bounded dims evaluate their bound); nullopt if a symbol is unbound or
  // factor * value overflows int64.
  std::optional<int64_t> evaluate(const SymbolBindings& bindings) const;

  std::string str() const;
  bool operator==(const Dim& o) const = default;

 private:
  Dim(Kind k, int64_t f, std::string s) : kind_(k), factor_(f), sym_(std::move(s)) {}
  Kind kind_ = Kind::Static;
  int64_t factor_ = 1;
  std::string sym_;
};

// Symbol names are upper case: [A-Z][A-Z0-9_]* (so the `x` separator is never ambiguous).
bool isSymbolName(std::string_view s);

using Shape = std::vector<Dim>;
std::string shapeStr(const Shape& s);  // "Bx13" ("" for a scalar)

// A tensor dimension's split across ranks; shards[i] == 1 means dim i is whole on each rank.
struct Sharding {
  std::vector<int64_t> shards;
  bool operator==(const Sharding& o) const = default;
};

class TensorType {
 public:
  TensorType() = default;
  TensorType(DType dtype, Shape shape, std::optional<Sharding> sharding = std::nullopt)
      : dtype_(dtype), shape_(std::move(shape)), sharding_(std::move(sharding)) {}

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  const Dim& dim(int64_t i) const { return shape_[static_cast<size_t>(i)]; }
  const std::optional<Sharding>& sharding() const { return sharding_; }

  TensorType withDType(DType t) const { return TensorType(t, shape_, sharding_); }
  TensorType withShape(Shape s) const { return TensorType(dtype_, std::move(s), std::nullopt); }
  TensorType withSharding(std::optional<Sharding> s) const { return TensorType(dtype_, shape_, std::move(s)); }

  bool isStatic() const;  // every dim static
  bool hasBoundedDims() const;
  // Element count under bindings, bounded dims at their bound; nullopt if a symbol is unbound or
  // the count does not fit in int64 (never a wrapped value).
  std::optional<int64_t> numElements(const SymbolBindings& bindings) const;
  std::optional<int64_t> bytes(const SymbolBindings& bindings) const;
  // The same, with an error that says which: "symbol 'B' of T is not bound" or "T holds more than
  // 2^63-1 bytes at B=..." (for sizes from user flags, e.g. --batch or --set rows_cap=...).
  Expected<int64_t> checkedNumElements(const SymbolBindings& bindings) const;
  Expected<int64_t> checkedBytes(const SymbolBindings& bindings) const;

  // "!kiln.tensor<Bx13xf32>"
  std::string str() const;
  bool operator==(const TensorType& o) const = default;

 private:
  DType dtype_ = DType::f32;
  Shape shape_;
  std::optional<Sharding> sharding_;
};

// Parses the body between `!kiln.tensor<` and `>` (e.g. "Bx13xf32, shard<8x1>").
Expected<TensorType> parseTensorTypeBody(std::string_view body);

// Numpy-style broadcast of two shapes; an error names both shapes.
Expected<Shape> broadcastShapes(const Shape& a, const Shape& b);

// The product of the dims as a canonical (factor, sorted symbols) pair, so that reshapes that
// preserve element count can be checked symbolically. Bounded dims make the product unknown.
struct SymbolicProduct {
  int64_t factor = 1;
  std::vector<std::string> symbols;  // sorted
  bool known = true;
  bool overflow = false;  // the static factor does not fit in int64 (`factor` is then meaningless)
  bool operator==(const SymbolicProduct& o) const = default;
};
SymbolicProduct symbolicProduct(const Shape& s);

}  // namespace kiln::ir
