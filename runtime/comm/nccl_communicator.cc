#include "runtime/comm/nccl_communicator.h"

#include <cstdlib>
#include <thread>

#if defined(KILN_HAVE_CUDA_HEADERS) && __has_include(<nccl.h>)
#define KILN_HAVE_NCCL_HEADER 1
#include <nccl.h>

#include <mutex>
#endif

namespace kiln::comm {

#ifndef KILN_HAVE_NCCL_HEADER

Status loadNccl(int*) {
  return Status::error("cannot use NCCL: this kiln was built without the CUDA toolkit's nccl.h");
}
Status tryLoadNccl(const std::string&) { return loadNccl(); }

#ifdef KILN_HAVE_CUDA_HEADERS
Expected<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator&, const cuda::CudaContext&,
                                                               CUstream) {
  return loadNccl();
}
#endif

#else

namespace {

using Clock = std::chrono::steady_clock;

// The entry points Kiln uses, resolved from libnccl at run time.
struct NcclApi {
  cuda::DynamicLibrary lib;
  int version = 0;
  decltype(&::ncclGetVersion) getVersion = nullptr;
  decltype(&::ncclGetErrorString) errorString = nullptr;
  decltype(&::ncclGetUniqueId) getUniqueId = nullptr;
  decltype(&::ncclCommInitRank) commInitRank = nullptr;
  decltype(&::ncclCommInitRankConfig) commInitRankConfig = nullptr;  // NCCL 2.14+; optional
  decltype(&::ncclCommDestroy) commDestroy = nullptr;
  decltype(&::ncclCommAbort) commAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) commGetAsyncError = nullptr;
  decltype(&::ncclAllReduce) allReduce = nullptr;
  decltype(&::ncclReduceScatter) reduceScatter = nullptr;
  decltype(&::ncclAllGather) allGather = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclReduce) reduce = nullptr;
  decltype(&::ncclSend) send = nullptr;
  decltype(&::ncclRecv) recv = nullptr;
  decltype(&::ncclGroupStart) groupStart = nullptr;
  decltype(&::ncclGroupEnd) groupEnd = nullptr;
};

// Opens libnccl from `names` (under the loader's path, then `dirs`) and binds its entry points.
Expected<NcclApi*> openApi(const std::vector<std::string>& names, const std::vector<std::string>& dirs) {
  {
    auto lib = cuda::DynamicLibrary::open(names, dirs);
    if (!lib)
      return Status::errorf("cannot use NCCL: {}\n(install libnccl2, or put libnccl.so.2 on LD_LIBRARY_PATH)",
                            lib.status().message());
    auto api = std::make_unique<NcclApi>();
    api->lib = lib.take();
    std::string missing;
    auto bind = [&](auto& fn, const char* name, bool required = true) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(api->lib.symbol(name));
      if (!fn && required) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    bind(api->getVersion, "ncclGetVersion");
    bind(api->errorString, "ncclGetErrorString");
    bind(api->getUniqueId, "ncclGetUniqueId");
    bind(api->commInitRank, "ncclCommInitRank");
    bind(api->commInitRankConfig, "ncclCommInitRankConfig", false);
    bind(api->commDestroy, "ncclCommDestroy");
    bind(api->commAbort, "ncclCommAbort");
    bind(api->commGetAsyncError, "ncclCommGetAsyncError");
    bind(api->allReduce, "ncclAllReduce");
    bind(api->reduceScatter, "ncclReduceScatter");
    bind(api->allGather, "ncclAllGather");
    bind(api->broadcast, "ncclBroadcast");
    bind(api->reduce, "ncclReduce");
    bind(api->send, "ncclSend");
    bind(api->recv, "ncclRecv");
    bind(api->groupStart, "ncclGroupStart");
    bind(api->groupEnd, "ncclGroupEnd");
    if (!missing.empty())
      return Status::errorf("cannot use NCCL: {} lacks {} (NCCL 2.7 or later is needed)", api->lib.path(),
                            missing);
    api->getVersion(&api->version);
    return api.release();
  }
}

Expected<NcclApi*> loadApi() {
  // Loaded once and kept for the process: NCCL's own threads may outlive any one communicator.
  // KILN_NCCL_LIBRARY picks one library file over the search.
  static Expected<NcclApi*> loaded = []() -> Expected<NcclApi*> {
    if (const char* path = std::getenv("KILN_NCCL_LIBRARY"); path && *path) return openApi({path}, {});
    std::vector<std::string> dirs = cuda::cudaLibraryDirs();
    dirs.push_back("/usr/lib/x86_64-linux-gnu");
    return openApi({"libnccl.so.2", "libnccl.so"}, dirs);
  }();
  return loaded;
}

ncclDataType_t ncclType(DataType t) {
  switch (t) {
    case DataType::f32:
      return ncclFloat32;
    case DataType::f16:
      return ncclFloat16;
    case DataType::bf16:
      return ncclBfloat16;
    case DataType::f64:
      return ncclFloat64;
    case DataType::i32:
      return ncclInt32;
    case DataType::i64:
      return ncclInt64;
    case DataType::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

const char* at(const void* base, size_t elems, DataType t) {
  return static_cast<const char*>(base) + elems * dataTypeBytes(t);
}
char* at(void* base, size_t elems, DataType t) { return static_cast<char*>(base) + elems * dataTypeBytes(t); }

// What a communicator and its requests share; requests keep it alive.
struct NcclState {
  NcclApi* api = nullptr;
  cuda::CudaDriver* drv = nullptr;
  ncclComm_t comm = nullptr;
  std::mutex mutex;
  std::string broken;  // the first failure; non-empty once broken

  std::string errorText(ncclResult_t r) const { return api->errorString(r); }

  // Aborts the NCCL communicator (its kernels stop waiting for peers) and records why.
  void breakWith(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!broken.empty()) return;
    broken = message;
    if (comm) api->commAbort(comm);
    comm = nullptr;
  }
  std::string brokenReason() {
    std::lock_guard<std::mutex> lock(mutex);
    return broken;
  }

  // ncclSuccess, or ncclInProgress on a non-blocking communicator followed until it settles
  // (bounded by `deadline`). An error breaks the communicator.
  Status settle(ncclResult_t r, const std::string& what, Clock::time_point deadline) {
    while (r == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!comm) return Status::errorf("{}: the communicator is broken: {}", what, broken);
        api->commGetAsyncError(comm, &async);
      }
      r = async;
    }
    if (r == ncclSuccess) return Status::ok();
    std::string message = r == ncclInProgress ? fmt::format("{}: NCCL did not settle in time", what)
                                              : fmt::format("{}: {}", what, errorText(r));
    breakWith(message);
    return Status::error(message);
  }
};

class NcclRequest final : public RequestState {
 public:
  NcclRequest(std::shared_ptr<NcclState> state, CUevent event, std::string name,
              std::chrono::milliseconds limit)
      : state_(std::move(state)),
        event_(event),
        name_(std::move(name)),
        limit_(limit),
        deadline_(Clock::now() + limit) {}
  ~NcclRequest() override {
    if (event_) state_->drv->cuEventDestroy(event_);
  }

  Expected<bool> test() override {
    CUresult r = state_->drv->cuEventQuery(event_);
    if (r == CUDA_SUCCESS) return true;
    if (r != CUDA_ERROR_NOT_READY) return state_->drv->check(r, "cuEventQuery", name_);
    std::string broken = state_->brokenReason();
    if (!broken.empty()) return Status::errorf("{}: the communicator is broken: {}", name_, broken);
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (state_->comm) state_->api->commGetAsyncError(state_->comm, &async);
    }
    if (async != ncclSuccess && async != ncclInProgress) {
      std::string message = fmt::format("{}: {}", name_, state_->errorText(async));
      state_->breakWith(message);
      return Status::error(message);
    }
    if (Clock::now() >= deadline_) {
      std::string message = fmt::format(
          "{}: not complete within {}; a peer did not arrive (NCCL cannot say which: see the other ranks' "
          "errors)",
          name_, formatDuration(limit_));
      state_->breakWith(message);
      return Status::error(message);
    }
    return false;
  }

  Status wait() override {
    auto pause = std::chrono::microseconds(0);
    while (true) {
      KILN_ASSIGN_OR_RETURN(bool done, test());
      if (done) return Status::ok();
      pause = std::min(std::chrono::microseconds(1000), pause * 2 + std::chrono::microseconds(5));
      std::this_thread::sleep_for(pause);
    }
  }

  void* cudaEvent() const override { return event_; }

 private:
  std::shared_ptr<NcclState> state_;
  CUevent event_;
  std::string name_;
  std::chrono::milliseconds limit_;
  Clock::time_point deadline_;
};

class NcclCommunicator final : public Communicator {
 public:
  static Expected<std::unique_ptr<Communicator>> create(Communicator& bootstrap, const cuda::CudaContext& ctx,
                                                        CUstream stream) {
    if (bootstrap.memorySpace() != MemorySpace::Host)
      return Status::error("NCCL's unique id needs a host communicator to travel over");
    KILN_ASSIGN_OR_RETURN(NcclApi * api, loadApi());
    std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(ctx));
    c->state_->api = api;
    c->state_->drv = ctx.driver();
    c->rank_ = bootstrap.rank();
    c->size_ = bootstrap.size();
    c->setTimeout(bootstrap.timeout());
    KILN_RETURN_IF_ERROR(ctx.makeCurrent());
    ncclUniqueId id{};
    if (c->rank_ == 0) {
      ncclResult_t r = api->getUniqueId(&id);
      if (r != ncclSuccess) return Status::errorf("ncclGetUniqueId: {}", api->errorString(r));
    }
    KILN_RETURN_IF_ERROR(bootstrap.broadcastSync(&id, sizeof(id), DataType::u8, 0));
    std::string what = fmt::format("NCCL init on rank {} of {}", c->rank_, c->size_);
    Clock::time_point deadline = Clock::now() + bootstrap.timeout();
    ncclComm_t comm = nullptr;
    ncclResult_t r;
    if (api->commInitRankConfig) {
      // Non-blocking, so a peer that never joins costs a timeout, not a hang.
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      r = api->commInitRankConfig(&comm, c->size_, id, c->rank_, &config);
    } else {
      r = api->commInitRank(&comm, c->size_, id, c->rank_);
    }
    c->state_->comm = comm;
    if (Status s = c->state_->settle(r, what, deadline); !s)
      return Status::errorf("{} (the group did not form within {}?)", s.message(),
                            formatDuration(bootstrap.timeout()));
    if (stream) {
      c->stream_ = stream;
    } else {
      KILN_CU(c->state_->drv, cuStreamCreate(&c->own_stream_, CU_STREAM_NON_BLOCKING), "the NCCL stream");
      c->stream_ = c->own_stream_;
    }
    auto scratch = cuda::DeviceBuffer::allocate(c->state_->drv, 4, "the NCCL barrier's word");
    if (!scratch) return scratch.status();
    c->scratch_ = scratch.take();
    return std::unique_ptr<Communicator>(std::move(c));
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (state_->comm) {
        // Outstanding collectives finish first (their buffers are the caller's to keep alive).
        if (stream_) state_->drv->cuStreamSynchronize(stream_);
        state_->api->commDestroy(state_->comm);
        state_->comm = nullptr;
      }
    }
    if (own_stream_) state_->drv->cuStreamDestroy(own_stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backendName() const override { return "nccl"; }
  MemorySpace memorySpace() const override { return MemorySpace::Device; }

  Request allReduce(const void* send, void* recv, size_t count, DataType t) override {
    return issue(CollectiveKind::AllReduce, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      return a.allReduce(send, recv, count, ncclType(t), ncclSum, c, s);
    });
  }

  Request reduceScatter(const void* send, void* recv, size_t recv_count, DataType t) override {
    return issue(CollectiveKind::ReduceScatter, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      return a.reduceScatter(send, recv, recv_count, ncclType(t), ncclSum, c, s);
    });
  }

  // NCCL has no uneven reduce-scatter: one reduce per segment, each to its owner, in a group.
  Request reduceScatterV(const void* send, void* recv, const std::vector<size_t>& recv_counts,
                         DataType t) override {
    if (Status st = checkCounts(recv_counts, size_, "reduce_scatter's recv_counts"); !st)
      return failIssue(CollectiveKind::ReduceScatterV, st);
    return issue(CollectiveKind::ReduceScatterV, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      size_t off = 0;
      for (int p = 0; p < size_; ++p) {
        size_t n = recv_counts[static_cast<size_t>(p)];
        ncclResult_t r = a.reduce(at(send, off, t), recv, n, ncclType(t), ncclSum, p, c, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
        off += n;
      }
      return ncclSuccess;
    });
  }

  Request allGather(const void* send, void* recv, size_t send_count, DataType t) override {
    return issue(CollectiveKind::AllGather, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      return a.allGather(send, recv, send_count, ncclType(t), c, s);
    });
  }

  // Uneven segments: one broadcast per rank's segment, in a group.
  Request allGatherV(const void* send, void* recv, const std::vector<size_t>& counts, DataType t) override {
    if (Status st = checkCounts(counts, size_, "all_gather's counts"); !st)
      return failIssue(CollectiveKind::AllGatherV, st);
    return issue(CollectiveKind::AllGatherV, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      size_t off = 0;
      for (int p = 0; p < size_; ++p) {
        size_t n = counts[static_cast<size_t>(p)];
        const void* src = p == rank_ ? send : at(recv, off, t);
        ncclResult_t r = a.broadcast(src, at(recv, off, t), n, ncclType(t), p, c, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
        off += n;
      }
      return ncclSuccess;
    });
  }

  Request allToAll(const void* send, void* recv, size_t count_per_peer, DataType t) override {
    std::vector<size_t> counts(static_cast<size_t>(size_), count_per_peer);
    return pairwise(CollectiveKind::AllToAll, send, counts, recv, counts, t);
  }

  Request allToAllV(const void* send, const std::vector<size_t>& send_counts, void* recv,
                    const std::vector<size_t>& recv_counts, size_t recv_capacity, DataType t) override {
    Status st = checkCounts(send_counts, size_, "all_to_all_v's send_counts");
    if (st) st = checkCounts(recv_counts, size_, "all_to_all_v's recv_counts");
    size_t total = 0;
    for (size_t n : recv_counts) total += n;
    if (st && total > recv_capacity)
      st = Status::errorf("all_to_all_v receives {} elements into a buffer of {}", total, recv_capacity);
    if (!st) return failIssue(CollectiveKind::AllToAllV, st);
    return pairwise(CollectiveKind::AllToAllV, send, send_counts, recv, recv_counts, t);
  }

  Request broadcast(void* buf, size_t count, DataType t, int root) override {
    if (Status st = checkRoot(root, size_); !st) return failIssue(CollectiveKind::Broadcast, st);
    return issue(CollectiveKind::Broadcast, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      return a.broadcast(buf, buf, count, ncclType(t), root, c, s);
    });
  }

  // NCCL has no barrier: a one-word all-reduce that every rank must join.
  Request barrierAsync() override {
    void* word = reinterpret_cast<void*>(scratch_.ptr());
    return issue(CollectiveKind::Barrier, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      return a.allReduce(word, word, 1, ncclInt32, ncclSum, c, s);
    });
  }

  void abort(const std::string& reason) override {
    state_->breakWith(fmt::format("rank {} aborted: {}", rank_, reason));
  }

 private:
  explicit NcclCommunicator(const cuda::CudaContext& ctx)
      : ctx_(ctx), state_(std::make_shared<NcclState>()) {}

  // all_to_all as grouped sends and receives (every NCCL since 2.7 has them; ncclAlltoAll is
  // recent), skipping empty segments.
  Request pairwise(CollectiveKind kind, const void* send, const std::vector<size_t>& send_counts, void* recv,
                   const std::vector<size_t>& recv_counts, DataType t) {
    return issue(kind, [&](NcclApi& a, ncclComm_t c, CUstream s) {
      size_t soff = 0, roff = 0;
      for (int p = 0; p < size_; ++p) {
        size_t sn = send_counts[static_cast<size_t>(p)], rn = recv_counts[static_cast<size_t>(p)];
        ncclResult_t r = ncclSuccess;
        if (sn) r = a.send(at(send, soff, t), sn, ncclType(t), p, c, s);
        if ((r == ncclSuccess || r == ncclInProgress) && rn)
          r = a.recv(at(recv, roff, t), rn, ncclType(t), p, c, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
        soff += sn;
        roff += rn;
      }
      return ncclSuccess;
    });
  }

  Request failIssue(CollectiveKind kind, const Status& st) {
    std::string message = fmt::format("{}: {}", operationName(kind, ++seq_, rank_), st.message());
    state_->breakWith(message);
    return Request::failed(Status::error(message));
  }

  // Enqueues `calls` (NCCL calls on the stream) as one group, then records the event.
  template <typename Calls>
  Request issue(CollectiveKind kind, Calls calls) {
    std::string name = operationName(kind, ++seq_, rank_);
    Clock::time_point deadline = Clock::now() + timeout();
    NcclApi& a = *state_->api;
    ncclComm_t comm;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      comm = state_->comm;
      if (!comm)
        return Request::failed(Status::errorf("{}: the communicator is broken: {}", name, state_->broken));
    }
    if (Status s = ctx_.makeCurrent(); !s) return Request::failed(s);
    ncclResult_t r = a.groupStart();
    ncclResult_t inner = r == ncclSuccess ? calls(a, comm, stream_) : r;
    r = a.groupEnd();
    if (inner != ncclSuccess && inner != ncclInProgress) r = inner;
    if (Status s = state_->settle(r, name, deadline); !s) return Request::failed(s);
    CUevent event = nullptr;
    cuda::CudaDriver* drv = state_->drv;
    if (Status s = drv->check(drv->cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate", name); !s)
      return Request::failed(s);
    auto request = std::make_shared<NcclRequest>(state_, event, name, timeout());
    if (Status s = drv->check(drv->cuEventRecord(event, stream_), "cuEventRecord", name); !s)
      return Request::failed(s);
    return Request(request);
  }

  const cuda::CudaContext& ctx_;
  std::shared_ptr<NcclState> state_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
  CUstream stream_ = nullptr, own_stream_ = nullptr;
  cuda::DeviceBuffer scratch_;
};

}  // namespace

Status tryLoadNccl(const std::string& library) { return statusOf(openApi({library}, {})); }

Status loadNccl(int* version) {
  KILN_ASSIGN_OR_RETURN(NcclApi * api, loadApi());
  if (version) *version = api->version;
  return Status::ok();
}

Expected<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& bootstrap,
                                                               const cuda::CudaContext& ctx,
                                                               CUstream stream) {
  return NcclCommunicator::create(bootstrap, ctx, stream);
}

#endif

}  // namespace kiln::comm
