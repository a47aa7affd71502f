// N ranks train what one rank trains: every sharding type, on in-process ranks (threads of a
// LocalGroup), against the single-rank run of the same model on the same global batches
// (tests/cli/sharded_check.h). One step of every model at N = 2 and 4 compares every parameter
// and optimizer state; 20 steps compare the loss trajectory.
#include "tests/cli/sharded_check.h"

namespace kiln::cli::testing {
namespace {

constexpr const char* kShardings[] = {"data_parallel", "table_wise", "row_wise", "column_wise",
                                      "table_row_wise"};

class ShardedStep : public ::testing::TestWithParam<size_t> {};

TEST_P(ShardedStep, EveryShardingEqualsOneRank) {
  const Model m = models()[GetParam()];
  const Trajectory want = singleRank(m, 1);
  for (const char* sharding : kShardings)
    for (int ranks : {2, 4}) {
      SCOPED_TRACE(fmt::format("{} on {} ranks, {}", m.name, ranks,
                               *sharding ? fmt::format("every table {}", sharding) : "the automatic plan"));
      expectLossesMatch(runRanks(m, sharding, ranks, 1, want), want);
    }
}

// Hybrid tables (passes/shard.cc): half of every table's rows replicated, the rest sharded by each
// type. Every piece compared holds the replica's trained hot rows (localPieces copies them in),
// so the hot rows' update is checked as well as the cold rows'. The models' embedding optimizers
// cover both exchanges of the hot gradients: dense all-reduce (sgd, adagrad, rowwise_adagrad) and
// gathered ids (dcn's lazy adam).
TEST_P(ShardedStep, HybridTablesEqualOneRank) {
  const Model m = models()[GetParam()];
  const Trajectory want = singleRank(m, 1);
  for (const char* sharding : {"table_wise", "row_wise", "column_wise", "table_row_wise"})
    for (int ranks : {2, 4}) {
      SCOPED_TRACE(fmt::format("{} on {} ranks, every table {} with hot rows", m.name, ranks, sharding));
      const std::string plan = hybridPlanFile(m, sharding, ranks);
      expectLossesMatch(runRanks(m, "", ranks, 1, want, plan), want);
      std::filesystem::remove(plan);
    }
}

// The pipelined step (each step routes the next batch's ids, its own arrive from the step
// before; the first is routed by @pipeline_prime) trains to the same numbers over 3 steps, every
// piece compared: plain and hybrid tables, a table on one rank and row blocks on all.
TEST_P(ShardedStep, PipelinedStepEqualsOneRank) {
  const Model m = models()[GetParam()];
  const Trajectory want = singleRank(m, 3);
  for (const char* sharding : {"table_wise", "row_wise", "column_wise"})
    for (int ranks : {2, 4}) {
      SCOPED_TRACE(fmt::format("{} on {} ranks, every table {}, pipelined", m.name, ranks, sharding));
      expectLossesMatch(runRanks(m, sharding, ranks, 3, want, "", true), want);
    }
  SCOPED_TRACE(fmt::format("{} on 4 ranks, row_wise with hot rows, pipelined", m.name));
  const std::string plan = hybridPlanFile(m, "row_wise", 4);
  expectLossesMatch(runRanks(m, "", 4, 3, want, plan, true), want);
  std::filesystem::remove(plan);
}

// De-duplicated routing (TablePlan::dedup: each rank sends each distinct id once, the owners
// return one row per distinct id, the rank pools): the same numbers, every piece compared, for
// each row-block type, with hot rows, and pipelined.
TEST_P(ShardedStep, DedupIdsEqualOneRank) {
  const Model m = models()[GetParam()];
  const Trajectory want = singleRank(m, 3);
  for (const char* sharding : {"table_wise", "row_wise", "table_row_wise"})
    for (int ranks : {2, 4}) {
      SCOPED_TRACE(fmt::format("{} on {} ranks, every table {}, de-duplicated ids", m.name, ranks, sharding));
      const std::string plan = planFile(m, sharding, ranks, /*hot=*/false, /*dedup=*/true);
      expectLossesMatch(runRanks(m, "", ranks, 3, want, plan), want);
      std::filesystem::remove(plan);
    }
  for (bool pipeline : {false, true}) {
    SCOPED_TRACE(fmt::format("{} on 4 ranks, row_wise with hot rows, de-duplicated ids{}", m.name,
                             pipeline ? ", pipelined" : ""));
    const std::string plan = planFile(m, "row_wise", 4, /*hot=*/true, /*dedup=*/true);
    expectLossesMatch(runRanks(m, "", 4, 3, want, plan, pipeline), want);
    std::filesystem::remove(plan);
  }
  SCOPED_TRACE(fmt::format("{} on 2 ranks, table_wise, de-duplicated ids, pipelined", m.name));
  const std::string plan = planFile(m, "table_wise", 2, /*hot=*/false, /*dedup=*/true);
  expectLossesMatch(runRanks(m, "", 2, 3, want, plan, true), want);
  std::filesystem::remove(plan);
}

INSTANTIATE_TEST_SUITE_P(Models, ShardedStep, ::testing::Range<size_t>(0, models().size()),
                         [](const auto& info) { return std::string(models()[info.param].name); });

TEST(ShardedTrajectory, TwentyStepsAgree) {
  const Model m = models()[1];  // dlrm
  const Trajectory want = singleRank(m, 20);
  for (const char* sharding : kShardings) {
    SCOPED_TRACE(fmt::format("{} on 4 ranks, {}", m.name,
                             *sharding ? fmt::format("every table {}", sharding) : "the automatic plan"));
    expectLossesMatch(runRanks(m, sharding, 4, 20, want), want);
  }
  for (const char* sharding : {"row_wise", "table_wise"}) {
    SCOPED_TRACE(fmt::format("{} on 4 ranks, every table {} with hot rows", m.name, sharding));
    const std::string plan = hybridPlanFile(m, sharding, 4);
    expectLossesMatch(runRanks(m, "", 4, 20, want, plan), want);
    std::filesystem::remove(plan);
  }
}

// Shared tables (models/shared_tables.kiln) train on many ranks as data_parallel: the automatic
// plan keeps them so (and shards the other tables), and the step equals one rank's. Pinning a
// shared table to another type is a located error of the shard pass, not a wrong update.
TEST(ShardedSharedTables, AutomaticPlanEqualsOneRank) {
  const Model m{"shared_tables",
                "models/shared_tables.kiln",
                {{"rows_cap", "97"}, {"emb_dim", "8"}, {"top", "[16, 1]"}}};
  const Trajectory want = singleRank(m, 1);
  for (const char* sharding : {"", "data_parallel"})
    for (int ranks : {2, 4}) {
      SCOPED_TRACE(fmt::format("{} ranks, {}", ranks, *sharding ? sharding : "the automatic plan"));
      expectLossesMatch(runRanks(m, sharding, ranks, 1, want), want);
    }
  comm::LocalGroup group(2);
  Status st = group.run([&](comm::Communicator& c) -> Status {
    std::ostringstream diag;
    driver::SessionOptions o = options(m, kGlobalBatch / 2);
    o.comm = &c;
    o.sharding = "row_wise";
    auto s = driver::Session::create(o, diag);
    EXPECT_FALSE(s);
    if (!s) {
      EXPECT_NE(s.status().str().find(
                    "shared_tables.kiln:26:38: error: in pass 'shard': table 'city.0' is shared by "
                    "several features and cannot be row_wise yet"),
                std::string::npos)
          << s.status().str();
    }
    return Status::ok();
  });
  EXPECT_TRUE(st) << st.str();
}

}  // namespace
}  // namespace kiln::cli::testing
