#include "runtime/data/staging_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

namespace kiln::data {

namespace {
constexpr size_t kOrdinaryAlignment = 256;  // as the executor's slots align their tensors
}

int StagingBufferLayout::indexOf(const std::string& name) const {
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return static_cast<int>(i);
  return -1;
}

StagingPool::StagingPool(StagingBufferLayout layout, StagingMemory memory)
    : layout_(std::move(layout)), memory_(std::move(memory)) {}

Expected<std::shared_ptr<StagingPool>> StagingPool::create(StagingBufferLayout layout, int buffers,
                                                           StagingMemory memory) {
  if (layout.names.size() != layout.offset.size() || layout.names.size() != layout.bytes.size())
    return Status::error("staging pool: the layout's names, offsets and sizes differ in count");
  for (size_t i = 0; i < layout.names.size(); ++i)
    if (layout.offset[i] + layout.bytes[i] > layout.total)
      return Status::errorf("staging pool: '{}' ends at byte {}, past the buffer's {}", layout.names[i],
                            layout.offset[i] + layout.bytes[i], layout.total);
  if (!memory.allocate) {
    memory.allocate = [](size_t bytes) -> Expected<void*> {
      void* p = ::operator new(bytes, std::align_val_t(kOrdinaryAlignment), std::nothrow);
      if (!p) return Status::errorf("out of memory for a {}-byte staging buffer", bytes);
      return p;
    };
    memory.release = [](void* p) { ::operator delete(p, std::align_val_t(kOrdinaryAlignment)); };
  }
  std::shared_ptr<StagingPool> pool(new StagingPool(std::move(layout), std::move(memory)));
  const size_t bytes = std::max<size_t>(pool->layout_.total, 1);
  for (int i = 0; i < std::max(buffers, 1); ++i) {
    auto p = pool->memory_.allocate(bytes);
    if (!p)
      return Status::errorf("staging buffer {} of {} ({} bytes, {} memory): {}", i, buffers, bytes,
                            pool->memory_.kind, p.status().message());
    pool->blocks_.push_back(static_cast<uint8_t*>(*p));
    pool->leased_.push_back(false);
    pool->free_.push_back(i);
    pool->fence_.emplace_back();
  }
  return pool;
}

StagingPool::~StagingPool() {
  // Every lease holds the pool: none is out. An upload may still read a buffer given back.
  for (size_t b = 0; b < blocks_.size(); ++b) {
    if (fence_[b]) (void)fence_[b]();
    memory_.release(blocks_[b]);
  }
}

int StagingPool::find(const void* p) const {
  const auto* at = static_cast<const uint8_t*>(p);
  const size_t bytes = std::max<size_t>(layout_.total, 1);
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (at >= blocks_[b] && at < blocks_[b] + bytes) return static_cast<int>(b);
  return -1;
}

void StagingPool::setFence(int buffer, std::function<Status()> fence) {
  std::lock_guard<std::mutex> lock(mu_);
  fence_[static_cast<size_t>(buffer)] = std::move(fence);
}

Status StagingPool::waitFence(int buffer) {
  std::function<Status()> fence;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fence.swap(fence_[static_cast<size_t>(buffer)]);
    if (fence) ++stats_.fence_waits;
  }
  return fence ? fence() : Status::ok();
}

StagingPool::Stats StagingPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void StagingPool::giveBack(int buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  leased_[static_cast<size_t>(buffer)] = false;
  free_.push_back(buffer);
}

bool StagingPool::place(Batch& batch) {
  std::vector<int> where(batch.tensors.size());
  for (size_t i = 0; i < batch.tensors.size(); ++i) {
    const int at = i < batch.names.size() ? layout_.indexOf(batch.names[i]) : -1;
    const size_t bytes = static_cast<size_t>(batch.tensors[i].view.bytes());
    if (at < 0 || bytes > layout_.bytes[static_cast<size_t>(at)]) {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.did_not_fit;
      return false;
    }
    where[i] = at;
  }
  int buffer = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) {
      ++stats_.none_free;
      return false;
    }
    buffer = free_.front();
    free_.erase(free_.begin());
    leased_[static_cast<size_t>(buffer)] = true;
  }
  // The last upload from this buffer may still be reading it.
  if (!waitFence(buffer).isOk()) {
    // A failed wait (a broken device) leaves the buffer's reader unknown: it stays leased.
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.none_free;
    return false;
  }
  uint8_t* block = blocks_[static_cast<size_t>(buffer)];
  std::shared_ptr<const void> lease(
      block, [pool = shared_from_this(), buffer](const void*) { pool->giveBack(buffer); });
  for (size_t i = 0; i < batch.tensors.size(); ++i) {
    ir::HostTensor& t = batch.tensors[i];
    uint8_t* dst = block + layout_.offset[static_cast<size_t>(where[i])];
    const size_t bytes = static_cast<size_t>(t.view.bytes());
    if (bytes) std::memcpy(dst, t.view.data, bytes);
    t = ir::HostTensor::external(t.view.dtype, t.view.shape, dst, lease);
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.placed;
  return true;
}

}  // namespace kiln::data
