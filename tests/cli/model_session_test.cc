// ModelSession's compile options: train-block overrides (what r1_bench uses to run R1 with SGD)
// and the memory budget reach the pipeline.
#include "tools/model_session.h"

#include <gtest/gtest.h>

#include <set>
#include <sstream>

namespace kiln::cli {
namespace {

SessionOptions smallDcnV2() {
  SessionOptions o;
  o.model_path = std::string(KILN_SOURCE_DIR) + "/models/dlrm_dcnv2.kiln";
  o.overrides = {{"rows_cap", "300"}, {"emb_dim", "8"}, {"cross_rank", "8"}, {"top", "[16, 1]"}};
  o.batch = 64;
  return o;
}

// The optimizer kinds the training step applies: dense updates and embedding updates.
std::multiset<std::string> optimizerKinds(const ir::Function& f) {
  std::multiset<std::string> kinds;
  for (const ir::Op* op : f.entry().opList()) {
    std::vector<const ir::Op*> ops = {op};
    if (!op->regions().empty())
      for (const auto& inner : op->regions().front()->front().ops()) ops.push_back(inner.get());
    for (const ir::Op* o : ops) {
      if (o->name() == "kiln.optimizer_update") kinds.insert("dense:" + o->strAttr("kind"));
      if (o->name() == "kiln.embedding_bag_update") kinds.insert("table:" + o->strAttr("optimizer"));
    }
  }
  return kinds;
}

TEST(ModelSession, TrainOverridesReplaceTheModelsOptimizers) {
  std::ostringstream diag;
  auto plain = ModelSession::create(smallDcnV2(), diag);
  ASSERT_TRUE(plain) << plain.status().str() << diag.str();
  auto kinds = optimizerKinds(*(*plain)->module().lookup("train_step"));
  EXPECT_GT(kinds.count("dense:adagrad"), 0u);
  EXPECT_EQ(kinds.count("table:rowwise_adagrad"), 26u);

  SessionOptions o = smallDcnV2();
  const ir::AttrDict sgd = {{"kind", ir::Attribute(std::string("sgd"))}, {"lr", ir::Attribute(0.01)}};
  o.train_overrides = {{"optimizer", ir::Attribute(sgd)}, {"embedding_optimizer", ir::Attribute(sgd)}};
  auto s = ModelSession::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  kinds = optimizerKinds(*(*s)->module().lookup("train_step"));
  EXPECT_EQ(kinds.count("table:sgd"), 26u);
  EXPECT_EQ(kinds.count("dense:sgd"), kinds.size() - 26u);
  EXPECT_EQ(kinds.count("dense:adagrad"), 0u);
  // SGD keeps no state: no accumulator parameters are created.
  for (const ir::Op* op : (*s)->module().lookup("train_step")->entry().opList()) {
    if (op->name() != "kiln.parameter") continue;
    EXPECT_FALSE(op->hasAttr("state_of")) << op->strAttr("name");
  }
}

TEST(ModelSession, MemoryBudgetRecomputesInTheTrainingStep) {
  std::ostringstream diag;
  SessionOptions o = smallDcnV2();
  o.batch = 256;  // at 64 the weights dominate the peak and nothing is worth recomputing
  o.memory_budget = "70%";
  auto s = ModelSession::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  int recomputed = 0;
  (*s)->module().lookup("train_step")->walk([&](ir::Op& op) { recomputed += op.boolAttr("kiln.recompute"); });
  EXPECT_GT(recomputed, 0);
}

}  // namespace
}  // namespace kiln::cli
