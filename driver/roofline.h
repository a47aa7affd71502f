// A roofline estimate of one step on a GPU target, from the kernels the CUDA backend would launch
// (codegen::lowerFunction's groups, as `kiln dump --stage cuda` shows them) priced by the shared
// cost model (passes/cost_model.h): per group, the bytes it moves and the flops it does, its
// roofline time max(flops / rate, bytes / bandwidth) and its launches at the target's launch cost.
// Grouped by kernel class, so that a change to the generated code shows where it moved the time;
// `kiln dump --stats --roofline --target h200` prints it (docs/cuda.md), and a later run on the
// GPU checks it against the profile (`kiln train --device cuda --profile`).
#pragma once

#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"

namespace kiln::driver {

struct KernelClassCost {
  std::string kind;    // "gemm tf32", "embedding lookup", ...: roofline.cc's kernelClass
  int groups = 0;      // lowered groups of this class
  int launches = 0;    // kernel launches and cuBLASLt calls
  double bytes = 0;    // moved to and from device memory
  double flops = 0;
  double roofline_s = 0;     // sum over its groups of max(compute, memory), launches left out
  double launch_s = 0;       // launches * the target's launch cost
  double memory_bound_s = 0; // the part of roofline_s in groups where memory is the bound
};

struct Roofline {
  std::string function;
  int64_t batch = 0;
  Target target;
  std::vector<KernelClassCost> classes;  // by roofline_s + launch_s, largest first
  KernelClassCost total;                 // kind "total"
};

// The estimate of `f` (after the training pipeline) at B = `batch` on `target`.
Expected<Roofline> estimateRoofline(const ir::Function& f, int64_t batch, const Target& target);

// The table `kiln dump --stats --roofline` prints: one row per class, the total, and the floor
// (every group at its roofline, no launch cost) and the estimate (with launches) in ms.
std::string formatRoofline(const Roofline& r);

}  // namespace kiln::driver
