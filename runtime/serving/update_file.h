// The update files of `kiln train --publish DIR` (docs/serving.md, "Live updates"). Every N
// steps the trainer writes the rows of the served tables that changed since its last update and
// the other parameters whole, as one safetensors file named by the step:
//   DIR/update-000000000200.safetensors
//     ids/<table>    i64 [n]          the rows that changed, ascending
//     rows/<table>   f32 [n, dim]     their values at the step
//     dense/<param>  the parameter    every parameter of @forward that is not a served table
//     __metadata__   {"kiln.update": "2", "version": "200", "base": "100", "model": "dlrm",
//                     "checksum": "<16 hex digits>"}
// `base` is the version the update follows (the previous update, or the step training resumed
// from), so a reader at version v applies the files with base <= v < version, in order. A file is
// written beside its place and renamed into it, so a watcher never reads half of one; a file
// copied in by other means may be read at full size before its tail is written, so `checksum`
// (FNV-1a 64 of every tensor's name, dtype, shape and bytes, in name order) is checked before an
// update is applied.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ir/status.h"
#include "ir/tensor_view.h"
#include "runtime/parameter_store.h"
#include "runtime/serving/served_tables.h"

namespace kiln::data {
struct Batch;
}

namespace kiln::serving {

struct TableRows {
  std::string table;
  std::vector<int64_t> ids;  // ascending
  ir::HostTensor rows;       // f32 [ids.size(), dim]
};

struct ModelUpdate {
  int64_t version = 0;  // the training step
  int64_t base = 0;     // the version it follows
  std::string model;
  std::vector<TableRows> tables;
  std::vector<std::pair<std::string, ir::HostTensor>> dense;
};

// "update-000000000200.safetensors", and back (nullopt for any other name, a temporary file's too).
std::string updateFileName(int64_t version);
std::optional<int64_t> parseUpdateFileName(std::string_view name);

Status writeUpdate(const std::string& dir, const ModelUpdate& update);
// Reads and checks one update file, its checksum included; errors name the file.
Expected<ModelUpdate> readUpdate(const std::string& path);
// The update files of `dir` by version, ascending: regular files only (a FIFO or a device of an
// update's name is skipped, never opened).
Expected<std::vector<std::pair<int64_t, std::string>>> listUpdates(const std::string& dir);

// The trainer's side: which rows of the served tables the steps since the last update read (and
// so may have changed: embedding updates are sparse), and the update that publishes them.
class UpdatePublisher {
 public:
  // `dense`: the other parameters of @forward, published whole. `base`: the step training starts
  // from (0, or the checkpoint's step on resume).
  UpdatePublisher(std::string dir, std::string model, std::vector<ServedTable> tables,
                  std::vector<std::string> dense, int64_t base);
  // Notes the ids of one training batch.
  void noteBatch(const data::Batch& batch);
  // Writes the update of step `version` from `params` and starts a new one.
  Status publish(int64_t version, const runtime::ParameterStore& params);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_, model_;
  std::vector<ServedTable> tables_;
  std::vector<std::string> dense_;
  int64_t base_;
  std::vector<std::set<int64_t>> touched_;  // per table
};

}  // namespace kiln::serving
