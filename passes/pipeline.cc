#include "passes/pipeline.h"

#include <vector>

#include "passes/pass_manager.h"

namespace kiln::passes {
namespace {

std::vector<PipelineEntry> defaultEntries(bool training, std::string_view memory_budget,
                                          const PassOptions& shard = {}) {
  std::vector<PipelineEntry> p;
  auto add = [&](std::string name) { p.push_back({std::move(name), {}, 0}); };
  for (const char* name : {"canonicalize", "cse", "dce"}) add(name);
  if (!training) {
    if (!shard.empty()) p.push_back({"shard", shard, 0});
    return p;
  }
  // mixed-precision acts only when kiln.train asks for bf16; remat only under a memory budget
  // (--memory-budget). Fusion and schedule run on every training step: the CPU executor runs a
  // fused group op by op on its stream, a GPU as one kernel.
  for (const char* name : {"mixed-precision", "autodiff", "canonicalize", "cse", "dce"}) add(name);
  // Sharding follows the cleanup of the training step, so that it sees each lookup once.
  if (!shard.empty()) p.push_back({"shard", shard, 0});
  for (const char* name : {"remat", "fusion", "schedule"}) add(name);
  if (!memory_budget.empty())
    for (PipelineEntry& e : p)
      if (e.name == "remat") e.options.set("budget", std::string(memory_budget));
  return p;
}

std::string join(const std::vector<PipelineEntry>& entries, std::string_view stop) {
  std::string out;
  for (const PipelineEntry& e : entries) {
    if (e.name == stop) break;
    out += (out.empty() ? "" : ",") + e.str();
  }
  return out;
}

}  // namespace

std::string defaultPipeline(bool training, std::string_view memory_budget, const PassOptions& shard) {
  return join(defaultEntries(training, memory_budget, shard), "");
}

std::string pipelineUpTo(bool training, std::string_view pass, std::string_view memory_budget,
                         const PassOptions& shard) {
  return join(defaultEntries(training, memory_budget, shard), pass);
}

}  // namespace kiln::passes
