// Our use of nlohmann-json (runtime/json.h): what a safetensors header needs, and untrusted text
// giving errors, never exceptions or crashes.
#include "runtime/json.h"

#include <cmath>

#include "test_util.h"

namespace kiln::json {
namespace {

TEST(Json, HeaderRoundTripKeepsOrderAndExactIntegers) {
  const std::string text =
      R"({"__metadata__":{"step":"50"},"z.weight":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},)"
      R"("a.bias":{"dtype":"I64","shape":[],"data_offsets":[48,9223372036854775807]}})";
  auto v = parse(text);
  ASSERT_TRUE(v.isOk()) << v.status().str();
  std::vector<std::string> keys;
  for (const auto& [k, _] : v->items()) keys.push_back(k);
  EXPECT_EQ(keys,
            (std::vector<std::string>{"__metadata__", "z.weight", "a.bias"}));  // file order, not sorted
  EXPECT_EQ(asInt64((*v)["a.bias"]["data_offsets"][1]), INT64_MAX);             // exact, not through a double
  EXPECT_EQ(*dump(*v), text);
}

TEST(Json, IntegersOutsideInt64AreNotIntegers) {
  auto v = parse(R"([-9223372036854775808, 9223372036854775808, 1e3, 2.0, "7", 18446744073709551616])");
  ASSERT_TRUE(v.isOk());
  EXPECT_EQ(asInt64((*v)[0]), INT64_MIN);
  for (size_t i = 1; i < v->size(); ++i) EXPECT_EQ(asInt64((*v)[i]), std::nullopt) << (*v)[i];
}

TEST(Json, WritesNonFiniteAsNullAndStringsEscaped) {
  Json v = {{"nan", std::nan("")}, {"inf", INFINITY}, {"x", 0.1}, {"s", std::string("a\"\x01\n\xc3\xa9")}};
  EXPECT_EQ(*dump(v), R"({"nan":null,"inf":null,"x":0.1,"s":"a\"\u0001\n)"
                      "\xc3\xa9"
                      R"("})");
  // Not UTF-8: an error from dump(), not a type_error thrown at the caller.
  auto bad = dump(Json(std::string("\xff")));
  ASSERT_FALSE(bad.isOk());
  EXPECT_NE(bad.status().message().find("UTF-8"), std::string::npos) << bad.status().message();
}

TEST(Json, MalformedInputIsAnErrorWithTheBytePosition) {
  struct Case {
    std::string text, error;
  };
  for (const Case& c : std::vector<Case>{{"{\"a\" 1}", "invalid JSON at byte 5: "},
                                         {"[1, 2", "invalid JSON at byte 5: "},
                                         {"\"abc", "invalid JSON at byte 4: "},
                                         {"1 2", "invalid JSON at byte 2: "},
                                         {"", "invalid JSON at byte 0: "},
                                         {"{1:2}", "invalid JSON at byte 1: "},
                                         {"tru", "invalid JSON at byte 3: "},
                                         {"\"\xff\"", "invalid JSON at byte 1: "},
                                         {"[1] // comment", "invalid JSON at byte 4: "},
                                         {"{\"a\":1,\"b\":{\"c\":2,\"c\":3}}", "duplicate key \"c\""},
                                         {std::string("[1,\0]", 5), "invalid JSON at byte 3: "}}) {
    auto v = parse(c.text);
    ASSERT_FALSE(v.isOk()) << c.text;
    EXPECT_NE(v.status().message().find(c.error), std::string::npos) << c.text << " -> " << v.status().message();
  }
}

TEST(Json, DeepNestingIsAnErrorNotAStackOverflow) {
  std::string ok = std::string(kMaxDepth, '[') + std::string(kMaxDepth, ']');
  auto v = parse(ok);
  ASSERT_TRUE(v.isOk()) << v.status().str();
  EXPECT_EQ(*dump(*v), ok);
  for (const std::string open : {"[", "{\"k\":"}) {
    std::string deep;
    for (int i = 0; i < 100000; ++i) deep += open;
    auto d = parse(deep);
    ASSERT_FALSE(d.isOk());
    EXPECT_NE(d.status().message().find("nested deeper than 64 levels"), std::string::npos)
        << d.status().message();
  }
  EXPECT_FALSE(parse("[" + ok + "]").isOk());
}

TEST(Json, ManyKeysParseInLinearTime) {
  // ordered_json::parse searches an object for every new key: 100000 members took 43 s there.
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += fmt::format("{}\"t{}\":{}", i ? "," : "", i, i);
  auto v = parse(text + "}");
  ASSERT_TRUE(v.isOk());
  EXPECT_EQ(v->size(), 200000u);
  EXPECT_EQ((*v)["t199999"], 199999);
  EXPECT_FALSE(parse(text + ",\"t5\":0}").isOk());  // the duplicate is still found
}

}  // namespace
}  // namespace kiln::json
