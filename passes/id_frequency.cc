#include "passes/id_frequency.h"

#include <algorithm>
#include <optional>
#include <unordered_map>
#include <unordered_set>

namespace kiln::passes {

void IdSample::addSample(const int64_t* first, int64_t n) {
  ids.insert(ids.end(), first, first + n);
  offsets.push_back(static_cast<int64_t>(ids.size()));
}

namespace {

// How many of the sorted `v` lie below `bound`.
int64_t countBelow(const std::vector<int64_t>& v, int64_t bound) {
  return std::lower_bound(v.begin(), v.end(), bound) - v.begin();
}

// As the search ranks plans: the critical path first (within a relative 1e-3, below which two
// predictions do not differ), then the time summed over ranks, then the bytes on the links.
bool better(double step, double total, double bytes, double best_step, double best_total, double best_bytes) {
  if (step < best_step * (1 - 1e-3)) return true;
  if (step > best_step * (1 + 1e-3)) return false;
  if (total != best_total) return total < best_total;
  return bytes < best_bytes;
}

bool fits(const PlanCosts& c, const PlanRequest& req) {
  if (req.memory_per_rank <= 0) return true;
  for (const RankCost& r : c.ranks)
    if (r.memory_bytes > req.memory_per_rank) return false;
  return true;
}

}  // namespace

double FrequencyCurve::idShare(int64_t hot) const {
  if (id_ranks.empty() || hot <= 0) return 0;
  hot = std::min(hot, static_cast<int64_t>(hot_order.size()));  // only rows the ranking half saw
  return static_cast<double>(countBelow(id_ranks, hot)) / static_cast<double>(id_ranks.size());
}

double FrequencyCurve::sampleShare(int64_t hot) const {
  if (sample_max_ranks.empty() || hot <= 0) return 0;
  hot = std::min(hot, static_cast<int64_t>(hot_order.size()));
  return static_cast<double>(countBelow(sample_max_ranks, hot)) / static_cast<double>(sample_max_ranks.size());
}

double FrequencyCurve::uniqueShare(int64_t hot) const {
  hot = std::clamp<int64_t>(hot, 0, static_cast<int64_t>(hot_order.size()));
  const auto cold_ids = static_cast<double>(static_cast<int64_t>(id_ranks.size()) - countBelow(id_ranks, hot));
  const auto cold_distinct = static_cast<double>(static_cast<int64_t>(batch_distinct_ranks.size()) -
                                                 countBelow(batch_distinct_ranks, hot));
  return cold_ids > 0 ? cold_distinct / cold_ids : 1.0;
}

FrequencyCurve frequencyCurve(const IdSample& sample, int64_t rows, int64_t batch_samples) {
  FrequencyCurve c;
  c.rows = rows;
  const int64_t n = sample.samples();
  const int64_t half = n / 2;  // samples [0, half) rank the rows, [half, n) measure them
  std::unordered_map<int64_t, int64_t> counts;
  for (int64_t k = 0; k < sample.offsets[static_cast<size_t>(half)]; ++k) ++counts[sample.ids[static_cast<size_t>(k)]];
  std::vector<std::pair<int64_t, int64_t>> ranked(counts.begin(), counts.end());  // (row, count)
  std::sort(ranked.begin(), ranked.end(),
            [](const auto& a, const auto& b) { return a.second != b.second ? a.second > b.second : a.first < b.first; });
  std::unordered_map<int64_t, int64_t> rank_of;
  rank_of.reserve(ranked.size());
  for (size_t r = 0; r < ranked.size(); ++r) {
    c.hot_order.push_back(ranked[r].first);
    c.hot_counts.push_back(ranked[r].second);
    rank_of[ranked[r].first] = static_cast<int64_t>(r);
  }
  const int64_t unseen = static_cast<int64_t>(ranked.size());  // no hot set of any size holds it
  std::unordered_set<int64_t> new_rows;  // measured rows the ranking half never saw
  if (batch_samples <= 0 || batch_samples > n - half) batch_samples = n - half;
  std::unordered_map<int64_t, int64_t> in_batch;  // this batch's distinct ids and their ranks
  for (int64_t i = half; i < n; ++i) {
    if ((i - half) % batch_samples == 0) {
      for (const auto& [id, r] : in_batch) c.batch_distinct_ranks.push_back(r);
      in_batch.clear();
    }
    int64_t worst = -1;
    for (int64_t k = sample.offsets[static_cast<size_t>(i)]; k < sample.offsets[static_cast<size_t>(i + 1)]; ++k) {
      const int64_t id = sample.ids[static_cast<size_t>(k)];
      auto it = rank_of.find(id);
      if (it == rank_of.end()) new_rows.insert(id);
      const int64_t r = it == rank_of.end() ? unseen : it->second;
      c.id_ranks.push_back(r);
      in_batch.emplace(id, r);
      worst = std::max(worst, r);
    }
    c.sample_max_ranks.push_back(worst);
  }
  for (const auto& [id, r] : in_batch) c.batch_distinct_ranks.push_back(r);
  c.distinct = static_cast<int64_t>(ranked.size() + new_rows.size());
  c.samples = n - half;
  c.ids = static_cast<int64_t>(c.id_ranks.size());
  std::sort(c.id_ranks.begin(), c.id_ranks.end());
  std::sort(c.sample_max_ranks.begin(), c.sample_max_ranks.end());
  std::sort(c.batch_distinct_ranks.begin(), c.batch_distinct_ranks.end());
  return c;
}

std::vector<HybridEstimate> estimateHybrid(const ShardPlan& plan, const std::vector<TableInfo>& tables,
                                           const std::vector<FrequencyCurve>& curves, const PlanRequest& req) {
  std::vector<HybridEstimate> out;
  ShardPlan trial = plan;
  for (size_t i = 0; i < plan.tables.size() && i < curves.size(); ++i) {
    const TablePlan& t = plan.tables[i];
    const FrequencyCurve& curve = curves[i];
    HybridEstimate e;
    e.table = t.table;
    auto info = std::find_if(tables.begin(), tables.end(), [&](const TableInfo& x) { return x.name == t.table; });
    trial.tables[i].hot = {};
    const PlanCosts plain = planCosts(trial, tables, req);
    e.plain_bytes = e.hybrid_bytes = plain.tables[i].comm_bytes_per_step;
    if (info == tables.end() || curve.rows == 0 || t.kind().replicated() || plan.ranks < 1) {
      out.push_back(e);
      continue;
    }
    // The candidates: 0 (the plain table) and powers of two up to a quarter of the rows and the
    // rows the ranking half saw.
    double best_step = plain.step_s(), best_total = plain.total_s(), best_bytes = e.plain_bytes;
    e.candidates.push_back({HotRows{}, best_step, best_total, best_bytes, fits(plain, req)});
    const int64_t most = std::min<int64_t>(info->rows / 4, static_cast<int64_t>(curve.hot_order.size()));
    for (int64_t h = 1; h <= most; h *= 2) {
      HotRows hot{h, curve.idShare(h), curve.sampleShare(h)};
      trial.tables[i].hot = hot;
      const PlanCosts c = planCosts(trial, tables, req);
      const double step = c.step_s(), total = c.total_s(), bytes = c.tables[i].comm_bytes_per_step;
      e.candidates.push_back({hot, step, total, bytes, fits(c, req)});
      if (!e.candidates.back().fits) break;  // larger sets take more memory still
      if (better(step, total, bytes, best_step, best_total, best_bytes)) {
        best_step = step, best_total = total, best_bytes = bytes;
        e.hot = hot;
      }
    }
    trial.tables[i].hot = e.hot;  // later tables are scored with this one's hot rows in place
    // The rows themselves: the ranking's top, ascending (as plan.json and the shard pass hold them).
    e.hot.ids.assign(curve.hot_order.begin(), curve.hot_order.begin() + e.hot.rows);
    std::sort(e.hot.ids.begin(), e.hot.ids.end());
    e.hybrid_bytes = best_bytes;
    e.replica_bytes = e.hot.rows * info->bytesPerRow();
    out.push_back(e);
  }
  return out;
}

ShardPlan withHotRows(ShardPlan plan, const std::vector<HybridEstimate>& estimates) {
  for (const HybridEstimate& e : estimates)
    for (TablePlan& t : plan.tables)
      if (t.table == e.table) t.hot = e.hot;
  return plan;
}

std::vector<DedupChoice> chooseDedup(ShardPlan& plan, const std::vector<TableInfo>& tables,
                                     const std::vector<FrequencyCurve>& curves, const PlanRequest& req) {
  std::vector<DedupChoice> out;
  // The plan's costs as it stands, carried from one table's decision to the next; recomputed
  // only where clearing a table's incoming dedup changed the plan.
  std::optional<PlanCosts> current;
  for (size_t i = 0; i < plan.tables.size(); ++i) {
    TablePlan& t = plan.tables[i];
    DedupChoice c;
    c.table = t.table;
    if (t.dedup) current.reset();
    t.dedup = false;
    t.unique_share = 1;
    c.considered = i < curves.size() && curves[i].rows > 0 && t.kind().rowBlocks();
    if (c.considered) {
      if (!current) current = planCosts(plan, tables, req);
      const PlanCosts& plain = *current;
      t.dedup = true;
      t.unique_share = c.unique_share = std::max(1e-6, curves[i].uniqueShare(t.hot.rows));
      PlanCosts dedup = planCosts(plan, tables, req);
      c.plain_step_s = plain.step_s(), c.dedup_step_s = dedup.step_s();
      c.plain_bytes = plain.tables[i].comm_bytes_per_step, c.dedup_bytes = dedup.tables[i].comm_bytes_per_step;
      c.chosen = better(dedup.step_s(), dedup.total_s(), c.dedup_bytes, plain.step_s(), plain.total_s(), c.plain_bytes);
      if (c.chosen) {
        current = std::move(dedup);
      } else {
        t.dedup = false;
        t.unique_share = 1;
      }
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace kiln::passes
