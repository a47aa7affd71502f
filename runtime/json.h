// A small JSON reader and writer for the files the runtime writes and reads back: safetensors
// headers and metrics lines. Objects keep their key order; numbers keep integers exact.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ir/status.h"

namespace kiln::json {

class Value {
 public:
  enum class Kind : uint8_t { Null, Bool, Int, Double, String, Array, Object };
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : kind_(Kind::Bool), b_(b) {}
  Value(int v) : kind_(Kind::Int), i_(v) {}
  Value(int64_t v) : kind_(Kind::Int), i_(v) {}
  Value(double v) : kind_(Kind::Double), d_(v) {}
  Value(const char* s) : kind_(Kind::String), s_(s) {}
  Value(std::string s) : kind_(Kind::String), s_(std::move(s)) {}
  Value(Array a) : kind_(Kind::Array), a_(std::move(a)) {}
  Value(Object o) : kind_(Kind::Object), o_(std::move(o)) {}
  static Value object() { return Value(Object{}); }

  Kind kind() const { return kind_; }
  bool isNull() const { return kind_ == Kind::Null; }
  bool isBool() const { return kind_ == Kind::Bool; }
  bool isInt() const { return kind_ == Kind::Int; }
  bool isNumber() const { return kind_ == Kind::Int || kind_ == Kind::Double; }
  bool isString() const { return kind_ == Kind::String; }
  bool isArray() const { return kind_ == Kind::Array; }
  bool isObject() const { return kind_ == Kind::Object; }

  bool asBool() const { return b_; }
  int64_t asInt() const { return i_; }
  double asDouble() const { return kind_ == Kind::Int ? static_cast<double>(i_) : d_; }
  const std::string& asString() const { return s_; }
  const Array& asArray() const { return a_; }
  const Object& asObject() const { return o_; }
  Array& mutableArray() { return a_; }

  // Object member by key, or nullptr.
  const Value* find(std::string_view key) const;
  // Appends (or replaces) an object member.
  Value& set(std::string key, Value v);

  // Compact text: {"a":1,"b":[true,null]}. Non-finite doubles are written as null.
  std::string dump() const;

 private:
  void dumpTo(std::string& out) const;
  Kind kind_ = Kind::Null;
  bool b_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::string s_;
  Array a_;
  Object o_;
};

// Parses a whole document; errors give the byte offset ("at byte 17: expected ':'").
Expected<Value> parse(std::string_view text);
// A JSON string literal with escapes.
std::string quote(std::string_view s);

}  // namespace kiln::json
