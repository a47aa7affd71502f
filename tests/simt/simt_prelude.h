// The CUDA kernel language on the host, for running Kiln's generated kernels without a GPU.
//
// simt::HostModule force-includes this header ahead of a codegen::CudaModule's source and builds
// both with the host C++ compiler into a shared object. The source is the text NVRTC compiles,
// unchanged: this header gives its CUDA words host meanings.
//   - A launch runs its blocks one after another. The threads of a block are fibers on one OS
//     thread, each resumed until it finishes or waits at a barrier, so __syncthreads and warp
//     shuffles keep CUDA's semantics, and __shared__ (a function-local static here) is shared
//     by the block that runs. Blocks, and threads between barriers, run in a shuffled order.
//   - Atomics are plain read-modify-writes: only one fiber runs at a time.
//   - Mistakes the GPU would make silently or hang on are errors naming the kernel, block and
//     thread: a barrier some threads never reach (deadlock), a warp shuffle with an exited lane,
//     and a memory access fault (the harness places buffers against inaccessible pages).
// Not modelled: threads truly at once (a race is seen only through the order it leaves results
// in), the memory model, and the GPU's math library (glibc's expf may differ in the last bit).
#pragma once

#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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
#define __align__(n) __attribute__((aligned(n)))

struct kiln_simt_dim3 {
  unsigned x = 1, y = 1, z = 1;
};
// The running thread's coordinates, set by the scheduler before it resumes a fiber.
inline kiln_simt_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace kiln_simt {

enum class State : unsigned char { Ready, AtBlockBarrier, AtWarpBarrier, Done };

// Switching between fibers. On x86-64 a few instructions save the callee-saved registers and
// the floating-point control words on the old stack and restore them from the new one
// (glibc's swapcontext makes a system call per switch for the signal mask, which dominated the
// run time); elsewhere ucontext does it.
#if defined(__x86_64__)
extern "C" void kiln_simt_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .hidden kiln_simt_switch
  .type kiln_simt_switch, @function
kiln_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kiln_simt_switch, .-kiln_simt_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void switchContext(Context& from, Context& to) { kiln_simt_switch(&from.sp, to.sp); }
// A context that starts `entry` (which must never return) on [stack, stack + bytes).
inline void makeContext(Context& c, char* stack, size_t bytes, Context&, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                          // entry's return address: it never returns
  *--sp = reinterpret_cast<void*>(entry);   // where kiln_simt_switch's ret goes
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
  *--sp = reinterpret_cast<void*>(uintptr_t{0x037F} << 32 | 0x1F80);  // x87 control word, MXCSR
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switchContext(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void makeContext(Context& c, char* stack, size_t bytes, Context& link, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = &link.uc;
  makecontext(&c.uc, entry, 0);
}
#endif

struct Fiber {
  Context context;
  State state = State::Ready;
};

struct Launch {
  void (*body)(void**) = nullptr;
  void** args = nullptr;
  const char* kernel = "";
  std::vector<Fiber> fibers;
  Context scheduler;
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
  switchContext(f.context, l.scheduler);
}

[[noreturn]] inline void fiberEntry() {
  running->body(running->args);
  Fiber& f = running->fibers[static_cast<size_t>(running->current)];
  f.state = State::Done;
  switchContext(f.context, running->scheduler);  // never resumed
  __builtin_unreachable();
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
  // Back into the scheduler, abandoning the fiber (SA_NODEFER left the signal unblocked).
  Fiber& f = running->fibers[static_cast<size_t>(running->current)];
  switchContext(f.context, running->scheduler);
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
  // Blocks, and the threads of a block between barriers, run in a shuffled order drawn from
  // the kernel's name: the same every run (so results repeat bit for bit), but not index order,
  // so code that assumes an order the GPU does not promise (a missing __syncthreads, block 0
  // finishing first) computes wrong results here rather than passing by luck.
  // KILN_SIMT_SEED (a number; unset or 0: none) is mixed in, so a test can run the same kernels
  // in other orders and require the same bits (tests/simt/simt_embedding_backward_test.cc).
  unsigned long long rng = 0x9E3779B97F4A7C15ull;
  if (const char* seed = getenv("KILN_SIMT_SEED")) rng ^= strtoull(seed, nullptr, 0) * 0xD1B54A32D192ED03ull;
  for (const char* c = kernel; *c; ++c) rng = (rng ^ static_cast<unsigned char>(*c)) * 0x100000001B3ull;
  auto next = [&rng](unsigned long long n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return n ? rng % n : 0;
  };
  auto shuffled = [&](std::vector<unsigned>& order, size_t n) {
    order.resize(n);
    for (size_t i = 0; i < n; ++i) order[i] = static_cast<unsigned>(i);
    for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[next(i)]);
  };
  std::vector<unsigned> blocks, threads;
  shuffled(blocks, static_cast<size_t>(grid));
  for (size_t bi = 0; bi < blocks.size() && l.error.empty(); ++bi) {
    blockIdx = {blocks[bi], 0, 0};
    shuffled(threads, static_cast<size_t>(block));
    for (int t = 0; t < block; ++t) {
      Fiber& f = l.fibers[static_cast<size_t>(t)];
      makeContext(f.context, stacks + static_cast<size_t>(t) * kStackBytes, kStackBytes, l.scheduler, fiberEntry);
      f.state = State::Ready;
    }
    while (l.error.empty()) {
      for (size_t i = 0; i < threads.size() && l.error.empty(); ++i) {
        const unsigned t = threads[i];
        Fiber& f = l.fibers[t];
        if (f.state != State::Ready) continue;
        l.current = static_cast<int>(t);
        threadIdx = {t, 0, 0};
        switchContext(l.scheduler, f.context);
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

// The lanes of the running thread's warp whose `pred` holds, bit i for lane i. Every lane of the
// warp must call it.
inline unsigned ballot(bool pred) {
  Launch& l = *running;
  const unsigned lane = threadIdx.x & 31u, first = threadIdx.x - lane;
  const unsigned lanes = blockDim.x - first < 32u ? blockDim.x - first : 32u;
  l.lanes[threadIdx.x] = pred ? 1 : 0;
  wait(State::AtWarpBarrier);  // every lane has published
  unsigned bits = 0;
  for (unsigned i = 0; i < lanes; ++i) bits |= (l.lanes[first + i] ? 1u : 0u) << i;
  wait(State::AtWarpBarrier);  // every lane has read before the slots are reused
  return bits;
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

inline unsigned __ballot_sync(unsigned, int pred) { return kiln_simt::ballot(pred != 0); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

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
