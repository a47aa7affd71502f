// plan.json: a ShardPlan as a file (docs/distributed.md, "Plans"):
//   {"format": "kiln-plan-1", "ranks": 4, "ranks_per_node": 0,
//    "tables": [{"table": "tables.0", "sharding": "row_wise", "ranks": [0, 1, 2, 3]}, ...]}
// `kiln plan` writes one, `kiln train --plan` reads it. The writer may add the planner's
// predictions to each entry and a "per_rank" list; the reader ignores every field it does not
// know. Every error is located: "plan.json:LINE:COL: ...".
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"
#include "passes/shard_plan.h"

namespace kiln::passes {

struct PlanCosts;
struct PlanPin;

// Parses the text of a plan file named `file` (for the locations). Checks the syntax, the
// format, the sharding names and the field types; each TablePlan gets its entry's location, the
// plan the "tables" list's, so that completePlan's errors point into the file. With
// `expected_ranks` > 0, a "ranks" field that differs is an error.
Expected<ShardPlan> readPlanJson(std::string_view text, std::string_view file, int expected_ranks = 0);

// readPlanJson, then completePlan against the module's tables.
Expected<ShardPlan> loadPlanJson(std::string_view text, std::string_view file,
                                 const std::vector<TableInfo>& tables, int expected_ranks);

// A constraints file (`kiln plan --constraints`): pins that fix a table's sharding, and its
// ranks where they are given, located for the planner's errors and printout:
//   {"format": "kiln-constraints-1",
//    "tables": [{"table": "tables.3", "sharding": "table_wise", "ranks": [2]},
//               {"table": "tables.20", "sharding": "row_wise"}]}
Expected<std::vector<PlanPin>> readPlanConstraints(std::string_view text, std::string_view file, int ranks);

// The plan as plan.json, one table entry a line; with `costs`, each entry also carries its
// predictions (bytes_per_rank, lookups_per_step, comm_bytes_per_step, reason) and a "per_rank"
// list the memory and step time of each rank.
std::string writePlanJson(const ShardPlan& plan, const PlanCosts* costs = nullptr);

}  // namespace kiln::passes
