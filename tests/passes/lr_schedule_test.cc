// Learning-rate schedules against values computed by hand.
#include "passes/lr_schedule.h"

#include <cmath>

#include <gtest/gtest.h>

namespace kiln::passes {
namespace {

using ir::AttrDict;

TEST(LrSchedule, Constant) {
  AttrDict s{{"kind", "constant"}};
  ASSERT_TRUE(checkLrSchedule(s).isOk());
  EXPECT_EQ(learningRateFactor(s, 1), 1.0);
  EXPECT_EQ(learningRateFactor(s, 100000), 1.0);
  EXPECT_EQ(learningRateFactor(AttrDict{}, 7), 1.0);
}

TEST(LrSchedule, WarmupThenLinearDecay) {
  // Warmup over 4 steps, flat until step 10, then linear decay over 8 steps to 0.2.
  AttrDict s{{"kind", "warmup_decay"}, {"warmup_steps", 4}, {"decay_start", 10}, {"decay_steps", 8},
             {"end_factor", 0.2}};
  ASSERT_TRUE(checkLrSchedule(s).isOk());
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 1), 0.25);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 2), 0.5);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 4), 1.0);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 5), 1.0);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 10), 1.0);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 12), 0.2 + 0.8 * 0.75);  // 2 of 8 decay steps done
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 14), 0.6);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 18), 0.2);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 1000), 0.2);
}

TEST(LrSchedule, PolynomialDecay) {
  AttrDict s{{"kind", "warmup_decay"}, {"decay_start", 0}, {"decay_steps", 10}, {"power", 2.0}};
  ASSERT_TRUE(checkLrSchedule(s).isOk());
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 5), 0.25);  // (1 - 5/10)^2, end factor 0
  EXPECT_NEAR(learningRateFactor(s, 9), 0.01, 1e-15);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 10), 0.0);
}

TEST(LrSchedule, Exponential) {
  AttrDict s{{"kind", "exponential"}, {"decay_rate", 0.5}, {"decay_steps", 4}};
  ASSERT_TRUE(checkLrSchedule(s).isOk());
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 1), 1.0);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 5), 0.5);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 9), 0.25);
  EXPECT_DOUBLE_EQ(learningRateFactor(s, 3), std::sqrt(0.5));  // 0.5^(2/4)
  AttrDict stair = s;
  stair["staircase"] = true;
  EXPECT_DOUBLE_EQ(learningRateFactor(stair, 3), 1.0);
  EXPECT_DOUBLE_EQ(learningRateFactor(stair, 8), 0.5);
  AttrDict warm = s;
  warm["warmup_steps"] = 2;
  EXPECT_DOUBLE_EQ(learningRateFactor(warm, 1), 0.5);
  EXPECT_DOUBLE_EQ(learningRateFactor(warm, 3), 1.0);
  EXPECT_DOUBLE_EQ(learningRateFactor(warm, 7), 0.5);
}

TEST(LrSchedule, Errors) {
  auto message = [](AttrDict s) {
    Status st = checkLrSchedule(s);
    return st.isOk() ? std::string("ok") : st.message();
  };
  EXPECT_EQ(message({{"kind", "cosine"}}),
            "unknown lr_schedule kind 'cosine'; expected constant, warmup_decay or exponential");
  EXPECT_EQ(message({{"kind", "warmup_decay"}, {"warmup_step", 3}}), "lr_schedule 'warmup_decay' has no field 'warmup_step'");
  EXPECT_EQ(message({{"kind", "exponential"}, {"decay_rate", 0.5}}), "lr_schedule 'exponential' needs 'decay_steps'");
  EXPECT_EQ(message({{"kind", "warmup_decay"}, {"warmup_steps", -1}}), "lr_schedule: 'warmup_steps' must be >= 0, got -1");
  EXPECT_EQ(message({{"kind", "warmup_decay"}, {"warmup_steps", 10}, {"decay_start", 5}}),
            "lr_schedule: 'decay_start' (5) is before the end of warmup (10)");
}

}  // namespace
}  // namespace kiln::passes
