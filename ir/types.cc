#include "ir/types.h"

#include <algorithm>
#include <charconv>

#include "ir/checked.h"

namespace kiln::ir {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  int64_t bytes;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::f32, "f32", 4},       {DType::f16, "f16", 2},       {DType::bf16, "bf16", 2},
    {DType::f8e4m3, "f8e4m3", 1}, {DType::f8e5m2, "f8e5m2", 1}, {DType::i32, "i32", 4},
    {DType::i64, "i64", 8},       {DType::i1, "i1", 1},         {DType::f64, "f64", 8},
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

std::optional<int64_t> parseInt(std::string_view s) {
  int64_t v = 0;
  if (s.empty()) return std::nullopt;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

}  // namespace

bool isSymbolName(std::string_view s) {
  if (s.empty() || !(s[0] >= 'A' && s[0] <= 'Z')) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

namespace {

// "128", "B", "26*B"
std::optional<Dim> parseUnboundedDim(std::string_view s) {
  if (auto v = parseInt(s)) return *v >= 0 ? std::optional<Dim>(Dim::fixed(*v)) : std::nullopt;
  size_t star = s.find('*');
  if (star == std::string_view::npos) {
    if (isSymbolName(s)) return Dim::symbol(std::string(s));
    return std::nullopt;
  }
  auto f = parseInt(s.substr(0, star));
  auto sym = s.substr(star + 1);
  if (!f || *f <= 0 || !isSymbolName(sym)) return std::nullopt;
  return Dim::symbol(std::string(sym), *f);
}

}  // namespace

std::string_view dtypeName(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

std::optional<DType> parseDType(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

int64_t dtypeBytes(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.bytes;
  return 0;
}

bool isFloat(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16 || t == DType::f8e4m3 ||
         t == DType::f8e5m2;
}
bool isInteger(DType t) { return t == DType::i32 || t == DType::i64; }

Dim Dim::upperBound() const {
  if (kind_ != Kind::Bounded) return *this;
  return sym_.empty() ? Dim::fixed(factor_) : Dim::symbol(sym_, factor_);
}

std::optional<int64_t> Dim::evaluate(const SymbolBindings& bindings) const {
  if (sym_.empty()) return factor_;
  auto it = bindings.find(sym_);
  if (it == bindings.end()) return std::nullopt;
  return checkedMul(factor_, it->second);
}

std::string Dim::str() const {
  std::string base;
  if (sym_.empty())
    base = std::to_string(factor_);
  else if (factor_ == 1)
    base = sym_;
  else
    base = fmt::format("{}*{}", factor_, sym_);
  return kind_ == Kind::Bounded ? "?(" + base + ")" : base;
}

std::string shapeStr(const Shape& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += 'x';
    out += s[i].str();
  }
  return out;
}

bool TensorType::isStatic() const {
  return std::all_of(shape_.begin(), shape_.end(), [](const Dim& d) { return d.isStatic(); });
}

bool TensorType::hasBoundedDims() const {
  return std::any_of(shape_.begin(), shape_.end(), [](const Dim& d) { return d.isBounded(); });
}

std::optional<int64_t> TensorType::numElements(const SymbolBindings& bindings) const {
  auto n = checkedNumElements(bindings);
  return n ? std::optional<int64_t>(*n) : std::nullopt;
}

std::optional<int64_t> TensorType::bytes(const SymbolBindings& bindings) const {
  auto n = checkedBytes(bindings);
  return n ? std::optional<int64_t>(*n) : std::nullopt;
}

namespace {

// " at B=4096, T=8" for the symbols of `shape` that are bound ("" when there are none).
std::string boundSymbols(const Shape& shape, const SymbolBindings& bindings) {
  std::string out;
  for (const auto& [name, value] : bindings) {
    bool used = false;
    for (const Dim& d : shape) used |= d.sym() == name;
    if (used) out += fmt::format("{}{}={}", out.empty() ? " at " : ", ", name, value);
  }
  return out;
}

}  // namespace

Expected<int64_t> TensorType::checkedNumElements(const SymbolBindings& bindings) const {
  int64_t n = 1;
  for (const Dim& d : shape_) {
    if (!d.sym().empty() && !bindings.count(d.sym()))
      return Status::errorf("symbol '{}' of {} is not bound (set it, e.g. --batch)", d.sym(), str());
    auto v = d.evaluate(bindings);
    if (!v)
      return Status::errorf("dim {} of {} overflows int64{}", d.str(), str(), boundSymbols(shape_, bindings));
    auto product = checkedMul(n, *v);
    if (!product)
      return Status::errorf("{} has more than 2^63-1 elements{}", str(), boundSymbols(shape_, bindings));
    n = *product;
  }
  return n;
}

Expected<int64_t> TensorType::checkedBytes(const SymbolBindings& bindings) const {
  KILN_ASSIGN_OR_RETURN(int64_t n, checkedNumElements(bindings));
  auto b = checkedMul(n, dtypeBytes(dtype_));
  if (!b) return Status::errorf("{} holds more than 2^63-1 bytes{}", str(), boundSymbols(shape_, bindings));
  return *b;
}

std::string TensorType::str() const {
  std::string body = shapeStr(shape_);
  if (!body.empty()) body += 'x';
  body += dtypeName(dtype_);
  if (sharding_) {
    body += ", shard<";
    for (size_t i = 0; i < sharding_->shards.size(); ++i) {
      if (i) body += 'x';
      body += std::to_string(sharding_->shards[i]);
    }
    body += '>';
  }
  return "!kiln.tensor<" + body + ">";
}

Expected<TensorType> parseTensorTypeBody(std::string_view body) {
  std::optional<Sharding> sharding;
  size_t comma = body.find(',');
  std::string_view dims_part = trim(body.substr(0, comma));
  if (comma != std::string_view::npos) {
    std::string_view sh = trim(body.substr(comma + 1));
    if (sh.substr(0, 6) != "shard<" || sh.back() != '>')
      return Status::error(fmt::format("expected 'shard<...>' after ',' in tensor type, got '{}'", sh));
    sh = sh.substr(6, sh.size() - 7);
    Sharding s;
    size_t pos = 0;
    while (pos <= sh.size()) {
      size_t x = sh.find('x', pos);
      auto part = sh.substr(pos, x == std::string_view::npos ? std::string_view::npos : x - pos);
      auto v = parseInt(trim(part));
      if (!v || *v <= 0) return Status::error(fmt::format("bad shard count '{}'", part));
      s.shards.push_back(*v);
      if (x == std::string_view::npos) break;
      pos = x + 1;
    }
    sharding = std::move(s);
  }
  // Split on 'x' outside parentheses; the last piece is the dtype.
  std::vector<std::string_view> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < dims_part.size(); ++i) {
    char c = dims_part[i];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    // Symbols are upper case, so a lower-case 'x' outside parentheses always separates.
    if (c == 'x' && depth == 0) {
      parts.push_back(trim(dims_part.substr(start, i - start)));
      start = i + 1;
    }
  }
  parts.push_back(trim(dims_part.substr(start)));
  auto dt = parseDType(parts.back());
  if (!dt) return Status::error(fmt::format("unknown element type '{}'", parts.back()));
  Shape shape;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    std::string_view p = parts[i];
    if (p.substr(0, 2) == "?(" && p.back() == ')') {
      auto b = parseUnboundedDim(p.substr(2, p.size() - 3));
      if (!b) return Status::error(fmt::format("bad bound in dimension '{}'", p));
      shape.push_back(Dim::bounded(*b));
      continue;
    }
    auto d = parseUnboundedDim(p);
    if (!d) return Status::error(fmt::format("bad dimension '{}'", p));
    shape.push_back(*d);
  }
  if (sharding && sharding->shards.size() != shape.size())
    return Status::error(fmt::format("sharding has {} entries for a rank-{} tensor",
                                     sharding->shards.size(), shape.size()));
  return TensorType(*dt, std::move(shape), std::move(sharding));
}

Expected<Shape> broadcastShapes(const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const Dim* da = i < n - a.size() ? nullptr : &a[i - (n - a.size())];
    const Dim* db = i < n - b.size() ? nullptr : &b[i - (n - b.size())];
    if (!da) {
      out[i] = *db;
    } else if (!db) {
      out[i] = *da;
    } else if (*da == *db) {
      out[i] = *da;
    } else if (da->isStatic() && da->size() == 1) {
      out[i] = *db;
    } else if (db->isStatic() && db->size() == 1) {
      out[i] = *da;
    } else {
      return Status::error(fmt::format("shapes [{}] and [{}] do not broadcast", shapeStr(a), shapeStr(b)));
    }
  }
  return out;
}

SymbolicProduct symbolicProduct(const Shape& s) {
  SymbolicProduct p;
  for (const Dim& d : s) {
    if (d.isBounded()) p.known = false;
    if (auto f = checkedMul(p.factor, d.factor()))
      p.factor = *f;
    else
      p.overflow = true;
    if (!d.sym().empty()) p.symbols.push_back(d.sym());
  }
  std::sort(p.symbols.begin(), p.symbols.end());
  return p;
}

}  // namespace kiln::ir
