// The driver's Session (docs/architecture.md): a model ready to run. The .kiln file compiled
// through the pass pipeline for a device (or a compiled model's payload), its parameters in a
// store, and the executors of the chosen backend for the training step and the forward pass,
// one per batch size seen (a short last batch gets its own program); checkpoints' pieces, the
// memory check from the compiler's own count. `kiln train`, `kiln eval`, `kiln predict`, the
// server, the ahead-of-time runner and the C API all run models through it.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "frontend/frontend.h"
#include "ir/ir.h"
#include "ir/target.h"
#include "passes/pass_manager.h"
#include "runtime/comm/rank_group.h"
#include "runtime/cpu/executor.h"
#include "runtime/cuda/cuda_executor.h"
#include "runtime/cuda/kernel_set.h"
#include "runtime/data/batch.h"
#include "runtime/data/staging_pool.h"
#include "runtime/memory.h"
#include "runtime/parameter_store.h"
#include "runtime/sharded_checkpoint.h"
#include "runtime/serving/served_tables.h"
#include "driver/compiled_model.h"

namespace kiln::driver {

// Batches the data prefetchers hold ready: training (kiln train) and evaluation (eval, predict,
// --eval-every). The memory check counts these many batches, plus the one being read and the one
// being used.
inline constexpr int kTrainPrefetchDepth = 4;
// The page-locked buffers the training data thread copies batches into on the GPU: the queue's,
// the one being read, and the two the trainer holds (this step's and the next, staged).
inline constexpr int kTrainStagingBuffers = kTrainPrefetchDepth + 3;
inline constexpr int kEvalPrefetchDepth = 2;

struct SessionOptions {
  std::string model_path;
  frontend::ParamOverrides overrides;
  int64_t batch = 256;
  int threads = 1;
  uint64_t seed = 0;
  bool training = true;  // build @train_step (needs a train block)
  std::string device = "cpu";  // "cpu" or "cuda" (one GPU; parameters stay on it between steps)
  std::string memory_budget;  // "" = none; "60%" or bytes of the training step's planned peak
  // --memory-limit: the most the run may allocate, besides what the machine has (runtime/memory.h).
  std::optional<uint64_t> memory_limit;
  // --memory-limit N%: that share of what the machine has (0 = not given).
  double memory_limit_percent = 0;
  // A checkpoint the caller loads after create() (kiln eval, kiln train --resume): loading reads
  // it whole, so the memory check counts its size. A directory means DIR/checkpoint.safetensors.
  std::string checkpoint_path;
  // What the passes plan for (--target): "" = the device the run uses (cpu, or the GPU's target
  // with --device cuda).
  std::string target;
  // Entries that replace those of the model's train block (kiln.train) before the pipeline runs,
  // e.g. {"optimizer": {kind = "sgd", lr = 0.01}} for a benchmark that fixes the optimizer.
  ir::AttrDict train_overrides;
  bool profile = false;  // time every launch of the CPU executors (kiln train --profile)
  // kiln train --trace: every executor puts its kernels and GEMMs on this timeline while it
  // records (owned by the caller, outliving the session).
  runtime::Tracer* tracer = nullptr;
  passes::PassManagerOptions pass_options;

  // Many ranks (kiln train --ranks N, mpirun -np N kiln train): this rank's communicator, owned by
  // the caller; nullptr = one rank. `batch` is then this rank's share of the global batch.
  comm::Communicator* comm = nullptr;
  // The sharding plan (kiln train --plan plan.json); "" = the planner's proposal (passes/planner.h)
  // from the ids of the first plan_samples samples of plan_data (the run's --data), or without
  // plan_data the search's plan alone.
  std::string plan_path;
  std::vector<std::string> plan_data;
  int64_t plan_samples = 65536;
  int ranks_per_node = 0;  // --ranks-per-node; 0 = every rank on one node
  int ep = 1;              // --ep: MoE experts over groups of this many ranks (expert parallelism)
  // kiln train --no-overlap: the executors wait on each collective right after issuing it.
  bool no_overlap = false;
  // Every table one way (data_parallel, table_wise, ...) instead of a plan (tests, --sharding).
  std::string sharding;
  // kiln train --pipeline: the training step routes the next batch's ids while it computes this
  // one (the shard pass's pipeline option); trainStep then takes the next batch too.
  bool pipeline = false;
  // How many sessions of one process split its memory (kiln train --ranks N): the memory check
  // gives this one 1/N of what the machine (or --memory-limit) allows.
  int memory_shares = 1;
  // kiln serve: the tables a serving store holds (serving::findServedTables of @forward) are not
  // allocated here; forwardWithRows is given each batch's rows of them instead.
  bool external_tables = false;
};


// The planned arena peak of `f` with the batch symbol at `batch`, from the CPU lowering and
// memory plan the executor runs: what `kiln dump --stats` prints as peak_bytes, what the
// --memory-budget warning compares with the budget and what the memory check counts as
// activations.
Expected<int64_t> plannedPeakBytes(const ir::Function& f, int64_t batch);

// After a pipeline with remat's budget (`kiln.remat`): "" when @train_step's planned peak at
// `batch` fits the budget, else the warning every command that takes --memory-budget prints:
// the peak reached, the budget, where in the step the peak sits and its largest live buffers
// with the ops that wrote them (what recomputation could not free: a backward's temporaries,
// parameter-sized gradients).
Expected<std::string> memoryBudgetWarning(const ir::Module& m, int64_t batch, std::string_view budget_text);

// What a session compiled from `m` allocates, by the compiler's own count: each parameter and
// optimizer state (from its type), the planned arena of the function it runs (@train_step when
// training, else @forward), the results copied out of it, the data batches in flight (`spec` at
// options.batch, prefetch depth + 2) and a checkpoint to be loaded. The one count: the memory
// check of train, eval, predict and compile --checkpoint, and `kiln dump --stats`.
Expected<runtime::MemoryNeed> estimateSessionMemory(const ir::Module& m, const SessionOptions& options,
                                                    const data::BatchSpec& spec);

// What a session on a GPU (--device cuda) allocates in the device's memory, from the CUDA
// backend's own program (codegen::buildCudaProgram over the kernel groups, as the executor builds
// it, not the CPU's): every parameter and optimizer state (the session uploads the whole store),
// the arena the program plans for the function it runs at options.batch, the buffers it keeps
// outside the arena (inputs, constants, error flags) and cuBLASLt's workspace. estimateSessionMemory
// counts the host's half: the parameters' host copies, the results and the data.
Expected<runtime::MemoryNeed> estimateDeviceMemory(const ir::Module& m, const SessionOptions& options);

// The kinds of estimateSessionMemory's consumers.
inline constexpr const char* kWeightsKind = "weights";
inline constexpr const char* kOptimizerStateKind = "optimizer state";
inline constexpr const char* kActivationsKind = "activations";
inline constexpr const char* kWorkspaceKind = "workspace";
inline constexpr const char* kDataBuffersKind = "data buffers";
inline constexpr const char* kCheckpointKind = "checkpoint";

// A MemoryNeed summed by kind, as `kiln dump --stats` prints it (param_bytes, optimizer_bytes,
// activation_peak_bytes, workspace_bytes, data_bytes, peak_bytes).
struct MemoryTotals {
  uint64_t param_bytes = 0, optimizer_bytes = 0, activation_peak_bytes = 0, workspace_bytes = 0,
           data_bytes = 0, checkpoint_bytes = 0;
  // Everything resident at once: the sum of all of them; nullopt past 2^64-1.
  std::optional<uint64_t> peak_bytes;
};
MemoryTotals memoryTotals(const runtime::MemoryNeed& need);

// What `options` lets the run have: --memory-limit SIZE or N% of the machine, and the machine's
// own limits (runtime::availableMemory), shared by options.memory_shares in-process ranks.
runtime::MemoryLimit sessionMemoryLimit(const SessionOptions& options);

// A step's inputs as the executors take them: views of a batch's tensors and named f32 scalars
// (the training step's "lr" and "step"), which this object holds.
class StepInputs {
 public:
  StepInputs(const data::Batch& batch, const std::vector<std::pair<std::string, float>>& scalars);
  StepInputs(const StepInputs&) = delete;
  StepInputs& operator=(const StepInputs&) = delete;
  const runtime::cpu::Batch& views() const { return views_; }
  // One more input (a view the caller keeps alive).
  void add(const std::string& name, const ir::TensorView& v) { views_[name] = v; }

 private:
  std::vector<float> scalars_;
  runtime::cpu::Batch views_;
};

struct StepOutputs {
  double loss = 0;
  std::vector<float> logits;      // the prediction output when it holds one value per sample (and task)
  std::vector<float> prediction;  // the prediction output otherwise, all its values in order
  // The step statistics kiln.train's `stats` names (a MoE layer's per-expert counts and
  // balancing losses), in that order, as doubles.
  std::vector<std::pair<std::string, std::vector<double>>> stats;
};

// The module `options.model_path` compiles to: the frontend, then every pass, planned for
// `target` at options.batch (tools/model_compile.cc).
Expected<std::unique_ptr<ir::Module>> compileModelModule(const SessionOptions& options, const Target& target,
                                                         std::ostream& diag);

class Session {
 public:
  // Compiles the model and initializes its parameters from `seed`. Diagnostics go to `diag`.
  // (tools/model_compile.cc: only binaries with the compiler link it.)
  static Expected<std::unique_ptr<Session>> create(const SessionOptions& options, std::ostream& diag);
  // A session of a model compiled ahead of time: its IR and Programs come from the payload, its
  // parameters from `seed` or the embedded weights. options.batch may be any size up to the
  // compiled max batch; the executors run the embedded Programs rebound to it.
  static Expected<std::unique_ptr<Session>> fromCompiled(std::shared_ptr<const CompiledModel> compiled,
                                                              const SessionOptions& options,
                                                              std::ostream& diag);

  ir::Module& module() { return *module_; }
  const std::string& modelName() const { return model_name_; }
  // The parameters on the host. With --device cuda this first copies the device's values back,
  // and the next step uploads the store again (a caller may have changed it, e.g. on resume).
  runtime::ParameterStore& params();
  const std::string& device() const { return options_.device; }
  const SessionOptions& options() const { return options_; }
  // The target the passes planned for.
  const Target& target() const { return target_; }
  // The data the training step reads (labels included) and the forward pass reads.
  const data::BatchSpec& trainSpec() const { return train_spec_; }
  const data::BatchSpec& forwardSpec() const { return forward_spec_; }
  bool hasTrainBlock() const { return train_ != nullptr; }
  // The `kiln.train` attribute; only with a train block.
  const ir::AttrDict& trainConfig() const { return *train_; }

  // One optimizer step on `batch`; `lr_factor` scales the optimizers' learning rates and
  // `step` is 1-based.
  Expected<StepOutputs> trainStep(const data::Batch& batch, double lr_factor, int64_t step);
  // The pipelined step (SessionOptions::pipeline): `next` is the batch the following call trains
  // on (the last step may pass `batch` again); its ids are routed during this step. The first
  // call routes `batch` itself first (@pipeline_prime), as does the first after a resume.
  Expected<StepOutputs> trainStep(const data::Batch& batch, const data::Batch& next, double lr_factor,
                                  int64_t step);
  bool pipelined() const { return !carried_names_.empty(); }
  // The batch the next trainStep call trains on, its learning-rate factor and its step. On the
  // GPU (--device cuda) the step below copies it into pinned memory and enqueues its upload on
  // the executor's copy stream while the GPU computes (docs/runtime.md, "Feeding the GPU"); the
  // next call with that step and batch size launches it as staged, any other call drops it. The
  // caller keeps the promise that the next call passes that same batch.
  struct NextStep {
    const data::Batch* batch = nullptr;
    double lr_factor = 1;
    int64_t step = 0;
  };
  Expected<StepOutputs> trainStep(const data::Batch& batch, double lr_factor, int64_t step,
                                  const NextStep& next);
  // Whether passing the next step overlaps anything: the GPU, and a step that is not pipelined
  // (whose inputs would include the previous step's results).
  bool stagesAhead() const { return cuda_ != nullptr && !pipelined(); }
  // When stagesAhead(): the page-locked staging pool of @train_step's executor at `batch_size`
  // (CudaExecutor::stagingPool), for the data thread to copy batches into
  // (data::Prefetcher::stageInto); nullptr before that executor's first step and off the GPU.
  Expected<std::shared_ptr<data::StagingPool>> trainStagingPool(int64_t batch_size, int buffers);
  // Forget the routes of the next batch: the next trainStep routes its own batch first.
  void resetPipeline() { carried_.clear(); }
  // The forward pass: the loss (when the model has one and the batch has labels) and logits.
  Expected<StepOutputs> forward(const data::Batch& batch);
  // The same for an evaluation on the GPU that stages the following batch while this one runs:
  // `number` is the batch's (1-based) in the evaluation, `next` the following one's batch and
  // number (its lr_factor unused), matched as trainStep's NextStep is.
  Expected<StepOutputs> forward(const data::Batch& batch, int64_t number, const NextStep& next);
  // Whether forward(batch, number, next) overlaps anything: on the GPU.
  bool stagesForwardAhead() const { return cuda_ != nullptr; }
  // With SessionOptions::external_tables: the tables this session does not hold, and the forward
  // pass over one batch's gathered rows of them (serving::gatherRows): `batch`'s id inputs are
  // read from `rows.remapped_inputs`.
  const std::vector<serving::ServedTable>& servedTables() const { return served_tables_; }
  Expected<StepOutputs> forwardWithRows(const data::Batch& batch, const serving::GatheredRows& rows);

  // Names of the tensors a checkpoint holds: every parameter and optimizer state.
  std::vector<std::string> checkpointNames() const { return params_.names(); }

  // This rank and the group size (0 and 1 without SessionOptions::comm).
  int rank() const;
  int ranks() const;
  // The communicator of a run on several ranks; nullptr on one.
  comm::Communicator* communicator() const { return options_.comm; }
  // This rank's collectives so far (zeros on one rank).
  comm::CommStats commStats() const { return rank_group_ ? rank_group_->stats() : comm::CommStats{}; }
  // What this rank holds of every global tensor (parameters and optimizer states), as the
  // sharded checkpoint writer takes them: a shard's global name, shape and offset, or a
  // replicated whole tensor. The views point into params().
  // A hybrid table's replica of its hot rows (the shard pass's `hot_of`) is no piece: its values
  // are first copied into the rows of this rank's piece of the table, which hold them in the
  // checkpoint.
  std::vector<runtime::LocalPiece> localPieces();
  // Loads this rank's pieces from a sharded checkpoint written under any rank count or plan.
  Status loadPieces(const runtime::ShardedCheckpoint& ckpt);
  // Reads every hybrid replica's rows from the whole tensors they replicate: `read(name, offset,
  // view)` fills `view` (a run of consecutive hot rows) from tensor `name` at `offset`.
  using RegionReader =
      std::function<Status(const std::string& name, const std::vector<int64_t>& offset, ir::TensorView& view)>;
  Status loadHotRows(const RegionReader& read);

  // With SessionOptions::profile: where the CPU time of `function`'s runs went, one line per op
  // (launches and ms per run, share of the total, fast kernel or reference), slowest first.
  std::string profileTable(const std::string& function) const;

 private:
  Session() = default;
  // The GPU (with --device cuda) and the target: `planned` (a compiled model's), else --target,
  // else the device's own.
  Status openDevice(const std::string& planned);
  // Takes the compiled module: its outputs, train block, data specs, the memory check, the
  // parameters (those not preset initialized from the seed).
  // `preset`: parameters that already have their values (a compiled model's embedded weights).
  Status adopt(std::unique_ptr<ir::Module> module, runtime::ParameterStore preset = {});
  Expected<runtime::cpu::CpuExecutor*> executorFor(const std::string& function, int64_t batch);
  Expected<cuda::CudaExecutor*> cudaExecutorFor(const std::string& function, int64_t batch);
  // The pipelined step's routes of the batch the next call trains on, as its inputs "pipe.*".
  std::vector<std::string> carried_names_;
  std::vector<ir::HostTensor> carried_;
  // `next`: the pipelined step's next batch (its inputs as "next.<name>").
  // `ahead`: on the GPU, the batch of the following step, staged while this one computes.
  // `number`: the batch's number a staged batch matches on, when the function reads no step.
  Expected<StepOutputs> run(const std::string& function, const data::Batch& batch,
                            const std::vector<std::pair<std::string, float>>& scalars,
                            const data::Batch* next = nullptr, const NextStep* ahead = nullptr,
                            int64_t number = 0);
  // One GPU step: launches the batch staged for it (or stages it now), stages `ahead` while it
  // computes, and collects its results.
  Expected<std::vector<ir::HostTensor>> runOnGpu(cuda::CudaExecutor& exec, const runtime::cpu::Batch& inputs,
                                                 int64_t batch_size, float step, const NextStep* ahead);
  // The batch a step staged for the next (NextStep), per executor (an evaluation's forward steps
  // leave the training step's staged batch alone): its executor, step, size and ticket.
  struct StagedStep {
    cuda::CudaExecutor* exec = nullptr;
    float step = 0;  // the "step" input's value
    int64_t batch_size = 0;
    cuda::CudaExecutor::Ticket ticket = -1;
  };
  std::map<const cuda::CudaExecutor*, StagedStep> staged_;

  SessionOptions options_;
  std::shared_ptr<const CompiledModel> compiled_;  // fromCompiled()
  Target target_;
  std::unique_ptr<ir::Module> module_;
  std::string model_name_;
  const ir::AttrDict* train_ = nullptr;
  std::vector<std::string> outputs_;  // names of @forward's results
  runtime::ParameterStore params_;
  std::unique_ptr<comm::CommunicatorRankGroup> rank_group_;  // with SessionOptions::comm
  data::BatchSpec train_spec_, forward_spec_;
  std::vector<serving::ServedTable> served_tables_;  // with SessionOptions::external_tables
  std::map<std::pair<std::string, int64_t>, std::unique_ptr<runtime::cpu::CpuExecutor>> executors_;
  // --device cuda: the GPU, its executors, and which copy of the parameters is newer.
  std::shared_ptr<cuda::CudaSession> cuda_;
  std::map<std::pair<std::string, int64_t>, std::unique_ptr<cuda::CudaExecutor>> cuda_executors_;
  std::unique_ptr<cuda::KernelSet> kernel_set_;  // a compiled model's CUDA kernels, parsed once
  bool device_newer_ = false, host_touched_ = false;
};

// The `kiln.train` value of `key`, or nullptr.
const ir::Attribute* trainValue(const ir::AttrDict& train, std::string_view key);

// "1:02:03" / "2:03" for a progress line.
std::string formatDuration(double seconds);

}  // namespace kiln::driver
