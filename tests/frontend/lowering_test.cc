// Lowering tests: each construct of the language, checked against shapes, op counts and
// parameter names worked out by hand from the model text.
#include <gtest/gtest.h>

#include <map>

#include "frontend/frontend.h"
#include "ir/printer.h"

namespace kiln::frontend {
namespace {

struct Lowered {
  std::unique_ptr<ir::Module> m;
  std::string diags;
  std::map<std::string, int> counts;  // op name -> count
  std::map<std::string, std::string> params;  // name -> type
  std::vector<std::string> results;  // result types of @forward
};

Lowered lower(const std::string& body, const ParamOverrides& ov = {}) {
  DiagnosticEngine d;
  auto m = compileModelSource("t.kiln", body, ov, d);
  Lowered out;
  out.diags = d.str();
  if (!m) return out;
  out.m = m.take();
  ir::Function* f = out.m->lookup("forward");
  f->walk([&](ir::Op& op) {
    out.counts[op.name()]++;
    if (op.name() == "kiln.parameter") out.params[op.strAttr("name")] = op.result()->type().str();
  });
  for (const auto& t : f->resultTypes()) out.results.push_back(t.str());
  return out;
}

const char* kHead = "model m {\n dim B\n input x: f32[B, 8]\n input label: f32[B]\n";

TEST(Lowering, LinearKeepsWeightsOutByIn) {
  auto r = lower(std::string(kHead) + " y = linear(x, 3)\n output y\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.params["y.weight"], "!kiln.tensor<3x8xf32>");
  EXPECT_EQ(r.params["y.bias"], "!kiln.tensor<3xf32>");
  EXPECT_EQ(r.counts["kiln.matmul"], 1);
  EXPECT_EQ(r.counts["kiln.add"], 1);
  EXPECT_EQ(r.results, std::vector<std::string>{"!kiln.tensor<Bx3xf32>"});
  std::string text = ir::printModule(*r.m);
  EXPECT_NE(text.find("transpose_b = true"), std::string::npos);
  EXPECT_NE(text.find("kiln.outputs = [\"y\"]"), std::string::npos);
}

TEST(Lowering, MlpLayersAndLastActivation) {
  auto r = lower(std::string(kHead) + " h = mlp(x, [16, 4, 1], last = identity)\n output h\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.matmul"], 3);
  EXPECT_EQ(r.counts["kiln.relu"], 2);  // the last layer has no activation
  EXPECT_EQ(r.params["h.1.weight"], "!kiln.tensor<4x16xf32>");
  EXPECT_EQ(r.params["h.2.weight"], "!kiln.tensor<1x4xf32>");
}

TEST(Lowering, UserFunctionsLoopsAndScopedNames) {
  auto r = lower(
      "fn block(x, n) { h = linear(x, n)\n return relu(h) }\n" + std::string(kHead) +
      " y = x\n for i in 0..3 { y = block(y, 8) }\n top = block(y, 2)\n output top\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.matmul"], 4);
  EXPECT_EQ(r.params.count("block.0.h.weight"), 1u);
  EXPECT_EQ(r.params.count("block.2.h.weight"), 1u);
  EXPECT_EQ(r.params["top.h.weight"], "!kiln.tensor<2x8xf32>");
}

TEST(Lowering, ParamsListsAndOverrides) {
  std::string src = "model m {\n dim B\n param n = 4\n param sizes = [n * 2, n]\n input x: f32[B, 8]\n"
                    " y = mlp(x, sizes)\n output y\n}\n";
  auto r = lower(src);
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.results[0], "!kiln.tensor<Bx4xf32>");
  auto o = lower(src, {{"n", "3"}});
  ASSERT_TRUE(o.m) << o.diags;
  EXPECT_EQ(o.results[0], "!kiln.tensor<Bx3xf32>");
  EXPECT_EQ(o.params["y.0.weight"], "!kiln.tensor<6x8xf32>");
  auto bad = lower(src, {{"nope", "1"}});
  EXPECT_FALSE(bad.m);
  EXPECT_NE(bad.diags.find("has no param 'nope'"), std::string::npos);
}

TEST(Lowering, SparseInputsAndEmbeddings) {
  auto r = lower(
      "model m {\n dim B\n param rows = [50, 5000]\n input c: ids[B, 2] hotness([3, 1])\n"
      " input v: ids[B] max_hotness(4) weighted id_map(hash)\n"
      " t = embeddings(rows = min(rows, 100), dim = 4)\n u = embeddings(rows = 7, dim = 4, pool = mean)\n"
      " y = concat(t(c), u(v))\n output y\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.embedding_bag"], 3);
  EXPECT_EQ(r.counts["kiln.input"], 5);  // c.0, c.1, v, v.lengths, v.weights
  EXPECT_EQ(r.params["t.0"], "!kiln.tensor<50x4xf32>");
  EXPECT_EQ(r.params["t.1"], "!kiln.tensor<100x4xf32>");
  EXPECT_EQ(r.results[0], "!kiln.tensor<Bx12xf32>");
  std::string text = ir::printModule(*r.m);
  EXPECT_NE(text.find("{feature = 1, hotness = 1, id_map = \"modulo\", name = \"c.1\", role = \"sparse\", rows = 100}"),
            std::string::npos) << text;
  EXPECT_NE(text.find("!kiln.tensor<?(4*B)xi64>"), std::string::npos);
  EXPECT_NE(text.find("role = \"lengths\""), std::string::npos);
  EXPECT_NE(text.find("embedding = true"), std::string::npos);
}

TEST(Lowering, EmbeddingShardPin) {
  // Every table of the collection carries the pin; a quoted name is the same pin.
  auto r = lower(
      "model m {\n dim B\n input c: ids[B, 2]\n input v: ids[B]\n"
      " t = embeddings(rows = 10, dim = 4, count = 2, shard = column_wise)\n"
      " u = embeddings(rows = 7, dim = 4, shard = \"table_wise\")\n"
      " y = concat(t(c), u(v))\n output y\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  std::string text = ir::printModule(*r.m);
  EXPECT_NE(text.find("name = \"t.0\", shard = \"column_wise\""), std::string::npos) << text;
  EXPECT_NE(text.find("name = \"t.1\", shard = \"column_wise\""), std::string::npos) << text;
  EXPECT_NE(text.find("name = \"u.0\", shard = \"table_wise\""), std::string::npos) << text;
}

TEST(Lowering, DotInteractionShape) {
  // 1 dense + 3 embeddings = 4 features: 4*3/2 = 6 pairs after the 4-wide dense vector.
  auto r = lower("model m {\n dim B\n input d: f32[B, 4]\n input c: ids[B, 3]\n"
                 " t = embeddings(rows = 10, dim = 4, count = 3)\n z = dot_interaction(d, t(c))\n output z\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.results[0], "!kiln.tensor<Bx10xf32>");
  EXPECT_EQ(r.counts["kiln.gather"], 1);
  std::string text = ir::printModule(*r.m);
  EXPECT_NE(text.find("value = [4, 8, 9, 12, 13, 14]"), std::string::npos) << text;
}

TEST(Lowering, CrossFullAndLowRank) {
  auto r = lower(std::string(kHead) + " a = cross(x, x)\n b = cross(x, a, rank = 2)\n output b\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.params["a.weight"], "!kiln.tensor<8x8xf32>");
  EXPECT_EQ(r.params["b.v"], "!kiln.tensor<2x8xf32>");
  EXPECT_EQ(r.params["b.u"], "!kiln.tensor<8x2xf32>");
  EXPECT_EQ(r.counts["kiln.matmul"], 3);
  EXPECT_EQ(r.results[0], "!kiln.tensor<Bx8xf32>");
}

TEST(Lowering, FmNormsAndSlicing) {
  auto r = lower("model m {\n dim B\n input x: f32[B, 8]\n input c: ids[B, 2]\n"
                 " t = embeddings(rows = 10, dim = 3, count = 2)\n f = fm(t(c))\n"
                 " n = layernorm(x[:, 2:6])\n r = rmsnorm(x[:, 1:3])\n output f, n, r\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.results, (std::vector<std::string>{"!kiln.tensor<Bx1xf32>", "!kiln.tensor<Bx4xf32>", "!kiln.tensor<Bx2xf32>"}));
  EXPECT_EQ(r.params["n.weight"], "!kiln.tensor<4xf32>");
  EXPECT_EQ(r.params["n.bias"], "!kiln.tensor<4xf32>");
  EXPECT_EQ(r.params.count("r.bias"), 0u);
  EXPECT_EQ(r.counts["kiln.slice"], 2);
  EXPECT_EQ(r.counts["kiln.rsqrt"], 2);
}

TEST(Lowering, TrainBlockAttributes) {
  auto r = lower(std::string(kHead) +
                 " logit = linear(x, 1)\n output logit\n train {\n loss = bce_with_logits(logit, label)\n"
                 " optimizer = adamw(lr = 0.002)\n lr_schedule = warmup_decay(warmup_steps = 10)\n"
                 " precision = bf16\n grad_clip = 1.5\n }\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.results.size(), 2u);
  const ir::AttrDict& t = r.m->attrs().at("kiln.train").asDict();
  EXPECT_EQ(t.at("loss").asString(), "loss");
  EXPECT_EQ(t.at("prediction").asString(), "logit");
  EXPECT_EQ(t.at("label").asString(), "label");
  EXPECT_EQ(t.at("optimizer").asDict().at("kind").asString(), "adamw");
  EXPECT_DOUBLE_EQ(t.at("optimizer").asDict().at("lr").asDouble(), 0.002);
  EXPECT_DOUBLE_EQ(t.at("optimizer").asDict().at("beta2").asDouble(), 0.999);
  EXPECT_EQ(t.at("embedding_optimizer").asDict().at("kind").asString(), "adam");
  EXPECT_EQ(t.at("lr_schedule").asDict().at("warmup_steps").asInt(), 10);
  EXPECT_EQ(t.at("precision").asString(), "bf16");
  EXPECT_DOUBLE_EQ(t.at("grad_clip").asDouble(), 1.5);
  EXPECT_EQ(r.m->attrs().at("kiln.outputs").str(), "[\"logit\", \"loss\"]");
  std::string text = ir::printModule(*r.m);
  EXPECT_NE(text.find("role = \"label\""), std::string::npos);
}

TEST(Lowering, BroadcastingArithmeticWithScalars) {
  auto r = lower(std::string(kHead) + " y = 2 * x - x / 4 + 1\n output y\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.constant"], 3);
  EXPECT_EQ(r.counts["kiln.mul"], 1);
  EXPECT_EQ(r.counts["kiln.div"], 1);
  EXPECT_EQ(r.counts["kiln.sub"], 1);
  EXPECT_EQ(r.counts["kiln.add"], 1);
}

TEST(Lowering, OpsCarryKilnLocations) {
  auto r = lower(std::string(kHead) + " y = relu(x)\n output y\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  bool found = false;
  r.m->lookup("forward")->walk([&](ir::Op& op) {
    if (op.name() == "kiln.relu") {
      found = true;
      EXPECT_EQ(op.location().file, "t.kiln");
      EXPECT_EQ(op.location().line, 5);
      EXPECT_EQ(op.location().col, 10);  // a call is located at its "("
    }
  });
  EXPECT_TRUE(found);
}

TEST(Lowering, UnusedValuesWarn) {
  auto r = lower(std::string(kHead) + " unused = relu(x)\n y = x\n output y\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_NE(r.diags.find("t.kiln:5:2: warning: value 'unused' is never used"), std::string::npos) << r.diags;
  EXPECT_NE(r.diags.find("warning: input 'label' is never used"), std::string::npos) << r.diags;
}

TEST(Lowering, ShippedModelsCheckClean) {
  for (const char* name : {"dlrm", "dlrm_dcnv2", "dcn", "deepfm", "wide_deep"}) {
    DiagnosticEngine d;
    auto m = compileModelFile(std::string(KILN_SOURCE_DIR) + "/models/" + name + ".kiln", {{"rows_cap", "1000"}}, d);
    EXPECT_TRUE(m.isOk()) << name << ": " << d.str();
    EXPECT_EQ(d.warningCount(), 0) << name << ": " << d.str();
  }
}

}  // namespace
}  // namespace kiln::frontend
