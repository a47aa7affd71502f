#include "passes/pass_manager.h"

#include <fmt/format.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "ir/printer.h"
#include "ir/verifier.h"

namespace kiln::passes {

namespace {

bool isNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
}
bool isSpace(char c) { return c == ' ' || c == '\t' || c == '\n'; }

// A recursive-descent reader of the pipeline grammar:
//   pipeline := entry (',' entry)* | <empty>
//   entry    := name ('{' (key '=' value)* '}')?
//   value    := '...' | "..." | chars up to a space or a brace
class PipelineParser {
 public:
  explicit PipelineParser(std::string_view text) : text_(text) {}

  Expected<std::vector<PipelineEntry>> parse() {
    std::vector<PipelineEntry> entries;
    skipSpaces();
    if (atEnd()) return entries;
    while (true) {
      KILN_ASSIGN_OR_RETURN(auto e, entry());
      entries.push_back(std::move(e));
      skipSpaces();
      if (atEnd()) return entries;
      if (text_[pos_] != ',')
        return error(fmt::format("expected ',' between passes after '{}'", entries.back().name));
      ++pos_;
      skipSpaces();
    }
  }

 private:
  bool atEnd() const { return pos_ >= text_.size(); }
  void skipSpaces() {
    while (!atEnd() && isSpace(text_[pos_])) ++pos_;
  }
  std::string_view name() {
    size_t start = pos_;
    while (!atEnd() && isNameChar(text_[pos_])) ++pos_;
    return text_.substr(start, pos_ - start);
  }
  // "malformed pipeline at column 7: expected ..." with the text and a caret under `at`.
  Status error(const std::string& what, size_t at) const {
    return Status::errorf("malformed pipeline at column {}: {}\n  {}\n  {}^", at + 1, what, text_,
                          std::string(at, ' '));
  }
  Status error(const std::string& what) const { return error(what, pos_); }

  Expected<PipelineEntry> entry() {
    PipelineEntry e;
    e.column = pos_ + 1;
    e.name = std::string(name());
    if (e.name.empty()) return error(atEnd() ? "expected a pass name at the end" : "expected a pass name");
    skipSpaces();
    if (atEnd() || text_[pos_] != '{') return e;
    const size_t open = pos_++;
    while (true) {
      skipSpaces();
      if (atEnd()) return error(fmt::format("the options of '{}' have no closing '}}'", e.name), open);
      if (text_[pos_] == '}') {
        ++pos_;
        return e;
      }
      const size_t key_at = pos_;
      std::string key(name());
      if (key.empty())
        return error(fmt::format("expected an option name or '}}' in the options of '{}'", e.name));
      if (atEnd() || text_[pos_] != '=')
        return error(fmt::format("expected '=' after option '{}' (options are key=value)", key));
      ++pos_;
      KILN_ASSIGN_OR_RETURN(auto value, optionValue(key));
      if (e.options.has(key))
        return error(fmt::format("option '{}' of '{}' is given twice", key, e.name), key_at);
      e.options.set(std::move(key), std::move(value));
    }
  }

  Expected<std::string> optionValue(const std::string& key) {
    if (!atEnd() && (text_[pos_] == '\'' || text_[pos_] == '"')) {
      const size_t open = pos_;
      const char quote = text_[pos_++];
      size_t close = text_.find(quote, pos_);
      if (close == std::string_view::npos)
        return error(fmt::format("the value of '{}' has no closing {}", key, quote), open);
      std::string v(text_.substr(pos_, close - pos_));
      pos_ = close + 1;
      return v;
    }
    size_t start = pos_;
    while (!atEnd() && !isSpace(text_[pos_]) && text_[pos_] != '}' && text_[pos_] != '{') ++pos_;
    if (pos_ == start) return error(fmt::format("expected a value for option '{}'", key));
    return std::string(text_.substr(start, pos_ - start));
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

std::string PipelineEntry::str() const {
  return options.empty() ? name : fmt::format("{}{{{}}}", name, options.str());
}

Expected<std::vector<PipelineEntry>> parsePipeline(std::string_view text) {
  return PipelineParser(text).parse();
}

PassManager::PassManager(PassContext context) : context_(std::move(context)) {
  for (const PassOrdering& o : registeredOrderings())
    orderings_.push_back({std::string(o.first), std::string(o.then), std::string(o.reason)});
}

std::ostream& PassManager::log() const { return options_.log ? *options_.log : std::cerr; }

Status PassManager::addPass(std::string_view name, const PassOptions& options) {
  KILN_ASSIGN_OR_RETURN(auto p, createPass(name, context_, options));
  passes_.push_back(std::move(p));
  return Status::ok();
}

void PassManager::addPass(std::unique_ptr<Pass> pass) { passes_.push_back(std::move(pass)); }

Status PassManager::addPipeline(std::string_view text) {
  KILN_ASSIGN_OR_RETURN(auto entries, parsePipeline(text));
  // All or nothing: a bad entry leaves the pipeline as it was.
  std::vector<std::unique_ptr<Pass>> made;
  for (const PipelineEntry& e : entries) {
    KILN_ASSIGN_OR_RETURN(auto p, createPass(e.name, context_, e.options));
    made.push_back(std::move(p));
  }
  for (auto& p : made) passes_.push_back(std::move(p));
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
    if (findPass(name)) return true;
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
