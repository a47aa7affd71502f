// Op and function attributes: the values of MLIR's attribute dictionary that Kiln uses.
// Text forms (MLIR generic syntax): `true`, `42 : i64` printed as `42`, `1.5e-02`, `"relu"`,
// `[1, 2]`, `{lr = 1.0e-02, name = "adagrad"}`, and type attributes `!kiln.tensor<...>`.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "ir/types.h"

namespace kiln::ir {

class Attribute;
using AttrArray = std::vector<Attribute>;
// Sorted by key, as MLIR prints dictionaries.
using AttrDict = std::map<std::string, Attribute, std::less<>>;

class Attribute {
 public:
  enum class Kind : uint8_t { Bool, Int, Float, String, Array, Dict, Type };

  Attribute() : v_(false) {}
  Attribute(bool b) : v_(b) {}
  Attribute(int v) : v_(static_cast<int64_t>(v)) {}
  Attribute(int64_t v) : v_(v) {}
  Attribute(double v) : v_(v) {}
  Attribute(const char* s) : v_(std::string(s)) {}
  Attribute(std::string s) : v_(std::move(s)) {}
  Attribute(AttrArray a) : v_(std::make_shared<AttrArray>(std::move(a))) {}
  Attribute(AttrDict d) : v_(std::make_shared<AttrDict>(std::move(d))) {}
  Attribute(TensorType t) : v_(std::move(t)) {}
  static Attribute ints(const std::vector<int64_t>& v);

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool isBool() const { return kind() == Kind::Bool; }
  bool isInt() const { return kind() == Kind::Int; }
  bool isFloat() const { return kind() == Kind::Float; }
  bool isNumber() const { return isInt() || isFloat(); }
  bool isString() const { return kind() == Kind::String; }
  bool isArray() const { return kind() == Kind::Array; }
  bool isDict() const { return kind() == Kind::Dict; }
  bool isType() const { return kind() == Kind::Type; }

  bool asBool() const { return std::get<bool>(v_); }
  int64_t asInt() const { return std::get<int64_t>(v_); }
  // Ints convert to double too.
  double asDouble() const { return isInt() ? static_cast<double>(asInt()) : std::get<double>(v_); }
  const std::string& asString() const { return std::get<std::string>(v_); }
  const AttrArray& asArray() const { return *std::get<std::shared_ptr<AttrArray>>(v_); }
  const AttrDict& asDict() const { return *std::get<std::shared_ptr<AttrDict>>(v_); }
  const TensorType& asType() const { return std::get<TensorType>(v_); }
  // An array of ints as a vector (empty if this is not an int array).
  std::vector<int64_t> asInts() const;
  std::vector<double> asDoubles() const;

  // MLIR generic text form.
  std::string str() const;
  bool operator==(const Attribute& o) const;
  bool operator!=(const Attribute& o) const { return !(*this == o); }

 private:
  std::variant<bool, int64_t, double, std::string, std::shared_ptr<AttrArray>,
               std::shared_ptr<AttrDict>, TensorType>
      v_;
};

// Floats print so that they read back to the same double and always carry a '.', which MLIR's
// lexer needs to see a float: 1.0, 1.0e-05, -2.5.
std::string formatFloat(double v);
// MLIR string literal with escapes.
std::string quoteString(const std::string& s);
// An attribute dictionary `{a = 1, b = "x"}`; "" when empty.
std::string attrDictStr(const AttrDict& d);
// Keys are bare identifiers when they can be, else quoted.
std::string attrKeyStr(const std::string& k);

}  // namespace kiln::ir
