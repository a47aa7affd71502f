// `kiln check FILE...`: parses and lowers each model, verifies its IR, and prints every error
// and warning. Exit 0 when every file is clean of errors, 1 otherwise.
#include <fmt/format.h>

#include <cstdio>
#include <iostream>

#include "frontend/frontend.h"
#include "ir/checked.h"
#include "runtime/memory.h"
#include "runtime/parameter_store.h"
#include "tools/cli.h"

namespace kiln::cli {

int runCheck(const std::vector<std::string>& args) {
  ArgParser p("check", "kiln check FILE.kiln... [--set name=value]...",
              "Checks model files: syntax, names, types and shapes, and that each lowers to IR that verifies.");
  p.setPositionals("FILE.kiln", 1, -1, "the models to check");
  p.addOption("set", "NAME=VALUE", "override a model param (a Kiln value: 1000, [1, 2], 0.5)", std::nullopt, true);
  p.addFlag("quiet", "print nothing on success");
  int code;
  if (!p.parse(args, &code)) return code;
  frontend::ParamOverrides overrides;
  for (const std::string& s : p.getAll("set"))
    if (Status st = frontend::addOverride(s, overrides); !st.isOk()) return p.usageError(st.message());

  bool all_ok = true;
  for (const std::string& path : p.positionals()) {
    frontend::DiagnosticEngine diags(&std::cerr);
    auto m = frontend::compileModelFile(path, overrides, diags);
    if (!m) {
      all_ok = false;
      std::cerr << fmt::format("{}: {} error(s), {} warning(s)\n", path, std::max(diags.errorCount(), 1), diags.warningCount());
      continue;
    }
    if (!p.flag("quiet")) {
      size_t ops = (*m)->lookup("forward")->numOps();
      // The weights' bytes from their types (the count `kiln train` checks before allocating;
      // the optimizer state and activations need the passes: `kiln dump --stats`).
      std::string weights;
      if (auto specs = runtime::parameterSpecs(**m, {})) {
        uint64_t bytes = 0;
        for (const runtime::ParameterSpec& s : *specs)
          bytes = checkedAddU(bytes, static_cast<uint64_t>(s.bytes)).value_or(UINT64_MAX);
        weights = fmt::format(", weights {}", runtime::formatBytes(bytes));
      }
      std::printf("%s: ok (%zu ops, %d warning(s)%s)\n", path.c_str(), ops, diags.warningCount(),
                  weights.c_str());
    }
  }
  return all_ok ? kExitOk : kExitError;
}

}  // namespace kiln::cli
