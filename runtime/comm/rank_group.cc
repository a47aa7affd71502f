#include "runtime/comm/rank_group.h"

#include <chrono>

namespace kiln::comm {
namespace {

std::vector<size_t> toSizes(const std::vector<int64_t>& v) { return std::vector<size_t>(v.begin(), v.end()); }

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

double CommunicatorRankGroup::share() const {
  const double n = comm_.size();
  return (n - 1) / n;
}

// Bytes count when issued; seconds only while this rank is blocked in the wait, so a transfer
// that overlapped compute costs what was left of it.
ir::PendingCollective CommunicatorRankGroup::counted(double bytes_sent, Request request) {
  stats_.bytes_sent += static_cast<int64_t>(bytes_sent);
  ++stats_.collectives;
  return ir::PendingCollective([this, request]() mutable {
    const auto start = std::chrono::steady_clock::now();
    Status s = request.wait();
    stats_.seconds += secondsSince(start);
    return s;
  });
}

ir::PendingCollective CommunicatorRankGroup::issueAllReduceSum(const void* send, void* recv, int64_t count,
                                                               ir::DType t) {
  auto dt = fromIrDType(t);
  if (!dt) return ir::PendingCollective::done(dt.status());
  // A ring: reduce-scatter then all-gather, each (N-1)/N of the data.
  return counted(2 * share() * static_cast<double>(count) * ir::dtypeBytes(t),
                 comm_.allReduce(send, recv, static_cast<size_t>(count), *dt));
}

ir::PendingCollective CommunicatorRankGroup::issueReduceScatterSum(const void* send, void* recv,
                                                                   int64_t recv_count, ir::DType t) {
  auto dt = fromIrDType(t);
  if (!dt) return ir::PendingCollective::done(dt.status());
  return counted(share() * static_cast<double>(recv_count * size()) * ir::dtypeBytes(t),
                 comm_.reduceScatter(send, recv, static_cast<size_t>(recv_count), *dt));
}

ir::PendingCollective CommunicatorRankGroup::issueAllGather(const void* send, void* recv, int64_t send_count,
                                                            ir::DType t) {
  auto dt = fromIrDType(t);
  if (!dt) return ir::PendingCollective::done(dt.status());
  return counted(share() * static_cast<double>(send_count * size()) * ir::dtypeBytes(t),
                 comm_.allGather(send, recv, static_cast<size_t>(send_count), *dt));
}

ir::PendingCollective CommunicatorRankGroup::issueAllToAll(const void* send, void* recv,
                                                           int64_t count_per_peer, ir::DType t) {
  auto dt = fromIrDType(t);
  if (!dt) return ir::PendingCollective::done(dt.status());
  return counted(static_cast<double>(count_per_peer * (size() - 1)) * ir::dtypeBytes(t),
                 comm_.allToAll(send, recv, static_cast<size_t>(count_per_peer), *dt));
}

ir::PendingCollective CommunicatorRankGroup::issueAllToAllV(const void* send,
                                                            const std::vector<int64_t>& send_counts,
                                                            void* recv,
                                                            const std::vector<int64_t>& recv_counts,
                                                            int64_t recv_capacity, ir::DType t) {
  auto dt = fromIrDType(t);
  if (!dt) return ir::PendingCollective::done(dt.status());
  int64_t to_others = 0;
  for (size_t p = 0; p < send_counts.size(); ++p)
    if (static_cast<int>(p) != rank()) to_others += send_counts[p];
  return counted(static_cast<double>(to_others) * ir::dtypeBytes(t),
                 comm_.allToAllV(send, toSizes(send_counts), recv, toSizes(recv_counts),
                                 static_cast<size_t>(recv_capacity), *dt));
}

// The blocking forms: issue, then wait at once.
Status CommunicatorRankGroup::allReduceSum(const void* send, void* recv, int64_t count, ir::DType t) {
  return issueAllReduceSum(send, recv, count, t).wait();
}

Status CommunicatorRankGroup::reduceScatterSum(const void* send, void* recv, int64_t recv_count,
                                               ir::DType t) {
  return issueReduceScatterSum(send, recv, recv_count, t).wait();
}

Status CommunicatorRankGroup::allGather(const void* send, void* recv, int64_t send_count, ir::DType t) {
  return issueAllGather(send, recv, send_count, t).wait();
}

Status CommunicatorRankGroup::allToAll(const void* send, void* recv, int64_t count_per_peer, ir::DType t) {
  return issueAllToAll(send, recv, count_per_peer, t).wait();
}

Status CommunicatorRankGroup::allToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                        const std::vector<int64_t>& recv_counts, int64_t recv_capacity,
                                        ir::DType t) {
  return issueAllToAllV(send, send_counts, recv, recv_counts, recv_capacity, t).wait();
}

// The count exchange stays blocking: the rows' transfer needs its answer.
Expected<std::vector<int64_t>> CommunicatorRankGroup::exchangeCounts(
    const std::vector<int64_t>& send_counts) {
  stats_.bytes_sent += static_cast<int64_t>(8 * (size() - 1));
  ++stats_.collectives;
  const auto start = std::chrono::steady_clock::now();
  auto recv = comm_.exchangeCounts(toSizes(send_counts));
  stats_.seconds += secondsSince(start);
  if (!recv) return recv.status();
  return std::vector<int64_t>(recv->begin(), recv->end());
}

}  // namespace kiln::comm
