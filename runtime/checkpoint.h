// Checkpoints in the safetensors format (https://github.com/huggingface/safetensors):
//   u64 little-endian N | N bytes of JSON header | raw little-endian tensor data
// The header maps each tensor name (the model's parameter names, optimizer state included) to
// {"dtype": "F32", "shape": [r, c], "data_offsets": [begin, end]} (offsets relative to the data
// section) and holds "__metadata__": an object of strings (step, model, data position, RNG
// state: whatever a run needs to resume exactly).
// Saving writes a temporary file in the same folder, fsyncs it, renames it into place and
// fsyncs the folder, so a crash leaves the old checkpoint or the new one, never half of one.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ir/status.h"
#include "ir/tensor_view.h"

namespace kiln::runtime {

struct Checkpoint {
  std::vector<std::pair<std::string, ir::HostTensor>> tensors;  // in file order
  std::map<std::string, std::string> metadata;

  const ir::HostTensor* find(const std::string& name) const;
};

// Writes `tensors` (in the given order) and `metadata` to `path` atomically.
// Makes `dir` (and its parents) a directory checkpoints can be written to, proving it with a
// test write of `reserve_bytes` (a checkpoint's size: the space one more save needs beside the
// last one): a path that is a file, a directory that cannot be created or written, a disk too
// full or a file size limit too low for a checkpoint are an error naming `dir`, before any work
// is done (issue 12: a run trained and was then lost).
Status prepareCheckpointDir(const std::string& dir, uint64_t reserve_bytes = 1);

Status saveCheckpoint(const std::string& path, const std::vector<std::pair<std::string, ir::TensorView>>& tensors,
                      const std::map<std::string, std::string>& metadata);
// The bytes saveCheckpoint writes, in memory (a compiled model's embedded weights).
Expected<std::vector<uint8_t>> serializeCheckpoint(
    const std::vector<std::pair<std::string, ir::TensorView>>& tensors,
    const std::map<std::string, std::string>& metadata);

// Reads and validates a whole checkpoint: sizes, JSON, dtypes, shapes, offsets (in range,
// matching the tensor's size, non-overlapping, covering the data). Errors name the file and,
// where it applies, the tensor.
Expected<Checkpoint> loadCheckpoint(const std::string& path);
// The same checks on the bytes of a whole checkpoint file in memory; `name` is for messages.
Expected<Checkpoint> parseCheckpoint(std::string_view bytes, const std::string& name);

// The same checks, without copying: the tensors are external views into `bytes` (which
// `keep_alive` keeps valid), writable when the bytes are. Each tensor's data must be aligned to
// its element size (saveCheckpoint pads its header so). A compiled model's embedded weights.
Expected<Checkpoint> viewCheckpoint(std::span<uint8_t> bytes, const std::string& name,
                                    std::shared_ptr<const void> keep_alive);

// Copies a loaded checkpoint into the model's tensors: every destination must be present with
// the same dtype and shape, and the checkpoint may hold nothing else. `path` is for messages.
// Copies the region of `whole` that starts at `offset` and has dst's shape into dst (a shard of
// a tensor saved whole, e.g. a single-file checkpoint resumed on several ranks).
Status copyRegion(const ir::TensorView& whole, const std::vector<int64_t>& offset, const ir::TensorView& dst);

Status restoreTensors(const Checkpoint& ckpt, const std::map<std::string, ir::TensorView>& dest, const std::string& path);

// safetensors dtype names: "F32", "BF16", "I64", "BOOL", ...
std::string_view safetensorsDType(ir::DType t);
std::optional<ir::DType> parseSafetensorsDType(std::string_view name);

// Writes `bytes` to `path` as saveCheckpoint writes a checkpoint: a temporary file beside it,
// fsync, rename, fsync of the folder (the index of a sharded checkpoint).
Status writeFileAtomically(const std::string& path, std::string_view bytes);

// A checkpoint file's header alone, validated as loadCheckpoint validates it, so that a reader
// of a few slices (runtime/sharded_checkpoint.h) need not hold whole files in memory.
struct CheckpointEntry {
  std::string name;
  ir::DType dtype = ir::DType::f32;
  std::vector<int64_t> shape;
  uint64_t file_offset = 0;  // of the tensor's first byte, from the start of the file
  uint64_t bytes = 0;
};
struct CheckpointHeader {
  std::vector<CheckpointEntry> tensors;  // in header order
  std::map<std::string, std::string> metadata;
  const CheckpointEntry* find(const std::string& name) const;
};
Expected<CheckpointHeader> readCheckpointHeader(const std::string& path);
// Reads `n` bytes at `file_offset` of `path` into `dst`; `what` names the tensor in messages.
Status readCheckpointBytes(const std::string& path, uint64_t file_offset, uint64_t n, void* dst,
                           const std::string& what);

}  // namespace kiln::runtime
