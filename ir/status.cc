#include "ir/status.h"

namespace kiln {

std::string Location::str() const {
  if (file.empty() && line == 0) return "<unknown>";
  if (line == 0) return file;
  return fmt::format("{}:{}:{}", file, line, col);
}

std::string Status::str() const {
  if (isOk()) return "ok";
  if (error_->loc.line == 0 && error_->loc.file.empty()) return "error: " + error_->message;
  return fmt::format("{}: error: {}", error_->loc.str(), error_->message);
}

Status Status::withLocation(const Location& loc) && {
  if (error_ && !error_->loc.known() && error_->loc.file.empty()) error_->loc = loc;
  return std::move(*this);
}

}  // namespace kiln
