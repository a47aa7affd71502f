#include "passes/pass.h"

namespace kiln::passes {

const std::vector<PassInfo>& registeredPasses() {
  static const std::vector<PassInfo> passes = {
#define KILN_PASS(NAME, CLASS, DESCRIPTION) {NAME, DESCRIPTION, &create##CLASS},
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_ORDER
  };
  return passes;
}

const std::vector<PassOrdering>& registeredOrderings() {
  static const std::vector<PassOrdering> orderings = {
#define KILN_PASS(NAME, CLASS, DESCRIPTION)
#define KILN_PASS_ORDER(FIRST, THEN, REASON) {FIRST, THEN, REASON},
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_ORDER
  };
  return orderings;
}

std::unique_ptr<Pass> createPass(std::string_view name) {
  for (const PassInfo& p : registeredPasses())
    if (p.name == name) return p.create();
  return nullptr;
}

}  // namespace kiln::passes
