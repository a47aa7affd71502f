#include "runtime/data/prefetcher.h"

namespace kiln::data {

Prefetcher::Prefetcher(std::unique_ptr<BatchReader> reader, int depth)
    : reader_(std::move(reader)), depth_(static_cast<size_t>(std::max(depth, 1))) {
  consumed_ = reader_->position();
  thread_ = std::thread([this] { run(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  not_full_.notify_all();
  thread_.join();
}

void Prefetcher::run() {
  for (;;) {
    Batch batch;
    Expected<bool> got = reader_->next(batch);
    std::unique_lock<std::mutex> lock(mu_);
    malformed_ = reader_->malformed();
    if (!got || !*got) {
      if (!got) error_ = got.status();
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

Expected<bool> Prefetcher::next(Batch& batch) {
  std::unique_lock<std::mutex> lock(mu_);
  not_empty_.wait(lock, [&] { return !queue_.empty() || done_; });
  if (queue_.empty()) {
    if (!error_.isOk()) return error_;
    return false;
  }
  batch = std::move(queue_.front());
  queue_.pop_front();
  consumed_ = batch.end;
  not_full_.notify_one();
  return true;
}

int64_t Prefetcher::malformed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return malformed_;
}

}  // namespace kiln::data
