// Checked arithmetic for sizes that come from users and files: dims, element and byte counts,
// flag values, offsets, checkpoint steps. Each returns nullopt instead of a wrapped or saturated
// value, so the caller can report the overflow where it knows what the number was (a flag, a
// type, a file offset).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace kiln {

inline std::optional<int64_t> checkedMul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<int64_t> checkedAdd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<uint64_t> checkedMulU(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<uint64_t> checkedAddU(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// A whole decimal integer: an optional sign, then digits, nothing else (no spaces, no "1e3"). Out
// of the int64 range is nullopt, unlike strtoll, which saturates and leaves the caller to look at
// errno.
inline std::optional<int64_t> parseInt64(std::string_view s) {
  if (s.empty()) return std::nullopt;
  bool negative = s[0] == '-';
  if (s[0] == '-' || s[0] == '+') s.remove_prefix(1);
  if (s.empty()) return std::nullopt;
  // Accumulate negatively: INT64_MIN has no positive counterpart.
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    auto scaled = checkedMul(v, 10);
    if (!scaled) return std::nullopt;
    auto next = checkedAdd(*scaled, -(c - '0'));
    if (!next) return std::nullopt;
    v = *next;
  }
  if (negative) return v;
  if (v == std::numeric_limits<int64_t>::min()) return std::nullopt;
  return -v;
}

// Digits only (no sign), within the uint64 range.
inline std::optional<uint64_t> parseUint64(std::string_view s) {
  if (s.empty()) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    auto scaled = checkedMulU(v, 10);
    if (!scaled) return std::nullopt;
    auto next = checkedAddU(*scaled, static_cast<uint64_t>(c - '0'));
    if (!next) return std::nullopt;
    v = *next;
  }
  return v;
}

}  // namespace kiln
