#include "runtime/cpu/executor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "codegen/lower_cpu.h"
#include "runtime/cpu/kernels/kernels.h"
#include "runtime/memory.h"

namespace kiln::runtime::cpu {

struct CpuExecutor::Launch {
  ir::Op* op = nullptr;
  const FastKernel* fast = nullptr;
  ir::CpuFn reference = nullptr;
  // A matmul running the launches after it, up to position `epilogue_through` in order_, as its
  // GEMM's epilogue (planGemmEpilogues): it writes `epilogue_out`, the last one's result.
  int epilogue_through = -1;
  int epilogue_bias = -1, epilogue_out = -1;  // buffer ids; bias -1: none
  GemmActivation epilogue_act = GemmActivation::none;
  // The memory plan gave `epilogue_out` storage that the product reads (a value whose last reader
  // was the matmul): the product writes the executor's scratch, copied there after.
  bool epilogue_via_scratch = false;
  // The first launch of a pointwise group runs the group (planPointwiseGroups): an index into
  // groups_.
  int group = -1;
  bool runs_with_earlier = false;  // run by the matmul or the pointwise group's first launch before it
};

// Launches [first, last] of order_, one pointwise fusion group, compiled.
struct CpuExecutor::PointwiseGroup {
  size_t first = 0, last = 0;
  PointwiseProgram program;
};

CpuExecutor::~CpuExecutor() { std::free(arena_); }

Expected<std::unique_ptr<CpuExecutor>> CpuExecutor::create(codegen::Program program, const ExecutorOptions& options) {
  KILN_RETURN_IF_ERROR(codegen::validate(program));
  if (!program.planned) return Status::error("cpu executor: the program has no memory plan (run planMemory)");
  std::unique_ptr<CpuExecutor> ex(new CpuExecutor());
  ex->options_ = options;
  KILN_ASSIGN_OR_RETURN(ex->pool_, ThreadPool::create(std::max(options.threads, 1)));

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
  ex->recorded_at_.assign(static_cast<size_t>(ex->program_.num_events), 0);
  for (size_t t = 0; t < ex->order_.size(); ++t)
    if (ex->order_[t]->kind == codegen::InstrKind::RecordEvent)
      ex->recorded_at_[static_cast<size_t>(ex->order_[t]->event)] = static_cast<int>(t);
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

  if (options.use_fast_kernels && !options.batch_invariant) ex->planGemmEpilogues();
  if (options.use_fast_kernels) KILN_RETURN_IF_ERROR(ex->planPointwiseGroups());

  int64_t arena_bytes = ex->program_.arena_bytes;
  if (arena_bytes > 0) {
    ex->arena_ = static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>((arena_bytes + 63) / 64 * 64)));
    if (!ex->arena_)
      return Status::errorf("cpu executor: cannot allocate a {}-byte arena ({})", arena_bytes,
                            runtime::outOfMemoryNote());
    if (options.poison_arena) std::memset(ex->arena_, kPoison, static_cast<size_t>(arena_bytes));
  }
  ex->views_.resize(ex->program_.buffers.size());
  return ex;
}

bool CpuExecutor::sharesStorage(int x, int y) const {
  const codegen::Buffer& a = program_.buffers[static_cast<size_t>(x)];
  const codegen::Buffer& b = program_.buffers[static_cast<size_t>(y)];
  return a.inArena() && b.inArena() && a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

std::vector<int> CpuExecutor::readerCounts() const {
  std::vector<int> readers(program_.buffers.size(), 0);
  for (const codegen::Instruction* in : order_)
    if (in->kind == codegen::InstrKind::Launch)
      for (int id : in->operands) ++readers[static_cast<size_t>(id)];
  for (int id : program_.results) readers[static_cast<size_t>(id)] += 2;
  return readers;
}

int CpuExecutor::gemmEpilogues() const {
  int n = 0;
  for (const Launch& l : launches_) n += l.epilogue_through >= 0;
  return n;
}

void CpuExecutor::planGemmEpilogues() {
  const std::vector<int> readers = readerCounts();
  auto type = [&](int id) -> const ir::TensorType& { return program_.buffers[static_cast<size_t>(id)].type; };

  for (size_t t = 0; t < order_.size(); ++t) {
    Launch& mm = launches_[t];
    if (!mm.op || mm.runs_with_earlier || !mm.fast || !mm.op->is(ir::OpCode::Matmul) || !matmulTakesEpilogue(*mm.op))
      continue;
    int cur = order_[t]->results[0];
    const int64_t n = type(cur).dim(type(cur).rank() - 1).isStatic() ? type(cur).dim(type(cur).rank() - 1).size() : -1;
    const std::vector<int>& mm_in = order_[t]->operands;
    // The next launch on the same stream, if it alone of all launches reads `cur`.
    auto next = [&](size_t at) -> const ir::Op* {
      if (at >= order_.size() || order_[at]->kind != codegen::InstrKind::Launch || stream_of_[at] != stream_of_[t] ||
          readers[static_cast<size_t>(cur)] != 1 || order_[at]->results.size() != 1)
        return nullptr;
      for (int id : order_[at]->operands)
        if (id == cur) return launches_[at].op;
      return nullptr;
    };
    size_t at = t + 1;
    int bias = -1;
    GemmActivation act = GemmActivation::none;
    // A bf16 product widened to f32 at once (next() checked that the cast reads the product).
    if (const ir::Op* c = next(at); c && c->is(ir::OpCode::Cast) && type(cur).dtype() == ir::DType::bf16 &&
                                    type(order_[at]->results[0]).dtype() == ir::DType::f32)
      cur = order_[at++]->results[0];
    if (const ir::Op* add = next(at); add && add->is(ir::OpCode::Add) && n > 0) {
      const std::vector<int>& ops = order_[at]->operands;
      const int other = ops[0] == cur ? ops[1] : ops[0];
      const ir::TensorType& bt = type(other);
      if (ops.size() == 2 && other != cur && bt.rank() == 1 && bt.dim(0).isStatic() && bt.dim(0).size() == n &&
          bt.dtype() == type(cur).dtype() && type(order_[at]->results[0]) == type(cur)) {
        bias = other;
        cur = order_[at++]->results[0];
      }
    }
    if (const ir::Op* a = next(at); a && type(order_[at]->results[0]) == type(cur)) {
      if (a->is(ir::OpCode::Relu)) act = GemmActivation::relu;
      else if (a->is(ir::OpCode::Gelu)) act = GemmActivation::gelu_tanh;
      else if (a->is(ir::OpCode::Silu)) act = GemmActivation::silu;
      if (act != GemmActivation::none) cur = order_[at++]->results[0];
    }
    if (at == t + 1) continue;
    mm.epilogue_through = static_cast<int>(at - 1);
    mm.epilogue_bias = bias;
    mm.epilogue_act = act;
    mm.epilogue_out = cur;
    // The planner may give an elementwise result the storage of a value whose last reader was the
    // matmul; the fused product must not write what it reads.
    mm.epilogue_via_scratch = sharesStorage(cur, mm_in[0]) || sharesStorage(cur, mm_in[1]) ||
                              (bias >= 0 && sharesStorage(cur, bias));
    if (mm.epilogue_via_scratch)
      epilogue_scratch_bytes_ = std::max(epilogue_scratch_bytes_, program_.buffers[static_cast<size_t>(cur)].bytes);
    for (size_t u = t + 1; u < at; ++u) launches_[u].runs_with_earlier = true;
  }
}

int CpuExecutor::pointwiseGroups() const { return static_cast<int>(groups_.size()); }

int CpuExecutor::pointwiseGroupLaunches() const {
  int n = 0;
  for (const PointwiseGroup& g : groups_) n += static_cast<int>(g.last - g.first + 1);
  return n;
}

Status CpuExecutor::planPointwiseGroups() {
  const std::vector<int> readers = readerCounts();
  // The group a launch belongs to, if it can be a step of one.
  auto groupOf = [&](size_t u) -> int64_t {
    const codegen::Instruction& in = *order_[u];
    const Launch& l = launches_[u];
    if (in.kind != codegen::InstrKind::Launch || !l.fast || l.runs_with_earlier || l.epilogue_through >= 0 ||
        !isPointwiseStep(*l.op))
      return -1;
    auto it = in.attrs.find(codegen::kGroupAttr);
    return it != in.attrs.end() && it->second.isInt() ? it->second.asInt() : -1;
  };
  for (size_t t = 0; t < order_.size();) {
    const int64_t g = groupOf(t);
    size_t end = t + 1;
    while (g >= 0 && end < order_.size() && groupOf(end) == g && stream_of_[end] == stream_of_[t]) ++end;
    if (end - t < 2) {
      t = end;
      continue;
    }
    std::vector<PointwiseProgram::OpRef> ops;
    for (size_t u = t; u < end; ++u) {
      const codegen::Instruction& in = *order_[u];
      PointwiseProgram::OpRef r{launches_[u].op, in.operands, in.results[0], false};
      int inside = 0;
      for (size_t v = u + 1; v < end; ++v)
        for (int id : order_[v]->operands) inside += id == r.result;
      r.stored = readers[static_cast<size_t>(r.result)] > inside;
      ops.push_back(std::move(r));
    }
    auto program = PointwiseProgram::compile(ops);
    if (!program)
      return Status::errorf("cpu executor: the pointwise group at instruction {}: {}", order_[t]->seq,
                            program.status().message());
    launches_[t].group = static_cast<int>(groups_.size());
    for (size_t u = t + 1; u < end; ++u) launches_[u].runs_with_earlier = true;
    groups_.push_back({t, end - 1, program.take()});
    t = end;
  }
  return Status::ok();
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

namespace {

// The group one collective launch runs over: the executor's, except that a transfer between
// the launch's own operand and result views is issued and left in flight. A reference hook
// that sends from or receives into a scratch copy of its own (a packed reduce_scatter) frees
// it on return, so that transfer completes before the hook returns.
class IssuingGroup final : public ir::RankGroup {
 public:
  IssuingGroup(ir::RankGroup& inner, const std::vector<const ir::TensorView*>& operands,
               const std::vector<ir::TensorView*>& results, std::vector<ir::PendingCollective>& issued)
      : inner_(inner), operands_(operands), results_(results), issued_(issued) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Status allReduceSum(const void* send, void* recv, int64_t count, ir::DType t) override {
    if (!ownViews(send, recv)) return inner_.allReduceSum(send, recv, count, t);
    return keep(inner_.issueAllReduceSum(send, recv, count, t));
  }
  Status reduceScatterSum(const void* send, void* recv, int64_t recv_count, ir::DType t) override {
    if (!ownViews(send, recv)) return inner_.reduceScatterSum(send, recv, recv_count, t);
    return keep(inner_.issueReduceScatterSum(send, recv, recv_count, t));
  }
  Status allGather(const void* send, void* recv, int64_t send_count, ir::DType t) override {
    if (!ownViews(send, recv)) return inner_.allGather(send, recv, send_count, t);
    return keep(inner_.issueAllGather(send, recv, send_count, t));
  }
  Status allToAll(const void* send, void* recv, int64_t count_per_peer, ir::DType t) override {
    if (!ownViews(send, recv)) return inner_.allToAll(send, recv, count_per_peer, t);
    return keep(inner_.issueAllToAll(send, recv, count_per_peer, t));
  }
  Status allToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                   const std::vector<int64_t>& recv_counts, int64_t recv_capacity, ir::DType t) override {
    if (!ownViews(send, recv))
      return inner_.allToAllV(send, send_counts, recv, recv_counts, recv_capacity, t);
    return keep(inner_.issueAllToAllV(send, send_counts, recv, recv_counts, recv_capacity, t));
  }
  Expected<std::vector<int64_t>> exchangeCounts(const std::vector<int64_t>& send_counts) override {
    return inner_.exchangeCounts(send_counts);
  }

 private:
  bool ownViews(const void* send, const void* recv) const {
    bool from = false, to = false;
    for (const ir::TensorView* v : operands_) from |= v->data == send;
    for (const ir::TensorView* v : results_) to |= v->data == recv;
    return from && to;
  }
  Status keep(ir::PendingCollective p) {
    issued_.push_back(std::move(p));
    return Status::ok();
  }

  ir::RankGroup& inner_;
  const std::vector<const ir::TensorView*>& operands_;
  const std::vector<ir::TensorView*>& results_;
  std::vector<ir::PendingCollective>& issued_;
};

}  // namespace

// One collective launch whose transfer is still in flight.
struct CpuExecutor::InFlight {
  size_t issued = 0;  // position in order_
  int stream = 0;
  std::vector<int> buffers;  // its operands and results
  std::vector<ir::PendingCollective> pending;
};

Status CpuExecutor::waitOn(InFlight& f, int waited_at) {
  Status first = Status::ok();
  for (ir::PendingCollective& p : f.pending) {
    Status s = p.wait();
    if (first.isOk() && !s.isOk()) first = s;
  }
  waits_.push_back({order_[f.issued]->seq, waited_at});
  if (!first.isOk())
    return Status::errorf("instruction {} ('{}'): {}", order_[f.issued]->seq, order_[f.issued]->op,
                          first.message());
  return Status::ok();
}

// Waits on every one, even after an error: no transfer may still use the arena when run returns.
Status CpuExecutor::waitAll(std::vector<InFlight>& in_flight, int waited_at) {
  Status first = Status::ok();
  for (InFlight& f : in_flight) {
    Status s = waitOn(f, waited_at);
    if (first.isOk() && !s.isOk()) first = s;
  }
  in_flight.clear();
  return first;
}

Status CpuExecutor::joinBefore(size_t t, std::vector<InFlight>& in_flight) {
  const codegen::Instruction& in = *order_[t];
  auto touches = [&](const InFlight& f) {
    for (int id : in.operands)
      if (std::find(f.buffers.begin(), f.buffers.end(), id) != f.buffers.end()) return true;
    for (int id : in.results)
      if (std::find(f.buffers.begin(), f.buffers.end(), id) != f.buffers.end()) return true;
    return false;
  };
  auto due = [&](const InFlight& f) {
    if (in.kind == codegen::InstrKind::WaitEvent) {
      // A stream waiting on this event follows everything its recorder ran before the record.
      const size_t rec = static_cast<size_t>(recorded_at_[static_cast<size_t>(in.event)]);
      return stream_of_[rec] == f.stream && f.issued < rec;
    }
    // A stream runs in order; and the first use of a collective's buffers needs it done.
    return in.kind == codegen::InstrKind::Launch && (stream_of_[t] == f.stream || touches(f));
  };
  Status first = Status::ok();
  for (auto it = in_flight.begin(); it != in_flight.end();) {
    if (!due(*it)) {
      ++it;
      continue;
    }
    Status s = waitOn(*it, in.seq);
    if (first.isOk() && !s.isOk()) first = s;
    it = in_flight.erase(it);
  }
  if (!first.isOk() || in.kind != codegen::InstrKind::Launch) return first;
  // What is still in flight was not joined: the plan must not give its storage to this launch.
  for (const InFlight& f : in_flight)
    for (int id : in.results)
      for (int busy : f.buffers) {
        if (sharesStorage(id, busy))
          return Status::errorf(
              "internal error: instruction {} ('{}') writes %b{}, whose storage %b{} of the collective at "
              "instruction {} still uses (the memory plan ignored the transfer's lifetime)",
              in.seq, in.op, id, busy, order_[f.issued]->seq);
      }
  return Status::ok();
}

Status CpuExecutor::runLaunch(size_t t, std::vector<InFlight>& in_flight) {
  const Launch& l = launches_[t];
  if (l.runs_with_earlier) return Status::ok();  // the launch before it ran it
  if (l.epilogue_through >= 0) return runGemmWithEpilogue(t, in_flight);
  if (l.group >= 0) return runPointwiseGroup(groups_[static_cast<size_t>(l.group)], in_flight);
  return runKernel(t, in_flight);
}

Status CpuExecutor::runKernel(size_t t, std::vector<InFlight>& in_flight) {
  const codegen::Instruction& in = *order_[t];
  const Launch& l = launches_[t];
  std::vector<const ir::TensorView*>& operands = launch_operands_;
  std::vector<ir::TensorView*>& results = launch_results_;
  operands.clear();
  results.clear();
  for (int id : in.operands) operands.push_back(&views_[static_cast<size_t>(id)]);
  for (int id : in.results) {
    ir::TensorView& v = views_[static_cast<size_t>(id)];
    v.shape = bound_[static_cast<size_t>(id)];  // full capacity; the kernel sets the actual shape
    results.push_back(&v);
  }
  std::vector<ir::PendingCollective> issued;
  std::unique_ptr<IssuingGroup> issuing;
  ir::CpuContext ref_ctx{&program_.symbols, pool_->numThreads(), options_.ranks};
  if (options_.ranks && ir::isCollective(*l.op)) {
    issuing = std::make_unique<IssuingGroup>(*options_.ranks, operands, results, issued);
    ref_ctx.ranks = issuing.get();
  }
  KernelContext fast_ctx{pool_.get(), &program_.symbols, options_.batch_invariant};
  Tracer* tracer = options_.tracer && options_.tracer->recording() ? options_.tracer : nullptr;
  const bool timed = options_.profile || tracer;
  auto start = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  Status s = l.fast ? l.fast->run(*l.op, operands, results, fast_ctx)
                    : l.reference(*l.op, operands, results, ref_ctx);
  (l.fast ? fast_launches_ : reference_launches_)++;
  if (!issued.empty()) {
    InFlight f{t, stream_of_[t], in.operands, std::move(issued)};
    f.buffers.insert(f.buffers.end(), in.results.begin(), in.results.end());
    in_flight.push_back(std::move(f));
    // A failed hook may have issued part of its work: wait for it before reporting.
    if (!options_.overlap_collectives || !s.isOk()) {
      Status w = waitOn(in_flight.back(), in.seq);
      in_flight.pop_back();
      if (s.isOk()) s = w;
    }
  }
  if (timed) recordLaunch(t, start, std::chrono::steady_clock::now(), tracer);
  if (!s.isOk())
    return Status::errorf("running instruction {} ('{}' -> %b{}): {}", in.seq, in.op,
                          in.results.empty() ? -1 : in.results[0], s.message());
  for (int id : in.results) KILN_RETURN_IF_ERROR(checkWritten(id, in.op));
  return Status::ok();
}

void CpuExecutor::recordLaunch(size_t t, std::chrono::steady_clock::time_point start,
                               std::chrono::steady_clock::time_point end, Tracer* tracer) {
  const codegen::Instruction& in = *order_[t];
  const Launch& l = launches_[t];
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

Status CpuExecutor::runGemmWithEpilogue(size_t t, std::vector<InFlight>& in_flight) {
  const Launch& l = launches_[t];
  const codegen::Instruction& in = *order_[t];
  // The fused launches' own joins (their bias, their results) come first.
  for (size_t u = t + 1; u <= static_cast<size_t>(l.epilogue_through); ++u) KILN_RETURN_IF_ERROR(joinBefore(u, in_flight));
  ir::TensorView& y = views_[static_cast<size_t>(l.epilogue_out)];
  y.shape = bound_[static_cast<size_t>(l.epilogue_out)];
  ir::TensorView product = y;
  if (l.epilogue_via_scratch) {
    if (!epilogue_scratch_) {
      epilogue_scratch_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>((epilogue_scratch_bytes_ + 63) / 64 * 64))));
      if (!epilogue_scratch_)
        return Status::errorf("cpu executor: cannot allocate {} bytes for a GEMM epilogue", epilogue_scratch_bytes_);
    }
    product.data = epilogue_scratch_.get();
  }
  MatmulEpilogue e;
  e.bias = l.epilogue_bias >= 0 ? &views_[static_cast<size_t>(l.epilogue_bias)] : nullptr;
  e.act = l.epilogue_act;
  KernelContext ctx{pool_.get(), &program_.symbols, options_.batch_invariant};
  Tracer* tracer = options_.tracer && options_.tracer->recording() ? options_.tracer : nullptr;
  const bool timed = options_.profile || tracer;
  auto start = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  Status s = runMatmulEpilogue(*l.op, views_[static_cast<size_t>(in.operands[0])],
                               views_[static_cast<size_t>(in.operands[1])], e, product, ctx);
  y.shape = product.shape;
  if (s.isOk() && l.epilogue_via_scratch) std::memcpy(y.data, product.data, static_cast<size_t>(y.bytes()));
  fast_launches_ += l.epilogue_through - static_cast<int>(t) + 1;
  if (timed) {
    auto end = std::chrono::steady_clock::now();
    recordLaunch(t, start, end, tracer);
    // The epilogue's launches ran inside the product: each is counted, at no time of its own.
    for (size_t u = t + 1; u <= static_cast<size_t>(l.epilogue_through); ++u) {
      if (options_.profile) profile_[order_[u]->op].launches += 1;
      if (tracer)
        tracer->complete(order_[u]->op, TraceCategory::Kernel, options_.rank, streamTrack(stream_of_[u]), end, end,
                         {{"seq", order_[u]->seq}, {"epilogue_of", in.seq}});
    }
  }
  if (!s.isOk())
    return Status::errorf("running instruction {} ('{}' with its epilogue -> %b{}): {}", in.seq, in.op,
                          l.epilogue_out, s.message());
  return checkWritten(l.epilogue_out, in.op);
}

Status CpuExecutor::checkWritten(int id, std::string_view op) {
  const codegen::Buffer& b = program_.buffers[static_cast<size_t>(id)];
  const ir::TensorView& v = views_[static_cast<size_t>(id)];
  if (v.bytes() > b.bytes || v.rank() != b.type.rank())
    return Status::errorf("internal error: {} set %b{} to [{}], beyond its type {}",
                          op.empty() ? std::string("a pointwise group") : fmt::format("'{}'", op), id,
                          fmt::join(v.shape, ", "), b.type.str());
  if (b.inArena()) high_water_mark_ = std::max(high_water_mark_, b.offset + v.bytes());
  return Status::ok();
}

Status CpuExecutor::runPointwiseGroup(const PointwiseGroup& g, std::vector<InFlight>& in_flight) {
  for (size_t u = g.first + 1; u <= g.last; ++u) KILN_RETURN_IF_ERROR(joinBefore(u, in_flight));
  Tracer* tracer = options_.tracer && options_.tracer->recording() ? options_.tracer : nullptr;
  const bool timed = options_.profile || tracer;
  auto start = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  Expected<bool> ran = g.program.run(views_, *pool_);
  if (!ran)
    return Status::errorf("running instructions {} to {} (a pointwise group): {}", order_[g.first]->seq,
                          order_[g.last]->seq, ran.status().message());
  if (!*ran) {
    // Run-time shapes the group cannot iterate as one: op by op.
    for (size_t u = g.first; u <= g.last; ++u) KILN_RETURN_IF_ERROR(runKernel(u, in_flight));
    return Status::ok();
  }
  fast_launches_ += static_cast<int>(g.last - g.first + 1);
  if (timed) {
    auto end = std::chrono::steady_clock::now();
    const codegen::Instruction& first = *order_[g.first];
    // The group's time is a row of its own, kiln.fused; each of its launches is counted at none.
    if (options_.profile) {
      OpTime& p = profile_[std::string(ir::opName(ir::OpCode::Fused))];
      p.seconds += std::chrono::duration<double>(end - start).count();
      p.launches += 1;
    }
    if (tracer)
      tracer->complete(std::string(ir::opName(ir::OpCode::Fused)), TraceCategory::Kernel, options_.rank,
                       streamTrack(stream_of_[g.first]), start, end,
                       {{"seq", first.seq}, {"ops", static_cast<int64_t>(g.last - g.first + 1)}});
    for (size_t u = g.first; u <= g.last; ++u) {
      if (options_.profile) profile_[order_[u]->op].launches += 1;
      if (tracer)
        tracer->complete(order_[u]->op, TraceCategory::Kernel, options_.rank, streamTrack(stream_of_[u]), end, end,
                         {{"seq", order_[u]->seq}, {"group_of", first.seq}});
    }
  }
  for (int id : g.program.storedResults()) KILN_RETURN_IF_ERROR(checkWritten(id, ""));
  return Status::ok();
}

Expected<std::vector<ir::HostTensor>> CpuExecutor::run(const Batch& batch, ParameterStore& params) {
  KILN_RETURN_IF_ERROR(bindSources(batch, params));
  fast_launches_ = reference_launches_ = 0;
  ++runs_;
  waits_.clear();
  std::vector<InFlight> in_flight;
  Status s = Status::ok();
  for (size_t t = 0; t < order_.size() && s.isOk(); ++t) {
    s = joinBefore(t, in_flight);
    if (s.isOk() && order_[t]->kind == codegen::InstrKind::Launch) s = runLaunch(t, in_flight);
  }
  const int end_seq = order_.empty() ? 0 : order_.back()->seq + 1;
  Status drained = waitAll(in_flight, end_seq);
  KILN_RETURN_IF_ERROR(s);
  KILN_RETURN_IF_ERROR(drained);
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
