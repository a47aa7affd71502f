// How the commands open a driver::Session from their flags: the model source (`kiln` compiles the
// model file; an ahead-of-time runner opens its payload) and the flags every command that runs a
// model shares. The CLI's half of the session; the session itself is driver/session.h.
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "driver/compiled_model.h"
#include "driver/session.h"
#include "tools/cli.h"

namespace kiln::cli {

// What a command that runs a model (train, eval, predict, serve, data requests) runs, handed to it
// by its caller: `kiln` compiles the MODEL.kiln its command line names (modelFileSource(),
// tools/model_compile.cc: the frontend and the passes, under the compile flags); an ahead-of-time
// runner opens its own payload (CompiledSource), compiled already: no MODEL argument, no compile
// flags, and --batch defaults to the batch it was compiled for. The commands declare and read
// their flags through it and open their sessions from it, so `kiln train` and `./NAME train`
// are one parse of the user's own arguments and the same driver calls.
class ModelSource {
 public:
  virtual ~ModelSource() = default;
  // "kiln train MODEL.kiln" or "NAME train": the start of a command's usage line.
  virtual std::string synopsis(const std::string& command) const = 0;
  // Declares the model argument (MODEL.kiln, or none).
  virtual void addModelArgument(ArgParser& p) const = 0;
  // Sets o.model_path: the file named (which must exist), or the runner's own.
  virtual bool readModelArgument(const ArgParser& p, driver::SessionOptions& o, int* exit_code) const = 0;
  // The flags of compiling (--set, --memory-budget, --precision, --target, the pass manager's),
  // where this source compiles.
  virtual void addCompileFlags(ArgParser&) const {}
  virtual bool readCompileFlags(const ArgParser&, driver::SessionOptions&, int*) const { return true; }
  virtual Expected<std::unique_ptr<driver::Session>> open(const driver::SessionOptions& options,
                                                          std::ostream& diag) const = 0;
  // A runner's model (its max batch, embedded weights); null for a model file.
  virtual const driver::CompiledModel* compiled() const { return nullptr; }

  // --batch's default: `fallback`, or the batch a compiled model was compiled for.
  std::string defaultBatch(int64_t fallback) const;
  // A compiled model with embedded weights needs no --checkpoint.
  bool embeddedWeights() const;
};

// An ahead-of-time runner's payload: `path` is the runner itself, `name` what it was called as.
class CompiledSource final : public ModelSource {
 public:
  CompiledSource(std::shared_ptr<const driver::CompiledModel> compiled, std::string path, std::string name);
  std::string synopsis(const std::string& command) const override;
  void addModelArgument(ArgParser&) const override {}
  bool readModelArgument(const ArgParser& p, driver::SessionOptions& o, int* exit_code) const override;
  Expected<std::unique_ptr<driver::Session>> open(const driver::SessionOptions& options,
                                                  std::ostream& diag) const override;
  const driver::CompiledModel* compiled() const override { return compiled_.get(); }

 private:
  std::shared_ptr<const driver::CompiledModel> compiled_;
  std::string path_, name_;
};

// The model file `kiln` compiles (tools/model_compile.cc; the runner does not link it).
const ModelSource& modelFileSource();

// The flags every command that runs a model shares: --threads, --seed, --memory-limit, and, where
// `model` compiles, --set, --memory-budget, --precision, --target and the pass manager's flags.
void addModelFlags(ArgParser& p, const ModelSource& model);
// Reads them back; returns a usage error (already printed) as false.
bool readModelFlags(const ArgParser& p, const ModelSource& model, driver::SessionOptions& o, int* exit_code);
// --device cpu|cuda; the default is cuda when a GPU is present, else cpu.
void addDeviceFlag(ArgParser& p);
bool readDeviceFlag(const ArgParser& p, driver::SessionOptions& o, int* exit_code);

}  // namespace kiln::cli
