// `kiln dump FILE --stage=NAME`: shows one stage of the compilation of a model. Each stage is
// one entry of kStages; a later stage (memory, program, cuda) is one more entry and function.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include "codegen/lower_cpu.h"
#include "frontend/frontend.h"
#include "ir/dot.h"
#include "ir/precision.h"
#include "ir/printer.h"
#include "passes/remat.h"
#include "tools/cli.h"
#include "tools/dump_cuda.h"
#include "tools/dump_optimize.h"

namespace kiln::cli {
namespace {

struct DumpContext {
  const ArgParser& args;
  std::string path;
  frontend::ParamOverrides overrides;
  std::string format;  // mlir | dot
  std::ostream& out;
  frontend::DiagnosticEngine& diags;
};

int dumpAst(DumpContext& c) {
  if (c.format != "mlir") return c.args.usageError("--stage=ast prints text only (no --format=dot)");
  auto f = frontend::parseModelFile(c.path, c.diags);
  if (!f) return kExitError;
  c.out << frontend::ast::printFile(**f);
  return kExitOk;
}

int dumpIr(DumpContext& c) {
  auto m = frontend::compileModelFile(c.path, c.overrides, c.diags);
  if (!m) return kExitError;
  if (c.format == "dot") {
    for (const auto& f : (*m)->functions()) ir::functionToDot(*f, c.out);
  } else {
    ir::printModule(**m, c.out);
  }
  return kExitOk;
}

// The options of the training pipeline from the flags: --batch, --memory-budget, --disable-pass,
// --target (default: cpu, the H200 for --stage=cuda).
std::optional<OptimizeOptions> optimizeOptions(const ArgParser& p) {
  OptimizeOptions o;
  std::optional<long long> batch = p.getInt("batch");
  if (!batch) return std::nullopt;  // getInt printed why
  if (*batch <= 0) {
    std::cerr << "kiln dump: error: --batch must be a positive integer\n";
    return std::nullopt;
  }
  o.batch = *batch;
  if (p.has("memory-budget")) {
    o.memory_budget = p.get("memory-budget");
    if (auto b = passes::parseMemoryBudget(o.memory_budget, 1); !b) {
      p.usageError(b.status().message());
      return std::nullopt;
    }
  }
  for (const std::string& d : p.getAll("disable-pass")) o.disabled_passes.insert(d);
  // One rank's program of a sharded run: the shard pass with these options.
  std::optional<long long> ranks = p.getInt("ranks"), rank = p.getInt("rank"), ep = p.getInt("ep");
  if (!ranks || !rank || !ep) return std::nullopt;
  if (*ranks < 1 || *rank < 0 || *rank >= *ranks) {
    p.usageError(fmt::format("--rank must lie in [0, --ranks), got --rank {} --ranks {}", *rank, *ranks));
    return std::nullopt;
  }
  if (*ep < 1 || *ranks % *ep != 0) {
    p.usageError(
        fmt::format("--ep must be a positive divisor of --ranks, got --ep {} --ranks {}", *ep, *ranks));
    return std::nullopt;
  }
  if (*ranks > 1) {
    o.shard.set("ranks", std::to_string(*ranks));
    o.shard.set("rank", std::to_string(*rank));
    if (p.has("plan")) o.shard.set("plan", p.get("plan"));
    if (p.has("sharding")) o.shard.set("sharding", p.get("sharding"));
    if (*ep > 1) o.shard.set("ep", std::to_string(*ep));
    if (p.has("pipeline")) o.shard.set("pipeline", "1");
  }
  std::optional<Target> target;
  int code = kExitOk;
  if (!readTargetFlag(p, &target, &code)) return std::nullopt;
  o.roofline = p.flag("roofline");
  o.target = target ? *target : p.get("stage") == "cuda" || o.roofline ? h200Target() : cpuTarget();
  if (o.roofline && o.target.kind != TargetKind::gpu) {
    p.usageError(fmt::format("--roofline prices the CUDA kernels on a GPU: --target {} is not one", o.target.name));
    return std::nullopt;
  }
  o.device = p.get("device");
  if (o.device != "cpu" && o.device != "cuda") {
    p.usageError(fmt::format("--device must be cpu or cuda, got '{}'", o.device));
    return std::nullopt;
  }
  return o;
}

// The CPU Program (memory planned) of --function at --batch B: @forward as the frontend makes
// it, @train_step after the training pipeline (streams and events of the schedule included).
std::optional<codegen::Program> lowerStage(DumpContext& c) {
  auto m = frontend::compileModelFile(c.path, c.overrides, c.diags);
  if (!m) return std::nullopt;
  auto o = optimizeOptions(c.args);
  if (!o) return std::nullopt;
  std::string name = c.args.get("function");
  if (name == "train_step") {
    if (Status s = runTrainingPipeline(**m, *o); !s) {
      std::cerr << s.str() << "\n";
      return std::nullopt;
    }
  }
  const ir::Function* f = (*m)->lookup(name);
  if (!f) {
    std::cerr << fmt::format("{}: error: the model has no @{} function{}\n", c.path, name,
                             name == "train_step" ? " (it needs a train block)" : "");
    return std::nullopt;
  }
  auto p = codegen::lowerForCpu(*f, {{"B", o->batch}});
  if (!p) {
    std::cerr << p.status().str() << "\n";
    return std::nullopt;
  }
  return p.take();
}

int dumpMemory(DumpContext& c) {
  auto p = lowerStage(c);
  if (!p) return kExitError;
  c.out << codegen::memoryPlanStr(*p);
  return kExitOk;
}

int dumpProgram(DumpContext& c) {
  auto p = lowerStage(c);
  if (!p) return kExitError;
  c.out << p->str();
  return kExitOk;
}

// --precision: the train block's GEMM precision, overridden. An exit code on a usage error.
std::optional<int> overridePrecision(const ArgParser& p, ir::Module& m) {
  if (!p.has("precision")) return std::nullopt;
  const std::string precision = p.get("precision");
  if (!ir::isGemmPrecision(precision))
    return p.usageError(fmt::format("--precision must be one of {}, got '{}'", ir::gemmPrecisionNames(), precision));
  auto train = m.attrs().find("kiln.train");
  if (train == m.attrs().end() || !train->second.isDict()) return p.usageError("--precision: the model has no train block");
  ir::AttrDict merged = train->second.asDict();
  merged["precision"] = ir::Attribute(precision);
  m.mutableAttrs()["kiln.train"] = ir::Attribute(std::move(merged));
  return std::nullopt;
}

int dumpCuda(DumpContext& c) {
  auto m = frontend::compileModelFile(c.path, c.overrides, c.diags);
  if (!m) return kExitError;
  auto o = optimizeOptions(c.args);
  if (!o) return kExitUsage;
  if (auto code = overridePrecision(c.args, **m)) return *code;
  return printCudaStage(**m, *o, c.out, std::cerr, c.args.flag("resources"));
}

struct Stage {
  const char* name;
  const char* help;
  int (*run)(DumpContext&);
};

const Stage kStages[] = {
    {"ast", "the syntax tree of the file, as S-expressions", dumpAst},
    {"ir", "the lowered IR (@forward and the module attributes)", dumpIr},
    {"cuda", "the generated CUDA of the training step, kernels specialized to --batch", dumpCuda},
    {"memory", "the CPU memory plan of --function at --batch: buffers, offsets, live ranges, peak_bytes", dumpMemory},
    {"program", "the CPU Program of --function at --batch: buffers and per-stream instructions", dumpProgram},
};

}  // namespace

int runDump(const std::vector<std::string>& args) {
  std::string stages;
  for (const Stage& s : kStages) stages += fmt::format("{}{}", stages.empty() ? "" : "|", s.name);
  ArgParser p("dump", fmt::format("kiln dump FILE.kiln --stage={} [--format=dot] [--set name=value]...", stages),
              "Shows one stage of a model's compilation.");
  p.setPositionals("FILE.kiln", 1, 1, "the model");
  p.addOption("stage", stages, "what to show", "ir");
  p.addOption("format", "mlir|dot", "text, or a Graphviz graph of each function", "mlir");
  p.addOption("set", "NAME=VALUE", "override a model param", std::nullopt, true);
  p.addOption("output", "OUT", "write to OUT instead of stdout");
  p.addOption("function", "forward|train_step", "with --stage=memory|program: which function", "forward");
  p.addOption("batch", "B", "the batch size B bound before planning (memory, program, cuda, --stats, --explain)", "1024");
  p.addFlag("stats",
            "print kernels, the memory (param_bytes, optimizer_bytes, activation_peak_bytes, "
            "workspace_bytes, data_bytes, "
            "peak_bytes: what kiln train checks), flops and recompute_flops of one training step at --batch");
  p.addOption("device", "cpu|cuda",
              "with --stats: cuda also prints what the GPU holds (gpu_param_bytes, gpu_activation_peak_bytes "
              "from the CUDA program's arena, gpu_bytes: what kiln train --device cuda checks against the GPU)",
              "cpu");
  p.addFlag("roofline",
            "with --stats: the CUDA kernels of the step by class (GEMMs, embedding forward and backward, MoE "
            "routing, reductions, elementwise): launches, bytes, flops and their roofline time on the GPU "
            "target (default h200)");
  p.addOption("explain", "fusion", "explain a pass's decisions: each fused group and each refused pair");
  p.addOption("memory-budget", "BYTES|N%",
              "training step: recompute activations until the peak fits (remat{budget=...})");
  addTargetFlag(p, "cpu; h200 with --stage=cuda");
  p.addOption("disable-pass", "NAME", "training step: leave this pass out of the pipeline", std::nullopt, true);
  p.addOption("ranks", "N", "show one rank's program of a run on N ranks (the shard pass)", "1");
  p.addOption("rank", "R", "with --ranks: which rank's program", "0");
  p.addOption("plan", "FILE", "with --ranks: the plan.json to shard by (default: the automatic plan)");
  p.addOption("sharding", "TYPE", "with --ranks: shard every table this way instead of a plan");
  p.addOption("ep", "N", "with --ranks: spread each MoE layer's experts over groups of N ranks", "1");
  p.addFlag("pipeline", "with --ranks: the pipelined step (the next batch's ids routed during this one)");
  p.addOption("precision", "f32|bf16|f32_strict",
              "with --stats, --explain or --stage=cuda: the GEMM precision, overriding the train block's");
  p.addFlag("resources",
            "with --stage=cuda: instead of the source, compile the kernels with NVRTC for the target (default "
            "h200: sm_90) and print ptxas's registers, shared memory and spills per kernel, and how many of its "
            "blocks an SM holds at once");
  int code;
  if (!p.parse(args, &code)) return code;
  std::string format = p.get("format");
  if (format != "mlir" && format != "dot") return p.usageError(fmt::format("--format must be mlir or dot, got '{}'", format));
  frontend::ParamOverrides overrides;
  for (const std::string& s : p.getAll("set"))
    if (Status st = frontend::addOverride(s, overrides); !st.isOk()) return p.usageError(st.message());

  if (p.get("function") != "forward" && p.get("function") != "train_step")
    return p.usageError(fmt::format("--function must be forward or train_step, got '{}'", p.get("function")));
  const Stage* stage = nullptr;
  for (const Stage& s : kStages)
    if (p.get("stage") == s.name) stage = &s;
  if (!stage) return p.usageError(fmt::format("unknown stage '{}' (use {})", p.get("stage"), stages));
  if (p.flag("resources") && std::string(stage->name) != "cuda")
    return p.usageError("--resources goes with --stage=cuda");

  std::ofstream file;
  if (p.has("output")) {
    file.open(p.get("output"));
    if (!file) return p.usageError(fmt::format("cannot write '{}'", p.get("output")));
  }
  frontend::DiagnosticEngine diags(&std::cerr);
  if (p.flag("stats") || p.has("explain")) {
    if (p.has("explain") && p.get("explain") != "fusion")
      return p.usageError(fmt::format("--explain: unknown pass '{}' (use fusion)", p.get("explain")));
    auto o = optimizeOptions(p);
    if (!o) return kExitUsage;
    auto m = frontend::compileModelFile(p.positionals()[0], overrides, diags);
    if (!m) return kExitError;
    if (auto code = overridePrecision(p, **m)) return *code;
    std::ostream& out = p.has("output") ? static_cast<std::ostream&>(file) : std::cout;
    return p.flag("stats") ? printOptimizeStats(**m, *o, out, std::cerr) : printFusionExplanation(**m, *o, out, std::cerr);
  }
  DumpContext c{p, p.positionals()[0], overrides, format, p.has("output") ? static_cast<std::ostream&>(file) : std::cout, diags};
  return stage->run(c);
}

}  // namespace kiln::cli
