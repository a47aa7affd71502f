// The CUDA kernel language on the host, for running Kiln's generated kernels without a GPU.
//
// simt::HostModule force-includes this header ahead of a codegen::CudaModule's source and builds
// both with the host C++ compiler into a shared object. The source is the text NVRTC compiles,
// unchanged: this header gives its CUDA words host meanings.
//   - A launch runs its blocks one after another. The threads of a block are fibers (ucontext)
//     on one OS thread, each resumed until it finishes or waits at a barrier, so __syncthreads
//     and warp shuffles keep CUDA's semantics, and __shared__ (a function-local static here) is
//     shared by the block that runs.
//   - Atomics are plain read-modify-writes: only one fiber runs at a time.
//   - Mistakes the GPU would make silently or hang on are errors naming the kernel, block and
//     thread: a barrier some threads never reach (deadlock), a warp shuffle with an exited lane,
//     and a memory access fault (the harness places buffers against inaccessible pages).
// Not modelled: concurrency between blocks (a race between blocks goes unseen), the memory
// model, and the GPU's math library (glibc's expf may differ in the last bit).
#pragma once

#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <string>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct kiln_simt_dim3 {
  unsigned x = 1, y = 1, z = 1;
};
// The running thread's coordinates, set by the scheduler before it resumes a fiber.
inline kiln_simt_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace kiln_simt {

enum class State : unsigned char { Ready, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
  ucontext_t context;
  State state = State::Ready;
};

struct Launch {
  void (*body)(void**) = nullptr;
  void** args = nullptr;
  const char* kernel = "";
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = -1;
  std::vector<unsigned long long> lanes;  // one exchange slot per thread, for shuffles
  std::string error;
};

inline Launch* running = nullptr;

// Fiber stacks: mapped once, grown on demand, committed lazily by the kernel.
constexpr size_t kStackBytes = 64 << 10;
inline char* stacks = nullptr;
inline size_t stacks_for = 0;

inline bool reserveStacks(size_t threads) {
  if (threads <= stacks_for) return true;
  if (stacks) munmap(stacks, stacks_for * kStackBytes);
  void* p = mmap(nullptr, threads * kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    stacks = nullptr;
    stacks_for = 0;
    return false;
  }
  stacks = static_cast<char*>(p);
  stacks_for = threads;
  return true;
}

inline std::string where() {
  char at[96];
  snprintf(at, sizeof at, " (block %u, thread %u)", blockIdx.x, threadIdx.x);
  return at;
}

// Suspends the running fiber in state `s` until the scheduler releases it.
inline void wait(State s) {
  Launch& l = *running;
  Fiber& f = l.fibers[static_cast<size_t>(l.current)];
  f.state = s;
  swapcontext(&f.context, &l.scheduler);
}

inline void fiberEntry() {
  running->body(running->args);
  running->fibers[static_cast<size_t>(running->current)].state = State::Done;
  // Returning resumes uc_link: the scheduler.
}

// A memory fault inside a kernel ends its launch with an error instead of the process.
inline void onFault(int sig, siginfo_t* info, void*) {
  if (!running || running->current < 0) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  char what[128];
  snprintf(what, sizeof what, "a memory access fault at address %p", info->si_addr);
  running->error = std::string(what) + where();
  setcontext(&running->scheduler);  // back into the scheduler, with its signal mask
}

// Releases the barrier the block's fibers wait at, if it is complete. False when the block can
// make no progress (an error is set) or when every thread is done.
inline bool release(Launch& l) {
  const size_t n = l.fibers.size();
  size_t done = 0, at_block = 0, at_warp = 0;
  for (const Fiber& f : l.fibers) {
    done += f.state == State::Done;
    at_block += f.state == State::AtBlockBarrier;
    at_warp += f.state == State::AtWarpBarrier;
  }
  if (done == n) return false;
  bool released = false;
  // A warp's shuffle completes when all of its lanes are there.
  for (size_t w = 0; w * 32 < n; ++w) {
    const size_t lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
    size_t waiting = 0, exited = 0;
    for (size_t t = lo; t < hi; ++t) {
      waiting += l.fibers[t].state == State::AtWarpBarrier;
      exited += l.fibers[t].state == State::Done;
    }
    if (waiting == hi - lo) {
      for (size_t t = lo; t < hi; ++t) l.fibers[t].state = State::Ready;
      released = true;
    } else if (waiting && exited) {
      char msg[160];
      snprintf(msg, sizeof msg, "a warp shuffle in warp %zu of block %u waits for lanes that have exited", w, blockIdx.x);
      l.error = msg;
      return false;
    }
  }
  if (released) return true;
  // __syncthreads completes when every thread that has not exited is there.
  if (at_block && at_block + done == n) {
    for (Fiber& f : l.fibers)
      if (f.state == State::AtBlockBarrier) f.state = State::Ready;
    return true;
  }
  char msg[200];
  snprintf(msg, sizeof msg,
           "block %u deadlocks: %zu threads wait at __syncthreads, %zu at a warp shuffle, %zu have exited (a barrier "
           "not every thread reaches)",
           blockIdx.x, at_block, at_warp, done);
  l.error = msg;
  return false;
}

// Runs `body` as a <<<grid, block>>> launch. Returns 0, or 1 with `err` holding the error.
inline int launch(void (*body)(void**), void** args, long long grid, int block, const char* kernel, char* err,
                  int err_bytes) {
  auto fail = [&](const std::string& message) {
    snprintf(err, static_cast<size_t>(err_bytes), "%s: %s", kernel, message.c_str());
    return 1;
  };
  if (grid < 1 || grid > (1LL << 31) - 1 || block < 1 || block > 1024)
    return fail("launch <<<" + std::to_string(grid) + ", " + std::to_string(block) + ">>> is out of CUDA's limits");
  if (!reserveStacks(static_cast<size_t>(block))) return fail("cannot map fiber stacks");
  Launch l;
  l.body = body;
  l.args = args;
  l.kernel = kernel;
  l.fibers.resize(static_cast<size_t>(block));
  l.lanes.resize(static_cast<size_t>(block));
  struct sigaction fault = {}, old_segv = {}, old_bus = {};
  fault.sa_sigaction = onFault;
  fault.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&fault.sa_mask);
  sigaction(SIGSEGV, &fault, &old_segv);
  sigaction(SIGBUS, &fault, &old_bus);
  running = &l;
  blockDim = {static_cast<unsigned>(block), 1, 1};
  gridDim = {static_cast<unsigned>(grid), 1, 1};
  for (long long b = 0; b < grid && l.error.empty(); ++b) {
    blockIdx = {static_cast<unsigned>(b), 0, 0};
    for (int t = 0; t < block; ++t) {
      Fiber& f = l.fibers[static_cast<size_t>(t)];
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = stacks + static_cast<size_t>(t) * kStackBytes;
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = &l.scheduler;
      makecontext(&f.context, fiberEntry, 0);
      f.state = State::Ready;
    }
    while (l.error.empty()) {
      for (int t = 0; t < block && l.error.empty(); ++t) {
        Fiber& f = l.fibers[static_cast<size_t>(t)];
        if (f.state != State::Ready) continue;
        l.current = t;
        threadIdx = {static_cast<unsigned>(t), 0, 0};
        swapcontext(&l.scheduler, &f.context);
        l.current = -1;
      }
      if (!l.error.empty() || !release(l)) break;
    }
  }
  running = nullptr;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  return l.error.empty() ? 0 : fail(l.error);
}

// Exchanges `v` among the lanes of the running thread's warp: returns lane `src`'s value (the
// caller's own when src is outside the warp). Every lane of the warp must call it.
template <typename T>
inline T shuffle(T v, int src) {
  static_assert(sizeof(T) <= sizeof(unsigned long long), "a shuffle moves at most 8 bytes");
  Launch& l = *running;
  const unsigned lane = threadIdx.x & 31u, first = threadIdx.x - lane;
  const unsigned lanes = blockDim.x - first < 32u ? blockDim.x - first : 32u;
  memcpy(&l.lanes[threadIdx.x], &v, sizeof(T));
  wait(State::AtWarpBarrier);  // every lane has published
  T r = v;
  if (src >= 0 && static_cast<unsigned>(src) < lanes) memcpy(&r, &l.lanes[first + static_cast<unsigned>(src)], sizeof(T));
  wait(State::AtWarpBarrier);  // every lane has read before the slots are reused
  return r;
}

// Calls a kernel with its pointer arguments, typed as the kernel declares them.
template <typename... P, size_t... I>
inline void callWith(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(static_cast<P>(args[I])...);
}
template <typename... P>
inline void call(void (*kernel)(P...), void** args) {
  callWith(kernel, args, std::index_sequence_for<P...>{});
}

template <typename T>
inline T bitCast(const void* from) {
  T to;
  memcpy(&to, from, sizeof to);
  return to;
}

}  // namespace kiln_simt

inline void __syncthreads() { kiln_simt::wait(kiln_simt::State::AtBlockBarrier); }

template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) {
  return kiln_simt::shuffle(v, src & 31);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return kiln_simt::shuffle(v, static_cast<int>(threadIdx.x & 31u) ^ mask);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int = 32) {
  const int src = static_cast<int>(threadIdx.x & 31u) - static_cast<int>(delta);
  return kiln_simt::shuffle(v, src < 0 ? static_cast<int>(threadIdx.x & 31u) : src);
}

// Atomics: one fiber runs at a time, so a read-modify-write is atomic.
template <typename T>
inline T kiln_simt_rmw_add(T* p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
inline float atomicAdd(float* p, float v) { return kiln_simt_rmw_add(p, v); }
inline double atomicAdd(double* p, double v) { return kiln_simt_rmw_add(p, v); }
inline int atomicAdd(int* p, int v) { return kiln_simt_rmw_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return kiln_simt_rmw_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return kiln_simt_rmw_add(p, v); }
template <typename T>
inline T kiln_simt_cas(T* p, T compare, T v) {
  T old = *p;
  if (old == compare) *p = v;
  return old;
}
inline int atomicCAS(int* p, int c, int v) { return kiln_simt_cas(p, c, v); }
inline unsigned atomicCAS(unsigned* p, unsigned c, unsigned v) { return kiln_simt_cas(p, c, v); }
inline unsigned short atomicCAS(unsigned short* p, unsigned short c, unsigned short v) { return kiln_simt_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) {
  return kiln_simt_cas(p, c, v);
}
inline int atomicExch(int* p, int v) {
  int old = *p;
  *p = v;
  return old;
}

inline float __int_as_float(int i) { return kiln_simt::bitCast<float>(&i); }
inline float __uint_as_float(unsigned u) { return kiln_simt::bitCast<float>(&u); }
inline unsigned __float_as_uint(float f) { return kiln_simt::bitCast<unsigned>(&f); }
inline double __longlong_as_double(long long i) { return kiln_simt::bitCast<double>(&i); }
