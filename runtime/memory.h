// How much memory a run needs and how much it may have, checked before anything large is
// allocated: a run that cannot fit stops with the largest consumers and the shortfall instead of
// meeting the OOM killer (or std::bad_alloc under `ulimit -v`) minutes later.
//
// What the run may have is the smallest of: MemAvailable (/proc/meminfo), the cgroup's limit less
// its usage (v2 memory.max, v1 memory.limit_in_bytes, over the cgroup and its ancestors), the
// address-space and data rlimits less what the process already maps, and --memory-limit. The
// parsers take text so that tests feed them strings.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

// "8G", "512M", "1.5GiB", "100k", "4000000000" (bytes). K, M, G, T alone or with "iB" are powers
// of 1024; with "B" (KB, MB, GB, TB) powers of 1000, as GNU coreutils reads sizes. Case is ignored.
Expected<uint64_t> parseByteSize(std::string_view text);

// "512 bytes", "1.5 KiB", "97.8 GiB": three significant digits in binary units.
std::string formatBytes(uint64_t bytes);

// The bytes of MemAvailable in /proc/meminfo text.
std::optional<uint64_t> parseMemAvailable(std::string_view meminfo);
// A cgroup limit file (memory.max: "max" or bytes; memory.limit_in_bytes: bytes, where values
// near 2^63 mean none). nullopt: no limit or unreadable text.
std::optional<uint64_t> parseCgroupLimit(std::string_view text);
// A plain number file (memory.current, memory.usage_in_bytes).
std::optional<uint64_t> parseCgroupNumber(std::string_view text);
// `key value` lines (memory.stat): the value of `key`.
std::optional<uint64_t> parseKeyValue(std::string_view text, std::string_view key);
// "VmSize:   123 kB" lines (/proc/self/status): bytes of `key`.
std::optional<uint64_t> parseStatusKb(std::string_view status, std::string_view key);

// The cgroup paths of /proc/self/cgroup text: the v2 path ("0::/a/b") and the v1 memory
// controller's path ("4:memory:/a/b"); empty when absent.
struct CgroupPaths {
  std::string v2, v1_memory;
};
CgroupPaths parseProcSelfCgroup(std::string_view text);

// What the run may still allocate and which limit set it.
struct MemoryLimit {
  std::optional<uint64_t> bytes;  // nullopt: nothing limits it (or nothing could be read)
  // What set it: "--memory-limit", "MemAvailable in /proc/meminfo", "the cgroup limit in
  // /sys/fs/cgroup/.../memory.max (8 GiB, 1.2 GiB of it in use)", "the address-space limit ...".
  std::string source;
  // The address-space limit (ulimit -v) set it: reserved address space counts as used, so the
  // threads' stacks and the GEMM library's code count too (addressSpaceReserve).
  bool address_space = false;
};

// Under an address-space limit, what a run reserves beyond its tensors: a stack (RLIMIT_STACK,
// 8 MiB by default) for each thread besides the caller's (`threads` - 1 kernel pool workers,
// as many OpenMP workers for the GEMMs, and the prefetcher) and 40 MiB for what maps after the
// check (oneDNN's JIT code and primitives, the OpenMP runtime): measured on DLRM-DCNv2, where
// less left oneDNN failing inside a kernel's creation (SIGSEGV). Counted only there: elsewhere
// it is address space, not memory.
uint64_t addressSpaceReserve(int threads);

// The smallest of the machine's limits and `flag_limit` (--memory-limit), measured now.
MemoryLimit availableMemory(std::optional<uint64_t> flag_limit);

// Under an address-space limit (ulimit -v), where reserved address space counts as used: limits
// malloc to its main arena (M_ARENA_MAX 1), so that each thread does not reserve a 64 MiB heap of
// its own. Without it a few threads' heaps took the space the GEMM library's JIT and workspace
// need, and oneDNN, failing to allocate inside a kernel's creation, crashed (SIGSEGV) or threw
// through pthread_once (abort, or the other threads waiting on it forever). Call before starting
// threads; returns whether the limit applied.
bool singleHeapUnderAddressLimit();

// For an allocation that failed after the memory check passed (a library's workspace, thread
// stacks and code under `ulimit -v` count too): "out of memory: 12 MiB left under the
// address-space limit RLIMIT_AS, ulimit -v (293 MiB, 281 MiB of it already mapped)".
std::string outOfMemoryNote();

// One thing a run allocates: a parameter, the training step's arena, the data buffers.
struct MemoryConsumer {
  std::string what;  // `parameter "tables.0"`, `@train_step's activations (planned arena)`
  std::string kind;  // "weights", "optimizer state", "activations", "workspace", "data buffers", ...
  uint64_t bytes = 0;
};

struct MemoryNeed {
  std::vector<MemoryConsumer> consumers;
  void add(std::string what, std::string kind, uint64_t bytes) {
    consumers.push_back({std::move(what), std::move(kind), bytes});
  }
  // The sum; nullopt when it does not fit in 64 bits.
  std::optional<uint64_t> total() const;
  // Per kind, in the order kinds first appear.
  std::vector<std::pair<std::string, uint64_t>> byKind() const;
};

// Ok when `need` fits `limit`; otherwise an error naming the total, the limit and its source, the
// shortfall, the largest `top` consumers and the bytes of each kind.
Status checkMemoryFits(const MemoryNeed& need, const MemoryLimit& limit, size_t top = 3);

}  // namespace kiln::runtime
