// The IR's rank group (ir/collective.h) over a communicator: what the reference interpreter and
// the CPU executor hand the collective ops so that they run across real ranks (threads of a
// LocalGroup, MPI processes).
#pragma once

#include "ir/collective.h"
#include "runtime/comm/communicator.h"

namespace kiln::comm {

// What this rank's collectives cost so far: what they sent to other ranks (a ring's share for
// the reductions and gathers, the rows to other peers for all_to_all), and the time this rank
// was blocked on them: in a blocking call, or in the wait of an issued one (the slowest rank
// included). A transfer that finished while this rank computed costs no seconds.
struct CommStats {
  int64_t bytes_sent = 0;
  double seconds = 0;
  int64_t collectives = 0;
};

class CommunicatorRankGroup final : public ir::RankGroup {
 public:
  explicit CommunicatorRankGroup(Communicator& comm) : comm_(comm) {}
  const CommStats& stats() const { return stats_; }

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  Status allReduceSum(const void* send, void* recv, int64_t count, ir::DType t) override;
  Status reduceScatterSum(const void* send, void* recv, int64_t recv_count, ir::DType t) override;
  Status allGather(const void* send, void* recv, int64_t send_count, ir::DType t) override;
  Status allToAll(const void* send, void* recv, int64_t count_per_peer, ir::DType t) override;
  Status allToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                   const std::vector<int64_t>& recv_counts, int64_t recv_capacity, ir::DType t) override;
  Expected<std::vector<int64_t>> exchangeCounts(const std::vector<int64_t>& send_counts) override;

  ir::PendingCollective issueAllReduceSum(const void* send, void* recv, int64_t count, ir::DType t) override;
  ir::PendingCollective issueReduceScatterSum(const void* send, void* recv, int64_t recv_count,
                                              ir::DType t) override;
  ir::PendingCollective issueAllGather(const void* send, void* recv, int64_t send_count,
                                       ir::DType t) override;
  ir::PendingCollective issueAllToAll(const void* send, void* recv, int64_t count_per_peer,
                                      ir::DType t) override;
  ir::PendingCollective issueAllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                       const std::vector<int64_t>& recv_counts, int64_t recv_capacity,
                                       ir::DType t) override;

 private:
  double share() const;  // (N - 1) / N
  // Counts one issued collective's bytes and returns the wait that times this rank's block.
  ir::PendingCollective counted(double bytes_sent, Request request);

  Communicator& comm_;
  CommStats stats_;
};

}  // namespace kiln::comm
