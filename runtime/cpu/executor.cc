#include "runtime/cpu/executor.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/cpu/kernels/kernels.h"

#ifdef KILN_HAVE_OPENBLAS
extern "C" void openblas_set_num_threads(int num_threads);
#endif

namespace kiln::runtime::cpu {

struct CpuExecutor::Launch {
  ir::Op* op = nullptr;
  const FastKernel* fast = nullptr;
  ir::CpuFn reference = nullptr;
};

CpuExecutor::~CpuExecutor() { std::free(arena_); }

Expected<std::unique_ptr<CpuExecutor>> CpuExecutor::create(codegen::Program program, const ExecutorOptions& options) {
  KILN_RETURN_IF_ERROR(codegen::validate(program));
  if (!program.planned) return Status::error("cpu executor: the program has no memory plan (run planMemory)");
  std::unique_ptr<CpuExecutor> ex(new CpuExecutor());
  ex->options_ = options;
  ex->pool_ = std::make_unique<ThreadPool>(std::max(options.threads, 1));
#ifdef KILN_HAVE_OPENBLAS
  openblas_set_num_threads(std::max(options.threads, 1));
#endif

  for (const codegen::Buffer& b : program.buffers) {
    std::vector<int64_t> shape;
    for (const ir::Dim& d : b.type.shape()) {
      auto v = d.evaluate(program.symbols);
      if (!v) return Status::errorf("cpu executor: %b{} has unbound symbol '{}'", b.id, d.sym());
      shape.push_back(*v);
    }
    if (b.inArena() && b.first_use >= 0 && (b.offset < 0 || b.offset + b.bytes > program.arena_bytes))
      return Status::errorf("cpu executor: %b{} at offset {} ({} bytes) lies outside the {}-byte arena", b.id, b.offset,
                            b.bytes, program.arena_bytes);
    ex->bound_.push_back(std::move(shape));
  }

  ex->shadow_ = std::make_unique<ir::Module>();
  ir::Function& f = ex->shadow_->addFunction("cpu_executor");
  ir::Block& block = f.body().addBlock();
  for (const codegen::Buffer& b : program.buffers) block.addArgument(b.type);

  ex->program_ = std::move(program);
  ex->order_ = static_cast<const codegen::Program&>(ex->program_).ordered();
  std::map<const codegen::Instruction*, int> stream_ids;
  for (const codegen::Stream& st : ex->program_.streams)
    for (const codegen::Instruction& in : st.instrs) stream_ids[&in] = st.id;
  for (const codegen::Instruction* in : ex->order_) ex->stream_of_.push_back(stream_ids.at(in));
  for (const codegen::Instruction* in : ex->order_) {
    Launch l;
    if (in->kind == codegen::InstrKind::HostStep)
      return Status::errorf("cpu executor: unknown host step '{}' at instruction {}", in->op, in->seq);
    if (in->kind == codegen::InstrKind::Launch) {
      std::vector<ir::Value*> operands;
      std::vector<ir::TensorType> types;
      for (int id : in->operands) operands.push_back(block.argument(static_cast<unsigned>(id)));
      for (int id : in->results) types.push_back(ex->program_.buffers[static_cast<size_t>(id)].type);
      l.op = block.push_back(ir::Op::create(in->op, operands, types, in->attrs));
      if (!l.op->def()) return Status::errorf("cpu executor: op '{}' is not in the op table", in->op);
      if (options.use_fast_kernels) l.fast = findFastKernel(*l.op);
      l.reference = l.op->def()->cpu;
      if (!l.fast && !l.reference)
        return Status::errorf("cpu executor: op '{}' (instruction {}) has no CPU kernel and no reference implementation",
                              in->op, in->seq);
    }
    ex->launches_.push_back(l);
  }

  int64_t arena_bytes = ex->program_.arena_bytes;
  if (arena_bytes > 0) {
    ex->arena_ = static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>((arena_bytes + 63) / 64 * 64)));
    if (!ex->arena_) return Status::errorf("cpu executor: cannot allocate a {}-byte arena", arena_bytes);
    if (options.poison_arena) std::memset(ex->arena_, kPoison, static_cast<size_t>(arena_bytes));
  }
  ex->views_.resize(ex->program_.buffers.size());
  return ex;
}

// A source tensor must have the declared dtype and rank; static and symbolic dims match their
// bound value exactly, data-dependent dims may be smaller than their bound.
static Status checkSource(const codegen::Buffer& b, const std::vector<int64_t>& bound, const ir::TensorView& v) {
  const char* what = b.kind == codegen::BufferKind::Input ? "input" : "parameter";
  auto mismatch = [&]() {
    return Status::errorf("{} \"{}\" is {}[{}] but the program expects {} (bound: [{}])", what, b.name,
                          ir::dtypeName(v.dtype), fmt::join(v.shape, ", "), b.type.str(), fmt::join(bound, ", "));
  };
  if (v.dtype != b.type.dtype() || v.rank() != b.type.rank()) return mismatch();
  for (int64_t i = 0; i < v.rank(); ++i) {
    int64_t have = v.shape[static_cast<size_t>(i)], want = bound[static_cast<size_t>(i)];
    if (b.type.dim(i).isBounded() ? (have < 0 || have > want) : have != want) return mismatch();
  }
  if (v.numel() > 0 && !v.data) return Status::errorf("{} \"{}\" has no data", what, b.name);
  return Status::ok();
}

Status CpuExecutor::bindSources(const Batch& batch, ParameterStore& params) {
  for (const codegen::Buffer& b : program_.buffers) {
    const auto& bound = bound_[static_cast<size_t>(b.id)];
    ir::TensorView& v = views_[static_cast<size_t>(b.id)];
    if (b.kind == codegen::BufferKind::Input) {
      auto it = batch.find(b.name);
      if (it == batch.end()) return Status::errorf("missing input \"{}\" ({})", b.name, b.type.str());
      KILN_RETURN_IF_ERROR(checkSource(b, bound, it->second));
      v = it->second;
    } else if (b.kind == codegen::BufferKind::Parameter) {
      ir::HostTensor* t = params.find(b.name);
      if (!t) return Status::errorf("parameter \"{}\" is not in the parameter store", b.name);
      KILN_RETURN_IF_ERROR(checkSource(b, bound, t->view));
      v = t->view;
    } else {
      v.dtype = b.type.dtype();
      v.shape = bound;
      v.data = arena_ + b.offset;
    }
  }
  return Status::ok();
}

Expected<std::vector<ir::HostTensor>> CpuExecutor::run(const Batch& batch, ParameterStore& params) {
  KILN_RETURN_IF_ERROR(bindSources(batch, params));
  fast_launches_ = reference_launches_ = 0;
  ++runs_;
  ir::CpuContext ref_ctx{&program_.symbols, pool_->numThreads(), options_.ranks};
  KernelContext fast_ctx{pool_.get(), &program_.symbols};
  std::vector<const ir::TensorView*> operands;
  std::vector<ir::TensorView*> results;
  for (size_t t = 0; t < order_.size(); ++t) {
    const codegen::Instruction& in = *order_[t];
    if (in.kind != codegen::InstrKind::Launch) continue;  // one thread of execution: events hold by order
    const Launch& l = launches_[t];
    operands.clear();
    results.clear();
    for (int id : in.operands) operands.push_back(&views_[static_cast<size_t>(id)]);
    for (int id : in.results) {
      ir::TensorView& v = views_[static_cast<size_t>(id)];
      v.shape = bound_[static_cast<size_t>(id)];  // full capacity; the kernel sets the actual shape
      results.push_back(&v);
    }
    Tracer* tracer = options_.tracer && options_.tracer->recording() ? options_.tracer : nullptr;
    const bool timed = options_.profile || tracer;
    auto start = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
    Status s = l.fast ? l.fast->run(*l.op, operands, results, fast_ctx) : l.reference(*l.op, operands, results, ref_ctx);
    (l.fast ? fast_launches_ : reference_launches_)++;
    if (timed) {
      auto end = std::chrono::steady_clock::now();
      if (options_.profile) {
        OpTime& p = profile_[in.op];
        p.seconds += std::chrono::duration<double>(end - start).count();
        p.launches += 1;
        p.reference = !l.fast;
      }
      if (tracer)
        tracer->complete(in.op, l.op->is(ir::OpCode::Matmul) ? TraceCategory::Gemm : TraceCategory::Kernel,
                         options_.rank, streamTrack(stream_of_[t]), start, end,
                         {{"seq", in.seq}, {"reference", l.fast ? 0 : 1}});
    }
    if (!s.isOk())
      return Status::errorf("running instruction {} ('{}' -> %b{}): {}", in.seq, in.op,
                            in.results.empty() ? -1 : in.results[0], s.message());
    for (int id : in.results) {
      const codegen::Buffer& b = program_.buffers[static_cast<size_t>(id)];
      const ir::TensorView& v = views_[static_cast<size_t>(id)];
      if (v.bytes() > b.bytes || v.rank() != b.type.rank())
        return Status::errorf("internal error: '{}' set %b{} to [{}], beyond its type {}", in.op, id,
                              fmt::join(v.shape, ", "), b.type.str());
      if (b.inArena()) high_water_mark_ = std::max(high_water_mark_, b.offset + v.bytes());
    }
  }
  std::vector<ir::HostTensor> out;
  for (int id : program_.results) {
    const ir::TensorView& v = views_[static_cast<size_t>(id)];
    ir::HostTensor t(v.dtype, v.shape);
    if (v.bytes() > 0) std::memcpy(t.view.data, v.data, static_cast<size_t>(v.bytes()));
    out.push_back(std::move(t));
  }
  return out;
}

int64_t CpuExecutor::scanTouchedArenaBytes() const {
  for (int64_t i = program_.arena_bytes; i > 0; --i)
    if (arena_[i - 1] != kPoison) return i;
  return 0;
}

}  // namespace kiln::runtime::cpu
