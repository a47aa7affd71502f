// `kiln check FILE...`: parses and lowers each model, verifies its IR, checks that the data
// loaders can fill its inputs (as `kiln train` does before it reads a sample), and prints every
// error and warning with the weights' bytes; with --data, reads the first lines of data files
// under the model's inputs. Exit 0 when every file is clean of errors, 1 otherwise.
#include <fmt/format.h>

#include <cstdio>
#include <iostream>

#include "frontend/frontend.h"
#include "ir/checked.h"
#include "runtime/data/batch_reader.h"
#include "runtime/memory.h"
#include "runtime/parameter_store.h"
#include "tools/cli.h"

namespace kiln::cli {

namespace {

// Reads up to `lines` samples of `paths` as training would; each malformed line is printed.
// Returns the samples read and the malformed lines, or the first fatal error.
Expected<std::pair<int64_t, int64_t>> checkData(const data::BatchSpec& spec,
                                                const std::vector<std::string>& paths, int64_t lines) {
  data::DataOptions opts;
  opts.paths = paths;
  opts.batch_size = std::min<int64_t>(lines, 4096);
  int64_t malformed = 0;
  opts.on_skip = [&](const Status& s) {
    ++malformed;
    std::cerr << s.str() << "\n";
  };
  KILN_ASSIGN_OR_RETURN(auto reader, data::openBatchReader(spec, std::move(opts)));
  data::Batch batch;
  int64_t samples = 0;
  while (samples + malformed < lines) {
    KILN_ASSIGN_OR_RETURN(bool more, reader->next(batch));
    if (!more) break;
    samples += batch.size;
  }
  return std::pair{samples, malformed};
}

}  // namespace

int runCheck(const std::vector<std::string>& args) {
  ArgParser p("check", "kiln check FILE.kiln... [--set name=value]...",
              "Checks model files: syntax, names, types and shapes, and that each lowers to IR that verifies.");
  p.setPositionals("FILE.kiln", 1, -1, "the models to check");
  p.addOption("set", "NAME=VALUE", "override a model param (a Kiln value: 1000, [1, 2], 0.5)", std::nullopt, true);
  p.addOption("data", "FILE",
              "also read the first --lines samples of these data files under each model (TSV, CSV or "
              "binary), as training reads them",
              std::nullopt, true);
  p.addOption("lines", "N", "with --data: how many lines to read", "1000");
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
    const ir::Function& forward = *(*m)->lookup("forward");
    auto spec = data::fromFunction(forward);
    Status readable = spec ? data::checkReadable(*spec, /*files=*/false) : spec.status();
    if (!readable) {
      all_ok = false;
      std::cerr << fmt::format("{}: error: {}\n", path, readable.message());
      continue;
    }
    if (!p.getAll("data").empty()) {
      auto lines = p.getInt("lines");
      if (!lines) return kExitUsage;
      if (*lines <= 0) return p.usageError(fmt::format("--lines takes a positive count, got {}", *lines));
      auto got = checkData(*spec, p.getAll("data"), *lines);
      if (!got) {
        all_ok = false;
        std::cerr << got.status().str() << "\n";
        continue;
      }
      const auto [samples, malformed] = *got;
      if (malformed > 0) {
        all_ok = false;
        std::cerr << fmt::format("{}: {} of {} lines read are malformed for this model\n", path, malformed,
                                 samples + malformed);
        continue;
      }
      if (!p.flag("quiet"))
        std::printf("%s: data ok (%lld samples read)\n", path.c_str(), static_cast<long long>(samples));
    }
    if (!p.flag("quiet")) {
      size_t ops = forward.numOps();
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
