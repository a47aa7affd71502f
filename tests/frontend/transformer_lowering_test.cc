// Lowering tests of the transformer builtins: tensor comparisons and where, matmul, einsum,
// embedding, swiglu, attention and sequence cross entropy. Types, op counts and parameter
// names are worked out by hand from the model text; errors are checked for their message and
// their location.
#include <gtest/gtest.h>

#include <map>

#include "frontend/frontend.h"
#include "ir/printer.h"
#include "passes/autodiff.h"

namespace kiln::frontend {
namespace {

struct Lowered {
  std::unique_ptr<ir::Module> m;
  std::string diags;
  std::map<std::string, int> counts;          // op name -> count
  std::map<std::string, std::string> params;  // name -> type
  std::vector<std::string> results;           // result types of @forward
};

Lowered lower(const std::string& body) {
  DiagnosticEngine d;
  auto m = compileModelSource("t.kiln", body, {}, d);
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

// A model with the inputs below and `lines` as its body.
std::string model(const std::string& lines) {
  return "model m {\n dim B\n input x: f32[B, 4, 8]\n input v: f32[8]\n input n: i32[B, 4]\n" + lines +
         "\n}\n";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The one error of a model that must not lower, with its location (line 6 is `lines`' first).
std::string errorOf(const std::string& lines) {
  auto r = lower(model(lines));
  EXPECT_FALSE(r.m) << "lowered: " << lines;
  return r.diags;
}

TEST(TransformerLowering, TensorComparisonsGiveBooleanTensors) {
  auto r = lower(model(" a = x > 0\n b = 1.5 <= x\n c = x == v\n d = n != 3\n output a, b, c, d"));
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.compare"], 4);
  EXPECT_EQ(r.results, (std::vector<std::string>{"!kiln.tensor<Bx4x8xi1>", "!kiln.tensor<Bx4x8xi1>",
                                                 "!kiln.tensor<Bx4x8xi1>", "!kiln.tensor<Bx4xi1>"}));
  std::string text = ir::printModule(*r.m);
  for (const char* p : {"\"gt\"", "\"le\"", "\"eq\"", "\"ne\""})
    EXPECT_NE(text.find(p), std::string::npos) << p;
}

TEST(TransformerLowering, ComparisonErrorsAreLocated) {
  EXPECT_PRED2(contains, errorOf(" a = x < \"s\"\n output a"),
               "t.kiln:6:8: error: cannot compare a tensor f32[B,4,8] and "
               "the string \"s\"");
  // An integer tensor against a fraction would compare with a truncated number.
  EXPECT_PRED2(contains, errorOf(" a = n < 0.5\n output a"),
               "6:8: error: cannot compare a tensor i32[B,4] and the number 0.5");
  EXPECT_PRED2(contains, errorOf(" a = x < n\n output a"), "cannot compare f32[B,4,8] and i32[B,4]");
}

TEST(TransformerLowering, WhereSelectsWithBroadcasting) {
  auto r = lower(model(" y = where(x > v, x, 0)\n z = where(n > 0, 1.0, 2.0)\n output y, z"));
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.select"], 2);
  EXPECT_EQ(r.results, (std::vector<std::string>{"!kiln.tensor<Bx4x8xf32>", "!kiln.tensor<Bx4xf32>"}));
  EXPECT_PRED2(contains, errorOf(" y = where(x, x, 0)\n output y"),
               "6:12: error: where's condition must be a boolean tensor");
  EXPECT_PRED2(contains, errorOf(" y = where(n > 0, x, v)\n output y"),
               "where cannot select between f32[B,4,8] and f32[8] "
               "under i1[B,4]");
}

TEST(TransformerLowering, MatmulBroadcastsBatchDimsAndVectors) {
  auto r =
      lower(model(" w = parameter([3, 8, 5])\n a = reshape(x, [B, 1, 4, 8])\n y = matmul(a, w)\n"
                  " r = matmul(x, v)\n s = matmul(v, w)\n output y, r, s"));
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.matmul"], 3);
  EXPECT_EQ(r.results, (std::vector<std::string>{"!kiln.tensor<Bx3x4x5xf32>", "!kiln.tensor<Bx4xf32>",
                                                 "!kiln.tensor<3x5xf32>"}));
  EXPECT_PRED2(contains, errorOf(" y = matmul(x, x)\n output y"),
               "6:12: error: matmul cannot multiply f32[B,4,8] by f32[B,4,8]: "
               "the contracted dims 8 and 4 differ");
  EXPECT_PRED2(contains, errorOf(" w = parameter([3, 8, 5])\n y = matmul(x, w)\n output y"),
               "cannot broadcast the batch dims");
  EXPECT_PRED2(contains, errorOf(" y = matmul(n, n)\n output y"),
               "matmul's first operand must be a float tensor");
}

TEST(TransformerLowering, EinsumIsOneMatmulBetweenTransposes) {
  // Attention scores: batch b h, free q and k, contracted d: k is read transposed, no copies.
  auto r = lower(
      "model m {\n input q: f32[2, 3, 5, 4]\n input k: f32[2, 3, 6, 4]\n"
      " s = einsum(\"bhqd,bhkd->bhqk\", q, k)\n output s\n}\n");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.matmul"], 1);
  EXPECT_EQ(r.counts["kiln.transpose"], 0);
  EXPECT_EQ(r.results, std::vector<std::string>{"!kiln.tensor<2x3x5x6xf32>"});
  EXPECT_NE(ir::printModule(*r.m).find("transpose_b = true"), std::string::npos);

  // A symbolic batch label and an output order that needs a transpose.
  auto t = lower(model(" w = parameter([8, 6])\n y = einsum(\"bti,io->bot\", x, w)\n output y"));
  ASSERT_TRUE(t.m) << t.diags;
  EXPECT_EQ(t.counts["kiln.matmul"], 1);
  EXPECT_EQ(t.results, std::vector<std::string>{"!kiln.tensor<Bx6x4xf32>"});
}

TEST(TransformerLowering, EinsumRejectsWhatItDoesNotSupport) {
  auto spec = [](const std::string& s, const std::string& args) {
    return errorOf(" y = einsum(\"" + s + "\", " + args + ")\n output y");
  };
  EXPECT_PRED2(contains, spec("bii,bi->b", "x, x"),
               "6:13: error: einsum spec \"bii,bi->b\": label 'i' repeats in one operand");
  EXPECT_PRED2(contains, spec("...i,...i", "x, x"), "einsum does not support ellipsis");
  EXPECT_PRED2(contains, spec("bti,bti,bti->bt", "x, x, x"),
               "einsum takes one or two operands, the spec names 3");
  EXPECT_PRED2(contains, spec("bti,btj->bz", "x, x"), "output label 'z' is in no operand");
  EXPECT_PRED2(contains, spec("bti,bti->bt", "x"), "names 2 operand(s), got 1");
  EXPECT_PRED2(contains, spec("bt,bti->bt", "x, x"),
               "einsum labels \"bt\" need a tensor of rank 2, got f32[B,4,8]");
  EXPECT_PRED2(contains, spec("bti,bit->bt", "x, x"),
               "einsum label 't' is 4 in the first operand (f32[B,4,8]) and 8 in the "
               "second (f32[B,4,8])");
  // Two symbolic labels cannot merge into one dim of the IR.
  auto two = lower(
      "model m {\n dim B, T\n input x: f32[B, T, 8]\n w = parameter([8, 6])\n y = einsum(\"bti,io->bto\", x, "
      "w)\n output y\n}\n");
  EXPECT_PRED2(contains, two.diags, "5:12: error: einsum cannot merge the dims 'bt' of f32[B,T,8]");
}

TEST(TransformerLowering, EmbeddingIsADenseGatherOfANamedTable) {
  auto r = lower(model(" tok = embedding(n, 100, 16)\n output tok"));
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.params["tok.weight"], "!kiln.tensor<100x16xf32>");
  EXPECT_EQ(r.counts["kiln.gather"], 1);
  EXPECT_EQ(r.counts["kiln.embedding_bag"], 0);
  EXPECT_EQ(r.results, std::vector<std::string>{"!kiln.tensor<Bx4x16xf32>"});
  std::string text = ir::printModule(*r.m);
  EXPECT_NE(text.find("init = \"normal\""), std::string::npos);
  EXPECT_NE(text.find("mean = 0.0, name = \"tok.weight\", std = 0.02"), std::string::npos) << text;
  EXPECT_PRED2(contains, errorOf(" tok = embedding(x, 100, 16)\n output tok"),
               "6:18: error: embedding's tokens must be an "
               "integer tensor, got f32[B,4,8]");
}

TEST(TransformerLowering, SwigluGatesTheSecondHalf) {
  auto r = lower(model(" y = swiglu(x)\n output y"));
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.silu"], 1);
  EXPECT_EQ(r.counts["kiln.slice"], 2);
  EXPECT_EQ(r.results, std::vector<std::string>{"!kiln.tensor<Bx4x4xf32>"});
  EXPECT_PRED2(contains, errorOf(" y = swiglu(x[:, :, 0:3])\n output y"), "it must be even, got f32[B,4,3]");
}

TEST(TransformerLowering, AttentionNamesItsProjectionsAndGroupsHeads) {
  auto r = lower(model(" attn = attention(x, heads = 4, kv_heads = 2)\n output attn"));
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.params, (std::map<std::string, std::string>{{"attn.q.weight", "!kiln.tensor<8x8xf32>"},
                                                          {"attn.k.weight", "!kiln.tensor<4x8xf32>"},
                                                          {"attn.v.weight", "!kiln.tensor<4x8xf32>"},
                                                          {"attn.o.weight", "!kiln.tensor<8x8xf32>"}}));
  EXPECT_EQ(r.counts["kiln.matmul"], 6);  // four projections, scores, context
  EXPECT_EQ(r.counts["kiln.softmax"], 1);
  EXPECT_EQ(r.counts["kiln.select"], 1);  // the causal mask
  EXPECT_EQ(r.results, std::vector<std::string>{"!kiln.tensor<Bx4x8xf32>"});

  auto plain = lower(model(" a = attention(x, 2, causal = false, rope = false, head_dim = 3)\n output a"));
  ASSERT_TRUE(plain.m) << plain.diags;
  EXPECT_EQ(plain.counts["kiln.select"], 0);
  EXPECT_EQ(plain.counts["kiln.concat"], 0);  // no rotate-half
  EXPECT_EQ(plain.params["a.q.weight"], "!kiln.tensor<6x8xf32>");
  EXPECT_EQ(plain.params["a.o.weight"], "!kiln.tensor<8x6xf32>");

  // bf16 activations: the softmax still runs in f32.
  auto half = lower(model(" a = attention(cast(x, bf16), 2)\n output a"));
  ASSERT_TRUE(half.m) << half.diags;
  EXPECT_EQ(half.results, std::vector<std::string>{"!kiln.tensor<Bx4x8xbf16>"});
  EXPECT_NE(ir::printModule(*half.m).find("kiln.softmax\"(%"), std::string::npos);
}

TEST(TransformerLowering, AttentionErrors) {
  EXPECT_PRED2(contains, errorOf(" a = attention(x, 3)\n output a"), "heads (3) must divide the model dim 8");
  EXPECT_PRED2(contains, errorOf(" a = attention(x, 4, kv_heads = 3)\n output a"),
               "6:22: error: kv_heads (3) must divide heads (4)");
  EXPECT_PRED2(contains, errorOf(" a = attention(x, 2, head_dim = 3)\n output a"),
               "rope needs an even head_dim, got 3");
  EXPECT_PRED2(contains, errorOf(" a = attention(v, 2)\n output a"),
               "attention needs x: [B, T, D], got f32[8]");
  auto r = lower("model m {\n dim B, T\n input x: f32[B, T, 8]\n a = attention(x, 2)\n output a\n}\n");
  EXPECT_FALSE(r.m);
  EXPECT_NE(r.diags.find("4:16: error: attention needs a static sequence length (T a number or a param), got "
                         "f32[B,T,8]"),
            std::string::npos)
      << r.diags;
}

TEST(TransformerLowering, SequenceCrossEntropyFlattensTokensAndTrains) {
  std::string src =
      "model m {\n dim B\n param T = 4\n input tokens: i32[B, T] vocab(10)\n input label: i32[B, T]\n"
      " h = embedding(tokens, 10, 8)\n h = h + attention(h, 2, kv_heads = 1)\n"
      " logits = linear(swiglu(linear(h, 12, bias = false)), 10, bias = false)\n output logits\n"
      " train {\n  loss = softmax_cross_entropy(logits, label)\n  optimizer = adamw(lr = 0.001)\n }\n}\n";
  auto r = lower(src);
  ASSERT_TRUE(r.m) << r.diags;
  std::string text = ir::printModule(*r.m);
  EXPECT_NE(text.find("!kiln.tensor<4*Bx10xf32>"), std::string::npos) << text;
  EXPECT_NE(text.find("!kiln.tensor<4*Bxi32>"), std::string::npos) << text;
  Status s = passes::buildTrainStep(*r.m);
  EXPECT_TRUE(s.isOk()) << s.str();

  auto bad = lower(model(" y = linear(x, 5)\n l = softmax_cross_entropy(y, n[:, 0:2])\n output l"));
  EXPECT_FALSE(bad.m);
  EXPECT_NE(
      bad.diags.find("softmax_cross_entropy needs labels i32[B,4] (class ids) or f32[B,4,5] (probabilities)"),
      std::string::npos)
      << bad.diags;
}

TEST(TransformerLowering, TopkArgmaxAndTakeAlongAxis) {
  auto r = lower(
      model(" vals, idx = topk(x, 3)\n top = topk(x, 2, axis = 1)\n a = argmax(x, axis = 1)\n"
            " k = argmax(x, keepdims = true)\n g = take_along_axis(x, idx, -1)\n h = gather(x, top[1], 1)\n"
            " output vals, idx, a, k, g, h"));
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.counts["kiln.topk"], 4);
  EXPECT_EQ(r.counts["kiln.take_along_axis"], 2);
  EXPECT_EQ(r.results, (std::vector<std::string>{"!kiln.tensor<Bx4x3xf32>", "!kiln.tensor<Bx4x3xi32>",
                                                 "!kiln.tensor<Bx8xi32>", "!kiln.tensor<Bx4x1xi32>",
                                                 "!kiln.tensor<Bx4x3xf32>", "!kiln.tensor<Bx2x8xf32>"}));
}

TEST(TransformerLowering, SelectionErrors) {
  EXPECT_PRED2(contains, errorOf(" t = topk(x, 9)\n output t"),
               "6:14: error: topk cannot take 9 of the 8 entries along axis 2 of f32[B,4,8]");
  EXPECT_PRED2(contains, errorOf(" t = topk(n, 1)\n output t"), "topk's input must be a float tensor");
  EXPECT_PRED2(contains, errorOf(" t = topk(x, 1, axis = 3)\n output t"),
               "axis 3 is out of range for rank 3");
  EXPECT_PRED2(contains, errorOf(" t = take_along_axis(x, x, 1)\n output t"),
               "take_along_axis's indices must be an integer tensor, got f32[B,4,8]");
  EXPECT_PRED2(
      contains, errorOf(" t = gather(x, n, 1)\n output t"),
      "6:12: error: gather needs indices with the dims of f32[B,4,8] except along axis 1, got i32[B,4]");
  EXPECT_PRED2(contains, errorOf(" a, b = x\n output a"),
               "6:9: error: cannot unpack a tensor f32[B,4,8] into 2 names");
  EXPECT_PRED2(contains, errorOf(" a, b, c = topk(x, 2)\n output a"),
               "cannot unpack a list of 2 into 3 names");
}

// The decoder of docs/language.md, as printed there.
TEST(TransformerLowering, TheDocumentedDecoderLowersAndTrains) {
  auto r = lower(R"(
fn block(h, d, heads) {
  h = h + attention(rmsnorm(h), heads, kv_heads = heads / 2)
  up = linear(rmsnorm(h), 8 * d, bias = false)
  return h + linear(swiglu(up), d, bias = false)
}

model gpt {
  dim B
  param T = 128
  param vocab = 1000
  param d = 256
  input tokens: i32[B, T] vocab(vocab)
  input label: i32[B, T]

  h = embedding(tokens, vocab, d)
  for i in 0..4 { h = block(h, d, 8) }
  logits = linear(rmsnorm(h), vocab, bias = false)

  output logits
  train {
    loss = softmax_cross_entropy(logits, label)
    optimizer = adamw(lr = 3e-4, weight_decay = 0.1)
    grad_clip = 1.0
  }
}
)");
  ASSERT_TRUE(r.m) << r.diags;
  EXPECT_EQ(r.params["h.weight"], "!kiln.tensor<1000x256xf32>");
  EXPECT_EQ(r.params["block.3.attention.0.k.weight"], "!kiln.tensor<128x256xf32>");  // 4 kv heads of 32
  EXPECT_EQ(r.params["block.0.up.weight"], "!kiln.tensor<2048x256xf32>");
  EXPECT_EQ(r.params["logits.weight"], "!kiln.tensor<1000x256xf32>");
  EXPECT_EQ(r.counts["kiln.softmax"], 4);
  EXPECT_EQ(r.results, (std::vector<std::string>{"!kiln.tensor<Bx128x1000xf32>", "!kiln.tensor<f32>"}));
  Status s = passes::buildTrainStep(*r.m);
  EXPECT_TRUE(s.isOk()) << s.str();
}

}  // namespace
}  // namespace kiln::frontend
