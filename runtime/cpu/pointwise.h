// A pointwise fusion group (passes/fusion.h, kind `pointwise`) compiled for the CPU: its
// elementwise ops become the steps of a small register program over f32 values, which the
// executor runs over the data in cache-sized chunks. Each chunk loads its inputs once, runs every
// step as one vectorised loop (AVX-512 where the CPU has it, chosen at run time), and stores only
// the values read after the group; the values that live inside the group never reach memory. The
// group thus makes one pass over its data where op-by-op execution made one per op.
//
// The results are the op-by-op kernels' to the bit: every step computes in f32 as they do, a
// step whose result is bf16 rounds its values to bf16 (round to nearest even) before any later
// step reads them, and this file is compiled without floating-point contraction.
#pragma once

#include <cstdint>
#include <vector>

#include "ir/ir.h"
#include "ir/tensor_view.h"
#include "runtime/cpu/thread_pool.h"

namespace kiln::runtime::cpu {

// Whether an op can be a step: an elementwise op of ir/scalar_fn.def (not a comparison) whose
// operands and result are all f32 or all bf16, an activation_grad likewise, or a cast between
// f32 and bf16.
bool isPointwiseStep(const ir::Op& op);

class PointwiseProgram {
 public:
  // One op of the group, over the program's buffer ids.
  struct OpRef {
    const ir::Op* op = nullptr;
    std::vector<int> operands;
    int result = -1;
    bool stored = false;  // read after the group (or a result of the program): written to memory
  };

  // The ops in order, each isPointwiseStep. An operand that no earlier op of `ops` produces is an
  // input of the program.
  static Expected<PointwiseProgram> compile(const std::vector<OpRef>& ops);

  // The buffers the program reads and writes.
  const std::vector<int>& inputs() const { return inputs_; }
  std::vector<int> storedResults() const;
  int numSteps() const { return static_cast<int>(steps_.size()); }

  // Runs over `views` (indexed by buffer id): reads the inputs' views at their run-time shapes,
  // writes the stored results and sets every result's shape. Returns false, having written
  // nothing, when the run-time shapes of the steps' results differ (data-dependent dims the ops
  // resolve differently): the caller then runs the ops one by one.
  //
  // The memory plan reuses storage at op granularity: a result may share storage with an input
  // that an earlier step (or its own) was the last to read. Element for element (the same
  // offset, dtype and shape) the pass reads each element before it writes it; otherwise the
  // result is written to a spill buffer of the program's and copied over after the pass.
  // Not reentrant: one run at a time.
  Expected<bool> run(std::vector<ir::TensorView>& views, ThreadPool& pool) const;

  // A chunk loop: out[i] = f(a[i], b[i]) for i < n (b unused by a unary step).
  using ChunkFn = void (*)(const float* a, const float* b, float* out, int64_t n);

 private:
  struct Step {
    ChunkFn fn = nullptr;
    int a = -1, b = -1;  // operand slots (b: -1 for unary steps)
    bool broadcasts = false;  // an operand's shape may differ from the result's
    bool round_bf16 = false;  // the result is bf16: round before it is read or stored
    int result = -1;          // buffer id
    bool stored = false;
  };

  std::vector<int> inputs_;  // slot i < inputs_.size() holds input i; step s's result is slot inputs_.size() + s
  std::vector<Step> steps_;
  mutable std::vector<uint8_t> spill_;  // results that would overwrite what the pass still reads
};

}  // namespace kiln::runtime::cpu
