#include "tools/dump_cuda.h"

#include <fmt/format.h>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "passes/autodiff.h"
#include "tools/cli.h"

namespace kiln::cli {

int printCudaStage(ir::Module& module, int64_t batch, std::ostream& out, std::ostream& err) {
  if (module.attrs().count("kiln.train") && !module.lookup("train_step")) {
    if (Status s = passes::buildTrainStep(module); !s.isOk()) {
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
  auto groups = codegen::lowerFunction(*f, {{"B", batch}});
  if (!groups) {
    err << groups.status().str() << "\n";
    return kExitError;
  }
  std::vector<const codegen::Kernel*> kernels;
  for (const auto& g : *groups)
    for (const auto& k : g.kernels) kernels.push_back(&k);
  codegen::CudaModule m = codegen::emitModule(kernels);
  out << fmt::format("// @{} at B = {}: {} groups, {} kernel launches\n", f->name(), batch, groups->size(), kernels.size());
  size_t next = 0;
  for (const auto& g : *groups) {
    std::string ops;
    for (const ir::Op* op : g.ops) ops += (ops.empty() ? "" : ", ") + op->name();
    if (g.gemm) {
      out << fmt::format("//   gemm (cuBLASLt): {}\n", ops);
      continue;
    }
    out << fmt::format("//   [{}]:", ops);
    for (size_t i = 0; i < g.kernels.size(); ++i, ++next) out << " " << m.kernels[next].name;
    out << "\n";
  }
  out << "\n" << m.source;
  return kExitOk;
}

}  // namespace kiln::cli
