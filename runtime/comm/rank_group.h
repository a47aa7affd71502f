// The IR's rank group (ir/collective.h) over a communicator: what the reference interpreter and
// the CPU executor hand the collective ops so that they run across real ranks (threads of a
// LocalGroup, MPI processes).
#pragma once

#include "ir/collective.h"
#include "runtime/comm/communicator.h"

namespace kiln::comm {

// What this rank's collectives cost so far: what they sent to other ranks (a ring's share for
// the reductions and gathers, the rows to other peers for all_to_all), and the time spent in
// them (waiting for the slowest rank included).
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

 private:
  class Counted;
  double share() const;  // (N - 1) / N

  Communicator& comm_;
  CommStats stats_;
};

}  // namespace kiln::comm
