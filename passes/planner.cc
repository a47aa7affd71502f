#include "passes/planner.h"

#include <algorithm>

#include <fmt/format.h>

namespace kiln::passes {

Expected<PlanProposal> proposePlan(const std::vector<TableInfo>& tables, const PlanRequest& req,
                                   const ShardPlan* fixed, const std::vector<IdSample>* sample) {
  PlanProposal p;
  if (fixed) {
    p.layout = *fixed;
  } else {
    KILN_ASSIGN_OR_RETURN(p.layout, autoPlan(tables, req));
  }
  p.layout_costs = planCosts(p.layout, tables, req);
  p.plan = p.layout;
  p.costs = p.layout_costs;
  p.why = fixed ? "the plan file" : fmt::format("the {} plan", strategyName(req.strategy));
  if (!sample) return p;

  // 1. Each model-parallel table's hot rows, from its curve over one rank's batches.
  p.sampled = true;
  for (const TablePlan& pt : p.layout.tables) {
    FrequencyCurve curve;
    for (size_t j = 0; j < tables.size() && j < sample->size(); ++j)
      if (tables[j].name == pt.table && (*sample)[j].samples() >= 2)
        curve = frequencyCurve((*sample)[j], tables[j].rows, req.global_batch / std::max(1, p.layout.ranks));
    p.curves.push_back(std::move(curve));
  }
  p.hybrid = estimateHybrid(p.layout, tables, p.curves, req);
  const ShardPlan hot = withHotRows(p.layout, p.hybrid);
  p.hot_step_s = planCosts(hot, tables, req).step_s();

  // 2. The search again, every model-parallel choice of a table with its hot rows.
  std::vector<TableInfo> with_hot = tables;
  for (TableInfo& t : with_hot)
    for (const HybridEstimate& e : p.hybrid)
      if (e.table == t.name) t.hot = e.hot;
  PlanRequest r = req;
  r.strategy = PlanStrategy::search;
  ShardPlan chosen = hot;
  p.why = "the plan above with its hot rows";
  p.allowed_imbalance = std::max(kHybridImbalance, p.layout_costs.memory_imbalance());
  if (auto searched = autoPlan(with_hot, r)) {
    p.rerun = planCosts(*searched, with_hot, r);
    if (fixed) {
      p.why += " (--plan fixes the layout)";
    } else if (p.rerun->step_s() < p.hot_step_s && p.rerun->memory_imbalance() <= p.allowed_imbalance) {
      chosen = *searched;
      p.why = "the search rerun with the hot rows";
    } else if (p.rerun->step_s() < p.hot_step_s) {
      p.why += fmt::format(" (the rerun's memory imbalance is above {:.2f}x)", p.allowed_imbalance);
    }
  }

  // 3. De-duplicated routing where the sample's repeats make it cheaper, on the plan that runs.
  p.before_dedup = chosen;
  p.dedup = chooseDedup(chosen, tables, p.curves, req);
  p.plan = std::move(chosen);
  p.costs = planCosts(p.plan, tables, req);
  return p;
}

}  // namespace kiln::passes
