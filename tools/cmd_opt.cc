// `kiln opt`: IR text in, passes, IR text (or Graphviz) out, like mlir-opt.
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "ir/diagnostic.h"
#include "ir/dot.h"
#include "ir/op_def.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/target.h"
#include "passes/pass_manager.h"
#include "tools/cli.h"

namespace kiln::cli {
namespace {

struct Chunk {
  std::string text;  // padded with the newlines before it, so that line numbers stay the file's
};

// Splits on `// -----` lines, as mlir-opt's --split-input-file does.
std::vector<Chunk> splitInput(const std::string& source) {
  std::vector<Chunk> chunks;
  std::string current;
  int line = 0, chunk_start = 0;
  std::istringstream in(source);
  std::string text;
  while (std::getline(in, text)) {
    if (text.rfind("// -----", 0) == 0) {
      chunks.push_back({std::string(static_cast<size_t>(chunk_start), '\n') + current});
      current.clear();
      chunk_start = line + 1;
    } else {
      current += text;
      current += '\n';
    }
    ++line;
  }
  chunks.push_back({std::string(static_cast<size_t>(chunk_start), '\n') + current});
  return chunks;
}

bool readInput(const std::string& path, std::string* out, std::string* error) {
  if (path == "-") {
    std::ostringstream ss;
    ss << std::cin.rdbuf();
    *out = ss.str();
    return true;
  }
  // A directory opens as a stream that reads nothing; without this check it would be an empty
  // module (`module {}`, exit 0).
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    *error = fmt::format("cannot read '{}': it is a directory", path);
    return false;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = fmt::format("cannot read '{}': {}", path, std::strerror(errno));
    return false;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    *error = fmt::format("cannot read '{}': {}", path, std::strerror(errno));
    return false;
  }
  *out = ss.str();
  return true;
}

void listOps(std::ostream& os) {
  for (const ir::OpDef* d : ir::OpRegistry::get().all())
    os << fmt::format("{:<36} {}\n", d->name, d->summary);
}

// Each pass, then its options: `  budget=VALUE  description (default: ...)`.
void listPasses(std::ostream& os) {
  for (const passes::PassInfo& p : passes::registeredPasses()) {
    os << fmt::format("{:<20} {}\n", p.name, p.description);
    for (const passes::PassOptionInfo& o : p.options)
      os << fmt::format("  {:<18} {} (default: {})\n", fmt::format("{}=", o.name), o.description,
                        o.default_value.empty() ? "none" : o.default_value);
  }
}

void listTargets(std::ostream& os) {
  for (std::string_view name : targetNames()) {
    auto t = targetByName(name);
    os << fmt::format("{:<8} {}: {:.3g} TFLOP/s GEMM bf16, {:.3g} f32, {:.3g} TB/s, {:.0f} us per launch\n",
                      name, t->description, t->gemm_flops_per_s.bf16 / 1e12, t->gemm_flops_per_s.f32 / 1e12,
                      t->bytes_per_s / 1e12, t->launch_s * 1e6);
  }
}

}  // namespace

int runOpt(const std::vector<std::string>& raw_args) {
  ArgParser p("opt", "kiln opt FILE.mlir [--passes=a,b] [flags] [-o OUT]",
              "Reads IR in its text form ('-' reads stdin), runs passes over it and prints the result.");
  p.setPositionals("FILE.mlir", 0, 1, "the IR to read; '-' for stdin");
  p.addOption("passes", "a,b{opt=v},c",
              "the passes to run, in order, with options in braces (see --list-passes)", std::nullopt);
  addTargetFlag(p, "cpu");
  p.addOption("disable-pass", "NAME", "leave this pass out of the pipeline", std::nullopt, true);
  p.addOption("print-ir-after", "NAME", "print the IR to stderr after this pass", std::nullopt, true);
  p.addFlag("print-ir-after-all", "print the IR to stderr after every pass");
  p.addOption("dump-dir", "DIR", "write 0000.input.mlir and NNNN.<pass>.mlir after each pass into DIR");
  p.addFlag("pass-timing", "print the time of each pass to stderr");
  p.addOption("format", "mlir|dot", "output format: IR text or a Graphviz graph of each function", "mlir");
  p.addOption("output", "OUT", "write the output to OUT instead of stdout (also -o OUT)");
  p.addFlag("split-input-file", "process each '// -----' separated chunk on its own");
  p.addFlag("list-ops", "list the ops of the op table and exit");
  p.addFlag("list-passes", "list the passes and their options and exit");
  p.addFlag("list-targets", "list the targets --target takes and exit");

  // `-o OUT` is the one short flag, spelled as compilers do.
  std::vector<std::string> args;
  for (size_t i = 0; i < raw_args.size(); ++i) {
    if (raw_args[i] == "-o" && i + 1 < raw_args.size()) {
      args.push_back(fmt::format("--output={}", raw_args[++i]));
    } else if (raw_args[i].size() > 2 && raw_args[i].rfind("-o", 0) == 0 && raw_args[i][2] != '-') {
      args.push_back(fmt::format("--output={}", raw_args[i].substr(2)));
    } else {
      args.push_back(raw_args[i]);
    }
  }
  int code;
  if (!p.parse(args, &code)) return code;
  if (p.flag("list-ops")) {
    listOps(std::cout);
    return kExitOk;
  }
  if (p.flag("list-passes")) {
    listPasses(std::cout);
    return kExitOk;
  }
  if (p.flag("list-targets")) {
    listTargets(std::cout);
    return kExitOk;
  }
  std::optional<Target> target;
  if (!readTargetFlag(p, &target, &code)) return code;
  const passes::PassContext context{target ? *target : cpuTarget()};
  if (p.positionals().empty()) return p.usageError("missing FILE.mlir (usage: kiln opt FILE.mlir [flags])");
  std::string format = p.get("format");
  if (format != "mlir" && format != "dot")
    return p.usageError(fmt::format("--format must be mlir or dot, got '{}'", format));

  // Check the pipeline before reading anything, so that a typo is a usage error.
  auto makePassManager = [&](passes::PassManager& pm) -> Status {
    KILN_RETURN_IF_ERROR(pm.addPipeline(p.get("passes")));
    for (const std::string& d : p.getAll("disable-pass")) pm.options().disabled.insert(d);
    for (const std::string& d : p.getAll("print-ir-after")) pm.options().print_ir_after.insert(d);
    pm.options().print_ir_after_all = p.flag("print-ir-after-all");
    pm.options().dump_dir = p.get("dump-dir");
    pm.options().timing = p.flag("pass-timing");
    return pm.build();
  };
  {
    passes::PassManager probe(context);
    Status s = makePassManager(probe);
    if (!s) return p.usageError(s.message());
  }

  const std::string path = p.positionals()[0];
  std::string source, error;
  std::error_code ec;
  if (path != "-" && !std::filesystem::exists(path, ec))
    return p.usageError(fmt::format("cannot read '{}': {}", path, std::strerror(ENOENT)));
  if (!readInput(path, &source, &error)) {
    // A file that is there but cannot be read is bad input, not bad usage: exit 1, as kiln check
    // and dump do.
    std::fprintf(stderr, "kiln opt: error: %s\n", error.c_str());
    return kExitError;
  }
  std::string filename = path == "-" ? "<stdin>" : path;

  std::vector<Chunk> chunks;
  if (p.flag("split-input-file"))
    chunks = splitInput(source);
  else
    chunks.push_back({source});

  std::ostringstream out;
  int exit_code = kExitOk;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (i) out << "// -----\n";
    auto module = ir::parseModule(chunks[i].text, filename);
    if (!module) {
      std::cerr << formatDiagnostic(module.status(), source, filename) << '\n';
      exit_code = kExitError;
      continue;
    }
    passes::PassManager pm(context);
    Status built = makePassManager(pm);
    assert(built.isOk());
    (void)built;
    auto ran = pm.run(**module);
    if (!ran) {
      std::cerr << formatDiagnostic(ran.status(), source, filename) << '\n';
      exit_code = kExitError;
      continue;
    }
    if (format == "dot") {
      for (const auto& f : (*module)->functions()) ir::functionToDot(*f, out);
    } else {
      ir::printModule(**module, out);
    }
  }

  if (p.has("output")) {
    std::ofstream file(p.get("output"), std::ios::binary);
    file << out.str();
    file.close();
    if (!file)
      return p.usageError(fmt::format("cannot write '{}': {}", p.get("output"), std::strerror(errno)));
  } else {
    std::cout << out.str();
  }
  return exit_code;
}

}  // namespace kiln::cli
