// `kiln plan MODEL --ranks N`: the sharding plan of a model's embedding tables on N ranks (the
// automatic one, or --plan FILE's) with its predictions, and with -o the plan as plan.json. The
// model is compiled through autodiff only, for its tables and their optimizer state: nothing is
// allocated, so a full-size model plans on any machine.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "frontend/frontend.h"
#include "passes/auto_plan.h"
#include "passes/plan_json.h"
#include "runtime/memory.h"
#include "tools/cli.h"
#include "tools/dump_optimize.h"

namespace kiln::cli {
namespace {

// "0-7", "3", "0-2,5": ranks read at a glance.
std::string rankList(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ",") +
           (j > i ? fmt::format("{}-{}", ranks[i], ranks[j]) : fmt::format("{}", ranks[i]));
    i = j + 1;
  }
  return out;
}

std::string bytes(double b) { return runtime::formatBytes(static_cast<uint64_t>(b)); }

void printPlan(const passes::ShardPlan& plan, const passes::PlanCosts& costs,
               const std::vector<passes::TableInfo>& tables, std::FILE* out) {
  size_t w = 5;
  for (const auto& t : plan.tables) w = std::max(w, t.table.size());
  std::fprintf(
      out, "%s\n",
      fmt::format("{:<{}}  {:>10}  {:>4}  {:<14}  {:<8}  {:>11}  {:>12}  {:>11}  {}", "table", w, "rows",
                  "dim", "sharding", "ranks", "bytes/rank", "lookups/step", "comm/step", "reason")
          .c_str());
  for (size_t i = 0; i < plan.tables.size(); ++i) {
    const auto& t = plan.tables[i];
    const auto& c = costs.tables[i];
    const passes::TableInfo* info = nullptr;
    for (const auto& x : tables)
      if (x.name == t.table) info = &x;
    std::fprintf(
        out, "%s\n",
        fmt::format("{:<{}}  {:>10}  {:>4}  {:<14}  {:<8}  {:>11}  {:>12.0f}  {:>11}  {}", t.table, w,
                    info ? info->rows : 0, info ? info->dim : 0, passes::shardingName(t.type),
                    rankList(t.ranks), bytes(static_cast<double>(c.bytes_per_rank)), c.lookups_per_step,
                    bytes(c.comm_bytes_per_step), t.reason.empty() ? "from the plan file" : t.reason)
            .c_str());
  }
  std::fprintf(out, "\n%s\n",
               fmt::format("{:<4}  {:>11}  {:>10}  {:>10}  {:>10}", "rank", "memory", "lookup ms", "comm ms",
                           "step ms")
                   .c_str());
  for (size_t r = 0; r < costs.ranks.size(); ++r) {
    const auto& c = costs.ranks[r];
    std::fprintf(out, "%s\n",
                 fmt::format("{:<4}  {:>11}  {:>10.3f}  {:>10.3f}  {:>10.3f}", r,
                             bytes(static_cast<double>(c.memory_bytes)), c.lookup_s * 1e3, c.comm_s * 1e3,
                             c.step_s * 1e3)
                     .c_str());
  }
}

}  // namespace

int runPlan(const std::vector<std::string>& raw_args) {
  ArgParser p(
      "plan",
      "kiln plan MODEL.kiln --ranks N [--ranks-per-node G] [--memory-per-rank BYTES] [--batch B] "
      "[--target T] [--plan FILE] [--set name=value]... [-o plan.json]",
      "Plans where each embedding table of the model lives on N ranks (the greedy of the automatic\n"
      "plan, or --plan FILE's) and prints, per table, its sharding, ranks, bytes per rank (weights\n"
      "plus optimizer state), lookups and bytes communicated per step and the reason for the choice;\n"
      "per rank, the embedding memory and the predicted embedding time of one step. Writes the plan\n"
      "as plan.json only with -o / --output. Nothing is allocated: full-size models plan anywhere.");
  p.setPositionals("MODEL.kiln", 1, 1, "the model (it needs a train block)");
  p.addOption("ranks", "N", "the number of ranks");
  p.addOption("ranks-per-node", "G", "ranks per node (default 0: all on one node)");
  p.addOption("memory-per-rank", "BYTES",
              "memory for tables and their state on each rank (80G, 512M, ...; default: unlimited)");
  p.addOption("batch", "B", "the global batch (each rank reads B / N samples)", "4096");
  p.addOption("plan", "FILE", "print the costs of this plan file instead of planning");
  p.addOption("set", "NAME=VALUE", "override a model param", std::nullopt, true);
  p.addOption("output", "FILE", "write the plan as plan.json to FILE (also -o FILE)");
  addTargetFlag(p, "the H200");
  std::vector<std::string> args = expandOutputShorthand(raw_args);
  int code;
  if (!p.parse(args, &code)) return code;
  if (!p.has("ranks")) return p.usageError("--ranks N is required");
  passes::PlanRequest req;
  auto ranks = p.getInt("ranks");
  if (!ranks) return kExitUsage;
  if (*ranks < 1 || *ranks > 65536)
    return p.usageError(fmt::format("--ranks must lie in [1, 65536], got {}", *ranks));
  req.ranks = static_cast<int>(*ranks);
  if (p.has("ranks-per-node")) {
    auto rpn = p.getInt("ranks-per-node");
    if (!rpn) return kExitUsage;
    if (*rpn < 0 || *rpn > 65536)
      return p.usageError(fmt::format("--ranks-per-node must lie in [0, 65536], got {}", *rpn));
    req.ranks_per_node = static_cast<int>(*rpn);
  }
  auto batch = p.getInt("batch");
  if (!batch) return kExitUsage;
  if (*batch < req.ranks)
    return p.usageError(
        fmt::format("--batch (the global batch) must be at least --ranks ({}), got {}", req.ranks, *batch));
  req.global_batch = *batch;
  if (p.has("memory-per-rank")) {
    auto m = runtime::parseByteSize(p.get("memory-per-rank"));
    if (!m) return p.usageError(fmt::format("--memory-per-rank: {}", m.status().message()));
    if (*m == 0 || *m > static_cast<uint64_t>(INT64_MAX))
      return p.usageError("--memory-per-rank must be positive");
    req.memory_per_rank = static_cast<int64_t>(*m);
  }
  std::optional<Target> target;
  if (!readTargetFlag(p, &target, &code)) return code;
  req.target = target ? *target : h200Target();
  frontend::ParamOverrides overrides;
  for (const std::string& s : p.getAll("set"))
    if (Status st = frontend::addOverride(s, overrides); !st.isOk()) return p.usageError(st.message());

  const std::string& path = p.positionals()[0];
  frontend::DiagnosticEngine diags(&std::cerr);
  auto m = frontend::compileModelFile(path, overrides, diags);
  if (!m) return kExitError;
  if (!(*m)->attrs().count("kiln.train")) {
    std::fprintf(stderr, "%s: error: the model has no train block: there is nothing to plan\n", path.c_str());
    return kExitError;
  }
  OptimizeOptions o;
  o.batch = std::max<int64_t>(1, req.global_batch / req.ranks);
  o.target = req.target;
  // Through autodiff and its cleanup: the tables and their optimizer state exist, nothing else
  // is needed.
  if (Status s = runTrainingPipeline(**m, o, "remat"); !s) {
    printError("plan", s);
    return kExitError;
  }
  auto tables = passes::tablesOf(**m);
  if (!tables) {
    printError("plan", tables.status());
    return kExitError;
  }
  passes::ShardPlan plan;
  if (p.has("plan")) {
    std::ifstream in(p.get("plan"), std::ios::binary);
    if (!in) return p.usageError(fmt::format("cannot read '{}'", p.get("plan")));
    std::stringstream text;
    text << in.rdbuf();
    auto read = passes::loadPlanJson(text.str(), p.get("plan"), *tables, req.ranks);
    if (!read) {
      printError("plan", read.status());
      return kExitError;
    }
    plan = read.take();
    if (p.has("ranks-per-node") && plan.ranks_per_node != req.ranks_per_node)
      std::fprintf(
          stderr,
          "kiln plan: warning: the plan file says ranks_per_node %d; using it, not --ranks-per-node %d\n",
          plan.ranks_per_node, req.ranks_per_node);
    req.ranks_per_node = plan.ranks_per_node;
  } else {
    auto made = passes::autoPlan(*tables, req);
    if (!made) {
      printError("plan", made.status());
      return kExitError;
    }
    plan = made.take();
  }
  passes::PlanCosts costs = passes::planCosts(plan, *tables, req);
  int64_t total = 0;
  for (const auto& t : *tables) total += t.rows * t.bytesPerRow();
  std::printf(
      "%s\n",
      fmt::format("{}: {} embedding tables ({}) on {} ranks{}, global batch {}, target {}, {} a rank", path,
                  tables->size(), bytes(static_cast<double>(total)), req.ranks,
                  req.ranks_per_node > 0 ? fmt::format(" ({} a node)", req.ranks_per_node) : "",
                  req.global_batch, req.target.name,
                  req.memory_per_rank > 0 ? bytes(static_cast<double>(req.memory_per_rank)) : "unlimited")
          .c_str());
  printPlan(plan, costs, *tables, stdout);
  if (p.has("output")) {
    const std::string out_path = p.get("output");
    const std::string tmp = out_path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f << passes::writePlanJson(plan, &costs);
      if (!f.good()) return p.usageError(fmt::format("cannot write '{}'", out_path));
    }
    if (std::rename(tmp.c_str(), out_path.c_str()) != 0) {
      std::remove(tmp.c_str());
      return p.usageError(fmt::format("cannot write '{}'", out_path));
    }
    std::printf("wrote %s\n", out_path.c_str());
  }
  return kExitOk;
}

}  // namespace kiln::cli
