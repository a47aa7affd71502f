// A model compiled ahead of time (`kiln compile`, docs/aot.md): what a payload holds and what a
// session opened from it needs. The IR after every pass (for the names, types and initializers of
// the inputs and parameters, and the train block), the CPU Program of each function memory-planned
// at the largest batch it takes, the CUDA kernels for each architecture, and optionally the weights.
// Nothing here needs the frontend, the passes or NVRTC.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "codegen/program.h"
#include "ir/status.h"
#include "runtime/payload.h"

namespace kiln::driver {

// The sections of a payload (runtime/payload.h).
inline constexpr std::string_view kMetaSection = "meta.json";
inline constexpr std::string_view kModuleSection = "module.kir";
inline constexpr std::string_view kWeightsSection = "weights.safetensors";
inline constexpr std::string_view kCudaKernelsSection = "cuda.kernels";
std::string cpuProgramSection(std::string_view function);  // "program.cpu.train_step"

struct CompiledModel {
  std::string name;    // the model's name
  std::string source;  // the model file it was compiled from (for `info`)
  std::string kiln_version;
  std::string module_text;             // the IR after every pass
  std::string target;                  // what the passes planned for
  int64_t max_batch = 0;               // every Program is planned for this batch; any batch up to it runs
  std::vector<std::string> functions;  // of train, eval, predict
  std::vector<std::string> devices;    // cpu, cuda
  std::vector<std::string> archs;      // of the CUDA kernels: sm_80, compute_90 (PTX), ...
  std::map<std::string, std::string> overrides;                       // the --set values it was compiled with
  std::map<std::string, codegen::Program, std::less<>> cpu_programs;  // by function
  std::span<uint8_t> weights;  // safetensors bytes in the payload (a private, writable mapping); empty: none
  std::string_view cuda_kernels;                    // the serialized kernel set; empty: no cuda payload
  std::shared_ptr<const runtime::Payload> payload;  // keeps the views above valid

  bool has(std::string_view function) const;  // "train", "eval", "predict"
};

// Reads and checks what a runner needs from its payload; errors name the file.
Expected<std::shared_ptr<const CompiledModel>> loadCompiledModel(
    std::shared_ptr<const runtime::Payload> payload);

// The metadata section as JSON text, and back.
std::string compiledMetaJson(const CompiledModel& c);
Status parseCompiledMeta(std::string_view json, CompiledModel& c);

}  // namespace kiln::driver
