// The CUDA executor's input pipeline, without a GPU: the staging layout, the operations each
// stage/launch/collect issues, the refusals of unsafe calls, and the hazard checker over the
// schedules the trainer and run() use (and over orders missing one kind of wait, which it must
// flag: every wait the pipeline issues is needed).
#include "runtime/cuda/input_pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace kiln::cuda {
namespace {

using K = PipelineOpKind;

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

std::vector<K> kinds(const std::vector<PipelineOp>& ops) {
  std::vector<K> out;
  for (const PipelineOp& op : ops) out.push_back(op.kind);
  return out;
}

TEST(StagingLayout, AlignsEveryTensorAndCountsTheTotal) {
  StagingLayout l = StagingLayout::plan({13 * 4 * 2, 0, 5, 256}, 64);
  EXPECT_EQ(l.offset, (std::vector<size_t>{0, 128, 128, 192}));
  EXPECT_EQ(l.bytes, (std::vector<size_t>{104, 0, 5, 256}));
  EXPECT_EQ(l.total, 448u);
  for (size_t o : l.offset) EXPECT_EQ(o % 64, 0u);
  // No tensors (a function without inputs) still gets an address.
  EXPECT_EQ(StagingLayout::plan({}, 64).total, 1u);
}

TEST(InputPipeline, FirstUseOfASlotWaitsForNothingLaterUsesWait) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  auto t0 = p.stage(ops);
  ASSERT_TRUE(t0) << t0.status().message();
  EXPECT_EQ(*t0, 0);
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::FillPinned, K::Upload, K::RecordUploaded}));
  ops.clear();
  ASSERT_TRUE(p.launch(0, ops));
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::ComputeWaitUploaded, K::CopyIn, K::RecordConsumed, K::RunStep,
                                        K::Download, K::RecordDone}));
  for (const PipelineOp& op : ops) EXPECT_EQ(op.slot, 0);
  ops.clear();
  ASSERT_TRUE(p.stage(ops));  // ticket 1, slot 1: first use
  ASSERT_TRUE(p.collect(0, ops));
  ASSERT_TRUE(p.launch(1, ops));
  ops.clear();
  auto t2 = p.stage(ops);  // slot 0 again: waits for its upload and for step 0's CopyIn
  ASSERT_TRUE(t2);
  EXPECT_EQ(*t2, 2);
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::HostWaitUploaded, K::FillPinned, K::CopyWaitConsumed, K::Upload,
                                        K::RecordUploaded}));
  for (const PipelineOp& op : ops) EXPECT_EQ(op.slot, 0);
}

// The trainer's order: launch step i, stage step i+1 while it runs, collect step i.
std::vector<PipelineOp> trainerSchedule(InputPipeline& p, int steps) {
  std::vector<PipelineOp> ops;
  auto current = p.stage(ops);
  EXPECT_TRUE(current);
  for (int i = 0; i < steps; ++i) {
    EXPECT_TRUE(p.launch(*current, ops));
    Expected<int64_t> next = Status::error("last step");
    if (i + 1 < steps) {
      next = p.stage(ops);
      EXPECT_TRUE(next) << next.status().message();
    }
    EXPECT_TRUE(p.collect(*current, ops));
    if (next) current = next;
  }
  return ops;
}

// Two batches ahead: stage i+2 before step i is collected (the deepest the slots allow).
std::vector<PipelineOp> deepSchedule(InputPipeline& p, int steps) {
  std::vector<PipelineOp> ops;
  std::vector<int64_t> tickets;
  for (int i = 0; i < 2; ++i) tickets.push_back(*p.stage(ops));
  for (int i = 0; i < steps; ++i) {
    EXPECT_TRUE(p.launch(tickets[static_cast<size_t>(i)], ops));
    if (i + 2 < steps) {
      auto t = p.stage(ops);
      EXPECT_TRUE(t) << t.status().message();
      tickets.push_back(*t);
    }
    if (i >= 1) {
      EXPECT_TRUE(p.collect(tickets[static_cast<size_t>(i - 1)], ops));
    }
  }
  EXPECT_TRUE(p.collect(tickets.back(), ops));
  return ops;
}

TEST(InputPipeline, TrainerOrderIsSafeWithOneOrTwoSlots) {
  for (int slots : {1, 2, 3}) {
    InputPipeline p(slots);
    std::vector<PipelineOp> ops = trainerSchedule(p, 10);
    EXPECT_EQ(joined(findPipelineHazards(ops, slots)), "") << slots << " slots";
    EXPECT_TRUE(p.staged().empty());
    EXPECT_TRUE(p.inFlight().empty());
  }
}

TEST(InputPipeline, RunOrderIsSafe) {
  InputPipeline p;
  std::vector<PipelineOp> ops;
  for (int i = 0; i < 5; ++i) {
    auto t = p.stage(ops);
    ASSERT_TRUE(t);
    ASSERT_TRUE(p.launch(*t, ops));
    ASSERT_TRUE(p.collect(*t, ops));
  }
  EXPECT_EQ(joined(findPipelineHazards(ops, p.slots())), "");
}

TEST(InputPipeline, TwoAheadIsSafe) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops = deepSchedule(p, 8);
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
}

// Without any one kind of wait the deep order races: the checker must say so, naming the memory.
TEST(InputPipeline, EveryKindOfWaitIsNeeded) {
  const std::vector<std::pair<K, std::string>> cases = {
      {K::HostWaitUploaded, "pinned["},      // the host refills a slot the copy stream still reads
      {K::CopyWaitConsumed, "landing["},     // an upload overwrites a slot a step has not copied in
      {K::ComputeWaitUploaded, "landing["},  // a step copies in a slot before its upload lands
      {K::HostWaitDone, "result slot["},     // the host reads results before their download
  };
  for (const auto& [removed, memory] : cases) {
    InputPipeline p(2);
    std::vector<PipelineOp> ops = deepSchedule(p, 6);
    ops.erase(
        std::remove_if(ops.begin(), ops.end(), [&](const PipelineOp& op) { return op.kind == removed; }),
        ops.end());
    std::vector<std::string> hazards = findPipelineHazards(ops, 2);
    ASSERT_FALSE(hazards.empty()) << "without " << pipelineOpName(removed);
    EXPECT_NE(joined(hazards).find(memory), std::string::npos) << joined(hazards);
  }
}

TEST(InputPipeline, CheckerCatchesASlotMixUp) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops = trainerSchedule(p, 3);
  // Step 1 copying in slot 0 (ticket 0's upload) instead of its own.
  for (PipelineOp& op : ops)
    if (op.ticket == 1 && op.kind == K::CopyIn) op.slot = 0;
  const std::string hazards = joined(findPipelineHazards(ops, 2));
  EXPECT_NE(hazards.find("landing[0]: CopyIn(slot 0, ticket 1) reads ticket 0's data"), std::string::npos)
      << hazards;
}

TEST(InputPipeline, RefusesUnsafeCalls) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  ASSERT_TRUE(p.stage(ops));
  ASSERT_TRUE(p.stage(ops));
  auto third = p.stage(ops);  // both landing slots still wait for their steps
  ASSERT_FALSE(third);
  EXPECT_NE(third.status().message().find("staged and not launched"), std::string::npos);
  Status early = p.launch(1, ops);  // ticket 0 was staged first
  ASSERT_FALSE(early);
  EXPECT_NE(early.message().find("before ticket 0"), std::string::npos) << early.message();
  EXPECT_FALSE(p.collect(0, ops));  // not launched
  ASSERT_TRUE(p.launch(0, ops));
  ASSERT_TRUE(p.launch(1, ops));
  ASSERT_TRUE(p.stage(ops));         // ticket 2
  Status unread = p.launch(2, ops);  // ticket 0's results still in result slot 0
  ASSERT_FALSE(unread);
  EXPECT_NE(unread.message().find("collect ticket 0"), std::string::npos) << unread.message();
  ASSERT_TRUE(p.collect(0, ops));
  EXPECT_FALSE(p.collect(0, ops));  // twice
  EXPECT_FALSE(p.drop(0));          // collected already
  EXPECT_EQ(p.inFlight(), (std::vector<int64_t>{1}));
  EXPECT_EQ(p.staged(), (std::vector<int64_t>{2}));
}

// The session drops a staged batch the trainer did not train on next (a short last batch, a
// stop); the slots stay safe afterwards.
TEST(InputPipeline, DroppedTicketLeavesTheSlotsSafe) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops = trainerSchedule(p, 3);
  auto ahead = p.stage(ops);
  ASSERT_TRUE(ahead);
  ASSERT_TRUE(p.drop(*ahead));
  EXPECT_FALSE(p.launch(*ahead, ops));
  std::vector<PipelineOp> more = trainerSchedule(p, 4);
  ops.insert(ops.end(), more.begin(), more.end());
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
}

// A launch that failed part way is dropped by the executor; later tickets may reuse its slots.
TEST(InputPipeline, DroppedLaunchLeavesTheSlotsSafe) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  auto t0 = p.stage(ops);
  ASSERT_TRUE(t0);
  std::vector<PipelineOp> launched;
  ASSERT_TRUE(p.launch(*t0, launched));
  launched.resize(3);  // failed after RecordConsumed: no step, no download, no done
  ops.insert(ops.end(), launched.begin(), launched.end());
  ASSERT_TRUE(p.drop(*t0));
  EXPECT_TRUE(p.inFlight().empty());
  std::vector<PipelineOp> more = trainerSchedule(p, 4);  // tickets 1..4, slot 0 again at 2 and 4
  ops.insert(ops.end(), more.begin(), more.end());
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
}

}  // namespace
}  // namespace kiln::cuda
