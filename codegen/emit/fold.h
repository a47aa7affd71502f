// Folds (codegen/emit/reduction.cc): an element expression summed or maximized over some dims of
// a shape into a value of the kept dims, in the form the shapes call for (docs/cuda.md,
// "Reductions"): ColumnReduce kernels when the folded dims lead (a bias gradient, a whole
// tensor), else Row kernels; a long fold into few outputs is cut into pieces whose partials a
// second kernel folds in order, so no fold is one block over 100M elements and every fold gives
// the same bits every run. The reductions and the losses (softmax_loss.cc) share it.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "codegen/emit/group_lowering.h"

namespace kiln::codegen::emit {

// A fold over the dims of `xs` marked `folded` into `out`, which is the kept dims in order
// (size-1 dims may be dropped or kept: the flat index is the same). out = cast(combiner over the
// folded elements, times `scale` when it is not 1).
struct Fold {
  std::string name;
  std::vector<int64_t> xs;
  std::vector<bool> folded;  // per dim of xs
  Combiner combiner = Combiner::Sum;
  double scale = 1;
  const ir::Value* out = nullptr;
  // The element at coordinates `coords` (node ids, one per dim of xs) in kernel `kb`, f32 or
  // f64: a value of the group (GroupLowering::valueAt) or any expression of such values.
  using Element = std::function<Expected<int>(KernelBuilder& kb, const std::vector<int>& coords)>;
  Element element;

  std::vector<int64_t> keptDims(bool drop_ones) const;
  std::vector<int64_t> foldedDims(bool drop_ones) const;
  // The folded dims all come before the kept ones (size-1 dims aside).
  bool foldsLeadingDims() const;
};

Status lowerFold(GroupLowering& gl, const Fold& f);

}  // namespace kiln::codegen::emit
