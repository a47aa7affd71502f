// Rematerialization and the peak estimator: the estimator equals codegen's planned peak on
// every model; a 60% budget brings DCNv2's training step at batch 16384 to 63% or below through
// the whole pipeline (60%: disabled, see below); recomputation leaves the training step's numbers
// unchanged; the pipeline keeps it after CSE.
#include "passes/remat.h"

#include <gtest/gtest.h>

#include <map>

#include "codegen/lower_cpu.h"
#include "ir/verifier.h"
#include "passes/cost_model.h"
#include "passes/fusion.h"
#include "passes/peak_memory.h"
#include "tests/passes/model_fixture.h"

namespace kiln::passes {
namespace {

using testing::kModels;
using testing::trainingModule;

int64_t plannedPeak(const ir::Function& f, int64_t batch) {
  auto p = codegen::lowerForCpu(f, {{"B", batch}});
  EXPECT_TRUE(p) << p.status().str();
  return p ? p->peak_bytes : -1;
}

TEST(MemoryBudget, Parses) {
  EXPECT_EQ(*parseMemoryBudget("60%", 1000), 600);
  EXPECT_EQ(*parseMemoryBudget("12345", 1000), 12345);
  EXPECT_FALSE(parseMemoryBudget("lots", 1000));
  EXPECT_FALSE(parseMemoryBudget("150%", 1000));
  EXPECT_FALSE(parseMemoryBudget("", 1000));
}

class PeakOnModels : public ::testing::TestWithParam<const char*> {};

TEST_P(PeakOnModels, EstimateEqualsCodegensPlanWithAndWithoutFusion) {
  auto m = trainingModule(GetParam());
  ASSERT_TRUE(m) << m.status().str();
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& f : (*m)->functions()) {
      auto est = estimatePeakBytes(*f, {{"B", 64}});
      ASSERT_TRUE(est) << est.status().str();
      EXPECT_EQ(*est, plannedPeak(*f, 64)) << f->name() << (pass ? " fused" : "");
    }
    ASSERT_TRUE(fuseModule(**m));
  }
}

// The smallest batch at which a 50% budget makes each model recompute something: below it the
// weights and their gradients, which recomputation cannot drop, set the peak.
int64_t rematBatch(const std::string& model) {
  static const std::map<std::string, int64_t> batch = {
      {"dlrm", 32}, {"dlrm_dcnv2", 32}, {"dcn", 256}, {"deepfm", 8}, {"wide_deep", 1024}};
  return batch.at(model);
}

TEST_P(PeakOnModels, RecomputationKeepsTheNumbers) {
  auto m = trainingModule(GetParam());
  auto reference = trainingModule(GetParam());
  ASSERT_TRUE(m && reference);
  const int64_t B = rematBatch(GetParam());
  auto r = rematerialize(**m, "50%", {{"B", B}});
  ASSERT_TRUE(r) << r.status().str();
  ASSERT_TRUE(ir::verify(**m).isOk()) << ir::verify(**m).str();
  EXPECT_FALSE(r->recomputed.empty());
  EXPECT_LT(r->peak_after, r->peak_before);
  EXPECT_EQ(r->peak_after, plannedPeak(*(*m)->lookup("train_step"), B));
  size_t marked = 0;
  (*m)->lookup("train_step")->walk([&](ir::Op& op) { marked += op.boolAttr("kiln.recompute"); });
  EXPECT_GE(marked, r->recomputed.size());
  EXPECT_EQ(recomputeFlops(*(*m)->lookup("train_step"), {{"B", B}}), r->recompute_flops);
  testing::expectSameTrainStep(**reference, **m, B);
}

INSTANTIATE_TEST_SUITE_P(Models, PeakOnModels, ::testing::ValuesIn(kModels));

// The training step after remat (under `budget`; none when empty), fusion (unless left out) and
// schedule at batch B, as `kiln dump --stats` runs them.
struct OptimizedStep {
  int64_t peak = 0;
  double flops = 0, recompute_flops = 0;
};
OptimizedStep optimizedStep(const char* model, const std::string& budget, int64_t batch, bool fusion = true) {
  auto m = trainingModule(model);
  EXPECT_TRUE(m) << m.status().str();
  if (!m) return {};
  (*m)->mutableAttrs()["kiln.symbols"] = ir::Attribute(ir::AttrDict{{"B", ir::Attribute(batch)}});
  PassManager pm;
  const std::string remat = budget.empty() ? "remat" : "remat{budget=" + budget + "}";
  EXPECT_TRUE(pm.addPipeline(remat + (fusion ? ",fusion,schedule" : ",schedule")).isOk());
  auto r = pm.run(**m);
  EXPECT_TRUE(r) << r.status().str();
  const ir::Function& f = *(*m)->lookup("train_step");
  OptimizedStep out;
  out.peak = plannedPeak(f, batch);
  CostModel cost(cpuTarget(), {{"B", batch}});
  for (const auto& op : f.entry().ops()) out.flops += cost.opCost(*op).flops;
  out.recompute_flops = recomputeFlops(f, {{"B", batch}});
  return out;
}

// Issue 6: at batch 16384 under a 60% budget, DCNv2's planned peak after the whole pipeline is
// at most 60% of the unbudgeted one (58.5% today: 1173159940 of 2004942852 bytes).
TEST(Remat, DcnV2At16384FitsSixtyPercent) {
  const OptimizedStep unbudgeted = optimizedStep("dlrm_dcnv2", "", 16384);
  const OptimizedStep budgeted = optimizedStep("dlrm_dcnv2", "60%", 16384);
  EXPECT_EQ(unbudgeted.recompute_flops, 0);
  EXPECT_LE(budgeted.peak, unbudgeted.peak * 6 / 10)
      << "unbudgeted " << unbudgeted.peak << ", planned " << budgeted.peak;
  EXPECT_GT(budgeted.recompute_flops, 0);
}

// The price follows the budget: 65% costs under a fifth of the step's flops in recomputation,
// 60% (where the cheap recomputations are used up) under 60%; fusion keeps the peak.
TEST(Remat, DcnV2At16384RecomputesLessUnderALooserBudget) {
  const OptimizedStep unbudgeted = optimizedStep("dlrm_dcnv2", "", 16384);
  const OptimizedStep loose = optimizedStep("dlrm_dcnv2", "65%", 16384);
  const OptimizedStep tight = optimizedStep("dlrm_dcnv2", "60%", 16384);
  const OptimizedStep unfused = optimizedStep("dlrm_dcnv2", "60%", 16384, /*fusion=*/false);
  EXPECT_LE(loose.peak, unbudgeted.peak * 65 / 100);
  EXPECT_LE(loose.recompute_flops, 0.2 * unbudgeted.flops) << loose.recompute_flops << " of " << unbudgeted.flops;
  EXPECT_LT(loose.recompute_flops, tight.recompute_flops);
  EXPECT_LE(tight.recompute_flops, 0.6 * unbudgeted.flops) << tight.recompute_flops << " of " << unbudgeted.flops;
  EXPECT_LE(tight.peak, unfused.peak);
}

// remat's own estimate is codegen's plan, and it lowers the peak well below the unbudgeted one.
TEST(Remat, DcnV2At16384EstimateIsThePlan) {
  auto m = trainingModule("dlrm_dcnv2");
  ASSERT_TRUE(m) << m.status().str();
  const int64_t unbudgeted = plannedPeak(*(*m)->lookup("train_step"), 16384);
  auto r = rematerialize(**m, "60%", {{"B", 16384}});
  ASSERT_TRUE(r) << r.status().str();
  EXPECT_EQ(r->peak_before, unbudgeted);
  EXPECT_EQ(plannedPeak(*(*m)->lookup("train_step"), 16384), r->peak_after);
  EXPECT_LE(r->peak_after, unbudgeted * 63 / 100)
      << "unbudgeted " << unbudgeted << ", planned " << r->peak_after;
  EXPECT_EQ(recomputeFlops(*(*m)->lookup("train_step"), {{"B", 16384}}), r->recompute_flops);
}

TEST(Remat, NothingToDoUnderABudgetThatFits) {
  auto m = trainingModule("dcn");
  ASSERT_TRUE(m);
  auto r = rematerialize(**m, "100%", {{"B", 8}});
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->recomputed.empty());
  EXPECT_EQ(r->peak_after, r->peak_before);
}

TEST(Remat, ThePipelineRefusesCseAfterRemat) {
  PassManager pm;
  ASSERT_TRUE(pm.addPipeline("remat,cse").isOk());
  Status s = pm.build();
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("'cse'"), std::string::npos) << s.message();
  PassManager ok;
  ASSERT_TRUE(ok.addPipeline("cse,remat,fusion,schedule").isOk());
  EXPECT_TRUE(ok.build().isOk());
}

}  // namespace
}  // namespace kiln::passes
