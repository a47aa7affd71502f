// The collective checks through MPI processes: run under `mpirun -np N` (ctest does, for N = 2
// and 4). Every rank runs every test; only rank 0 prints gtest's report.
#include <gtest/gtest.h>

#include <cstdio>

#include "runtime/comm/mpi_communicator.h"
#include "tests/comm/collective_checks.h"

namespace kiln::comm {
namespace {

Communicator* world = nullptr;

TEST(MpiCollectives, AllReduce) { testing::checkAllReduce(*world); }
TEST(MpiCollectives, ReduceScatter) { testing::checkReduceScatter(*world); }
TEST(MpiCollectives, AllGather) { testing::checkAllGather(*world); }
TEST(MpiCollectives, AllToAll) { testing::checkAllToAll(*world); }
TEST(MpiCollectives, BroadcastAndBarrier) { testing::checkBroadcast(*world); }
TEST(MpiCollectives, OverlappingRequests) { testing::checkOverlap(*world); }

}  // namespace
}  // namespace kiln::comm

int main(int argc, char** argv) {
  auto comm = kiln::comm::createMpiCommunicator(&argc, &argv);
  if (!comm) {
    std::fprintf(stderr, "error: %s\n", comm.status().message().c_str());
    return 1;
  }
  kiln::comm::world = comm->get();
  kiln::comm::world->setTimeout(std::chrono::seconds(60));
  ::testing::InitGoogleTest(&argc, argv);
  if (kiln::comm::world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  comm->reset();  // finalizes MPI
  return rc;
}
