// Reads batches on a background thread into a bounded queue, so loading overlaps compute.
// The consumer sees batches in order, then the end of the data or the reader's error (in its
// place in the stream, and again on every later call). Destroying the prefetcher stops and
// joins the thread at once, even when the queue is full. Malformed lines are reported and counted
// as their batches are handed out: lines in batches read ahead and never used are neither.
// Given a staging pool (stageInto), the thread also copies each batch it reads into one of the
// pool's buffers (page-locked memory laid out as the GPU executor uploads it), so that the
// training thread's stage() only enqueues the upload.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "runtime/data/batch_reader.h"
#include "runtime/data/staging_pool.h"

namespace kiln::data {

class Prefetcher {
 public:
  // Starts reading at once; at most `depth` ready batches wait in the queue.
  Prefetcher(std::unique_ptr<BatchReader> reader, int depth = 4);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next batch; false at the end of the data; the reader's error if it failed.
  Expected<bool> next(Batch& batch);
  // The position after the last batch handed out (where a resumed run continues).
  StreamPosition position() const { return consumed_; }
  // Malformed lines among the batches handed out so far, and, once next() has returned false,
  // those between the last sample and the end of the data.
  int64_t malformed() const { return malformed_; }
  // The lines skipped after the last sample, once next() has returned false.
  const std::vector<SkippedLine>& skippedAtEnd() const { return skipped_at_end_; }
  // From now on, copies the batches it reads into `pool`'s buffers (those that fit and find a
  // free buffer; the others come as read). Batches already queued stay as they are. nullptr stops.
  void stageInto(std::shared_ptr<StagingPool> pool);

 private:
  void run();

  std::unique_ptr<BatchReader> reader_;
  const size_t depth_;
  mutable std::mutex mu_;
  std::condition_variable not_full_, not_empty_;
  std::deque<Batch> queue_;
  bool done_ = false;   // the producer has finished (end of data or error)
  bool stop_ = false;   // the consumer is going away
  Status error_;
  std::shared_ptr<StagingPool> staging_;     // guarded by mu_
  std::vector<SkippedLine> skipped_at_end_;  // set by the producer when done_
  // The consumer's own (not guarded by mu_).
  int64_t malformed_ = 0;
  bool end_reported_ = false;
  StreamPosition consumed_;
  std::thread thread_;
};

}  // namespace kiln::data
