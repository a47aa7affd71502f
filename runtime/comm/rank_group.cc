#include "runtime/comm/rank_group.h"

#include <chrono>

namespace kiln::comm {
namespace {

std::vector<size_t> toSizes(const std::vector<int64_t>& v) { return std::vector<size_t>(v.begin(), v.end()); }

}  // namespace

// Counts one blocking call: its time, and what it sends to other ranks.
class CommunicatorRankGroup::Counted {
 public:
  Counted(CommunicatorRankGroup& g, double bytes_sent) : g_(g), start_(std::chrono::steady_clock::now()) {
    g_.stats_.bytes_sent += static_cast<int64_t>(bytes_sent);
    ++g_.stats_.collectives;
  }
  ~Counted() {
    g_.stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  CommunicatorRankGroup& g_;
  std::chrono::steady_clock::time_point start_;
};

double CommunicatorRankGroup::share() const {
  const double n = comm_.size();
  return (n - 1) / n;
}

Status CommunicatorRankGroup::allReduceSum(const void* send, void* recv, int64_t count, ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  // A ring: reduce-scatter then all-gather, each (N-1)/N of the data.
  Counted c(*this, 2 * share() * static_cast<double>(count) * ir::dtypeBytes(t));
  return comm_.allReduceSync(send, recv, static_cast<size_t>(count), dt);
}

Status CommunicatorRankGroup::reduceScatterSum(const void* send, void* recv, int64_t recv_count,
                                               ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  Counted c(*this, share() * static_cast<double>(recv_count * size()) * ir::dtypeBytes(t));
  return comm_.reduceScatterSync(send, recv, static_cast<size_t>(recv_count), dt);
}

Status CommunicatorRankGroup::allGather(const void* send, void* recv, int64_t send_count, ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  Counted c(*this, share() * static_cast<double>(send_count * size()) * ir::dtypeBytes(t));
  return comm_.allGatherSync(send, recv, static_cast<size_t>(send_count), dt);
}

Status CommunicatorRankGroup::allToAll(const void* send, void* recv, int64_t count_per_peer, ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  Counted c(*this, static_cast<double>(count_per_peer * (size() - 1)) * ir::dtypeBytes(t));
  return comm_.allToAllSync(send, recv, static_cast<size_t>(count_per_peer), dt);
}

Status CommunicatorRankGroup::allToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                        const std::vector<int64_t>& recv_counts, int64_t recv_capacity,
                                        ir::DType t) {
  KILN_ASSIGN_OR_RETURN(DataType dt, fromIrDType(t));
  int64_t to_others = 0;
  for (size_t p = 0; p < send_counts.size(); ++p)
    if (static_cast<int>(p) != rank()) to_others += send_counts[p];
  Counted c(*this, static_cast<double>(to_others) * ir::dtypeBytes(t));
  return comm_.allToAllVSync(send, toSizes(send_counts), recv, toSizes(recv_counts),
                             static_cast<size_t>(recv_capacity), dt);
}

Expected<std::vector<int64_t>> CommunicatorRankGroup::exchangeCounts(
    const std::vector<int64_t>& send_counts) {
  Counted c(*this, static_cast<double>(8 * (size() - 1)));
  KILN_ASSIGN_OR_RETURN(auto recv, comm_.exchangeCounts(toSizes(send_counts)));
  return std::vector<int64_t>(recv.begin(), recv.end());
}

}  // namespace kiln::comm
