// `kiln dump FILE --stage=NAME`: shows one stage of the compilation of a model. Each stage is
// one entry of kStages; a later stage (memory, program, cuda) is one more entry and function.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include <fmt/format.h>

#include "codegen/lower_cpu.h"
#include "frontend/frontend.h"
#include "ir/dot.h"
#include "ir/printer.h"
#include "tools/cli.h"

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

// The CPU Program of @forward at --batch B (memory planned), or an error printed.
std::optional<codegen::Program> lowerForward(DumpContext& c) {
  auto m = frontend::compileModelFile(c.path, c.overrides, c.diags);
  if (!m) return std::nullopt;
  const ir::Function* f = (*m)->lookup("forward");
  if (!f) {
    std::cerr << c.path << ": error: the model has no @forward function\n";
    return std::nullopt;
  }
  auto batch = c.args.getInt("batch");
  if (!batch || *batch <= 0) {
    std::cerr << "kiln dump: error: --batch must be a positive integer\n";
    return std::nullopt;
  }
  auto p = codegen::lowerForCpu(*f, {{"B", *batch}});
  if (!p) {
    std::cerr << p.status().str() << "\n";
    return std::nullopt;
  }
  return p.take();
}

int dumpMemory(DumpContext& c) {
  auto p = lowerForward(c);
  if (!p) return kExitError;
  c.out << codegen::memoryPlanStr(*p);
  return kExitOk;
}

int dumpProgram(DumpContext& c) {
  auto p = lowerForward(c);
  if (!p) return kExitError;
  c.out << p->str();
  return kExitOk;
}

struct Stage {
  const char* name;
  const char* help;
  int (*run)(DumpContext&);
};

const Stage kStages[] = {
    {"ast", "the syntax tree of the file, as S-expressions", dumpAst},
    {"ir", "the lowered IR (@forward and the module attributes)", dumpIr},
    {"memory", "the CPU memory plan of @forward at --batch: buffers, offsets, live ranges, peak_bytes", dumpMemory},
    {"program", "the CPU Program of @forward at --batch: buffers and per-stream instructions", dumpProgram},
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
  p.addOption("batch", "B", "the batch size B bound before memory planning (stages memory, program)", "256");
  int code;
  if (!p.parse(args, &code)) return code;
  std::string format = p.get("format");
  if (format != "mlir" && format != "dot") return p.usageError(fmt::format("--format must be mlir or dot, got '{}'", format));
  frontend::ParamOverrides overrides;
  for (const std::string& s : p.getAll("set"))
    if (Status st = frontend::addOverride(s, overrides); !st.isOk()) return p.usageError(st.message());

  const Stage* stage = nullptr;
  for (const Stage& s : kStages)
    if (p.get("stage") == s.name) stage = &s;
  if (!stage) return p.usageError(fmt::format("unknown stage '{}' (use {})", p.get("stage"), stages));

  std::ofstream file;
  if (p.has("output")) {
    file.open(p.get("output"));
    if (!file) return p.usageError(fmt::format("cannot write '{}'", p.get("output")));
  }
  frontend::DiagnosticEngine diags(&std::cerr);
  DumpContext c{p, p.positionals()[0], overrides, format, p.has("output") ? static_cast<std::ostream&>(file) : std::cout, diags};
  return stage->run(c);
}

}  // namespace kiln::cli
