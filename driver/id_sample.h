// The ids a plan is made from: each embedding table's ids over the first samples of the data (or
// of the synthetic stream). `kiln plan --data` prints the proposal they give; `kiln train --ranks N`
// runs it (passes/planner.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "passes/id_frequency.h"
#include "passes/shard_plan.h"

namespace kiln::driver {

// One IdSample per table of `tables` (module order), empty where the table has no single data
// input; the data as --data names it (files, or "synthetic"). Errors: unreadable data, fewer
// than 2 samples.
Expected<std::vector<passes::IdSample>> sampleIds(const ir::Module& m, const std::vector<passes::TableInfo>& tables,
                                                  const std::vector<std::string>& paths, int64_t samples);

}  // namespace kiln::driver
