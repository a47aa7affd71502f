// The pass pipeline every model goes through (kiln train, eval, predict, dump): one place, so
// that what `kiln dump` shows is what `kiln train` runs.
#pragma once

#include <string>
#include <string_view>

#include "passes/pass.h"

namespace kiln::passes {

// Pipeline text for PassManager::addPipeline. With `training`, autodiff builds @train_step; the
// cleanup passes run before it and again on the training step, and remat gets
// `memory_budget` ("60%" or bytes; "" = none) as its `budget` option.
// With `shard` options (ranks > 1: shard{ranks=N,rank=R,...}) the shard pass follows autodiff.
std::string defaultPipeline(bool training, std::string_view memory_budget = "",
                            const PassOptions& shard = {});

// The default pipeline up to, not including, the first run of `pass` (all of it when the
// pipeline does not run `pass`): what `kiln dump --explain=fusion` runs before explaining.
std::string pipelineUpTo(bool training, std::string_view pass, std::string_view memory_budget = "",
                         const PassOptions& shard = {});

}  // namespace kiln::passes
