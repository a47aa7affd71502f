// The scalar functions of ir/scalar_fn.def as C++: one enum (ScalarFn) that the op table, the
// CPU kernels and the kernel IR share, a description of each entry (ScalarFnInfo), and each
// body compiled for the host (namespace scalar). codegen/cuda_emitter.cc prints the same bodies
// as CUDA.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ir/random.h"

namespace kiln::ir {

// Every scalar function, in the order of scalar_fn.def. An activation is followed by its
// derivative (GeluDerivative after Gelu).
enum class ScalarFn : uint8_t {
#define KILN_EACH(Name, arity) Name,
#include "ir/scalar_fn_each.def"
};

// A reduction's combiner, in the order of scalar_fn.def's KILN_COMBINER entries.
enum class Combiner : uint8_t {
#define KILN_COMBINER(Name, ...) Name,
#include "ir/scalar_fn.def"
};

enum class ScalarFnKind : uint8_t {
  Unary,        // an op kiln.<spelling> and a language builtin
  Activation,   // a unary op with a derivative (kiln.activation_grad)
  Derivative,   // an activation's derivative; no op of its own
  Binary,       // an op kiln.<spelling>
  Compare,      // a predicate of kiln.compare; the result is i1
  KernelUnary,  // kernel IR only
  KernelBinary,
};

enum class ScalarDomain : uint8_t { Any, Float };

// How many operands f takes (1 or 2), at compile time.
constexpr int arityOf(ScalarFn f) {
  switch (f) {
#define KILN_EACH(Name, arity) \
  case ScalarFn::Name:         \
    return arity;
#include "ir/scalar_fn_each.def"
  }
  return 0;
}

// Whether f takes float operands only (at compile time, for the kernels' type dispatch).
constexpr bool isFloatOnly(ScalarFn f) {
  switch (f) {
#define KILN_UNARY(Name, spelling, flops, domain, body) \
  case ScalarFn::Name:                                  \
    return ScalarDomain::domain == ScalarDomain::Float;
#define KILN_ACTIVATION(Name, ...) \
  case ScalarFn::Name:             \
  case ScalarFn::Name##Derivative: \
    return true;
#define KILN_BINARY(Name, spelling, flops, domain, commutative, body) \
  case ScalarFn::Name:                                                \
    return ScalarDomain::domain == ScalarDomain::Float;
#include "ir/scalar_fn.def"
    default:
      return false;
  }
}

struct ScalarFnInfo {
  ScalarFn fn;
  std::string_view name;      // as in C++ and CUDA: "Gelu", "GeluDerivative"
  std::string_view spelling;  // "gelu"; a derivative: "gelu_derivative"
  ScalarFnKind kind;
  int arity;  // 1 or 2
  ScalarDomain domain = ScalarDomain::Any;
  int flops = 1;  // per element, for the cost model
  bool commutative = false;
  std::string_view body;  // the C++/CUDA body of scalar_fn.def, over x (or a and b)
  // An activation's derivative; a derivative's activation.
  std::optional<ScalarFn> partner;

  // Whether the function is an op of the op table (kiln.<spelling>) of its own.
  bool isOp() const {
    return kind == ScalarFnKind::Unary || kind == ScalarFnKind::Activation || kind == ScalarFnKind::Binary;
  }
  // Whether the result is i1 (comparisons and logic).
  bool isPredicate() const;
};

// Every function, in table order; scalarFnInfo(f) is scalarFns()[f].
const std::vector<ScalarFnInfo>& scalarFns();
const ScalarFnInfo& scalarFnInfo(ScalarFn f);
// By spelling within a kind ("gelu" among activations, "lt" among comparisons).
std::optional<ScalarFn> findScalarFn(ScalarFnKind kind, std::string_view spelling);

struct CombinerInfo {
  Combiner combiner;
  std::string_view name;      // "Sum"
  std::string_view spelling;  // "sum"
  ScalarFn combine;           // the binary function that folds
  std::string_view identity;  // the body giving the fold's starting value
};
const CombinerInfo& combinerInfo(Combiner c);
const std::vector<CombinerInfo>& combiners();

namespace scalar {

// The primitives the bodies are written in. Float arguments use the C library's functions (no
// fast-math approximations); an integer quotient or remainder by zero is zero, never a trap.
// exp, log, log1p, sqrt, tanh: the C library's, for float and double.
#define KILN_LIBM_PRIMITIVE(fn) \
  template <class T>            \
  T fn(T x) {                   \
    return std::fn(x);          \
  }
KILN_LIBM_PRIMITIVE(exp)
KILN_LIBM_PRIMITIVE(log)
KILN_LIBM_PRIMITIVE(log1p)
KILN_LIBM_PRIMITIVE(sqrt)
KILN_LIBM_PRIMITIVE(tanh)
#undef KILN_LIBM_PRIMITIVE
template <class T>
T pow(T a, T b) {
  if constexpr (std::is_floating_point_v<T>)
    return std::pow(a, b);
  else
    return static_cast<T>(std::pow(static_cast<double>(a), static_cast<double>(b)));
}
template <class T>
T abs(T x) {
  if constexpr (std::is_floating_point_v<T>)
    return std::fabs(x);
  else
    return x < 0 ? -x : x;
}
// fmax and fmin for floats: a NaN operand gives the other one.
template <class T>
T max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>)
    return std::fmax(a, b);
  else
    return a > b ? a : b;
}
template <class T>
T min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>)
    return std::fmin(a, b);
  else
    return a < b ? a : b;
}
template <class T>
T quotient(T a, T b) {
  if constexpr (std::is_floating_point_v<T>)
    return a / b;
  else
    return b ? a / b : T(0);
}
template <class T>
T rem(T a, T b) {
  if constexpr (std::is_floating_point_v<T>)
    return std::fmod(a, b);
  else
    return b ? a % b : T(0);
}
// The hashing primitives of HashMix and CounterBits (ir/random.h), meaningful over i64; other
// types go through i64 (kernels use them on i64 alone).
template <class T>
T hash_mix(T a, T b) {
  return static_cast<T>(static_cast<int64_t>(splitMix64(static_cast<uint64_t>(static_cast<int64_t>(a)) ^
                                                        static_cast<uint64_t>(static_cast<int64_t>(b)))));
}
template <class T>
T counter_bits(T stream, T index) {
  const uint64_t z = static_cast<uint64_t>(static_cast<int64_t>(stream)) +
                     0x9e3779b97f4a7c15ull * static_cast<uint64_t>(static_cast<int64_t>(index));
  return static_cast<T>(static_cast<int64_t>(splitMix64(z) >> 11));
}
// The smallest value of T: -infinity for floats.
template <class T>
T lowest() {
  if constexpr (std::numeric_limits<T>::has_infinity)
    return -std::numeric_limits<T>::infinity();
  else
    return std::numeric_limits<T>::lowest();
}

// The functions of scalar_fn.def, by Name: scalar::Gelu(x), scalar::GeluDerivative(x),
// scalar::Lt(a, b) (a bool).
#define KILN_UNARY(Name, spelling, flops, domain, body) \
  template <class T>                                    \
  T Name(T x) {                                         \
    body                                                \
  }
#define KILN_ACTIVATION(Name, spelling, flops, body, derivative) \
  template <class T>                                             \
  T Name(T x) {                                                  \
    body                                                         \
  }                                                              \
  template <class T>                                             \
  T Name##Derivative(T x) {                                      \
    derivative                                                   \
  }
#define KILN_BINARY(Name, spelling, flops, domain, commutative, body) \
  template <class T>                                                  \
  T Name(T a, T b) {                                                  \
    body                                                              \
  }
#define KILN_COMPARE(Name, spelling, body) \
  template <class T>                       \
  bool Name(T a, T b) {                    \
    body                                   \
  }
#define KILN_KERNEL_UNARY(Name, spelling, body) \
  template <class T>                            \
  T Name(T x) {                                 \
    body                                        \
  }
#define KILN_KERNEL_BINARY(Name, spelling, body) \
  template <class T>                             \
  T Name(T a, T b) {                             \
    body                                         \
  }
#include "ir/scalar_fn.def"

namespace detail {
template <class T>
T call(T (*f)(T), T a, T) { return f(a); }
template <class T>
T call(T (*f)(T, T), T a, T b) { return f(a, b); }
template <class T>
T call(bool (*f)(T, T), T a, T b) { return static_cast<T>(f(a, b)); }
}  // namespace detail

// F applied to a (and b for a binary function), chosen at compile time: the CPU kernels' loops.
// A predicate gives 1 or 0.
template <ScalarFn F, class T>
T apply(T a, [[maybe_unused]] T b = T()) {
#define KILN_EACH(Name, arity) \
  if constexpr (F == ScalarFn::Name) return detail::call<T>(&Name<T>, a, b);
#include "ir/scalar_fn_each.def"
}

// f applied at run time: constant folding and the kernel IR's interpreter.
template <class T>
T evaluate(ScalarFn f, T a, T b = T()) {
  switch (f) {
#define KILN_EACH(Name, arity) \
  case ScalarFn::Name: return apply<ScalarFn::Name, T>(a, b);
#include "ir/scalar_fn_each.def"
  }
  return T();
}

// f as a function pointer over T, for loops that choose the function once at run time.
template <class T>
using UnaryFnPtr = T (*)(T);
template <class T>
UnaryFnPtr<T> unaryFnPtr(ScalarFn f) {
  switch (f) {
#define KILN_EACH(Name, arity) \
  case ScalarFn::Name:         \
    if constexpr (arity == 1) return &Name<T>; else return nullptr;
#include "ir/scalar_fn_each.def"
  }
  return nullptr;
}

// A combiner's fold function, at compile time.
template <Combiner C>
constexpr ScalarFn combineFn() {
#define KILN_COMBINER(Name, spelling, combine, body) \
  if constexpr (C == Combiner::Name) return ScalarFn::combine;
#include "ir/scalar_fn.def"
}

// A combiner's fold step and starting value.
template <Combiner C, class T>
T fold(T acc, T x) {
  return apply<combineFn<C>(), T>(acc, x);
}
template <class T>
T combine(Combiner c, T acc, T x) {
  return evaluate<T>(combinerInfo(c).combine, acc, x);
}
template <class T>
T identity(Combiner c) {
  switch (c) {
#define KILN_COMBINER(Name, spelling, combine, body) \
  case Combiner::Name:                               \
    return [] { body }();
#include "ir/scalar_fn.def"
  }
  return T();
}

}  // namespace scalar
}  // namespace kiln::ir
