#include "ir/ops/kernel_util.h"

#include <algorithm>

namespace kiln::ir::kernels {

double loadAsDouble(const TensorView& v, int64_t i) {
  switch (v.dtype) {
    case DType::f32:
      return static_cast<const float*>(v.data)[i];
    case DType::f64:
      return static_cast<const double*>(v.data)[i];
    case DType::bf16:
      return bf16ToFloat(static_cast<const uint16_t*>(v.data)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(v.data)[i];
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(v.data)[i]);
    case DType::i1:
      return static_cast<const uint8_t*>(v.data)[i] != 0;
    default:
      assert(false && "loadAsDouble: unsupported dtype");
      return 0;
  }
}

std::vector<int64_t> broadcastStrides(const std::vector<int64_t>& in, const std::vector<int64_t>& out) {
  std::vector<int64_t> strides(out.size(), 0);
  std::vector<int64_t> own = rowMajorStrides(in);
  const size_t lead = out.size() - in.size();
  for (size_t i = 0; i < in.size(); ++i)
    if (in[i] != 1 || out[lead + i] == 1) strides[lead + i] = own[i];
  return strides;
}

std::string shapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string indexString(const std::vector<int64_t>& shape, int64_t i) {
  std::vector<int64_t> idx(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    const int64_t n = shape[static_cast<size_t>(d)];
    idx[static_cast<size_t>(d)] = n ? i % n : 0;
    i = n ? i / n : 0;
  }
  return shapeString(idx);
}

Expected<std::vector<int64_t>> broadcastRuntime(const Op& op, const std::vector<int64_t>& a,
                                                const std::vector<int64_t>& b) {
  const size_t n = std::max(a.size(), b.size());
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      return Status::errorf("'{}': run-time shapes {} and {} do not broadcast", op.name(), shapeString(a),
                            shapeString(b));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Status setResultShape(const Op& op, TensorView& result, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (shape.size() != result.shape.size() || n > result.numel())
    return Status::errorf("'{}': run-time result shape {} does not fit its buffer {}", op.name(),
                          shapeString(shape), shapeString(result.shape));
  result.shape = std::move(shape);
  return Status::ok();
}

double typeElements(const TensorType& t, const SymbolBindings& symbols) {
  auto n = t.numElements(symbols);
  return n ? static_cast<double>(*n) : 0.0;
}

double typeBytes(const TensorType& t, const SymbolBindings& symbols) {
  return typeElements(t, symbols) * static_cast<double>(dtypeBytes(t.dtype()));
}

double operandAndResultBytes(const Op& op, const SymbolBindings& symbols) {
  double bytes = 0;
  for (Value* v : op.operands()) bytes += typeBytes(v->type(), symbols);
  for (Value* v : op.results()) bytes += typeBytes(v->type(), symbols);
  return bytes;
}

OpCost elementwiseCost(const Op& op, const SymbolBindings& symbols, double flops_per_element) {
  double elements = 0;
  for (Value* v : op.results()) elements += typeElements(v->type(), symbols);
  return {elements * flops_per_element, operandAndResultBytes(op, symbols)};
}

}  // namespace kiln::ir::kernels
