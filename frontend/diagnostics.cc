#include "frontend/diagnostics.h"

#include <fmt/format.h>

namespace kiln::frontend {

const std::string* DiagnosticEngine::source(const std::string& file) const {
  auto it = sources_.find(file);
  return it == sources_.end() ? nullptr : &it->second;
}

void DiagnosticEngine::error(const Status& s, const Location& fallback) {
  report(Severity::Error, s.location().known() ? s.location() : fallback, s.message());
}

void DiagnosticEngine::report(Severity s, const Location& loc, std::string message) {
  if (s == Severity::Error) {
    if (errors_ >= kMaxErrors) {
      if (errors_++ == kMaxErrors && out_) *out_ << "error: too many errors, stopping\n";
      return;
    }
    ++errors_;
  }
  if (s == Severity::Warning) ++warnings_;
  diags_.push_back({s, loc, std::move(message)});
  if (out_) *out_ << format(diags_.back()) << std::flush;
}

std::string DiagnosticEngine::format(const Diagnostic& d) const {
  const char* kind = d.severity == Severity::Error ? "error" : d.severity == Severity::Warning ? "warning" : "note";
  std::string out = d.loc.known() || !d.loc.file.empty() ? fmt::format("{}: {}: {}\n", d.loc.str(), kind, d.message)
                                                         : fmt::format("{}: {}\n", kind, d.message);
  const std::string* text = d.loc.known() ? source(d.loc.file) : nullptr;
  if (!text) return out;
  // Find the line; quote it with a caret under the column (tabs kept so the caret lines up).
  size_t begin = 0;
  for (int line = 1; line < d.loc.line && begin != std::string::npos; ++line) {
    begin = text->find('\n', begin);
    if (begin != std::string::npos) ++begin;
  }
  if (begin == std::string::npos || begin > text->size()) return out;
  size_t end = text->find('\n', begin);
  std::string line = text->substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  std::string caret;
  for (int i = 1; i < d.loc.col && static_cast<size_t>(i - 1) < line.size(); ++i)
    caret += line[static_cast<size_t>(i - 1)] == '\t' ? '\t' : ' ';
  out += line + "\n" + caret + "^\n";
  return out;
}

std::string DiagnosticEngine::str() const {
  std::string out;
  for (const auto& d : diags_) out += format(d);
  return out;
}

}  // namespace kiln::frontend
