// What a training run was started with, recorded in its checkpoints so that `--resume` can tell
// a continuation from a different run. A checkpoint's data position is a byte offset into the
// data files; resumed over other files it lands in the middle of a line (issue 12). The record
// holds the model, the seed, the global batch and, per data file, its path, size and a hash of
// its first block: enough to catch another file, a truncated or appended one, or a reordering,
// without reading terabytes at start-up.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ir/status.h"
#include "runtime/random.h"  // fnv1a64

namespace kiln::runtime {

struct DataFileId {
  std::string path;        // as given on the command line
  uint64_t size = 0;       // bytes
  uint64_t head_hash = 0;  // FNV-1a 64 of the first kHeadBytes bytes
  bool operator==(const DataFileId&) const = default;
};

struct RunInputs {
  static constexpr uint64_t kHeadBytes = 1 << 20;

  std::string model;
  uint64_t seed = 0;
  int64_t batch = 0;
  bool synthetic = false;         // the synthetic stream (no files)
  std::vector<DataFileId> files;  // in reading order

  // Reads the size and first block of every data file (`synthetic` for the synthetic stream).
  static Expected<RunInputs> describe(const std::string& model, uint64_t seed, int64_t batch,
                                      const std::vector<std::string>& data);

  // Into and out of checkpoint metadata (keys model, seed, batch, data_files).
  void toMetadata(std::map<std::string, std::string>& meta) const;
  // Fails on malformed values. A checkpoint written before data files were recorded has no
  // `data_files`: *recorded is then false and the file list stays empty.
  static Expected<RunInputs> fromMetadata(const std::map<std::string, std::string>& meta,
                                          bool* files_recorded);
};

// Where `now` differs from `saved`, one line each ("the seed is 7, the checkpoint's is 1").
// Paths alone may differ (a data folder moved): files match by size and first block.
std::vector<std::string> compareRunInputs(const RunInputs& saved, const RunInputs& now);

// Whether both read the same data: the synthetic stream, or files equal in size and first block,
// in the same order. A saved data position is valid only then.
bool sameData(const RunInputs& a, const RunInputs& b);

}  // namespace kiln::runtime
