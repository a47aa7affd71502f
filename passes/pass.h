// A pass: one transformation of a Module, with a name and a one-line description. run()
// returns whether it changed anything, or an error located at the op it could not handle.
// Every pass is listed once in passes.def; the PassManager (pass_manager.h) builds pipelines
// from those names.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::passes {

class Pass {
 public:
  virtual ~Pass() = default;
  // The name used on the command line (`--passes=cse`) and in dump file names.
  virtual std::string_view name() const = 0;
  virtual std::string_view description() const = 0;
  virtual Expected<bool> run(ir::Module& m) = 0;
};

// The passes of passes.def, in the order listed there.
struct PassInfo {
  std::string_view name;
  std::string_view description;
  std::unique_ptr<Pass> (*create)();
};
const std::vector<PassInfo>& registeredPasses();
// Creates a registered pass by name; nullptr for a name that is not in passes.def.
std::unique_ptr<Pass> createPass(std::string_view name);

// The ordering rules of passes.def: `first` must not run after `then` in one pipeline.
struct PassOrdering {
  std::string_view first, then, reason;
};
const std::vector<PassOrdering>& registeredOrderings();

// Each pass file defines its factory, declared here from passes.def.
#define KILN_PASS(NAME, CLASS, DESCRIPTION) std::unique_ptr<Pass> create##CLASS();
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_ORDER

// A pass whose name and description come from its passes.def entry; pass classes derive from
// this so that the name is written once.
template <typename Self>
class RegisteredPass : public Pass {
 public:
  std::string_view name() const override { return Self::kName; }
  std::string_view description() const override { return Self::kDescription; }
};

}  // namespace kiln::passes
