// The pass pipeline every model goes through (kiln train, eval, predict, dump): one place, so
// that what `kiln dump` shows is what `kiln train` runs.
#pragma once

#include <string>

namespace kiln::passes {

// Comma-separated pass names for PassManager::addPipeline. With `training`, autodiff builds
// @train_step; the cleanup passes run before it and again on the training step.
std::string defaultPipeline(bool training);

}  // namespace kiln::passes
