#include "runtime/json.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace kiln::json {

namespace {

// Builds the document from nlohmann's SAX events, as ordered_json::parse does, and stops at the
// first error: a syntax error, a duplicate key, or nesting past kMaxDepth.
class DocumentBuilder final : public Json::json_sax_t {
 public:
  explicit DocumentBuilder(size_t text_bytes) : text_bytes_(text_bytes) {}
  Json root;
  std::string error;  // why parsing stopped

  bool null() override { return add(nullptr); }
  bool boolean(bool v) override { return add(v); }
  bool number_integer(Json::number_integer_t v) override { return add(v); }
  bool number_unsigned(Json::number_unsigned_t v) override { return add(v); }
  bool number_float(Json::number_float_t v, const Json::string_t&) override { return add(v); }
  bool string(Json::string_t& v) override { return add(std::move(v)); }
  bool binary(Json::binary_t& v) override { return add(Json::binary(std::move(v))); }  // not in JSON text

  bool start_object(std::size_t) override { return open(Json::object()); }
  bool key(Json::string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool end_object() override {
    // Readers that keep the first of two equal keys and readers that keep the last would see
    // two different checkpoints, so a duplicate is an error.
    std::vector<std::string_view> keys;
    for (const auto& member : open_.back()->get_ref<const Json::object_t&>()) keys.push_back(member.first);
    std::sort(keys.begin(), keys.end());
    auto dup = std::adjacent_find(keys.begin(), keys.end());
    if (dup != keys.end()) return fail(fmt::format("duplicate key \"{}\"", *dup));
    open_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return open(Json::array()); }
  bool end_array() override {
    open_.pop_back();
    return true;
  }

  bool parse_error(std::size_t bytes_read, const std::string&, const Json::exception& e) override {
    // The parser stopped on the last byte it read; reading the end of the text counts as a byte.
    size_t at = bytes_read > text_bytes_ ? text_bytes_ : std::max<size_t>(bytes_read, 1) - 1;
    // what() is "[json.exception.parse_error.101] parse error at line 1, column 6: syntax error ...".
    std::string_view why = e.what();
    if (size_t colon = why.find(": "); colon != std::string_view::npos) why.remove_prefix(colon + 2);
    return fail(fmt::format("invalid JSON at byte {}: {}", at, why));
  }

 private:
  bool fail(std::string why) {
    error = std::move(why);
    return false;
  }
  bool add(Json v) {
    place(std::move(v));
    return true;
  }
  bool open(Json container) {
    if (open_.size() >= kMaxDepth)
      return fail(fmt::format("invalid JSON: nested deeper than {} levels", kMaxDepth));
    open_.push_back(place(std::move(container)));
    return true;
  }
  // Puts a value into the innermost open array or object, or makes it the root. Pointers to open
  // containers stay valid: a container only grows while it is the innermost one.
  Json* place(Json v) {
    if (open_.empty()) return &(root = std::move(v));
    Json& parent = *open_.back();
    if (parent.is_array()) {
      parent.get_ref<Json::array_t&>().push_back(std::move(v));
      return &parent.back();
    }
    appendMember(parent, std::move(key_), std::move(v));  // end_object checks for duplicates
    return &parent.get_ref<Json::object_t&>().back().second;
  }

  size_t text_bytes_;
  std::vector<Json*> open_;  // the open arrays and objects, outermost first
  std::string key_;          // the key of the next object member
};

}  // namespace

Expected<Json> parse(std::string_view text) {
  DocumentBuilder builder(text.size());
  if (!Json::sax_parse(text.begin(), text.end(), &builder)) return Status::error(builder.error);
  return std::move(builder.root);
}

Expected<std::string> dump(const Json& value) {
  try {
    return value.dump();
  } catch (const Json::exception& e) {  // type_error 316: a string that is not UTF-8
    return Status::errorf("cannot write JSON: {}", e.what());
  }
}

void appendMember(Json& object, std::string key, Json value) {
  auto& members = object.get_ref<Json::object_t&>();
  members.Container::emplace_back(std::move(key), std::move(value));
}

std::optional<int64_t> asInt64(const Json& value) {
  if (value.is_number_unsigned()) {
    auto v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  return std::nullopt;
}

}  // namespace kiln::json
