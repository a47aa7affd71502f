// What the collective ops of the op table (ir/ops/collective.cc) need from outside the IR: a
// group of ranks to run their CPU reference over, and the time a collective takes on a
// target's links.
//
// The IR library does not depend on runtime/comm (a layer includes only layers to its left), so
// the group is an abstract interface here; runtime/comm/rank_group.h implements it over a
// comm::Communicator, and the interpreter (ir/interpreter.h) and the CPU executor hand it to
// the reference kernels through CpuContext::ranks. Without a group, a collective of ranks = 1
// is the identity and any other group size is an error.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"
#include "ir/types.h"

namespace kiln::ir {

// A collective issued but perhaps not complete: its send and receive buffers belong to it until
// wait() returns. Waiting twice returns the first wait's status; a default-constructed one is
// complete. Dropping one unwaited does not cancel the transfer, so the buffers must outlive it.
class PendingCollective {
 public:
  PendingCollective() = default;
  explicit PendingCollective(std::function<Status()> wait) : wait_(std::move(wait)) {}
  static PendingCollective done(Status s) {
    return PendingCollective([s] { return s; });
  }
  Status wait() {
    if (wait_) {
      status_ = wait_();
      wait_ = nullptr;
    }
    return status_;
  }

 private:
  std::function<Status()> wait_;
  Status status_ = Status::ok();
};

// This rank's view of its group. Every call blocks until this rank's part is done; buffers are
// host memory, counts are elements of `t`, segments are packed in rank order (as in
// comm::Communicator, whose blocking forms these are). The issue* forms return at once with the
// transfer in flight (the CPU executor overlaps it with compute); by default they run the
// blocking form, for groups that cannot do better.
class RankGroup {
 public:
  virtual ~RankGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // recv[i] = sum over ranks of send[i].
  virtual Status allReduceSum(const void* send, void* recv, int64_t count, DType t) = 0;
  // send holds size() segments of recv_count; rank r gets the sum of every rank's r-th segment.
  virtual Status reduceScatterSum(const void* send, void* recv, int64_t recv_count, DType t) = 0;
  // recv holds size() segments of send_count; segment r is rank r's send.
  virtual Status allGather(const void* send, void* recv, int64_t send_count, DType t) = 0;
  // Segment p of send goes to peer p; segment p of recv comes from peer p.
  virtual Status allToAll(const void* send, void* recv, int64_t count_per_peer, DType t) = 0;
  // send_counts[p] elements to peer p, recv_counts[p] from peer p; recv holds recv_capacity.
  virtual Status allToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                           const std::vector<int64_t>& recv_counts, int64_t recv_capacity, DType t) = 0;
  // What each peer will send here, given what this rank sends each peer.
  virtual Expected<std::vector<int64_t>> exchangeCounts(const std::vector<int64_t>& send_counts) = 0;

  virtual PendingCollective issueAllReduceSum(const void* send, void* recv, int64_t count, DType t) {
    return PendingCollective::done(allReduceSum(send, recv, count, t));
  }
  virtual PendingCollective issueReduceScatterSum(const void* send, void* recv, int64_t recv_count, DType t) {
    return PendingCollective::done(reduceScatterSum(send, recv, recv_count, t));
  }
  virtual PendingCollective issueAllGather(const void* send, void* recv, int64_t send_count, DType t) {
    return PendingCollective::done(allGather(send, recv, send_count, t));
  }
  virtual PendingCollective issueAllToAll(const void* send, void* recv, int64_t count_per_peer, DType t) {
    return PendingCollective::done(allToAll(send, recv, count_per_peer, t));
  }
  virtual PendingCollective issueAllToAllV(const void* send, const std::vector<int64_t>& send_counts,
                                           void* recv, const std::vector<int64_t>& recv_counts,
                                           int64_t recv_capacity, DType t) {
    return PendingCollective::done(allToAllV(send, send_counts, recv, recv_counts, recv_capacity, t));
  }
};

// Whether an op is one of the collectives (all_reduce, reduce_scatter, all_gather, all_to_all,
// all_to_all_v).
bool isCollective(const Op& op);

// Which links a collective's ring crosses.
enum class LinkScope { intra_node, inter_node };

// Seconds one collective takes on `target`'s links of the given scope: each of its ring steps
// pays the link latency, and its bytes on the wire (OpCost::comm_bytes) move at the link rate:
//     steps * latency_s + comm_bytes / bytes_per_s
// with 2(N-1) steps for all_reduce (reduce-scatter then all-gather), N-1 for reduce_scatter and
// all_gather, and 1 for all_to_all and all_to_all_v, whose N-1 messages go at once.
// 0 for an op that is not a collective or a group of one rank.
double collectiveSeconds(const Op& op, const SymbolBindings& symbols, const Target& target, LinkScope scope);

}  // namespace kiln::ir
