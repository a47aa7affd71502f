// `kiln checkpoint`: checkpoint tools. `kiln checkpoint merge DIR -o model.safetensors` joins a
// sharded checkpoint (runtime/sharded_checkpoint.h: shard files and their index) into the
// single safetensors file that kiln eval and predict, and PyTorch's safetensors, read.
#include <cstdio>

#include "runtime/sharded_checkpoint.h"
#include "tools/cli.h"

namespace kiln::cli {
namespace {

int runMerge(const std::vector<std::string>& raw_args) {
  ArgParser p("checkpoint merge", "kiln checkpoint merge DIR -o OUT.safetensors",
              "Reads the sharded checkpoint in DIR (its index and every shard file, validated) and writes\n"
              "each global tensor whole, with the index's metadata, into one safetensors file (written\n"
              "atomically: a temporary file, then a rename).");
  p.setPositionals("DIR", 1, 1, "a sharded checkpoint directory (with checkpoint.index.json)");
  p.addOption("output", "OUT", "the safetensors file to write (also -o OUT)");
  std::vector<std::string> args = expandOutputShorthand(raw_args);
  int code;
  if (!p.parse(args, &code)) return code;
  if (!p.has("output")) return p.usageError("-o OUT.safetensors is required");
  const std::string& dir = p.positionals()[0];
  if (!runtime::ShardedCheckpoint::isShardedDir(dir))
    return p.usageError(
        fmt::format("'{}' holds no sharded checkpoint (no {})", dir, runtime::kShardedIndexFile));
  auto ck = runtime::ShardedCheckpoint::open(dir);
  if (!ck) {
    printError("checkpoint merge", ck.status());
    return kExitError;
  }
  auto merged = ck->merge();
  if (!merged) {
    printError("checkpoint merge", merged.status());
    return kExitError;
  }
  std::vector<std::pair<std::string, ir::TensorView>> views;
  for (const auto& [name, t] : merged->tensors) views.emplace_back(name, t.view);
  Status st = runtime::saveCheckpoint(p.get("output"), views, merged->metadata);
  if (!st) {
    printError("checkpoint merge", st);
    return kExitError;
  }
  std::printf("wrote %s: %zu tensors of step %lld, merged from %d ranks\n", p.get("output").c_str(),
              views.size(), static_cast<long long>(ck->step()), ck->ranks());
  return kExitOk;
}

}  // namespace

int runCheckpoint(const std::vector<std::string>& args) {
  return runSubcommands("checkpoint",
                        {{"merge", "Join a sharded checkpoint into one safetensors file", runMerge}}, args);
}

}  // namespace kiln::cli
