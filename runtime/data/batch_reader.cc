#include "runtime/data/batch_reader.h"

#include <cstdio>
#include <cstring>

#include "runtime/data/binary_format.h"
#include "runtime/data/markov_tokens.h"

namespace kiln::data {

BatchReader::BatchReader(BatchSpec spec, DataOptions opts, std::unique_ptr<RecordSource> records,
                         std::shared_ptr<SkipLog> skips)
    : spec_(std::move(spec)),
      opts_(std::move(opts)),
      records_(std::move(records)),
      skips_(std::move(skips)) {}

BatchReader::BatchReader(BatchSpec spec, DataOptions opts, std::unique_ptr<RowSource> rows,
                         std::shared_ptr<SkipLog> skips)
    : spec_(std::move(spec)), opts_(std::move(opts)), rows_(std::move(rows)), skips_(std::move(skips)) {}

BatchReader::BatchReader(BatchSpec spec, DataOptions opts, SyntheticGenerator synthetic)
    : spec_(std::move(spec)), opts_(std::move(opts)), synthetic_(std::make_unique<SyntheticGenerator>(std::move(synthetic))) {}

BatchReader::BatchReader(BatchSpec spec, DataOptions opts, std::unique_ptr<TokenSource> tokens,
                         std::optional<double> entropy_floor)
    : spec_(std::move(spec)),
      opts_(std::move(opts)),
      tokens_(std::move(tokens)),
      entropy_floor_(entropy_floor) {}

static bool epochsDone(const StreamPosition& p, int64_t epochs) { return epochs > 0 && p.epoch >= epochs; }

template <class Source, class Sample>
Expected<bool> BatchReader::nextSample(Source& source, Sample& s) {
  for (;;) {
    if (epochsDone(pos_, opts_.epochs)) return false;
    KILN_ASSIGN_OR_RETURN(auto got, source.next(s));
    if (got) {
      StreamPosition at = source.position();
      pos_.file = at.file;
      pos_.offset = at.offset;
      pos_.line = at.line;
      ++pos_.sample;
      return true;
    }
    if (pos_.sample == 0) return Status::error("the data files hold no samples");
    // Start the next epoch at the first file.
    pos_ = StreamPosition{.epoch = pos_.epoch + 1};
    if (!epochsDone(pos_, opts_.epochs)) KILN_RETURN_IF_ERROR(source.seek(pos_));
  }
}

// As nextSample, for windows of a token stream.
Expected<bool> BatchReader::nextWindow(int32_t* window) {
  for (;;) {
    if (epochsDone(pos_, opts_.epochs)) return false;
    KILN_ASSIGN_OR_RETURN(auto got, tokens_->next(window));
    if (got) {
      StreamPosition at = tokens_->position();
      pos_.file = at.file;
      pos_.offset = at.offset;
      ++pos_.sample;
      return true;
    }
    if (pos_.sample == 0)
      return Status::errorf("the token data holds no window of {} tokens (T + 1)", tokens_->windowLength());
    pos_ = StreamPosition{.epoch = pos_.epoch + 1};
    if (!epochsDone(pos_, opts_.epochs)) KILN_RETURN_IF_ERROR(tokens_->seek(pos_));
  }
}

Expected<bool> BatchReader::nextTokens(Batch& batch) {
  const int64_t b = opts_.batch_size, w = tokens_->windowLength();
  windows_.resize(static_cast<size_t>(b * w));
  int64_t got = 0;
  while (got < b) {
    KILN_ASSIGN_OR_RETURN(auto more, nextWindow(windows_.data() + got * w));
    if (!more) break;
    ++got;
  }
  if (got == 0 || (opts_.drop_last && got < b)) return false;
  assembleTokenBatch(spec_, windows_.data(), got, batch);
  batch.end = pos_;
  return true;
}

void BatchReader::takeSkips(int64_t before, std::vector<SkippedLine>& out) {
  if (!skips_) return;
  for (Status& reason : *skips_) out.push_back(SkippedLine{before, std::move(reason)});
  skips_->clear();
}

void BatchReader::reportSkipped(const std::vector<SkippedLine>& lines) const {
  for (const SkippedLine& l : lines) {
    if (opts_.on_skip)
      opts_.on_skip(l.reason);
    else
      std::fprintf(stderr, "%s (line skipped)\n", l.reason.str().c_str());
  }
}

Expected<bool> BatchReader::next(Batch& batch) {
  const int64_t b = opts_.batch_size;
  batch.skipped.clear();
  if (tokens_) return nextTokens(batch);
  if (synthetic_) {
    // A batch is one run of consecutive samples, or two or more when it crosses an epoch's end.
    std::vector<Batch> more;
    int64_t got = 0;
    while (got < b && !epochsDone(pos_, opts_.epochs)) {
      int64_t n = std::min(b - got, opts_.synthetic_samples - pos_.sample);
      synthetic_->generate(pos_.sample, n, got == 0 ? batch : more.emplace_back());
      got += n;
      pos_.sample += n;
      if (pos_.sample == opts_.synthetic_samples) pos_ = StreamPosition{.epoch = pos_.epoch + 1};
    }
    if (got == 0 || (opts_.drop_last && got < b)) return false;
    if (!more.empty()) {
      for (size_t k = 0; k < spec_.inputs.size(); ++k) {
        ir::HostTensor& t = batch.tensors[k];
        std::vector<int64_t> shape = t.view.shape;
        std::vector<unsigned char> bytes = std::move(t.storage);
        for (const Batch& r : more) {
          shape[0] += r.tensors[k].view.shape[0];
          bytes.insert(bytes.end(), r.tensors[k].storage.begin(), r.tensors[k].storage.end());
        }
        t.reset(spec_.inputs[k].type.dtype(), shape);
        std::memcpy(t.storage.data(), bytes.data(), bytes.size());
      }
    }
    batch.size = got;
    batch.end = pos_;
    return true;
  }
  if (rows_)
    return nextFileBatch(*rows_, row_samples_, batch,
                         [&](const Record* r, int64_t n) { assembleRecords(spec_, r, n, batch); });
  return nextFileBatch(*records_, samples_, batch,
                       [&](const RawSample* r, int64_t n) { assembleBatch(spec_, r, n, batch); });
}

template <class Source, class Sample, class Assemble>
Expected<bool> BatchReader::nextFileBatch(Source& source, std::vector<Sample>& samples, Batch& batch,
                                          Assemble assemble) {
  const int64_t b = opts_.batch_size;
  samples.resize(static_cast<size_t>(b));
  int64_t got = 0;
  std::vector<SkippedLine> skipped;
  while (got < b) {
    auto ok = nextSample(source, samples[static_cast<size_t>(got)]);
    takeSkips(got, skipped);
    if (!ok) {
      if (!defer_reports_) reportSkipped(skipped);  // the lines before the error, as they were read
      return ok.status();
    }
    if (!*ok) break;
    ++got;
  }
  if (got == 0 || (opts_.drop_last && got < b)) {
    // The end of the data: lines skipped on the way there belong to no batch.
    skipped_at_end_ = std::move(skipped);
    if (!defer_reports_) reportSkipped(skipped_at_end_);
    return false;
  }
  assemble(samples.data(), got);
  batch.end = pos_;
  batch.skipped = std::move(skipped);
  if (!defer_reports_) reportSkipped(batch.skipped);
  return true;
}

Status BatchReader::seek(const StreamPosition& pos) {
  pos_ = pos;
  if (tokens_) return tokens_->seek(pos);
  if (synthetic_) {
    if (pos.sample > opts_.synthetic_samples)
      return Status::errorf("data position sample {} is beyond the synthetic epoch of {}", pos.sample, opts_.synthetic_samples);
    return Status::ok();
  }
  return rows_ ? rows_->seek(pos) : records_->seek(pos);
}

namespace {

Expected<std::unique_ptr<BatchReader>> openTokenReader(const BatchSpec& spec, DataOptions opts) {
  const InputSpec& tokens = spec.inputs[static_cast<size_t>(spec.tokensIndex())];
  if (opts.paths.size() == 1 && opts.paths[0] == "synthetic") {
    if (opts.synthetic_samples <= 0) return Status::error("a synthetic epoch needs at least one sample");
    if (tokens.vocab > kMaxSyntheticVocab)
      return Status::errorf("input '{}': synthetic tokens take a vocab of at most {}, got {}", tokens.name,
                            kMaxSyntheticVocab, tokens.vocab);
    auto chain = std::make_shared<const MarkovChain>(tokens.vocab, opts.synthetic.seed);
    const double floor = chain->entropyRate();
    auto source = openMarkovTokens(std::move(chain), opts.synthetic.seed, opts.synthetic.stream,
                                   tokens.seq_len, opts.synthetic_samples);
    return std::make_unique<BatchReader>(spec, std::move(opts), std::move(source), floor);
  }
  if (opts.paths.empty()) return Status::error("no token files given");
  KILN_ASSIGN_OR_RETURN(TokenDType dtype, tokenDTypeFor(opts.paths[0], opts.token_dtype));
  for (const std::string& p : opts.paths) {
    KILN_ASSIGN_OR_RETURN(TokenDType other, tokenDTypeFor(p, opts.token_dtype));
    if (other != dtype)
      return Status::errorf("'{}' holds {} tokens by its name but '{}' {}: give --token-dtype", p,
                            tokenDTypeName(other), opts.paths[0], tokenDTypeName(dtype));
  }
  KILN_ASSIGN_OR_RETURN(auto source, openTokenFiles(opts.paths, dtype, tokens.seq_len, tokens.vocab));
  return std::make_unique<BatchReader>(spec, std::move(opts), std::move(source));
}

}  // namespace

Expected<std::unique_ptr<BatchReader>> openBatchReader(const BatchSpec& spec, DataOptions opts) {
  if (opts.batch_size <= 0) return Status::errorf("batch size must be positive, got {}", opts.batch_size);
  if (opts.epochs < 0) return Status::errorf("epochs must be >= 0, got {}", opts.epochs);
  const bool synthetic = opts.paths.size() == 1 && opts.paths[0] == "synthetic";
  KILN_RETURN_IF_ERROR(checkReadable(spec, !synthetic));
  if (spec.readsTokens()) return openTokenReader(spec, std::move(opts));
  if (synthetic) {
    if (opts.synthetic_samples <= 0) return Status::error("a synthetic epoch needs at least one sample");
    SyntheticGenerator gen(spec, opts.synthetic);
    return std::make_unique<BatchReader>(spec, std::move(opts), std::move(gen));
  }
  // Skipped lines go into the batch they were read for; they are reported when it is handed out.
  auto skips = std::make_shared<SkipLog>();
  TsvOptions tsv;
  tsv.strict = opts.strict;
  tsv.on_skip = [skips](const Status& s) { skips->push_back(s); };
  if (spec.layout != DataLayout::Criteo) {
    const bool binary = isBinaryFile(opts.paths[0]);
    for (const std::string& p : opts.paths)
      if (isBinaryFile(p) != binary)
        return Status::errorf(
            "'{}' and '{}' are of different kinds (binary and text): give files of one kind", opts.paths[0],
            p);
    std::unique_ptr<RowSource> rows;
    if (binary) {
      KILN_ASSIGN_OR_RETURN(rows, openSchemaBinary(spec, opts.paths));
    } else {
      KILN_ASSIGN_OR_RETURN(rows, openSchemaText(spec, opts.paths, std::move(tsv)));
    }
    return std::make_unique<BatchReader>(spec, std::move(opts), std::move(rows), std::move(skips));
  }
  KILN_ASSIGN_OR_RETURN(auto records, openRecords(opts.paths, std::move(tsv)));
  return std::make_unique<BatchReader>(spec, std::move(opts), std::move(records), std::move(skips));
}

}  // namespace kiln::data
