// NCCL on GPUs: one rank per GPU (one process each under mpirun, or one thread each over a
// LocalGroup). libnccl.so.2 is loaded at run time with dlopen, like cuBLASLt, so `kiln`
// starts on machines without it. Rank 0 makes the NCCL unique id and broadcasts it over a host
// communicator (MPI across processes), which also gives the rank and the group size.
//
// Buffers are device pointers (CUdeviceptr cast to void*). A collective is enqueued on the
// communicator's stream and its Request carries a CUDA event recorded after it: a compute
// stream waits on Request::cudaEvent() without blocking the host; wait() and test() poll the
// event and NCCL's asynchronous error. A collective not complete within the timeout aborts the
// NCCL communicator (ncclCommAbort) and fails; NCCL does not say which peer is late, so the
// message says so. exchangeCounts is host-only: the variable all_to_all's counts come to the
// host first (its caller copies them), as TorchRec's splits do.
#pragma once

#include <memory>
#include <string>

#include "runtime/comm/communicator.h"
#include "runtime/cuda/cuda_driver.h"

namespace kiln::comm {

// Loads libnccl once per process; the error names the library and where it was looked for.
// `version` (when given) receives NCCL's version code, e.g. 22809 for 2.28.9.
// The environment variable KILN_NCCL_LIBRARY names one library file to use instead.
Status loadNccl(int* version = nullptr);
// Loads `library` (a file or a name for the loader) without caching it: what loadNccl would
// say with that library, for tests and diagnostics.
Status tryLoadNccl(const std::string& library);

#ifdef KILN_HAVE_CUDA_HEADERS
// The NCCL communicator of bootstrap's rank, on ctx's GPU (made current on the calling thread).
// Every rank of `bootstrap` calls this together. The stream is the communicator's own unless
// one is given. The init itself is bounded by bootstrap's timeout.
Expected<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& bootstrap,
                                                               const cuda::CudaContext& ctx,
                                                               CUstream stream = nullptr);
#endif

}  // namespace kiln::comm
