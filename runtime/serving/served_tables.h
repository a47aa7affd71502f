// Which embedding tables of a model's @forward a serving store can hold, and how one batch reads
// them: the batch's ids of each such table are de-duplicated, their rows fetched (from the tiers
// of runtime/serving/embedding_store.h), and the ids rewritten to positions among the fetched
// rows. @forward then runs on the small [distinct ids, dim] tables instead of the whole ones
// (driver::Session::forwardWithRows). Each pooled sum adds the same rows in the same order as a
// lookup in the whole table, so the scores are equal bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/tensor_view.h"

namespace kiln::data {
struct Batch;
}

namespace kiln::serving {

struct ServedTable {
  std::string name;  // the parameter
  int64_t rows = 0;
  int64_t dim = 0;
  // The sparse inputs whose ids index it (several for a shared table), in declaration order.
  std::vector<std::string> id_inputs;
  // Tables whose lookups read the same inputs share a group (Wide & Deep reads a feature with a
  // wide and a deep table): one batch gathers the group's distinct ids for each of its tables, and
  // rewrites each input once. Groups are numbered 0, 1, ...
  int group = 0;
};

// The f32 tables of `forward` that a store can serve: read only as the table of
// kiln.embedding_bag lookups whose ids are kiln.inputs read by nothing but such lookups. Any
// other table (a cross's ids, a sequence lookup, a bf16 table, one that shares ids with those)
// stays a parameter of the session.
std::vector<ServedTable> findServedTables(const ir::Function& forward);

// Writes the rows of `ids` (distinct, ascending, each in [0, rows)) of table `table` (an index
// into the served tables) to `out`, ids.size() * dim floats.
using RowSource = std::function<Status(size_t table, std::span<const int64_t> ids, float* out)>;

// One batch's rows of every served table and its id inputs rewritten onto them.
struct GatheredRows {
  // Per served table: [distinct ids of the batch, dim], rows in ascending id order.
  std::vector<ir::HostTensor> rows;
  // Per served table: the distinct ids of its group (ascending), what `rows` holds.
  std::vector<std::vector<int64_t>> ids;
  // The batch's id inputs by name, each id replaced by its row's position in `rows`.
  std::vector<std::pair<std::string, ir::HostTensor>> remapped_inputs;
};

// Checks every id of the served tables' inputs against the table's rows (an error names the
// input, the sample and the id), then gathers through `source`.
Expected<GatheredRows> gatherRows(const std::vector<ServedTable>& tables, const data::Batch& batch,
                                  const RowSource& source);

}  // namespace kiln::serving
