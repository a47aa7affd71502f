#include "runtime/cpu/thread_pool.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/thread_start.h"

namespace kiln::runtime {

Expected<std::unique_ptr<ThreadPool>> ThreadPool::create(int num_threads) {
  std::unique_ptr<ThreadPool> pool(new ThreadPool());
  KILN_RETURN_IF_ERROR(pool->start(num_threads));
  return pool;
}

ThreadPool::ThreadPool(int num_threads) {
  if (Status s = start(num_threads); !s) throw std::runtime_error(s.message());
}

Status ThreadPool::start(int num_threads) {
  const int n = std::max(num_threads, 1);
  for (int i = 1; i < n; ++i) {
    auto t = startThread(fmt::format("cannot start thread {} of {} (--threads {})", i + 1, n, n),
                         [this] { workerLoop(); });
    if (!t) {
      stop();
      return t.status();
    }
    workers_.push_back(t.take());
  }
  return Status::ok();
}

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::runChunks() {
  for (;;) {
    int64_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return;
    (*fn_)(begin, std::min(n_, begin + chunk_));
  }
}

void ThreadPool::workerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    runChunks();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::parallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = numThreads();
  if (threads == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  // About four chunks per thread balances uneven work without much scheduling traffic.
  int64_t chunk = std::max(grain, (n + threads * 4 - 1) / (threads * 4));
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    next_.store(0, std::memory_order_relaxed);
    active_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  runChunks();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
}

}  // namespace kiln::runtime
