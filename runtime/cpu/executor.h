// The CPU executor: runs a planned Program. Inputs are bound by name from a batch, parameters
// come from the parameter store, temporaries and outputs live in one arena of the planned
// size. Each launch runs a fast kernel where one supports the op (runtime/cpu/kernels/) and
// the op table's CPU reference hook otherwise, so every op with a reference runs.
// Instructions run in the program's global order. A matmul whose result only the bias add and
// activation after it read runs them as its GEMM's epilogue (one oneDNN product; a bf16 product
// widened to f32 at once is stored as f32 straight from the accumulator). The launches of a
// pointwise fusion group run as one loop over the data (cpu/pointwise.h). A collective on its own stream is issued
// (ir::RankGroup's non-blocking forms) and waited on only where the program first needs it: at
// a wait on an event its stream recorded after it, before the next launch of its stream, before
// a launch that touches its buffers, or at the end of the run. Compute placed between issue and
// that point runs while the data moves; the memory plan (ir/arena_plan.h) keeps the
// collective's buffers out of reuse until such a join, and the executor checks that it does.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codegen/program.h"
#include "ir/collective.h"
#include "ir/ir.h"
#include "ir/tensor_view.h"
#include "runtime/cpu/pointwise.h"
#include "runtime/cpu/thread_pool.h"
#include "runtime/parameter_store.h"
#include "runtime/trace.h"

namespace kiln::runtime::cpu {

// A batch: the model's inputs by name. Views are read, never written.
using Batch = std::map<std::string, ir::TensorView, std::less<>>;

struct ExecutorOptions {
  int threads = 1;                // --threads N (the caller counts as one)
  bool use_fast_kernels = true;   // false: every op through its reference hook
  bool poison_arena = false;      // fill the arena with kPoison first (tests, debugging)
  bool profile = false;           // time every launch (kiln train --profile)
  // Also with a tracer: while it records, every launch becomes a "kernel" event ("gemm" for
  // kiln.matmul) named by its op, on the track of its Program stream, from the same clock
  // readings --profile sums.
  Tracer* tracer = nullptr;
  int rank = 0;  // the trace's pid
  // This rank's group for the collective ops (ir/collective.h; comm::CommunicatorRankGroup);
  // null runs one rank. Not owned; it must outlive the executor's runs.
  ir::RankGroup* ranks = nullptr;
  // false (kiln train --no-overlap): wait on each collective right after issuing it, as a
  // baseline for the overlap.
  bool overlap_collectives = true;
  // Run f32 matmuls through the batch-invariant GEMM (kernels/invariant_gemm.h): a sample's
  // results then do not depend on its batch (the forward pass of eval, predict and serve).
  bool batch_invariant = false;
};

// Where one run waited on one collective: the seq of the launch that issued it and of the
// instruction before which it was waited on (the end of the program: one past the last seq).
struct CollectiveWait {
  int issued_at = 0;
  int waited_at = 0;
};

// Time spent in one op over all runs of a program (ExecutorOptions::profile).
struct OpTime {
  int64_t launches = 0;
  double seconds = 0;
  bool reference = false;  // ran through the op table's reference hook, not a fast kernel
};

class CpuExecutor {
 public:
  static constexpr uint8_t kPoison = 0xA5;

  // Checks that the program is planned and that every launch has a kernel or a reference.
  static Expected<std::unique_ptr<CpuExecutor>> create(codegen::Program program, const ExecutorOptions& options = {});
  ~CpuExecutor();

  // Runs the program once; returns its results in order, as owning tensors at their actual
  // shapes. Side-effecting ops write the parameter store's tensors in place.
  Expected<std::vector<ir::HostTensor>> run(const Batch& batch, ParameterStore& params);

  const codegen::Program& program() const { return program_; }
  ThreadPool& pool() { return *pool_; }
  // The highest arena byte any kernel wrote (end of its result view) over all runs so far.
  int64_t highWaterMark() const { return high_water_mark_; }
  // With poison_arena: one past the highest arena byte that no longer holds kPoison.
  int64_t scanTouchedArenaBytes() const;
  // How many launches ran through a fast kernel / a reference hook in the last run.
  int fastLaunches() const { return fast_launches_; }
  // With options.profile: time per op name over all runs so far, and how many runs.
  const std::map<std::string, OpTime, std::less<>>& profile() const { return profile_; }
  int64_t runs() const { return runs_; }
  int referenceLaunches() const { return reference_launches_; }
  // How many matmuls run launches after them as their GEMM's epilogue.
  int gemmEpilogues() const;
  // How many pointwise groups run as one loop over the data, and how many launches they hold.
  int pointwiseGroups() const;
  int pointwiseGroupLaunches() const;
  // The collectives of the last run that were issued without completing at once, in issue
  // order, with where each was waited on.
  const std::vector<CollectiveWait>& collectiveWaits() const { return waits_; }

 private:
  struct Launch;
  struct InFlight;
  struct PointwiseGroup;
  CpuExecutor() = default;
  Status bindSources(const Batch& batch, ParameterStore& params);
  // How many launches read each buffer; a program result counts as two readers (one that stays).
  std::vector<int> readerCounts() const;
  // Marks each matmul whose result only a following widening cast, bias add and activation read
  // (in that order, each optional) to run them as its GEMM's epilogue.
  void planGemmEpilogues();
  // Compiles each run of two or more launches of one pointwise fusion group (codegen::kGroupAttr),
  // on one stream, each a pointwise step (cpu/pointwise.h), to run as one loop over the data.
  Status planPointwiseGroups();
  // Whether two buffers share arena bytes (buffers outside the arena share none).
  bool sharesStorage(int x, int y) const;
  Status runLaunch(size_t t, std::vector<InFlight>& in_flight);
  Status runKernel(size_t t, std::vector<InFlight>& in_flight);
  // After buffer `id` was written by op `op` ("": a pointwise group): its view must fit the
  // buffer's type and bytes; raises the high-water mark.
  Status checkWritten(int id, std::string_view op);
  Status runGemmWithEpilogue(size_t t, std::vector<InFlight>& in_flight);
  Status runPointwiseGroup(const PointwiseGroup& g, std::vector<InFlight>& in_flight);
  // Adds launch `t`'s time to the profile (ExecutorOptions::profile) and the trace (non-null).
  void recordLaunch(size_t t, std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end,
                    Tracer* tracer);
  // Waits on the collectives of `in_flight` that `t` (a position in order_) must follow.
  Status joinBefore(size_t t, std::vector<InFlight>& in_flight);
  Status waitOn(InFlight& f, int waited_at);
  Status waitAll(std::vector<InFlight>& in_flight, int waited_at);

  codegen::Program program_;
  ExecutorOptions options_;
  std::unique_ptr<ThreadPool> pool_;
  // Ops rebuilt from the program's instructions (kernels and hooks take an ir::Op), owned by a
  // private module whose entry block has one argument per buffer.
  std::unique_ptr<ir::Module> shadow_;
  std::vector<Launch> launches_;  // by position in the global order
  std::vector<PointwiseGroup> groups_;
  std::vector<const codegen::Instruction*> order_;
  std::vector<int> stream_of_;  // by position in order_: the instruction's Program stream
  uint8_t* arena_ = nullptr;
  std::vector<ir::TensorView> views_;          // per buffer, during a run
  std::vector<std::vector<int64_t>> bound_;    // per buffer: shape at the bound symbols
  int64_t high_water_mark_ = 0;
  int fast_launches_ = 0, reference_launches_ = 0;
  std::map<std::string, OpTime, std::less<>> profile_;
  int64_t runs_ = 0;
  std::vector<int> recorded_at_;  // per event: the position in order_ of its record
  std::vector<CollectiveWait> waits_;
  // One launch's operand and result views, kept across launches so that none allocates.
  std::vector<const ir::TensorView*> launch_operands_;
  std::vector<ir::TensorView*> launch_results_;
  // Where a fused GEMM writes when its output's storage is also its input's (planGemmEpilogues).
  int64_t epilogue_scratch_bytes_ = 0;
  std::unique_ptr<uint8_t, decltype(&std::free)> epilogue_scratch_{nullptr, &std::free};
};

}  // namespace kiln::runtime::cpu
