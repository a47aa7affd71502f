// The statistic names shared by `kiln train`'s progress line and evaluation (driver/evaluator.h).
#include "driver/evaluator.h"

#include <gtest/gtest.h>

namespace kiln::driver {
namespace {

TEST(TaskLossIndex, ReadsTheTaskOfATaskLossStatistic) {
  EXPECT_EQ(taskLossIndex("task_loss.0"), std::optional<size_t>(0));
  EXPECT_EQ(taskLossIndex("task_loss.12"), std::optional<size_t>(12));
}

TEST(TaskLossIndex, IgnoresEveryOtherName) {
  for (const char* name : {"loss", "task_loss", "task_loss.", "task_loss.x", "task_loss.1a", "task_loss.-1",
                           "task_loss. 1", "my_task_loss.1", "grad_norm"})
    EXPECT_EQ(taskLossIndex(name), std::nullopt) << name;
}

}  // namespace
}  // namespace kiln::driver
