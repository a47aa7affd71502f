// A job with one faulty rank, for tests/comm/mpi_fault_test.sh: `mpi_fault_main MODE` under
// mpirun. Rank 1 misbehaves at collective #2: `hang` (never issues it), `exit` (issues it and
// exits mid-collective; the peers may still complete it and fail at the next one), `bad-args` (passes counts
// of the wrong length), `relay` (exits before it; rank 0 waits 60 s, rank 2 only 2 s, and rank 2
// aborts the group when it sees rank 1 lost, as `kiln train` does). The other ranks must exit
// non-zero within their 2 s timeout, naming rank 1 and the collective: in `relay`, rank 0 learns
// it from rank 2's abort.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "runtime/comm/mpi_communicator.h"

using namespace kiln::comm;

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "hang";
  auto created = createMpiCommunicator(&argc, &argv);
  if (!created) {
    std::fprintf(stderr, "error: %s\n", created.status().message().c_str());
    return 1;
  }
  Communicator& c = **created;
  const bool relay = std::strcmp(mode, "relay") == 0;
  c.setTimeout(std::chrono::seconds(relay && c.rank() == 0 ? 60 : 2));
  std::vector<float> x(1024, 1.0f), y(1024);
  kiln::Status s = c.allReduceSync(x.data(), y.data(), x.size(), DataType::f32);  // #1: everyone
  if (s && c.rank() == 1) {
    if (std::strcmp(mode, "hang") == 0) std::this_thread::sleep_for(std::chrono::seconds(120));
    if (std::strcmp(mode, "exit") == 0) {
      Request r = c.allReduce(x.data(), y.data(), x.size(), DataType::f32);
      _exit(3);
    }
    if (relay) _exit(3);
    if (std::strcmp(mode, "bad-args") == 0) {
      std::vector<size_t> counts(static_cast<size_t>(c.size()) + 1, 1);
      s = c.reduceScatterV(x.data(), y.data(), counts, DataType::f32).wait();
    }
  }
  if (s) s = c.allReduceSync(x.data(), y.data(), x.size(), DataType::f32);
  if (s) s = c.barrier();
  if (!s) {
    if (relay) c.abort("rank " + std::to_string(c.rank()) + " failed");
    std::fprintf(stderr, "rank %d: error: %s\n", c.rank(), s.message().c_str());
    std::fflush(stderr);
    // Linger a moment so the peers report too, before the launcher ends the job. The
    // communicator is broken and MPI cannot finalize cleanly: exit non-zero without it.
    std::this_thread::sleep_for(std::chrono::seconds(1));
    _exit(1);
  }
  std::printf("rank %d: no error\n", c.rank());
  return 0;
}
