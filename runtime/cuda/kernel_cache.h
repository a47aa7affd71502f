// The on-disk cache of compiled kernels: one file per (source, architecture, NVRTC version,
// options) in $KILN_CACHE_DIR (default ~/.cache/kiln), so a second run compiles nothing.
// Entries are written to a temporary file and renamed into place, so concurrent processes
// never see a partial file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::cuda {

// $KILN_CACHE_DIR, else $HOME/.cache/kiln, else ./.kiln-cache.
std::string defaultCacheDir();

class KernelCache {
 public:
  explicit KernelCache(std::string dir) : dir_(std::move(dir)) {}
  const std::string& dir() const { return dir_; }

  // The file name for a key's parts: a 128-bit hash of the source and options, the
  // architecture and the compiler version, e.g. "3f...e1-sm_90-nvrtc13.0.cubin" (".ptx" for a
  // compute_XX arch).
  static std::string entryName(const std::string& source, const std::string& options, const std::string& arch,
                               const std::string& compiler_version);

  std::optional<std::vector<char>> load(const std::string& entry) const;
  // Atomic: temp file + rename. Creates the directory if needed.
  Status store(const std::string& entry, const std::vector<char>& bytes) const;
  std::string pathOf(const std::string& entry) const { return dir_ + "/" + entry; }

 private:
  std::string dir_;
};

}  // namespace kiln::cuda
