// The communication runtime: one interface over a group of ranks, with three backends
// (in-process threads: local_group.h; MPI processes: mpi_communicator.h; NCCL on GPUs:
// nccl_communicator.h). The collectives are the ones the IR's collective ops lower to.
//
// Semantics every backend keeps (MPI's and NCCL's):
//  - every rank issues the same collectives in the same order; the n-th collective of one rank
//    meets the n-th of every other (a mismatch in kind, type or count is an error, where the
//    backend can see it);
//  - issuing never blocks on peers: it returns a Request; the buffers stay owned by the
//    collective until the request completes (wait() or test() says so);
//  - counts are elements, not bytes; offsets are implied by packing (segment of peer p follows
//    that of p-1);
//  - every rank gets the same sum; the local backend adds in rank order (f16 and bf16 in f32,
//    rounded once), MPI and NCCL in their own algorithms' order (f16 and bf16 round per step);
//  - send and recv do not overlap, except in the in-place forms noted below;
//  - an operation not complete within timeout() fails with a Status naming the collective, its
//    sequence number, this rank and the late rank where the backend knows it, e.g.
//    "all_to_all #17 on rank 2: rank 3 did not arrive within 300 s". After a failure or an
//    abort the communicator is broken: every later operation fails at once, with the first
//    error. Nothing waits forever.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"
#include "ir/types.h"

namespace kiln::comm {

// Element types of the collectives. ir::DType lacks a byte type (for raw payloads such as the
// NCCL unique id), so this is its own small enum; fromIrDType converts.
enum class DataType : uint8_t { f32, f16, bf16, f64, i32, i64, u8 };

std::string_view dataTypeName(DataType t);
size_t dataTypeBytes(DataType t);
// i1 travels as u8; f8 types have no sum here and are refused.
Expected<DataType> fromIrDType(ir::DType t);

enum class CollectiveKind : uint8_t {
  AllReduce,
  ReduceScatter,
  ReduceScatterV,
  AllGather,
  AllGatherV,
  AllToAll,
  AllToAllV,
  Broadcast,
  Barrier,
};
std::string_view collectiveName(CollectiveKind k);

// Where a backend's buffers live: host memory (local, MPI) or device memory (NCCL).
enum class MemorySpace : uint8_t { Host, Device };

// The default of Communicator::timeout(): long enough for a slow peer's compilation or a
// checkpoint write, short enough that a lost peer does not hold a job for hours.
inline constexpr std::chrono::milliseconds kDefaultTimeout{300'000};

// "300 s", "1.5 s", "250 ms": how messages print a timeout.
std::string formatDuration(std::chrono::milliseconds d);

// What one backend's outstanding operation exposes to a Request.
class RequestState {
 public:
  virtual ~RequestState() = default;
  // Non-blocking: true when complete, false while running, or the operation's error.
  virtual Expected<bool> test() = 0;
  // Blocks until complete, failed or timed out (the backend's deadline).
  virtual Status wait() = 0;
  // The CUDA event (a CUevent) recorded after the operation on its stream, for a compute
  // stream to wait on without blocking the host; nullptr on host backends.
  virtual void* cudaEvent() const { return nullptr; }
};

// A handle to one outstanding collective. Cheap to copy; an empty Request (default) is
// complete. Dropping a Request does not cancel the operation, but its buffers must stay alive
// until it completes: wait on every request before freeing them.
class Request {
 public:
  Request() = default;
  explicit Request(std::shared_ptr<RequestState> state) : state_(std::move(state)) {}
  // An operation that failed when issued (a bad argument, a broken communicator).
  static Request failed(Status s);

  Expected<bool> test() { return state_ ? state_->test() : Expected<bool>(true); }
  Status wait() { return state_ ? state_->wait() : Status::ok(); }
  void* cudaEvent() const { return state_ ? state_->cudaEvent() : nullptr; }

 private:
  std::shared_ptr<RequestState> state_;
};

// Waits on every request, returning the first error (but waiting on all of them, so that no
// buffer is still in use when this returns).
Status waitAll(std::vector<Request>& requests);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backendName() const = 0;
  virtual MemorySpace memorySpace() const { return MemorySpace::Host; }

  // The per-operation timeout, counted from the moment this rank issues the operation.
  std::chrono::milliseconds timeout() const { return timeout_; }
  void setTimeout(std::chrono::milliseconds t) { timeout_ = t; }

  // --- Non-blocking collectives. Each returns at once; the Request completes the operation.
  // In-place use follows NCCL: allReduce with send == recv; reduceScatter with recv pointing at
  // this rank's segment of send; allGather with send pointing at this rank's segment of recv.

  // recv[i] = sum over ranks of send[i], i < count.
  virtual Request allReduce(const void* send, void* recv, size_t count, DataType t) = 0;
  // send holds size() segments of recv_count; rank r receives the sum of every rank's r-th.
  virtual Request reduceScatter(const void* send, void* recv, size_t recv_count, DataType t) = 0;
  // Uneven segments: send holds sum(recv_counts) elements, rank r receives the sum of the
  // segments [offset_r, offset_r + recv_counts[r]). recv_counts has size() entries, the same on
  // every rank. (Row-wise shards of a table whose rows do not divide by N.)
  virtual Request reduceScatterV(const void* send, void* recv, const std::vector<size_t>& recv_counts,
                                 DataType t) = 0;
  // recv holds size() segments of send_count; segment r is rank r's send.
  virtual Request allGather(const void* send, void* recv, size_t send_count, DataType t) = 0;
  // Uneven segments, the mirror (and gradient) of reduceScatterV: rank r sends counts[r].
  virtual Request allGatherV(const void* send, void* recv, const std::vector<size_t>& counts, DataType t) = 0;
  // send holds size() segments of count, segment p for peer p; recv segment p comes from p.
  virtual Request allToAll(const void* send, void* recv, size_t count_per_peer, DataType t) = 0;
  // Variable splits: this rank sends send_counts[p] elements to peer p (packed in peer order)
  // and receives recv_counts[p] from peer p (packed in peer order) into recv, which holds
  // recv_capacity elements (the bounded dim's bound: more is an error, never an overflow).
  // recv_counts must equal what the peers send; exchangeCounts() finds them.
  virtual Request allToAllV(const void* send, const std::vector<size_t>& send_counts, void* recv,
                            const std::vector<size_t>& recv_counts, size_t recv_capacity, DataType t) = 0;
  // buf (count elements) on root is copied to buf on every other rank.
  virtual Request broadcast(void* buf, size_t count, DataType t, int root) = 0;
  virtual Request barrierAsync() = 0;

  // Breaks the group: every rank's pending and later operations fail with a message that
  // names this rank and `reason` (on MPI the peers hear of it over a side channel; on NCCL the
  // communicator is aborted). Idempotent; the first reason wins.
  virtual void abort(const std::string& reason) = 0;

  // --- Blocking forms: issue and wait.
  Status allReduceSync(const void* send, void* recv, size_t count, DataType t) {
    return allReduce(send, recv, count, t).wait();
  }
  Status reduceScatterSync(const void* send, void* recv, size_t recv_count, DataType t) {
    return reduceScatter(send, recv, recv_count, t).wait();
  }
  Status allGatherSync(const void* send, void* recv, size_t send_count, DataType t) {
    return allGather(send, recv, send_count, t).wait();
  }
  Status allToAllSync(const void* send, void* recv, size_t count_per_peer, DataType t) {
    return allToAll(send, recv, count_per_peer, t).wait();
  }
  Status allToAllVSync(const void* send, const std::vector<size_t>& send_counts, void* recv,
                       const std::vector<size_t>& recv_counts, size_t recv_capacity, DataType t) {
    return allToAllV(send, send_counts, recv, recv_counts, recv_capacity, t).wait();
  }
  Status broadcastSync(void* buf, size_t count, DataType t, int root) {
    return broadcast(buf, count, t, root).wait();
  }
  Status barrier() { return barrierAsync().wait(); }

  // The first step of a variable all_to_all: tells every peer how much this rank will send it
  // (an all_to_all of one i64 per peer) and returns what each peer will send here. Host
  // backends only (NCCL's counts live on the device; its caller copies them).
  Expected<std::vector<size_t>> exchangeCounts(const std::vector<size_t>& send_counts);

 private:
  std::chrono::milliseconds timeout_ = kDefaultTimeout;
};

// --- Shared by the backends.

// "all_to_all #17 on rank 2": how every message names one operation. Sequence numbers count
// this communicator's collectives from 1, so the same number names the same collective on
// every rank.
std::string operationName(CollectiveKind k, uint64_t seq, int rank);

// The argument checks every backend makes before issuing (counts of the right length, a root
// in range, a capacity that holds what arrives).
Status checkCounts(const std::vector<size_t>& counts, int size, const char* what);
Status checkRoot(int root, int size);

// Host arithmetic: acc[i] (f32, or the type itself for f64/i32/i64/u8) += src[i], and the
// conversions between storage and accumulator, so a sum over ranks rounds once.
// `acc` holds count elements of accumulatorType(t).
DataType accumulatorType(DataType t);
void accumulate(DataType t, const void* src, void* acc, size_t count, bool first);
void storeAccumulator(DataType t, const void* acc, void* dst, size_t count);

uint16_t floatToF16(float f);
float f16ToFloat(uint16_t h);

}  // namespace kiln::comm
