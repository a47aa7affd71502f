// Batches for a model from any data source: synthetic, Criteo TSV files or Kiln binary files, or
// for a model that reads tokens, token files or a synthetic Markov chain.
// Epochs re-read the data from the start; batches run on across an epoch's end, so only the
// last batch of the last epoch may be short (or dropped with drop_last).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/data/record_source.h"
#include "runtime/data/schema.h"
#include "runtime/data/synthetic.h"
#include "runtime/data/token_source.h"

namespace kiln::data {

struct DataOptions {
  // {"synthetic"}, or data files read in order (TSV or binary, told apart by content).
  std::vector<std::string> paths;
  int64_t batch_size = 1;
  int64_t epochs = 1;  // 0: repeat forever
  bool drop_last = false;
  bool strict = false;  // TSV: a malformed line is fatal
  // Told about each skipped line as its batch is handed out (default: printed to stderr).
  DiagnosticSink on_skip;
  // Synthetic data: its seed and stream (0 trains, 1 is the held-out evaluation stream) and the
  // size of one epoch.
  SyntheticOptions synthetic;
  int64_t synthetic_samples = 1 << 20;
  // Token files: "u16" or "u32", or empty to tell by the file names (tokenDTypeFor).
  std::string token_dtype;
};

// Collects the lines a RecordSource skips, for the batch being read.
using SkipLog = std::vector<Status>;

class BatchReader {
 public:
  // `skips` (optional) is the log the records' TsvOptions::on_skip appends to.
  BatchReader(BatchSpec spec, DataOptions opts, std::unique_ptr<RecordSource> records,
              std::shared_ptr<SkipLog> skips = nullptr);
  // A model with its own schema: records from files under it.
  BatchReader(BatchSpec spec, DataOptions opts, std::unique_ptr<RowSource> rows,
              std::shared_ptr<SkipLog> skips);
  BatchReader(BatchSpec spec, DataOptions opts, SyntheticGenerator synthetic);
  // A model that reads tokens: each sample is one window of the source. `entropy_floor` is the
  // per-token cross entropy no model can beat on it, when known (synthetic data).
  BatchReader(BatchSpec spec, DataOptions opts, std::unique_ptr<TokenSource> tokens,
              std::optional<double> entropy_floor = std::nullopt);

  // Fills `batch` with the next batch (its skipped lines in batch.skipped); false when the last
  // epoch is done.
  Expected<bool> next(Batch& batch);
  // The position of the next sample; seek() continues from a position taken earlier.
  StreamPosition position() const { return pos_; }
  Status seek(const StreamPosition& pos);
  // Malformed lines read so far (read, not necessarily handed out: see Prefetcher::malformed).
  int64_t malformed() const { return records_ ? records_->malformed() : rows_ ? rows_->malformed() : 0; }
  const BatchSpec& spec() const { return spec_; }
  std::optional<double> entropyFloor() const { return entropy_floor_; }

  // Lines skipped after the last batch's last sample, once next() has returned false.
  const std::vector<SkippedLine>& skippedAtEnd() const { return skipped_at_end_; }
  // Skipped lines are reported (opts.on_skip) by next() itself, unless reports are deferred: a
  // prefetcher reports each batch's lines when it hands the batch out, never those of batches
  // read ahead and left unused.
  void deferSkipReports() { defer_reports_ = true; }
  void reportSkipped(const std::vector<SkippedLine>& lines) const;

 private:
  // The next sample of a file source (RecordSource or RowSource), across epochs.
  template <class Source, class Sample>
  Expected<bool> nextSample(Source& source, Sample& s);
  // A batch of the file source's samples, assembled into `batch` by `assemble`.
  template <class Source, class Sample, class Assemble>
  Expected<bool> nextFileBatch(Source& source, std::vector<Sample>& samples, Batch& batch, Assemble assemble);
  Expected<bool> nextWindow(int32_t* window);
  Expected<bool> nextTokens(Batch& batch);
  // Moves the lines skipped since the last call into `out`, located before sample `before`.
  void takeSkips(int64_t before, std::vector<SkippedLine>& out);

  BatchSpec spec_;
  DataOptions opts_;
  std::unique_ptr<RecordSource> records_;
  std::unique_ptr<RowSource> rows_;
  std::shared_ptr<SkipLog> skips_;
  std::vector<SkippedLine> skipped_at_end_;
  bool defer_reports_ = false;
  std::unique_ptr<SyntheticGenerator> synthetic_;
  std::unique_ptr<TokenSource> tokens_;
  std::optional<double> entropy_floor_;
  StreamPosition pos_;
  std::vector<RawSample> samples_;
  std::vector<Record> row_samples_;
  std::vector<int32_t> windows_;
};

// Opens `opts.paths` for `spec`: a model that reads tokens reads `{"synthetic"}` as windows of a
// Markov chain (markov_tokens.h) and files as token files.
Expected<std::unique_ptr<BatchReader>> openBatchReader(const BatchSpec& spec, DataOptions opts);

}  // namespace kiln::data
