#include "ir/scalar_fn.h"

namespace kiln::ir {

bool ScalarFnInfo::isPredicate() const {
  return kind == ScalarFnKind::Compare || fn == ScalarFn::Not || fn == ScalarFn::And || fn == ScalarFn::Or;
}

const std::vector<ScalarFnInfo>& scalarFns() {
  using K = ScalarFnKind;
  using D = ScalarDomain;
  static const std::vector<ScalarFnInfo> fns = {
#define KILN_UNARY(Name, spelling, flops, domain, body) \
  {ScalarFn::Name, #Name, spelling, K::Unary, 1, D::domain, flops, false, #body, std::nullopt},
#define KILN_ACTIVATION(Name, spelling, flops, body, derivative)                \
  {ScalarFn::Name, #Name, spelling, K::Activation, 1,                           \
   D::Float,       flops, false,    #body,         ScalarFn::Name##Derivative}, \
      {ScalarFn::Name##Derivative,                                              \
       #Name "Derivative",                                                      \
       spelling "_derivative",                                                  \
       K::Derivative,                                                           \
       1,                                                                       \
       D::Float,                                                                \
       flops,                                                                   \
       false,                                                                   \
       #derivative,                                                             \
       ScalarFn::Name},
#define KILN_BINARY(Name, spelling, flops, domain, commutative, body) \
  {ScalarFn::Name, #Name, spelling, K::Binary, 2, D::domain, flops, commutative, #body, std::nullopt},
#define KILN_COMPARE(Name, spelling, body) \
  {ScalarFn::Name, #Name, spelling, K::Compare, 2, D::Any, 1, false, #body, std::nullopt},
#define KILN_KERNEL_UNARY(Name, spelling, body) \
  {ScalarFn::Name, #Name, spelling, K::KernelUnary, 1, D::Any, 1, false, #body, std::nullopt},
#define KILN_KERNEL_BINARY(Name, spelling, body) \
  {ScalarFn::Name, #Name, spelling, K::KernelBinary, 2, D::Any, 1, false, #body, std::nullopt},
#include "ir/scalar_fn.def"
  };
  return fns;
}

const ScalarFnInfo& scalarFnInfo(ScalarFn f) { return scalarFns()[static_cast<size_t>(f)]; }

std::optional<ScalarFn> findScalarFn(ScalarFnKind kind, std::string_view spelling) {
  for (const ScalarFnInfo& i : scalarFns())
    if (i.kind == kind && i.spelling == spelling) return i.fn;
  return std::nullopt;
}

const std::vector<CombinerInfo>& combiners() {
  static const std::vector<CombinerInfo> cs = {
#define KILN_COMBINER(Name, spelling, combine, body) \
  {Combiner::Name, #Name, spelling, ScalarFn::combine, #body},
#include "ir/scalar_fn.def"
  };
  return cs;
}

const CombinerInfo& combinerInfo(Combiner c) { return combiners()[static_cast<size_t>(c)]; }

}  // namespace kiln::ir
