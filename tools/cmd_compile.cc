// `kiln compile MODEL.kiln -o NAME`: the model through every pass and codegen, written as a
// standalone executable (the kiln-runner binary with the payload appended) or, with --emit lib,
// a shared library with a C API. docs/aot.md.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "codegen/lower_cpu.h"
#include "ir/printer.h"
#include "kiln_aot_header.inc"
#include "runtime/checkpoint.h"
#include "runtime/cuda/ahead_compile.h"
#include "runtime/cuda/kernel_set.h"
#include "runtime/data/sample.h"
#include "runtime/payload.h"
#include "tools/cli.h"
#include "driver/compiled_model.h"
#include "driver/evaluator.h"
#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// The prebuilt runner beside this kiln binary (the build's tools/ folder, or an install's bin/).
Expected<std::string> runnerBeside(const std::string& file) {
  KILN_ASSIGN_OR_RETURN(std::string self, runtime::selfExecutablePath());
  const std::filesystem::path dir = std::filesystem::path(self).parent_path();
  for (const auto& candidate : {dir / file, dir / ".." / "lib" / file}) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(candidate, ec)) return candidate.string();
  }
  return Status::errorf("cannot find {} beside {} (build the target, or reinstall Kiln)", file, self);
}

// The checkpoint's tensors that the compiled model holds, checked against it by the same code
// that loads a checkpoint at run time, as the bytes of a safetensors file.
Expected<std::vector<uint8_t>> weightsFor(const std::shared_ptr<const driver::CompiledModel>& compiled,
                                          const driver::SessionOptions& options, const std::string& checkpoint) {
  KILN_ASSIGN_OR_RETURN(auto session, driver::Session::fromCompiled(compiled, options, std::cerr));
  KILN_RETURN_IF_ERROR(driver::loadCheckpointInto(*session, checkpoint));
  std::vector<std::pair<std::string, ir::TensorView>> tensors;
  for (const std::string& name : session->checkpointNames())
    tensors.emplace_back(name, session->params().find(name)->view);
  // The training step the weights are of: kiln serve reports it as the model's version.
  std::map<std::string, std::string> metadata{{"source", checkpoint}};
  if (auto file = driver::checkpointFile(checkpoint); file)  // a sharded checkpoint's step is not recorded
    if (auto header = runtime::readCheckpointHeader(*file); header && header->metadata.count("step"))
      metadata["step"] = header->metadata.at("step");
  return runtime::serializeCheckpoint(tensors, metadata);
}

// NAME.h: the C API's header after the model's own constants (its max batch and each input's
// index), as NAME_MAX_BATCH, NAME_NUM_INPUTS and NAME_INPUT_<INPUT>.
Expected<std::string> cHeaderFor(const ir::Module& m, const driver::CompiledModel& c, const std::string& name) {
  auto macro = [](std::string_view s) {
    std::string out;
    for (char ch : s)
      out += std::isalnum(static_cast<unsigned char>(ch)) ? static_cast<char>(std::toupper(ch)) : '_';
    if (out.empty() || std::isdigit(static_cast<unsigned char>(out[0]))) out = "_" + out;
    return out;
  };
  const ir::Function* fwd = m.lookup("forward");
  if (!fwd) return Status::error("the model has no @forward");
  KILN_ASSIGN_OR_RETURN(auto spec, data::fromFunction(*fwd));
  data::Batch one;
  data::allocateBatch(spec, 1, one);
  const std::string prefix = macro(name);
  std::string h = fmt::format(
      "/* {}.h: the C API of lib{}.so, model '{}' compiled ahead of time by Kiln {} from {}\n"
      " * (batch up to {}; functions {}). Link with -L. -l{}; see docs/aot.md.\n *\n"
      " * Inputs, as kiln_input(model, i) describes them:\n",
      name, name, c.name, c.kiln_version, c.source, c.max_batch, fmt::join(c.functions, ", "), name);
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const data::InputSpec& in = spec.inputs[i];
    h += fmt::format(" *   {:<3} {:<16} {:<6} {:>6} per sample  {}\n", i, in.name,
                     ir::dtypeName(in.type.dtype()), one.tensors[i].numel(), data::roleName(in.role));
  }
  h += " */\n";
  h += fmt::format("#define {}_MAX_BATCH {}\n#define {}_NUM_INPUTS {}\n", prefix, c.max_batch, prefix,
                   spec.inputs.size());
  for (size_t i = 0; i < spec.inputs.size(); ++i)
    h += fmt::format("#define {}_INPUT_{} {}\n", prefix, macro(spec.inputs[i].name), i);
  h += "\n";
  h += kKilnAotHeader;
  return h;
}

std::string megabytes(uint64_t bytes) { return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6); }

}  // namespace

int runCompile(const std::vector<std::string>& raw_args) {
  ArgParser p(
      "compile", "kiln compile MODEL.kiln -o NAME [flags]",
      "Compiles a model ahead of time: every pass and codegen, the CUDA kernels for each architecture\n"
      "(NVRTC; no GPU needed), written with the runtime into one file that runs without Kiln:\n"
      "`./NAME train|eval|predict|info` (or, with --emit lib, libNAME.so and NAME.h).");
  modelFileSource().addModelArgument(p);
  p.addOption("output", "NAME",
              "the executable to write (also -o NAME); with --emit lib, libNAME.so and NAME.h");
  p.addOption("emit", "exe|lib", "a standalone executable or a shared library with a C API", "exe");
  p.addFlag("serve",
            "the executable also serves over HTTP (./NAME serve, docs/serving.md); it then needs Debian's "
            "libcpp-httplib at run time");
  p.addOption("device", "cpu|cuda|all", "the devices the payload runs on", "all");
  p.addOption("arch", "LIST", "CUDA architectures, e.g. sm_80,sm_90,compute_90 (PTX for newer GPUs)",
              "sm_80,sm_90,compute_90");
  p.addOption("max-batch", "B", "the largest batch the executable takes (memory is planned for it)", "256");
  p.addOption("functions", "LIST", "of train, eval, predict", "train,eval,predict");
  p.addOption("checkpoint", "CKPT",
              "embed these trained weights (default: initialise at run time from --seed)");
  const ModelSource& model = modelFileSource();
  addModelFlags(p, model);
  int code;
  const std::vector<std::string> args = expandOutputShorthand(raw_args);
  if (!p.parse(args, &code)) return code;
  if (!p.has("output")) return p.usageError("-o NAME is required");
  const std::string emit = p.get("emit"), device = p.get("device");
  if (emit != "exe" && emit != "lib")
    return p.usageError(fmt::format("--emit must be exe or lib, got '{}'", emit));
  if (emit == "lib" && p.flag("serve")) return p.usageError("--serve makes an executable (--emit exe)");
  if (device != "cpu" && device != "cuda" && device != "all")
    return p.usageError(fmt::format("--device must be cpu, cuda or all, got '{}'", device));
  auto max_batch = p.getInt("max-batch");
  if (!max_batch) return kExitUsage;
  if (*max_batch < 1) return p.usageError("--max-batch must be positive");
  std::vector<std::string> functions = splitList(p.get("functions"));
  for (const std::string& f : functions)
    if (f != "train" && f != "eval" && f != "predict")
      return p.usageError(fmt::format("--functions: '{}' is not one of train, eval, predict", f));
  if (functions.empty()) return p.usageError("--functions names none of train, eval, predict");

  driver::SessionOptions so;
  if (!model.readModelArgument(p, so, &code)) return code;
  so.batch = *max_batch;
  so.training = std::find(functions.begin(), functions.end(), "train") != functions.end();
  if (!readModelFlags(p, model, so, &code)) return code;
  if (p.has("checkpoint") && !std::filesystem::exists(p.get("checkpoint")))
    return p.usageError(fmt::format("no such checkpoint '{}'", p.get("checkpoint")));

  auto fail = [](const Status& s) {
    printError("compile", s);
    return kExitError;
  };
  // The passes plan for the CPU unless told otherwise: one module serves every device.
  auto target = targetByName(so.target.empty() ? "cpu" : so.target);
  if (!target) return fail(target.status());
  auto module = driver::compileModelModule(so, *target, std::cerr);
  if (!module) return fail(module.status());
  const ir::Module& m = **module;

  auto compiled = std::make_shared<driver::CompiledModel>();
  if (auto it = m.attrs().find("kiln.model"); it != m.attrs().end() && it->second.isString())
    compiled->name = it->second.asString();
  compiled->source = so.model_path;
  compiled->kiln_version = KILN_VERSION;
  compiled->target = target->name;
  compiled->max_batch = *max_batch;
  compiled->functions = functions;
  for (const auto& [k, v] : so.overrides) compiled->overrides[k] = v;
  compiled->module_text = ir::printModule(m);
  if (device != "cuda") compiled->devices.push_back("cpu");
  runtime::PayloadWriter payload;
  for (const char* function : {"train_step", "forward"}) {
    const ir::Function* f = m.lookup(function);
    if (!f) continue;
    auto program = codegen::lowerForCpu(*f, {{"B", *max_batch}});
    if (!program) return fail(program.status());
    payload.add(driver::cpuProgramSection(function), program->serialize());
    compiled->cpu_programs.emplace(function, program.take());
  }
  if (device != "cpu") {
    // Every kernel of each function at the max batch, for each architecture, on every core.
    cuda::AheadOptions ahead;
    ahead.archs.clear();
    ahead.ptx = false;
    std::string ptx_arch;
    for (const std::string& a : splitList(p.get("arch"))) {
      if (a.rfind("compute_", 0) == 0) {
        ahead.ptx = true;
        ptx_arch = a;
      } else {
        ahead.archs.push_back(a);
      }
    }
    if (ahead.archs.empty()) return p.usageError("--arch names no sm_XX architecture to compile for");
    if (ahead.ptx) {
      int newest = 0;
      for (const std::string& a : ahead.archs) newest = std::max(newest, cuda::archNumber(a));
      if (cuda::archNumber(ptx_arch) != newest)
        return p.usageError(fmt::format(
            "--arch: PTX is emitted for the newest architecture (compute_{}), not {}", newest, ptx_arch));
    }
    const auto start = std::chrono::steady_clock::now();
    cuda::KernelSet kernels;
    for (const char* function : {"train_step", "forward"}) {
      const ir::Function* f = m.lookup(function);
      if (!f) continue;
      auto set = cuda::compileKernelsAhead(*f, {{"B", *max_batch}}, ahead);
      if (!set)
        return fail(Status::errorf("--device {}: the CUDA kernels of @{}: {}{}", device, function,
                                   set.status().message(),
                                   device == "all" ? " (--device cpu builds without them)" : ""));
      kernels.merge(set.take());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "compiled %zu CUDA kernels for %s in %.1f s (%d NVRTC threads)\n",
                 kernels.kernelNames().size(), fmt::format("{}", fmt::join(kernels.archs(), ", ")).c_str(),
                 seconds, cuda::nvrtcThreads(ahead.threads));
    compiled->devices.push_back("cuda");
    compiled->archs = kernels.archs();
    payload.add(std::string(driver::kCudaKernelsSection), kernels.serialize());
  }

  const std::filesystem::path out(p.get("output"));
  const std::filesystem::path out_dir =
      out.has_parent_path() ? out.parent_path() : std::filesystem::path(".");
  if (p.has("checkpoint")) {
    driver::SessionOptions check = so;
    check.training = so.training;
    auto weights = weightsFor(compiled, check, p.get("checkpoint"));
    if (!weights) return fail(weights.status());
    payload.add(std::string(driver::kWeightsSection), weights.take());
  }
  payload.add(std::string(driver::kMetaSection), driver::compiledMetaJson(*compiled));
  payload.add(std::string(driver::kModuleSection), compiled->module_text);

  const std::string runner_file = emit == "exe" ? (p.flag("serve") ? "kiln-serve-runner" : "kiln-runner")
                                                : "libkiln-aot.so";
  auto runner = runnerBeside(runner_file);
  if (!runner) return fail(runner.status());
  const std::string name = out.filename().string();
  const std::filesystem::path written = emit == "exe" ? out : out_dir / ("lib" + name + ".so");
  if (Status s = payload.writeAppended(*runner, written.string(), emit == "exe"); !s) return fail(s);
  if (emit == "lib") {
    auto header = cHeaderFor(m, *compiled, name);
    if (!header) return fail(header.status());
    const std::filesystem::path header_path = out_dir / (name + ".h");
    if (Status s = runtime::writeFileAtomically(header_path.string(), *header); !s) return fail(s);
  }
  std::error_code ec;
  const uint64_t total = std::filesystem::file_size(written, ec),
                 runtime_bytes = std::filesystem::file_size(*runner, ec);
  std::fprintf(stderr, "wrote %s (%s: runtime %s, payload %s; batch up to %lld; %s%s)\n", written.c_str(),
               megabytes(total).c_str(), megabytes(runtime_bytes).c_str(),
               megabytes(total - runtime_bytes).c_str(), static_cast<long long>(*max_batch),
               fmt::format("{}", fmt::join(compiled->devices, ", ")).c_str(),
               p.has("checkpoint") ? "; weights embedded" : "");
  return kExitOk;
}

}  // namespace kiln::cli
