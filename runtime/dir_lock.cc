#include "runtime/dir_lock.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <utility>

namespace kiln::runtime {
namespace {

namespace fs = std::filesystem;

// What one write of the lock file holds at most: a holder line is far shorter.
constexpr size_t kMaxHolderBytes = 512;

std::string readHolder(int fd) {
  char buf[kMaxHolderBytes];
  ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  if (n <= 0) return "";
  std::string s(buf, static_cast<size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

// Files Kiln itself leaves in a checkpoint directory only when killed mid-write: a save's
// temporary (`<name>.safetensors.tmp.<pid>`) and prepareCheckpointDir's probe
// (`.kiln-write-test.<pid>`). Nothing else in the directory is touched.
bool isStaleTemporary(const std::string& name) {
  auto endsWithPid = [&](std::string_view stem) {
    size_t at = name.rfind(stem);
    if (at == std::string::npos) return false;
    std::string_view pid = std::string_view(name).substr(at + stem.size());
    if (pid.empty() || pid.size() > 10) return false;
    for (char c : pid)
      if (c < '0' || c > '9') return false;
    return std::to_string(::getpid()) != pid;
  };
  return (name.find(".safetensors") != std::string::npos && endsWithPid(".safetensors.tmp.")) ||
         (name.rfind(".kiln-write-test.", 0) == 0 && endsWithPid(".kiln-write-test."));
}

}  // namespace

std::string describeLockHolder() {
  char host[256] = "?";
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  host[sizeof host - 1] = '\0';
  char when[64] = "?";
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  if (::gmtime_r(&now, &tm)) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return fmt::format("pid {} on host {} since {}", ::getpid(), host, when);
}

Expected<DirLock> DirLock::acquire(const std::string& dir, std::vector<std::string>* notes) {
  DirLock lock;
  lock.path_ = (fs::path(dir.empty() ? "." : dir) / kFileName).string();
  lock.fd_ = ::open(lock.path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock.fd_ < 0)
    return Status::errorf("cannot open the lock file '{}': {}", lock.path_, std::strerror(errno));
  if (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder = readHolder(lock.fd_);
    // Not ours: closed without release(), which would erase the holder's name.
    ::close(std::exchange(lock.fd_, -1));
    if (err == EWOULDBLOCK)
      return Status::errorf(
          "checkpoint directory '{}' is in use by another kiln process ({}); give each run its own "
          "--checkpoint "
          "directory, or wait for that run to finish",
          dir, holder.empty() ? "one that has not yet written its name" : holder);
    return Status::errorf("cannot lock '{}': {}", lock.path_, std::strerror(err));
  }
  // We hold the lock. A line left in the file is the name of a holder that died without
  // releasing it cleanly: the kernel dropped its lock, we take it over.
  if (std::string previous = readHolder(lock.fd_); !previous.empty() && notes)
    notes->push_back(fmt::format(
        "took over the lock of '{}' from a kiln process that did not exit cleanly ({})", dir, previous));
  std::string line = describeLockHolder() + "\n";
  if (::ftruncate(lock.fd_, 0) != 0 ||
      ::pwrite(lock.fd_, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size()))
    return Status::errorf("cannot write the lock file '{}': {}", lock.path_, std::strerror(errno));

  std::error_code ec;
  uint64_t removed = 0, bytes = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir.empty() ? "." : dir, ec)) {
    std::string name = e.path().filename().string();
    if (!isStaleTemporary(name) || !e.is_regular_file(ec)) continue;
    uint64_t size = e.file_size(ec);
    if (fs::remove(e.path(), ec)) {
      ++removed;
      bytes += ec ? 0 : size;
    }
  }
  if (removed > 0 && notes)
    notes->push_back(fmt::format("removed {} temporary file{} ({} bytes) left in '{}' by killed writers",
                                 removed, removed == 1 ? "" : "s", bytes, dir));
  return lock;
}

DirLock::DirLock(DirLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

DirLock::~DirLock() { release(); }

void DirLock::release() {
  if (fd_ < 0) return;
  // An empty file says the last holder exited cleanly. The file stays: unlinking it would let a
  // process that opened it just before lock an inode nobody else can find.
  if (::ftruncate(fd_, 0) != 0) {
    // Nothing to do: the next writer will only warn that it took the lock over.
  }
  ::close(fd_);  // releases the flock
  fd_ = -1;
}

}  // namespace kiln::runtime
