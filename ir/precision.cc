#include "ir/precision.h"

namespace kiln::ir {

std::string_view gemmPrecision(const Module& m) {
  auto it = m.attrs().find("kiln.train");
  if (it == m.attrs().end() || !it->second.isDict()) return "f32";
  const auto& train = it->second.asDict();
  auto p = train.find("precision");
  return p != train.end() && p->second.isString() ? std::string_view(p->second.asString()) : "f32";
}

bool isGemmPrecision(std::string_view p) { return p == "f32" || p == "bf16" || p == "f32_strict"; }

std::string_view gemmPrecisionNames() { return "f32, bf16, f32_strict"; }

bool allowsTf32(const Op& matmul) {
  if (matmul.operand(0)->type().dtype() != DType::f32 || matmul.operand(1)->type().dtype() != DType::f32 ||
      matmul.strAttr("kiln.precision") == "f32")
    return false;
  const Function* f = matmul.parentFunction();
  const Module* m = f ? f->parentModule() : nullptr;
  return !m || gemmPrecision(*m) != "f32_strict";
}

}  // namespace kiln::ir
