// How the commands open a driver::Session from their flags: the opener (`kiln` compiles the model
// file; an ahead-of-time runner opens its payload) and the flags every command that runs a model
// shares. The CLI's half of the session; the session itself is driver/session.h.
#pragma once

#include <functional>
#include <memory>
#include <ostream>

#include "driver/compiled_model.h"
#include "driver/session.h"
#include "tools/cli.h"

namespace kiln::cli {

// How the commands (train, eval, predict) open their session: `kiln` compiles the model file
// (installCompilingOpener, tools/model_compile.cc: the frontend and the passes); an
// ahead-of-time runner opens its payload and has no compiler flags. main installs one.
struct SessionOpener {
  std::function<Expected<std::unique_ptr<driver::Session>>(const driver::SessionOptions&, std::ostream&)> open;
  // The flags of compiling (--set, --memory-budget, --target, the pass manager's); none in a runner.
  void (*add_compile_flags)(ArgParser&) = nullptr;
  bool (*read_compile_flags)(const ArgParser&, driver::SessionOptions&, int*) = nullptr;
  // A runner's model: MODEL is the runner itself, and its embedded weights stand in for --checkpoint.
  std::shared_ptr<const driver::CompiledModel> compiled;
};
void installSessionOpener(SessionOpener opener);
const SessionOpener& sessionOpener();
Expected<std::unique_ptr<driver::Session>> openSession(const driver::SessionOptions& options, std::ostream& diag);
void installCompilingOpener();

// The flags every command that runs a model shares: --threads, --seed, --memory-limit, and, where
// the session opener compiles, --set, --memory-budget, --target and the pass manager's flags.
void addModelFlags(ArgParser& p);
// Reads them back; returns a usage error (already printed) as false.
bool readModelFlags(const ArgParser& p, driver::SessionOptions& o, int* exit_code);
// --device cpu|cuda; the default is cuda when a GPU is present, else cpu.
void addDeviceFlag(ArgParser& p);
bool readDeviceFlag(const ArgParser& p, driver::SessionOptions& o, int* exit_code);

}  // namespace kiln::cli
