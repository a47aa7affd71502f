#include "ir/arena_plan.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <map>

#include "ir/op_def.h"

namespace kiln::ir {
namespace {

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// One component per stream: component s of a step's clock is 1 + the index of the latest step
// of stream s known to have finished before it.
using Clock = std::vector<int>;

bool happenedBefore(const Clock& uses, const Clock& now) {
  for (size_t s = 0; s < uses.size(); ++s)
    if (uses[s] > now[s]) return false;
  return true;
}

void mergeInto(Clock& into, const Clock& from) {
  for (size_t s = 0; s < into.size(); ++s) into[s] = std::max(into[s], from[s]);
}

// Free intervals of the arena, each with the clock of the uses of what it last held. Best fit:
// the smallest free interval the step may reuse that holds the request (lowest offset on
// ties); otherwise the top of the arena grows, absorbing a reusable free interval at the top.
class Arena {
 public:
  int64_t allocate(int64_t size, const Clock& now) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second.size >= size && happenedBefore(it->second.clock, now) &&
          (best == free_.end() || it->second.size < best->second.size))
        best = it;
    if (best != free_.end()) {
      int64_t off = best->first, left = best->second.size - size;
      Clock clock = std::move(best->second.clock);
      free_.erase(best);
      if (left > 0) free_[off + size] = {left, std::move(clock)};
      return off;
    }
    int64_t off = top_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second.size == top_ && happenedBefore(last->second.clock, now)) {
        off = last->first;
        free_.erase(last);
      }
    }
    top_ = off + size;
    return off;
  }

  // Adjacent free intervals merge; the merged one may be reused only after all their uses.
  void release(int64_t off, int64_t size, Clock clock) {
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + size == next->first) {
      size += next->second.size;
      mergeInto(clock, next->second.clock);
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size == off) {
        prev->second.size += size;
        mergeInto(prev->second.clock, clock);
        return;
      }
    }
    free_[off] = {size, std::move(clock)};
  }

 private:
  struct Free {
    int64_t size = 0;
    Clock clock;
  };
  std::map<int64_t, Free> free_;  // by offset
  int64_t top_ = 0;
};

// Online best fit places buffers in program order and cannot foresee that a large buffer made
// later would fit below long-lived ones; it fragments. This second layout places whole blocks
// (a buffer with the buffers that took it over in place) largest first, each at the lowest
// offset free of every block it may overlap in time (TFLite's and XLA's greedy-by-size
// heuristic), and replaces the first when its peak is lower.
void improveLayout(ArenaPlan& plan, const std::vector<ArenaBuffer>& buffers, const std::vector<int64_t>& block_size,
                   const std::vector<Clock>& used, const std::vector<Clock>& clock, const std::vector<ArenaStep>& steps,
                   const std::map<int, size_t>& stream_index) {
  const size_t nbuf = buffers.size();
  struct Block {
    int root = -1;
    int64_t size = 0;
    int first = 0, last = 0;
    Clock used;
    std::vector<int> members;
    int64_t offset = -1;
  };
  auto rootOf = [&](int b) {
    while (plan.in_place_of[static_cast<size_t>(b)] >= 0) b = plan.in_place_of[static_cast<size_t>(b)];
    return b;
  };
  std::vector<Block> blocks;
  std::map<int, size_t> block_of_root;
  const int kForever = std::numeric_limits<int>::max();
  for (size_t b = 0; b < nbuf; ++b) {
    if (!buffers[b].in_arena || block_size[b] <= 0 || plan.first[b] < 0) continue;
    int root = rootOf(static_cast<int>(b));
    auto [it, added] = block_of_root.try_emplace(root, blocks.size());
    if (added) {
      Block blk;
      blk.root = root;
      blk.size = block_size[static_cast<size_t>(root)];
      blk.first = plan.first[static_cast<size_t>(root)];
      blk.used = Clock(used[b].size(), 0);
      blocks.push_back(std::move(blk));
    }
    Block& blk = blocks[it->second];
    blk.members.push_back(static_cast<int>(b));
    blk.last = std::max(blk.last, plan.last[b]);
    if (buffers[b].live_to_end) blk.used.assign(blk.used.size(), kForever);
    else mergeInto(blk.used, used[b]);
  }
  // before(x, y): every use of x happens before y's block is first written (strictly: a step
  // that writes y while reading x would need them apart).
  auto before = [&](const Block& x, const Block& y) {
    const ArenaStep& s = steps[static_cast<size_t>(y.first)];
    Clock upto = clock[static_cast<size_t>(y.first)];
    upto[stream_index.at(s.stream)] = y.first;  // steps of y's stream before y.first
    return happenedBefore(x.used, upto);
  };
  // Greedy placement in the given order: each block at the lowest offset that no block it
  // overlaps in time occupies. Returns the peak; offsets are left in the blocks.
  auto place = [&](const std::vector<size_t>& order) {
    std::vector<size_t> placed;
    int64_t peak = 0;
    for (size_t i : order) {
      Block& blk = blocks[i];
      std::vector<std::pair<int64_t, int64_t>> taken;  // [offset, end) of blocks live with it
      for (size_t j : placed) {
        const Block& other = blocks[j];
        if (!before(blk, other) && !before(other, blk)) taken.push_back({other.offset, other.offset + other.size});
      }
      std::sort(taken.begin(), taken.end());
      int64_t off = 0;
      for (const auto& [lo, hi] : taken) {
        if (lo >= off + blk.size) break;  // the gap below this one holds it
        off = std::max(off, hi);
      }
      blk.offset = off;
      placed.push_back(i);
      for (int m : blk.members) peak = std::max(peak, off + buffers[static_cast<size_t>(m)].bytes);
    }
    return peak;
  };
  // Largest first; among equal sizes, the longer-lived (then the earlier) first, or the earlier
  // first: the better of the two orders wins.
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto span = [&](const Block& b) { return b.last - b.first; };
  std::vector<int64_t> best_offsets;
  int64_t peak = plan.peak;
  for (int variant = 0; variant < 2; ++variant) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const Block& x = blocks[a];
      const Block& y = blocks[b];
      if (x.size != y.size) return x.size > y.size;
      if (variant == 0 && span(x) != span(y)) return span(x) > span(y);
      return x.first < y.first;
    });
    int64_t p = place(order);
    if (p >= peak) continue;
    peak = p;
    best_offsets.clear();
    for (const Block& blk : blocks) best_offsets.push_back(blk.offset);
  }
  if (best_offsets.empty()) return;
  for (size_t i = 0; i < blocks.size(); ++i)
    for (int m : blocks[i].members) plan.offset[static_cast<size_t>(m)] = best_offsets[i];
  plan.peak = peak;
}

}  // namespace

InPlace inPlaceKind(std::string_view op_name) {
  if (opCodeOf(op_name) == OpCode::Reshape) return InPlace::kSameBytes;
  const OpDef* def = OpRegistry::get().lookup(op_name);
  return def && def->has(kElementwise) && !def->has(kSideEffect) ? InPlace::kSameType : InPlace::kNever;
}

ArenaPlan planArena(const std::vector<ArenaStep>& steps, const std::vector<ArenaBuffer>& buffers,
                    const ArenaPlanOptions& options) {
  assert(options.alignment > 0 && (options.alignment & (options.alignment - 1)) == 0);
  const int n = static_cast<int>(steps.size());
  const size_t nbuf = buffers.size();

  std::map<int, size_t> stream_index;
  for (const ArenaStep& s : steps) stream_index.emplace(s.stream, stream_index.size());
  const size_t ns = std::max<size_t>(1, stream_index.size());

  std::vector<Clock> clock(steps.size(), Clock(ns, 0));
  std::vector<int> latest(ns, -1);
  for (int t = 0; t < n; ++t) {
    const ArenaStep& s = steps[static_cast<size_t>(t)];
    size_t si = stream_index.at(s.stream);
    Clock& c = clock[static_cast<size_t>(t)];
    if (latest[si] >= 0) c = clock[static_cast<size_t>(latest[si])];
    for (int w : s.waits) {
      assert(w >= 0 && w < t && "a step waits for a later one");
      mergeInto(c, clock[static_cast<size_t>(w)]);
    }
    c[si] = t + 1;
    latest[si] = t;
  }

  ArenaPlan plan;
  plan.offset.assign(nbuf, -1);
  plan.in_place_of.assign(nbuf, -1);
  plan.first.assign(nbuf, -1);
  plan.last.assign(nbuf, -1);
  std::vector<Clock> used(nbuf, Clock(ns, 0));  // per stream: 1 + the latest step using it
  for (int t = 0; t < n; ++t) {
    const ArenaStep& s = steps[static_cast<size_t>(t)];
    size_t si = stream_index.at(s.stream);
    for (int id : s.results) {
      if (plan.first[static_cast<size_t>(id)] < 0) plan.first[static_cast<size_t>(id)] = t;
      used[static_cast<size_t>(id)][si] = t + 1;
    }
    for (int id : s.operands) {
      plan.last[static_cast<size_t>(id)] = std::max(plan.last[static_cast<size_t>(id)], t);
      used[static_cast<size_t>(id)][si] = t + 1;
    }
  }
  auto& first = plan.first;
  auto& last = plan.last;
  for (size_t b = 0; b < nbuf; ++b) {
    if (!buffers[b].in_arena) first[b] = 0;
    if (buffers[b].live_to_end) last[b] = n;
    last[b] = std::max(last[b], first[b]);  // a result nobody reads still gets written
  }

  Arena arena;
  std::vector<int64_t> block_size(nbuf, 0);  // aligned size of the block a buffer holds
  std::vector<bool> holds(nbuf, false);      // the buffer currently owns its block
  for (int t = 0; t < n; ++t) {
    const ArenaStep& s = steps[static_cast<size_t>(t)];
    const Clock& now = clock[static_cast<size_t>(t)];
    std::vector<int> donated;
    for (int r : s.results) {
      const ArenaBuffer& res = buffers[static_cast<size_t>(r)];
      size_t ru = static_cast<size_t>(r);
      if (!res.in_arena || plan.offset[ru] >= 0) continue;
      if (options.in_place && s.in_place != InPlace::kNever) {
        for (int o : s.operands) {
          size_t ou = static_cast<size_t>(o);
          const ArenaBuffer& src = buffers[ou];
          bool fits = s.in_place == InPlace::kSameBytes
                          ? src.bytes == res.bytes
                          : src.type.withSharding(std::nullopt) == res.type.withSharding(std::nullopt);
          if (!src.in_arena || !holds[ou] || last[ou] != t || !fits) continue;
          if (!happenedBefore(used[ou], now)) continue;  // read on a stream not yet joined
          if (std::find(donated.begin(), donated.end(), o) != donated.end()) continue;
          plan.offset[ru] = plan.offset[ou];
          plan.in_place_of[ru] = o;
          block_size[ru] = block_size[ou];
          holds[ou] = false;
          holds[ru] = true;
          donated.push_back(o);
          break;
        }
      }
      if (plan.offset[ru] < 0) {
        int64_t size = alignUp(res.bytes, options.alignment);
        plan.offset[ru] = size == 0 ? 0 : arena.allocate(size, now);
        block_size[ru] = size;
        holds[ru] = size > 0;
      }
      plan.peak = std::max(plan.peak, plan.offset[ru] + res.bytes);
    }
    // Operands die after the step has read them; results nobody reads die at once.
    auto release = [&](int id) {
      size_t u = static_cast<size_t>(id);
      if (holds[u] && last[u] == t) {
        arena.release(plan.offset[u], block_size[u], used[u]);
        holds[u] = false;
      }
    };
    for (int o : s.operands) release(o);
    for (int r : s.results) release(r);
  }
  for (size_t b = 0; b < nbuf; ++b)
    if (buffers[b].in_arena && plan.offset[b] < 0) plan.offset[b] = 0;  // never written: holds nothing
  improveLayout(plan, buffers, block_size, used, clock, steps, stream_index);
  return plan;
}

StreamHazards::Access& StreamHazards::at(int buffer) {
  if (static_cast<size_t>(buffer) >= access_.size()) access_.resize(static_cast<size_t>(buffer) + 1);
  return access_[static_cast<size_t>(buffer)];
}

std::vector<int> StreamHazards::add(int step, int stream, const std::vector<int>& reads,
                                    const std::vector<int>& writes_in_place, const std::vector<int>& results) {
  if (static_cast<size_t>(step) >= stream_of_.size()) stream_of_.resize(static_cast<size_t>(step) + 1, -1);
  stream_of_[static_cast<size_t>(step)] = stream;
  std::vector<int> waits;
  auto need = [&](int earlier) {
    if (earlier < 0 || earlier == step || stream_of_[static_cast<size_t>(earlier)] == stream) return;
    if (std::find(waits.begin(), waits.end(), earlier) == waits.end()) waits.push_back(earlier);
  };
  for (int b : reads) need(at(b).last_write);
  for (int b : writes_in_place) {
    need(at(b).last_write);
    for (int r : at(b).readers) need(r);
  }
  for (int b : reads) at(b).readers.push_back(step);
  for (int b : writes_in_place) at(b) = {step, {}};
  for (int b : results) at(b) = {step, {}};
  return waits;
}

}  // namespace kiln::ir
