// What a model reads each step: the BatchSpec (the model's declared data inputs, taken from its
// `kiln.input` ops) and a Batch (one host tensor per declared input, filled by a loader).
// Loaders know the Criteo layout (13 dense, 26 categorical features); models only name which
// features they read and how (docs/model-ir.md), so every model reads every data source. A
// language model instead reads windows of a token stream: tokens [B, T] and next-token targets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/tensor_view.h"
#include "ir/types.h"

namespace kiln::data {

// The Criteo layout: a label, 13 integer features, 26 categorical features.
inline constexpr int kNumDense = 13;
inline constexpr int kNumSparse = 26;

// The largest vocabulary of a token input: token ids travel as int32 (a u32 file's ids above it
// are out of range for any model).
inline constexpr int64_t kMaxVocab = int64_t{1} << 31;

enum class InputRole : uint8_t { Dense, Label, Sparse, Lengths, Weights, Tokens, Targets };
enum class IdMap : uint8_t { Modulo, Hash };

// How samples lie in a data file (docs/data.md, "Schemas"). A model whose inputs bind no file
// columns reads the Criteo layout; one whose inputs carry `columns(...)` defines its own schema
// and finds its columns by name in each file's header line, or by position.
enum class DataLayout : uint8_t { Criteo, Named, Positional };

// One file column an input reads: a header name or a 0-based position.
struct ColumnRef {
  std::string name;
  int64_t position = -1;

  bool named() const { return position < 0; }
  std::string str() const;  // 'click' or #3
  bool operator==(const ColumnRef&) const = default;
};

struct InputSpec {
  std::string name;
  InputRole role = InputRole::Dense;
  ir::TensorType type;  // as declared, with the batch symbol
  int feature = -1;     // sparse/lengths/weights: the categorical feature (0..25 for Criteo)
  int dense_count = 0;  // dense: how many dense features (the last dim): the first of Criteo's 13
  int label_count = 0;  // label: how many labels (f32[B]: 1, f32[B, k]: k)
  // A schema layout's file columns: one per dense feature, label or categorical feature, and
  // where they start among the schema's columns of their kind (schema.h).
  std::vector<ColumnRef> columns;
  int first_column = 0;
  int64_t rows = 0;     // sparse: table rows; ids are mapped into [0, rows)
  int hotness = 0;      // sparse, fixed: ids per sample
  int max_hotness = 0;  // sparse, variable length: at most this many ids per sample
  IdMap id_map = IdMap::Modulo;
  // Sparse: the embedding table reading the ids when the model names it (attribute `table`, set
  // for pool = none lookups); the synthetic generator pairs a history with a candidate by it.
  std::string table;
  // Sparse: the candidates' ids of an in-batch retrieval loss (attribute `retrieval` =
  // "candidate", set by in_batch_softmax); the synthetic generator draws them for the query.
  bool retrieval_candidate = false;
  // Sparse, variable length: indices into BatchSpec::inputs of the feature's lengths and
  // weights inputs (-1 when absent). Fixed hotness may have weights too.
  int lengths_input = -1;
  int weights_input = -1;
  // Tokens and targets: the sequence length T of [B, T]; tokens: ids lie in [0, vocab).
  int64_t seq_len = 0;
  int64_t vocab = 0;

  bool variableLength() const { return max_hotness > 0; }
  // Ids per sample at most.
  int idsPerSample() const { return variableLength() ? max_hotness : hotness; }
};

struct BatchSpec {
  std::vector<InputSpec> inputs;
  std::string batch_symbol = "B";
  DataLayout layout = DataLayout::Criteo;

  const InputSpec* find(const std::string& name) const;
  int indexOf(const std::string& name) const;  // -1 when absent
  int labelIndex() const;                      // -1 when the model has no label input
  int tokensIndex() const;                     // -1 when the model reads no token stream
  int targetsIndex() const;                    // -1 when the model has no next-token targets
  bool readsTokens() const { return tokensIndex() >= 0; }
};

// Whether the data loaders can fill every input of `spec`: the Criteo layout has one label,
// and its files 13 dense and 26 categorical features (synthetic data makes any number). `kiln
// check` (--data: files) and every reader ask the same question.
Status checkReadable(const BatchSpec& spec, bool files);

// Builds the spec from a function's `kiln.input` ops (the trainer-fed scalars `lr` and `step`
// are not data and are left out). Errors name the input and the attribute at fault.
Expected<BatchSpec> fromFunction(const ir::Function& fn);
// The same from explicit (attributes, type) pairs, in declaration order.
Expected<BatchSpec> fromInputs(const std::vector<std::pair<ir::AttrDict, ir::TensorType>>& inputs);

// Where a stream stands: the next sample to read. `offset` is a byte offset within file `file`
// and `line` the number of lines consumed there, so a reader seeks without rescanning.
// `sample` counts samples delivered in the current epoch. A token stream uses the same fields:
// `offset` is the byte offset of the next window's first token (`line` stays 0), `sample` the
// windows delivered; synthetic streams need only `sample`.
struct StreamPosition {
  int64_t epoch = 0;
  int64_t file = 0;
  int64_t offset = 0;
  int64_t line = 0;
  int64_t sample = 0;

  // "epoch=0,file=1,offset=4096,line=17,sample=120": stored in checkpoint metadata.
  std::string str() const;
  static Expected<StreamPosition> parse(std::string_view s);
  bool operator==(const StreamPosition&) const = default;
};

// A malformed line skipped while a batch was read: why (located), and where it sat among the
// batch's samples, so that one output per input line can be written (kiln predict).
struct SkippedLine {
  int64_t before = 0;  // the batch's samples read before it: 0 .. size
  Status reason;
};

// One host tensor per input of the spec, in the spec's order, holding `size` samples. Variable-
// length ids are shaped [total ids of the batch].
struct Batch {
  int64_t size = 0;
  std::vector<std::string> names;
  std::vector<ir::HostTensor> tensors;
  // The stream's position after this batch: saved with a checkpoint to resume at the next one.
  StreamPosition end;
  // The malformed lines among this batch's samples, in order (the last may follow its last sample).
  std::vector<SkippedLine> skipped;

  const ir::HostTensor* find(const std::string& name) const;
  ir::HostTensor* find(const std::string& name);
};

// Samples [first, first + n) of `b` (which `spec` describes): a rank's share of a global batch.
// Variable-length ids and their weights go with their samples' lengths.
Expected<Batch> sliceBatch(const Batch& b, const BatchSpec& spec, int64_t first, int64_t n);

// The label of sample i when the spec has a label input (f32 [B] or [B, k]: the first of k).
float batchLabel(const Batch& b, const BatchSpec& spec, int64_t i);

std::string_view roleName(InputRole r);

}  // namespace kiln::data
