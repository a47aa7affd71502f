// Shared by the TSV and binary data fuzzers: the input as a file (the readers open paths, as
// `kiln train --data FILE` does), a model's batch spec that touches every kind of input, and a
// read of every batch to the end, checking that a resumed read sees the same batches.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/data/batch_reader.h"

namespace kiln::fuzz {

// The bytes as an in-memory file (memfd), under a path every open() accepts: no disk I/O.
class MemFile {
 public:
  explicit MemFile(std::string_view bytes) {
    fd_ = ::memfd_create("kiln-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) std::abort();
    for (size_t at = 0; at < bytes.size();) {
      ssize_t w = ::write(fd_, bytes.data() + at, bytes.size() - at);
      if (w <= 0) std::abort();
      at += static_cast<size_t>(w);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

inline void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
    std::abort();
  }
}

// Dense and label; fixed-hotness ids (modulo into i64, hashed into i32 with per-id weights);
// variable-length ids with lengths and weights.
inline data::BatchSpec fuzzSpec() {
  auto type = [](const char* body) {
    auto t = ir::parseTensorTypeBody(body);
    check(t.isOk(), "a fuzz spec type parses");
    return t.take();
  };
  std::vector<std::pair<ir::AttrDict, ir::TensorType>> decls = {
      {{{"name", "dense"}, {"role", "dense"}}, type("Bx13xf32")},
      {{{"name", "label"}, {"role", "label"}}, type("Bx1xf32")},
      {{{"name", "c0"}, {"role", "sparse"}, {"feature", 0}, {"rows", 1000}}, type("Bx1xi64")},
      {{{"name", "c7"}, {"role", "sparse"}, {"feature", 7}, {"rows", 97}, {"id_map", "hash"}},
       type("Bx3xi32")},
      {{{"name", "c7.w"}, {"role", "weights"}, {"feature", 7}}, type("Bx3xf32")},
      {{{"name", "c25"}, {"role", "sparse"}, {"feature", 25}, {"rows", int64_t{1} << 40}, {"max_hotness", 4}},
       type("?(4*B)xi64")},
      {{{"name", "c25.len"}, {"role", "lengths"}, {"feature", 25}}, type("Bxi32")},
      {{{"name", "c25.w"}, {"role", "weights"}, {"feature", 25}}, type("?(4*B)xf32")},
  };
  auto spec = data::fromInputs(decls);
  check(spec.isOk(), "the fuzz spec is valid");
  return spec.take();
}

inline bool sameBatch(const data::Batch& a, const data::Batch& b) {
  if (a.size != b.size || !(a.end == b.end) || a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i)
    if (a.tensors[i].view.shape != b.tensors[i].view.shape || a.tensors[i].storage != b.tensors[i].storage)
      return false;
  return true;
}

struct ReadResult {
  bool opened = false;      // the reader opened the file
  bool to_the_end = false;  // and read it to the end without an error
  int64_t samples = 0;      // over all epochs
};

// Reads every batch of `path` over `epochs` epochs, as training does, to the end or the first
// error; with `resume`, then resumes after some batches, as `kiln train --resume` does, and
// checks that the next batch is the one read before. (Every open costs the TSV reader a 1 MiB
// buffer, which dominates the time of an input: resumes are checked where they matter.)
inline ReadResult readBatches(const std::string& path, bool strict, int64_t epochs, bool resume) {
  static const data::BatchSpec spec = fuzzSpec();
  data::DataOptions opts;
  opts.paths = {path};
  opts.batch_size = 3;
  opts.epochs = epochs;
  opts.strict = strict;
  opts.on_skip = [](const Status& s) { (void)s.str(); };
  ReadResult result;
  auto reader = data::openBatchReader(spec, opts);
  if (!reader) return result;
  result.opened = true;
  std::vector<data::Batch> batches;
  for (;;) {
    data::Batch batch;
    auto more = (*reader)->next(batch);
    if (!more) break;
    if (!*more) {
      result.to_the_end = true;
      break;
    }
    check(batch.size > 0 && batch.size <= opts.batch_size, "a batch holds 1..batch_size samples");
    result.samples += batch.size;
    batches.push_back(std::move(batch));
  }
  // A checkpoint after batch i - 1 stores its end; resuming there must give batch i. The middle
  // batch and the last (in the last epoch, past the restart at the first file).
  for (size_t i : {batches.size() / 2, batches.size() - 1}) {
    if (!resume || i == 0 || i >= batches.size()) continue;
    auto again = data::openBatchReader(spec, opts);
    check(again.isOk(), "the data opens a second time");
    check((*again)->seek(batches[i - 1].end).isOk(), "a reader seeks to the end of a batch it read");
    data::Batch batch;
    auto more = (*again)->next(batch);
    check(more.isOk() && *more, "a resumed reader reads the batch it read before");
    check(sameBatch(batch, batches[i]), "a resumed reader reads the same batch");
  }
  return result;
}

// One epoch, then two: every later epoch reads the same bytes again, so a file read whole once
// must read whole twice, with twice the samples. Returns the two-epoch read.
inline ReadResult readAllBatches(const std::string& path, bool strict) {
  ReadResult once = readBatches(path, strict, 1, /*resume=*/false);
  ReadResult twice = readBatches(path, strict, 2, /*resume=*/true);
  check(!once.to_the_end || (twice.to_the_end && twice.samples == 2 * once.samples),
        "a file read whole in one epoch reads whole in two, each sample twice");
  return twice;
}

}  // namespace kiln::fuzz
