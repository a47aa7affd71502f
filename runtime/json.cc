#include "runtime/json.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace kiln::json {

const Value* Value::find(std::string_view key) const {
  for (const auto& [k, v] : o_)
    if (k == key) return &v;
  return nullptr;
}

Value& Value::set(std::string key, Value v) {
  kind_ = Kind::Object;
  for (auto& [k, old] : o_)
    if (k == key) return old = std::move(v);
  o_.emplace_back(std::move(key), std::move(v));
  return o_.back().second;
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
        else out += c;
    }
  }
  return out + "\"";
}

void Value::dumpTo(std::string& out) const {
  switch (kind_) {
    case Kind::Null: out += "null"; break;
    case Kind::Bool: out += b_ ? "true" : "false"; break;
    case Kind::Int: out += std::to_string(i_); break;
    case Kind::Double:
      // fmt prints the shortest text that reads back to the same double.
      out += std::isfinite(d_) ? fmt::format("{}", d_) : "null";
      break;
    case Kind::String: out += quote(s_); break;
    case Kind::Array:
      out += '[';
      for (size_t i = 0; i < a_.size(); ++i) {
        if (i) out += ',';
        a_[i].dumpTo(out);
      }
      out += ']';
      break;
    case Kind::Object:
      out += '{';
      for (size_t i = 0; i < o_.size(); ++i) {
        if (i) out += ',';
        out += quote(o_[i].first);
        out += ':';
        o_[i].second.dumpTo(out);
      }
      out += '}';
      break;
  }
}

std::string Value::dump() const {
  std::string out;
  dumpTo(out);
  return out;
}

namespace {

class Parser {
 public:
  explicit Parser(std::string_view t) : t_(t) {}

  Expected<Value> document() {
    auto v = value(0);
    if (!v) return v;
    skipSpace();
    if (p_ != t_.size()) return fail("trailing characters after the JSON value");
    return v;
  }

 private:
  Status fail(std::string_view msg) const { return Status::errorf("invalid JSON at byte {}: {}", p_, msg); }
  void skipSpace() {
    while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\n' || t_[p_] == '\r')) ++p_;
  }
  bool eat(char c) {
    skipSpace();
    if (p_ < t_.size() && t_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  bool literal(std::string_view w) {
    if (t_.substr(p_, w.size()) != w) return false;
    p_ += w.size();
    return true;
  }

  Expected<Value> value(int depth) {
    if (depth > 64) return fail("nested too deeply");
    skipSpace();
    if (p_ >= t_.size()) return fail("unexpected end of input");
    char c = t_[p_];
    if (c == '{') {
      ++p_;
      Value obj = Value::object();
      if (eat('}')) return obj;
      do {
        skipSpace();
        if (p_ >= t_.size() || t_[p_] != '"') return fail("expected a string key");
        auto key = string();
        if (!key) return key.status();
        if (!eat(':')) return fail("expected ':'");
        auto v = value(depth + 1);
        if (!v) return v;
        if (obj.find(*key)) return fail(fmt::format("duplicate key \"{}\"", *key));
        obj.set(key.take(), v.take());
      } while (eat(','));
      if (!eat('}')) return fail("expected ',' or '}'");
      return obj;
    }
    if (c == '[') {
      ++p_;
      Value arr{Value::Array{}};
      if (eat(']')) return arr;
      do {
        auto v = value(depth + 1);
        if (!v) return v;
        arr.mutableArray().push_back(v.take());
      } while (eat(','));
      if (!eat(']')) return fail("expected ',' or ']'");
      return arr;
    }
    if (c == '"') {
      auto s = string();
      if (!s) return s.status();
      return Value(s.take());
    }
    if (literal("true")) return Value(true);
    if (literal("false")) return Value(false);
    if (literal("null")) return Value(nullptr);
    return number();
  }

  Expected<std::string> string() {
    ++p_;  // the opening quote
    std::string out;
    while (p_ < t_.size()) {
      char c = t_[p_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (p_ >= t_.size()) break;
      char e = t_[p_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (p_ + 4 > t_.size()) return fail("short \\u escape");
          unsigned cp = 0;
          for (int i = 0; i < 4; ++i) {
            char h = t_[p_++];
            cp <<= 4;
            if (h >= '0' && h <= '9') cp |= static_cast<unsigned>(h - '0');
            else if (h >= 'a' && h <= 'f') cp |= static_cast<unsigned>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') cp |= static_cast<unsigned>(h - 'A' + 10);
            else return fail("bad \\u escape");
          }
          // UTF-8 encode (surrogate pairs are passed through as separate code units).
          if (cp < 0x80) out += static_cast<char>(cp);
          else if (cp < 0x800) {
            out += static_cast<char>(0xc0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          } else {
            out += static_cast<char>(0xe0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          }
          break;
        }
        default: return fail("bad escape");
      }
    }
    return fail("unterminated string");
  }

  Expected<Value> number() {
    size_t start = p_;
    if (p_ < t_.size() && t_[p_] == '-') ++p_;
    bool digits = false, frac = false;
    while (p_ < t_.size() && std::isdigit(static_cast<unsigned char>(t_[p_]))) ++p_, digits = true;
    if (p_ < t_.size() && t_[p_] == '.') {
      frac = true;
      ++p_;
      while (p_ < t_.size() && std::isdigit(static_cast<unsigned char>(t_[p_]))) ++p_;
    }
    if (p_ < t_.size() && (t_[p_] == 'e' || t_[p_] == 'E')) {
      frac = true;
      ++p_;
      if (p_ < t_.size() && (t_[p_] == '+' || t_[p_] == '-')) ++p_;
      while (p_ < t_.size() && std::isdigit(static_cast<unsigned char>(t_[p_]))) ++p_;
    }
    if (!digits) {
      p_ = start;
      return fail("expected a value");
    }
    std::string text(t_.substr(start, p_ - start));
    errno = 0;
    if (!frac) {
      long long v = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == 0) return Value(static_cast<int64_t>(v));
    }
    char* end = nullptr;
    double d = std::strtod(text.c_str(), &end);
    if (*end != '\0') return fail("bad number");
    return Value(d);
  }

  std::string_view t_;
  size_t p_ = 0;
};

}  // namespace

Expected<Value> parse(std::string_view text) { return Parser(text).document(); }

}  // namespace kiln::json
