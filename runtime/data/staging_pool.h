// Host buffers that batches are copied into on the data thread, laid out as the consumer uploads
// them (docs/runtime.md, "Feeding the GPU"): the CUDA executor hands out a pool whose buffers are
// page-locked and laid out as its pinned input slots, the prefetcher copies each batch it reads
// into a free buffer, and the executor's stage() then uploads the buffer itself, so the training
// thread copies nothing. Without a GPU (and in the CPU tests) the buffers are ordinary memory.
//
// A buffer goes back to the pool when the last tensor of its batch is destroyed; whoever reads it
// asynchronously (an upload still running) leaves a fence, which the pool waits for before the
// buffer is handed out again. Every call is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ir/status.h"
#include "runtime/data/batch.h"

namespace kiln::data {

// Where each named tensor lies in a buffer (each at its full, bound, size).
struct StagingBufferLayout {
  std::vector<std::string> names;
  std::vector<size_t> offset, bytes;
  size_t total = 0;
  int indexOf(const std::string& name) const;  // -1 when absent
};

// How the pool gets and frees its memory: ordinary (aligned) memory unless set.
struct StagingMemory {
  std::function<Expected<void*>(size_t bytes)> allocate;
  std::function<void(void*)> release;
  std::string kind = "ordinary";  // for messages: "page-locked" on a GPU
};

class StagingPool : public std::enable_shared_from_this<StagingPool> {
 public:
  static Expected<std::shared_ptr<StagingPool>> create(StagingBufferLayout layout, int buffers,
                                                       StagingMemory memory = {});
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  const StagingBufferLayout& layout() const { return layout_; }
  int buffers() const { return static_cast<int>(blocks_.size()); }
  const std::string& memoryKind() const { return memory_.kind; }

  // Copies `batch` into a free buffer (after that buffer's fence) and points its tensors there,
  // sharing one lease that returns the buffer when the last of them is destroyed. Returns false
  // and leaves the batch as it was when it does not fit (a tensor the layout does not name or
  // larger than its place) or when every buffer is leased: the consumer then copies it itself.
  bool place(Batch& batch);

  // The buffer whose block starts at or contains `p`; -1 when none does.
  int find(const void* p) const;
  uint8_t* base(int buffer) const { return blocks_[static_cast<size_t>(buffer)]; }
  // Leaves the fence an asynchronous reader of `buffer` (an upload just enqueued) puts on its next
  // use: the pool calls it before handing the buffer out again. Replaces an earlier fence, which
  // the caller guarantees the new one covers (a later record on the same in-order stream).
  void setFence(int buffer, std::function<Status()> fence);
  // Waits for the buffer's fence now (the consumer writes into a leased buffer a second time).
  Status waitFence(int buffer);

  struct Stats {
    int64_t placed = 0;       // batches copied into a buffer
    int64_t did_not_fit = 0;  // batches left as they were: the layout does not hold them
    int64_t none_free = 0;    // batches left as they were: every buffer was leased
    int64_t fence_waits = 0;  // buffers handed out after waiting for their fence
  };
  Stats stats() const;

 private:
  StagingPool(StagingBufferLayout layout, StagingMemory memory);
  void giveBack(int buffer);
  // Takes the buffer's fence (under mu_) and waits for it (outside); false when it failed.
  bool drainFence(int buffer, std::unique_lock<std::mutex>& lock);

  StagingBufferLayout layout_;
  StagingMemory memory_;
  std::vector<uint8_t*> blocks_;
  mutable std::mutex mu_;
  std::vector<bool> leased_;
  std::vector<int> free_;  // the buffers not leased, least recently given back first
  std::vector<std::function<Status()>> fence_;
  Stats stats_;
};

}  // namespace kiln::data
