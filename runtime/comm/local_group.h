// In-process ranks: N communicators over shared memory, one per thread (`kiln train --ranks N`
// and the tests). A collective is a rendezvous: each rank posts its buffers into the shared
// slot of that collective's sequence number; once all have arrived the data moves in N parts
// (one per rank's segment), each done by whichever rank's wait() or test() claims it first, so
// a rank busy computing never holds up the others and the copies run on several threads at once.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "runtime/comm/communicator.h"

namespace kiln::comm {

namespace detail {
struct LocalShared;
}

class LocalGroup {
 public:
  explicit LocalGroup(int size);
  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int size() const { return static_cast<int>(comms_.size()); }
  // Rank r's communicator. Each is meant for one thread at a time (as an MPI rank is one
  // process); its requests may be waited on from any thread.
  Communicator& comm(int r) { return *comms_[static_cast<size_t>(r)]; }
  // Sets every rank's timeout.
  void setTimeout(std::chrono::milliseconds t);

  // Runs fn on size() threads, rank r's thread with comm(r), and returns the first error. A
  // rank whose fn fails (or throws) aborts the group, so that the others fail at their next
  // collective instead of waiting out the timeout. A rank whose thread the system refuses
  // (ulimit -u) aborts it the same way, and the ranks already running are joined.
  Status run(const std::function<Status(Communicator&)>& fn);

 private:
  std::shared_ptr<detail::LocalShared> shared_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

}  // namespace kiln::comm
