#include "runtime/json.h"
#include "test_util.h"

namespace kiln::json {
namespace {

TEST(Json, ParsesAndDumps) {
  auto v = parse(R"( {"a": [1, -2.5e3, true, false, null], "b": {"c": "x\"y\\z\n\u00e9"}, "big": 1152921504606846977} )");
  ASSERT_TRUE(v.isOk()) << v.status().str();
  EXPECT_EQ(v->find("a")->asArray()[1].asDouble(), -2500.0);
  EXPECT_EQ(v->find("big")->asInt(), 1152921504606846977LL);  // exact, not through a double
  EXPECT_EQ(v->find("b")->find("c")->asString(), "x\"y\\z\n\xc3\xa9");
  EXPECT_EQ(v->dump(), R"({"a":[1,-2500,true,false,null],"b":{"c":"x\"y\\z\n)" "\xc3\xa9" R"("},"big":1152921504606846977})");
  auto again = parse(v->dump());
  ASSERT_TRUE(again.isOk());
  EXPECT_EQ(again->dump(), v->dump());
  EXPECT_EQ(Value(0.1).dump(), "0.1");
  EXPECT_EQ(quote(std::string("a\x01", 2)), "\"a\\u0001\"");
}

TEST(Json, ErrorsGiveTheByteOffset) {
  struct Case {
    const char* text;
    const char* error;
  };
  for (const Case& c : {Case{"{\"a\" 1}", "invalid JSON at byte 5: expected ':'"}, Case{"[1, 2", "invalid JSON at byte 5: expected ',' or ']'"},
                        Case{"{\"a\":1,\"a\":2}", "duplicate key \"a\""}, Case{"\"abc", "unterminated string"},
                        Case{"1 2", "invalid JSON at byte 2: trailing characters"}, Case{"", "unexpected end of input"},
                        Case{"{1:2}", "expected a string key"}, Case{"tru", "expected a value"}}) {
    auto v = parse(c.text);
    ASSERT_FALSE(v.isOk()) << c.text;
    EXPECT_NE(v.status().message().find(c.error), std::string::npos) << c.text << " -> " << v.status().message();
  }
  std::string deep(100, '[');
  EXPECT_FALSE(parse(deep).isOk());
}

}  // namespace
}  // namespace kiln::json
