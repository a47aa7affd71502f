// Lowering IR ops to kernel IR.
//
// A group is a list of ops of one block, in order, that becomes one unit of GPU work:
//   - elementwise and data-movement ops (broadcast, reshape, transpose, slice, concat, gather,
//     cast, activation_grad) of one output shape: ONE Pointwise kernel; values that leave the
//     group are stored, the rest stay in registers;
//   - a reduction or softmax, optionally fed by such a chain (the chain is computed inline);
//   - losses (bce_with_logits, softmax_cross_entropy) and dense optimizer updates;
//   - every fixed-hotness embedding_bag of a collection: ONE EmbeddingForward kernel;
//   - an embedding_bag_update: clear, accumulate (duplicate ids combined in a hash table) and
//     one Row kernel applying the sparse optimizer to the touched rows;
//   - a matmul: no kernel (cuBLASLt runs it); lowerGroup returns it with `gemm` set.
// groupOps() forms groups greedily (the fusion pass can hand its own groups to lowerGroup).
#pragma once

#include <string>
#include <vector>

#include "codegen/kernel_ir.h"
#include "ir/ir.h"

namespace kiln::codegen {

// A buffer the kernels of a group read or write: an IR value, or a temporary of the group.
struct GroupBuffer {
  const ir::Value* value = nullptr;  // null for a temporary
  std::string name;
  DType dtype = DType::f32;
  int64_t elements = 0;
  bool written = false;
};

struct LoweredGroup {
  std::vector<const ir::Op*> ops;
  const ir::Op* gemm = nullptr;  // a matmul, run by cuBLASLt: no kernels
  std::vector<GroupBuffer> buffers;
  std::vector<Kernel> kernels;
  // args[k][j]: the group buffer bound to buffer j of kernels[k].
  std::vector<std::vector<int>> args;
};

// Ops that need no GPU work of their own: sources (inputs, parameters, constants) and
// terminators.
bool isSourceOrTerminator(const ir::Op& op);
// Ops that lower into a Pointwise kernel's expressions.
bool isPointwiseOp(const ir::Op& op);

// Splits the ops of a block (sources and terminators skipped) into groups in execution order.
std::vector<std::vector<const ir::Op*>> groupOps(const std::vector<const ir::Op*>& ops);

// Lowers one group under concrete symbol values. Errors name the op and say what the CUDA
// backend does not support.
Expected<LoweredGroup> lowerGroup(const std::vector<const ir::Op*>& ops, const ir::SymbolBindings& symbols);

// Every group of a function, lowered: what `kiln dump --stage=cuda` prints.
Expected<std::vector<LoweredGroup>> lowerFunction(const ir::Function& f, const ir::SymbolBindings& symbols);

// The concrete shape of a type under symbol values (bounded dims at their bound).
Expected<std::vector<int64_t>> concreteShape(const ir::TensorType& t, const ir::SymbolBindings& symbols);

}  // namespace kiln::codegen
