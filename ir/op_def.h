// The op table. Every op is declared once, as an OpDef registered from its family's file in
// ir/ops/ (elementwise.cc, matmul.cc, ...). Next to the declaration live its shape inference,
// verifier, cost, gradient rule and CPU reference implementation, so adding an op touches one
// place. The printer, parser, verifier, passes and backends all consult this table.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/attribute.h"
#include "ir/ir.h"
#include "ir/opcode.h"
#include "ir/scalar_fn.h"
#include "ir/tensor_view.h"

namespace kiln::ir {

class Builder;
class RankGroup;

// Op traits, a bit set.
enum OpTrait : uint32_t {
  kPure = 1u << 0,          // no side effects: CSE may merge it, DCE may drop it
  kElementwise = 1u << 1,   // result[i] depends on operand[i] only (after broadcasting)
  kBroadcasting = 1u << 2,  // operands broadcast numpy-style
  kCommutative = 1u << 3,   // binary op with f(a, b) == f(b, a)
  kTerminator = 1u << 4,    // ends a block (func.return, kiln.yield)
  kSideEffect = 1u << 5,    // writes state (optimizer updates): never CSE'd or DCE'd
  kReduction = 1u << 6,     // reduces over axes
  kTypeGiven = 1u << 7,     // result types are stated, not inferred (input, parameter, reshape)
  kNonDifferentiable = 1u << 8,  // no gradient flows through (compare, integer ops)
  kSource = 1u << 9,        // produces a value from outside the graph (input, parameter)
};

struct AttrSpec {
  std::string name;
  Attribute::Kind kind;
  bool required = false;
  std::optional<Attribute> default_value;  // applied by the builder when absent
  std::vector<std::string> choices;        // allowed values of a string attribute
};

// Work of one op execution, for the shared cost model.
struct OpCost {
  double flops = 0;
  double bytes = 0;  // bytes read plus bytes written
  // Collectives: bytes this rank sends over its links (ring algorithms); 0 for local ops.
  double comm_bytes = 0;
};

// Autodiff: given gradients of an op's results (nullptr where a result has no gradient), the
// rule builds gradients for its operands at the builder's insertion point.
struct GradContext {
  Builder& builder;
  std::vector<Value*> result_grads;
  std::vector<Value*> operand_grads;  // filled by the rule; nullptr = no gradient
};

// CPU reference execution: operands and results as host tensors. Result buffers are allocated
// by the caller at their (bound) size; a kernel producing a data-dependent dim sets its size.
struct CpuContext {
  const SymbolBindings* symbols = nullptr;
  int num_threads = 1;
  // The ranks a collective op runs over (ir/collective.h); null: a single rank, on which a
  // collective of ranks = 1 is the identity.
  RankGroup* ranks = nullptr;
};

using InferFn = Status (*)(const Op& op, std::vector<TensorType>& result_types);
using VerifyFn = Status (*)(const Op& op);
using CostFn = OpCost (*)(const Op& op, const SymbolBindings& symbols);
using GradFn = Status (*)(GradContext& ctx, const Op& op);
using CpuFn = Status (*)(const Op& op, const std::vector<const TensorView*>& operands,
                         const std::vector<TensorView*>& results, const CpuContext& ctx);
using WrittenFn = std::vector<unsigned> (*)(const Op& op);

struct OpDef {
  std::string name;          // "kiln.matmul"
  OpCode opcode = OpCode::Unknown;  // set by OpRegistry::add from ops.def
  std::string summary;       // one line, for docs and --help
  int min_operands = 0;
  int max_operands = 0;      // -1: variadic
  int num_results = 1;       // -1: variadic (result types given)
  std::vector<AttrSpec> attrs;
  uint32_t traits = 0;
  InferFn infer = nullptr;   // required unless kTypeGiven
  VerifyFn verify = nullptr; // extra checks beyond arity, attributes and inference
  CostFn cost = nullptr;
  GradFn grad = nullptr;
  CpuFn cpu = nullptr;
  // kSideEffect ops: the operands they write in place (the others they only read). Without the
  // hook, every operand counts as written.
  WrittenFn written = nullptr;
  // An elementwise op of scalar_fn.def: the function it applies to each element.
  std::optional<ScalarFn> scalar_fn;

  bool has(uint32_t t) const { return (traits & t) != 0; }
  const AttrSpec* attrSpec(std::string_view n) const;
};

class OpRegistry {
 public:
  static OpRegistry& get();
  // Registers a definition; returns false if the name is taken.
  bool add(OpDef def);
  const OpDef* lookup(std::string_view name) const;
  const OpDef* lookup(OpCode code) const;
  // Mutable access, for later layers that attach a hook to an existing op.
  OpDef* mutableLookup(std::string_view name);
  std::vector<const OpDef*> all() const;

 private:
  OpRegistry();
  std::map<std::string, OpDef, std::less<>> defs_;
  std::vector<const OpDef*> by_code_;  // indexed by OpCode
};

// Each family file defines one of these; OpRegistry's constructor calls them all, so no
// static-initialization order matters and nothing is dropped by the linker.
void registerCoreOps(OpRegistry& r);         // ops/core.cc: constant, input, parameter, func.return, kiln.yield
void registerElementwiseOps(OpRegistry& r);  // ops/elementwise.cc
void registerMatmulOps(OpRegistry& r);       // ops/matmul.cc
void registerShapeOps(OpRegistry& r);        // ops/shape.cc: broadcast, reshape, transpose, concat, slice, gather, cast, sum_to, pad, scatter_add
void registerReduceOps(OpRegistry& r);       // ops/reduce.cc: reduce, softmax, reduce_grad
void registerEmbeddingOps(OpRegistry& r);    // ops/embedding.cc
void registerLossOps(OpRegistry& r);         // ops/loss.cc
void registerOptimizerOps(OpRegistry& r);    // ops/optimizer.cc: optimizer_update, embedding_bag_update
void registerCollectiveOps(
    OpRegistry& r);  // ops/collective.cc: all_reduce, reduce_scatter, all_gather, all_to_all, all_to_all_v
void registerRoutingOps(
    OpRegistry& r);  // ops/routing.cc: topk, take/scatter_along_axis, moe_router, losses, dispatch
void registerExpertOps(
    OpRegistry& r);  // ops/experts.cc: moe_permute, moe_unpermute, moe_row_dot, grouped_matmul
void registerExpertParallelOps(
    OpRegistry& r);  // ops/expert_parallel.cc: moe_route_counts, moe_ep_split, moe_sort_chunks, ...
void registerRandomOps(OpRegistry& r);        // ops/random.cc: dropout, hash_cross
void registerRunningStateOps(OpRegistry& r);  // ops/running_state.cc: running_stat, log_frequency, updates

// The operands `op` writes in place: none for ops without kSideEffect; the op's `written` hook
// (an optimizer update writes its parameter and state, not its gradient or lr); else all.
std::vector<unsigned> writtenOperands(const Op& op);

// Whether `cast` widens the bf16 or f16 result of the kiln.matmul `matmul` to f32 (mixed
// precision's form). Fusion and the CUDA lowering take such a product as the GEMM's f32
// accumulator (see docs/passes.md, gemm_epilogue).
bool isWideningCast(const Op& matmul, const Op& cast);

// Whether one pointwise kernel computes `op` per element of its result: elementwise math and
// data movement (broadcast, reshape, transpose, slice, pad, concat, gather, cast), the backward
// ops that are elementwise in effect, and dropout, hash_cross, running_stat and log_frequency.
// Fusion's pointwise groups and codegen's Pointwise kernels are both this set.
bool isPointwise(const Op& op);

// The scalar function an elementwise op applies: its table entry's, or for kiln.compare the
// function of its predicate; nullopt for other ops.
std::optional<ScalarFn> scalarFnOf(const Op& op);
// The op of a function with an op of its own (ScalarFnInfo::isOp()); Unknown otherwise.
OpCode opCodeOf(ScalarFn fn);

// Shared helpers for rules.
Status expectRank(const Op& op, unsigned operand, int64_t rank);
// Normalizes a possibly negative axis against rank; error if out of range.
Expected<int64_t> normalizeAxis(const Op& op, int64_t axis, int64_t rank);

}  // namespace kiln::ir
