#include "tools/session_flags.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

#include "runtime/cuda/cuda_driver.h"
#include "runtime/memory.h"

namespace kiln::cli {

std::string ModelSource::defaultBatch(int64_t fallback) const {
  return std::to_string(compiled() ? compiled()->max_batch : fallback);
}

bool ModelSource::embeddedWeights() const { return compiled() && !compiled()->weights.empty(); }

CompiledSource::CompiledSource(std::shared_ptr<const driver::CompiledModel> compiled, std::string path,
                               std::string name)
    : compiled_(std::move(compiled)), path_(std::move(path)), name_(std::move(name)) {}

std::string CompiledSource::synopsis(const std::string& command) const { return name_ + " " + command; }

bool CompiledSource::readModelArgument(const ArgParser&, driver::SessionOptions& o, int*) const {
  o.model_path = path_;
  return true;
}

Expected<std::unique_ptr<driver::Session>> CompiledSource::open(const driver::SessionOptions& options,
                                                                std::ostream& diag) const {
  return driver::Session::fromCompiled(compiled_, options, diag);
}

void addModelFlags(ArgParser& p, const ModelSource& model) {
  p.addOption("threads", "N", "CPU threads", "2");
  p.addOption("seed", "S", "seed of parameter initialization and synthetic data", "0");
  p.addOption("memory-limit", "SIZE|N%",
              "the most memory the run may use, e.g. 8G, 512M, 1.5GiB, or 80% of what the machine has "
              "(default: all the machine has: MemAvailable, the cgroup limit, ulimit -v); a run that needs "
              "more stops before it allocates, naming the largest tables and the shortfall");
  model.addCompileFlags(p);
}

bool readModelFlags(const ArgParser& p, const ModelSource& model, driver::SessionOptions& o, int* exit_code) {
  auto threads = p.getInt("threads");
  auto seed = p.getInt("seed");
  if (!threads || !seed) {
    *exit_code = kExitUsage;
    return false;
  }
  if (*threads < 1 || *threads > 1024) {
    *exit_code = p.usageError(fmt::format("--threads must be in [1, 1024], got {}", *threads));
    return false;
  }
  o.threads = static_cast<int>(*threads);
  if (*seed < 0) {
    // Cast to uint64_t it would silently become another seed.
    *exit_code = p.usageError(fmt::format("--seed must be at least 0, got {}", *seed));
    return false;
  }
  o.seed = static_cast<uint64_t>(*seed);
  if (p.has("memory-limit") && !p.get("memory-limit").empty() && p.get("memory-limit").back() == '%') {
    // A share of what the machine has, measured when the session checks.
    const std::string text = p.get("memory-limit");
    char* end = nullptr;
    const double percent = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() - 1 || !std::isfinite(percent) || percent <= 0 || percent > 100) {
      *exit_code =
          p.usageError(fmt::format("--memory-limit: a percentage must be in (0%, 100%], got '{}'", text));
      return false;
    }
    o.memory_limit_percent = percent;
  } else if (p.has("memory-limit")) {
    auto limit = runtime::parseByteSize(p.get("memory-limit"));
    if (!limit) {
      *exit_code = p.usageError(fmt::format("--memory-limit: {}", limit.status().message()));
      return false;
    }
    o.memory_limit = *limit;
  }
  return model.readCompileFlags(p, o, exit_code);
}

void addDeviceFlag(ArgParser& p) {
  p.addOption("device", "cpu|cuda", "where to run (default: cuda when a GPU is present, else cpu)");
}

bool readDeviceFlag(const ArgParser& p, driver::SessionOptions& o, int* exit_code) {
  if (!p.has("device")) {
    o.device = cuda::cudaAvailable() ? "cuda" : "cpu";
    return true;
  }
  o.device = p.get("device");
  if (o.device != "cpu" && o.device != "cuda") {
    *exit_code = p.usageError(fmt::format("--device must be cpu or cuda, got '{}'", o.device));
    return false;
  }
  return true;
}

}  // namespace kiln::cli
