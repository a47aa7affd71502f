// Clang-style diagnostics for .kiln sources: `file:line:col: error: message`, then the source
// line and a caret under the column. The engine keeps every source it has seen, so a diagnostic
// located in an imported file still shows its line, and counts errors so that a run can report
// several and fail once at the end.
#pragma once

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::frontend {

enum class Severity { Error, Warning, Note };

struct Diagnostic {
  Severity severity = Severity::Error;
  Location loc;
  std::string message;
};

class DiagnosticEngine {
 public:
  // Diagnostics go to `out` as they are reported (nullptr: only kept).
  explicit DiagnosticEngine(std::ostream* out = nullptr) : out_(out) {}

  // Registers a source text so that diagnostics in `file` can quote their line.
  void addSource(const std::string& file, std::string text) { sources_[file] = std::move(text); }
  const std::string* source(const std::string& file) const;

  void error(const Location& loc, std::string message) { report(Severity::Error, loc, std::move(message)); }
  void warning(const Location& loc, std::string message) { report(Severity::Warning, loc, std::move(message)); }
  void note(const Location& loc, std::string message) { report(Severity::Note, loc, std::move(message)); }
  // Reports a failed Status as an error, at its own location or else at `fallback`.
  void error(const Status& s, const Location& fallback);

  int errorCount() const { return errors_; }
  int warningCount() const { return warnings_; }
  bool hasErrors() const { return errors_ > 0; }
  const std::vector<Diagnostic>& diagnostics() const { return diags_; }
  // Every diagnostic formatted, in order.
  std::string str() const;
  // Past this many errors, further errors are dropped (a fuzzer's garbage would print pages).
  static constexpr int kMaxErrors = 50;

  std::string format(const Diagnostic& d) const;

 private:
  void report(Severity s, const Location& loc, std::string message);
  std::ostream* out_;
  std::map<std::string, std::string> sources_;
  std::vector<Diagnostic> diags_;
  int errors_ = 0;
  int warnings_ = 0;
};

}  // namespace kiln::frontend
