// driver::Session's compile options: train-block overrides (what r1_bench uses to run R1 with SGD)
// and the memory budget reach the pipeline.
#include "tools/session_flags.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <sstream>

namespace kiln::cli {
namespace {

driver::SessionOptions smallDcnV2() {
  driver::SessionOptions o;
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

TEST(DriverSession, TrainOverridesReplaceTheModelsOptimizers) {
  std::ostringstream diag;
  auto plain = driver::Session::create(smallDcnV2(), diag);
  ASSERT_TRUE(plain) << plain.status().str() << diag.str();
  auto kinds = optimizerKinds(*(*plain)->module().lookup("train_step"));
  EXPECT_GT(kinds.count("dense:adagrad"), 0u);
  EXPECT_EQ(kinds.count("table:rowwise_adagrad"), 26u);

  driver::SessionOptions o = smallDcnV2();
  const ir::AttrDict sgd = {{"kind", ir::Attribute(std::string("sgd"))}, {"lr", ir::Attribute(0.01)}};
  o.train_overrides = {{"optimizer", ir::Attribute(sgd)}, {"embedding_optimizer", ir::Attribute(sgd)}};
  auto s = driver::Session::create(o, diag);
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

TEST(DriverSession, MemoryBudgetRecomputesInTheTrainingStep) {
  std::ostringstream diag;
  driver::SessionOptions o = smallDcnV2();
  o.batch = 256;  // at 64 the weights dominate the peak and nothing is worth recomputing
  o.memory_budget = "70%";
  auto s = driver::Session::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  int recomputed = 0;
  (*s)->module().lookup("train_step")->walk([&](ir::Op& op) { recomputed += op.boolAttr("kiln.recompute"); });
  EXPECT_GT(recomputed, 0);
}

driver::SessionOptions tiny(int64_t batch) {
  driver::SessionOptions o;
  o.model_path = std::string(KILN_SOURCE_DIR) + "/tests/reliability/Inputs/tiny.kiln";
  o.batch = batch;
  return o;
}

uint64_t kindBytes(const runtime::MemoryNeed& need, const std::string& kind) {
  for (const auto& [k, bytes] : need.byKind())
    if (k == kind) return bytes;
  return 0;
}

// Issue 12, defect 2: what the memory check counts is what the session allocates. The tiny model
// by hand: 26 tables of 200x4 f32 and an MLP 117 -> 16 -> 1; rowwise adagrad keeps one f32 per
// table row, adam two copies of each dense weight; a sample is 13 dense f32, 26 i64 ids and an
// f32 label.
TEST(DriverSession, MemoryNeedIsWhatTheSessionAllocates) {
  std::ostringstream diag;
  driver::SessionOptions o = tiny(256);
  auto s = driver::Session::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  auto need = driver::estimateSessionMemory((*s)->module(), o, (*s)->trainSpec());
  ASSERT_TRUE(need) << need.status().str();
  const uint64_t dense = 16 * 117 + 16 + 1 * 16 + 1;
  const uint64_t weights = (26 * 200 * 4 + dense) * 4, state = (26 * 200 + 2 * dense) * 4;
  EXPECT_EQ(kindBytes(*need, "weights"), weights);
  EXPECT_EQ(kindBytes(*need, "optimizer state"), state);
  EXPECT_EQ(static_cast<uint64_t>((*s)->params().totalBytes()), weights + state);
  EXPECT_EQ(kindBytes(*need, "data buffers"),
            uint64_t{driver::kTrainPrefetchDepth + 2} * 256 * (13 * 4 + 26 * 8 + 4));
  EXPECT_EQ(kindBytes(*need, "workspace"), uint64_t{4 + 256 * 4});  // the loss and one prediction per sample
  auto peak = driver::plannedPeakBytes(*(*s)->module().lookup("train_step"), 256);
  ASSERT_TRUE(peak) << peak.status().str();
  EXPECT_EQ(kindBytes(*need, "activations"), static_cast<uint64_t>(*peak));
  // Evaluation runs @forward with its own prefetch depth and counts the checkpoint it loads.
  driver::SessionOptions e = tiny(64);
  e.training = false;
  e.checkpoint_path =
      std::string(KILN_SOURCE_DIR) + "/tests/reliability/Inputs/tiny.kiln";  // any file: its size
  auto es = driver::Session::create(e, diag);
  ASSERT_TRUE(es) << es.status().str() << diag.str();
  auto eneed = driver::estimateSessionMemory((*es)->module(), e, (*es)->forwardSpec());
  ASSERT_TRUE(eneed) << eneed.status().str();
  EXPECT_EQ(kindBytes(*eneed, "weights"), weights);
  EXPECT_EQ(kindBytes(*eneed, "optimizer state"), 0u);
  EXPECT_EQ(kindBytes(*eneed, "data buffers"), uint64_t{driver::kEvalPrefetchDepth + 2} * 64 * (13 * 4 + 26 * 8 + 4));
  EXPECT_EQ(kindBytes(*eneed, "checkpoint"), std::filesystem::file_size(e.checkpoint_path));
}

TEST(DriverSession, ARunThatCannotFitStopsBeforeAllocating) {
  std::ostringstream diag;
  driver::SessionOptions o = tiny(256);
  o.memory_limit = 100000;
  auto s = driver::Session::create(o, diag);
  ASSERT_FALSE(s);
  const std::string& m = s.status().message();
  EXPECT_NE(m.find("not enough memory: the run needs"), std::string::npos) << m;
  EXPECT_NE(m.find("97.7 KiB (100000 bytes) are available"), std::string::npos) << m;
  EXPECT_NE(m.find("limit: --memory-limit"), std::string::npos) << m;
  EXPECT_NE(m.find("6 batches of 256 samples (data buffers)"), std::string::npos) << m;
  EXPECT_NE(m.find("raise --memory-limit"), std::string::npos) << m;
}

// Issue 12, defect 11: the --memory-budget warning reports the planned peak of the step as it
// runs (what `kiln dump --stats` prints), not remat's estimate before fusion and the schedule.
TEST(DriverSession, MemoryBudgetWarningReportsThePlannedPeak) {
  std::ostringstream diag;
  driver::SessionOptions o = tiny(32);
  o.memory_budget = "10%";
  auto s = driver::Session::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  auto peak = driver::plannedPeakBytes(*(*s)->module().lookup("train_step"), 32);
  ASSERT_TRUE(peak) << peak.status().str();
  EXPECT_NE(diag.str().find(fmt::format("planned peak down to {} bytes,", *peak)), std::string::npos)
      << diag.str();
}

}  // namespace
}  // namespace kiln::cli
