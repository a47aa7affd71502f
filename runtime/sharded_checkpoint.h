// Sharded checkpoints (issue 13): every rank writes the pieces of the global tensors it holds
// into its own safetensors file, and rank 0 writes one index that describes every global tensor
// and where each of its pieces lies. Any region of any tensor can then be read back from the
// pieces that cover it, so a run on another rank count or under another sharding plan reads
// exactly its own slices. Format and guarantees: docs/distributed.md, "Sharded checkpoints".
//
// A directory holds one complete checkpoint at a time:
//   DIR/checkpoint.index.json                 the index, written last
//   DIR/shard-SSSSSSSS-rRRRR.safetensors      rank R's pieces at step S
// Shard files are stamped with their step, so writing step S never touches the files the index of
// an earlier step names: a crash before the new index is renamed into place leaves the previous
// checkpoint whole. Files the new index does not name are removed after it is in place.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ir/status.h"
#include "ir/tensor_view.h"
#include "runtime/checkpoint.h"
#include "runtime/comm/communicator.h"

namespace kiln::runtime {

inline constexpr const char* kShardedIndexFile = "checkpoint.index.json";

// One rectangular piece of a global tensor that this rank holds: `view` is its data (dense,
// row-major), `offset` where it starts in the global tensor along each dim; its extent is
// view.shape. The four shardings of the issue are all such pieces: row_wise a range of dim 0,
// column_wise a range of dim 1, table_wise the whole tensor on one rank, data_parallel the whole
// tensor on every rank with `replicated` set.
struct LocalPiece {
  std::string name;                   // the global tensor's name (a parameter or optimizer state)
  std::vector<int64_t> global_shape;  // of the whole tensor
  std::vector<int64_t> offset;        // as many entries as global_shape
  ir::TensorView view;
  // The same region is held by several ranks (a replicated tensor): only the lowest rank that
  // offers it writes it. Identical regions not marked replicated are an overlap error.
  bool replicated = false;
};

// Saves one checkpoint of `step` into `dir`, collectively: every rank of `comm` calls it with its
// own pieces. `metadata` (step, data position, run inputs: what a run needs to resume) is taken
// from rank 0 and stored in the index. The ranks first exchange the descriptions of their pieces,
// and each checks that they tile every global tensor exactly, so that a bad layout is the same
// error on every rank before anything is written. Each rank then writes its shard file (atomic:
// temporary file, fsync, rename); once every rank's file is durable, rank 0 writes the index
// atomically and removes the shard files it no longer names. `dir` must be one directory that
// every rank sees (a shared file system across nodes). Saving a step that the index in `dir`
// already holds is an error: its shard files are the ones the index names.
// Every rank returns an error if any rank failed; the index is then the previous one.
Status saveShardedCheckpoint(comm::Communicator& comm, const std::string& dir, int64_t step,
                             const std::vector<LocalPiece>& pieces,
                             const std::map<std::string, std::string>& metadata);

// Where one piece of a global tensor lies.
struct ShardPiece {
  std::string file;  // a file name inside the checkpoint directory
  std::string name;  // the tensor's name inside that file
  std::vector<int64_t> offset;
  std::vector<int64_t> extent;
};

struct GlobalTensor {
  std::string name;
  ir::DType dtype = ir::DType::f32;
  std::vector<int64_t> shape;
  std::vector<ShardPiece> pieces;
};

// A sharded checkpoint opened for reading: its index, validated, and the headers of every shard
// file it names, checked against it.
class ShardedCheckpoint {
 public:
  // Errors name the index or the shard file and the tensor: malformed JSON, pieces that leave a
  // gap in a tensor or overlap, a piece out of bounds, a missing shard file, a shard tensor whose
  // dtype or shape differs from the index's.
  static Expected<ShardedCheckpoint> open(const std::string& dir);
  // Whether `dir` holds an index (a sharded checkpoint rather than one checkpoint.safetensors).
  static bool isShardedDir(const std::string& dir);

  const std::string& dir() const { return dir_; }
  int64_t step() const { return step_; }
  int ranks() const { return ranks_; }  // how many ranks wrote it
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<GlobalTensor>& tensors() const { return tensors_; }  // in index order
  const GlobalTensor* find(const std::string& name) const;

  // Assembles the region [offset, offset + extent) of tensor `name` from the pieces that cover
  // it, reading only the bytes it needs.
  Expected<ir::HostTensor> loadSlice(const std::string& name, const std::vector<int64_t>& offset,
                                     const std::vector<int64_t>& extent) const;
  // The same into `dst`, whose shape is the extent; its dtype must be the tensor's.
  Status readSlice(const std::string& name, const std::vector<int64_t>& offset,
                   const ir::TensorView& dst) const;
  // Every tensor whole, with the index's metadata: the single-file form (kiln checkpoint merge).
  Expected<Checkpoint> merge() const;

 private:
  std::string dir_;
  int64_t step_ = 0;
  int ranks_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<GlobalTensor> tensors_;
  std::map<std::string, size_t> by_name_;
  // Per shard file: where each named tensor's bytes start.
  std::map<std::string, CheckpointHeader> headers_;
};

// The file name rank `rank` writes at `step`: shard-00000120-r0003.safetensors.
std::string shardFileName(int64_t step, int rank);

}  // namespace kiln::runtime
