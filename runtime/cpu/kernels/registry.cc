#include <map>
#include <string>

#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {

struct KernelTable {
  std::multimap<ir::OpCode, FastKernel> by_op;
};

void addKernel(KernelTable& t, ir::OpCode op, FastKernel k) { t.by_op.emplace(op, k); }

static const KernelTable& table() {
  static const KernelTable t = [] {
    KernelTable t;
    registerElementwiseKernels(t);
    registerMatmulKernels(t);
    registerReduceKernels(t);
    registerEmbeddingKernels(t);
    registerEmbeddingUpdateKernels(t);
    registerOptimizerKernels(t);
    registerDataKernels(t);
    registerMoeKernels(t);
    return t;
  }();
  return t;
}

const FastKernel* findFastKernel(const ir::Op& op) {
  auto [lo, hi] = table().by_op.equal_range(op.opcode());
  for (auto it = lo; it != hi; ++it)
    if (it->second.supports(op)) return &it->second;
  return nullptr;
}

}  // namespace kiln::runtime::cpu
