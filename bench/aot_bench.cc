// Ahead-of-time kernel compilation of workload R1's training step (models/dlrm_dcnv2.kiln as
// r1_bench runs it: SGD, bf16, planned for the H200) with NVRTC, no GPU needed: the wall time of
// compileKernelsAhead for the given archs on the given threads, with an empty cache unless
// --cache-dir is given. Prints one `KILN {json}` line. bench/aot_compile.sh runs the table.
//
//   aot_bench [--model FILE] [--batch B] [--rows-cap N] [--archs sm_80,sm_90,...] [--ptx 0|1]
//             [--threads N] [--cache-dir DIR] [--single 1]
//
// --single 1 measures the executor's former JIT path instead: every kernel in ONE NVRTC program,
// compiled on one thread, for the first arch.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include "codegen/kernel_lowering.h"
#include "ir/target.h"
#include "runtime/cuda/ahead_compile.h"
#include "tools/session_flags.h"

using namespace kiln;

int main(int argc, char** argv) {
  std::string model = std::string(KILN_SOURCE_DIR) + "/models/dlrm_dcnv2.kiln";
  int64_t batch = 16384, rows_cap = 1000000;
  cuda::AheadOptions ahead;
  ahead.archs.clear();
  std::string archs = "sm_90";
  bool single = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") {
      model = v;
    } else if (k == "--batch") {
      batch = std::stoll(v);
    } else if (k == "--rows-cap") {
      rows_cap = std::stoll(v);
    } else if (k == "--archs") {
      archs = v;
    } else if (k == "--ptx") {
      ahead.ptx = v == "1";
    } else if (k == "--threads") {
      ahead.threads = std::stoi(v);
    } else if (k == "--single") {
      single = v == "1";
    } else if (k == "--cache-dir") {
      ahead.cache_dir = v;
    } else {
      std::fprintf(stderr, "aot_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  for (size_t at = 0; at <= archs.size();) {
    const size_t comma = std::min(archs.find(',', at), archs.size());
    if (comma > at) ahead.archs.push_back(archs.substr(at, comma - at));
    at = comma + 1;
  }

  driver::SessionOptions so;
  so.model_path = model;
  so.overrides["rows_cap"] = std::to_string(rows_cap);
  so.batch = batch;
  const ir::AttrDict sgd = {{"kind", ir::Attribute(std::string("sgd"))}, {"lr", ir::Attribute(0.01)}};
  so.train_overrides = {{"optimizer", ir::Attribute(sgd)},
                        {"embedding_optimizer", ir::Attribute(sgd)},
                        {"precision", ir::Attribute(std::string("bf16"))}};
  // The module only: no parameters are allocated (R1's tables are gigabytes).
  auto module = driver::compileModelModule(so, h200Target(), std::cerr);
  if (!module) {
    std::fprintf(stderr, "aot_bench: compiling %s: %s\n", model.c_str(), module.status().message().c_str());
    return 1;
  }
  const ir::Function* step = (*module)->lookup("train_step");
  if (!step) {
    std::fprintf(stderr, "aot_bench: %s has no @train_step\n", model.c_str());
    return 1;
  }
  const ir::SymbolBindings symbols{{"B", batch}};
  auto groups = codegen::lowerFunction(*step, symbols);
  if (!groups) {
    std::fprintf(stderr, "aot_bench: lowering: %s\n", groups.status().message().c_str());
    return 1;
  }
  std::vector<const codegen::Kernel*> kernels;
  for (const auto& g : *groups)
    for (const auto& k : g.kernels) kernels.push_back(&k);
  const int threads = cuda::nvrtcThreads(ahead.threads);
  const size_t programs = cuda::splitIntoPrograms(kernels, threads).size();

  if (single) {
    auto nvrtc = cuda::NvrtcCompiler::create(ahead.cache_dir);
    if (!nvrtc) {
      std::fprintf(stderr, "aot_bench: %s\n", nvrtc.status().message().c_str());
      return 1;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const codegen::CudaModule m = codegen::emitModule(kernels);
    auto cubin = (*nvrtc)->compile(m, ahead.archs.at(0));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!cubin) {
      std::fprintf(stderr, "aot_bench: %s\n", cubin.status().message().c_str());
      return 1;
    }
    std::printf(
        "KILN {\"archs\": \"%s\", \"ptx\": 0, \"threads\": 1, \"programs\": 1, \"image_bytes\": %zu, "
        "\"seconds\": %.3f}\n",
        ahead.archs[0].c_str(), cubin->cubin.size(), seconds);
    return 0;
  }

  const auto t0 = std::chrono::steady_clock::now();
  auto set = cuda::compileKernelsAhead(*step, symbols, ahead);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!set) {
    std::fprintf(stderr, "aot_bench: %s\n", set.status().message().c_str());
    return 1;
  }
  size_t bytes = 0;
  for (const cuda::KernelImage& im : set->images) bytes += im.bytes.size();
  std::printf(
      "KILN {\"archs\": \"%s\", \"ptx\": %d, \"threads\": %d, \"kernels\": %zu, \"programs\": %zu, "
      "\"images\": %zu, \"image_bytes\": %zu, \"serialized_bytes\": %zu, \"seconds\": %.3f}\n",
      fmt::format("{}", fmt::join(set->archs(), ",")).c_str(), ahead.ptx ? 1 : 0, threads,
      set->kernelNames().size(), programs, set->images.size(), bytes, set->serialize().size(), seconds);
  return 0;
}
