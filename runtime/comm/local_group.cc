#include "runtime/comm/local_group.h"

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "runtime/thread_start.h"

namespace kiln::comm {

namespace detail {

// One collective as the ranks meet in it. Written under LocalShared::mutex until every rank
// has arrived; after that the slots are read-only and the parts write disjoint bytes.
struct LocalOp {
  struct Slot {
    bool arrived = false;
    const void* send = nullptr;
    void* recv = nullptr;
    // The per-peer counts: segment sizes (reduce_scatter_v, all_gather_v) or send counts
    // (all_to_all_v).
    std::vector<size_t> counts;
    std::vector<size_t> recv_counts;  // all_to_all_v only
  };

  CollectiveKind kind;
  DataType dtype;
  uint64_t seq;
  size_t count = 0;  // the uniform count of the kinds that have one
  int root = 0;
  std::vector<Slot> slots;
  int arrived = 0;
  int parts = 0;       // set when the last rank arrives
  int next_part = 0;   // the next part to claim
  int parts_done = 0;  // parts finished; parts claimed but not done are in flight

  bool complete() const { return arrived == static_cast<int>(slots.size()) && parts_done == parts; }
  bool inFlight() const { return next_part > parts_done; }
};

struct LocalShared {
  explicit LocalShared(int n) : size(n), last_issued(static_cast<size_t>(n), 0) {}

  std::mutex mutex;
  std::condition_variable cv;
  int size;
  bool broken = false;
  std::string broken_reason;
  // Collectives some but not all ranks have issued, by sequence number.
  std::map<uint64_t, std::shared_ptr<LocalOp>> pending;
  std::vector<uint64_t> last_issued;  // per rank: the sequence number of its latest collective

  // Breaks the group (mutex held); the first reason wins.
  void breakLocked(std::string reason) {
    if (broken) return;
    broken = true;
    broken_reason = std::move(reason);
    cv.notify_all();
  }
};

namespace {

size_t prefix(const std::vector<size_t>& counts, size_t end) {
  size_t s = 0;
  for (size_t i = 0; i < end; ++i) s += counts[i];
  return s;
}

const unsigned char* bytesAt(const void* p, size_t elems, size_t elem_bytes) {
  return static_cast<const unsigned char*>(p) + elems * elem_bytes;
}
unsigned char* bytesAt(void* p, size_t elems, size_t elem_bytes) {
  return static_cast<unsigned char*>(p) + elems * elem_bytes;
}
void copyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
}

// The sum of every rank's [offset, offset + n) of send, in rank order, into dst_of(q) for each
// destination. Accumulates into a scratch buffer first: with in-place use a destination may be
// some rank's source.
template <typename Dests>
void reduceSegment(const LocalOp& op, size_t offset, size_t n, const Dests& dests) {
  if (n == 0) return;
  size_t eb = dataTypeBytes(op.dtype);
  std::vector<unsigned char> acc(n * dataTypeBytes(accumulatorType(op.dtype)));
  for (size_t r = 0; r < op.slots.size(); ++r)
    accumulate(op.dtype, bytesAt(op.slots[r].send, offset, eb), acc.data(), n, r == 0);
  for (void* d : dests) storeAccumulator(op.dtype, acc.data(), bytesAt(d, 0, 1), n);
}

// Part p of a collective whose ranks have all arrived.
void computePart(const LocalOp& op, int part) {
  size_t p = static_cast<size_t>(part), n = op.slots.size(), eb = dataTypeBytes(op.dtype);
  switch (op.kind) {
    case CollectiveKind::AllReduce: {
      // Reduce-scatter then all-gather by segment: part p reduces segment p into every rank.
      size_t lo = op.count * p / n, hi = op.count * (p + 1) / n;
      std::vector<void*> dests;
      for (const auto& s : op.slots) dests.push_back(bytesAt(s.recv, lo, eb));
      reduceSegment(op, lo, hi - lo, dests);
      return;
    }
    case CollectiveKind::ReduceScatter:
    case CollectiveKind::ReduceScatterV: {
      const std::vector<size_t>& counts = op.slots[0].counts;
      std::vector<void*> dests{op.slots[p].recv};
      reduceSegment(op, prefix(counts, p), counts[p], dests);
      return;
    }
    case CollectiveKind::AllGather:
    case CollectiveKind::AllGatherV: {
      const std::vector<size_t>& counts = op.slots[0].counts;
      size_t off = prefix(counts, p);
      for (const auto& s : op.slots) copyBytes(bytesAt(s.recv, off, eb), op.slots[p].send, counts[p] * eb);
      return;
    }
    case CollectiveKind::AllToAll:
    case CollectiveKind::AllToAllV: {
      // Part p: everything sender p sends.
      const LocalOp::Slot& from = op.slots[p];
      size_t send_off = 0;
      for (size_t q = 0; q < n; ++q) {
        const LocalOp::Slot& to = op.slots[q];
        copyBytes(bytesAt(to.recv, prefix(to.recv_counts, p), eb), bytesAt(from.send, send_off, eb),
                  from.counts[q] * eb);
        send_off += from.counts[q];
      }
      return;
    }
    case CollectiveKind::Broadcast:
      if (part != op.root)
        copyBytes(op.slots[p].recv, op.slots[static_cast<size_t>(op.root)].recv, op.count * eb);
      return;
    case CollectiveKind::Barrier:
      return;
  }
}

std::string rankList(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

class LocalRequest final : public RequestState {
 public:
  LocalRequest(std::shared_ptr<LocalShared> shared, std::shared_ptr<LocalOp> op, int rank,
               std::chrono::milliseconds timeout)
      : shared_(std::move(shared)),
        op_(std::move(op)),
        rank_(rank),
        timeout_(timeout),
        deadline_(std::chrono::steady_clock::now() + timeout) {}

  Expected<bool> test() override {
    std::unique_lock<std::mutex> lock(shared_->mutex);
    while (true) {
      if (op_->complete()) return true;
      if (auto s = failure(lock); !s) return op_->inFlight() ? Expected<bool>(false) : Expected<bool>(s);
      // Help: claim a part if one is left; with none left the others are finishing theirs.
      if (!claimAndCompute(lock)) return false;
    }
  }

  Status wait() override {
    std::unique_lock<std::mutex> lock(shared_->mutex);
    while (true) {
      if (op_->complete()) return Status::ok();
      if (Status s = failure(lock); !s) {
        // Never return while another thread still writes our buffers or reads our sends.
        shared_->cv.wait(lock, [&] { return !op_->inFlight(); });
        return s;
      }
      if (claimAndCompute(lock)) continue;
      shared_->cv.wait_until(lock, deadline_);
    }
  }

 private:
  // The error this operation fails with now, if any (mutex held): the group is broken, or the
  // deadline passed, which breaks it.
  Status failure(std::unique_lock<std::mutex>&) {
    std::string name = operationName(op_->kind, op_->seq, rank_);
    if (shared_->broken) return Status::errorf("{}: the group was aborted: {}", name, shared_->broken_reason);
    if (std::chrono::steady_clock::now() < deadline_) return Status::ok();
    std::vector<int> missing;
    for (size_t q = 0; q < op_->slots.size(); ++q)
      if (!op_->slots[q].arrived) missing.push_back(static_cast<int>(q));
    std::string why;
    if (!missing.empty()) {
      why = fmt::format("{} did not arrive within {}", rankList(missing), formatDuration(timeout_));
      for (int q : missing) {
        uint64_t at = shared_->last_issued[static_cast<size_t>(q)];
        why += at ? fmt::format("; rank {} is at collective #{}", q, at)
                  : fmt::format("; rank {} has issued no collective", q);
      }
    } else {
      why = fmt::format("not complete within {}", formatDuration(timeout_));
    }
    std::string message = fmt::format("{}: {}", name, why);
    shared_->breakLocked(message);
    return Status::error(message);
  }

  // Claims and computes one part, with the mutex released during the copy. False when there
  // is nothing to claim.
  bool claimAndCompute(std::unique_lock<std::mutex>& lock) {
    if (op_->arrived < static_cast<int>(op_->slots.size()) || op_->next_part >= op_->parts) return false;
    int part = op_->next_part++;
    lock.unlock();
    computePart(*op_, part);
    lock.lock();
    if (++op_->parts_done == op_->parts || !op_->inFlight()) shared_->cv.notify_all();
    return true;
  }

  std::shared_ptr<LocalShared> shared_;
  std::shared_ptr<LocalOp> op_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_;
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalShared> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return shared_->size; }
  std::string_view backendName() const override { return "local"; }

  Request allReduce(const void* send, void* recv, size_t count, DataType t) override {
    LocalOp::Slot s;
    s.send = send;
    s.recv = recv;
    return issue(CollectiveKind::AllReduce, t, count, 0, std::move(s));
  }

  Request reduceScatter(const void* send, void* recv, size_t recv_count, DataType t) override {
    return segmented(CollectiveKind::ReduceScatter, send, recv,
                     std::vector<size_t>(static_cast<size_t>(size()), recv_count), t);
  }

  Request reduceScatterV(const void* send, void* recv, const std::vector<size_t>& recv_counts,
                         DataType t) override {
    return segmented(CollectiveKind::ReduceScatterV, send, recv, recv_counts, t);
  }

  Request allGather(const void* send, void* recv, size_t send_count, DataType t) override {
    return segmented(CollectiveKind::AllGather, send, recv,
                     std::vector<size_t>(static_cast<size_t>(size()), send_count), t);
  }

  Request allGatherV(const void* send, void* recv, const std::vector<size_t>& counts, DataType t) override {
    return segmented(CollectiveKind::AllGatherV, send, recv, counts, t);
  }

  Request allToAll(const void* send, void* recv, size_t count_per_peer, DataType t) override {
    std::vector<size_t> counts(static_cast<size_t>(size()), count_per_peer);
    LocalOp::Slot slot;
    slot.send = send;
    slot.recv = recv;
    slot.counts = counts;
    slot.recv_counts = counts;
    return issue(CollectiveKind::AllToAll, t, count_per_peer, 0, std::move(slot));
  }

  Request allToAllV(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, size_t recv_capacity, DataType t) override {
    Status s = checkCounts(send_counts, size(), "all_to_all_v's send_counts");
    if (s) s = checkCounts(recv_counts, size(), "all_to_all_v's recv_counts");
    if (s && prefix(recv_counts, recv_counts.size()) > recv_capacity)
      s = Status::errorf("all_to_all_v receives {} elements into a buffer of {}",
                         prefix(recv_counts, recv_counts.size()), recv_capacity);
    if (!s) return failIssue(CollectiveKind::AllToAllV, s);
    LocalOp::Slot slot;
    slot.send = send;
    slot.recv = recv;
    slot.counts = send_counts;
    slot.recv_counts = recv_counts;
    return issue(CollectiveKind::AllToAllV, t, 0, 0, std::move(slot));
  }

  Request broadcast(void* buf, size_t count, DataType t, int root) override {
    if (Status s = checkRoot(root, size()); !s) return failIssue(CollectiveKind::Broadcast, s);
    LocalOp::Slot slot;
    slot.recv = buf;
    return issue(CollectiveKind::Broadcast, t, count, root, std::move(slot));
  }

  Request barrierAsync() override {
    return issue(CollectiveKind::Barrier, DataType::u8, 0, 0, LocalOp::Slot{});
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->breakLocked(fmt::format("rank {} aborted: {}", rank_, reason));
  }

 private:
  // The collectives over one segment per rank (counts, the same on every rank).
  Request segmented(CollectiveKind kind, const void* send, void* recv, const std::vector<size_t>& counts,
                    DataType t) {
    if (Status s = checkCounts(counts, size(), "the per-rank counts"); !s) return failIssue(kind, s);
    LocalOp::Slot slot;
    slot.send = send;
    slot.recv = recv;
    slot.counts = counts;
    return issue(kind, t, 0, 0, std::move(slot));
  }

  // A bad argument is this rank's bug, but its peers would wait for it: it breaks the group.
  Request failIssue(CollectiveKind kind, const Status& s) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    uint64_t seq = ++next_seq_;
    shared_->last_issued[static_cast<size_t>(rank_)] = seq;
    std::string message = fmt::format("{}: {}", operationName(kind, seq, rank_), s.message());
    shared_->breakLocked(message);
    return Request::failed(Status::error(message));
  }

  Request issue(CollectiveKind kind, DataType t, size_t count, int root, LocalOp::Slot slot) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    uint64_t seq = ++next_seq_;
    shared_->last_issued[static_cast<size_t>(rank_)] = seq;
    std::string name = operationName(kind, seq, rank_);
    if (shared_->broken)
      return Request::failed(Status::errorf("{}: the group was aborted: {}", name, shared_->broken_reason));
    std::shared_ptr<LocalOp>& op = shared_->pending[seq];
    if (!op) {
      op = std::make_shared<LocalOp>();
      op->kind = kind;
      op->dtype = t;
      op->seq = seq;
      op->count = count;
      op->root = root;
      op->slots.resize(static_cast<size_t>(size()));
    } else if (std::string why = mismatch(*op, kind, t, count, root, slot); !why.empty()) {
      std::string message = fmt::format("{}: {}", name, why);
      shared_->breakLocked(message);
      return Request::failed(Status::error(message));
    }
    op->slots[static_cast<size_t>(rank_)] = std::move(slot);
    op->slots[static_cast<size_t>(rank_)].arrived = true;
    std::shared_ptr<LocalOp> keep = op;
    if (++keep->arrived == size()) {
      shared_->pending.erase(seq);
      if (kind == CollectiveKind::AllToAllV) {
        if (std::string why = splitMismatch(*keep); !why.empty()) {
          std::string message = fmt::format("{}: {}", name, why);
          shared_->breakLocked(message);
          return Request::failed(Status::error(message));
        }
      }
      keep->parts = kind == CollectiveKind::Barrier ? 0 : size();
      shared_->cv.notify_all();
    }
    return Request(std::make_shared<LocalRequest>(shared_, keep, rank_, timeout()));
  }

  // Why this rank's call does not match the collective its peers issued with the same
  // sequence number, or "".
  static std::string mismatch(const LocalOp& op, CollectiveKind kind, DataType t, size_t count, int root,
                              const LocalOp::Slot& slot) {
    int first = 0;
    while (!op.slots[static_cast<size_t>(first)].arrived) ++first;
    if (op.kind != kind)
      return fmt::format("rank {} issued {} as this collective", first, collectiveName(op.kind));
    if (op.dtype != t)
      return fmt::format("rank {} issued it on {}, this rank on {}", first, dataTypeName(op.dtype),
                         dataTypeName(t));
    if (op.count != count || op.root != root)
      return fmt::format("rank {} issued it with count {} root {}, this rank with count {} root {}", first,
                         op.count, op.root, count, root);
    if (kind != CollectiveKind::AllToAllV && op.slots[static_cast<size_t>(first)].counts != slot.counts)
      return fmt::format("rank {} issued it with other per-rank counts", first);
    return "";
  }

  // all_to_all_v: what each sender sends must be what its receiver expects.
  static std::string splitMismatch(const LocalOp& op) {
    for (size_t p = 0; p < op.slots.size(); ++p)
      for (size_t q = 0; q < op.slots.size(); ++q)
        if (op.slots[p].counts[q] != op.slots[q].recv_counts[p])
          return fmt::format("rank {} sends {} elements to rank {}, which expects {}", p,
                             op.slots[p].counts[q], q, op.slots[q].recv_counts[p]);
    return "";
  }

  std::shared_ptr<LocalShared> shared_;
  int rank_;
  uint64_t next_seq_ = 0;
};

}  // namespace

}  // namespace detail

LocalGroup::LocalGroup(int size) : shared_(std::make_shared<detail::LocalShared>(size)) {
  assert(size >= 1);
  for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<detail::LocalCommunicator>(shared_, r));
}

LocalGroup::~LocalGroup() = default;

void LocalGroup::setTimeout(std::chrono::milliseconds t) {
  for (auto& c : comms_) c->setTimeout(t);
}

Status LocalGroup::run(const std::function<Status(Communicator&)>& fn) {
  std::mutex m;
  Status first;
  auto fail = [&](int r, Status s) {
    comm(r).abort(s.message());
    std::lock_guard<std::mutex> lock(m);
    if (first) first = std::move(s);
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < size(); ++r) {
    const std::string what = fmt::format("cannot start the thread of rank {} of {}", r, size());
    auto started = runtime::startThread(what, [&, r] {
      // An exception must not leave the thread (std::terminate): it fails the rank.
      Status s;
      try {
        s = fn(comm(r));
      } catch (const std::system_error& e) {
        // std::thread's refusal (a thread of the rank's own: a kernel pool, the prefetcher).
        if (e.code() == std::errc::resource_unavailable_try_again)
          s = Status::error(runtime::threadStartFailure(fmt::format("rank {} cannot start a thread", r), e));
        else
          s = Status::errorf("rank {}: {}", r, e.what());
      } catch (const std::exception& e) {
        s = Status::errorf("rank {}: {}", r, e.what());
      } catch (...) {
        s = Status::errorf("rank {}: an unknown exception", r);
      }
      if (!s) fail(r, std::move(s));
    });
    if (!started) {
      // The ranks already running fail at their next collective; they are joined below.
      fail(r, started.status());
      break;
    }
    threads.push_back(started.take());
  }
  for (auto& t : threads) t.join();
  return first;
}

}  // namespace kiln::comm
