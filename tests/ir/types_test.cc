// Element types, dims and tensor types: text form both ways, broadcasting, symbolic products.
#include "ir/types.h"

#include <gtest/gtest.h>

namespace kiln::ir {
namespace {

TensorType parse(std::string_view body) {
  auto t = parseTensorTypeBody(body);
  EXPECT_TRUE(t.isOk()) << body << ": " << (t.isOk() ? "" : t.status().str());
  return t.isOk() ? *t : TensorType();
}

TEST(Types, EveryDimKindPrintsAndParses) {
  struct Case {
    std::string body;
    Dim::Kind kind;
    int64_t factor;
    std::string sym;
  };
  const Case cases[] = {
      {"128xf32", Dim::Kind::Static, 128, ""},        {"Bxf32", Dim::Kind::Symbolic, 1, "B"},
      {"26*Bxf32", Dim::Kind::Symbolic, 26, "B"},     {"?(4096)xi64", Dim::Kind::Bounded, 4096, ""},
      {"?(214*B)xi64", Dim::Kind::Bounded, 214, "B"}, {"?(T)xbf16", Dim::Kind::Bounded, 1, "T"},
  };
  for (const Case& c : cases) {
    TensorType t = parse(c.body);
    ASSERT_EQ(t.rank(), 1) << c.body;
    EXPECT_EQ(t.dim(0).kind(), c.kind) << c.body;
    EXPECT_EQ(t.dim(0).factor(), c.factor) << c.body;
    EXPECT_EQ(t.dim(0).sym(), c.sym) << c.body;
    EXPECT_EQ(t.str(), "!kiln.tensor<" + c.body + ">");
  }
}

TEST(Types, ScalarsAndEveryDType) {
  for (std::string_view name : {"f32", "f16", "bf16", "f8e4m3", "f8e5m2", "i32", "i64", "i1", "f64"}) {
    TensorType t = parse(name);
    EXPECT_EQ(t.rank(), 0);
    EXPECT_EQ(dtypeName(t.dtype()), name);
    EXPECT_EQ(t.str(), "!kiln.tensor<" + std::string(name) + ">");
  }
  EXPECT_EQ(dtypeBytes(DType::bf16), 2);
  EXPECT_EQ(dtypeBytes(DType::i1), 1);
  EXPECT_TRUE(isFloat(DType::f8e4m3));
  EXPECT_FALSE(isInteger(DType::i1));
}

TEST(Types, MixedShapeRoundTrips) {
  TensorType t = parse("Bx?(8*B)x13xf32");
  EXPECT_EQ(t.rank(), 3);
  EXPECT_TRUE(t.hasBoundedDims());
  EXPECT_FALSE(t.isStatic());
  EXPECT_EQ(t.str(), "!kiln.tensor<Bx?(8*B)x13xf32>");
  // Bounded dims evaluate at their bound: 4 * 32 * 13.
  EXPECT_EQ(t.numElements({{"B", 4}}), 4 * 32 * 13);
  EXPECT_EQ(t.bytes({{"B", 4}}), 4 * 32 * 13 * 4);
  EXPECT_FALSE(t.numElements({}).has_value());
}

TEST(Types, ShardingPrintsAndParses) {
  TensorType t = parse("1000000x128xf32, shard<8x1>");
  ASSERT_TRUE(t.sharding().has_value());
  EXPECT_EQ(t.sharding()->shards, (std::vector<int64_t>{8, 1}));
  EXPECT_EQ(t.str(), "!kiln.tensor<1000000x128xf32, shard<8x1>>");
  EXPECT_FALSE(t == t.withSharding(std::nullopt));
}

TEST(Types, BadTypesAreErrors) {
  for (std::string_view bad : {"Bx13xf33", "bx13xf32", "-1xf32", "?(?(4))xf32", "4xf32, shard<0>",
                               "4xf32, shard<2", "x4xf32", "", "0*Bxf32"}) {
    auto t = parseTensorTypeBody(bad);
    EXPECT_FALSE(t.isOk()) << "'" << bad << "' parsed as " << (t.isOk() ? t->str() : "");
  }
}

TEST(Types, Broadcast) {
  auto s = [](std::string_view body) { return parse(body).shape(); };
  auto b = broadcastShapes(s("Bx1x4xf32"), s("3x1xf32"));
  ASSERT_TRUE(b.isOk());
  EXPECT_EQ(shapeStr(*b), "Bx3x4");
  auto scalar = broadcastShapes(s("f32"), s("Bx4xf32"));
  ASSERT_TRUE(scalar.isOk());
  EXPECT_EQ(shapeStr(*scalar), "Bx4");
  auto sym = broadcastShapes(s("Bx4xf32"), s("Bx1xf32"));
  ASSERT_TRUE(sym.isOk());
  EXPECT_EQ(shapeStr(*sym), "Bx4");
  auto bad = broadcastShapes(s("3x4xf32"), s("5x4xf32"));
  ASSERT_FALSE(bad.isOk());
  // The error names both shapes.
  EXPECT_NE(bad.status().message().find("3x4"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("5x4"), std::string::npos) << bad.status().message();
}

TEST(Types, SymbolicProductComparesReshapes) {
  auto p = [](std::string_view body) { return symbolicProduct(parse(body).shape()); };
  EXPECT_EQ(p("Bx26x128xf32"), p("26*Bx128xf32"));
  EXPECT_EQ(p("Bx6xf32"), p("6xBxf32"));
  EXPECT_FALSE(p("Bx6xf32") == p("Bx7xf32"));
  EXPECT_FALSE(p("?(4)xf32").known);
  EXPECT_TRUE(isSymbolName("B_2"));
  EXPECT_FALSE(isSymbolName("b"));
}

}  // namespace
}  // namespace kiln::ir
