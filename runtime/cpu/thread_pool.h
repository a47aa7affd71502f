// A small fixed thread pool for the CPU kernels (`--threads N`). parallelFor splits a range
// into chunks that workers and the calling thread take in turn; it returns when all are done.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 runs everything on the calling thread. Where the system
  // refuses a thread (ulimit -u), create() returns the error (runtime/thread_start.h) and the
  // constructor throws it as a std::runtime_error, both after joining the workers it started.
  static Expected<std::unique_ptr<ThreadPool>> create(int num_threads);
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int numThreads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) over disjoint chunks covering [0, n), each at least `grain` long
  // (except the last), from up to numThreads() threads. Not reentrant: fn must not call
  // parallelFor on the same pool.
  void parallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  ThreadPool() = default;
  Status start(int num_threads);
  void stop();
  void workerLoop();
  void runChunks();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  uint64_t generation_ = 0;  // bumped for each parallelFor
  int active_ = 0;           // workers still inside the current job

  // The current job.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

}  // namespace kiln::runtime
