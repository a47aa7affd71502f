// Errors as values. Nothing in the compiler aborts on user input: functions that can fail on
// user input return a Status or an Expected<T>, carrying a message and, where known, the
// source location it refers to. Internal invariants use assert.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace kiln {

// A position in a source file (a .kiln model or a .mlir IR file). line and col are 1-based;
// line == 0 means "unknown".
struct Location {
  std::string file;
  int line = 0;
  int col = 0;

  bool known() const { return line > 0; }
  // "file:line:col" (or "file" or "<unknown>").
  std::string str() const;
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(std::string message, Location loc = {}) {
    Status s;
    s.error_ = Error{std::move(message), std::move(loc)};
    return s;
  }
  template <typename... Args>
  static Status errorf(fmt::format_string<Args...> f, Args&&... args) {
    return error(fmt::format(f, std::forward<Args>(args)...));
  }

  bool isOk() const { return !error_.has_value(); }
  explicit operator bool() const { return isOk(); }
  const std::string& message() const {
    assert(!isOk());
    return error_->message;
  }
  const Location& location() const {
    assert(!isOk());
    return error_->loc;
  }
  // "file:line:col: error: message" when located, "error: message" otherwise.
  std::string str() const;
  // Attaches a location if the error has none yet.
  Status withLocation(const Location& loc) &&;

 private:
  struct Error {
    std::string message;
    Location loc;
  };
  std::optional<Error> error_;
};

template <typename T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}
  Expected(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).isOk()); }

  bool isOk() const { return v_.index() == 0; }
  explicit operator bool() const { return isOk(); }
  T& operator*() { return std::get<T>(v_); }
  const T& operator*() const { return std::get<T>(v_); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T take() { return std::move(std::get<T>(v_)); }
  const Status& status() const { return std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

// The Status of a Status or an Expected (ok when it holds a value).
inline Status statusOf(Status s) { return s; }
template <typename T>
Status statusOf(const Expected<T>& e) {
  return e ? Status::ok() : e.status();
}

}  // namespace kiln

// Evaluates `expr`, an Expected<T>: on an error returns its Status from the enclosing function,
// else moves the value into `lhs`, a declaration (`auto op`, `Value* v`) or a variable. XLA's
// TF_ASSIGN_OR_RETURN.
//   KILN_ASSIGN_OR_RETURN(Value* sum, builder.createValue(OpCode::Add, {a, b}));
#define KILN_ASSIGN_OR_RETURN(lhs, expr) \
  KILN_ASSIGN_OR_RETURN_IMPL(KILN_STATUS_CONCAT(kiln_expected_, __LINE__), lhs, expr)
#define KILN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp) return tmp.status();                   \
  lhs = tmp.take()
#define KILN_STATUS_CONCAT(a, b) KILN_STATUS_CONCAT_IMPL(a, b)
#define KILN_STATUS_CONCAT_IMPL(a, b) a##b

// Propagates a failed Status (or the error of an Expected whose value is not needed) out of the
// enclosing function.
#define KILN_RETURN_IF_ERROR(expr)                       \
  do {                                                   \
    ::kiln::Status kiln_status_ = ::kiln::statusOf(expr); \
    if (!kiln_status_.isOk()) return kiln_status_;        \
  } while (0)
