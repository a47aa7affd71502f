// The scatter emitter: kiln.scatter_add (gather's adjoint) as a copy of the base, then one
// atomic add per update.
#include "codegen/emit/emitter_registry.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// result = base, then result[..., indices[j], ...] += updates[..., j, ...] with atomic adds.
// Atomics rather than a deterministic owner-computes kernel (each output element searching the
// indices for its updates): that costs O(outputs x indices), atomics O(updates). The order of
// additions only matters where indices repeat; DLRM's interaction pairs are distinct, so its
// backward is exact. Out-of-range indices add nothing (the CPU reference reports them).
Status lowerScatterAdd(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* base = op.operand(0);
  const Value* idx = op.operand(1);
  const Value* upd = op.operand(2);
  auto bs = gl.shapeOf(base);
  auto is = gl.shapeOf(idx);
  auto us = gl.shapeOf(upd);
  if (!bs || !is || !us) return !bs ? bs.status() : !is ? is.status() : us.status();
  DType t = op.result()->type().dtype();
  if (t == DType::i1)
    return Status::errorf("{} on the CUDA backend needs numeric values, not i1", opLabel(op));
  int64_t axis = op.intAttr("axis");
  if (axis < 0) axis += static_cast<int64_t>(bs->size());
  int out = gl.groupBuffer(op.result(), true);
  {
    KernelBuilder kb = KernelBuilder::pointwise("scatter_add_init", *bs);
    ExprGraph& g = kb.g();
    std::vector<int> coords = kb.spaceCoords();
    auto x = gl.valueAt(kb, base, coords);  // a splat zero base is a constant: the output is zeroed
    if (!x) return x.status();
    kb.k.stores.push_back({gl.bind(kb, out, true), rowMajorOffset(g, coords, *bs), g.cast(*x, t), -1});
    KILN_RETURN_IF_ERROR(gl.finish(kb));
  }
  KernelBuilder kb = KernelBuilder::pointwise("scatter_add", *us);
  ExprGraph& g = kb.g();
  std::vector<int> coords = kb.spaceCoords();
  const size_t a = static_cast<size_t>(axis), ri = is->size();
  KILN_ASSIGN_OR_RETURN(auto iv, gl.valueAt(kb, idx,
                                            std::vector<int>(coords.begin() + static_cast<int64_t>(a),
                                                             coords.begin() + static_cast<int64_t>(a + ri))));
  int id = g.cast(iv, DType::i64);
  int ok = g.binary(ExprOp::And, g.binary(ExprOp::Ge, id, g.intConstant(0)),
                    g.binary(ExprOp::Lt, id, g.intConstant((*bs)[a])));
  std::vector<int> oc(coords.begin(), coords.begin() + static_cast<int64_t>(a));
  oc.push_back(id);
  oc.insert(oc.end(), coords.begin() + static_cast<int64_t>(a + ri), coords.end());
  KILN_ASSIGN_OR_RETURN(auto v, gl.valueAt(kb, upd, coords));
  Store st{gl.bind(kb, out, true), rowMajorOffset(g, oc, *bs), g.cast(v, t), ok};
  st.accumulate = true;
  kb.k.stores.push_back(st);
  return gl.finish(kb);
}

}  // namespace

void registerScatterEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::ScatterAdd, {"scatter", lowerScatterAdd});
}

}  // namespace kiln::codegen::emit
