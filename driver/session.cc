#include "driver/session.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

#include "codegen/cuda_program.h"
#include "codegen/kernel_lowering.h"
#include "codegen/lower_cpu.h"
#include "ir/checked.h"
#include "ir/ops/kernel_util.h"
#include "ir/parser.h"
#include "ir/verifier.h"
#include "runtime/checkpoint.h"
#include "runtime/cuda/cublaslt.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/sharded_checkpoint.h"

namespace kiln::driver {

const ir::Attribute* trainValue(const ir::AttrDict& train, std::string_view key) {
  auto it = train.find(key);
  return it == train.end() ? nullptr : &it->second;
}

std::string formatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

namespace {

// The tables a serving session leaves to its store (SessionOptions::external_tables).
std::set<std::string, std::less<>> externalTables(const ir::Module& m, const SessionOptions& options) {
  std::set<std::string, std::less<>> names;
  const ir::Function* fwd = options.external_tables ? m.lookup("forward") : nullptr;
  if (fwd)
    for (const serving::ServedTable& t : serving::findServedTables(*fwd)) names.insert(t.name);
  return names;
}

// Every parameter and optimizer state the session holds (a served table's store holds its own),
// named with its concrete type, so that a table too big to fit shows its rows and dim.
Status addParameters(runtime::MemoryNeed& need, const ir::Module& m, const SessionOptions& options) {
  KILN_ASSIGN_OR_RETURN(auto params, runtime::parameterSpecs(m, {{"B", options.batch}}));
  const std::set<std::string, std::less<>> external = externalTables(m, options);
  for (const runtime::ParameterSpec& p : params)
    if (!external.count(p.name))
      need.add(fmt::format("parameter \"{}\" {}[{}]", p.name, ir::dtypeName(p.dtype), fmt::join(p.shape, ", ")),
               p.optimizer_state ? kOptimizerStateKind : kWeightsKind, static_cast<uint64_t>(p.bytes));
  return Status::ok();
}

// The function a session runs: @train_step when training, else @forward.
Expected<const ir::Function*> sessionFunction(const ir::Module& m, const SessionOptions& options) {
  const std::string function = options.training ? "train_step" : "forward";
  const ir::Function* f = m.lookup(function);
  if (!f) return Status::error(fmt::format("{}: the model has no @{}", options.model_path, function));
  return f;
}

}  // namespace

Expected<int64_t> plannedPeakBytes(const ir::Function& f, int64_t batch) {
  KILN_ASSIGN_OR_RETURN(auto program, codegen::lowerForCpu(f, {{"B", batch}}));
  return program.peak_bytes;
}

Expected<std::string> memoryBudgetWarning(const ir::Module& m, int64_t batch, std::string_view budget_text) {
  auto remat = m.attrs().find("kiln.remat");
  const ir::Function* f = m.lookup("train_step");
  if (remat == m.attrs().end() || !remat->second.isDict() || !f) return std::string();
  const int64_t budget = remat->second.asDict().at("budget_bytes").asInt();
  KILN_ASSIGN_OR_RETURN(auto program, codegen::lowerForCpu(*f, {{"B", batch}}));
  if (program.peak_bytes <= budget) return std::string();
  // The instruction where the most arena bytes are live (storage written in place counted
  // once), and who wrote each buffer.
  std::map<int, std::string> writer;
  int last = 0;
  for (const codegen::Stream& stream : program.streams)
    for (const codegen::Instruction& in : stream.instrs) {
      last = std::max(last, in.seq);
      if (in.kind == codegen::InstrKind::Launch)
        for (int r : in.results) writer.emplace(r, in.op);
    }
  auto liveAt = [&](const codegen::Buffer& b, int t) { return b.first_use <= t && t <= b.last_use; };
  int peak_at = 0;
  int64_t peak_live = -1;
  for (int t = 0; t <= last; ++t) {
    int64_t live = 0;
    for (const codegen::Buffer& b : program.buffers)
      if (b.inArena() && liveAt(b, t) &&
          !(b.in_place_of >= 0 && liveAt(program.buffers[static_cast<size_t>(b.in_place_of)], t)))
        live += b.bytes;
    if (live > peak_live) peak_live = live, peak_at = t;
  }
  std::vector<const codegen::Buffer*> there;
  for (const codegen::Buffer& b : program.buffers)
    if (b.inArena() && liveAt(b, peak_at)) there.push_back(&b);
  std::stable_sort(there.begin(), there.end(), [](auto* a, auto* b) { return a->bytes > b->bytes; });
  std::vector<std::string> largest;
  for (size_t i = 0; i < there.size() && i < 3; ++i) {
    const codegen::Buffer& b = *there[i];
    auto w = writer.find(b.id);
    largest.push_back(fmt::format("{}{} {}", w == writer.end() ? "an input" : w->second,
                                  b.name.empty() ? "" : " \"" + b.name + "\"",
                                  runtime::formatBytes(static_cast<uint64_t>(b.bytes))));
  }
  return fmt::format(
      "warning: --memory-budget {}: recomputation gets the training step's planned peak down to {} bytes, "
      "not to the budget of {} bytes ({} against {}). At the peak (instruction {} of {}) {} are live, the "
      "largest: {}; recomputation found nothing there it could free (a backward's temporaries and the "
      "weights' gradients are not recomputable; a smaller --batch lowers what scales with it)\n",
      budget_text, program.peak_bytes, budget, runtime::formatBytes(static_cast<uint64_t>(program.peak_bytes)),
      runtime::formatBytes(static_cast<uint64_t>(budget)), peak_at, last + 1,
      runtime::formatBytes(static_cast<uint64_t>(peak_live)), fmt::join(largest, ", "));
}

Expected<runtime::MemoryNeed> estimateSessionMemory(const ir::Module& m, const SessionOptions& options,
                                                    const data::BatchSpec& spec) {
  runtime::MemoryNeed need;
  const ir::SymbolBindings symbols{{"B", options.batch}};
  KILN_RETURN_IF_ERROR(addParameters(need, m, options));
  KILN_ASSIGN_OR_RETURN(const ir::Function* f, sessionFunction(m, options));
  const std::string& function = f->name();
  // On a GPU the arena lives in device memory; the host holds the parameters and the data.
  if (options.device != "cuda") {
    KILN_ASSIGN_OR_RETURN(int64_t peak, plannedPeakBytes(*f, options.batch));
    need.add(fmt::format("@{}'s activations (planned arena at batch {})", function, options.batch),
             kActivationsKind, static_cast<uint64_t>(peak));
  }
  // Workspace: the results each step copies out of the arena. (Thread stacks and the kernels'
  // scratch are reserved address space or small; they are not counted.)
  uint64_t results = 0;
  if (const ir::Op* ret = f->returnOp())
    for (const ir::Value* v : ret->operands()) {
      KILN_ASSIGN_OR_RETURN(int64_t b, v->type().checkedBytes(symbols));
      results = checkedAddU(results, static_cast<uint64_t>(b)).value_or(UINT64_MAX);
    }
  need.add(fmt::format("@{}'s results", function), kWorkspaceKind, results);

  // Data: the prefetcher's queue, the batch the reader fills and the batch the step reads.
  uint64_t batch_bytes = 0;
  for (const data::InputSpec& in : spec.inputs) {
    auto b = in.type.checkedBytes({{spec.batch_symbol, options.batch}});
    if (!b)
      return Status::error(
          fmt::format("input \"{}\" at --batch {}: {}", in.name, options.batch, b.status().message()));
    batch_bytes = checkedAddU(batch_bytes, static_cast<uint64_t>(*b)).value_or(UINT64_MAX);
  }
  const int batches = (options.training ? kTrainPrefetchDepth : kEvalPrefetchDepth) + 2;
  need.add(fmt::format("{} batches of {} samples", batches, options.batch), kDataBuffersKind,
           checkedMulU(batch_bytes, static_cast<uint64_t>(batches)).value_or(UINT64_MAX));

  if (!options.checkpoint_path.empty()) {
    std::filesystem::path path = options.checkpoint_path;
    std::error_code ec;
    if (std::filesystem::is_regular_file(path / runtime::kShardedIndexFile, ec)) {
      // Merged in memory: about the size of its shard files together.
      uintmax_t size = 0;
      for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("shard-", 0) != 0 || entry.path().extension() != ".safetensors") continue;
        const uintmax_t bytes = std::filesystem::file_size(entry.path(), ec);
        if (!ec) size += bytes;
      }
      need.add(fmt::format("sharded checkpoint {} being loaded", path.string()), kCheckpointKind, size);
    } else {
      if (std::filesystem::is_directory(path, ec)) path /= "checkpoint.safetensors";
      const uintmax_t size = std::filesystem::file_size(path, ec);
      if (!ec) need.add(fmt::format("checkpoint {} being loaded", path.string()), kCheckpointKind, size);
    }
  }
  return need;
}

Expected<runtime::MemoryNeed> estimateDeviceMemory(const ir::Module& m, const SessionOptions& options) {
  runtime::MemoryNeed need;
  const ir::SymbolBindings symbols{{"B", options.batch}};
  KILN_RETURN_IF_ERROR(addParameters(need, m, options));
  KILN_ASSIGN_OR_RETURN(const ir::Function* f, sessionFunction(m, options));
  const std::string& function = f->name();
  KILN_ASSIGN_OR_RETURN(auto groups, codegen::lowerFunction(*f, symbols));
  KILN_ASSIGN_OR_RETURN(auto built, codegen::buildCudaProgram(*f, groups, symbols));
  const codegen::Program& program = built.program;
  need.add(fmt::format("@{}'s activations (the CUDA program's planned arena at batch {})", function, options.batch),
           kActivationsKind, static_cast<uint64_t>(program.arena_bytes));
  // Outside the arena: the inputs, the constants and the embedding error flags, each its own
  // allocation (at least 4 bytes); the parameters are counted above.
  std::set<int> own(built.error_flags.begin(), built.error_flags.end());
  for (const auto& [id, op] : built.constants) own.insert(id);
  for (const codegen::CudaProgram::AddressTable& t : built.address_tables) own.insert(t.buffer);
  uint64_t outside = 0;
  for (const codegen::Buffer& b : program.buffers)
    if (!b.inArena() && (b.kind != codegen::BufferKind::Parameter || own.count(b.id)))
      outside = checkedAddU(outside, static_cast<uint64_t>(std::max<int64_t>(b.bytes, 4))).value_or(UINT64_MAX);
  need.add(fmt::format("@{}'s inputs, constants and error flags", function), kWorkspaceKind, outside);
  need.add("cuBLASLt's workspace", kWorkspaceKind, cuda::kCublasLtWorkspaceBytes);
  return need;
}

MemoryTotals memoryTotals(const runtime::MemoryNeed& need) {
  MemoryTotals t;
  for (const auto& [kind, bytes] : need.byKind()) {
    uint64_t* slot = kind == kWeightsKind          ? &t.param_bytes
                     : kind == kOptimizerStateKind ? &t.optimizer_bytes
                     : kind == kActivationsKind    ? &t.activation_peak_bytes
                     : kind == kWorkspaceKind      ? &t.workspace_bytes
                     : kind == kDataBuffersKind    ? &t.data_bytes
                     : kind == kCheckpointKind     ? &t.checkpoint_bytes
                                                   : nullptr;
    if (slot) *slot = bytes;
  }
  t.peak_bytes = need.total();
  return t;
}

runtime::MemoryLimit sessionMemoryLimit(const SessionOptions& options) {
  runtime::MemoryLimit limit;
  if (options.memory_limit_percent > 0) {
    limit = runtime::availableMemory(std::nullopt);
    if (limit.bytes) {
      const uint64_t machine = *limit.bytes;
      *limit.bytes =
          static_cast<uint64_t>(static_cast<long double>(machine) * options.memory_limit_percent / 100.0L);
      limit.source = fmt::format("--memory-limit {:g}% of {} ({})", options.memory_limit_percent,
                                 runtime::formatBytes(machine), limit.source);
    }
  } else {
    limit = runtime::availableMemory(options.memory_limit);
  }
  if (options.memory_shares > 1 && limit.bytes) {
    // In-process ranks share one process's memory: each may use its share.
    *limit.bytes /= static_cast<uint64_t>(options.memory_shares);
    limit.source += fmt::format(", shared by {} in-process ranks", options.memory_shares);
  }
  return limit;
}

namespace {

// The embedded weights of a compiled model as the store's starting tensors, without a copy:
// views into the payload's private mapping (a session that trains writes them in place, in this
// process only). Only the tensors the module declares: an evaluating session leaves a training
// checkpoint's optimizer state out. The store then checks each against its declared type.
Expected<runtime::ParameterStore> embeddedParameters(const CompiledModel& c, const ir::Module& m,
                                                     const ir::SymbolBindings& symbols) {
  KILN_ASSIGN_OR_RETURN(
      auto ckpt,
      runtime::viewCheckpoint(
          c.weights, c.payload ? c.payload->path() + " (weights)" : "the embedded weights", c.payload));
  KILN_ASSIGN_OR_RETURN(auto specs, runtime::parameterSpecs(m, symbols));
  std::map<std::string, ir::HostTensor*, std::less<>> by_name;
  for (auto& [name, t] : ckpt.tensors) by_name[name] = &t;
  runtime::ParameterStore store;
  for (const runtime::ParameterSpec& spec : specs) {
    auto it = by_name.find(spec.name);
    if (it == by_name.end()) return Status::errorf("the embedded weights have no tensor '{}'", spec.name);
    store.set(spec.name, std::move(*it->second));  // moved: still a view, not a copy
  }
  return store;
}

}  // namespace

Status Session::openDevice(const std::string& planned_target) {
  if (options_.device == "cuda") {
    // Before the passes: without --target they plan for this GPU.
    std::string why;
    if (!cuda::cudaAvailable(&why)) return Status::error(fmt::format("--device cuda: {}", why));
    auto cs = cuda::CudaSession::create();
    if (!cs) return Status::error(fmt::format("--device cuda: {}", cs.status().message()));
    cuda_ = cs.take();
  } else if (options_.device != "cpu") {
    return Status::error(fmt::format("unknown device '{}' (cpu or cuda)", options_.device));
  }
  const std::string& name = planned_target.empty() ? options_.target : planned_target;
  if (!name.empty()) {
    auto t = targetByName(name);
    if (!t) return Status::error(fmt::format("--target: {}", t.status().message()));
    target_ = t.take();
  } else {
    target_ = cuda_ ? gpuTargetForDevice(cuda_->deviceName()) : cpuTarget();
  }
  return Status::ok();
}

Expected<std::unique_ptr<Session>> Session::fromCompiled(
    std::shared_ptr<const CompiledModel> compiled, const SessionOptions& options, std::ostream& diag) {
  std::unique_ptr<Session> s(new Session());
  s->options_ = options;
  s->compiled_ = std::move(compiled);
  const CompiledModel& c = *s->compiled_;
  if (options.batch > c.max_batch)
    return Status::errorf(
        "--batch {} is over the {} samples this model was compiled for (kiln compile --max-batch {})",
        options.batch, c.max_batch, c.max_batch);
  if (options.comm && options.comm->size() > 1)
    return Status::errorf("this model was compiled for one rank; it cannot run on {}", options.comm->size());
  if (options.training && !c.cpu_programs.count("train_step"))
    return Status::error("this model was compiled without its training step (kiln compile --functions)");
  KILN_RETURN_IF_ERROR(s->openDevice(c.target));
  KILN_ASSIGN_OR_RETURN(auto module, ir::parseModule(c.module_text, c.name + " (compiled IR)"));
  runtime::ParameterStore preset;
  if (!c.weights.empty()) {
    KILN_ASSIGN_OR_RETURN(preset, embeddedParameters(c, *module, {{"B", options.batch}}));
  }
  KILN_RETURN_IF_ERROR(s->adopt(std::move(module), std::move(preset)));
  return s;
}

Status Session::adopt(std::unique_ptr<ir::Module> module, runtime::ParameterStore preset) {
  module_ = std::move(module);
  ir::Module& m = *module_;
  const SessionOptions& options = options_;
  if (auto it = m.attrs().find("kiln.model"); it != m.attrs().end() && it->second.isString())
    model_name_ = it->second.asString();
  if (auto it = m.attrs().find("kiln.outputs"); it != m.attrs().end() && it->second.isArray())
    for (const auto& a : it->second.asArray()) outputs_.push_back(a.isString() ? a.asString() : "");
  if (auto it = m.attrs().find("kiln.train"); it != m.attrs().end() && it->second.isDict())
    train_ = &it->second.asDict();
  if (options.training && !train_)
    return Status::error(fmt::format("{}: the model has no train block to train with", options.model_path));
  // The pipelined step (the shard pass's kiln.pipeline): the inputs it carries from step to step.
  if (auto it = m.attrs().find("kiln.pipeline"); it != m.attrs().end() && it->second.isDict())
    if (auto c = it->second.asDict().find("carried"); c != it->second.asDict().end() && c->second.isArray())
      for (const auto& a : c->second.asArray()) carried_names_.push_back(a.asString());
  if (!carried_names_.empty() && options.device != "cpu")
    return Status::error("the pipelined step (--pipeline) runs on the CPU only so far");
  const ir::Function* fwd = m.lookup("forward");
  if (!fwd) return Status::error(fmt::format("{}: the model has no @forward", options.model_path));
  KILN_ASSIGN_OR_RETURN(auto fspec, data::fromFunction(*fwd));
  forward_spec_ = std::move(fspec);
  if (options.training) {
    const ir::Function* ts = m.lookup("train_step");
    if (!ts) return Status::error("autodiff did not build @train_step");
    KILN_ASSIGN_OR_RETURN(auto tspec, data::fromFunction(*ts));
    train_spec_ = std::move(tspec);
  } else {
    train_spec_ = forward_spec_;
  }
  // Before the first large allocation: a run that cannot fit stops here, naming what it needs.
  KILN_ASSIGN_OR_RETURN(auto need, estimateSessionMemory(m, options, train_spec_));
  const runtime::MemoryLimit limit = sessionMemoryLimit(options);
  // Under ulimit -v the threads' stacks and the GEMM library's code take address space too: a
  // oneDNN kernel that cannot allocate crashes rather than fail (runtime/memory.h).
  if (limit.address_space && options.device != "cuda")
    need.add(fmt::format("thread stacks and oneDNN's code at --threads {} (address space)", options.threads),
             kWorkspaceKind, runtime::addressSpaceReserve(options.threads));
  if (Status fits = runtime::checkMemoryFits(need, limit); !fits)
    return Status::error(fmt::format("{}\n  to fit: lower --batch or the model's sizes (--set){}",
                                     fits.message(),
                                     limit.source.rfind("--memory-limit", 0) == 0 ? ", or raise --memory-limit" : ""));
  if (cuda_) {
    // The device's half, from the CUDA program: what the GPU has free now is the limit.
    KILN_ASSIGN_OR_RETURN(auto device_need, estimateDeviceMemory(m, options));
    KILN_ASSIGN_OR_RETURN(auto info, cuda_->memoryInfo());
    runtime::MemoryLimit gpu;
    gpu.bytes = info.free_bytes;
    gpu.source = fmt::format("the free memory of {} ({} of {})", cuda_->deviceName(),
                             runtime::formatBytes(info.free_bytes), runtime::formatBytes(info.total_bytes));
    if (Status fits = runtime::checkMemoryFits(device_need, gpu); !fits)
      return Status::error(fmt::format("on the GPU: {}\n  to fit: lower --batch or the model's sizes (--set), or "
                                       "give a --memory-budget",
                                       fits.message()));
  }
  if (options.comm) rank_group_ = std::make_unique<comm::CommunicatorRankGroup>(*options.comm);
  ir::SymbolBindings symbols{{"B", options.batch}};
  // What is not preset is initialized from the seed, unless a checkpoint will overwrite every
  // value (an evaluation: kiln eval and predict load one whole; a training run may start fresh).
  params_ = std::move(preset);
  const bool values_follow = !options.training && !options.checkpoint_path.empty();
  if (options.external_tables) served_tables_ = serving::findServedTables(*fwd);
  std::set<std::string, std::less<>> external;
  for (const serving::ServedTable& t : served_tables_) external.insert(t.name);
  KILN_RETURN_IF_ERROR(params_.initializeFrom(m, options.seed, symbols, nullptr, !values_follow, &external));
  if (cuda_) KILN_RETURN_IF_ERROR(cuda_->uploadParameters(params_));
  return Status::ok();
}

Expected<runtime::cpu::CpuExecutor*> Session::executorFor(const std::string& function, int64_t batch) {
  auto key = std::make_pair(function, batch);
  auto it = executors_.find(key);
  if (it != executors_.end()) return it->second.get();
  codegen::Program program;
  if (compiled_) {
    // Planned at the max batch; a smaller batch runs in the same arena layout.
    auto it = compiled_->cpu_programs.find(function);
    if (it == compiled_->cpu_programs.end())
      return Status::errorf("the compiled model has no CPU program for @{}", function);
    if (batch > compiled_->max_batch)
      return Status::errorf(
          "a batch of {} is over the {} samples this model was compiled for (kiln compile "
          "--max-batch)",
          batch, compiled_->max_batch);
    program = it->second;
    KILN_RETURN_IF_ERROR(codegen::rebindProgram(program, {{"B", batch}}));
  } else {
    const ir::Function* f = module_->lookup(function);
    if (!f) return Status::error(fmt::format("the model has no @{}", function));
    KILN_ASSIGN_OR_RETURN(program, codegen::lowerForCpu(*f, {{"B", batch}}));
  }
  if (function == "forward" && !served_tables_.empty()) {
    // Each batch brings its own rows of the served tables: at most the table's rows of them.
    for (codegen::Buffer& b : program.buffers) {
      if (b.kind != codegen::BufferKind::Parameter) continue;
      for (const serving::ServedTable& t : served_tables_)
        if (t.name == b.name)
          b.type = b.type.withShape({ir::Dim::bounded(ir::Dim::fixed(t.rows)), ir::Dim::fixed(t.dim)});
    }
  }
  runtime::cpu::ExecutorOptions eo;
  eo.threads = options_.threads;
  eo.profile = options_.profile;
  eo.tracer = options_.tracer;
  eo.rank = rank();  // the trace's pid: each rank's kernels on its own tracks
  eo.ranks = rank_group_.get();
  eo.overlap_collectives = !options_.no_overlap;
  // A forward pass scores each sample alone: its bits do not depend on its batch (kiln serve
  // merges requests into batches of any size and must equal kiln predict).
  eo.batch_invariant = function == "forward";
  KILN_ASSIGN_OR_RETURN(auto exec, runtime::cpu::CpuExecutor::create(std::move(program), eo));
  runtime::cpu::CpuExecutor* raw = exec.get();
  executors_[key] = std::move(exec);
  return raw;
}

std::string Session::profileTable(const std::string& function) const {
  std::map<std::string, runtime::cpu::OpTime, std::less<>> ops;
  int64_t runs = 0;
  int epilogues = 0, groups = 0, grouped = 0;
  for (const auto& [key, exec] : executors_) {
    if (key.first != function) continue;
    runs += exec->runs();
    epilogues = std::max(epilogues, exec->gemmEpilogues());
    if (exec->pointwiseGroups() > groups) {
      groups = exec->pointwiseGroups();
      grouped = exec->pointwiseGroupLaunches();
    }
    for (const auto& [name, t] : exec->profile()) {
      runtime::cpu::OpTime& o = ops[name];
      o.launches += t.launches;
      o.seconds += t.seconds;
      o.reference |= t.reference;
    }
  }
  if (runs == 0) return "";
  std::vector<std::pair<std::string, runtime::cpu::OpTime>> rows(ops.begin(), ops.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double total = 0;
  for (const auto& [_, t] : rows) total += t.seconds;
  const double per = 1.0 / static_cast<double>(runs);
  std::string out = fmt::format("profile of @{} on the CPU ({} runs, {:.2f} ms per run in kernels):\n", function, runs,
                                total * 1e3 * per);
  out += fmt::format("  {:<32} {:>10} {:>10} {:>7}  {}\n", "op", "launches", "ms/run", "share", "kernel");
  for (const auto& [name, t] : rows)
    out += fmt::format("  {:<32} {:>10.0f} {:>10.3f} {:>6.1f}%  {}\n", name, static_cast<double>(t.launches) * per,
                       t.seconds * 1e3 * per, total > 0 ? 100.0 * t.seconds / total : 0.0,
                       t.reference ? "reference" : "fast");
  if (epilogues > 0)
    out += fmt::format("  ({} matmuls run the bias add / activation after them as their GEMM's epilogue; those "
                       "launches count here at no time of their own)\n",
                       epilogues);
  if (groups > 0)
    out += fmt::format("  ({} pointwise groups run {} elementwise launches as one loop over the data each: the row "
                       "kiln.fused is their time, those launches count here at no time of their own)\n",
                       groups, grouped);
  return out;
}

Expected<cuda::CudaExecutor*> Session::cudaExecutorFor(const std::string& function, int64_t batch) {
  auto key = std::make_pair(function, batch);
  auto it = cuda_executors_.find(key);
  if (it != cuda_executors_.end()) return it->second.get();
  const ir::Function* f = module_->lookup(function);
  if (!f) return Status::error(fmt::format("the model has no @{}", function));
  cuda::CudaExecutorOptions co;
  co.tracer = options_.tracer;
  if (compiled_) {
    // A compiled model runs the kernels of its payload: NVRTC is never loaded. They are
    // specialized to the max batch (forward() runs other batches on the CPU Program).
    if (compiled_->cuda_kernels.empty())
      return Status::error(
          "this model was compiled without CUDA kernels (kiln compile --device cuda or all)");
    if (batch != compiled_->max_batch)
      return Status::errorf(
          "the CUDA kernels of this model were compiled for batch {}; run @{} at --batch {} (or recompile "
          "with "
          "--max-batch {})",
          compiled_->max_batch, function, compiled_->max_batch, batch);
    if (!kernel_set_) {
      KILN_ASSIGN_OR_RETURN(auto set,
                            cuda::KernelSet::deserialize(compiled_->cuda_kernels,
                                                         compiled_->payload->path() + " (cuda.kernels)"));
      kernel_set_ = std::make_unique<cuda::KernelSet>(std::move(set));
    }
    co.kernels = kernel_set_.get();
  }
  KILN_ASSIGN_OR_RETURN(auto exec, cuda::CudaExecutor::create(*f, {{"B", batch}}, cuda_, co));
  cuda::CudaExecutor* raw = exec.get();
  cuda_executors_[key] = std::move(exec);
  return raw;
}

runtime::ParameterStore& Session::params() {
  if (cuda_ && device_newer_) {
    Status s = cuda_->downloadParameters(params_);
    if (!s) std::fprintf(stderr, "error: copying parameters from the GPU: %s\n", s.message().c_str());
    device_newer_ = false;
  }
  if (cuda_) host_touched_ = true;
  return params_;
}

int Session::rank() const { return options_.comm ? options_.comm->rank() : 0; }
int Session::ranks() const { return options_.comm ? options_.comm->size() : 1; }

namespace {

// The kiln.parameter op that declares each parameter (the training step's, else the forward
// pass's).
std::map<std::string, const ir::Op*, std::less<>> parameterOps(const ir::Module& m) {
  std::map<std::string, const ir::Op*, std::less<>> ops;
  for (const char* fn : {"train_step", "forward"})
    if (const ir::Function* f = m.lookup(fn))
      for (const auto& op : f->entry().ops())
        if (op->is(ir::OpCode::Parameter)) ops.emplace(op->strAttr("name"), op.get());
  return ops;
}

}  // namespace

std::vector<runtime::LocalPiece> Session::localPieces() {
  runtime::ParameterStore& store = params();
  const auto ops = parameterOps(*module_);
  // Between checkpoints a hybrid table's hot rows train in its replica, the shard's copies of
  // them lie idle: the replica's values go into the rows this rank's piece holds.
  for (const auto& [name, op] : ops) {
    const ir::HostTensor* replica = op->hasAttr("hot_of") ? store.find(name) : nullptr;
    ir::HostTensor* piece = replica ? store.find(op->strAttr("hot_of")) : nullptr;
    auto source = replica ? ops.find(op->strAttr("hot_of")) : ops.end();
    if (!piece || source == ops.end() || piece->view.shape.empty()) continue;  // not on this rank
    const std::vector<int64_t> rows = op->intsAttr("hot_rows"), offset = source->second->intsAttr("offset");
    const int64_t row0 = offset.empty() ? 0 : offset[0], col0 = offset.size() > 1 ? offset[1] : 0;
    const int64_t local_rows = piece->view.shape[0];
    const int64_t width = local_rows ? piece->numel() / local_rows : 0;  // this piece's columns
    const int64_t full = rows.empty() ? 0 : replica->numel() / static_cast<int64_t>(rows.size());
    const size_t elem = ir::dtypeBytes(piece->view.dtype);
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r = rows[i] - row0;
      if (r < 0 || r >= local_rows || col0 + width > full) continue;
      std::memcpy(static_cast<char*>(piece->view.data) + static_cast<size_t>(r * width) * elem,
                  static_cast<const char*>(replica->view.data) + static_cast<size_t>(i * full + col0) * elem,
                  static_cast<size_t>(width) * elem);
    }
  }
  std::vector<runtime::LocalPiece> pieces;
  for (const std::string& name : store.names()) {
    ir::HostTensor* t = store.find(name);
    if (auto op = ops.find(name); op != ops.end() && op->second->hasAttr("hot_of")) continue;
    runtime::LocalPiece p;
    p.name = name;
    p.view = t->view;
    auto it = ops.find(name);
    const ir::Op* op = it == ops.end() ? nullptr : it->second;
    // A shard of a global tensor (the shard pass's `global_shape` and `offset`), else the whole
    // tensor: replicated when several ranks hold it.
    p.global_shape = op ? op->intsAttr("global_shape") : std::vector<int64_t>{};
    p.offset = op ? op->intsAttr("offset") : std::vector<int64_t>{};
    p.replicated = op && op->boolAttr("replicated");
    if (p.global_shape.empty()) {
      p.global_shape = t->view.shape;
      p.offset.assign(t->view.shape.size(), 0);
      p.replicated = ranks() > 1;
    }
    pieces.push_back(std::move(p));
  }
  return pieces;
}

Status Session::loadPieces(const runtime::ShardedCheckpoint& ckpt) {
  for (runtime::LocalPiece& p : localPieces()) {
    if (!ckpt.find(p.name))
      return Status::errorf(
          "checkpoint {} has no tensor '{}' (the model's parameters differ from the checkpoint's)",
          ckpt.dir(), p.name);
    KILN_RETURN_IF_ERROR(ckpt.readSlice(p.name, p.offset, p.view));
  }
  return loadHotRows([&](const std::string& name, const std::vector<int64_t>& offset, ir::TensorView& view) {
    return ckpt.readSlice(name, offset, view);
  });
}

Status Session::loadHotRows(const RegionReader& read) {
  runtime::ParameterStore& store = params();
  for (const auto& [name, op] : parameterOps(*module_)) {
    ir::HostTensor* replica = op->hasAttr("hot_of") ? store.find(name) : nullptr;
    if (!replica || replica->view.shape.empty()) continue;
    // The hot rows ascend: each run of consecutive rows is one region of the whole tensor.
    const std::vector<int64_t> rows = op->intsAttr("hot_rows");
    std::vector<int64_t> run_shape = replica->view.shape;
    const int64_t full = rows.empty() ? 0 : replica->numel() / static_cast<int64_t>(rows.size());
    const size_t row_bytes = static_cast<size_t>(full) * ir::dtypeBytes(replica->view.dtype);
    std::vector<int64_t> offset(run_shape.size(), 0);
    for (size_t i = 0, end = 0; i < rows.size(); i = end) {
      for (end = i + 1; end < rows.size() && rows[end] == rows[end - 1] + 1;) ++end;
      run_shape[0] = static_cast<int64_t>(end - i);
      ir::TensorView run{replica->view.dtype, run_shape, static_cast<char*>(replica->view.data) + i * row_bytes};
      offset[0] = rows[i];
      KILN_RETURN_IF_ERROR(read(op->strAttr("hot_of"), offset, run));
    }
  }
  return Status::ok();
}

StepInputs::StepInputs(const data::Batch& batch, const std::vector<std::pair<std::string, float>>& scalars) {
  for (size_t i = 0; i < batch.names.size(); ++i) views_[batch.names[i]] = batch.tensors[i].view;
  scalars_.reserve(scalars.size());  // views point into it: no reallocation
  for (const auto& [name, value] : scalars) {
    scalars_.push_back(value);
    views_[name] = ir::TensorView{ir::DType::f32, {}, &scalars_.back()};
  }
}

Expected<StepOutputs> Session::run(const std::string& function, const data::Batch& batch,
                                   const std::vector<std::pair<std::string, float>>& scalars,
                                   const data::Batch* next, const NextStep* ahead, int64_t number) {
  StepInputs step_inputs(batch, scalars);
  const bool pipelined_step = function == "train_step" && pipelined();
  if (pipelined_step) {
    if (!next) return Status::error("the pipelined step needs the next batch (trainStep(batch, next, ...))");
    if (next->size != batch.size)
      return Status::errorf("the pipelined step's next batch holds {} samples, this one {}", next->size, batch.size);
    if (carried_.empty()) {
      // The first step (or the first after a resume): this batch's ids are routed first.
      StepInputs prime_inputs(data::Batch{}, {});
      for (size_t i = 0; i < batch.names.size(); ++i) prime_inputs.add("next." + batch.names[i], batch.tensors[i].view);
      KILN_ASSIGN_OR_RETURN(auto prime, executorFor("pipeline_prime", batch.size));
      KILN_ASSIGN_OR_RETURN(carried_, prime->run(prime_inputs.views(), params_));
      if (carried_.size() != carried_names_.size())
        return Status::errorf("@pipeline_prime returned {} values for {} carried inputs", carried_.size(),
                              carried_names_.size());
    }
    for (size_t i = 0; i < next->names.size(); ++i) step_inputs.add("next." + next->names[i], next->tensors[i].view);
    for (size_t i = 0; i < carried_names_.size(); ++i) step_inputs.add(carried_names_[i], carried_[i].view);
  }
  const runtime::cpu::Batch& inputs = step_inputs.views();
  Expected<std::vector<ir::HostTensor>> results = Status::error("not run");
  // A compiled model's GPU kernels take the max batch only; a forward pass at another batch (an
  // evaluation's short last batch) runs the payload's CPU Program on the host's copy of the
  // parameters, when the payload has one.
  const bool on_host = cuda_ && compiled_ && function == "forward" && batch.size != compiled_->max_batch &&
                       compiled_->cpu_programs.count(function);
  if (on_host) {
    KILN_ASSIGN_OR_RETURN(auto exec, executorFor(function, batch.size));
    results = exec->run(inputs, params());  // params(): the device's values, when newer
  } else if (cuda_) {
    if (host_touched_) {
      KILN_RETURN_IF_ERROR(cuda_->uploadParameters(params_));
      host_touched_ = false;
    }
    KILN_ASSIGN_OR_RETURN(auto exec, cudaExecutorFor(function, batch.size));
    float step = static_cast<float>(number);  // as the step reads it (a staged batch matches on it)
    for (const auto& [name, value] : scalars)
      if (name == "step") step = value;
    results = runOnGpu(*exec, inputs, batch.size, step, ahead);
    if (function == "train_step") device_newer_ = true;
  } else {
    KILN_ASSIGN_OR_RETURN(auto exec, executorFor(function, batch.size));
    results = (exec)->run(inputs, params_);
  }
  if (!results) return results.status();
  if (pipelined_step) {
    // Right after loss and prediction: the next batch's routes, the next call's inputs.
    if (results->size() < 2 + carried_names_.size())
      return Status::errorf("@train_step returned {} values, fewer than its {} carried ones", results->size(),
                            carried_names_.size());
    auto first = results->begin() + 2, last = first + static_cast<long>(carried_names_.size());
    carried_.assign(std::make_move_iterator(first), std::make_move_iterator(last));
    results->erase(first, last);
  }

  // @train_step returns (loss, prediction); @forward returns the outputs kiln.outputs names.
  int loss_index = -1, prediction_index = -1;
  if (function == "train_step") {
    loss_index = 0;
    prediction_index = results->size() > 1 ? 1 : -1;
  } else if (train_) {
    auto indexOf = [&](std::string_view key) {
      const ir::Attribute* a = trainValue(*train_, key);
      if (!a || !a->isString()) return -1;
      for (size_t i = 0; i < outputs_.size(); ++i)
        if (outputs_[i] == a->asString()) return static_cast<int>(i);
      return -1;
    };
    loss_index = indexOf("loss");
    prediction_index = indexOf("prediction");
  }
  if (prediction_index < 0 && !train_ && !results->empty()) prediction_index = 0;

  StepOutputs out;
  // Statistics: after loss and prediction in @train_step, by name among @forward's outputs.
  if (const ir::Attribute* names = train_ ? trainValue(*train_, "stats") : nullptr;
      names && names->isArray()) {
    const auto& list = names->asArray();
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string& name = list[i].asString();
      size_t index = results->size();
      if (function == "train_step") {
        index = results->size() - list.size() + i;
      } else {
        for (size_t j = 0; j < outputs_.size(); ++j)
          if (outputs_[j] == name) index = j;
      }
      if (index >= results->size())
        return Status::errorf("@{} does not return the statistic '{}'", function, name);
      const ir::HostTensor& t = (*results)[index];
      std::vector<double> values(static_cast<size_t>(t.numel()));
      for (size_t k = 0; k < values.size(); ++k)
        values[k] = ir::kernels::loadAsDouble(t.view, static_cast<int64_t>(k));
      out.stats.push_back({name, std::move(values)});
    }
  }
  if (loss_index >= 0) {
    const ir::HostTensor& l = (*results)[static_cast<size_t>(loss_index)];
    out.loss = l.view.dtype == ir::DType::f64 ? *l.as<double>() : *l.as<float>();
  }
  // A language model's prediction is [B*T, vocab] logits, which no per-sample metric reads.
  if (prediction_index >= 0 && forwardSpec().readsTokens()) prediction_index = -1;
  if (prediction_index >= 0) {
    const ir::HostTensor& p = (*results)[static_cast<size_t>(prediction_index)];
    if (p.view.dtype != ir::DType::f32)
      return Status::errorf("the prediction output must be f32, got {}", ir::dtypeName(p.view.dtype));
    // One score per sample and task (a click model's logit; a multi-task model's [B, k] for a
    // label of k columns) or a whole tensor (a layer's output, a language model's logits).
    const int label = forwardSpec().labelIndex();
    const int64_t tasks = label >= 0 ? forwardSpec().inputs[static_cast<size_t>(label)].label_count : 1;
    std::vector<float>& dst = p.numel() == batch.size * tasks ? out.logits : out.prediction;
    dst.assign(p.as<float>(), p.as<float>() + p.numel());
  }
  return out;
}

Expected<std::vector<ir::HostTensor>> Session::runOnGpu(cuda::CudaExecutor& exec,
                                                        const runtime::cpu::Batch& inputs, int64_t batch_size,
                                                        float step, const NextStep* ahead) {
  // The batch the previous step staged on this executor is this one's when the step and size
  // match; otherwise it is dropped (the caller trained on another batch). An evaluation in
  // between runs another executor and leaves it staged.
  cuda::CudaExecutor::Ticket ticket = -1;
  if (auto it = staged_.find(&exec); it != staged_.end()) {
    if (it->second.step == step && it->second.batch_size == batch_size && step > 0)
      ticket = it->second.ticket;
    else
      (void)exec.drop(it->second.ticket);
    staged_.erase(it);
  }
  if (ticket < 0) {
    KILN_ASSIGN_OR_RETURN(ticket, exec.stage(inputs));
  }
  KILN_RETURN_IF_ERROR(exec.launch(ticket));
  // While the GPU computes: the next batch into pinned memory, its upload on the copy stream.
  // A batch that cannot be staged (another size: the data's short last batch, which another
  // executor runs) is left to its own step, which reports any error in it.
  if (ahead && ahead->batch && ahead->batch->size == batch_size && ahead->step > 0) {
    runtime::Tracer::Scope scope(options_.tracer, "stage next batch", runtime::TraceCategory::Data, rank(),
                                 runtime::kHostTrack, {{"step", ahead->step}});
    StepInputs next_inputs(*ahead->batch, {{"lr", static_cast<float>(ahead->lr_factor)},
                                           {"step", static_cast<float>(ahead->step)}});
    if (auto t = exec.stage(next_inputs.views()))
      staged_[&exec] = StagedStep{&exec, static_cast<float>(ahead->step), batch_size, *t};
  }
  return exec.collect(ticket);
}

Expected<std::shared_ptr<data::StagingPool>> Session::trainStagingPool(int64_t batch_size, int buffers) {
  if (!stagesAhead()) return std::shared_ptr<data::StagingPool>();
  auto it = cuda_executors_.find(std::make_pair(std::string("train_step"), batch_size));
  if (it == cuda_executors_.end()) return std::shared_ptr<data::StagingPool>();
  return it->second->stagingPool(buffers);
}

Expected<StepOutputs> Session::trainStep(const data::Batch& batch, double lr_factor, int64_t step,
                                         const NextStep& next) {
  return run("train_step", batch, {{"lr", static_cast<float>(lr_factor)}, {"step", static_cast<float>(step)}},
             nullptr, &next);
}

Expected<StepOutputs> Session::trainStep(const data::Batch& batch, double lr_factor, int64_t step) {
  return run("train_step", batch, {{"lr", static_cast<float>(lr_factor)}, {"step", static_cast<float>(step)}});
}

Expected<StepOutputs> Session::trainStep(const data::Batch& batch, const data::Batch& next, double lr_factor,
                                              int64_t step) {
  return run("train_step", batch, {{"lr", static_cast<float>(lr_factor)}, {"step", static_cast<float>(step)}},
             &next);
}

Expected<StepOutputs> Session::forward(const data::Batch& batch) { return run("forward", batch, {}); }

Expected<StepOutputs> Session::forward(const data::Batch& batch, int64_t number, const NextStep& next) {
  return run("forward", batch, {}, nullptr, &next, number);
}

Expected<StepOutputs> Session::forwardWithRows(const data::Batch& batch, const serving::GatheredRows& rows) {
  if (cuda_) return Status::error("serving from a store runs on the CPU (--device cpu)");
  if (rows.rows.size() != served_tables_.size())
    return Status::errorf("{} gathered tables for {} served ones", rows.rows.size(), served_tables_.size());
  // The batch as views, its id inputs replaced by the remapped ones.
  data::Batch views;
  views.size = batch.size;
  views.names = batch.names;
  for (size_t i = 0; i < batch.tensors.size(); ++i) {
    const ir::TensorView* v = &batch.tensors[i].view;
    for (const auto& [name, t] : rows.remapped_inputs)
      if (name == batch.names[i]) v = &t.view;
    views.tensors.push_back(ir::HostTensor::external(v->dtype, v->shape, v->data, nullptr));
  }
  for (size_t t = 0; t < served_tables_.size(); ++t) {
    const ir::TensorView& r = rows.rows[t].view;
    params_.set(served_tables_[t].name, ir::HostTensor::external(r.dtype, r.shape, r.data, nullptr));
  }
  auto out = run("forward", views, {});
  // The views die with `rows`: leave no parameter pointing at them.
  for (const serving::ServedTable& t : served_tables_) params_.set(t.name, ir::HostTensor());
  return out;
}

}  // namespace kiln::driver
