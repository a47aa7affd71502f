#include "runtime/comm/mpi_communicator.h"

#include <cstdlib>

#include "ir/tensor_view.h"

#ifdef KILN_HAVE_MPI
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#endif

namespace kiln::comm {

bool launchedByMpi() {
  // OpenMPI's mpirun, the PMI/PMIx launchers (MPICH's hydra, Slurm's srun --mpi), MVAPICH.
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"})
    if (const char* v = std::getenv(var); v && *v) return true;
  return false;
}

Expected<std::unique_ptr<Communicator>> mpiWorldIfLaunched() {
  if (!launchedByMpi()) return std::unique_ptr<Communicator>();
  int argc = 0;
  char** argv = nullptr;
  return createMpiCommunicator(&argc, &argv);
}

#ifndef KILN_HAVE_MPI

bool mpiAvailable() { return false; }

Expected<std::unique_ptr<Communicator>> createMpiCommunicator(int*, char***) {
  return Status::error(
      "this kiln was built without MPI (install libopenmpi-dev and rebuild), so it cannot run MPI ranks");
}

#else

bool mpiAvailable() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

std::string mpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

MPI_Datatype mpiType(DataType t) {
  switch (t) {
    case DataType::f32:
      return MPI_FLOAT;
    case DataType::f64:
      return MPI_DOUBLE;
    case DataType::i32:
      return MPI_INT32_T;
    case DataType::i64:
      return MPI_INT64_T;
    case DataType::u8:
      return MPI_UINT8_T;
    // MPI 3 has no 16-bit floats: they travel as 16-bit words and sum with our own MPI_Op.
    case DataType::f16:
    case DataType::bf16:
      return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

// The MPI_Op callbacks for f16 and bf16 sums (inout[i] += in[i], rounded each step).
template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void sumHalves(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Store(Load(a[i]) + Load(b[i]));
}
// u8 sums wrap, as C's unsigned arithmetic (and NCCL) do; OpenMPI 4.1's vectorized MPI_SUM
// saturates them at 255 beyond a few elements (seen with Debian's 4.1.4), so u8 has its own op.
void sumBytes(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint8_t* a = static_cast<const uint8_t*>(in);
  uint8_t* b = static_cast<uint8_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<uint8_t>(a[i] + b[i]);
}
float bf16Load(uint16_t h) { return ir::bf16ToFloat(h); }
uint16_t bf16Store(float f) { return ir::floatToBf16(f); }

Expected<int> toInt(size_t n, const char* what) {
  if (n > static_cast<size_t>(std::numeric_limits<int>::max()))
    return Status::errorf("{} of {} elements is beyond MPI's int counts", what, n);
  return static_cast<int>(n);
}

Expected<std::vector<int>> toInts(const std::vector<size_t>& counts, const char* what) {
  std::vector<int> out;
  for (size_t c : counts) {
    KILN_ASSIGN_OR_RETURN(int v, toInt(c, what));
    out.push_back(v);
  }
  return out;
}

// Packed offsets of counts, each within int.
Expected<std::vector<int>> displacements(const std::vector<size_t>& counts, const char* what) {
  std::vector<int> out;
  size_t off = 0;
  for (size_t c : counts) {
    KILN_ASSIGN_OR_RETURN(int v, toInt(off, what));
    out.push_back(v);
    off += c;
  }
  KILN_RETURN_IF_ERROR(toInt(off, what));
  return out;
}

// The side channel's messages: a query ("which collective have you issued?"), its reply, and an
// abort carrying its reason.
enum ControlType : int64_t { kQuery = 1, kReply = 2, kAbort = 3 };
constexpr int kControlTag = 1;
struct ControlMessage {
  int64_t type = 0;
  int64_t seq = 0;
  char text[496] = {};
};

// One collective, issued by the caller, started and completed by the communication thread.
class MpiOp final : public RequestState {
 public:
  CollectiveKind kind;
  uint64_t seq = 0;
  std::string name;
  std::chrono::milliseconds limit;
  Clock::time_point deadline;
  // Starts the MPI collective (communication thread); keeps its arguments alive in the lambda.
  std::function<int(MPI_Request*)> start;
  // Runs on completion (communication thread): copies a staging buffer out.
  std::function<void()> finish;
  MPI_Request request = MPI_REQUEST_NULL;

  void complete(Status s) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    status_ = std::move(s);
    cv_.notify_all();
  }

  Expected<bool> test() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) return false;
    if (!status_) return status_;
    return true;
  }

  Status wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    return status_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

class MpiCommunicator final : public Communicator {
 public:
  static Expected<std::unique_ptr<Communicator>> create(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    std::unique_ptr<MpiCommunicator> c(new MpiCommunicator());
    if (!initialized) {
      int provided = 0;
      int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) return Status::errorf("MPI_Init_thread: {}", mpiError(rc));
      c->owns_mpi_ = true;
      // Every call after this one comes from the communication thread, one at a time.
      if (provided < MPI_THREAD_SERIALIZED)
        return Status::errorf(
            "this MPI provides thread level {}; Kiln's communication thread needs MPI_THREAD_SERIALIZED",
            provided);
    }
    // Our own communicators, so our collectives never match an application's, and errors
    // come back as codes rather than aborting the job.
    for (MPI_Comm* comm : {&c->comm_, &c->control_}) {
      int rc = MPI_Comm_dup(MPI_COMM_WORLD, comm);
      if (rc != MPI_SUCCESS) return Status::errorf("MPI_Comm_dup: {}", mpiError(rc));
      MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN);
    }
    MPI_Comm_rank(c->comm_, &c->rank_);
    MPI_Comm_size(c->comm_, &c->size_);
    MPI_Op_create(&sumHalves<f16ToFloat, floatToF16>, 1, &c->sum_f16_);
    MPI_Op_create(&sumHalves<bf16Load, bf16Store>, 1, &c->sum_bf16_);
    MPI_Op_create(&sumBytes, 1, &c->sum_u8_);
    c->replies_.assign(static_cast<size_t>(c->size_), -1);
    c->postControlReceive();
    c->thread_ = std::thread([raw = c.get()] { raw->loop(); });
    return std::unique_ptr<Communicator>(std::move(c));
  }

  ~MpiCommunicator() override {
    bool broken;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Let outstanding collectives finish (they complete or time out) before stopping.
      cv_.wait(lock, [&] { return (queue_.empty() && !active_count_) || !broken_.empty(); });
      stop_ = true;
      broken = !broken_.empty();
      cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
    if (comm_ == MPI_COMM_NULL) {
      if (owns_mpi_) MPI_Finalize();
      return;
    }
    // A broken group has collectives MPI cannot cancel, and MPI_Finalize could wait on them or
    // on a lost peer forever: leave MPI as it is; the process is about to exit non-zero.
    if (broken) return;
    MPI_Cancel(&control_request_);
    MPI_Wait(&control_request_, MPI_STATUS_IGNORE);
    for (auto& s : sends_) MPI_Wait(&s.second, MPI_STATUS_IGNORE);
    MPI_Op_free(&sum_f16_);
    MPI_Op_free(&sum_bf16_);
    MPI_Op_free(&sum_u8_);
    MPI_Comm_free(&control_);
    MPI_Comm_free(&comm_);
    if (owns_mpi_) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backendName() const override { return "mpi"; }

  Request allReduce(const void* send, void* recv, size_t count, DataType t) override {
    auto op = newOp(CollectiveKind::AllReduce);
    auto n = toInt(count, "all_reduce");
    if (!n) return fail(op, n.status());
    const void* sb = send == recv ? MPI_IN_PLACE : send;
    op->start = [=, this, n = *n](MPI_Request* r) {
      return MPI_Iallreduce(sb, recv, n, mpiType(t), sumOp(t), comm_, r);
    };
    return enqueue(op);
  }

  Request reduceScatter(const void* send, void* recv, size_t recv_count, DataType t) override {
    auto op = newOp(CollectiveKind::ReduceScatter);
    auto n = toInt(recv_count, "reduce_scatter");
    if (n) n = toInt(recv_count * static_cast<size_t>(size_), "reduce_scatter");
    if (!n) return fail(op, n.status());
    void* out = stageIfInside(*op, send, recv_count * static_cast<size_t>(size_), recv, recv_count, t);
    op->start = [=, this, n = static_cast<int>(recv_count)](MPI_Request* r) {
      return MPI_Ireduce_scatter_block(send, out, n, mpiType(t), sumOp(t), comm_, r);
    };
    return enqueue(op);
  }

  Request reduceScatterV(const void* send, void* recv, const std::vector<size_t>& recv_counts,
                         DataType t) override {
    auto op = newOp(CollectiveKind::ReduceScatterV);
    if (Status s = checkCounts(recv_counts, size_, "reduce_scatter's recv_counts"); !s) return fail(op, s);
    auto counts = toInts(recv_counts, "reduce_scatter");
    auto displs = displacements(recv_counts, "reduce_scatter");  // only to check the total fits an int
    if (!counts || !displs) return fail(op, !counts ? counts.status() : displs.status());
    size_t total = 0;
    for (size_t c : recv_counts) total += c;
    void* out = stageIfInside(*op, send, total, recv, recv_counts[static_cast<size_t>(rank_)], t);
    op->start = [=, this, counts = counts.take()](MPI_Request* r) {
      return MPI_Ireduce_scatter(send, out, counts.data(), mpiType(t), sumOp(t), comm_, r);
    };
    return enqueue(op);
  }

  Request allGather(const void* send, void* recv, size_t send_count, DataType t) override {
    auto op = newOp(CollectiveKind::AllGather);
    auto n = toInt(send_count, "all_gather");
    if (n) n = toInt(send_count * static_cast<size_t>(size_), "all_gather");
    if (!n) return fail(op, n.status());
    // NCCL's in-place form (send is this rank's segment of recv) is MPI's MPI_IN_PLACE.
    const void* sb = send == static_cast<const unsigned char*>(recv) + send_count * rank_ * dataTypeBytes(t)
                         ? MPI_IN_PLACE
                         : send;
    op->start = [=, this, n = static_cast<int>(send_count)](MPI_Request* r) {
      return MPI_Iallgather(sb, n, mpiType(t), recv, n, mpiType(t), comm_, r);
    };
    return enqueue(op);
  }

  Request allGatherV(const void* send, void* recv, const std::vector<size_t>& counts, DataType t) override {
    auto op = newOp(CollectiveKind::AllGatherV);
    if (Status s = checkCounts(counts, size_, "all_gather's counts"); !s) return fail(op, s);
    auto ints = toInts(counts, "all_gather");
    auto displs = displacements(counts, "all_gather");
    if (!ints || !displs) return fail(op, !ints ? ints.status() : displs.status());
    size_t mine = counts[static_cast<size_t>(rank_)];
    const void* sb = send == static_cast<const unsigned char*>(recv) +
                                 static_cast<size_t>((*displs)[static_cast<size_t>(rank_)]) * dataTypeBytes(t)
                         ? MPI_IN_PLACE
                         : send;
    op->start = [=, this, ints = ints.take(), displs = displs.take()](MPI_Request* r) {
      return MPI_Iallgatherv(sb, static_cast<int>(mine), mpiType(t), recv, ints.data(), displs.data(),
                             mpiType(t), comm_, r);
    };
    return enqueue(op);
  }

  Request allToAll(const void* send, void* recv, size_t count_per_peer, DataType t) override {
    auto op = newOp(CollectiveKind::AllToAll);
    auto n = toInt(count_per_peer * static_cast<size_t>(size_), "all_to_all");
    if (!n) return fail(op, n.status());
    op->start = [=, this, n = static_cast<int>(count_per_peer)](MPI_Request* r) {
      return MPI_Ialltoall(send, n, mpiType(t), recv, n, mpiType(t), comm_, r);
    };
    return enqueue(op);
  }

  Request allToAllV(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, size_t recv_capacity, DataType t) override {
    auto op = newOp(CollectiveKind::AllToAllV);
    Status s = checkCounts(send_counts, size_, "all_to_all_v's send_counts");
    if (s) s = checkCounts(recv_counts, size_, "all_to_all_v's recv_counts");
    size_t total = 0;
    for (size_t c : recv_counts) total += c;
    if (s && total > recv_capacity)
      s = Status::errorf("all_to_all_v receives {} elements into a buffer of {}", total, recv_capacity);
    if (!s) return fail(op, s);
    auto sc = toInts(send_counts, "all_to_all_v");
    auto sd = displacements(send_counts, "all_to_all_v");
    auto rc = toInts(recv_counts, "all_to_all_v");
    auto rd = displacements(recv_counts, "all_to_all_v");
    for (const Expected<std::vector<int>>* e : {&sc, &sd, &rc, &rd})
      if (!*e) return fail(op, e->status());
    // OpenMPI's non-blocking collectives take send == recv for MPI_IN_PLACE (and then expect
    // symmetric counts): a memory plan can give an empty buffer the address of a live one, so an
    // empty side gets an address of its own.
    size_t sent = 0;
    for (size_t c : send_counts) sent += c;
    static unsigned char empty_send, empty_recv;
    const void* sb = send;
    void* rb = recv;
    if (send == recv && total == 0)
      rb = &empty_recv;
    else if (send == recv && sent == 0)
      sb = &empty_send;
    else if (send == recv)
      return fail(op, Status::error("all_to_all_v's send and receive buffers are the same"));
    op->start = [=, this, sc = sc.take(), sd = sd.take(), rc = rc.take(), rd = rd.take()](MPI_Request* r) {
      return MPI_Ialltoallv(sb, sc.data(), sd.data(), mpiType(t), rb, rc.data(), rd.data(), mpiType(t), comm_,
                            r);
    };
    return enqueue(op);
  }

  Request broadcast(void* buf, size_t count, DataType t, int root) override {
    auto op = newOp(CollectiveKind::Broadcast);
    if (Status s = checkRoot(root, size_); !s) return fail(op, s);
    auto n = toInt(count, "broadcast");
    if (!n) return fail(op, n.status());
    op->start = [=, this, n = *n](MPI_Request* r) { return MPI_Ibcast(buf, n, mpiType(t), root, comm_, r); };
    return enqueue(op);
  }

  Request barrierAsync() override {
    auto op = newOp(CollectiveKind::Barrier);
    op->start = [this](MPI_Request* r) { return MPI_Ibarrier(comm_, r); };
    return enqueue(op);
  }

  // Returns once the peers' messages are sent (or after a second), so a process that exits
  // right after an abort still tells its peers why.
  void abort(const std::string& reason) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (abort_sent_) return;
    if (!abort_reason_) abort_reason_ = reason;
    cv_.notify_all();
    cv_.wait_for(lock, std::chrono::seconds(2), [&] { return abort_sent_; });
  }

 private:
  MpiCommunicator() = default;

  MPI_Op sumOp(DataType t) const {
    if (t == DataType::f16) return sum_f16_;
    if (t == DataType::bf16) return sum_bf16_;
    if (t == DataType::u8) return sum_u8_;
    return MPI_SUM;
  }

  std::shared_ptr<MpiOp> newOp(CollectiveKind kind) {
    auto op = std::make_shared<MpiOp>();
    op->kind = kind;
    op->seq = ++next_seq_;
    last_issued_.store(op->seq);
    op->name = operationName(kind, op->seq, rank_);
    op->limit = timeout();
    op->deadline = Clock::now() + op->limit;
    return op;
  }

  // A bad argument on one rank leaves its peers waiting in the collective: it breaks the
  // communicator, which tells them.
  Request fail(const std::shared_ptr<MpiOp>& op, const Status& s) {
    std::string message = fmt::format("{}: {}", op->name, s.message());
    abort(message);
    return Request::failed(Status::error(message));
  }

  // MPI forbids a receive buffer inside the send buffer; NCCL's in-place reduce-scatter puts it
  // there. Such a receive goes through a staging buffer, copied out on completion.
  void* stageIfInside(MpiOp& op, const void* send, size_t send_count, void* recv, size_t recv_count,
                      DataType t) {
    size_t eb = dataTypeBytes(t);
    auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
    if (recv_count == 0 || r + recv_count * eb <= s || r >= s + send_count * eb) return recv;
    auto staging = std::make_shared<std::vector<unsigned char>>(recv_count * eb);
    op.finish = [staging, recv] { std::memcpy(recv, staging->data(), staging->size()); };
    return staging->data();
  }

  Request enqueue(const std::shared_ptr<MpiOp>& op) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty())
      return Request::failed(Status::errorf("{}: the communicator is broken: {}", op->name, broken_));
    queue_.push_back(op);
    cv_.notify_all();
    return Request(op);
  }

  // --- The communication thread.

  void loop() {
    auto backoff = std::chrono::microseconds(0);
    while (true) {
      std::deque<std::shared_ptr<MpiOp>> fresh;
      std::optional<std::string> abort_reason;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (queue_.empty() && active_.empty() && !stop_ && !abort_reason_)
          cv_.wait_for(lock, std::chrono::milliseconds(5));  // idle: still answer peers' queries
        if (stop_ && queue_.empty() && active_.empty()) break;
        fresh.swap(queue_);
        std::swap(abort_reason, abort_reason_);
        active_count_ = active_.size() + fresh.size();
      }
      bool progressed = !fresh.empty();
      if (abort_reason) {
        // A rank that aborts because it saw the group break (a peer that does not answer) passes
        // on what it saw, so every survivor names the lost rank, not just the one that aborted.
        std::string seen = brokenReason();
        std::string reason = seen.empty()
                                 ? fmt::format("rank {} aborted: {}", rank_, *abort_reason)
                                 : fmt::format("rank {} aborted: {}, after {}", rank_, *abort_reason, seen);
        for (int q = 0; q < size_; ++q)
          if (q != rank_) sendControl(q, kAbort, 0, reason);
        breakGroup(reason, nullptr);
        for (Clock::time_point until = Clock::now() + std::chrono::seconds(1);
             !sends_.empty() && Clock::now() < until;)
          testSends();
        std::lock_guard<std::mutex> lock(mutex_);
        abort_sent_ = true;
        cv_.notify_all();
      }
      for (auto& op : fresh) {
        if (isBroken()) {
          op->complete(Status::errorf("{}: the communicator is broken: {}", op->name, brokenReason()));
          continue;
        }
        int rc = op->start(&op->request);
        active_.push_back(op);
        if (rc != MPI_SUCCESS) breakGroup(fmt::format("{}: {}", op->name, mpiError(rc)), op.get());
      }
      // Completions first, so a collective that finished is reported done even when an abort
      // arrives in the same round.
      for (size_t i = 0; i < active_.size();) {
        MpiOp& op = *active_[i];
        int flag = 0;
        int rc = MPI_Test(&op.request, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
          breakGroup(fmt::format("{}: {}", op.name, mpiError(rc)), &op);
          break;
        }
        if (!flag) {
          ++i;
          continue;
        }
        if (op.finish) op.finish();
        op.complete(Status::ok());
        active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
        progressed = true;
      }
      progressed |= pollControl();
      Clock::time_point now = Clock::now();
      for (auto& op : active_)
        if (now >= op->deadline) {
          breakGroup(diagnoseTimeout(*op), op.get());
          break;
        }
      testSends();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        active_count_ = active_.size();
        cv_.notify_all();
      }
      // Poll fast while collectives move, then back off so an idle wait does not hold a core.
      if (progressed) {
        backoff = std::chrono::microseconds(0);
      } else if (!active_.empty()) {
        backoff = std::min(std::chrono::microseconds(1000), backoff * 2 + std::chrono::microseconds(10));
        std::this_thread::sleep_for(backoff);
      }
    }
  }

  // Completes (and frees) the control messages the peers have taken.
  void testSends() {
    for (size_t i = 0; i < sends_.size();) {
      int flag = 0;
      MPI_Test(&sends_[i].second, &flag, MPI_STATUS_IGNORE);
      if (flag)
        sends_.erase(sends_.begin() + static_cast<std::ptrdiff_t>(i));
      else
        ++i;
    }
  }

  bool isBroken() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !broken_.empty();
  }
  std::string brokenReason() {
    std::lock_guard<std::mutex> lock(mutex_);
    return broken_;
  }

  // Fails every started and queued collective: `culprit` with `message`, the others as broken.
  // Their MPI requests are abandoned (MPI cannot cancel a collective).
  void breakGroup(const std::string& message, MpiOp* culprit) {
    std::deque<std::shared_ptr<MpiOp>> queued;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_.empty()) broken_ = message;
      queued.swap(queue_);
      cv_.notify_all();
    }
    auto fail = [&](MpiOp& op) {
      op.complete(&op == culprit ? Status::error(message)
                                 : Status::errorf("{}: the communicator is broken: {}", op.name, message));
    };
    for (auto& op : active_) fail(*op);
    for (auto& op : queued) fail(*op);
    active_.clear();
  }

  void postControlReceive() {
    MPI_Irecv(&control_in_, sizeof(ControlMessage), MPI_BYTE, MPI_ANY_SOURCE, kControlTag, control_,
              &control_request_);
  }

  void sendControl(int peer, int64_t type, int64_t seq, const std::string& text = "") {
    auto msg = std::make_unique<ControlMessage>();
    msg->type = type;
    msg->seq = seq;
    std::strncpy(msg->text, text.c_str(), sizeof(msg->text) - 1);
    MPI_Request r;
    if (MPI_Isend(msg.get(), sizeof(ControlMessage), MPI_BYTE, peer, kControlTag, control_, &r) ==
        MPI_SUCCESS)
      sends_.emplace_back(std::move(msg), r);
  }

  // Answers queries, records replies, takes aborts. True if a message came.
  bool pollControl() {
    bool any = false;
    while (true) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Test(&control_request_, &flag, &st) != MPI_SUCCESS || !flag) return any;
      any = true;
      ControlMessage msg = control_in_;
      int from = st.MPI_SOURCE;
      postControlReceive();
      if (msg.type == kQuery) {
        sendControl(from, kReply, static_cast<int64_t>(last_issued_.load()));
      } else if (msg.type == kReply) {
        replies_[static_cast<size_t>(from)] = msg.seq;
      } else if (msg.type == kAbort) {
        msg.text[sizeof(msg.text) - 1] = 0;
        breakGroup(msg.text, nullptr);
      }
    }
  }

  // Why `op` is late: asks every peer which collective it has issued, waits a short while for
  // the answers, and names the ranks that have not reached it.
  std::string diagnoseTimeout(const MpiOp& op) {
    std::chrono::milliseconds limit = op.limit;
    std::fill(replies_.begin(), replies_.end(), -1);
    replies_[static_cast<size_t>(rank_)] = static_cast<int64_t>(last_issued_.load());
    for (int q = 0; q < size_; ++q)
      if (q != rank_) sendControl(q, kQuery, static_cast<int64_t>(op.seq));
    auto grace = std::clamp(limit / 4, std::chrono::milliseconds(200), std::chrono::milliseconds(5000));
    Clock::time_point until = Clock::now() + grace;
    while (Clock::now() < until &&
           std::any_of(replies_.begin(), replies_.end(), [](int64_t r) { return r < 0; })) {
      pollControl();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::string late;
    for (int q = 0; q < size_; ++q) {
      int64_t at = replies_[static_cast<size_t>(q)];
      if (at >= static_cast<int64_t>(op.seq)) continue;
      late += fmt::format("{}rank {} did not arrive within {} ", late.empty() ? "" : "; ", q,
                          formatDuration(limit));
      late +=
          at < 0 ? fmt::format("(it does not answer: lost?)") : fmt::format("(it is at collective #{})", at);
    }
    if (late.empty())
      late = fmt::format("not complete within {} although every rank has issued it", formatDuration(limit));
    return fmt::format("{}: {}", op.name, late);
  }

  MPI_Comm comm_ = MPI_COMM_NULL, control_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  bool owns_mpi_ = false;
  MPI_Op sum_f16_ = MPI_OP_NULL, sum_bf16_ = MPI_OP_NULL, sum_u8_ = MPI_OP_NULL;
  std::thread thread_;

  // Shared between the caller and the communication thread.
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<MpiOp>> queue_;  // issued, not yet started
  size_t active_count_ = 0;                   // started, not complete
  bool stop_ = false;
  std::string broken_;                       // the first failure; non-empty once broken
  std::optional<std::string> abort_reason_;  // an abort() the thread has not sent yet
  bool abort_sent_ = false;
  std::atomic<uint64_t> last_issued_{0};
  uint64_t next_seq_ = 0;  // the caller's

  // The communication thread's own.
  std::vector<std::shared_ptr<MpiOp>> active_;
  ControlMessage control_in_;
  MPI_Request control_request_ = MPI_REQUEST_NULL;
  std::vector<std::pair<std::unique_ptr<ControlMessage>, MPI_Request>> sends_;
  std::vector<int64_t> replies_;
};

}  // namespace

Expected<std::unique_ptr<Communicator>> createMpiCommunicator(int* argc, char*** argv) {
  return MpiCommunicator::create(argc, argv);
}

#endif

}  // namespace kiln::comm
