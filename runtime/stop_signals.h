// SIGINT and SIGTERM as a request to stop, the way a scheduler preempts a job (Kubernetes and
// Slurm send SIGTERM, then SIGKILL after a grace period) and a user presses Ctrl-C.
//
// While a StopSignals is alive, the first of these signals only records itself: a loop polls
// stopSignal() at a point where stopping is clean (kiln train: after a step, with its checkpoint
// saved). A second signal means "now": the temporary files registered as PendingTempFile (a
// checkpoint being written) are removed and the process ends by that signal, so that nothing
// half-written is left behind either way.
#pragma once

#include <string>

namespace kiln::runtime {

class StopSignals {
 public:
  // Installs the handlers (the signals received before are forgotten); the destructor restores
  // the ones it replaced.
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
};

// The first stop signal received while a StopSignals was alive (SIGINT or SIGTERM), or 0.
int stopSignal();

// "SIGINT" / "SIGTERM" (or "signal N").
std::string signalName(int signal);

// A temporary file in the making: a second stop signal removes it before the process ends. The
// path is copied into a fixed slot the handler can read without allocating; when the slots are
// all taken the file is simply not covered.
class PendingTempFile {
 public:
  explicit PendingTempFile(const std::string& path);
  ~PendingTempFile();
  PendingTempFile(const PendingTempFile&) = delete;
  PendingTempFile& operator=(const PendingTempFile&) = delete;

 private:
  int slot_ = -1;
};

}  // namespace kiln::runtime
