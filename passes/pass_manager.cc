#include "passes/pass_manager.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "ir/printer.h"
#include "ir/verifier.h"

namespace kiln::passes {

PassManager::PassManager() {
  for (const PassOrdering& o : registeredOrderings())
    orderings_.push_back({std::string(o.first), std::string(o.then), std::string(o.reason)});
}

std::ostream& PassManager::log() const { return options_.log ? *options_.log : std::cerr; }

static std::string knownPassNames() {
  std::string out;
  for (const PassInfo& p : registeredPasses()) {
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

static bool isRegistered(std::string_view name) {
  for (const PassInfo& p : registeredPasses())
    if (p.name == name) return true;
  return false;
}

Status PassManager::addPass(std::string_view name) {
  std::unique_ptr<Pass> p = createPass(name);
  if (!p) return Status::errorf("unknown pass '{}'; known passes: {}", name, knownPassNames());
  passes_.push_back(std::move(p));
  return Status::ok();
}

void PassManager::addPass(std::unique_ptr<Pass> pass) { passes_.push_back(std::move(pass)); }

Status PassManager::addPipeline(std::string_view list) {
  size_t pos = 0;
  while (pos <= list.size() && !list.empty()) {
    size_t comma = list.find(',', pos);
    std::string_view name =
        list.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    if (name.empty()) return Status::errorf("empty pass name in pipeline '{}'", list);
    KILN_RETURN_IF_ERROR(addPass(name));
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return Status::ok();
}

void PassManager::requireBefore(std::string first, std::string then, std::string reason) {
  orderings_.push_back({std::move(first), std::move(then), std::move(reason)});
}

bool PassManager::enabled(const Pass& p) const { return !options_.disabled.count(p.name()); }

std::vector<std::string> PassManager::pipeline() const {
  std::vector<std::string> out;
  for (const auto& p : passes_)
    if (enabled(*p)) out.emplace_back(p->name());
  return out;
}

Status PassManager::build() const {
  auto known = [&](std::string_view name) {
    if (isRegistered(name)) return true;
    for (const auto& p : passes_)
      if (p->name() == name) return true;
    return false;
  };
  for (const std::string& d : options_.disabled)
    if (!known(d))
      return Status::errorf("--disable-pass: unknown pass '{}'; known passes: {}", d, knownPassNames());
  for (const std::string& d : options_.print_ir_after)
    if (!known(d))
      return Status::errorf("--print-ir-after: unknown pass '{}'; known passes: {}", d, knownPassNames());
  std::vector<std::string> names = pipeline();
  for (const Ordering& o : orderings_) {
    // Every run of `first` must come before every run of `then`.
    for (size_t t = 0; t < names.size(); ++t) {
      if (names[t] != o.then) continue;
      for (size_t f = t + 1; f < names.size(); ++f)
        if (names[f] == o.first)
          return Status::errorf("pass '{}' (position {}) must not run after '{}' (position {}){}", o.first,
                                f + 1, o.then, t + 1, o.reason.empty() ? "" : fmt::format(": {}", o.reason));
    }
  }
  return Status::ok();
}

namespace {

Status writeFile(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  if (!out) return Status::errorf("cannot write '{}'", path.string());
  return Status::ok();
}

struct Timing {
  std::string name;
  double ms;
  bool changed;
};

}  // namespace

Expected<bool> PassManager::run(ir::Module& m) {
  KILN_RETURN_IF_ERROR(build());
  if (options_.verify_each) {
    Status s = ir::verify(m);
    if (!s) return Status::error(fmt::format("the input IR is invalid: {}", s.message()), s.location());
  }
  std::filesystem::path dump;
  int dump_index = 0;
  if (!options_.dump_dir.empty()) {
    dump = options_.dump_dir;
    std::error_code ec;
    std::filesystem::create_directories(dump, ec);
    if (ec) return Status::errorf("--dump-dir: cannot create '{}': {}", options_.dump_dir, ec.message());
    KILN_RETURN_IF_ERROR(writeFile(dump / "0000.input.mlir", ir::printModule(m)));
  }

  std::vector<Timing> timings;
  bool any_change = false;
  for (const auto& pass : passes_) {
    if (!enabled(*pass)) continue;
    std::string name(pass->name());
    auto start = std::chrono::steady_clock::now();
    Expected<bool> changed = pass->run(m);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (!changed)
      return Status::error(fmt::format("in pass '{}': {}", name, changed.status().message()),
                           changed.status().location());
    any_change |= *changed;
    timings.push_back({name, ms, *changed});
    if (options_.verify_each) {
      Status s = ir::verify(m);
      if (!s)
        return Status::error(fmt::format("pass '{}' produced invalid IR: {}", name, s.message()),
                             s.location());
    }
    if (options_.print_ir_after_all || options_.print_ir_after.count(name)) {
      log() << "// -----// IR Dump After " << name << " //----- //\n";
      ir::printModule(m, log());
      log() << '\n';
    }
    if (!dump.empty())
      KILN_RETURN_IF_ERROR(
          writeFile(dump / fmt::format("{:04}.{}.mlir", ++dump_index, name), ir::printModule(m)));
  }

  if (options_.timing) {
    double total = 0;
    for (const Timing& t : timings) total += t.ms;
    log() << "===-------------------------------------------------------------------------===\n"
          << "                          Pass execution timing report\n"
          << "===-------------------------------------------------------------------------===\n";
    log() << fmt::format("  {:>10}  {:>7}  {:<7}  {}\n", "Wall (ms)", "Share", "Changed", "Pass");
    for (const Timing& t : timings)
      log() << fmt::format("  {:>10.3f}  {:>6.1f}%  {:<7}  {}\n", t.ms,
                           total > 0 ? 100.0 * t.ms / total : 0.0, t.changed ? "yes" : "no", t.name);
    log() << fmt::format("  {:>10.3f}  {:>6.1f}%  {:<7}  {}\n", total, 100.0, "", "Total");
  }
  return any_change;
}

}  // namespace kiln::passes
