// Runs a pipeline of named passes over a Module, as mlir-opt and XLA's HloPassPipeline do:
// the verifier between passes (an error names the pass that broke the IR), IR printed after
// chosen passes, every stage dumped to numbered files, and per-pass timing.
//
//   PassManager pm({.target = h200Target()});
//   pm.options().print_ir_after_all = true;
//   KILN_RETURN_IF_ERROR(pm.addPipeline("canonicalize,cse,remat{budget=60%},fusion"));
//   KILN_RETURN_IF_ERROR(pm.run(module));
//
// Every pass it creates is built for the manager's PassContext (its target).
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

// One entry of a pipeline's text: a pass name and the options in its braces.
struct PipelineEntry {
  std::string name;
  PassOptions options;
  size_t column = 0;  // where the name starts in the text, from 1

  // The entry as the text reads it: `name` or `name{key=value ...}`.
  std::string str() const;
};

// Parses a pipeline in MLIR's syntax: comma-separated pass names, each optionally followed by
// options in braces, separated by spaces: `canonicalize,remat{budget=60%},fusion`. A value
// runs to the next space or `}` (so `list=1,2` keeps its commas) unless quoted ('a b' or "a b").
// "" is the empty pipeline. Malformed text is an error naming the column, with the text and a
// caret under it.
Expected<std::vector<PipelineEntry>> parsePipeline(std::string_view text);

class PassManager {
 public:
  // Starts with the ordering rules of passes.def; passes are built for `context`.
  explicit PassManager(PassContext context = {});

  const PassContext& context() const { return context_; }

  PassManagerOptions& options() { return options_; }
  const PassManagerOptions& options() const { return options_; }

  // Appends a registered pass built with `options`; an unknown name is an error that lists the
  // known ones, an unknown option one that lists the pass's options.
  Status addPass(std::string_view name, const PassOptions& options = {});
  // Appends a pass object (tests, passes built with parameters).
  void addPass(std::unique_ptr<Pass> pass);
  // Appends the passes of `--passes=a,b{key=value},c` (parsePipeline; "" adds nothing).
  Status addPipeline(std::string_view text);

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

  PassContext context_;
  PassManagerOptions options_;
  std::vector<std::unique_ptr<Pass>> passes_;
  std::vector<Ordering> orderings_;
};

}  // namespace kiln::passes
