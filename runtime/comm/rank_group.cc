#include "runtime/comm/rank_group.h"

namespace kiln::comm {
namespace {

std::vector<size_t> toSizes(const std::vector<int64_t>& v) { return std::vector<size_t>(v.begin(), v.end()); }

}  // namespace

Status CommunicatorRankGroup::allReduceSum(const void* send, void* recv, int64_t count, ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  return comm_.allReduceSync(send, recv, static_cast<size_t>(count), dt);
}

Status CommunicatorRankGroup::reduceScatterSum(const void* send, void* recv, int64_t recv_count,
                                               ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  return comm_.reduceScatterSync(send, recv, static_cast<size_t>(recv_count), dt);
}

Status CommunicatorRankGroup::allGather(const void* send, void* recv, int64_t send_count, ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  return comm_.allGatherSync(send, recv, static_cast<size_t>(send_count), dt);
}

Status CommunicatorRankGroup::allToAll(const void* send, void* recv, int64_t count_per_peer, ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  return comm_.allToAllSync(send, recv, static_cast<size_t>(count_per_peer), dt);
}

Status CommunicatorRankGroup::allToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                        const std::vector<int64_t>& recv_counts, int64_t recv_capacity,
                                        ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  return comm_.allToAllVSync(send, toSizes(send_counts), recv, toSizes(recv_counts),
                             static_cast<size_t>(recv_capacity), dt);
}

Expected<std::vector<int64_t>> CommunicatorRankGroup::exchangeCounts(
    const std::vector<int64_t>& send_counts) {
  KILN_ASSIGN_OR_RETURN(auto recv, comm_.exchangeCounts(toSizes(send_counts)));
  return std::vector<int64_t>(recv.begin(), recv.end());
}

}  // namespace kiln::comm
