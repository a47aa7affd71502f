#include "codegen/program.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace kiln::codegen {

std::string_view bufferKindName(BufferKind k) {
  switch (k) {
    case BufferKind::Input: return "input";
    case BufferKind::Parameter: return "param";
    case BufferKind::Temp: return "temp";
    case BufferKind::Output: return "output";
  }
  return "?";
}

std::string_view instrKindName(InstrKind k) {
  switch (k) {
    case InstrKind::Launch: return "launch";
    case InstrKind::RecordEvent: return "record";
    case InstrKind::WaitEvent: return "wait";
    case InstrKind::HostStep: return "host";
  }
  return "?";
}

int Program::numInstructions() const {
  int n = 0;
  for (const Stream& s : streams) n += static_cast<int>(s.instrs.size());
  return n;
}

std::vector<const Instruction*> Program::ordered() const {
  std::vector<const Instruction*> out;
  for (const Stream& s : streams)
    for (const Instruction& i : s.instrs) out.push_back(&i);
  std::stable_sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->seq < b->seq; });
  return out;
}

std::vector<Instruction*> Program::ordered() {
  std::vector<Instruction*> out;
  for (Stream& s : streams)
    for (Instruction& i : s.instrs) out.push_back(&i);
  std::stable_sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->seq < b->seq; });
  return out;
}

// ---- Printing ----------------------------------------------------------------------------------

static std::string bufList(const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += fmt::format("{}%b{}", i ? ", " : "", ids[i]);
  return s;
}

std::string Program::str() const {
  std::string out = fmt::format("program @{}", function);
  if (!symbols.empty()) {
    out += " symbols {";
    bool first = true;
    for (const auto& [k, v] : symbols) {
      out += fmt::format("{}{} = {}", first ? "" : ", ", k, v);
      first = false;
    }
    out += "}";
  }
  out += fmt::format(" arena_bytes {}\n", arena_bytes);
  out += "buffers:\n";
  for (const Buffer& b : buffers) {
    out += fmt::format("  %b{} {}", b.id, bufferKindName(b.kind));
    if (!b.name.empty()) out += fmt::format(" {}", ir::quoteString(b.name));
    out += fmt::format(" {} bytes={}", b.type.str(), b.bytes);
    if (b.inArena() && b.offset >= 0) out += fmt::format(" offset={}", b.offset);
    if (b.in_place_of >= 0) out += fmt::format(" in_place_of=%b{}", b.in_place_of);
    out += "\n";
  }
  for (const Stream& s : streams) {
    out += fmt::format("stream {}:\n", s.id);
    for (const Instruction& i : s.instrs) {
      out += fmt::format("  {:>4}: ", i.seq);
      switch (i.kind) {
        case InstrKind::Launch:
        case InstrKind::HostStep: {
          if (!i.results.empty()) out += fmt::format("{} = ", bufList(i.results));
          out += fmt::format("{} {}({})", instrKindName(i.kind), ir::quoteString(i.op), bufList(i.operands));
          std::string attrs = ir::attrDictStr(i.attrs);
          if (!attrs.empty()) out += fmt::format(" {}", attrs);
          // Types make a line readable on its own, like MLIR's trailing signature.
          std::string sig = " : (";
          for (size_t k = 0; k < i.operands.size(); ++k)
            sig += fmt::format("{}{}", k ? ", " : "", buffers[static_cast<size_t>(i.operands[k])].type.str());
          sig += ") -> (";
          for (size_t k = 0; k < i.results.size(); ++k)
            sig += fmt::format("{}{}", k ? ", " : "", buffers[static_cast<size_t>(i.results[k])].type.str());
          out += fmt::format("{})", sig);
          break;
        }
        case InstrKind::RecordEvent:
        case InstrKind::WaitEvent:
          out += fmt::format("{} event {}", instrKindName(i.kind), i.event);
          break;
      }
      out += "\n";
    }
  }
  out += fmt::format("results: {}\n", bufList(results));
  return out;
}

// ---- Serialization -----------------------------------------------------------------------------
// Layout: "KILNPRG1", then fields in declaration order. Integers are little-endian fixed width;
// strings and lists are a u32 count then their items; types travel in their text form, which
// the IR parses back exactly.

namespace {

constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'P', 'R', 'G', '1'};

class Writer {
 public:
  std::vector<uint8_t> bytes;
  void raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  void u8(uint8_t v) { bytes.push_back(v); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void i64(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) u8(static_cast<uint8_t>(u >> (8 * i)));
  }
  void f64(double v) {
    uint64_t u;
    std::memcpy(&u, &v, 8);
    i64(static_cast<int64_t>(u));
  }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    raw(s.data(), s.size());
  }
  void type(const ir::TensorType& t) { str(t.str()); }
  void ints(const std::vector<int>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (int x : v) i64(x);
  }
  void attr(const ir::Attribute& a) {
    u8(static_cast<uint8_t>(a.kind()));
    switch (a.kind()) {
      case ir::Attribute::Kind::Bool: u8(a.asBool()); break;
      case ir::Attribute::Kind::Int: i64(a.asInt()); break;
      case ir::Attribute::Kind::Float: f64(a.asDouble()); break;
      case ir::Attribute::Kind::String: str(a.asString()); break;
      case ir::Attribute::Kind::Array:
        u32(static_cast<uint32_t>(a.asArray().size()));
        for (const auto& e : a.asArray()) attr(e);
        break;
      case ir::Attribute::Kind::Dict: dict(a.asDict()); break;
      case ir::Attribute::Kind::Type: type(a.asType()); break;
    }
  }
  void dict(const ir::AttrDict& d) {
    u32(static_cast<uint32_t>(d.size()));
    for (const auto& [k, v] : d) {
      str(k);
      attr(v);
    }
  }
};

// Reads with bounds checks: a truncated or damaged program is an error, never a crash.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  size_t pos() const { return pos_; }

  bool need(size_t k) {
    if (!ok_) return false;
    if (n_ - pos_ < k) return fail(fmt::format("truncated at byte {}", pos_));
    return true;
  }
  bool fail(std::string msg) {
    if (ok_) error_ = std::move(msg);
    ok_ = false;
    return false;
  }
  uint8_t u8() {
    if (!need(1)) return 0;
    return p_[pos_++];
  }
  uint32_t u32() {
    if (!need(4)) return 0;
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p_[pos_++]) << (8 * i);
    return v;
  }
  int64_t i64() {
    if (!need(8)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p_[pos_++]) << (8 * i);
    return static_cast<int64_t>(v);
  }
  double f64() {
    auto u = static_cast<uint64_t>(i64());
    double d;
    std::memcpy(&d, &u, 8);
    return d;
  }
  // A count of items each at least `min_item` bytes, checked against what is left.
  uint32_t count(size_t min_item) {
    uint32_t n = u32();
    if (ok_ && static_cast<uint64_t>(n) * min_item > n_ - pos_) {
      fail(fmt::format("count {} at byte {} exceeds the data", n, pos_ - 4));
      return 0;
    }
    return n;
  }
  std::string str() {
    uint32_t n = count(1);
    if (!ok_) return {};
    std::string s(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return s;
  }
  ir::TensorType type() {
    std::string s = str();
    if (!ok_) return {};
    const std::string prefix = "!kiln.tensor<";
    if (s.rfind(prefix, 0) != 0 || s.back() != '>') {
      fail(fmt::format("bad tensor type '{}'", s));
      return {};
    }
    auto t = ir::parseTensorTypeBody(std::string_view(s).substr(prefix.size(), s.size() - prefix.size() - 1));
    if (!t) {
      fail(fmt::format("bad tensor type '{}': {}", s, t.status().message()));
      return {};
    }
    return *t;
  }
  std::vector<int> ints() {
    uint32_t n = count(8);
    std::vector<int> v;
    for (uint32_t i = 0; i < n && ok_; ++i) v.push_back(static_cast<int>(i64()));
    return v;
  }
  ir::Attribute attr(int depth = 0) {
    if (depth > 64) {
      fail("attributes nested too deeply");
      return {};
    }
    using K = ir::Attribute::Kind;
    auto kind = static_cast<K>(u8());
    switch (kind) {
      case K::Bool: return ir::Attribute(u8() != 0);
      case K::Int: return ir::Attribute(i64());
      case K::Float: return ir::Attribute(f64());
      case K::String: return ir::Attribute(str());
      case K::Array: {
        uint32_t n = count(1);
        ir::AttrArray a;
        for (uint32_t i = 0; i < n && ok_; ++i) a.push_back(attr(depth + 1));
        return ir::Attribute(std::move(a));
      }
      case K::Dict: return ir::Attribute(dict(depth + 1));
      case K::Type: return ir::Attribute(type());
    }
    fail(fmt::format("bad attribute kind {} at byte {}", static_cast<int>(kind), pos_ - 1));
    return {};
  }
  ir::AttrDict dict(int depth = 0) {
    uint32_t n = count(5);
    ir::AttrDict d;
    for (uint32_t i = 0; i < n && ok_; ++i) {
      std::string k = str();
      d[k] = attr(depth);
    }
    return d;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  bool ok_ = true;
  std::string error_;
};

}  // namespace

std::vector<uint8_t> Program::serialize() const {
  Writer w;
  w.raw(kMagic, sizeof(kMagic));
  w.str(function);
  w.u32(static_cast<uint32_t>(symbols.size()));
  for (const auto& [k, v] : symbols) {
    w.str(k);
    w.i64(v);
  }
  w.u32(static_cast<uint32_t>(buffers.size()));
  for (const Buffer& b : buffers) {
    w.i64(b.id);
    w.u8(static_cast<uint8_t>(b.kind));
    w.str(b.name);
    w.type(b.type);
    w.i64(b.bytes);
    w.i64(b.offset);
    w.i64(b.first_use);
    w.i64(b.last_use);
    w.i64(b.in_place_of);
  }
  w.u32(static_cast<uint32_t>(streams.size()));
  for (const Stream& s : streams) {
    w.i64(s.id);
    w.u32(static_cast<uint32_t>(s.instrs.size()));
    for (const Instruction& i : s.instrs) {
      w.u8(static_cast<uint8_t>(i.kind));
      w.i64(i.seq);
      w.str(i.op);
      w.dict(i.attrs);
      w.ints(i.operands);
      w.ints(i.results);
      w.i64(i.event);
    }
  }
  w.ints(results);
  w.i64(num_events);
  w.u8(planned);
  w.i64(peak_bytes);
  w.i64(arena_bytes);
  return std::move(w.bytes);
}

Expected<Program> Program::deserialize(const uint8_t* data, size_t size) {
  if (size < sizeof(kMagic) || std::memcmp(data, kMagic, sizeof(kMagic)) != 0)
    return Status::error("not a serialized Kiln program (bad magic)");
  Reader r(data + sizeof(kMagic), size - sizeof(kMagic));
  Program p;
  p.function = r.str();
  uint32_t nsym = r.count(12);
  for (uint32_t i = 0; i < nsym && r.ok(); ++i) {
    std::string k = r.str();
    p.symbols[k] = r.i64();
  }
  uint32_t nbuf = r.count(50);
  for (uint32_t i = 0; i < nbuf && r.ok(); ++i) {
    Buffer b;
    b.id = static_cast<int>(r.i64());
    uint8_t kind = r.u8();
    if (kind > static_cast<uint8_t>(BufferKind::Output)) r.fail(fmt::format("bad buffer kind {}", kind));
    b.kind = static_cast<BufferKind>(kind);
    b.name = r.str();
    b.type = r.type();
    b.bytes = r.i64();
    b.offset = r.i64();
    b.first_use = static_cast<int>(r.i64());
    b.last_use = static_cast<int>(r.i64());
    b.in_place_of = static_cast<int>(r.i64());
    p.buffers.push_back(std::move(b));
  }
  uint32_t nstreams = r.count(12);
  for (uint32_t s = 0; s < nstreams && r.ok(); ++s) {
    Stream st;
    st.id = static_cast<int>(r.i64());
    uint32_t ninstr = r.count(30);
    for (uint32_t k = 0; k < ninstr && r.ok(); ++k) {
      Instruction in;
      uint8_t kind = r.u8();
      if (kind > static_cast<uint8_t>(InstrKind::HostStep)) r.fail(fmt::format("bad instruction kind {}", kind));
      in.kind = static_cast<InstrKind>(kind);
      in.seq = static_cast<int>(r.i64());
      in.op = r.str();
      in.attrs = r.dict();
      in.operands = r.ints();
      in.results = r.ints();
      in.event = static_cast<int>(r.i64());
      st.instrs.push_back(std::move(in));
    }
    p.streams.push_back(std::move(st));
  }
  p.results = r.ints();
  p.num_events = static_cast<int>(r.i64());
  p.planned = r.u8() != 0;
  p.peak_bytes = r.i64();
  p.arena_bytes = r.i64();
  if (!r.ok()) return Status::errorf("damaged serialized program: {}", r.error());
  if (r.pos() != size - sizeof(kMagic))
    return Status::errorf("damaged serialized program: {} trailing bytes", size - sizeof(kMagic) - r.pos());
  KILN_RETURN_IF_ERROR(validate(p));
  return p;
}

Status validate(const Program& p) {
  const int nbuf = static_cast<int>(p.buffers.size());
  for (int i = 0; i < nbuf; ++i)
    if (p.buffers[static_cast<size_t>(i)].id != i)
      return Status::errorf("program: buffer #{} has id {}", i, p.buffers[static_cast<size_t>(i)].id);
  std::vector<bool> written(static_cast<size_t>(nbuf), false);
  for (const Buffer& b : p.buffers)
    if (!b.inArena()) written[static_cast<size_t>(b.id)] = true;
  if (p.num_events < 0 || p.num_events > p.numInstructions())
    return Status::errorf("program: {} events for {} instructions", p.num_events, p.numInstructions());
  std::vector<bool> recorded(static_cast<size_t>(p.num_events), false);
  for (const Instruction* in : p.ordered()) {
    for (int id : in->operands) {
      if (id < 0 || id >= nbuf) return Status::errorf("program: instruction {} reads unknown buffer {}", in->seq, id);
      if (!written[static_cast<size_t>(id)])
        return Status::errorf("program: instruction {} reads %b{} before it is written", in->seq, id);
    }
    for (int id : in->results) {
      if (id < 0 || id >= nbuf) return Status::errorf("program: instruction {} writes unknown buffer {}", in->seq, id);
      written[static_cast<size_t>(id)] = true;
    }
    if (in->kind == InstrKind::RecordEvent || in->kind == InstrKind::WaitEvent) {
      if (in->event < 0 || in->event >= p.num_events)
        return Status::errorf("program: instruction {} names unknown event {}", in->seq, in->event);
      if (in->kind == InstrKind::RecordEvent) recorded[static_cast<size_t>(in->event)] = true;
      else if (!recorded[static_cast<size_t>(in->event)])
        return Status::errorf("program: instruction {} waits on event {} before it is recorded", in->seq, in->event);
    }
  }
  for (int id : p.results)
    if (id < 0 || id >= nbuf || !written[static_cast<size_t>(id)])
      return Status::errorf("program: result %b{} is never written", id);
  return Status::ok();
}

Status rebindProgram(Program& p, const ir::SymbolBindings& symbols) {
  ir::SymbolBindings merged = p.symbols;
  for (const auto& [name, value] : symbols) merged[name] = value;
  for (const Buffer& b : p.buffers) {
    auto bytes = b.type.checkedBytes(merged);
    if (!bytes)
      return Status::errorf("@{}: %b{} ({}): {}", p.function, b.id, b.name, bytes.status().message());
    if (*bytes > b.bytes)
      return Status::errorf("@{}: %b{} ({}) needs {} bytes at the new sizes but was planned for {}",
                            p.function, b.id, b.name, *bytes, b.bytes);
  }
  p.symbols = std::move(merged);
  return Status::ok();
}

}  // namespace kiln::codegen
