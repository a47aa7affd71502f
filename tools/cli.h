// A small command-line parser shared by the `kiln` subcommands: declared flags, `--help`
// generated from the declarations, and one-line errors with exit code 2 for anything unknown.
#pragma once

#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kiln {
class Status;
struct Target;
}  // namespace kiln

namespace kiln::cli {

// Exit codes of every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;  // the input was wrong (a diagnostic was printed)
inline constexpr int kExitUsage = 2;  // the command line was wrong

class ArgParser {
 public:
  // `usage` is the synopsis line, e.g. "kiln opt FILE.mlir [flags]".
  ArgParser(std::string command, std::string usage, std::string description);

  // A flag taking a value: --name=V or --name V. Repeatable flags collect every value.
  void addOption(const std::string& name, const std::string& metavar, const std::string& help,
                 std::optional<std::string> default_value = std::nullopt, bool repeatable = false);
  // A boolean flag: --name.
  void addFlag(const std::string& name, const std::string& help);
  // Positional arguments: at least `min`, at most `max` (-1: any number).
  void setPositionals(const std::string& metavar, int min, int max, const std::string& help);

  // Parses argv (without the program and command names). On `--help` prints help and returns
  // kExitOk in *exit_code; on an error prints "kiln CMD: error: ..." and returns kExitUsage.
  // Returns true when the command should run.
  bool parse(const std::vector<std::string>& args, int* exit_code);

  bool has(const std::string& name) const;  // given on the command line (or a default exists)
  std::string get(const std::string& name) const;
  const std::vector<std::string>& getAll(const std::string& name) const;
  bool flag(const std::string& name) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

  // Parses an integer option, printing a usage error on failure.
  std::optional<long long> getInt(const std::string& name) const;
  std::optional<double> getDouble(const std::string& name) const;

  std::string help() const;
  // Prints "kiln CMD: error: MSG" to stderr and returns kExitUsage.
  int usageError(const std::string& message) const;

 private:
  struct Option {
    std::string metavar, help;
    std::optional<std::string> default_value;
    bool repeatable = false;
    bool is_flag = false;
  };
  std::string command_, usage_, description_;
  std::vector<std::string> order_;
  std::map<std::string, Option> options_;
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positionals_;
  std::string pos_metavar_, pos_help_;
  int pos_min_ = 0, pos_max_ = 0;
};

// --target NAME, the machine the passes plan for (ir/target.h); `default_help` says what leaving
// it out means.
void addTargetFlag(ArgParser& p, const std::string& default_help);
// The --target given, looked up (a usage error, printed, lists the known names); nullopt when
// the flag is absent. Returns false on the usage error.
bool readTargetFlag(const ArgParser& p, std::optional<Target>* target, int* exit_code);

// Prints a failed Status for command `command`: "file:line:col: error: msg" when it is located,
// "kiln COMMAND: error: msg" otherwise.
void printError(const std::string& command, const Status& status);
// What an exception that reached a command's boundary says after "kiln COMMAND: ": an
// allocation that failed (std::bad_alloc, or std::length_error for a size no vector can take)
// is "error: out of memory ...", anything else an internal error. Errors are Status values; an
// exception there is a bug or an exhausted machine, and ends in exit 1, never std::terminate.
std::string uncaughtExceptionMessage(const std::exception_ptr& e);
// Runs `run(args)` as the command `program` `command` (`kiln train`); an exception that escapes it
// is printed by uncaughtExceptionMessage and returns kExitError.
int runCommandGuarded(const std::string& program, const std::string& command,
                      const std::function<int(const std::vector<std::string>&)>& run,
                      const std::vector<std::string>& args);

// A subcommand: `kiln NAME ...`.
struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

// `kiln GROUP SUBCOMMAND ...` (kiln data convert, kiln checkpoint merge): help, usage errors and
// the dispatch to `subcommands`, listed with their summaries in the help.
int runSubcommands(const std::string& group, const std::vector<Command>& subcommands,
                   const std::vector<std::string>& args);

// What the CPU backend runs on: "cpu: avx512+bf16 (AMD EPYC 9R14), gemm: onednn 2.6.3
// (avx512_core_bf16)".
std::string cpuBackendLine();
// Prints cpuBackendLine() with the thread count, and a warning for each library in the process
// that runs below the CPU's level (runtime/cpu/cpu_features.h), to stderr.
void printCpuHeader(int threads);

// `-o X` as `--output=X`, for the commands that write one output file.
std::vector<std::string> expandOutputShorthand(const std::vector<std::string>& args);

}  // namespace kiln::cli
