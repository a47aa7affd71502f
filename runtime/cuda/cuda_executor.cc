#include "runtime/cuda/cuda_executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "codegen/kernel_lowering.h"
#include "ir/op_def.h"
#include "runtime/cuda/ahead_compile.h"
#include "runtime/cuda/cublaslt.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/cuda/nvrtc_compiler.h"
#include "runtime/data/staging_pool.h"

namespace kiln::cuda {

namespace {

[[maybe_unused]] int64_t product(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

[[maybe_unused]] std::string shapeStr(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

// Enough for every vectorized access a kernel or cuBLASLt makes.
[[maybe_unused]] constexpr int64_t kArenaAlignment = 256;

}  // namespace

#ifdef KILN_HAVE_CUDA_HEADERS

struct CudaSession::Impl {
  std::unique_ptr<CudaContext> ctx;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<CublasLt> blas;
  std::string arch;
  std::string cache_dir;
  std::map<std::string, DeviceBuffer, std::less<>> params;
  CudaDriver* drv() const { return ctx->driver(); }
  // NVRTC, loaded at the first call.
  Expected<NvrtcCompiler*> compiler();

 private:
  std::mutex nvrtc_mutex;
  std::unique_ptr<NvrtcCompiler> nvrtc;
};

Expected<NvrtcCompiler*> CudaSession::Impl::compiler() {
  std::lock_guard<std::mutex> lock(nvrtc_mutex);
  if (!nvrtc) {
    KILN_ASSIGN_OR_RETURN(auto c, NvrtcCompiler::create(cache_dir));
    nvrtc = std::move(c);
  }
  return nvrtc.get();
}

CudaSession::~CudaSession() = default;

Expected<std::shared_ptr<CudaSession>> CudaSession::create(const CudaSessionOptions& options) {
  std::shared_ptr<CudaSession> s(new CudaSession());
  s->impl_ = std::make_unique<Impl>();
  Impl& im = *s->impl_;
  KILN_ASSIGN_OR_RETURN(auto ctx, CudaContext::create(options.device));
  im.ctx = std::move(ctx);
  im.arch = options.arch.empty() ? im.ctx->arch() : options.arch;
  KILN_RETURN_IF_ERROR(checkGpuArch(im.arch));
  KILN_ASSIGN_OR_RETURN(auto stream, Stream::create(im.drv()));
  im.stream = std::move(stream);
  im.cache_dir = options.cache_dir.empty() ? defaultCacheDir() : options.cache_dir;
  KILN_ASSIGN_OR_RETURN(auto blas, CublasLt::create(im.drv()));
  im.blas = std::move(blas);
  return s;
}

Status CudaSession::uploadParameters(const runtime::ParameterStore& store) {
  Impl& im = *impl_;
  KILN_RETURN_IF_ERROR(im.ctx->makeCurrent());
  KILN_RETURN_IF_ERROR(im.stream->synchronize());
  for (const std::string& name : store.names()) {
    const ir::HostTensor& t = *store.find(name);
    // From the view: an external tensor (a compiled model's mapped weights) has no storage.
    size_t bytes = static_cast<size_t>(t.view.bytes());
    auto it = im.params.find(name);
    if (it == im.params.end() || it->second.bytes() != std::max<size_t>(bytes, 1)) {
      KILN_ASSIGN_OR_RETURN(
          auto buf, DeviceBuffer::allocate(im.drv(), std::max<size_t>(bytes, 1), "parameter " + name));
      im.params[name] = std::move(buf);
      it = im.params.find(name);
    }
    if (bytes) KILN_RETURN_IF_ERROR(it->second.upload(t.view.data, bytes));
  }
  // A copy from pageable memory may return before its DMA lands, and the steps' streams do not
  // wait for the legacy stream it ran on.
  KILN_CU(im.drv(), cuCtxSynchronize(), "waiting for the parameters' upload");
  return Status::ok();
}

Status CudaSession::downloadParameters(runtime::ParameterStore& store) const {
  const Impl& im = *impl_;
  KILN_RETURN_IF_ERROR(im.ctx->makeCurrent());
  // Every stream: sparse updates write parameters on stream 1, and a run that stopped early may
  // have left work there.
  KILN_CU(im.drv(), cuCtxSynchronize(), "waiting for the device before downloading parameters");
  for (const auto& [name, buf] : im.params) {
    ir::HostTensor* t = store.find(name);
    if (!t) return Status::errorf("download: the parameter store has no '{}'", name);
    const size_t bytes = static_cast<size_t>(t->view.bytes());
    if (bytes == 0) continue;
    if (bytes > buf.bytes())
      return Status::errorf("download: '{}' is {} bytes on the host but {} on the device", name, bytes,
                            buf.bytes());
    KILN_RETURN_IF_ERROR(buf.download(t->view.data, bytes));
  }
  return Status::ok();
}

bool CudaSession::hasParameter(const std::string& name) const { return impl_->params.count(name) > 0; }
std::string CudaSession::deviceName() const { return impl_->ctx->name(); }
std::string CudaSession::arch() const { return impl_->arch; }

Expected<CudaSession::MemoryInfo> CudaSession::memoryInfo() const {
  KILN_RETURN_IF_ERROR(impl_->ctx->makeCurrent());
  size_t free_bytes = 0, total_bytes = 0;
  KILN_CU(impl_->drv(), cuMemGetInfo(&free_bytes, &total_bytes), "reading the device's free memory");
  return MemoryInfo{free_bytes, total_bytes};
}

// One unit of stream work: a kernel launch or a GEMM.
// A codegen::CudaStep of the Program with its arguments resolved to device addresses.
struct Step {
  const codegen::CudaStep* plan = nullptr;  // in Impl::built.steps
  CUfunction fn = nullptr;         // kernels
  std::vector<CUdeviceptr> args;   // kernel arguments; a GEMM's a, b, c, bias and aux (0: none)
};

// A group's embedding {code, table} flag, outside the arena so it survives the step: code 1 from
// an embedding kernel (an id out of range), 2 from its jagged-lengths scan. `table` is numbered
// across the group (LoweredGroup::error_subjects), whichever of its kernels set the flag.
struct ErrorFlag {
  CUdeviceptr ptr = 0;
  std::string kernel;                 // the group's first kernel using the flag
  std::vector<std::string> subjects;  // table (or lengths) names, by the flag's `table`
  std::vector<std::string> checkers;  // the kernel that checks each, by the flag's `table`
};

struct CudaExecutor::Impl {
  std::shared_ptr<CudaSession> session;
  CudaExecutorOptions options;
  codegen::CudaProgram built;
  codegen::Program& program = built.program;
  DeviceBuffer arena;
  std::vector<DeviceBuffer> owned;            // inputs, constants, error flags
  std::vector<CUdeviceptr> address;           // per program buffer
  std::vector<ErrorFlag> flags;
  std::vector<Step> steps;                    // in group order
  std::map<int, CUstream> streams;            // Program stream -> CUstream (0: the session's)
  std::vector<std::unique_ptr<Stream>> own_streams;
  std::vector<std::unique_ptr<Event>> events;  // per Program event
  std::vector<std::pair<int, const codegen::Instruction*>> order;  // (stream, instruction) by seq
  // The input pipeline (input_pipeline.h): its bookkeeping, the copy stream, and per slot the
  // pinned and landing copies of the inputs, the pinned copy of the results and three events.
  struct Slot {
    PinnedBuffer pinned, results;
    DeviceBuffer landing;
    std::shared_ptr<Event> uploaded;  // shared with the fences of the staging buffers it uploads
    std::unique_ptr<Event> consumed, done;
  };
  InputPipeline pipeline;
  std::unique_ptr<Stream> copy_stream;
  StagingLayout input_layout;  // per entry of built.inputs, at full (bound) size
  DeviceBuffer input_block;    // the step's inputs, laid out as input_layout (inputs_contiguous)
  bool inputs_contiguous = false;
  StagingLayout result_layout;  // per program result, then one {code, table} pair per error flag
  std::vector<Slot> slots;
  std::shared_ptr<data::StagingPool> staging;  // stagingPool(): batches the data thread placed
  CudaExecutor::StagingStats staging_stats;
  // The ticket launched with the tracer recording (-1: none), and its origin on the host clock.
  int64_t traced_ticket = -1;
  double trace_origin_us = 0;
  std::vector<std::unique_ptr<LoadedModule>> modules;
  std::map<std::string, CUfunction> functions;  // every kernel of the modules, by name
  std::unique_ptr<CudaGraph> graph;
  int kernels = 0, gemms = 0, compiled_count = 0, runs = 0;
  // Tracing: an origin event, then a begin and an end event per step (made at the first traced
  // run), and the Program stream each step ran on in the last traced run.
  std::vector<CUevent> trace_events;
  std::vector<int> trace_stream;

  ~Impl();
  CudaSession::Impl& s() { return session->impl(); }
  Status createPipeline(int slots);
  // The batch's view of each entry of built.inputs, checked against its bound shape, and the
  // bytes it holds.
  Status checkInputs(const runtime::cpu::Batch& batch, std::vector<const ir::TensorView*>& views,
                     std::vector<size_t>& bytes) const;
  // One operation of the pipeline's plan: `views`/`bytes`/`fill` for stage()'s, `out` for
  // ReadResults.
  Status apply(const PipelineOp& op, const std::vector<const ir::TensorView*>* views,
               const std::vector<size_t>* bytes, const HostFill* fill, std::vector<ir::HostTensor>* out);
  Status runStepOnStream0(int64_t ticket);
  // Forgets a ticket (InputPipeline::drop), and its trace if it was the traced one.
  Status drop(int64_t ticket) {
    if (ticket == traced_ticket) traced_ticket = -1;
    return pipeline.drop(ticket);
  }
  Status runStep(const Step& step, CUstream st);
  Status enqueue(bool traced = false);
  Status compileKernels(const ir::Function& f, const std::vector<codegen::LoweredGroup>& groups);
  Status loadKernels(const ir::Function& f, const ir::SymbolBindings& symbols, const KernelSet& set);
  Status beginTrace(double* origin_us, const runtime::Tracer& tracer);
  Status finishTrace(runtime::Tracer& tracer, double origin_us);
};

CudaExecutor::Impl::~Impl() {
  // An upload or a step may still be in flight over the pinned and device slots freed next.
  if (copy_stream) (void)copy_stream->synchronize();
  if (!pipeline.inFlight().empty()) (void)s().stream->synchronize();
  for (CUevent e : trace_events)
    if (e) s().drv()->cuEventDestroy(e);
}

// JIT: the function's kernels in several NVRTC programs compiled in parallel, one module each.
Status CudaExecutor::Impl::compileKernels(const ir::Function& f,
                                          const std::vector<codegen::LoweredGroup>& groups) {
  std::vector<const codegen::Kernel*> all;
  for (const codegen::LoweredGroup& g : groups)
    for (const codegen::Kernel& k : g.kernels) all.push_back(&k);
  if (all.empty()) return Status::ok();
  auto nvrtc = s().compiler();
  if (!nvrtc) return Status::errorf("compiling the kernels of @{}: {}", f.name(), nvrtc.status().message());
  const int threads = nvrtcThreads(options.nvrtc_threads);
  std::vector<codegen::CudaModule> modules;
  for (const auto& program : splitIntoPrograms(all, threads)) modules.push_back(codegen::emitModule(program));
  std::vector<CompileJob> jobs;
  for (const codegen::CudaModule& m : modules) jobs.push_back({&m, s().arch});
  const int before = (*nvrtc)->compilations();
  auto compiled = compileInParallel(**nvrtc, jobs, threads);
  if (!compiled)
    return Status::errorf("compiling the kernels of @{}: {}", f.name(), compiled.status().message());
  compiled_count = (*nvrtc)->compilations() - before;
  for (size_t i = 0; i < modules.size(); ++i) {
    KILN_ASSIGN_OR_RETURN(auto loaded, LoadedModule::load(s().drv(), (*compiled)[i].cubin));
    for (const codegen::EmittedKernel& k : modules[i].kernels) {
      KILN_ASSIGN_OR_RETURN(CUfunction fn, loaded->function(k.name));
      functions.emplace(k.name, fn);
    }
    this->modules.push_back(std::move(loaded));
  }
  return Status::ok();
}

// Ahead of time: the set's images for the session's arch; NVRTC stays unloaded.
Status CudaExecutor::Impl::loadKernels(const ir::Function& f, const ir::SymbolBindings& symbols,
                                       const KernelSet& set) {
  std::vector<std::string> names;
  for (const codegen::CudaStep& cs : built.steps)
    if (!cs.isGemm() && std::find(names.begin(), names.end(), cs.name) == names.end())
      names.push_back(cs.name);
  if (names.empty()) return Status::ok();
  const std::vector<std::string> have = set.kernelNames();
  for (const std::string& n : names)
    if (!std::binary_search(have.begin(), have.end(), n)) {
      std::string at;
      for (const auto& [sym, value] : symbols)
        at += fmt::format("{}{}={}", at.empty() ? "" : ", ", sym, value);
      return Status::errorf(
          "cuda executor: the compiled kernels have no '{}' of @{} (compiled for another batch or "
          "model? this executor runs at {})",
          n, f.name(), at.empty() ? "no symbols" : at);
    }
  auto chosen = set.select(s().arch, names);
  if (!chosen) return Status::errorf("cuda executor: @{}: {}", f.name(), chosen.status().message());
  for (const KernelImage* image : *chosen) {
    KILN_ASSIGN_OR_RETURN(auto loaded, LoadedModule::loadImage(s().drv(), image->bytes.c_str(),
                                                               fmt::format("a {}-byte {} image of {} kernels",
                                                                           image->bytes.size(), image->arch,
                                                                           image->kernels.size())));
    for (const std::string& k : image->kernels) {
      if (functions.count(k) || std::find(names.begin(), names.end(), k) == names.end()) continue;
      KILN_ASSIGN_OR_RETURN(CUfunction fn, loaded->function(k));
      functions.emplace(k, fn);
    }
    modules.push_back(std::move(loaded));
  }
  return Status::ok();
}

// Records the origin on stream 0 and waits for it, so that the host clock read just after is
// the device's time zero of this run (within the wake-up latency).
Status CudaExecutor::Impl::beginTrace(double* origin_us, const runtime::Tracer& tracer) {
  CudaDriver* drv = s().drv();
  if (trace_events.empty()) {
    trace_events.assign(1 + 2 * steps.size(), nullptr);
    for (CUevent& e : trace_events)
      KILN_CU(drv, cuEventCreate(&e, CU_EVENT_DEFAULT), "creating a trace event");
  }
  trace_stream.assign(steps.size(), -1);
  KILN_CU(drv, cuEventRecord(trace_events[0], streams.at(0)), "tracing");
  KILN_CU(drv, cuEventSynchronize(trace_events[0]), "tracing");
  *origin_us = tracer.nowUs();
  return Status::ok();
}

// After the run synchronized: one event per step that ran, from the device's timings.
Status CudaExecutor::Impl::finishTrace(runtime::Tracer& tracer, double origin_us) {
  CudaDriver* drv = s().drv();
  for (size_t i = 0; i < steps.size(); ++i) {
    if (trace_stream[i] < 0) continue;
    float begin_ms = 0, dur_ms = 0;
    KILN_CU(drv, cuEventElapsedTime(&begin_ms, trace_events[0], trace_events[1 + 2 * i]), "tracing");
    KILN_CU(drv, cuEventElapsedTime(&dur_ms, trace_events[1 + 2 * i], trace_events[2 + 2 * i]), "tracing");
    const codegen::CudaStep& plan = *steps[i].plan;
    tracer.complete(
        runtime::TraceEvent{plan.name,
                            plan.isGemm() ? runtime::TraceCategory::Gemm : runtime::TraceCategory::Kernel,
                            options.rank,
                            runtime::streamTrack(trace_stream[i]),
                            origin_us + 1e3 * begin_ms,
                            1e3 * dur_ms,
                            {{"group", plan.group}}});
  }
  return Status::ok();
}

Status CudaExecutor::Impl::runStep(const Step& step, CUstream st) {
  const codegen::CudaStep& plan = *step.plan;
  if (plan.isGemm()) {
    const CUdeviceptr aux = step.args[4] ? step.args[4] + static_cast<CUdeviceptr>(plan.aux_offset) : 0;
    Status r =
        s().blas->matmul(plan.gemm, step.args[0], step.args[1], step.args[2], step.args[3], aux, step.args[5], st);
    if (!r) return Status::errorf("cuBLASLt {}: {}", plan.name, r.message());
    return Status::ok();
  }
  return launchKernel(s().drv(), step.fn, plan.name, plan.launch.grid, plan.launch.block, step.args, st);
}

// The Program's instructions in global order, each on its stream's CUstream (records precede
// the waits on them in that order, so one host thread can enqueue them all).
Status CudaExecutor::Impl::enqueue(bool traced) {
  CudaDriver* drv = s().drv();
  CUstream st0 = streams.at(0);
  for (const ErrorFlag& f : flags) KILN_CU(drv, cuMemsetD32Async(f.ptr, 0, 2, st0), "clearing " + f.kernel + "'s error flag");
  for (const auto& [stream, in] : order) {
    CUstream cs = streams.at(stream);
    switch (in->kind) {
      case codegen::InstrKind::Launch: {
        auto [begin, end] = built.group_steps[static_cast<size_t>(in->attrs.find("group")->second.asInt())];
        for (size_t i = begin; i < end; ++i) {
          if (traced) KILN_CU(drv, cuEventRecord(trace_events[1 + 2 * i], cs), "tracing");
          KILN_RETURN_IF_ERROR(runStep(steps[i], cs));
          if (traced) {
            KILN_CU(drv, cuEventRecord(trace_events[2 + 2 * i], cs), "tracing");
            trace_stream[i] = stream;
          }
        }
        break;
      }
      case codegen::InstrKind::RecordEvent:
        KILN_CU(drv, cuEventRecord(events[static_cast<size_t>(in->event)]->get(), cs),
                fmt::format("event {} on stream {}", in->event, stream));
        break;
      case codegen::InstrKind::WaitEvent:
        KILN_CU(drv, cuStreamWaitEvent(cs, events[static_cast<size_t>(in->event)]->get(), 0),
                fmt::format("stream {} waiting for event {}", stream, in->event));
        break;
      case codegen::InstrKind::HostStep:
        return Status::errorf("@{}: the CUDA executor runs no host step ('{}')", program.function, in->op);
    }
  }
  return Status::ok();
}

Expected<std::unique_ptr<CudaExecutor>> CudaExecutor::create(const ir::Function& f, const ir::SymbolBindings& symbols,
                                                             std::shared_ptr<CudaSession> session,
                                                             const CudaExecutorOptions& options) {
  if (!session) return Status::error("cuda executor: no CUDA session");
  std::unique_ptr<CudaExecutor> ex(new CudaExecutor());
  ex->impl_ = std::make_unique<Impl>();
  Impl& im = *ex->impl_;
  im.session = std::move(session);
  im.options = options;
  CudaSession::Impl& si = im.s();
  CudaDriver* drv = si.drv();
  KILN_RETURN_IF_ERROR(si.ctx->makeCurrent());

  KILN_ASSIGN_OR_RETURN(auto lowered, codegen::lowerFunction(f, symbols));
  std::vector<codegen::LoweredGroup>& groups = lowered;
  // cuBLASLt shares one workspace per session: GEMMs on two streams could run at once over it.
  std::set<int> gemm_streams;
  for (const codegen::LoweredGroup& g : groups)
    if (g.gemm) gemm_streams.insert(g.stream);
  if (gemm_streams.size() > 1)
    return Status::errorf("cuda executor: @{} puts cuBLASLt calls on streams {}; they share one workspace, so GEMMs "
                          "must stay on one stream",
                          f.name(), fmt::join(gemm_streams, " and "));
  KILN_ASSIGN_OR_RETURN(auto built, codegen::buildCudaProgram(f, groups, symbols, kArenaAlignment));
  im.built = std::move(built);
  codegen::Program& p = im.program;
  std::set<int> error_flag_buffers(im.built.error_flags.begin(), im.built.error_flags.end());
  std::map<int, const ir::Op*> constants(im.built.constants.begin(), im.built.constants.end());
  std::set<int> address_tables;
  for (const codegen::CudaProgram::AddressTable& t : im.built.address_tables) address_tables.insert(t.buffer);

  // Streams and events: Program stream 0 is the session's stream.
  for (const codegen::Stream& ps : p.streams) {
    if (ps.id == 0) {
      im.streams[0] = si.stream->get();
      continue;
    }
    auto st = Stream::create(drv);
    if (!st) return Status::errorf("creating stream {} of @{}: {}", ps.id, f.name(), st.status().message());
    im.streams[ps.id] = (*st)->get();
    im.own_streams.push_back(st.take());
  }
  for (int e = 0; e < p.num_events; ++e) {
    KILN_ASSIGN_OR_RETURN(auto ev, Event::create(drv, fmt::format("event {} of @{}", e, f.name())));
    im.events.push_back(std::move(ev));
  }
  for (const codegen::Stream& ps : p.streams)
    for (const codegen::Instruction& in : ps.instrs) im.order.push_back({ps.id, &in});
  std::sort(im.order.begin(), im.order.end(), [](const auto& a, const auto& b) { return a.second->seq < b.second->seq; });

  // Device memory: the arena, then every buffer outside it.
  KILN_ASSIGN_OR_RETURN(
      auto arena,
      DeviceBuffer::allocate(drv, static_cast<size_t>(std::max<int64_t>(p.arena_bytes, kArenaAlignment)),
                             fmt::format("the {}-byte arena of @{}", p.arena_bytes, f.name())));
  im.arena = std::move(arena);
  // The inputs lie in one block laid out as the input pipeline's slots, so that the copy-in
  // from a landing slot is one device copy (R1 has 28 inputs: 26 id tensors, dense, label);
  // an input the planner put in the arena (none today) makes it one copy per input.
  std::vector<size_t> input_bytes;
  std::map<int, size_t> input_index;  // buffer id -> its entry of built.inputs
  im.inputs_contiguous = true;
  for (size_t i = 0; i < im.built.inputs.size(); ++i) {
    const codegen::Buffer& b = p.buffers[static_cast<size_t>(im.built.inputs[i])];
    input_bytes.push_back(static_cast<size_t>(b.bytes));
    input_index[b.id] = i;
    if (b.inArena()) im.inputs_contiguous = false;
  }
  im.input_layout = StagingLayout::plan(input_bytes, kArenaAlignment);
  if (im.inputs_contiguous) {
    KILN_ASSIGN_OR_RETURN(im.input_block, DeviceBuffer::allocate(drv, im.input_layout.total,
                                                                 fmt::format("the inputs of @{}", f.name())));
  }
  im.address.assign(p.buffers.size(), 0);
  for (const codegen::Buffer& b : p.buffers) {
    if (b.inArena()) {
      im.address[b.id] = im.arena.ptr() + static_cast<CUdeviceptr>(b.offset);
    } else if (im.inputs_contiguous && input_index.count(b.id)) {
      im.address[b.id] = im.input_block.ptr() + im.input_layout.offset[input_index.at(b.id)];
    } else if (b.kind == codegen::BufferKind::Parameter && !constants.count(b.id) &&
               !error_flag_buffers.count(b.id) && !address_tables.count(b.id)) {
      auto it = si.params.find(b.name);
      if (it == si.params.end())
        return Status::errorf("cuda executor: parameter '{}' of @{} is not on the device (upload the store first)",
                              b.name, f.name());
      if (static_cast<int64_t>(it->second.bytes()) < b.bytes)
        return Status::errorf("cuda executor: parameter '{}' is {} bytes on the device, @{} needs {}", b.name,
                              it->second.bytes(), f.name(), b.bytes);
      im.address[b.id] = it->second.ptr();
    } else {
      KILN_ASSIGN_OR_RETURN(
          auto buf, DeviceBuffer::allocate(drv, static_cast<size_t>(std::max<int64_t>(b.bytes, 4)),
                                           fmt::format("{} '{}'", codegen::bufferKindName(b.kind), b.name)));
      im.address[b.id] = buf.ptr();
      im.owned.push_back(std::move(buf));
    }
  }
  // Constants: computed by the op's CPU reference, uploaded once.
  for (const auto& [id, op] : constants) {
    ir::HostTensor t(op->result()->type().dtype(), im.built.shapes[id]);
    if (!op->def() || !op->def()->cpu) return Status::errorf("kiln.constant at {}: no reference to evaluate it", op->location().str());
    ir::CpuContext cc;
    cc.symbols = &symbols;
    KILN_RETURN_IF_ERROR(op->def()->cpu(*op, {}, {&t.view}, cc));
    if (!t.storage.empty())
      KILN_CU(drv, cuMemcpyHtoD(im.address[id], t.storage.data(), t.storage.size()), "constant " + p.buffers[id].name);
  }
  // Address tables: every buffer is placed now, so their words are final.
  {
    std::vector<uint64_t> address(im.address.begin(), im.address.end());
    for (const codegen::CudaProgram::AddressTable& t : im.built.address_tables) {
      std::vector<int64_t> words = t.at(address);
      KILN_CU(drv, cuMemcpyHtoD(im.address[t.buffer], words.data(), words.size() * sizeof(int64_t)),
              "address table " + p.buffers[t.buffer].name);
    }
  }
  // Pageable copies may return before their DMA lands; the step's streams do not wait for them.
  if (!constants.empty() || !address_tables.empty())
    KILN_CU(drv, cuCtxSynchronize(), "waiting for the constants of @" + f.name());
  // The kernels: from the set compiled ahead of time, else compiled now.
  if (options.kernels)
    KILN_RETURN_IF_ERROR(im.loadKernels(f, symbols, *options.kernels));
  else
    KILN_RETURN_IF_ERROR(im.compileKernels(f, groups));

  // The steps, every argument resolved to a device address.
  for (const codegen::CudaStep& cs : im.built.steps) {
    Step s;
    s.plan = &cs;
    for (int b : cs.args) s.args.push_back(b < 0 ? CUdeviceptr{0} : im.address[static_cast<size_t>(b)]);
    if (cs.isGemm()) {
      im.steps.push_back(std::move(s));
      ++im.gemms;
      continue;
    }
    auto fn = im.functions.find(cs.name);
    if (fn == im.functions.end()) return Status::errorf("cuda executor: no kernel '{}' was loaded", cs.name);
    s.fn = fn->second;
    const codegen::LoweredGroup& g = groups[static_cast<size_t>(cs.group)];
    const size_t ki = static_cast<size_t>(cs.kernel);
    const codegen::Kernel& k = g.kernels[ki];
    if (k.error_flag >= 0) {
      // One flag per group, shared by its scan ({2, t}) and embedding kernels ({1, t}).
      const CUdeviceptr flag = s.args[static_cast<size_t>(k.error_flag)];
      auto it = std::find_if(im.flags.begin(), im.flags.end(), [&](const ErrorFlag& e) { return e.ptr == flag; });
      if (it == im.flags.end()) {  // the group's list names every table its kernels check
        it = im.flags.insert(im.flags.end(), ErrorFlag{flag, cs.name, {}, {}});
        for (const codegen::ErrorSubject& e : g.error_subjects) it->subjects.push_back(e.name);
        it->checkers.resize(g.error_subjects.size(), "?");
      }
      for (size_t e = 0; e < g.error_subjects.size(); ++e)
        if (g.error_subjects[e].kernel == static_cast<int>(ki)) it->checkers[e] = cs.name;
    }
    im.steps.push_back(std::move(s));
    ++im.kernels;
  }
  // The input pipeline's slots, sized once (the flags are known now).
  KILN_RETURN_IF_ERROR(im.createPipeline(options.input_slots));
  return ex;
}

Status CudaExecutor::Impl::createPipeline(int slot_count) {
  CudaDriver* drv = s().drv();
  pipeline = InputPipeline(slot_count);
  KILN_ASSIGN_OR_RETURN(auto cs, Stream::create(drv));
  copy_stream = std::move(cs);
  std::vector<size_t> bytes;  // input_layout is create()'s, which placed the inputs by it
  for (int id : program.results) {
    const codegen::Buffer& b = program.buffers[id];
    bytes.push_back(static_cast<size_t>(product(built.shapes[id]) * ir::dtypeBytes(b.type.dtype())));
  }
  for (size_t i = 0; i < flags.size(); ++i) bytes.push_back(2 * sizeof(int32_t));
  result_layout = StagingLayout::plan(bytes, 64);
  for (int i = 0; i < pipeline.slots(); ++i) {
    Slot slot;
    const std::string what = fmt::format("input slot {} of @{}", i, program.function);
    KILN_ASSIGN_OR_RETURN(slot.pinned, PinnedBuffer::allocate(drv, input_layout.total, what));
    KILN_ASSIGN_OR_RETURN(slot.landing, DeviceBuffer::allocate(drv, input_layout.total, what));
    KILN_ASSIGN_OR_RETURN(slot.results,
                          PinnedBuffer::allocate(drv, result_layout.total,
                                                 fmt::format("result slot {} of @{}", i, program.function)));
    KILN_ASSIGN_OR_RETURN(slot.uploaded, Event::create(drv, "the upload of " + what));
    KILN_ASSIGN_OR_RETURN(slot.consumed, Event::create(drv, "the copy-in of " + what));
    KILN_ASSIGN_OR_RETURN(slot.done, Event::create(drv, "the results of " + what));
    slots.push_back(std::move(slot));
  }
  return Status::ok();
}

Status CudaExecutor::Impl::checkInputs(const runtime::cpu::Batch& batch,
                                       std::vector<const ir::TensorView*>& views,
                                       std::vector<size_t>& bytes) const {
  for (int id : built.inputs) {
    const codegen::Buffer& b = program.buffers[id];
    const std::vector<int64_t>& shape = built.shapes[id];
    auto it = batch.find(b.name);
    if (it == batch.end())
      return Status::errorf("@{}: the batch has no input '{}'", program.function, b.name);
    const ir::TensorView& v = it->second;
    // A bounded 1-d input (jagged ids, `?(3*B)`) may hold fewer elements than its bound: the
    // kernels read only the ids the lengths cover.
    const bool within_bound = b.type.rank() == 1 && b.type.dim(0).isBounded() && v.shape.size() == 1 &&
                              v.shape[0] <= shape[0];
    if (v.dtype != b.type.dtype() || (v.shape != shape && !within_bound))
      return Status::errorf("@{}: input '{}' is {} {}, the CUDA program was built for {} {}",
                            program.function, b.name, ir::dtypeName(v.dtype), shapeStr(v.shape),
                            ir::dtypeName(b.type.dtype()), shapeStr(shape));
    views.push_back(&v);
    bytes.push_back(static_cast<size_t>(product(v.shape) * ir::dtypeBytes(v.dtype)));
  }
  return Status::ok();
}

// The driver calls of one planned operation. Nothing here waits on the host but the two host
// waits: for a pinned slot's previous upload, and for a step's results.
Status CudaExecutor::Impl::apply(const PipelineOp& op, const std::vector<const ir::TensorView*>* views,
                                 const std::vector<size_t>* bytes, const HostFill* fill,
                                 std::vector<ir::HostTensor>* out) {
  CudaDriver* drv = s().drv();
  Slot& slot = slots[static_cast<size_t>(op.slot)];
  CUstream st0 = streams.at(0), copy = copy_stream->get();
  const std::string& fn = program.function;
  switch (op.kind) {
    case PipelineOpKind::HostWaitUploaded:
      KILN_CU(drv, cuEventSynchronize(slot.uploaded->get()),
              fmt::format("waiting for input slot {} of @{}", op.slot, fn));
      break;
    case PipelineOpKind::FillPinned:
      for (size_t i : fill->copies)
        std::memcpy(slot.pinned.data() + input_layout.offset[i], (*views)[i]->data, (*bytes)[i]);
      break;
    case PipelineOpKind::FillPinnedSkipped: {
      // The data thread copied the batch into this buffer; the inputs it does not hold (lr and
      // step) go next to them. A batch staged a second time may still be uploading from it.
      KILN_RETURN_IF_ERROR(staging->waitFence(fill->buffer));
      uint8_t* base = staging->base(fill->buffer);
      for (size_t i : fill->copies)
        std::memcpy(base + input_layout.offset[i], (*views)[i]->data, (*bytes)[i]);
      break;
    }
    case PipelineOpKind::CopyWaitConsumed:
      KILN_CU(drv, cuStreamWaitEvent(copy, slot.consumed->get(), 0), "the copy stream of @" + fn);
      break;
    case PipelineOpKind::Upload:
      // The whole slot in one copy: a bounded input's tail past the batch's ids is never read.
      KILN_CU(drv,
              cuMemcpyHtoDAsync(slot.landing.ptr(),
                                op.from_buffer ? staging->base(fill->buffer) : slot.pinned.data(),
                                input_layout.total, copy),
              fmt::format("uploading the inputs of @{}", fn));
      break;
    case PipelineOpKind::RecordUploaded:
      KILN_CU(drv, cuEventRecord(slot.uploaded->get(), copy), "the copy stream of @" + fn);
      if (fill && fill->inPlace()) {
        // The buffer's next batch waits for this upload (or a later one on the same in-order
        // stream, when the slot's event has been recorded again by then). On the data thread.
        staging->setFence(fill->buffer, [session = session, uploaded = slot.uploaded, fn]() -> Status {
          KILN_RETURN_IF_ERROR(session->impl().ctx->makeCurrent());
          CudaDriver* d = session->impl().drv();
          KILN_CU(d, cuEventSynchronize(uploaded->get()),
                  "waiting for an upload from a staging buffer of @" + fn);
          return Status::ok();
        });
      }
      break;
    case PipelineOpKind::ComputeWaitUploaded:
      KILN_CU(drv, cuStreamWaitEvent(st0, slot.uploaded->get(), 0), "stream 0 of @" + fn);
      break;
    case PipelineOpKind::CopyIn:
      // Into the buffers the step (and its graph) was built on, at device speed.
      if (inputs_contiguous) {
        KILN_CU(drv, cuMemcpyDtoDAsync(input_block.ptr(), slot.landing.ptr(), input_layout.total, st0),
                "the inputs of @" + fn);
        break;
      }
      for (size_t i = 0; i < built.inputs.size(); ++i) {
        const int id = built.inputs[i];
        if (input_layout.bytes[i])
          KILN_CU(drv,
                  cuMemcpyDtoDAsync(address[id], slot.landing.ptr() + input_layout.offset[i],
                                    input_layout.bytes[i], st0),
                  "input " + program.buffers[id].name);
      }
      break;
    case PipelineOpKind::RecordConsumed:
      KILN_CU(drv, cuEventRecord(slot.consumed->get(), st0), "stream 0 of @" + fn);
      break;
    case PipelineOpKind::RunStep:
      return runStepOnStream0(op.ticket);
    case PipelineOpKind::Download: {
      size_t r = 0;
      for (int id : program.results) {
        if (result_layout.bytes[r])
          KILN_CU(drv,
                  cuMemcpyDtoHAsync(slot.results.data() + result_layout.offset[r], address[id],
                                    result_layout.bytes[r], st0),
                  "result " + program.buffers[id].name);
        ++r;
      }
      for (const ErrorFlag& f : flags) {
        KILN_CU(drv,
                cuMemcpyDtoHAsync(slot.results.data() + result_layout.offset[r], f.ptr,
                                  result_layout.bytes[r], st0),
                "the embedding error flag of " + f.kernel);
        ++r;
      }
      break;
    }
    case PipelineOpKind::RecordDone:
      KILN_CU(drv, cuEventRecord(slot.done->get(), st0), "stream 0 of @" + fn);
      break;
    case PipelineOpKind::HostWaitDone: {
      runtime::Tracer* tracer = op.ticket == traced_ticket ? options.tracer : nullptr;
      auto wait_begin = runtime::Tracer::Clock::now();
      Status done = drv->check(drv->cuEventSynchronize(slot.done->get()), "cuEventSynchronize",
                               fmt::format("the results of @{}", fn));
      if (!done) return Status::errorf("@{} on the GPU: {}", fn, done.message());
      if (tracer) {
        traced_ticket = -1;
        tracer->complete("synchronize @" + fn, runtime::TraceCategory::Wait, options.rank,
                         runtime::kHostTrack, wait_begin, runtime::Tracer::Clock::now());
        KILN_RETURN_IF_ERROR(finishTrace(*tracer, trace_origin_us));
      }
      break;
    }
    case PipelineOpKind::ReadResults: {
      const size_t nresults = program.results.size();
      for (size_t k = 0; k < flags.size(); ++k) {
        const ErrorFlag& f = flags[k];
        int32_t flag[2] = {0, 0};
        std::memcpy(flag, slot.results.data() + result_layout.offset[nresults + k], sizeof(flag));
        if (!flag[0]) continue;
        auto at = [&](const std::vector<std::string>& names) {
          return flag[1] >= 0 && static_cast<size_t>(flag[1]) < names.size()
                     ? names[static_cast<size_t>(flag[1])]
                     : std::to_string(flag[1]);
        };
        if (flag[0] == 2)
          return Status::errorf(
              "@{}: jagged lengths '{}' are negative or add up to more ids than the batch holds (kernel {})",
              fn, at(f.subjects), at(f.checkers));
        return Status::errorf("@{}: an id is out of range for embedding table '{}' (kernel {})", fn,
                              at(f.subjects), at(f.checkers));
      }
      for (size_t r = 0; r < nresults; ++r) {
        const int id = program.results[r];
        ir::HostTensor t(program.buffers[id].type.dtype(), built.shapes[id]);
        if (!t.storage.empty())
          std::memcpy(t.storage.data(), slot.results.data() + result_layout.offset[r], t.storage.size());
        out->push_back(std::move(t));
      }
      break;
    }
  }
  return Status::ok();
}

// The step itself on stream 0 (and the streams it forks): traced eagerly, replayed as the
// graph, captured at the second launch, or eagerly on the first.
Status CudaExecutor::Impl::runStepOnStream0(int64_t ticket) {
  CudaDriver* drv = s().drv();
  CUstream st = streams.at(0);
  if (options.poison_arena)
    KILN_CU(drv, cuMemsetD8Async(arena.ptr(), 0xFF, arena.bytes(), st), "poisoning the arena");
  // One traced step at a time: its timing events are read when it is collected (a caller two
  // steps ahead runs the second one untraced).
  runtime::Tracer* tracer =
      options.tracer && options.tracer->recording() && traced_ticket < 0 ? options.tracer : nullptr;
  if (tracer) {
    KILN_RETURN_IF_ERROR(beginTrace(&trace_origin_us, *tracer));
    traced_ticket = ticket;
    KILN_RETURN_IF_ERROR(enqueue(/*traced=*/true));
  } else if (graph) {
    KILN_RETURN_IF_ERROR(graph->launch(st));
  } else if (options.use_graph && runs >= 1) {
    // The first run went eagerly (cuBLASLt chose its algorithms); now capture and replay. The
    // capture starts on stream 0 and reaches the other streams through the Program's fork event.
    KILN_RETURN_IF_ERROR(CudaGraph::beginCapture(drv, st));
    Status s = enqueue();
    if (!s) {
      CUgraph g = nullptr;
      drv->cuStreamEndCapture(st, &g);
      if (g) drv->cuGraphDestroy(g);
      return Status::errorf("capturing @{} as a CUDA graph: {}", program.function, s.message());
    }
    auto captured = CudaGraph::endCapture(drv, st);
    if (!captured)
      return Status::errorf("capturing @{} as a CUDA graph: {}", program.function,
                            captured.status().message());
    graph = captured.take();
    KILN_RETURN_IF_ERROR(graph->launch(st));
  } else {
    KILN_RETURN_IF_ERROR(enqueue());
  }
  ++runs;
  return Status::ok();
}

CudaExecutor::~CudaExecutor() = default;

Expected<std::vector<ir::HostTensor>> CudaExecutor::run(const runtime::cpu::Batch& batch) {
  KILN_ASSIGN_OR_RETURN(Ticket t, stage(batch));
  KILN_RETURN_IF_ERROR(launch(t));
  return collect(t);
}

Expected<CudaExecutor::Ticket> CudaExecutor::stage(const runtime::cpu::Batch& batch) {
  Impl& im = *impl_;
  KILN_RETURN_IF_ERROR(im.s().ctx->makeCurrent());
  std::vector<const ir::TensorView*> views;
  std::vector<size_t> bytes;
  KILN_RETURN_IF_ERROR(im.checkInputs(batch, views, bytes));
  std::vector<const void*> data;
  for (const ir::TensorView* v : views) data.push_back(v->data);
  const HostFill fill = planHostFill(im.input_layout, data, bytes, im.staging.get());
  std::vector<PipelineOp> ops;
  KILN_ASSIGN_OR_RETURN(Ticket t, im.pipeline.stage(ops, fill.inPlace()));
  for (const PipelineOp& op : ops) {
    Status s = im.apply(op, &views, &bytes, &fill, nullptr);
    if (!s) {
      (void)im.drop(t);
      return s;
    }
  }
  ++(fill.inPlace() ? im.staging_stats.in_place : im.staging_stats.filled);
  im.staging_stats.host_bytes += fill.copy_bytes;
  return t;
}

Status CudaExecutor::launch(Ticket ticket) {
  Impl& im = *impl_;
  KILN_RETURN_IF_ERROR(im.s().ctx->makeCurrent());
  std::vector<PipelineOp> ops;
  KILN_RETURN_IF_ERROR(im.pipeline.launch(ticket, ops));
  for (const PipelineOp& op : ops) {
    Status s = im.apply(op, nullptr, nullptr, nullptr, nullptr);
    if (!s) {
      (void)im.drop(ticket);  // nobody will collect it; the slots stay usable
      return s;
    }
  }
  return Status::ok();
}

Expected<std::vector<ir::HostTensor>> CudaExecutor::collect(Ticket ticket) {
  Impl& im = *impl_;
  KILN_RETURN_IF_ERROR(im.s().ctx->makeCurrent());
  std::vector<PipelineOp> ops;
  KILN_RETURN_IF_ERROR(im.pipeline.collect(ticket, ops));
  std::vector<ir::HostTensor> out;
  for (const PipelineOp& op : ops) KILN_RETURN_IF_ERROR(im.apply(op, nullptr, nullptr, nullptr, &out));
  return out;
}

Status CudaExecutor::drop(Ticket ticket) { return impl_->drop(ticket); }
std::vector<CudaExecutor::Ticket> CudaExecutor::staged() const { return impl_->pipeline.staged(); }

CudaExecutor::StagingStats CudaExecutor::stagingStats() const { return impl_->staging_stats; }

Expected<std::shared_ptr<data::StagingPool>> CudaExecutor::stagingPool(int buffers) {
  Impl& im = *impl_;
  if (im.staging) return im.staging;
  KILN_RETURN_IF_ERROR(im.s().ctx->makeCurrent());
  data::StagingBufferLayout layout;
  for (size_t i = 0; i < im.built.inputs.size(); ++i) {
    layout.names.push_back(im.program.buffers[static_cast<size_t>(im.built.inputs[i])].name);
    layout.offset.push_back(im.input_layout.offset[i]);
    layout.bytes.push_back(im.input_layout.bytes[i]);
  }
  layout.total = im.input_layout.total;
  // Portable: pinned for every context, so a buffer stays valid whichever thread frees it. The
  // last lease may die on any thread: each call makes the context current first.
  data::StagingMemory memory;
  memory.kind = "page-locked";
  std::shared_ptr<CudaSession> session = im.session;
  memory.allocate = [session](size_t bytes) -> Expected<void*> {
    KILN_RETURN_IF_ERROR(session->impl().ctx->makeCurrent());
    void* p = nullptr;
    KILN_CU(session->impl().drv(), cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE),
            fmt::format("{} page-locked bytes for a staging buffer", bytes));
    return p;
  };
  memory.release = [session](void* p) {
    if (session->impl().ctx->makeCurrent().isOk()) session->impl().drv()->cuMemFreeHost(p);
  };
  KILN_ASSIGN_OR_RETURN(im.staging, data::StagingPool::create(std::move(layout), buffers, std::move(memory)));
  return im.staging;
}

Expected<std::vector<CudaExecutor::Timing>> CudaExecutor::profile(const runtime::cpu::Batch& batch) {
  Impl& im = *impl_;
  // A normal run first: inputs uploaded, flags checked, cuBLASLt plans chosen.
  KILN_ASSIGN_OR_RETURN(auto first, run(batch));
  CudaSession::Impl& si = im.s();
  CudaDriver* drv = si.drv();
  CUstream st = im.streams.at(0);
  std::vector<CUevent> events(im.steps.size() + 1, nullptr);
  auto destroy = [&] {
    for (CUevent e : events)
      if (e) drv->cuEventDestroy(e);
  };
  std::vector<Timing> out;
  Status s = [&]() -> Status {
    for (CUevent& e : events) KILN_CU(drv, cuEventCreate(&e, CU_EVENT_DEFAULT), "profiling");
    for (const ErrorFlag& f : im.flags) KILN_CU(drv, cuMemsetD32Async(f.ptr, 0, 2, st), "clearing an error flag");
    KILN_CU(drv, cuEventRecord(events[0], st), "profiling");
    for (size_t i = 0; i < im.steps.size(); ++i) {
      KILN_RETURN_IF_ERROR(im.runStep(im.steps[i], st));
      KILN_CU(drv, cuEventRecord(events[i + 1], st), "profiling");
    }
    KILN_RETURN_IF_ERROR(si.stream->synchronize());
    for (size_t i = 0; i < im.steps.size(); ++i) {
      const Step& step = im.steps[i];
      float ms = 0;
      const codegen::CudaStep& plan = *step.plan;
      KILN_CU(drv, cuEventElapsedTime(&ms, events[i], events[i + 1]), plan.name);
      const codegen::GemmShape& g = plan.gemm;
      out.push_back({plan.name, plan.isGemm(), plan.isGemm() ? 2.0 * g.m * g.n * g.k * g.batch : 0.0, ms});
    }
    return Status::ok();
  }();
  destroy();
  if (!s) return s;
  return out;
}

const codegen::Program& CudaExecutor::plan() const { return impl_->program; }
int CudaExecutor::numKernels() const { return impl_->kernels; }
int CudaExecutor::numGemms() const { return impl_->gemms; }
bool CudaExecutor::graphCaptured() const { return impl_->graph != nullptr; }
int CudaExecutor::kernelsCompiled() const { return impl_->compiled_count; }
int CudaExecutor::modulesLoaded() const { return static_cast<int>(impl_->modules.size()); }

#else  // !KILN_HAVE_CUDA_HEADERS

struct CudaSession::Impl {};
struct CudaExecutor::Impl {
  codegen::Program program;
};

CudaSession::~CudaSession() = default;
Expected<std::shared_ptr<CudaSession>> CudaSession::create(const CudaSessionOptions&) {
  return Status::error("no CUDA: this kiln was built without the CUDA toolkit's headers");
}
Status CudaSession::uploadParameters(const runtime::ParameterStore&) { return Status::error("no CUDA"); }
Status CudaSession::downloadParameters(runtime::ParameterStore&) const { return Status::error("no CUDA"); }
bool CudaSession::hasParameter(const std::string&) const { return false; }
std::string CudaSession::deviceName() const { return ""; }
std::string CudaSession::arch() const { return ""; }
Expected<CudaSession::MemoryInfo> CudaSession::memoryInfo() const { return Status::error("no CUDA"); }

CudaExecutor::~CudaExecutor() = default;
Expected<std::unique_ptr<CudaExecutor>> CudaExecutor::create(const ir::Function&, const ir::SymbolBindings&,
                                                             std::shared_ptr<CudaSession>, const CudaExecutorOptions&) {
  return Status::error("no CUDA: this kiln was built without the CUDA toolkit's headers");
}
Expected<std::vector<ir::HostTensor>> CudaExecutor::run(const runtime::cpu::Batch&) { return Status::error("no CUDA"); }
Expected<CudaExecutor::Ticket> CudaExecutor::stage(const runtime::cpu::Batch&) {
  return Status::error("no CUDA");
}
Status CudaExecutor::launch(Ticket) { return Status::error("no CUDA"); }
Expected<std::vector<ir::HostTensor>> CudaExecutor::collect(Ticket) { return Status::error("no CUDA"); }
Status CudaExecutor::drop(Ticket) { return Status::error("no CUDA"); }
std::vector<CudaExecutor::Ticket> CudaExecutor::staged() const { return {}; }
Expected<std::shared_ptr<data::StagingPool>> CudaExecutor::stagingPool(int) {
  return Status::error("no CUDA");
}
CudaExecutor::StagingStats CudaExecutor::stagingStats() const { return {}; }
Expected<std::vector<CudaExecutor::Timing>> CudaExecutor::profile(const runtime::cpu::Batch&) {
  return Status::error("no CUDA");
}
const codegen::Program& CudaExecutor::plan() const { return impl_->program; }
int CudaExecutor::numKernels() const { return 0; }
int CudaExecutor::numGemms() const { return 0; }
bool CudaExecutor::graphCaptured() const { return false; }
int CudaExecutor::kernelsCompiled() const { return 0; }
int CudaExecutor::modulesLoaded() const { return 0; }

#endif

}  // namespace kiln::cuda
