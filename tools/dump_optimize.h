// `kiln dump FILE --stats` and `--explain=fusion`: compile the model's training step through the
// default training pipeline (passes/pipeline.h: what `kiln train` runs) and report.
#pragma once

#include <iosfwd>
#include <set>
#include <string>
#include <string_view>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"
#include "passes/pass.h"

namespace kiln::cli {

struct OptimizeOptions {
  int64_t batch = 1024;
  std::string memory_budget;                           // "" = none; "60%" or bytes: remat's budget
  std::set<std::string, std::less<>> disabled_passes;  // --disable-pass
  Target target = cpuTarget();                         // --target: what the passes plan for
  passes::PassOptions shard;                           // --ranks N --rank R ...: the shard pass's options
  // --device cuda: --stats also prints what the GPU holds (gpu_*), from the CUDA program.
  std::string device = "cpu";
  // --roofline: --stats also prints driver::estimateRoofline's table for the target (a GPU).
  bool roofline = false;
};

// Sets the symbols (B = batch) on the module and runs the default training pipeline for the
// target, remat under the memory budget, up to (not including) the pass `stop` unless it is empty.
Status runTrainingPipeline(ir::Module& m, const OptimizeOptions& options, std::string_view stop = "");

// Prints for @train_step at options.batch: `kernels: N`; the memory `kiln train` checks, by kind
// (`param_bytes`, `optimizer_bytes`, `activation_peak_bytes` (the planned arena), `workspace_bytes`,
// `data_bytes`) and in all (`peak_bytes`: everything resident at once); `flops: N`,
// `recompute_flops: N`, and a sharded step's communication. With options.device "cuda" it also
// prints the device's half of `kiln train --device cuda`'s check (driver::estimateDeviceMemory):
// `gpu_param_bytes`, `gpu_optimizer_bytes`, `gpu_activation_peak_bytes` (the CUDA program's
// arena), `gpu_workspace_bytes` and `gpu_bytes`. Errors go to `err`; returns an exit code.
int printOptimizeStats(ir::Module& m, const OptimizeOptions& options, std::ostream& out, std::ostream& err);
// Prints the fusion pass's groups and refused pairs (after the passes before fusion).
int printFusionExplanation(ir::Module& m, const OptimizeOptions& options, std::ostream& out, std::ostream& err);

}  // namespace kiln::cli
