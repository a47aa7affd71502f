// The pass pipeline every model goes through (kiln train, eval, predict, dump): one place, so
// that what `kiln dump` shows is what `kiln train` runs.
#pragma once

#include <string>
#include <string_view>

namespace kiln::passes {

// Comma-separated pass names for PassManager::addPipeline. With `training`, autodiff builds
// @train_step; the cleanup passes run before it and again on the training step.
std::string defaultPipeline(bool training);

// The default pipeline up to, not including, the first run of `pass` (all of it when the
// pipeline does not run `pass`): what `kiln dump --explain=fusion` runs before explaining.
std::string pipelineUpTo(bool training, std::string_view pass);

}  // namespace kiln::passes
