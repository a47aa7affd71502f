// Runs a pipeline of named passes over a Module, as mlir-opt and XLA's HloPassPipeline do:
// the verifier between passes (an error names the pass that broke the IR), IR printed after
// chosen passes, every stage dumped to numbered files, and per-pass timing.
//
//   PassManager pm;
//   pm.options().print_ir_after_all = true;
//   KILN_RETURN_IF_ERROR(pm.addPipeline("canonicalize,cse,dce"));
//   KILN_RETURN_IF_ERROR(pm.run(module));
#pragma once

#include <iosfwd>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "passes/pass.h"

namespace kiln::passes {

struct PassManagerOptions {
  // Passes dropped from the pipeline (`--disable-pass=NAME`, repeatable).
  std::set<std::string, std::less<>> disabled;
  // Print the module after these passes (`--print-ir-after=NAME`) or after all of them.
  std::set<std::string, std::less<>> print_ir_after;
  bool print_ir_after_all = false;
  // When set, write 0000.input.mlir, then NNNN.<pass>.mlir after each pass, into this folder.
  std::string dump_dir;
  // Print a table of the time of each pass.
  bool timing = false;
  // Run the verifier on the input and after every pass.
  bool verify_each = true;
  // Where printed IR and the timing table go; nullptr means std::cerr, as mlir-opt does.
  std::ostream* log = nullptr;
};

class PassManager {
 public:
  // Starts with the ordering rules of passes.def.
  PassManager();

  PassManagerOptions& options() { return options_; }
  const PassManagerOptions& options() const { return options_; }

  // Appends a registered pass; an unknown name is an error that lists the known ones.
  Status addPass(std::string_view name);
  // Appends a pass object (tests, passes built with parameters).
  void addPass(std::unique_ptr<Pass> pass);
  // Appends the comma-separated passes of `--passes=a,b,c` ("" adds nothing).
  Status addPipeline(std::string_view comma_separated);

  // Declares that `first` must not run after `then` in this pipeline; checked by build().
  void requireBefore(std::string first, std::string then, std::string reason = "");

  // Checks the pipeline once it is complete: disabled names exist, ordering rules hold.
  Status build() const;
  // The names of the passes that run (after --disable-pass), in order.
  std::vector<std::string> pipeline() const;

  // build(), then verifies the input, runs each pass, verifies after it, prints and dumps.
  // Returns whether any pass changed the module.
  Expected<bool> run(ir::Module& m);

 private:
  struct Ordering {
    std::string first, then, reason;
  };
  std::ostream& log() const;
  bool enabled(const Pass& p) const;

  PassManagerOptions options_;
  std::vector<std::unique_ptr<Pass>> passes_;
  std::vector<Ordering> orderings_;
};

}  // namespace kiln::passes
