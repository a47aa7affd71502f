// What a pass file includes to pick up its passes.def entry:
//   class CSEPass : public RegisteredPass<CSEPass> { public: KILN_PASS_INFO(CSEPass) ... };
// gives the class kName and kDescription as written in passes.def, so they are written once.
#pragma once

#include <string_view>

#include "passes/pass.h"

// Every pass class, declared from passes.def.
namespace kiln::passes {
#define KILN_PASS(NAME, CLASS, DESCRIPTION) class CLASS;
#define KILN_PASS_OPTION(PASS, NAME, DEFAULT, DESCRIPTION)
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_OPTION
#undef KILN_PASS_ORDER
}  // namespace kiln::passes

namespace kiln::passes::detail {

// The passes.def entry of a pass class, found by the class at compile time.
template <typename PassClass>
struct PassInfoOf;

#define KILN_PASS(NAME, CLASS, DESCRIPTION)                      \
  template <>                                                    \
  struct PassInfoOf<::kiln::passes::CLASS> {                     \
    static constexpr std::string_view name = NAME;               \
    static constexpr std::string_view description = DESCRIPTION; \
  };
#define KILN_PASS_OPTION(PASS, NAME, DEFAULT, DESCRIPTION)
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_OPTION
#undef KILN_PASS_ORDER

}  // namespace kiln::passes::detail

#define KILN_PASS_INFO(CLASS)                                                                \
  static constexpr std::string_view kName = ::kiln::passes::detail::PassInfoOf<CLASS>::name; \
  static constexpr std::string_view kDescription = ::kiln::passes::detail::PassInfoOf<CLASS>::description;
