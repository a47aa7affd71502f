// Fusion: groups ops of a function into `kiln.fused` ops (attribute `kind`) whose region holds
// the ops that run as one kernel:
//   pointwise        elementwise and data-movement ops of one result shape;
//   reduction        a reduction (reduce, softmax, bce_with_logits, sum_to) with its pointwise
//                    producers computed inline (they must not be used outside the group);
//   gemm_epilogue    matmul + bias add + activation (+ cast): one cuBLASLt call with an epilogue,
//                    which may also add a matrix of the product's type before the activation
//                    (cuBLASLt's C with beta = 1: a residual, or the sum of two products);
//                    or a weight-gradient matmul and the sum_to of its gradient operand beside
//                    it (the bias gradient; cuBLASLt's BGRADA/BGRADB epilogue); or matmul +
//                    activation_grad of relu or gelu (cuBLASLt's DRELU/DGELU: the product is
//                    the gradient it scales; a ReLU's mask comes from its forward GEMM, whose
//                    relu op gets attribute kiln.relu_mask);
//   embedding        every fixed-hotness embedding_bag of a collection feeding one concat, and
//                    the concat: one lookup kernel writing the concatenated rows;
//   embedding_update the slices of one concatenated gradient and the embedding_bag_update ops
//                    they feed: the backward of the above, one kernel.
// Legality rules return a FusionDecision with its reason; the shared cost model (cost_model.h)
// decides profitability. A group runs where its last op was, so a fusion that would grow the
// live bytes at an op it moves past is refused: fusion never raises the planned peak. The
// report lists each group and each refused (producer, consumer) pair.
#pragma once

#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "passes/cost_model.h"

namespace kiln::passes {

// Whether a transform may happen, and if not, why (XLA's FusionDecision).
class FusionDecision {
 public:
  static FusionDecision allow() { return FusionDecision(""); }
  static FusionDecision forbid(std::string reason) { return FusionDecision(reason.empty() ? "forbidden" : std::move(reason)); }
  bool allowed() const { return reason_.empty(); }
  explicit operator bool() const { return allowed(); }
  const std::string& reason() const { return reason_; }

 private:
  explicit FusionDecision(std::string r) : reason_(std::move(r)) {}
  std::string reason_;
};

struct FusedGroupReport {
  std::string kind;
  std::vector<std::string> ops;  // "%x = kiln.add", in order
  double saved_bytes = 0;        // memory traffic the group avoids
  int saved_launches = 0;
  double saved_seconds = 0;      // by the cost model
};

struct RefusedFusion {
  std::string producer, consumer, reason;
};

struct FusionReport {
  std::string function;
  int launches_before = 0, launches_after = 0;
  std::vector<FusedGroupReport> groups;
  std::vector<RefusedFusion> refused;
};

struct FusionOptions {
  Target target = cpuTarget();  // whose rates decide what pays (the pass: its PassContext's)
  ir::SymbolBindings symbols;   // empty: the module's planning symbols
};

// Fuses every function of the module; returns one report per function.
Expected<std::vector<FusionReport>> fuseModule(ir::Module& m, const FusionOptions& options = {});

// `kiln dump --explain=fusion`: each group, then each refused pair with its reason.
std::string explainFusion(const std::vector<FusionReport>& reports);

// Kernel launches of a function: every top-level op that does work (a fused group is one).
int countLaunches(const ir::Function& f);

}  // namespace kiln::passes
