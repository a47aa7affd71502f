#include "tools/cli.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <new>
#include <stdexcept>
#include <system_error>

#include "ir/checked.h"
#include "ir/status.h"
#include "ir/target.h"
#include "runtime/cpu/cpu_features.h"
#include "runtime/cpu/gemm.h"
#include "runtime/thread_start.h"

namespace kiln::cli {

ArgParser::ArgParser(std::string command, std::string usage, std::string description)
    : command_(std::move(command)), usage_(std::move(usage)), description_(std::move(description)) {}

void ArgParser::addOption(const std::string& name, const std::string& metavar, const std::string& help,
                          std::optional<std::string> default_value, bool repeatable) {
  order_.push_back(name);
  options_[name] = Option{metavar, help, std::move(default_value), repeatable, false};
}

void ArgParser::addFlag(const std::string& name, const std::string& help) {
  order_.push_back(name);
  options_[name] = Option{"", help, std::nullopt, false, true};
}

void ArgParser::setPositionals(const std::string& metavar, int min, int max, const std::string& help) {
  pos_metavar_ = metavar;
  pos_min_ = min;
  pos_max_ = max;
  pos_help_ = help;
}

int ArgParser::usageError(const std::string& message) const {
  std::fprintf(stderr, "kiln %s: error: %s\n", command_.c_str(), message.c_str());
  return kExitUsage;
}

bool ArgParser::parse(const std::vector<std::string>& args, int* exit_code) {
  *exit_code = kExitOk;
  bool only_positionals = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (only_positionals || a.size() < 2 || a[0] != '-' || a == "-") {
      positionals_.push_back(a);
      continue;
    }
    if (a == "--") {
      only_positionals = true;
      continue;
    }
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (a.rfind("--", 0) != 0) {
      *exit_code = usageError(fmt::format("unknown flag '{}' (see 'kiln {} --help')", a, command_));
      return false;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = options_.find(name);
    if (it == options_.end()) {
      *exit_code = usageError(fmt::format("unknown flag '--{}' (see 'kiln {} --help')", name, command_));
      return false;
    }
    const Option& opt = it->second;
    if (opt.is_flag) {
      if (has_value) {
        *exit_code = usageError(fmt::format("flag '--{}' takes no value", name));
        return false;
      }
      values_[name] = {"true"};
      continue;
    }
    if (!has_value) {
      if (i + 1 >= args.size()) {
        *exit_code = usageError(fmt::format("flag '--{}' needs a value ({})", name, opt.metavar));
        return false;
      }
      value = args[++i];
    }
    auto& vals = values_[name];
    if (!opt.repeatable) vals.clear();
    vals.push_back(value);
  }
  int n = static_cast<int>(positionals_.size());
  if (n < pos_min_) {
    *exit_code = usageError(pos_metavar_.empty() ? "missing arguments"
                                                 : fmt::format("missing {} (usage: {})", pos_metavar_, usage_));
    return false;
  }
  if (pos_max_ >= 0 && n > pos_max_) {
    *exit_code = usageError(fmt::format("unexpected argument '{}' (usage: {})", positionals_[pos_max_], usage_));
    return false;
  }
  return true;
}

bool ArgParser::has(const std::string& name) const {
  if (values_.count(name)) return true;
  auto it = options_.find(name);
  return it != options_.end() && it->second.default_value.has_value();
}

std::string ArgParser::get(const std::string& name) const {
  auto v = values_.find(name);
  if (v != values_.end() && !v->second.empty()) return v->second.back();
  auto it = options_.find(name);
  if (it != options_.end() && it->second.default_value) return *it->second.default_value;
  return "";
}

const std::vector<std::string>& ArgParser::getAll(const std::string& name) const {
  static const std::vector<std::string> kEmpty;
  auto v = values_.find(name);
  return v == values_.end() ? kEmpty : v->second;
}

bool ArgParser::flag(const std::string& name) const { return values_.count(name) > 0; }

std::optional<long long> ArgParser::getInt(const std::string& name) const {
  std::string s = get(name);
  // strtoll saturates out-of-range text to LLONG_MAX: --batch 99999999999999999999999 became a
  // batch of 2^63-1 samples.
  if (auto v = parseInt64(s)) return *v;
  std::string_view digits = s;
  if (!digits.empty() && (digits[0] == '-' || digits[0] == '+')) digits.remove_prefix(1);
  if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos)
    usageError(fmt::format("flag '--{}': {} is out of range (integers lie in [{}, {}])", name, s,
                           std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
  else
    usageError(fmt::format("flag '--{}' needs an integer, got '{}'", name, s));
  return std::nullopt;
}

std::optional<double> ArgParser::getDouble(const std::string& name) const {
  std::string s = get(name);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0') {
    usageError(fmt::format("flag '--{}' needs a number, got '{}'", name, s));
    return std::nullopt;
  }
  return v;
}

std::string ArgParser::help() const {
  std::string out = fmt::format("usage: {}\n\n{}\n", usage_, description_);
  if (!pos_metavar_.empty()) out += fmt::format("\narguments:\n  {:<28} {}\n", pos_metavar_, pos_help_);
  if (!order_.empty()) out += "\nflags:\n";
  for (const auto& name : order_) {
    const Option& o = options_.at(name);
    std::string lhs = "--" + name + (o.is_flag ? "" : "=" + o.metavar);
    std::string rhs = o.help;
    if (o.default_value) rhs += fmt::format(" (default: {})", *o.default_value);
    if (o.repeatable) rhs += " (repeatable)";
    out += fmt::format("  {:<28} {}\n", lhs, rhs);
  }
  out += fmt::format("  {:<28} {}\n", "--help", "show this help");
  return out;
}

void addTargetFlag(ArgParser& p, const std::string& default_help) {
  p.addOption("target", fmt::format("{}", fmt::join(targetNames(), "|")),
              fmt::format("the machine the passes plan for (default: {})", default_help));
}

bool readTargetFlag(const ArgParser& p, std::optional<Target>* target, int* exit_code) {
  target->reset();
  if (!p.has("target")) return true;
  auto t = targetByName(p.get("target"));
  if (!t) {
    *exit_code = p.usageError(fmt::format("--target: {}", t.status().message()));
    return false;
  }
  *target = t.take();
  return true;
}

std::string cpuBackendLine() {
  const runtime::cpu::CpuFeatures& cpu = runtime::cpu::hostCpu();
  return fmt::format("cpu: {} ({}), gemm: {}", cpu.summary(), cpu.model_name.empty() ? cpu.vendor : cpu.model_name,
                     runtime::cpu::gemmImplementation());
}

void printCpuHeader(int threads) {
  std::fprintf(stderr, "%s, threads %d\n", cpuBackendLine().c_str(), threads);
  for (const std::string& w : runtime::cpu::cpuLibraryWarnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
}

void printError(const std::string& command, const Status& status) {
  if (status.location().known() || !status.location().file.empty())
    std::fprintf(stderr, "%s\n", status.str().c_str());
  else
    std::fprintf(stderr, "kiln %s: error: %s\n", command.c_str(), status.message().c_str());
}

std::string uncaughtExceptionMessage(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return "error: out of memory: an allocation failed (std::bad_alloc); lower --batch or the model's sizes, "
           "or see what else uses the machine's memory";
  } catch (const std::length_error& l) {
    return fmt::format("error: out of memory: a size too large to allocate ({})", l.what());
  } catch (const std::system_error& x) {
    // std::thread's refusal to start a thread (ulimit -u): name the limit.
    if (x.code() == std::errc::resource_unavailable_try_again)
      return "error: " + runtime::threadStartFailure("cannot start a thread", x);
    return fmt::format("internal error: {}", x.what());
  } catch (const std::exception& x) {
    return fmt::format("internal error: {}", x.what());
  } catch (...) {
    return "internal error: an unknown exception";
  }
}

int runCommandGuarded(const std::string& program, const std::string& command,
                      const std::function<int(const std::vector<std::string>&)>& run,
                      const std::vector<std::string>& args) {
  try {
    return run(args);
  } catch (...) {
    std::fprintf(stderr, "%s %s: %s\n", program.c_str(), command.c_str(),
                 uncaughtExceptionMessage(std::current_exception()).c_str());
  }
  return kExitError;
}

int runSubcommands(const std::string& group, const std::vector<Command>& subcommands,
                   const std::vector<std::string>& args) {
  std::string usage = fmt::format("usage: kiln {} SUBCOMMAND [ARGS...]\n\nsubcommands:\n", group);
  for (const Command& c : subcommands) usage += fmt::format("  {:<10} {}\n", c.name, c.summary);
  usage += fmt::format("\nRun 'kiln {} SUBCOMMAND --help' for its flags.\n", group);
  if (args.empty()) {
    std::fputs(usage.c_str(), stderr);
    return kExitUsage;
  }
  if (args[0] == "--help" || args[0] == "-h") {
    std::fputs(usage.c_str(), stdout);
    return kExitOk;
  }
  for (const Command& c : subcommands)
    if (args[0] == c.name) return c.run(std::vector<std::string>(args.begin() + 1, args.end()));
  std::fprintf(stderr, "kiln %s: error: unknown subcommand '%s' (see 'kiln %s --help')\n", group.c_str(),
               args[0].c_str(), group.c_str());
  return kExitUsage;
}

std::vector<std::string> expandOutputShorthand(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-o" && i + 1 < args.size())
      out.push_back("--output=" + args[++i]);
    else
      out.push_back(args[i]);
  }
  return out;
}

}  // namespace kiln::cli
