// The `kiln` driver: dispatches to the subcommands listed in commands.def.
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "runtime/memory.h"
#include "tools/cli.h"
#include "tools/session_flags.h"

namespace kiln::cli {
#define KILN_COMMAND(name, summary, fn) int fn(const std::vector<std::string>& args);
#define KILN_MODEL_COMMAND(name, summary, fn) int fn(const ModelSource& model, const std::vector<std::string>& args);
#include "tools/commands.def"
#undef KILN_MODEL_COMMAND
#undef KILN_COMMAND

// A command that runs a model runs `kiln`'s: the model file its arguments name, compiled.
static const Command kCommands[] = {
#define KILN_COMMAND(name, summary, fn) {#name, summary, fn},
#define KILN_MODEL_COMMAND(name, summary, fn) \
  {#name, summary, [](const std::vector<std::string>& args) { return fn(modelFileSource(), args); }},
#include "tools/commands.def"
#undef KILN_MODEL_COMMAND
#undef KILN_COMMAND
};

static void printHelp() {
  std::printf("usage: kiln COMMAND [ARGS...]\n\nKiln compiles models for large sparse recommendation and\n"
              "Mixture-of-Experts workloads.\n\ncommands:\n");
  for (const Command& c : kCommands) std::printf("  %-10s %s\n", c.name, c.summary);
  std::printf("\nRun 'kiln COMMAND --help' for a command's flags.\n");
}

}  // namespace kiln::cli

int main(int argc, char** argv) {
  using namespace kiln::cli;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    printHelp();
    return argc < 2 ? kExitUsage : kExitOk;
  }
  // A write past the file size limit (ulimit -f) then fails with EFBIG, which the checkpoint
  // code reports and survives, instead of SIGXFSZ killing the process mid-save.
  std::signal(SIGXFSZ, SIG_IGN);
  // Under ulimit -v, one malloc heap for every thread (runtime/memory.h).
  kiln::runtime::singleHeapUnderAddressLimit();
  std::vector<std::string> args(argv + 2, argv + argc);
  for (const Command& c : kCommands) {
    if (c.name != std::string(argv[1])) continue;
    // Errors are Status values; an exception reaching here is a bug or an exhausted machine. It
    // gets a message and exit 1, never std::terminate's abort.
    return runCommandGuarded("kiln", c.name, c.run, args);
  }
  std::fprintf(stderr, "kiln: error: unknown command '%s' (see 'kiln --help')\n", argv[1]);
  return kExitUsage;
}
