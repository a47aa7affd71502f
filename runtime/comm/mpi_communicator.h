// MPI processes (`mpirun -np N kiln train ...`): one rank per process over MPI_COMM_WORLD.
//
// Every MPI call after MPI_Init_thread is made by one communication thread, which starts the
// non-blocking collectives (MPI_Iallreduce, MPI_Ireduce_scatter[_block], MPI_Iallgather[v],
// MPI_Ialltoall[v], MPI_Ibcast, MPI_Ibarrier) in issue order and drives them with MPI_Test, so
// they progress while the caller computes. A collective not complete within the timeout fails:
// the thread then asks every peer over a side channel (a duplicate communicator) which
// collective it has reached, to name the late rank; a peer that does not answer is named as
// lost. MPI cannot cancel a started collective, so a timed-out or aborted communicator stays
// broken and its process should exit non-zero (the launcher then ends the others).
//
// Without MPI at build time this header still compiles; create() then fails.
#pragma once

#include <memory>

#include "runtime/comm/communicator.h"

namespace kiln::comm {

// True when this process was started by an MPI launcher (mpirun/mpiexec, srun), judged from the
// environment the launchers set; `kiln` uses it to pick the MPI backend.
bool launchedByMpi();

// Whether this binary was built with MPI.
bool mpiAvailable();

// Initializes MPI on the calling thread (which should be the main thread; it must also be the
// one that destroys the communicator, which finalizes MPI) and returns the world communicator.
// Needs MPI_THREAD_SERIALIZED or better. One per process.
Expected<std::unique_ptr<Communicator>> createMpiCommunicator(int* argc, char*** argv);

// The world communicator of MPI's processes when a launcher started this one (launchedByMpi),
// created as createMpiCommunicator does; null otherwise.
Expected<std::unique_ptr<Communicator>> mpiWorldIfLaunched();

}  // namespace kiln::comm
