// Which emitter lowers what, as runtime/cpu/kernels/registry.cc says which CPU kernel runs an
// op. Each emitter file of codegen/emit/ registers, once, the ops and fused-group kinds it
// lowers; lowerGroup / lowerFusedGroup (kernel_lowering.h) look them up here:
//   - expression rules: ops computed inline, inside a kernel's expressions (elementwise math and
//     data movement): a group of only such ops is ONE Pointwise kernel (the pointwise chain
//     emitter), and a reduction's producers are computed inline through them;
//   - op emitters: the kernels (or cuBLASLt call) of a group ending in the op;
//   - fused emitters: a kiln.fused op's region as one unit of its `kind`;
//   - no-kernel marks: ops that the CUDA backend runs without a kernel of their own (sources
//     bound to buffers, terminators) or knowingly does not lower yet, each with its reason.
// tests/nvrtc/emitter_registry_test.cc fails for an op of the op table that has none of these.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "codegen/emit/group_lowering.h"

namespace kiln::codegen::emit {

// Whether an entry handles this op instance (its attributes); null: every instance.
using SupportsFn = bool (*)(const ir::Op& op);

// Where an expression rule computes its op's result.
struct ExprSite {
  const ir::Value* value;             // the op's result
  const std::vector<int>& coords;     // one node per dim of value
  const std::vector<int64_t>& shape;  // value's concrete shape
};
// The node of the op's result at site.coords (operands through gl.operandAt / gl.valueAt).
using ExpressionRule = std::function<Expected<int>(GroupLowering& gl, KernelBuilder& kb, const ir::Op& op,
                                                   const ExprSite& site)>;

// Lowers a group (gl.ops()) ending in the emitter's op, or a fused region.
using GroupEmitterFn = Status (*)(GroupLowering& gl, const std::vector<const ir::Op*>& ops);
// Lowers a group of only expression-rule ops.
using ChainEmitterFn = Status (*)(GroupLowering& gl);

// What an op emitter accepts before its op in one group.
enum class GroupForm {
  kAlone,            // the op by itself
  kPointwiseInputs,  // pointwise producers, computed inline (they may not escape the group)
  kManyOfTheOp,      // any number of the op (one kernel serves them all: embedding lookups)
};

struct OpEmitter {
  std::string emitter;  // the file's kind, for the registry test: "reduction"
  GroupEmitterFn lower = nullptr;
  GroupForm form = GroupForm::kAlone;
  SupportsFn supports = nullptr;
};

// Why an op needs no emitter.
enum class NoKernel {
  kNone,         // it has an expression rule or an op emitter
  kRunsWithout,  // sources bound to buffers, terminators, fused ops (their kind's emitter)
  kNotLowered,   // no CUDA lowering yet: a group holding it fails ("has no CUDA lowering")
};

class EmitterRegistry {
 public:
  static const EmitterRegistry& get();

  void addExpression(ir::OpCode op, ExpressionRule rule, SupportsFn supports = nullptr);
  void addOpEmitter(ir::OpCode op, OpEmitter emitter);
  void addFusedEmitter(std::string_view kind, GroupEmitterFn lower);
  // The one pointwise-chain emitter: a group of only expression-rule ops.
  void setPointwiseChain(ChainEmitterFn lower);
  void addNoKernel(ir::OpCode op, NoKernel why, std::string reason);

  // Lookups for an op instance; null when none handles it.
  const ExpressionRule* expressionFor(const ir::Op& op) const;
  const OpEmitter* emitterFor(const ir::Op& op) const;
  GroupEmitterFn fusedEmitter(std::string_view kind) const;
  ChainEmitterFn pointwiseChain() const { return pointwise_chain_; }

  // For the registry test: the emitters registered for an op ("pointwise", "reduction", ...;
  // "expression" for an expression rule), and its no-kernel mark.
  std::vector<std::string> loweringsOf(ir::OpCode op) const;
  NoKernel noKernel(ir::OpCode op, std::string* reason = nullptr) const;
  // Every op the registry mentions (lowerings and marks).
  std::vector<ir::OpCode> registeredOps() const;
  std::vector<std::string> fusedKinds() const;

 private:
  EmitterRegistry();
  struct Expression {
    ExpressionRule rule;
    SupportsFn supports;
  };
  struct Mark {
    NoKernel why;
    std::string reason;
  };
  std::multimap<ir::OpCode, Expression> expressions_;
  std::multimap<ir::OpCode, OpEmitter> emitters_;
  std::map<std::string, GroupEmitterFn, std::less<>> fused_;
  std::map<ir::OpCode, Mark> no_kernel_;
  ChainEmitterFn pointwise_chain_ = nullptr;
};

// Lowers gl's ops as one group: the registry's emitter for the last op, or the pointwise chain
// (what the "pointwise" and "reduction" fused kinds run too).
Status lowerOps(GroupLowering& gl);

// Registration, one function per emitter file; EmitterRegistry's constructor calls them all.
void registerPointwiseEmitters(EmitterRegistry& r);    // pointwise.cc: expression rules, the chain
void registerReductionEmitters(EmitterRegistry& r);    // reduction.cc: reduce, sum_to, max's gradient
void registerSoftmaxLossEmitters(EmitterRegistry& r);  // softmax_loss.cc: softmax, losses, CE gradient
void registerEmbeddingLookupEmitters(
    EmitterRegistry& r);  // embedding_lookup.cc: bags, bags + concat, weight grad
void registerEmbeddingUpdateEmitters(EmitterRegistry& r);  // embedding_update.cc: sparse updates, grad norm
void registerOptimizerEmitters(EmitterRegistry& r);        // optimizer.cc: dense optimizer_update
void registerScatterEmitters(EmitterRegistry& r);          // scatter.cc: scatter_add
void registerGemmEmitters(EmitterRegistry& r);             // gemm.cc: matmul (+ epilogue) on cuBLASLt
void registerMoeEmitters(EmitterRegistry& r);              // moe.cc: routing, dispatch, grouped GEMMs
void registerRandomStateEmitters(EmitterRegistry& r);      // random_state.cc: dropout, crosses, running state
void registerNoKernelOps(EmitterRegistry& r);              // emitter_registry.cc: sources, terminators, gaps

}  // namespace kiln::codegen::emit
