// One writer per checkpoint directory. `kiln train --checkpoint DIR` takes DIR/kiln.lock before
// it trains and holds it until it exits; a second trainer pointed at DIR fails at once, naming
// the holder, instead of overwriting the first one's checkpoints (issue 12: two runs wrote one
// directory, both exited 0, and the survivor's checkpoint was of the other model).
//
// The lock is flock(2) on the lock file, so the kernel releases it when its holder dies, kill -9
// included; no lock outlives its process. The file also holds a line naming the holder (pid,
// host, start time): for the message of a second writer, and to tell a clean exit (the holder
// empties the file) from a death (the line remains, and the next writer warns that it takes the
// lock over). Readers (eval, predict, resume's load) take no lock: saves are atomic renames.
#pragma once

#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

class DirLock {
 public:
  static constexpr const char* kFileName = "kiln.lock";

  // Takes the lock of `dir`, which must exist. Fails without waiting when another process holds
  // it, naming that process. Having the lock, removes the temporary files that writers killed
  // mid-save left behind (`*.tmp.<pid>`: no live writer can own them now). `notes` receives one
  // line per thing worth a warning: a lock taken over from a dead holder, stale files removed.
  static Expected<DirLock> acquire(const std::string& dir, std::vector<std::string>* notes);

  DirLock() = default;
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  // Empties the lock file (a clean exit) and releases the lock.
  ~DirLock();

  bool held() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  void release();

  int fd_ = -1;
  std::string path_;
};

// The line a holder writes into the lock file: "pid 123 on host h since 2026-12-01 19:05:03 UTC".
std::string describeLockHolder();

}  // namespace kiln::runtime
