// JSON for the files the runtime writes and reads back (safetensors headers, metrics lines), by
// nlohmann-json. `ordered_json` keeps key order, so a header lists its tensors in data order.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "ir/status.h"

namespace kiln::json {

using Json = nlohmann::ordered_json;

// The deepest nesting parse() accepts. nlohmann's parser and destructor are iterative, but its
// dump, copy and comparison recurse: a 100000-deep array from a hostile file would overflow the
// stack there. A safetensors header nests three levels.
inline constexpr size_t kMaxDepth = 64;

// Parses one whole document and never throws. Errors: "invalid JSON at byte N: ...", a duplicate
// key in an object, nesting deeper than kMaxDepth. Building is linear in the number of keys
// (ordered_json::parse searches every object for each new key: quadratic).
Expected<Json> parse(std::string_view text);

// Compact text: {"a":1,"b":[true,null]}. Non-finite doubles are written as null; a string that is
// not UTF-8 is an error, not an exception.
Expected<std::string> dump(const Json& value);

// Appends a member to an object without ordered_json's linear search for an equal key (which makes
// building an object of n members quadratic). The caller knows `key` is new.
void appendMember(Json& object, std::string key, Json value);

// The value of an integer that fits int64_t, else nullopt (floats, strings, 2^63 and above).
std::optional<int64_t> asInt64(const Json& value);

}  // namespace kiln::json
