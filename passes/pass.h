// A pass: one transformation of a Module, with a name and a one-line description. run()
// returns whether it changed anything, or an error located at the op it could not handle.
// Every pass is listed once in passes.def, with the options it takes; the PassManager
// (pass_manager.h) builds pipelines from those names. A pass is built for one target with its
// options (`remat{budget=60%}`), as MLIR passes take options and XLA's passes a
// DeviceDescription, and keeps them for every run.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"

namespace kiln::passes {

class Pass {
 public:
  virtual ~Pass() = default;
  // The name used on the command line (`--passes=cse`) and in dump file names.
  virtual std::string_view name() const = 0;
  virtual std::string_view description() const = 0;
  virtual Expected<bool> run(ir::Module& m) = 0;
};

// What every pass of a pipeline is built with: the target its cost model plans for.
struct PassContext {
  Target target = cpuTarget();
};

// The options one pass is built with, name=value as the pipeline's text gave them
// (`remat{budget=60%}`). createPass fills in the declared defaults, so a pass's factory finds
// every option its passes.def entry declares.
class PassOptions {
 public:
  // Sets `name`, replacing an earlier value.
  void set(std::string name, std::string value);
  bool has(std::string_view name) const;
  // The value of `name`; "" when it is not set.
  const std::string& get(std::string_view name) const;
  const std::vector<std::pair<std::string, std::string>>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }
  // "budget=60% other='a b'", as the pipeline's text reads them (values quoted where needed).
  std::string str() const;

 private:
  std::vector<std::pair<std::string, std::string>> entries_;
};

// An option a pass declares in passes.def.
struct PassOptionInfo {
  std::string_view name;
  std::string_view default_value;
  std::string_view description;
};

using PassFactory = Expected<std::unique_ptr<Pass>> (*)(const PassContext&, const PassOptions&);

// The passes of passes.def, in the order listed there.
struct PassInfo {
  std::string_view name;
  std::string_view description;
  PassFactory create;
  std::vector<PassOptionInfo> options;
};
const std::vector<PassInfo>& registeredPasses();
// nullptr for a name that is not in passes.def.
const PassInfo* findPass(std::string_view name);
// "shape-inference, canonicalize, ...": the registered names, for error messages.
std::string knownPassNames();
// Creates a registered pass for `context` with `options`. Errors: an unknown pass (listing the
// known ones), an option the pass does not declare (listing those it does), a value the pass
// rejects.
Expected<std::unique_ptr<Pass>> createPass(std::string_view name, const PassContext& context,
                                           const PassOptions& options = {});
// The same with the default context and options; nullptr for a name that is not in passes.def.
std::unique_ptr<Pass> createPass(std::string_view name);

// The ordering rules of passes.def: `first` must not run after `then` in one pipeline.
struct PassOrdering {
  std::string_view first, then, reason;
};
const std::vector<PassOrdering>& registeredOrderings();

// Each pass file defines its factory, declared here from passes.def.
#define KILN_PASS(NAME, CLASS, DESCRIPTION) \
  Expected<std::unique_ptr<Pass>> create##CLASS(const PassContext& context, const PassOptions& options);
#define KILN_PASS_OPTION(PASS, NAME, DEFAULT, DESCRIPTION)
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_OPTION
#undef KILN_PASS_ORDER

// A pass whose name and description come from its passes.def entry; pass classes derive from
// this so that the name is written once.
template <typename Self>
class RegisteredPass : public Pass {
 public:
  std::string_view name() const override { return Self::kName; }
  std::string_view description() const override { return Self::kDescription; }
};

// A factory's result: `return makePass<CSEPass>();`.
template <typename P, typename... Args>
Expected<std::unique_ptr<Pass>> makePass(Args&&... args) {
  return std::unique_ptr<Pass>(std::make_unique<P>(std::forward<Args>(args)...));
}

}  // namespace kiln::passes
