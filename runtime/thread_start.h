// Starting a thread where the system may refuse one. std::thread throws std::system_error when it
// cannot start a thread (EAGAIN: the limit on a user's processes and threads, RLIMIT_NPROC or
// `ulimit -u`, or the system's threads-max); a thread object destroyed while still joinable
// terminates the process. startThread turns the refusal into a Status that names the limit, so
// that a pool or group that started some of its threads can stop and join them, and fail.
//
// Header-only: the comm library (in-process ranks) and the CPU runtime (the kernel thread pool)
// both start threads and share no library below kiln_ir.
#pragma once

#include <fmt/format.h>
#include <sys/resource.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "ir/status.h"

namespace kiln::runtime {

namespace detail {
// Tests: how many more thread starts succeed before each fails as under the limit; -1: all succeed.
inline std::atomic<int64_t> thread_starts_left{-1};
}  // namespace detail

// Tests: the next `n` thread starts succeed and every later one fails as if the system refused it
// (EAGAIN), until failThreadStartsAfter(-1).
inline void failThreadStartsAfter(int64_t n) { detail::thread_starts_left.store(n); }

// "cannot start a thread: Resource temporarily unavailable (at most 40 processes and threads for
// this user: ulimit -u)". `what` says which thread ("cannot start rank 3's thread").
inline std::string threadStartFailure(const std::string& what, const std::system_error& e) {
  std::string limit;
  rlimit r{};
  if (e.code() == std::errc::resource_unavailable_try_again) {
    if (getrlimit(RLIMIT_NPROC, &r) == 0 && r.rlim_cur != RLIM_INFINITY)
      limit = fmt::format(
          " (at most {} processes and threads for this user: ulimit -u; fewer --threads "
          "or --ranks need fewer)",
          static_cast<uint64_t>(r.rlim_cur));
    else
      limit = " (the system's limit on threads, /proc/sys/kernel/threads-max, or memory for their stacks)";
  }
  return fmt::format("{}: {}{}", what, e.code().message(), limit);
}

// std::thread(fn), or the error of a system that cannot start it (threadStartFailure's message).
template <typename F>
Expected<std::thread> startThread(const std::string& what, F&& fn) {
  try {
    int64_t left = detail::thread_starts_left.load();
    while (left > 0 && !detail::thread_starts_left.compare_exchange_weak(left, left - 1)) {
    }
    if (left == 0) throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
    return std::thread(std::forward<F>(fn));
  } catch (const std::system_error& e) {
    return Status::error(threadStartFailure(what, e));
  }
}

}  // namespace kiln::runtime
