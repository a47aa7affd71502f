#include "codegen/memory_planner.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "ir/op_def.h"

namespace kiln::codegen {
namespace {

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Free intervals of one arena. Best fit: the smallest free interval that holds the request
// (lowest offset on ties); otherwise the top of the arena grows, absorbing a free interval
// that ends at the top.
class ArenaLayout {
 public:
  int64_t allocate(int64_t size) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second >= size && (best == free_.end() || it->second < best->second)) best = it;
    if (best != free_.end()) {
      int64_t off = best->first, left = best->second - size;
      free_.erase(best);
      if (left > 0) free_[off + size] = left;
      return off;
    }
    int64_t off = top_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) {
        off = last->first;
        free_.erase(last);
      }
    }
    top_ = off + size;
    return off;
  }

  void release(int64_t off, int64_t size) {
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + size == next->first) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += size;
        return;
      }
    }
    free_[off] = size;
  }

 private:
  std::map<int64_t, int64_t> free_;  // offset -> size
  int64_t top_ = 0;
};

}  // namespace

bool mayUpdateInPlace(std::string_view op_name) {
  if (op_name == "kiln.reshape") return true;
  const ir::OpDef* def = ir::OpRegistry::get().lookup(op_name);
  return def && def->has(ir::kElementwise) && !def->has(ir::kSideEffect);
}

Status planMemory(Program& p, const MemoryPlanOptions& options) {
  KILN_RETURN_IF_ERROR(validate(p));
  if (options.alignment <= 0 || (options.alignment & (options.alignment - 1)))
    return Status::errorf("memory planner: alignment {} is not a power of two", options.alignment);
  std::vector<const Instruction*> order = static_cast<const Program&>(p).ordered();
  const int n = static_cast<int>(order.size());
  const size_t nbuf = p.buffers.size();

  // Liveness by position in the global order. Buffers from outside the arena are live from
  // the start; outputs until the end.
  std::vector<int> first(nbuf, -1), last(nbuf, -1);
  for (int t = 0; t < n; ++t) {
    for (int id : order[t]->results)
      if (first[id] < 0) first[id] = t;
    for (int id : order[t]->operands) last[id] = std::max(last[id], t);
  }
  for (size_t b = 0; b < nbuf; ++b) {
    Buffer& buf = p.buffers[b];
    if (!buf.inArena()) first[b] = 0;
    if (buf.kind == BufferKind::Output) last[b] = n;
    last[b] = std::max(last[b], first[b]);  // a result nobody reads still gets written
    buf.in_place_of = -1;
    buf.offset = buf.inArena() ? -1 : buf.offset;
  }

  ArenaLayout arena;
  std::vector<int64_t> block_size(nbuf, 0);  // aligned size of the block a buffer holds
  std::vector<bool> holds(nbuf, false);      // buffer currently owns its block
  int64_t peak = 0;

  for (int t = 0; t < n; ++t) {
    const Instruction& in = *order[t];
    std::vector<int> donated;
    for (int r : in.results) {
      Buffer& res = p.buffers[r];
      if (!res.inArena() || res.offset >= 0) continue;
      int64_t size = alignUp(res.bytes, options.alignment);
      if (options.in_place && in.kind == InstrKind::Launch && mayUpdateInPlace(in.op)) {
        for (int o : in.operands) {
          const Buffer& src = p.buffers[o];
          bool same = in.op == "kiln.reshape" ? src.bytes == res.bytes
                                              : src.type.withSharding(std::nullopt) == res.type.withSharding(std::nullopt);
          if (!src.inArena() || !holds[o] || last[o] != t || !same) continue;
          if (std::find(donated.begin(), donated.end(), o) != donated.end()) continue;
          res.offset = src.offset;
          res.in_place_of = o;
          block_size[r] = block_size[o];
          holds[o] = false;
          holds[r] = true;
          donated.push_back(o);
          break;
        }
      }
      if (res.offset < 0) {
        res.offset = size == 0 ? 0 : arena.allocate(size);
        block_size[r] = size;
        holds[r] = size > 0;
      }
      peak = std::max(peak, res.offset + res.bytes);
    }
    // Operands die after the op has read them; results nobody reads die at once.
    auto release = [&](int id) {
      if (holds[id] && last[id] == t) {
        arena.release(p.buffers[id].offset, block_size[id]);
        holds[id] = false;
      }
    };
    for (int o : in.operands) release(o);
    for (int r : in.results) release(r);
  }

  auto seqAt = [&](int pos) { return pos >= n ? (n ? order.back()->seq + 1 : 0) : order[pos]->seq; };
  for (size_t b = 0; b < nbuf; ++b) {
    Buffer& buf = p.buffers[b];
    buf.first_use = first[b] < 0 ? -1 : seqAt(first[b]);
    buf.last_use = last[b] < 0 ? -1 : seqAt(last[b]);
    if (buf.inArena() && buf.offset < 0) buf.offset = 0;  // never written: holds nothing
  }
  p.peak_bytes = peak;
  p.arena_bytes = alignUp(peak, options.alignment);
  p.planned = true;
  return Status::ok();
}

std::string memoryPlanStr(const Program& p) {
  std::string out = fmt::format("memory plan @{}", p.function);
  for (const auto& [k, v] : p.symbols) out += fmt::format(" {}={}", k, v);
  out += "\n";
  auto range = [](const Buffer& b) {
    if (b.first_use < 0) return std::string("unused");
    return fmt::format("[{}, {}]", b.first_use, b.last_use);
  };
  for (const Buffer& b : p.buffers) {
    std::string line = fmt::format("  %b{:<4} {:<6}", b.id, bufferKindName(b.kind));
    if (b.inArena())
      line += fmt::format(" offset={:<10}", b.offset);
    else
      line += fmt::format(" {:<17}", "outside-arena");
    line += fmt::format(" bytes={:<10} live={:<12} {}", b.bytes, range(b), b.type.str());
    if (!b.name.empty()) line += fmt::format(" {}", ir::quoteString(b.name));
    if (b.in_place_of >= 0) line += fmt::format(" in_place_of=%b{}", b.in_place_of);
    out += fmt::format("{}\n", line);
  }
  int64_t outside = 0;
  for (const Buffer& b : p.buffers)
    if (!b.inArena()) outside += b.bytes;
  out += fmt::format("outside_arena_bytes: {}\n", outside);
  out += fmt::format("peak_bytes: {}\n", p.peak_bytes);
  return out;
}

}  // namespace kiln::codegen
