#include "passes/pipeline.h"

#include "passes/pass.h"

namespace kiln::passes {

std::string defaultPipeline(bool training) {
  std::string p = "canonicalize,cse,dce";
  if (!training) return p;
  // mixed-precision acts only when kiln.train asks for bf16.
  p += ",mixed-precision,autodiff,canonicalize,cse,dce";
  // Passes of the optimizing issue join when they are registered.
  for (const char* later : {"remat", "fusion", "schedule"})
    if (createPass(later)) p += std::string(",") + later;
  return p;
}

}  // namespace kiln::passes
