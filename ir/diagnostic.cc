#include "ir/diagnostic.h"

namespace kiln {

std::string formatDiagnostic(const Status& status, std::string_view source, std::string_view source_name) {
  std::string out = status.str();
  if (status.isOk() || !status.location().known()) return out;
  const Location& loc = status.location();
  if (!source_name.empty() && loc.file != source_name) return out;
  size_t start = 0;
  for (int line = 1; line < loc.line; ++line) {
    size_t nl = source.find('\n', start);
    if (nl == std::string_view::npos) return out;
    start = nl + 1;
  }
  size_t end = source.find('\n', start);
  std::string_view text =
      source.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
  if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
  out += '\n';
  out += text;
  out += '\n';
  // Keep tabs so that the caret lines up under tab-indented source.
  for (int i = 0; i + 1 < loc.col; ++i)
    out += static_cast<size_t>(i) < text.size() && text[static_cast<size_t>(i)] == '\t' ? '\t' : ' ';
  out += '^';
  return out;
}

}  // namespace kiln
