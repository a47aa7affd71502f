// The sharded-step check (tests/cli/sharded_check.h) through MPI processes: run under
// `mpirun -np N` (ctest does, for N = 2 and 4). Each process is one rank and computes the
// single-rank reference itself; only rank 0 prints gtest's report.
#include <cstdio>

#include "runtime/comm/mpi_communicator.h"
#include "tests/cli/sharded_check.h"

namespace kiln::cli::testing {
namespace {

comm::Communicator* world = nullptr;

// The global batch's loss of each step (the mean of the ranks' losses) against the single rank's.
void expectGlobalLossesMatch(const std::vector<double>& mine, const Trajectory& want) {
  std::vector<double> sum(mine.size());
  ASSERT_TRUE(world->allReduceSync(mine.data(), sum.data(), mine.size(), comm::DataType::f64));
  for (double& v : sum) v /= world->size();
  expectLossesMatch(sum, want);
}

// tiny, and dlrm_dcnv2 at 8 sparse features (one-hot and multi-hot ones): the transport is what
// these add to sharded_step_test.cc, which checks every model at full size on in-process ranks;
// each of the N processes on CI's 2 cores compiles its own programs, and at 26 features that took
// most of the time.
std::vector<Model> mpiModels() {
  Model dcnv2 = withSparseFeatures(models()[2]);
  dcnv2.overrides["hot"] = "[3, 1, 1, 6, 1, 12, 27, 2]";
  return {models()[0], dcnv2};
}

class ShardedStepMpi : public ::testing::TestWithParam<const char*> {};

TEST_P(ShardedStepMpi, EqualsOneRank) {
  for (const Model& m : mpiModels()) {
    SCOPED_TRACE(fmt::format("{} on {} MPI ranks, every table {}", m.name, world->size(), GetParam()));
    const int steps = 3;
    const Trajectory want = singleRank(m, steps);
    std::vector<double> mine;
    Status s = checkRank(*world, m, GetParam(), steps, want, mine);
    ASSERT_TRUE(s) << s.str();
    expectGlobalLossesMatch(mine, want);
  }
}

// Hybrid tables (half their rows replicated, tests/cli/sharded_check.h) through MPI processes:
// every rank writes the same plan to a file of its own and reads it.
TEST_P(ShardedStepMpi, HybridEqualsOneRank) {
  if (std::string(GetParam()) == "data_parallel") return;  // a replicated table has no hot rows
  for (const Model& m : mpiModels()) {
    SCOPED_TRACE(fmt::format("{} on {} MPI ranks, every table {} with hot rows", m.name, world->size(), GetParam()));
    const int steps = 3;
    const Trajectory want = singleRank(m, steps);
    const std::string plan = hybridPlanFile(m, GetParam(), world->size());
    std::vector<double> mine;
    Status s = checkRank(*world, m, "", steps, want, mine, plan);
    std::filesystem::remove(plan);
    ASSERT_TRUE(s) << s.str();
    expectGlobalLossesMatch(mine, want);
  }
}

// De-duplicated ids through MPI processes: plain, and with hot rows pipelined.
TEST_P(ShardedStepMpi, DedupEqualsOneRank) {
  const std::string sharding = GetParam();
  if (sharding == "data_parallel" || sharding == "column_wise") return;  // row blocks only
  for (const Model& m : mpiModels())
    for (bool hot : {false, true}) {
      SCOPED_TRACE(fmt::format("{} on {} MPI ranks, every table {}, de-duplicated ids{}", m.name, world->size(),
                               sharding, hot ? " with hot rows, pipelined" : ""));
      const int steps = 3;
      const Trajectory want = singleRank(m, steps);
      const std::string plan = planFile(m, sharding, world->size(), hot, /*dedup=*/true);
      std::vector<double> mine;
      Status s = checkRank(*world, m, "", steps, want, mine, plan, /*pipeline=*/hot);
      std::filesystem::remove(plan);
      ASSERT_TRUE(s) << s.str();
      expectGlobalLossesMatch(mine, want);
    }
}

// The pipelined step through MPI processes.
TEST_P(ShardedStepMpi, PipelinedEqualsOneRank) {
  if (std::string(GetParam()) == "data_parallel") return;  // nothing routed ahead: no pipelined step
  for (const Model& m : mpiModels()) {
    SCOPED_TRACE(fmt::format("{} on {} MPI ranks, every table {}, pipelined", m.name, world->size(), GetParam()));
    const int steps = 3;
    const Trajectory want = singleRank(m, steps);
    std::vector<double> mine;
    Status s = checkRank(*world, m, GetParam(), steps, want, mine, "", true);
    ASSERT_TRUE(s) << s.str();
    expectGlobalLossesMatch(mine, want);
  }
}

// A MoE layer's experts over every MPI rank (ep = N) and, on 4, over pairs (ep = 2).
TEST(ExpertParallelMpi, EqualsOneRank) {
  const Model one = moeModel("mpi", "shared_experts = 1, aux_loss = 0.01, z_loss = 0.001", 1);
  // One step: AdamW grows the f32 rounding of MPI's sums in later steps past a tensor tolerance.
  const int steps = 1;
  const Trajectory want = singleRank(one, steps);
  for (int ep : {world->size(), 2}) {
    if (ep > world->size()) continue;
    SCOPED_TRACE(fmt::format("ep {} on {} MPI ranks", ep, world->size()));
    Model m = one;
    m.ep = ep;
    std::vector<double> mine;
    Status s = checkRank(*world, m, "", steps, want, mine);
    ASSERT_TRUE(s) << s.str();
    expectGlobalLossesMatch(mine, want);
  }
  std::filesystem::remove(one.path);
}

INSTANTIATE_TEST_SUITE_P(Shardings, ShardedStepMpi,
                         ::testing::Values("data_parallel", "table_wise", "row_wise", "column_wise",
                                           "table_row_wise"));

}  // namespace
}  // namespace kiln::cli::testing

int main(int argc, char** argv) {
  auto comm = kiln::comm::createMpiCommunicator(&argc, &argv);
  if (!comm) {
    std::fprintf(stderr, "error: %s\n", comm.status().message().c_str());
    return 1;
  }
  kiln::cli::testing::world = comm->get();
  kiln::cli::testing::world->setTimeout(std::chrono::seconds(120));
  ::testing::InitGoogleTest(&argc, argv);
  if (kiln::cli::testing::world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  comm->reset();
  return rc;
}
