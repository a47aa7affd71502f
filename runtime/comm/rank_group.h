// The IR's rank group (ir/collective.h) over a communicator: what the reference interpreter and
// the CPU executor hand the collective ops so that they run across real ranks (threads of a
// LocalGroup, MPI processes).
#pragma once

#include "ir/collective.h"
#include "runtime/comm/communicator.h"

namespace kiln::comm {

class CommunicatorRankGroup final : public ir::RankGroup {
 public:
  explicit CommunicatorRankGroup(Communicator& comm) : comm_(comm) {}

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
  Communicator& comm_;
};

}  // namespace kiln::comm
