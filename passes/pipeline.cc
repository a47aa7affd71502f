#include "passes/pipeline.h"

namespace kiln::passes {

std::string defaultPipeline(bool training) {
  std::string p = "canonicalize,cse,dce";
  if (!training) return p;
  // mixed-precision acts only when kiln.train asks for bf16; remat only under a memory budget
  // (kiln.memory_budget, set by --memory-budget). Fusion and schedule run on every training
  // step: the CPU executor runs a fused group op by op on its stream, a GPU as one kernel.
  p += ",mixed-precision,autodiff,canonicalize,cse,dce,remat,fusion,schedule";
  return p;
}

std::string pipelineUpTo(bool training, std::string_view pass) {
  std::string full = defaultPipeline(training);
  std::string out;
  size_t start = 0;
  while (start <= full.size()) {
    size_t end = full.find(',', start);
    if (end == std::string::npos) end = full.size();
    std::string_view name(full.data() + start, end - start);
    if (name == pass) break;
    out += (out.empty() ? "" : ",") + std::string(name);
    start = end + 1;
  }
  return out;
}

}  // namespace kiln::passes
