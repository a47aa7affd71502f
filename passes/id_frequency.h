// Id frequencies of embedding tables from a sample of the data, and what replicating each table's
// hottest rows on every rank would save (HugeCTR's hybrid embedding): `kiln plan --data`.
//
// The curve of a table is measured honestly: the hot rows are ranked on the first half of the
// sample and their shares measured on the second, so a row that is frequent by chance in a small
// sample does not flatter the estimate. Two shares matter: of the ids, the hot ones are looked up
// on the rank that reads them (no id travels); of the samples, those whose ids are all hot need no
// pool from an owner (no pool or gradient travels).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "passes/auto_plan.h"

namespace kiln::passes {

// One table's ids over the sampled samples, sample-major: sample i's ids are
// ids[offsets[i], offsets[i + 1]).
struct IdSample {
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> ids;
  int64_t samples() const { return static_cast<int64_t>(offsets.size()) - 1; }
  void addSample(const int64_t* first, int64_t n);
};

struct FrequencyCurve {
  int64_t rows = 0;      // the table's rows
  int64_t samples = 0;   // in the measuring half
  int64_t ids = 0;       // in the measuring half
  int64_t distinct = 0;  // distinct ids in the whole sample
  // Rows by descending count in the ranking half (ties by row), with their counts.
  std::vector<int64_t> hot_order, hot_counts;
  // The measuring half: each id's rank in hot_order (rows the ranking half never saw rank past
  // its end), sorted; and per sample the largest rank among its ids (-1: no ids), sorted.
  std::vector<int64_t> id_ranks, sample_max_ranks;
  // The measuring half cut into one rank's batches: each batch's distinct ids, by their rank in
  // hot_order (as id_ranks), sorted.
  std::vector<int64_t> batch_distinct_ranks;

  // Of the measuring half's ids (samples), the share that are (have only) the `hot` top rows.
  double idShare(int64_t hot) const;
  double sampleShare(int64_t hot) const;
  // Of a rank's batch of ids outside the `hot` top rows, the distinct share (1: no repeats):
  // what a de-duplicated route sends (TablePlan::unique_share).
  double uniqueShare(int64_t hot) const;
};

// `batch_samples`: the samples of one rank's batch (global batch / ranks), over which ids
// repeat; 0 or more than the measuring half: that half as one batch.
FrequencyCurve frequencyCurve(const IdSample& sample, int64_t rows, int64_t batch_samples = 0);

// The best hot-row count for each model-parallel table of `plan`, the rest of the plan fixed.
struct HotCandidate {
  HotRows hot;
  double step_s = 0;      // the whole plan's predicted step with these hot rows
  double total_s = 0;     // its time summed over ranks (the tie-break within 0.1% of a step)
  double link_bytes = 0;  // the table's bytes on the links a step, summed over ranks
  bool fits = true;       // within every rank's memory
};

struct HybridEstimate {
  std::string table;
  std::vector<HotCandidate> candidates;  // every count considered, 0 first (`kiln plan --explain`)
  HotRows hot;                  // rows 0: replicating none is best (or the table is replicated)
  int64_t replica_bytes = 0;    // the hot rows and their state, on every rank
  double plain_bytes = 0;       // the table's bytes on the links per step, summed over ranks
  double hybrid_bytes = 0;      // the same with `hot` replicated (the hot gradients' exchange included)
};

// Candidates are 0 and powers of two of rows (at most a quarter of the table, and what every
// rank's memory has room for); each is scored as the search scores plans: by the whole plan's
// predicted step (within 0.1%), then its time summed over ranks, then the table's link bytes. `curves` holds one curve per plan table (rows 0: no sample, skipped).
std::vector<HybridEstimate> estimateHybrid(const ShardPlan& plan, const std::vector<TableInfo>& tables,
                                           const std::vector<FrequencyCurve>& curves, const PlanRequest& req);

// `plan` with every estimate's hot rows set.
ShardPlan withHotRows(ShardPlan plan, const std::vector<HybridEstimate>& estimates);

// One table's de-duplication what-if: the whole plan's predicted step and the table's link bytes
// with its ids routed plainly and de-duplicated.
struct DedupChoice {
  std::string table;
  bool considered = false;  // a row-block table with a sample
  bool chosen = false;
  double unique_share = 1;
  double plain_step_s = 0, dedup_step_s = 0;
  double plain_bytes = 0, dedup_bytes = 0;
};

// Sets TablePlan::dedup (and unique_share) on each row-block table of `plan` with a curve where
// routing de-duplicated ids predicts a faster step (the same order of comparison), table by
// table in plan order, each with its hot rows as `plan` holds them. Returns every table's what-if.
std::vector<DedupChoice> chooseDedup(ShardPlan& plan, const std::vector<TableInfo>& tables,
                                     const std::vector<FrequencyCurve>& curves, const PlanRequest& req);

}  // namespace kiln::passes
