#include "runtime/serving/row_store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

namespace kiln::serving {

std::string_view evictionPolicyName(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::Lru:
      return "lru";
    case EvictionPolicy::Lfu:
      return "lfu";
  }
  return "?";
}

Expected<EvictionPolicy> parseEvictionPolicy(std::string_view name) {
  if (name == "lru") return EvictionPolicy::Lru;
  if (name == "lfu") return EvictionPolicy::Lfu;
  return Status::errorf("unknown eviction policy '{}' (expected lru or lfu)", name);
}

namespace detail {

// One shard of a tier: an id -> slot index over row slots, and for a tier that evicts, the order
// in which its rows go. The order is kept as doubly linked lists of slots, one per use count
// ("bucket"), most recent use first: LRU keeps every slot in bucket 0 and evicts its tail; LFU
// moves a slot to bucket n+1 on its n+1-th use and evicts the tail of the lowest bucket. Both are
// O(1) per operation. All members are guarded by `mu`.
class RowShard {
 public:
  RowShard(int64_t capacity, int64_t dim, EvictionPolicy policy, bool evict, bool preallocate)
      : capacity_(capacity), dim_(dim), policy_(policy), evict_(evict) {
    if (preallocate) {
      chunk_rows_ = std::max<int64_t>(capacity, 1);
      chunks_.emplace_back(new float[chunk_rows_ * dim_]);
      index_.reserve(capacity);
      slot_id_.reserve(capacity);
    } else {
      // Chunks of about 256 KiB, so a growing tier never copies the rows it holds.
      chunk_rows_ = std::max<int64_t>(1, std::min<int64_t>(capacity, (int64_t{1} << 16) / dim_));
    }
  }

  mutable std::mutex mu;

  int64_t size() const { return static_cast<int64_t>(index_.size()); }
  bool contains(int64_t id) const { return index_.count(id) != 0; }

  // Copies the row of `id` to out and counts a use; false if absent.
  bool lookup(int64_t id, float* out) {
    auto it = index_.find(id);
    if (it == index_.end()) return false;
    std::memcpy(out, row(it->second), rowBytes());
    touch(it->second);
    return true;
  }

  // Overwrites the row of `id` if present.
  bool overwrite(int64_t id, const float* values) {
    auto it = index_.find(id);
    if (it == index_.end()) return false;
    std::memcpy(row(it->second), values, rowBytes());
    return true;
  }

  enum class Inserted { Fresh, Evicted, Full };
  // Stores a row for `id`, which is absent.
  Inserted insertAbsent(int64_t id, const float* values) {
    int64_t slot;
    Inserted result = Inserted::Fresh;
    if (size() < capacity_) {
      slot = newSlot();
    } else if (!evict_ || capacity_ == 0) {
      return Inserted::Full;
    } else {
      slot = buckets_.at(min_use_).tail;
      unlink(slot);
      index_.erase(slot_id_[slot]);
      result = Inserted::Evicted;
    }
    slot_id_[slot] = id;
    index_.emplace(id, slot);
    std::memcpy(row(slot), values, rowBytes());
    if (evict_) {
      // Under LFU the insertion is the row's first use, and no row has fewer.
      min_use_ = policy_ == EvictionPolicy::Lfu ? 1 : 0;
      link(slot, min_use_);
    }
    return result;
  }

 private:
  struct Ends {
    int64_t head = -1;
    int64_t tail = -1;
  };

  size_t rowBytes() const { return static_cast<size_t>(dim_) * sizeof(float); }
  float* row(int64_t slot) { return chunks_[slot / chunk_rows_].get() + (slot % chunk_rows_) * dim_; }

  int64_t newSlot() {
    int64_t slot = static_cast<int64_t>(slot_id_.size());
    if (slot / chunk_rows_ >= static_cast<int64_t>(chunks_.size()))
      chunks_.emplace_back(new float[chunk_rows_ * dim_]);
    slot_id_.push_back(0);
    if (evict_) {
      prev_.push_back(-1);
      next_.push_back(-1);
      uses_.push_back(0);
    }
    return slot;
  }

  // Puts `slot` at the head (most recent) of bucket `uses`.
  void link(int64_t slot, uint64_t uses) {
    uses_[slot] = uses;
    Ends& b = buckets_[uses];
    prev_[slot] = -1;
    next_[slot] = b.head;
    if (b.head >= 0)
      prev_[b.head] = slot;
    else
      b.tail = slot;
    b.head = slot;
  }

  // Takes `slot` out of its bucket; returns whether the bucket is now empty (and gone).
  bool unlink(int64_t slot) {
    auto it = buckets_.find(uses_[slot]);
    Ends& b = it->second;
    if (prev_[slot] >= 0)
      next_[prev_[slot]] = next_[slot];
    else
      b.head = next_[slot];
    if (next_[slot] >= 0)
      prev_[next_[slot]] = prev_[slot];
    else
      b.tail = prev_[slot];
    if (b.head >= 0) return false;
    buckets_.erase(it);
    return true;
  }

  void touch(int64_t slot) {
    if (!evict_) return;
    uint64_t uses = uses_[slot];
    bool emptied = unlink(slot);
    if (policy_ == EvictionPolicy::Lru) {
      link(slot, 0);
      return;
    }
    if (emptied && min_use_ == uses) min_use_ = uses + 1;
    link(slot, uses + 1);
  }

  int64_t capacity_;
  int64_t dim_;
  EvictionPolicy policy_;
  bool evict_;
  int64_t chunk_rows_ = 1;
  std::vector<std::unique_ptr<float[]>> chunks_;
  std::unordered_map<int64_t, int64_t> index_;  // id -> slot
  std::vector<int64_t> slot_id_;                // slot -> id
  // Only for a shard that evicts: the bucket lists and each slot's use count.
  std::vector<int64_t> prev_, next_;
  std::vector<uint64_t> uses_;
  std::unordered_map<uint64_t, Ends> buckets_;
  uint64_t min_use_ = 0;
};

}  // namespace detail

namespace {

// Calls fn(shard, positions) once per shard that some ids fall in, with the positions in `ids` of
// those ids, so a batch takes each shard's lock once.
template <typename ShardOf, typename Fn>
void forEachShard(std::span<const int64_t> ids, size_t shard_count, ShardOf shard_of, Fn fn) {
  if (shard_count == 1) {
    std::vector<size_t> all(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) all[i] = i;
    fn(size_t{0}, std::span<const size_t>(all));
    return;
  }
  std::vector<size_t> shard(ids.size());
  std::vector<size_t> start(shard_count + 1, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    shard[i] = shard_of(ids[i]);
    ++start[shard[i] + 1];
  }
  for (size_t s = 0; s < shard_count; ++s) start[s + 1] += start[s];
  std::vector<size_t> order(ids.size());
  std::vector<size_t> fill(start.begin(), start.end() - 1);
  for (size_t i = 0; i < ids.size(); ++i) order[fill[shard[i]]++] = i;
  for (size_t s = 0; s < shard_count; ++s)
    if (start[s + 1] > start[s])
      fn(s, std::span<const size_t>(order.data() + start[s], start[s + 1] - start[s]));
}

}  // namespace

RowTier::RowTier(int64_t capacity, int64_t dim, EvictionPolicy policy, bool evict, bool preallocate,
                 int shards)
    : capacity_(std::max<int64_t>(capacity, 0)), dim_(dim), evict_(evict) {
  assert(dim > 0);
  if (capacity_ == 0) return;
  int64_t count = shards > 0 ? shards : std::clamp<int64_t>(capacity_ / 64, 1, 16);
  // A shard that evicts needs room for one row at least.
  if (evict_) count = std::min(count, capacity_);
  for (int64_t s = 0; s < count; ++s) {
    // A tier that does not evict holds whatever lands in a shard: its capacity is checked for the
    // whole tier, as hashing does not spread ids evenly.
    int64_t share =
        evict_ ? capacity_ / count + (s < capacity_ % count ? 1 : 0) : std::numeric_limits<int64_t>::max();
    shards_.push_back(std::make_unique<detail::RowShard>(share, dim_, policy, evict_, preallocate));
  }
}

RowTier::~RowTier() = default;

size_t RowTier::shardOf(int64_t id) const {
  // splitmix64's finalizer: consecutive ids land in different shards.
  uint64_t x = static_cast<uint64_t>(id);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<size_t>(x % shards_.size());
}

int64_t RowTier::size() const { return size_.load(std::memory_order_relaxed); }

size_t RowTier::lookup(std::span<const int64_t> ids, float* out, std::span<uint8_t> found) {
  assert(found.size() == ids.size());
  std::fill(found.begin(), found.end(), 0);
  if (!enabled() || ids.empty()) return 0;
  size_t hits = 0;
  forEachShard(
      ids, shards_.size(), [this](int64_t id) { return shardOf(id); },
      [&](size_t s, std::span<const size_t> positions) {
        detail::RowShard& shard = *shards_[s];
        std::lock_guard<std::mutex> lock(shard.mu);
        for (size_t i : positions) {
          if (shard.lookup(ids[i], out + i * dim_)) {
            found[i] = 1;
            ++hits;
          }
        }
      });
  lookups_.fetch_add(ids.size(), std::memory_order_relaxed);
  hits_.fetch_add(hits, std::memory_order_relaxed);
  return hits;
}

bool RowTier::insert(std::span<const int64_t> ids, const float* rows) {
  if (!enabled()) return ids.empty();
  bool all_stored = true;
  uint64_t evicted = 0;
  forEachShard(
      ids, shards_.size(), [this](int64_t id) { return shardOf(id); },
      [&](size_t s, std::span<const size_t> positions) {
        detail::RowShard& shard = *shards_[s];
        std::lock_guard<std::mutex> lock(shard.mu);
        for (size_t i : positions) {
          const float* values = rows + i * dim_;
          if (shard.overwrite(ids[i], values)) continue;
          if (!evict_ && size_.fetch_add(1, std::memory_order_relaxed) >= capacity_) {
            size_.fetch_sub(1, std::memory_order_relaxed);
            all_stored = false;
            continue;
          }
          switch (shard.insertAbsent(ids[i], values)) {
            case detail::RowShard::Inserted::Fresh:
              if (evict_) size_.fetch_add(1, std::memory_order_relaxed);
              break;
            case detail::RowShard::Inserted::Evicted:
              ++evicted;
              break;
            case detail::RowShard::Inserted::Full:
              if (!evict_) size_.fetch_sub(1, std::memory_order_relaxed);
              all_stored = false;
              break;
          }
        }
      });
  evictions_.fetch_add(evicted, std::memory_order_relaxed);
  return all_stored;
}

size_t RowTier::update(std::span<const int64_t> ids, const float* rows) {
  if (!enabled()) return 0;
  size_t updated = 0;
  forEachShard(
      ids, shards_.size(), [this](int64_t id) { return shardOf(id); },
      [&](size_t s, std::span<const size_t> positions) {
        detail::RowShard& shard = *shards_[s];
        std::lock_guard<std::mutex> lock(shard.mu);
        for (size_t i : positions)
          if (shard.overwrite(ids[i], rows + i * dim_)) ++updated;
      });
  return updated;
}

bool RowTier::get(int64_t id, float* out) {
  uint8_t found = 0;
  lookup(std::span<const int64_t>(&id, 1), out, std::span<uint8_t>(&found, 1));
  return found != 0;
}

bool RowTier::put(int64_t id, const float* row) { return insert(std::span<const int64_t>(&id, 1), row); }

bool RowTier::contains(int64_t id) const {
  if (!enabled()) return false;
  const detail::RowShard& shard = *shards_[shardOf(id)];
  std::lock_guard<std::mutex> lock(shard.mu);
  return shard.contains(id);
}

RowTierCounters RowTier::counters() const {
  RowTierCounters c;
  c.lookups = lookups_.load(std::memory_order_relaxed);
  c.hits = hits_.load(std::memory_order_relaxed);
  c.evictions = evictions_.load(std::memory_order_relaxed);
  return c;
}

}  // namespace kiln::serving
