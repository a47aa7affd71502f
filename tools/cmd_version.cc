#include <cstdio>

#include "ir/op_def.h"
#include "runtime/cpu/cpu_features.h"
#include "tools/cli.h"

#ifndef KILN_VERSION
#define KILN_VERSION "0.0.0"
#endif

namespace kiln::cli {

int runVersion(const std::vector<std::string>& args) {
  ArgParser p("version", "kiln version", "Prints the version of kiln and what this build contains.");
  int code;
  if (!p.parse(args, &code)) return code;
  std::printf("kiln %s\n", KILN_VERSION);
  std::printf("ops: %zu\n", ir::OpRegistry::get().all().size());
  std::printf("%s\n", cpuBackendLine().c_str());
  for (const std::string& w : runtime::cpu::cpuLibraryWarnings()) std::printf("warning: %s\n", w.c_str());
  return kExitOk;
}

}  // namespace kiln::cli
