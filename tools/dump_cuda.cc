#include "tools/dump_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "ir/precision.h"
#include "runtime/cuda/nvrtc_compiler.h"
#include "tools/cli.h"

namespace kiln::cli {

namespace {

// ptxas's report of every kernel of `m`, one line each, with the blocks an SM holds.
int printResources(const codegen::CudaModule& m, const std::vector<const codegen::Kernel*>& kernels,
                   const Target& target, std::ostream& out, std::ostream& err) {
  if (target.cuda_arch.empty()) {
    err << fmt::format("error: --resources compiles the kernels for a GPU: --target {} is not one\n", target.name);
    return kExitUsage;
  }
  auto nvrtc = cuda::NvrtcCompiler::create("");
  if (!nvrtc) {
    err << "error: --resources needs NVRTC: " << nvrtc.status().message() << "\n";
    return kExitError;
  }
  auto usage = (*nvrtc)->resourceUsage(m, target.cuda_arch);
  if (!usage) {
    err << usage.status().str() << "\n";
    return kExitError;
  }
  std::map<std::string, int> block_of;
  for (size_t i = 0; i < kernels.size() && i < m.kernels.size(); ++i)
    block_of[m.kernels[i].name] = codegen::launchConfig(*kernels[i]).block;
  out << fmt::format("\n// ptxas (NVRTC {}) for {} ({}): per thread, per block, and the blocks an SM holds at once\n",
                     (*nvrtc)->version(), target.cuda_arch, target.name);
  out << fmt::format("{:<64} {:>6} {:>5} {:>10} {:>6} {:>10}  {}\n", "kernel", "block", "regs", "smem", "spill",
                     "blocks/SM", "limited by");
  for (const cuda::KernelResources& r : *usage) {
    auto it = block_of.find(r.name);
    const int block = it == block_of.end() ? 0 : it->second;
    const Occupancy o = blocksPerSm(target, block, r.registers, r.shared_bytes);
    out << fmt::format("{:<64} {:>6} {:>5} {:>10} {:>6} {:>10}  {}\n", r.name, block, r.registers, r.shared_bytes,
                       r.spill_bytes, o.blocks, o.limit);
  }
  return kExitOk;
}

}  // namespace

int printCudaStage(ir::Module& module, const OptimizeOptions& options, std::ostream& out, std::ostream& err,
                   bool resources) {
  const int64_t batch = options.batch;
  // The passes `kiln train --device cuda` runs (fusion included), planned at --batch as it plans
  // them at its batch, so the kernels shown are the kernels that run.
  if (module.attrs().count("kiln.train") && !module.lookup("train_step")) {
    if (Status s = runTrainingPipeline(module, options); !s.isOk()) {
      err << s.str() << "\n";
      return kExitError;
    }
  }
  ir::Function* f = module.lookup("train_step");
  if (!f) f = module.lookup("forward");
  if (!f) {
    err << "error: the module has neither @train_step nor @forward\n";
    return kExitError;
  }
  auto groups = codegen::lowerFunction(*f, {{"B", batch}}, options.target);
  if (!groups) {
    err << groups.status().str() << "\n";
    return kExitError;
  }
  std::vector<const codegen::Kernel*> kernels;
  for (const auto& g : *groups)
    for (const auto& k : g.kernels) kernels.push_back(&k);
  codegen::CudaModule m = codegen::emitModule(kernels);
  size_t gemms = 0;
  for (const auto& g : *groups) gemms += g.gemm != nullptr;
  out << fmt::format("// @{} at B = {}: {} groups, {} kernel launches, {} cuBLASLt calls\n", f->name(), batch,
                     groups->size(), kernels.size(), gemms);
  size_t next = 0;
  int last_split = -1;
  for (const auto& g : *groups) {
    // A fused group the backend could not run as one unit: one line saying why, then its pieces.
    if (!g.split_reason.empty() && g.fused_index != last_split) {
      last_split = g.fused_index;
      out << fmt::format("//   split {} group #{}: {}\n", g.fused_kind, g.fused_index, g.split_reason);
    }
    std::string ops;
    for (const ir::Op* op : g.ops) ops += (ops.empty() ? "" : ", ") + op->name();
    std::string origin = g.fused_kind.empty() ? "" : fmt::format("{} #{} ", g.fused_kind, g.fused_index);
    if (g.gemm) {
      const codegen::GemmCall& c = g.gemm_call;
      std::string epilogue = c.residual >= 0 ? "C" : "";
      if (c.bias_gradient_of)
        epilogue = fmt::format("bgrad({})", c.bias_gradient_of == 'a' ? 'A' : 'B');
      else if (c.bias >= 0)
        epilogue += epilogue.empty() ? "bias" : "+bias";
      if (!c.activation.empty()) epilogue += (epilogue.empty() ? "" : "+") + c.activation;
      if (c.writes_relu_mask) epilogue += "+mask";
      if (!c.activation_grad.empty()) epilogue += "d" + c.activation_grad;
      out << fmt::format("//   {}gemm (cuBLASLt{}{}{}, {} out): {}\n", origin, ir::allowsTf32(*g.gemm) ? ", tf32" : "",
                         epilogue.empty() ? "" : ", epilogue ", epilogue,
                         ir::dtypeName(g.buffers[static_cast<size_t>(c.c)].dtype), ops);
      continue;
    }
    out << fmt::format("//   {}[{}]:", origin, ops);
    for (size_t i = 0; i < g.kernels.size(); ++i, ++next) out << " " << m.kernels[next].name;
    out << "\n";
  }
  if (resources) return printResources(m, kernels, options.target, out, err);
  out << "\n" << m.source;
  return kExitOk;
}

}  // namespace kiln::cli
