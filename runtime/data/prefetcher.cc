#include "runtime/data/prefetcher.h"

#include <exception>
#include <new>

#include "runtime/thread_start.h"

namespace kiln::data {

Prefetcher::Prefetcher(std::unique_ptr<BatchReader> reader, int depth)
    : reader_(std::move(reader)), depth_(static_cast<size_t>(std::max(depth, 1))) {
  consumed_ = reader_->position();
  reader_->deferSkipReports();
  // A thread the system refuses (ulimit -u) is the reader's error, reported where the first
  // batch is awaited, instead of an exception out of the constructor.
  auto started = runtime::startThread("cannot start the data prefetcher's thread", [this] { run(); });
  if (started) {
    thread_ = started.take();
  } else {
    error_ = started.status();
    done_ = true;
  }
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  not_full_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Prefetcher::run() {
  for (;;) {
    Batch batch;
    // An exception would escape this thread to std::terminate, past main's handler: a batch too
    // big for memory becomes the reader's error instead, reported where the batch is awaited.
    Expected<bool> got = Status::error("no batch");
    try {
      got = reader_->next(batch);
    } catch (const std::bad_alloc&) {
      got = Status::error("out of memory reading the next batch (lower --batch)");
    } catch (const std::exception& e) {
      got = Status::errorf("reading the next batch failed: {}", e.what());
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (got && *got && staging_) {
      // Into page-locked memory here, off the training thread (outside the lock: a copy of
      // megabytes, and perhaps a wait for the buffer's last upload).
      std::shared_ptr<StagingPool> pool = staging_;
      lock.unlock();
      pool->place(batch);
      lock.lock();
    }
    if (!got || !*got) {
      if (!got) error_ = got.status();
      if (got) skipped_at_end_ = reader_->skippedAtEnd();
      done_ = true;
      not_empty_.notify_all();
      return;
    }
    not_full_.wait(lock, [&] { return stop_ || queue_.size() < depth_; });
    if (stop_) return;
    queue_.push_back(std::move(batch));
    not_empty_.notify_one();
  }
}

void Prefetcher::stageInto(std::shared_ptr<StagingPool> pool) {
  std::lock_guard<std::mutex> lock(mu_);
  staging_ = std::move(pool);
}

Expected<bool> Prefetcher::next(Batch& batch) {
  std::unique_lock<std::mutex> lock(mu_);
  not_empty_.wait(lock, [&] { return !queue_.empty() || done_; });
  if (queue_.empty()) {
    if (!error_.isOk()) return error_;
    if (!end_reported_) {
      end_reported_ = true;
      malformed_ += static_cast<int64_t>(skipped_at_end_.size());
      lock.unlock();
      reader_->reportSkipped(skipped_at_end_);
    }
    return false;
  }
  batch = std::move(queue_.front());
  queue_.pop_front();
  consumed_ = batch.end;
  not_full_.notify_one();
  lock.unlock();
  // Reported here, on the consumer's thread, so a batch read ahead and never used reports nothing.
  malformed_ += static_cast<int64_t>(batch.skipped.size());
  reader_->reportSkipped(batch.skipped);
  return true;
}

}  // namespace kiln::data
