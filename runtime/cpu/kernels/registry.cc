#include <map>
#include <string>

#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {

struct KernelTable {
  std::multimap<std::string, FastKernel, std::less<>> by_op;
};

void addKernel(KernelTable& t, std::string_view op_name, FastKernel k) { t.by_op.emplace(std::string(op_name), k); }

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
    return t;
  }();
  return t;
}

const FastKernel* findFastKernel(const ir::Op& op) {
  auto [lo, hi] = table().by_op.equal_range(op.name());
  for (auto it = lo; it != hi; ++it)
    if (it->second.supports(op)) return &it->second;
  return nullptr;
}

}  // namespace kiln::runtime::cpu
