#include "ir/attribute.h"

#include <cmath>
#include <cstdio>

namespace kiln::ir {

Attribute Attribute::ints(const std::vector<int64_t>& v) {
  AttrArray a;
  a.reserve(v.size());
  for (int64_t x : v) a.emplace_back(x);
  return Attribute(std::move(a));
}

std::vector<int64_t> Attribute::asInts() const {
  std::vector<int64_t> out;
  if (!isArray()) return out;
  for (const auto& a : asArray())
    if (a.isInt()) out.push_back(a.asInt());
  return out;
}

std::vector<double> Attribute::asDoubles() const {
  std::vector<double> out;
  if (!isArray()) return out;
  for (const auto& a : asArray())
    if (a.isNumber()) out.push_back(a.asDouble());
  return out;
}

std::string formatFloat(double v) {
  if (std::isnan(v)) return "0x7FF8000000000000";
  if (std::isinf(v)) return v > 0 ? "0x7FF0000000000000" : "0xFFF0000000000000";
  // Shortest representation that reads back exactly.
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  size_t e = s.find_first_of("eE");
  std::string mant = e == std::string::npos ? s : s.substr(0, e);
  std::string exp = e == std::string::npos ? "" : s.substr(e);
  if (mant.find('.') == std::string::npos) mant += ".0";
  return mant + exp;
}

std::string quoteString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      out += fmt::format("\\{:02X}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string attrKeyStr(const std::string& k) {
  bool bare = !k.empty() && (std::isalpha(static_cast<unsigned char>(k[0])) || k[0] == '_');
  for (char c : k)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '$')) bare = false;
  return bare ? k : quoteString(k);
}

std::string attrDictStr(const AttrDict& d) {
  if (d.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : d) {
    if (!first) out += ", ";
    first = false;
    out += attrKeyStr(k);
    // MLIR prints a true unit-like boolean as `key = true`; keep the explicit form.
    out += " = " + v.str();
  }
  return out + "}";
}

std::string Attribute::str() const {
  switch (kind()) {
    case Kind::Bool:
      return asBool() ? "true" : "false";
    case Kind::Int:
      return std::to_string(asInt());
    case Kind::Float:
      return formatFloat(std::get<double>(v_));
    case Kind::String:
      return quoteString(asString());
    case Kind::Array: {
      std::string out = "[";
      const auto& a = asArray();
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += ", ";
        out += a[i].str();
      }
      return out + "]";
    }
    case Kind::Dict: {
      std::string s = attrDictStr(asDict());
      return s.empty() ? "{}" : s;
    }
    case Kind::Type:
      return asType().str();
  }
  return "";
}

bool Attribute::operator==(const Attribute& o) const {
  if (kind() != o.kind()) return false;
  switch (kind()) {
    case Kind::Array:
      return asArray() == o.asArray();
    case Kind::Dict:
      return asDict() == o.asDict();
    default:
      return v_ == o.v_;
  }
}

}  // namespace kiln::ir
