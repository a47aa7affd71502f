// `kiln plan MODEL --ranks N`: the sharding plan of a model's embedding tables on N ranks (the
// search's, a baseline's, or --plan FILE's) with its predictions and the reason for each choice,
// and with -o the plan as plan.json. The model is compiled through autodiff only, for its tables
// and their optimizer state: nothing is allocated, so a full-size model plans on any machine.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include <unistd.h>

#include <algorithm>

#include "frontend/frontend.h"
#include "passes/auto_plan.h"
#include "passes/comm_timeline.h"
#include "passes/cost_model.h"
#include "passes/id_frequency.h"
#include "passes/planner.h"
#include "passes/plan_json.h"
#include "ir/ops/kernel_util.h"
#include "runtime/data/batch_reader.h"
#include "runtime/memory.h"
#include "tools/cli.h"
#include "tools/dump_optimize.h"
#include "driver/id_sample.h"

namespace kiln::cli {
namespace {

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
                    passes::rankList(t.ranks), bytes(static_cast<double>(c.bytes_per_rank)), c.lookups_per_step,
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

// The critical path and the imbalance figures, one line each.
void printSummary(const passes::PlanCosts& costs, std::FILE* out) {
  const int cr = costs.critical_rank();
  const auto& c = costs.ranks[static_cast<size_t>(cr)];
  int64_t lo = costs.ranks[0].memory_bytes, hi = lo;
  for (const auto& r : costs.ranks) {
    lo = std::min(lo, r.memory_bytes);
    hi = std::max(hi, r.memory_bytes);
  }
  std::fprintf(out, "%s\n",
               fmt::format("critical path: rank {}, {:.3f} ms predicted (lookups {:.3f} ms, communication {:.3f} ms)",
                           cr, c.step_s * 1e3, c.lookup_s * 1e3, c.comm_s * 1e3)
                   .c_str());
  std::fprintf(out, "%s\n",
               fmt::format("imbalance: memory {:.2f}x (fullest {}, emptiest {}), time {:.2f}x (slowest over the mean)",
                           costs.memory_imbalance(), bytes(static_cast<double>(hi)), bytes(static_cast<double>(lo)),
                           costs.time_imbalance())
                   .c_str());
}

// --explain TABLE: every choice for one table, the rest of the plan fixed.
void printExplain(const passes::ShardPlan& plan, const std::vector<passes::TableInfo>& tables,
                  const passes::PlanRequest& req, size_t index, std::FILE* out) {
  std::vector<passes::OptionCost> opts = passes::explainTable(plan, tables, req, index);
  std::fprintf(out, "\n%s\n",
               fmt::format("{}: every choice, the rest of the plan fixed (best first; * the plan's)",
                           plan.tables[index].table)
                   .c_str());
  std::fprintf(out, "%s\n",
               fmt::format("  {:<16}  {:<8}  {:>9}  {:>13}  {}", "sharding", "ranks", "step ms", "fullest rank", "fits")
                   .c_str());
  for (const auto& o : opts)
    std::fprintf(out, "%s\n",
                 fmt::format("{} {:<16}  {:<8}  {:>9.3f}  {:>13}  {}", o.chosen ? "*" : " ",
                             passes::shardingName(o.option.type), passes::rankList(o.option.ranks), o.step_s * 1e3,
                             bytes(static_cast<double>(o.max_memory)), o.fits ? "yes" : "no")
                     .c_str());
}

// The target the simulator plays a step on: `base` with the cost table's memory and link rates.
// Ranks that share a machine's cores (the CPU with more ranks than cores) share its compute.
Target simulationTarget(Target base, const passes::CostTable& costs, int ranks_per_machine) {
  base.bytes_per_s = costs.device_bytes_per_s;
  base.intra_node = costs.intra_node;
  base.inter_node = costs.inter_node;
  if (costs.gemm_flops_per_s.f32 > 0) base.gemm_flops_per_s = costs.gemm_flops_per_s;
  if (costs.vector_flops_per_s.f32 > 0) base.vector_flops_per_s = costs.vector_flops_per_s;
  if (costs.launch_s > 0) base.launch_s = costs.launch_s;
  if (base.kind == TargetKind::cpu && base.cores > 0 && ranks_per_machine > base.cores) {
    const double share = static_cast<double>(base.cores) / ranks_per_machine;
    base.gemm_flops_per_s.f32 *= share;
    base.gemm_flops_per_s.bf16 *= share;
    base.vector_flops_per_s.f32 *= share;
    base.vector_flops_per_s.bf16 *= share;
    base.bytes_per_s *= share;
  }
  return base;
}

// One rank's training step as compiled (the shard pass under `plan_path`, fusion, remat, the
// schedule) and played on `target` by the communication timeline, with its costliest ops.
struct SimulatedRank {
  passes::CommTimeline timeline;
  std::vector<std::pair<double, std::string>> slowest;  // (seconds, what), costliest first
};

Expected<SimulatedRank> simulateRank(const std::string& path, const frontend::ParamOverrides& overrides,
                                     const std::string& plan_path, const passes::ShardPlan& plan, int rank,
                                     int64_t global_batch, const Target& target) {
  frontend::DiagnosticEngine diags(&std::cerr);
  auto m = frontend::compileModelFile(path, overrides, diags);
  if (!m) return Status::errorf("{}: the model does not compile", path);
  OptimizeOptions o;
  o.batch = std::max<int64_t>(1, global_batch / plan.ranks);
  o.target = target;
  if (plan.ranks > 1) {
    o.shard.set("ranks", std::to_string(plan.ranks));
    o.shard.set("rank", std::to_string(rank));
    o.shard.set("plan", plan_path);
    if (plan.ranks_per_node > 0) o.shard.set("ranks_per_node", std::to_string(plan.ranks_per_node));
  }
  KILN_RETURN_IF_ERROR(runTrainingPipeline(**m, o, ""));
  const ir::Function* f = (*m)->lookup("train_step");
  if (!f) return Status::error("the model has no training step");
  const ir::SymbolBindings symbols{{"B", o.batch}};
  passes::CostModel cost(target, symbols);
  const bool multi_node = plan.ranks_per_node > 0 && plan.ranks > plan.ranks_per_node;
  const auto scope = multi_node ? ir::LinkScope::inter_node : ir::LinkScope::intra_node;
  SimulatedRank out;
  out.timeline = passes::simulateCommTimeline(*f, cost, scope);
  for (const auto& op : f->entry().ops()) {
    const double t = passes::streamSeconds(*op, cost, symbols, scope);
    if (t <= 0) continue;
    std::string what(op->name());
    if (op->hasAttr("table")) what += fmt::format(" '{}'", op->strAttr("table"));
    if (op->is(ir::OpCode::Fused)) what += fmt::format(" ({})", op->strAttr("kind"));
    out.slowest.emplace_back(t, std::move(what));
  }
  std::sort(out.slowest.begin(), out.slowest.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  if (out.slowest.size() > 6) out.slowest.resize(6);
  return out;
}

Expected<std::string> readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("cannot read '{}'", path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The proposal's id frequencies, hot rows, rerun and de-duplication (passes/planner.h decided
// them; this prints what it saw).
void printHybrid(const passes::PlanProposal& proposal, const std::vector<passes::TableInfo>& tables,
                 const std::vector<passes::IdSample>& sample, const passes::PlanRequest& req,
                 const std::string& source, const std::vector<std::string>& explain, std::FILE* out) {
  const passes::ShardPlan& plan = proposal.layout;
  const std::vector<passes::FrequencyCurve>& curves = proposal.curves;
  const std::vector<passes::HybridEstimate>& estimates = proposal.hybrid;
  int64_t n = 0;
  for (const auto& x : sample) n = std::max(n, x.samples());
  std::fprintf(out, "\n%s\n",
               fmt::format("id frequencies of {} samples of {} (hot rows ranked on the first half, their "
                           "shares measured on the second):",
                           n, source)
                   .c_str());
  std::fprintf(out, "%s\n",
               fmt::format("{:<12}  {:>10}  {:>9}  {:>8}  {:>8}  {:>8}  {:>9}  {:>7}  {:>7}  {:>10}  {:>21}", "table",
                           "rows", "seen", "top .1%", "top 1%", "top 10%", "hot rows", "ids", "samples", "replica",
                           "link bytes a step")
                   .c_str());
  double plain = 0, hybrid = 0;
  int64_t replicas = 0;
  for (size_t i = 0; i < estimates.size(); ++i) {
    const auto& c = curves[i];
    const auto& e = estimates[i];
    plain += e.plain_bytes, hybrid += e.hybrid_bytes, replicas += e.replica_bytes;
    if (c.rows == 0) continue;
    auto top = [&](double f) {
      return fmt::format("{:.0f}%", 100 * c.idShare(std::max<int64_t>(1, static_cast<int64_t>(f * c.rows))));
    };
    const bool replicated = plan.tables[i].kind().replicated();
    std::fprintf(
        out, "%s\n",
        fmt::format("{:<12}  {:>10}  {:>9}  {:>8}  {:>8}  {:>8}  {:>9}  {:>7}  {:>7}  {:>10}  {:>21}", e.table, c.rows,
                    c.distinct, top(0.001), top(0.01), top(0.1), replicated ? "replicated" : fmt::format("{}", e.hot.rows),
                    e.hot.rows ? fmt::format("{:.0f}%", 100 * e.hot.id_share) : "-",
                    e.hot.rows ? fmt::format("{:.0f}%", 100 * e.hot.sample_share) : "-",
                    e.hot.rows ? bytes(static_cast<double>(e.replica_bytes)) : "-",
                    e.hot.rows ? fmt::format("{} -> {}", bytes(e.plain_bytes), bytes(e.hybrid_bytes)) : bytes(e.plain_bytes))
            .c_str());
  }
  // --explain TABLE: every hot-row count considered for it, the chosen starred.
  for (const std::string& name : explain)
    for (const auto& e : estimates) {
      if (e.table != name || e.candidates.empty()) continue;
      std::fprintf(out, "%s\n", fmt::format("{}: every hot-row count, the rest of the plan fixed (* the chosen)", name).c_str());
      std::fprintf(out, "%s\n", fmt::format("  {:>10}  {:>7}  {:>7}  {:>9}  {:>13}  {:>12}  {}", "hot rows", "ids",
                                             "samples", "step ms", "all ranks ms", "link bytes", "fits")
                                     .c_str());
      for (const auto& c : e.candidates)
        std::fprintf(out, "%s\n",
                     fmt::format("{} {:>10}  {:>6.0f}%  {:>6.0f}%  {:>9.4f}  {:>13.4f}  {:>12}  {}",
                                 c.hot.rows == e.hot.rows ? "*" : " ", c.hot.rows, 100 * c.hot.id_share,
                                 100 * c.hot.sample_share, c.step_s * 1e3, c.total_s * 1e3, bytes(c.link_bytes),
                                 c.fits ? "yes" : "no")
                         .c_str());
    }
  const double before = proposal.layout_costs.step_s();
  const double after = proposal.hot_step_s;
  std::fprintf(out, "%s\n",
               fmt::format("hybrid: predicted step {:.3f} ms -> {:.3f} ms ({:.2f}x); link bytes {} -> {} a step "
                           "({:.0f}% saved); the hot rows take {} on every rank",
                           before * 1e3, after * 1e3, after > 0 ? before / after : 1.0, bytes(plain), bytes(hybrid),
                           plain > 0 ? 100 * (plain - hybrid) / plain : 0.0, bytes(static_cast<double>(replicas)))
                   .c_str());
  if (proposal.rerun)
    std::fprintf(out, "%s\n",
                 fmt::format("searched again with those hot rows: {:.3f} ms ({:.2f}x the plan above), memory "
                             "imbalance {:.2f}x",
                             proposal.rerun->step_s() * 1e3,
                             proposal.rerun->step_s() > 0 ? before / proposal.rerun->step_s() : 1.0,
                             proposal.rerun->memory_imbalance())
                     .c_str());
  // De-duplicated routing, on the plan that runs.
  const passes::ShardPlan& chosen = proposal.before_dedup;
  const passes::ShardPlan& deduped = proposal.plan;
  const std::vector<passes::DedupChoice>& dedup_choices = proposal.dedup;
  // --explain TABLE: its de-duplication what-if.
  for (const std::string& name : explain)
    for (const auto& c : dedup_choices)
      if (c.table == name && c.considered)
        std::fprintf(out, "%s\n",
                     fmt::format("{}: de-duplicated ids ({:.3g}% of a rank's batch distinct) would be {:.4f} ms and "
                                 "{} on the links a step, routed plainly {:.4f} ms and {}: {}",
                                 name, 100 * c.unique_share, c.dedup_step_s * 1e3, bytes(c.dedup_bytes),
                                 c.plain_step_s * 1e3, bytes(c.plain_bytes), c.chosen ? "de-duplicated" : "plain")
                         .c_str());
  std::vector<std::string> dedup_tables;
  for (const auto& t : deduped.tables)
    if (t.dedup) dedup_tables.push_back(fmt::format("{} {:.3g}%", t.table, 100 * t.unique_share));
  if (!dedup_tables.empty()) {
    const passes::PlanCosts a = passes::planCosts(chosen, tables, req), b = passes::planCosts(deduped, tables, req);
    double bytes_a = 0, bytes_b = 0;
    for (size_t i = 0; i < a.tables.size(); ++i) bytes_a += a.tables[i].comm_bytes_per_step;
    for (size_t i = 0; i < b.tables.size(); ++i) bytes_b += b.tables[i].comm_bytes_per_step;
    std::fprintf(out, "%s\n",
                 fmt::format("de-duplicated ids on {} table{} (each: the distinct share of a rank's batch of its cold "
                             "ids): {}; predicted step {:.3f} ms -> {:.3f} ms, link bytes {} -> {} a step",
                             dedup_tables.size(), dedup_tables.size() == 1 ? "" : "s", fmt::join(dedup_tables, ", "),
                             a.step_s() * 1e3, b.step_s() * 1e3, bytes(bytes_a), bytes(bytes_b))
                     .c_str());
  } else {
    std::fprintf(out, "de-duplicated ids: on no table (the sample's ids repeat too little within a rank's batch)\n");
  }
  int64_t hybrid_tables = 0;
  for (const auto& t : deduped.tables) hybrid_tables += t.hot.rows > 0;
  std::fprintf(out, "%s\n",
               fmt::format("runs: {}, {} hybrid table{}, {} de-duplicated (kiln train --plan with -o's file)",
                           proposal.why, hybrid_tables, hybrid_tables == 1 ? "" : "s", dedup_tables.size())
                   .c_str());
}

}  // namespace

int runPlan(const std::vector<std::string>& raw_args) {
  ArgParser p(
      "plan",
      "kiln plan MODEL.kiln --ranks N [--ranks-per-node G] [--memory-per-rank BYTES] [--batch B] "
      "[--target T] [--costs FILE] [--strategy S] [--constraints FILE] [--explain TABLE]... [--compare] "
      "[--simulate] [--data FILE|synthetic]... [--plan FILE] [--set name=value]... [-o plan.json]",
      "Plans where each embedding table of the model lives on N ranks (by searching the choices over\n"
      "the target's cost table, or by a baseline's rules, or --plan FILE's) and prints, per table, its\n"
      "sharding, ranks, bytes per rank (weights plus optimizer state), lookups and bytes communicated\n"
      "per step and the reason for the choice with the runner-up's cost; per rank, the embedding\n"
      "memory and the predicted embedding time of one step; the critical path and the imbalance.\n"
      "Writes the plan as plan.json only with -o / --output. Nothing is allocated: full-size models\n"
      "plan anywhere.");
  p.setPositionals("MODEL.kiln", 1, 1, "the model (it needs a train block)");
  p.addOption("ranks", "N", "the number of ranks");
  p.addOption("ranks-per-node", "G", "ranks per node (default 0: all on one node)");
  p.addOption("memory-per-rank", "BYTES",
              "memory for tables and their state on each rank (80G, 512M, ...; default: unlimited)");
  p.addOption("batch", "B", "the global batch (each rank reads B / N samples)", "4096");
  p.addOption("plan", "FILE", "print the costs of this plan file instead of planning");
  p.addOption("strategy", "S",
              "search (the default), greedy (its start), table_row_wise or torchrec (the baselines)", "search");
  p.addOption("costs", "FILE", "a cost table (kiln calibrate -o) instead of the target's built-in one");
  p.addOption("constraints", "FILE", "pins: {\"format\": \"kiln-constraints-1\", \"tables\": [...]}");
  p.addOption("explain", "TABLE", "print every choice for TABLE with its predicted cost", std::nullopt, true);
  p.addFlag("compare", "also print every strategy's predicted step and imbalance");
  p.addFlag("simulate",
            "also compile the plan's training step for rank 0 and its slowest ranks and play it on the target: "
            "the whole step's predicted time");
  p.addOption("data", "FILE",
              "sample the ids (synthetic or data files) and print each table's frequency curve and the hot "
              "rows worth replicating",
              std::nullopt, true);
  p.addOption("data-samples", "N", "samples read for --data", "65536");
  p.addOption("set", "NAME=VALUE", "override a model param", std::nullopt, true);
  p.addOption("output", "FILE", "write the plan as plan.json to FILE (also -o FILE)");
  addTargetFlag(p, "the H200; the CPU with a --costs table measured on one");
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
  Target tgt = target ? *target : h200Target();
  std::string costs_from = fmt::format("built-in {}", tgt.name);
  if (p.has("costs")) {
    auto t = passes::loadCostTable(p.get("costs"));
    if (!t) {
      printError("plan", t.status());
      return kExitError;
    }
    req.costs = t.take();
    costs_from = fmt::format("{} ({})", p.get("costs"), req.costs.target);
    // A table measured on a CPU (kiln calibrate's) plans and simulates for the CPU, its ranks
    // sharing its cores, unless --target says otherwise.
    if (!target && req.costs.target.rfind("cpu", 0) == 0) tgt = cpuTarget();
  } else {
    auto t = passes::builtinCostTable(tgt.name);
    if (!t) {
      printError("plan", t.status());
      return kExitError;
    }
    req.costs = t.take();
  }
  auto strategy = passes::parseStrategy(p.get("strategy"));
  if (!strategy)
    return p.usageError(fmt::format("--strategy: unknown '{}' (use search, greedy, table_row_wise, torchrec)",
                                    p.get("strategy")));
  req.strategy = *strategy;
  if (p.has("constraints")) {
    auto text = readText(p.get("constraints"));
    if (!text) return p.usageError(text.status().message());
    auto pins = passes::readPlanConstraints(*text, p.get("constraints"), req.ranks);
    if (!pins) {
      printError("plan", pins.status());
      return kExitError;
    }
    req.pins = pins.take();
  }
  auto data_samples = p.getInt("data-samples");
  if (!data_samples) return kExitUsage;
  if (*data_samples < 2 || *data_samples > (int64_t{1} << 26))
    return p.usageError(fmt::format("--data-samples must lie in [2, 2^26], got {}", *data_samples));
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
  o.target = tgt;
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
  // --data: the ids first, so that a bad file stops the command before anything is printed.
  std::optional<std::vector<passes::IdSample>> sample;
  if (p.has("data")) {
    auto read = driver::sampleIds(**m, *tables, p.getAll("data"), *data_samples);
    if (!read) {
      printError("plan", read.status());
      return kExitError;
    }
    sample = read.take();
  }
  std::optional<passes::ShardPlan> from_file;
  if (p.has("plan")) {
    auto text = readText(p.get("plan"));
    if (!text) return p.usageError(text.status().message());
    auto read = passes::loadPlanJson(*text, p.get("plan"), *tables, req.ranks);
    if (!read) {
      printError("plan", read.status());
      return kExitError;
    }
    from_file = read.take();
    if (p.has("ranks-per-node") && from_file->ranks_per_node != req.ranks_per_node)
      std::fprintf(
          stderr,
          "kiln plan: warning: the plan file says ranks_per_node %d; using it, not --ranks-per-node %d\n",
          from_file->ranks_per_node, req.ranks_per_node);
    req.ranks_per_node = from_file->ranks_per_node;
  }
  // The planner decides (passes/planner.h); what follows prints its proposal.
  auto proposal = passes::proposePlan(*tables, req, from_file ? &*from_file : nullptr, sample ? &*sample : nullptr);
  if (!proposal) {
    printError("plan", proposal.status());
    return kExitError;
  }
  passes::ShardPlan plan = proposal->layout;
  passes::PlanCosts costs = proposal->layout_costs;
  int64_t total = 0;
  for (const auto& t : *tables) total += t.rows * t.bytesPerRow();
  std::printf(
      "%s\n",
      fmt::format("{}: {} embedding tables ({}) on {} ranks{}, global batch {}, target {}, {} a rank", path,
                  tables->size(), bytes(static_cast<double>(total)), req.ranks,
                  req.ranks_per_node > 0 ? fmt::format(" ({} a node)", req.ranks_per_node) : "",
                  req.global_batch, tgt.name,
                  req.memory_per_rank > 0 ? bytes(static_cast<double>(req.memory_per_rank)) : "unlimited")
          .c_str());
  std::printf("%s\n", fmt::format("plan: {}; costs: {}", p.has("plan") ? "from " + p.get("plan")
                                                                         : "strategy " + p.get("strategy"),
                                   costs_from)
                          .c_str());
  printPlan(plan, costs, *tables, stdout);
  std::printf("\n");
  printSummary(costs, stdout);
  for (const std::string& name : p.getAll("explain")) {
    size_t index = plan.tables.size();
    for (size_t i = 0; i < plan.tables.size(); ++i)
      if (plan.tables[i].table == name) index = i;
    if (index == plan.tables.size()) {
      std::string names;
      for (const auto& t : plan.tables) names += (names.empty() ? "" : ", ") + t.table;
      return p.usageError(fmt::format("--explain: unknown table '{}' (the model's tables: {})", name, names));
    }
    printExplain(plan, *tables, req, index, stdout);
  }
  if (p.has("compare")) {
    std::printf("\n%s\n", fmt::format("{:<15}  {:>9}  {:>9}  {:>9}  {:>9}  {:>14}", "strategy", "step ms",
                                       "vs this", "memory", "time", "types")
                               .c_str());
    for (auto s : {passes::PlanStrategy::search, passes::PlanStrategy::greedy, passes::PlanStrategy::table_row_wise,
                   passes::PlanStrategy::torchrec}) {
      passes::PlanRequest r = req;
      r.strategy = s;
      auto other = passes::autoPlan(*tables, r);
      if (!other) {
        std::printf("%s\n", fmt::format("{:<15}  {}", passes::strategyName(s), other.status().message()).c_str());
        continue;
      }
      passes::PlanCosts oc = passes::planCosts(*other, *tables, r);
      int count[5] = {0, 0, 0, 0, 0};
      for (const auto& t : other->tables) ++count[static_cast<int>(t.type)];
      std::string types;
      const char* abbrev[5] = {"dp", "tw", "rw", "cw", "trw"};
      for (int k = 0; k < 5; ++k)
        if (count[k]) types += fmt::format("{}{} {}", types.empty() ? "" : ", ", count[k], abbrev[k]);
      std::printf("%s\n", fmt::format("{:<15}  {:>9.3f}  {:>8.2f}x  {:>8.2f}x  {:>8.2f}x  {}", passes::strategyName(s),
                                      oc.step_s() * 1e3, oc.step_s() / costs.step_s(), oc.memory_imbalance(),
                                      oc.time_imbalance(), types)
                              .c_str());
    }
  }
  if (sample) {
    printHybrid(*proposal, *tables, *sample, req, fmt::format("{}", fmt::join(p.getAll("data"), ", ")),
                p.getAll("explain"), stdout);
    plan = proposal->plan;
    costs = proposal->costs;
  }
  if (p.flag("simulate")) {
    // The plan as a file the shard pass reads, for the ranks simulated.
    char tmpl[] = "/tmp/kiln-plan-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd < 0) return p.usageError("--simulate: cannot create a temporary file");
    close(fd);
    const std::string plan_path = tmpl;
    {
      std::ofstream f(plan_path, std::ios::binary | std::ios::trunc);
      f << passes::writePlanJson(plan);
    }
    const int machine = req.ranks_per_node > 0 ? req.ranks_per_node : req.ranks;
    const Target sim = simulationTarget(tgt, req.costs, machine);
    // Rank 0, the slowest two by the embedding prediction.
    std::vector<int> ranks = {0};
    std::vector<int> order(costs.ranks.size());
    for (size_t r = 0; r < order.size(); ++r) order[r] = static_cast<int>(r);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return costs.ranks[a].step_s > costs.ranks[b].step_s; });
    for (size_t i = 0; i < order.size() && i < 2; ++i)
      if (std::find(ranks.begin(), ranks.end(), order[i]) == ranks.end()) ranks.push_back(order[i]);
    std::printf("\n%s\n", fmt::format("simulated step on {} ({}): compute, communication and overlap from the "
                                       "scheduled program of each rank",
                                       tgt.name, costs_from)
                               .c_str());
    std::printf("%s\n", fmt::format("{:<4}  {:>11}  {:>9}  {:>11}  {:>10}  {:>11}", "rank", "collectives",
                                    "comm ms", "exposed ms", "compute ms", "step ms")
                            .c_str());
    double slowest = 0;
    std::vector<std::pair<double, std::string>> costliest;  // the slowest rank's ops
    for (int r : ranks) {
      auto sim_rank = simulateRank(path, overrides, plan_path, plan, r, req.global_batch, sim);
      if (!sim_rank) {
        std::remove(plan_path.c_str());
        printError("plan", sim_rank.status());
        return kExitError;
      }
      const passes::CommTimeline* t = &sim_rank->timeline;
      if (t->step_seconds >= slowest) costliest = sim_rank->slowest;
      slowest = std::max(slowest, t->step_seconds);
      std::printf("%s\n", fmt::format("{:<4}  {:>11}  {:>9.3f}  {:>11.3f}  {:>10.3f}  {:>11.3f}", r, t->collectives,
                                      t->comm_seconds * 1e3, t->exposed_comm_seconds * 1e3,
                                      t->compute_seconds * 1e3, t->step_seconds * 1e3)
                              .c_str());
    }
    std::remove(plan_path.c_str());
    std::printf("%s\n", fmt::format("predicted step: {:.3f} ms, {:.4g} samples/s", slowest * 1e3,
                                    static_cast<double>(req.global_batch) / slowest)
                            .c_str());
    std::string ops;
    for (const auto& [seconds, what] : costliest) ops += fmt::format("{}{} {:.3f} ms", ops.empty() ? "" : ", ", what, seconds * 1e3);
    std::printf("%s\n", fmt::format("costliest ops of the slowest rank: {}", ops).c_str());
  }
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
