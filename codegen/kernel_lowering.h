// Lowering IR ops to kernel IR: the public entry points of the CUDA lowering.
//
// A group is a list of ops of one block, in order, that becomes one unit of GPU work. The
// emitters of codegen/emit/, one file per kind, lower it; the EmitterRegistry
// (codegen/emit/emitter_registry.h) says which, from the ops each emitter file registers:
//   - pointwise.cc: elementwise and data-movement ops (broadcast, reshape, transpose, slice,
//     concat, gather, cast, activation_grad, ...) of one output shape: ONE Pointwise kernel;
//     values that leave the group are stored, the rest stay in registers;
//   - reduction.cc, softmax_loss.cc: a reduction or softmax, optionally fed by such a chain (the
//     chain is computed inline); losses and softmax cross-entropy's gradient;
//   - embedding_lookup.cc: every embedding_bag over sources (per stream): ONE EmbeddingForward
//     kernel; jagged bags (ids[N] + lengths[B]) first get their offsets from ONE BagOffsets scan
//     kernel;
//   - embedding_update.cc: embedding_bag_updates: (a scan for jagged ids,) a radix sort of the
//     ids of every table, their segments, and one launch per optimizer summing each distinct
//     id's gradient rows and stepping that row;
//   - optimizer.cc: every dense optimizer update of a group (groupOps gathers a stream's): one
//     multi-tensor launch per configuration;
//   - gemm.cc: a matmul: no kernel (cuBLASLt runs it); lowerGroup returns it with `gemm` set;
//   - scatter.cc: a scatter_add: a copy of the base, then one atomic add per update.
// groupOps() forms groups greedily over ops the fusion pass left alone. lowerFunction takes the
// fusion pass's `kiln.fused` ops as they are: each becomes one group (a pointwise or reduction
// kernel, ONE cuBLASLt call with its epilogue, one lookup kernel writing the concatenated rows,
// the sorted backward of every table reading the concatenated gradient), or, where the backend
// cannot run it as one unit, is split by groupOps with the reason recorded.
// These entry points live in codegen/emit/lower_groups.cc; codegen/cuda_program.h builds the
// Program that runs the lowered groups. See docs/cuda.md.
#pragma once

#include <string>
#include <vector>

#include "codegen/kernel_ir.h"
#include "ir/ir.h"
#include "ir/target.h"

namespace kiln::codegen {

// A buffer the kernels of a group read or write: an IR value, or a temporary of the group.
// Values inside a kiln.fused region stand for values outside it: a block argument for the fused
// op's operand, a yielded value for the fused op's result. Buffers always hold the outer value.
// One i64 word of an address table: `value`, plus the device address of group buffer `buffer`
// when buffer >= 0 (then `value` is a byte offset into it).
struct AddressWord {
  int buffer = -1;
  int64_t value = 0;
};

struct GroupBuffer {
  const ir::Value* value = nullptr;  // null for a temporary; never a value inside a fused region
                                     // that the region's op passes in or yields (see outerValue)
  std::string name;
  DType dtype = DType::f32;
  int64_t elements = 0;
  bool written = false;
  bool defined = false;  // an op of the group computes this value (it is not an input)
  // Non-empty: an address table (i64, one element per word), written once by the runtime when
  // the buffers are placed, outside the arena. Kernels read per-table data (a table's ids and
  // gradient addresses, dims, offsets) from it instead of taking one parameter per buffer.
  std::vector<AddressWord> words;
};

// The words of address table `table` once every group buffer is placed: address[i] is where
// group buffer i lives.
std::vector<int64_t> addressTableWords(const GroupBuffer& table, const std::vector<uint64_t>& address);

// One cuBLASLt call: C = epilogue(op(A) op(B) + bias), or C = op(A) op(B) with a bias gradient
// written beside it. Fields are indices into LoweredGroup::buffers; `bias` is -1 without one.
struct GemmCall {
  int a = -1, b = -1, c = -1, bias = -1;
  std::string activation;  // "", "relu" or "gelu" (cuBLASLt's GELU is the tanh form, as ours)
  // 'a' or 'b': `bias` is written, the sum over K of op(A) or op(B) (a kiln.sum_to of the group
  // folding the leading dim of that operand); 0: `bias`, if any, is read.
  char bias_gradient_of = 0;
  // The activation backward through cuBLASLt's aux buffer (cuda_program.h, Epilogue):
  // `activation_grad` "relu" or "gelu": C is the product times that activation's derivative, at
  // the ReLU mask in the buffer of group buffer `aux` (the forward ReLU's output) or at the GELU
  // input `aux`. `writes_relu_mask`: the group's ReLU is the operand of such a GEMM, so its output
  // C also carries the mask (its op has attribute kiln.relu_mask, set by the fusion pass).
  std::string activation_grad;
  int aux = -1;
  bool writes_relu_mask = false;
  // A matrix added before the activation (cuBLASLt's C, beta = 1), in C's type and shape.
  int residual = -1;
};

// What the `table` word of a group's error flag (Kernel::error_flag) names: an embedding table
// (code 1: an id out of range [0, bound)) or a jagged bag's lengths (code 2: negative, or more
// than the `bound` ids). One list per group, so every kernel sharing the flag numbers alike.
struct ErrorSubject {
  std::string name;   // the table's (or lengths') IR value name
  int64_t bound = 0;  // rows, or the ids the lengths may cover
  int kernel = -1;    // the group's kernel that checks it
};

struct LoweredGroup {
  std::vector<const ir::Op*> ops;
  const ir::Op* gemm = nullptr;  // a matmul, run by cuBLASLt (with `gemm_call`): no kernels
  GemmCall gemm_call;
  std::vector<GroupBuffer> buffers;
  std::vector<Kernel> kernels;
  // args[k][j]: the group buffer bound to buffer j of kernels[k].
  std::vector<std::vector<int>> args;
  // Indexed by the error flag's `table` word (EmbeddingTable::flag_index).
  std::vector<ErrorSubject> error_subjects;
  // Where the group came from: the `kind` of its kiln.fused op and that op's number among the
  // function's fused ops ("" and -1 for ops the fusion pass left alone). A fused op the backend
  // cannot run as one unit becomes several groups sharing fused_index, each with the reason.
  std::string fused_kind;
  int fused_index = -1;
  std::string split_reason;
  // The stream the schedule pass put the group on (`kiln.stream` of its fused op or its ops;
  // 0 without one). groupOps never mixes streams in one group.
  int stream = 0;
};

// The `kiln.stream` of an op (0 when absent).
int streamOf(const ir::Op& op);

// The value outside every kiln.fused region that `v` stands for (v itself for a value of the
// function's body, or an op result inside a region that is not yielded).
const ir::Value* outerValue(const ir::Value* v);

// Ops that need no GPU work of their own: sources (inputs, parameters, constants) and
// terminators (the registry marks them so).
bool isSourceOrTerminator(const ir::Op& op);
// Ops that lower into a Pointwise kernel's expressions: those with an expression rule in the
// EmitterRegistry.
bool isPointwiseOp(const ir::Op& op);

// Splits the ops of a block (sources and terminators skipped) into groups in execution order. A
// kiln.fused op is a group of its own. A stream's dense optimizer updates wait and form one group,
// placed before the first op that reads or writes a parameter or state they update, else last.
std::vector<std::vector<const ir::Op*>> groupOps(const std::vector<const ir::Op*>& ops);

// Lowers one group under concrete symbol values. Errors name the op and say what the CUDA
// backend does not support. The kernels' grids, and the pieces a long fold is cut into, are
// sized for `target`'s SMs (gridSms: the H200's unless it is a GPU), so a step lowered for one
// GPU runs on any (grid-stride loops) but fills that one's SMs in whole waves.
Expected<LoweredGroup> lowerGroup(const std::vector<const ir::Op*>& ops, const ir::SymbolBindings& symbols,
                                  const Target& target = h200Target());

// Lowers the ops of one kiln.fused op (its region's ops, the yield excluded) as one unit of the
// given kind; an error says why the backend cannot (the caller then splits the group).
Expected<LoweredGroup> lowerFusedGroup(const std::string& kind, const std::vector<const ir::Op*>& ops,
                                       const ir::SymbolBindings& symbols,
                                       const Target& target = h200Target());

// Every group of a function, lowered, in execution order: what `kiln dump --stage=cuda` prints
// and the CUDA executor runs. Top-level kiln.fused ops are consumed as described above.
Expected<std::vector<LoweredGroup>> lowerFunction(const ir::Function& f, const ir::SymbolBindings& symbols,
                                                  const Target& target = h200Target());

// The concrete shape of a type under symbol values (bounded dims at their bound).
Expected<std::vector<int64_t>> concreteShape(const ir::TensorType& t, const ir::SymbolBindings& symbols);

}  // namespace kiln::codegen
