// The shard pass (passes/shard.cc): one rank's training step and forward pass for N ranks.
// The module attribute `kiln.plan` (a plan.json text) is the plan the planner proposed for the
// run; the pass takes it (unless a plan file or one sharding is given), removes it, and records
// the plan it ran in `kiln.shard` (each table's type and ranks, its hot rows and de-duplication,
// and the plan's source).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"
#include "passes/auto_plan.h"
#include "passes/plan_json.h"
#include "passes/shard_plan.h"

namespace kiln::passes {

// The pass's options (shard{ranks=4 rank=1 plan=plan.json}).
struct ShardOptions {
  int ranks = 1;
  int rank = 0;
  int ranks_per_node = 0;
  // Expert parallelism: each MoE layer's experts spread over groups of `ep` ranks (a layer's
  // `moe(..., ep = N)` pins its own); ranks / ep replicas of each group (expert-data parallel).
  int ep = 1;
  std::string plan_path;            // a plan.json; "" = the automatic plan
  std::string sharding;             // every table this way (tests, kiln opt); overrides plan_path
  // A plan.json text the planner proposed for this run (passes/planner.h: kiln train --ranks N
  // over its data's ids), given to the pass as the module's `kiln.plan`; after plan_path.
  std::string proposed_plan;
  int64_t bucket_bytes = 25 << 20;  // dense gradients per all_reduce, as DDP's bucket_cap_mb
  // The pipelined step (TorchRec's sparse-dist pipeline): @train_step routes the next batch's
  // ids (inputs "next.<input>") while it computes this batch, whose routed ids arrive as inputs
  // ("pipe.<table>.<what>") the previous step returned; @pipeline_prime routes the first batch.
  bool pipeline = false;
  int64_t memory_per_rank = 0;      // for the automatic plan; 0 = unlimited
  int64_t global_batch = 0;         // for the automatic plan; 0 = N times the module's B
  Target target = cpuTarget();
};

// The plan a run with `o` uses: o.sharding for every table, the plan file, the proposed plan, or
// the automatic plan (autoPlan without an id sample: what passes/planner.h proposes then);
// checked and laid out (completePlan).
Expected<ShardPlan> planFor(const std::vector<TableInfo>& tables, const ShardOptions& o);

// `grad` times `scale` at the builder's insertion point (itself for a scale of 1): the mean over
// ranks of a gradient the collectives summed.
Expected<ir::Value*> scaledGradient(ir::Builder& b, ir::Value* grad, double scale);

// Rewrites @forward and @train_step of `m` for rank o.rank under `plan`.
Status shardModule(ir::Module& m, const ShardPlan& plan, const std::vector<TableInfo>& tables,
                   const ShardOptions& o);

}  // namespace kiln::passes
