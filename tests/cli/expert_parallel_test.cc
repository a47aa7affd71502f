// Expert parallelism (issue 15) trains what one rank trains: a MoE language model with its
// experts spread over EP = 2 and 4 in-process ranks (and over 2 of 4 ranks, expert-data
// parallel), against the single-rank run of the same global batches. One step compares every
// parameter and optimizer state each rank holds, the loss and the per-expert counts
// (tests/cli/sharded_check.h); 20 steps compare the loss trajectory.
//
// Capacity is applied where Megatron applies it, on each rank's own tokens before the dispatch,
// so with a capacity factor the reference is the same ranks without expert parallelism (EP 1:
// every rank drops what it would drop under EP), itself checked against a plain loop per share in
// moe_layer_test.
#include <mutex>

#include "runtime/comm/local_group.h"
#include "tests/cli/sharded_check.h"

namespace kiln::cli::testing {
namespace {

struct EpCase {
  const char* name;
  std::string options;  // the moe(...) options after experts, topk and hidden
  bool local_capacity = false;
};

std::ostream& operator<<(std::ostream& os, const EpCase& c) { return os << c.name; }

// The reference of a capacity case: `ranks` ranks without expert parallelism, every tensor whole
// on each (rank 0's), the counts global, the loss the ranks' mean.
Trajectory dataParallel(const Model& m, int ranks, int steps) {
  Trajectory r;
  r.losses.assign(static_cast<size_t>(steps), 0.0);
  std::mutex mu;
  comm::LocalGroup group(ranks);
  Status st = group.run([&](comm::Communicator& c) -> Status {
    std::ostringstream diag;
    driver::SessionOptions o = options(m, kGlobalBatch / ranks);
    o.comm = &c;
    KILN_ASSIGN_OR_RETURN(auto s, driver::Session::create(o, diag));
    const int64_t b = kGlobalBatch / ranks;
    for (int step = 1; step <= steps; ++step) {
      KILN_ASSIGN_OR_RETURN(
          auto out, s->trainStep(batchOf(*s, (step - 1) * kGlobalBatch + c.rank() * b, b), 1.0, step));
      std::lock_guard<std::mutex> lock(mu);
      r.losses[static_cast<size_t>(step - 1)] += out.loss / ranks;
      if (c.rank() == 0)
        for (const auto& [stat, v] : out.stats)
          if (isCounts(stat)) r.counts[stat] = v;
    }
    if (c.rank() != 0) return Status::ok();
    std::lock_guard<std::mutex> lock(mu);
    for (const std::string& name : s->checkpointNames()) {
      const ir::HostTensor* t = s->params().find(name);
      ir::HostTensor copy(t->view.dtype, t->view.shape);
      std::memcpy(copy.view.data, t->view.data, static_cast<size_t>(t->view.bytes()));
      r.tensors.emplace(name, std::move(copy));
    }
    return Status::ok();
  });
  EXPECT_TRUE(st) << st.str();
  return r;
}

class ExpertParallelStep : public ::testing::TestWithParam<EpCase> {};

TEST_P(ExpertParallelStep, EqualsOneRank) {
  const EpCase& c = GetParam();
  const Model one = moeModel(c.name, c.options, 1);
  const Trajectory single = c.local_capacity ? Trajectory{} : singleRank(one, 1);
  for (auto [ranks, ep] : {std::pair{2, 2}, std::pair{4, 4}, std::pair{4, 2}}) {
    SCOPED_TRACE(fmt::format("{}: ep {} on {} ranks", c.name, ep, ranks));
    Model m = one;
    m.ep = ep;
    const Trajectory want = c.local_capacity ? dataParallel(one, ranks, 1) : single;
    expectLossesMatch(runRanks(m, "", ranks, 1, want), want);
  }
  std::filesystem::remove(one.path);
}

INSTANTIATE_TEST_SUITE_P(
    Layers, ExpertParallelStep,
    ::testing::Values(EpCase{"dropless", "aux_loss = 0.01, z_loss = 0.001"},
                      EpCase{"shared_expert", "shared_experts = 1, aux_loss = 0.01"},
                      EpCase{"group_limited",
                             "router = sigmoid, groups = 4, group_topk = 2, expert_bias = 0.001"},
                      EpCase{"seq_aux", "seq_aux_loss = 0.01, pre_softmax = true"},
                      EpCase{"capacity", "capacity_factor = 1.0, aux_loss = 0.01", true},
                      EpCase{"capacity_padded",
                             "capacity_factor = 1.0, pad_to_capacity = true, drop_policy = position", true}),
    [](const auto& info) { return std::string(info.param.name); });

// Twenty steps of the losses: AdamW divides each update by the root of its second moment, so the
// parameters' f32 rounding differences grow step by step beyond a tensor tolerance; the losses
// stay within it.
TEST(ExpertParallelTrajectory, TwentyStepsAgree) {
  const Model one = moeModel("trajectory", "shared_experts = 1, aux_loss = 0.01, z_loss = 0.001", 1);
  Trajectory want = singleRank(one, 20);
  want.tensors.clear();
  want.counts.clear();
  Model m = one;
  m.ep = 4;
  expectLossesMatch(runRanks(m, "", 4, 20, want), want);
  std::filesystem::remove(one.path);
}

}  // namespace
}  // namespace kiln::cli::testing
