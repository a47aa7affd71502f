// The planner's decisions in one place: which sharding plan a run on N ranks uses, with the
// predictions and the reasons behind it. `kiln plan` prints a proposal; `kiln train --ranks N`
// runs the proposal made from the same inputs (the shard pass reads it as the module's
// `kiln.plan`), so the two pick the same plan for the same model, target, batch and data.
//
// A proposal starts from a layout: the search's (autoPlan, req.strategy) or a plan file's. With a
// sample of the data's ids (id_frequency.h) it then
//   1. gives each model-parallel table the hot rows worth replicating on every rank (HugeCTR's
//      hybrid embedding; estimateHybrid), the rest of the plan fixed;
//   2. reruns the search with those hot rows, and takes the rerun where it predicts a faster step
//      and keeps the memory imbalance within kHybridImbalance (or the layout's own, if higher);
//      never for a plan file, whose layout is the user's;
//   3. routes de-duplicated ids on the row-block tables whose ids repeat enough within a rank's
//      batch (chooseDedup).
// Without a sample the layout runs as it is.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "passes/auto_plan.h"
#include "passes/id_frequency.h"
#include "passes/shard_plan.h"

namespace kiln::passes {

// Step 2's bound on the rerun's memory imbalance (the fullest rank over the emptiest).
inline constexpr double kHybridImbalance = 1.5;

struct PlanProposal {
  ShardPlan layout;        // the search's plan or the plan file's, before any hot rows
  PlanCosts layout_costs;
  ShardPlan plan;          // the plan to run
  PlanCosts costs;         // its predictions
  std::string why;         // which plan runs, and why: "the search", "the search rerun with the hot rows", ...

  // With an id sample (`sampled`):
  bool sampled = false;
  std::vector<FrequencyCurve> curves;    // per layout table (rows 0: no sample for it)
  std::vector<HybridEstimate> hybrid;    // step 1, per layout table
  double hot_step_s = 0;                 // the layout with step 1's hot rows
  std::optional<PlanCosts> rerun;        // step 2's search, where it found a plan
  double allowed_imbalance = 0;          // step 2's bound
  ShardPlan before_dedup;                // the plan step 2 chose
  std::vector<DedupChoice> dedup;        // step 3, per table of before_dedup
};

// `fixed`: a plan file's layout (kept); null: req.strategy's plan. `sample`: one IdSample per
// table of `tables`, in order (empty ones skipped); null: no sample.
Expected<PlanProposal> proposePlan(const std::vector<TableInfo>& tables, const PlanRequest& req,
                                   const ShardPlan* fixed, const std::vector<IdSample>* sample);

}  // namespace kiln::passes
