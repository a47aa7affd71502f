// Expert parallelism, the shard pass's MoE part (passes/shard_experts.cc): one rank's share of
// every MoE layer's experts, the all_to_all_v that brings each token to the rank owning its
// expert and takes it back, and the gradient reductions that go with them.
#pragma once

#include <map>
#include <set>
#include <string>

#include "ir/ir.h"
#include "ir/status.h"
#include "passes/shard.h"

namespace kiln::passes {

struct ExpertShardResult {
  // The expert parameters this rank holds a slice of: their gradients are reduced here, not
  // with the dense data-parallel buckets.
  std::set<const ir::Value*> expert_params;
  // Per layer (the experts' parameter prefix, "moe.0"), the EP size it was lowered at.
  std::map<std::string, int64_t> layer_ep;
};

// Rewrites `f` (@forward or @train_step, after autodiff) for rank o.rank of o.ranks:
//  - every MoE layer's balancing loss judges the global batch (routed counts all-reduced), and
//    its per-expert counts (the step statistic, the expert-bias update) are the global batch's;
//  - a layer with EP size ep > 1 (its dispatch's `ep` attribute, else o.ep) keeps E / ep experts
//    here and dispatches its rows to their owners; its expert gradients are reduced over the
//    ranks holding the same experts and scaled by `grad_scale` (1/N for a mean loss).
Expected<ExpertShardResult> shardExperts(ir::Function& f, const ShardOptions& o, double grad_scale);

}  // namespace kiln::passes
