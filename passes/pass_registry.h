// What a pass file includes to pick up its passes.def entry:
//   class CSEPass : public RegisteredPass<CSEPass> { public: KILN_PASS_INFO(CSEPass) ... };
// gives the class kName and kDescription as written in passes.def.
#pragma once

#include <string_view>

#include "passes/pass.h"

namespace kiln::passes::detail {

// The passes.def entry of a class, looked up by the class name at compile time.
template <typename Tag>
struct PassInfoOf;

#define KILN_PASS(NAME, CLASS, DESCRIPTION) class CLASS;
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
}  // namespace kiln::passes::detail
namespace kiln::passes {
#include "passes/passes.def"
}  // namespace kiln::passes
namespace kiln::passes::detail {
#undef KILN_PASS
#define KILN_PASS(NAME, CLASS, DESCRIPTION)                           \
  template <>                                                         \
  struct PassInfoOf<::kiln::passes::CLASS> {                          \
    static constexpr std::string_view name = NAME;                    \
    static constexpr std::string_view description = DESCRIPTION;     \
  };
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_ORDER

}  // namespace kiln::passes::detail

#define KILN_PASS_INFO(CLASS)                                                              \
  static constexpr std::string_view kName = ::kiln::passes::detail::PassInfoOf<CLASS>::name; \
  static constexpr std::string_view kDescription =                                         \
      ::kiln::passes::detail::PassInfoOf<CLASS>::description;
