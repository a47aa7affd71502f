#include "passes/auto_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace kiln::passes {
namespace {

// Powers of 1024, one decimal: reasons and errors read at a glance (exact bytes are in plan.json).
std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, units[u]);
}

int64_t tableBytes(const TableInfo& t) { return t.rows * t.bytesPerRow(); }

// What one table adds to each rank (memory, lookup bytes, link bytes and collectives) and its
// own totals, per the formulas of auto_plan.h.
struct Delta {
  std::vector<RankCost> ranks;
  TableCost table;
};

Delta tableDelta(const TablePlan& t, const TableInfo& info, const PlanRequest& req, int n, int rpn) {
  Delta out;
  out.ranks.assign(static_cast<size_t>(n), RankCost{});
  const double G = static_cast<double>(req.global_batch);
  const double b = G / n, h = info.lookups_per_sample, e = static_cast<double>(ir::dtypeBytes(info.dtype));
  const double d = static_cast<double>(info.dim), s = static_cast<double>(info.state_bytes_per_row);
  const bool multi_node = rpn > 0 && n > rpn;
  const LinkRates& global_link = multi_node ? req.target.inter_node : req.target.intra_node;
  const LinkRates& node_link = req.target.intra_node;
  const double bw = req.target.bytes_per_s > 0 ? req.target.bytes_per_s : 1e9;
  const double ids = 8 * h + 8;  // one sample's ids and its length
  const int k = static_cast<int>(t.ranks.size());
  std::vector<bool> holds(static_cast<size_t>(n), false);
  // Ranks outside [0, n) (a plan completePlan has not checked) hold nothing here.
  for (int r : t.ranks)
    if (r >= 0 && r < n) holds[static_cast<size_t>(r)] = true;
  for (const TableShard& sh : t.shards)
    if (sh.rank >= 0 && sh.rank < n)
      out.ranks[static_cast<size_t>(sh.rank)].memory_bytes +=
          sh.rows() * (sh.cols() * ir::dtypeBytes(info.dtype) + info.state_bytes_per_row);
  // Lookup bytes on a rank: the forward reads `fwd` rows of `cols` columns, the update reads and
  // writes `upd` rows and their state.
  auto lookups = [&](int r, double fwd, double upd, double cols) {
    out.ranks[static_cast<size_t>(r)].lookup_s += (fwd * cols * e + upd * (2 * cols * e + 2 * s)) / bw;
  };
  auto comm = [&](int r, double bytes, const LinkRates& link, int collectives) {
    double rate = link.bytes_per_s > 0 ? link.bytes_per_s : 1e9;
    out.ranks[static_cast<size_t>(r)].comm_s += bytes / rate + collectives * link.latency_s;
    out.table.comm_bytes_per_step += bytes;
  };
  for (int r = 0; r < n; ++r) {
    const bool mine = holds[static_cast<size_t>(r)];
    switch (t.type) {
      case ShardingType::data_parallel:
        lookups(r, b * h, G * h, d);
        if (n > 1) comm(r, (n - 1) * b * (8 * h + 8 + d * e), global_link, 2);
        break;
      case ShardingType::table_wise:
        if (mine) {
          lookups(r, G * h, G * h, d);
          if (n > 1) comm(r, (n - 1) * b * (ids + 2 * d * e), global_link, 4);
        } else {
          comm(r, b * (ids + 2 * d * e), global_link, 4);
        }
        break;
      case ShardingType::row_wise:
        if (mine) lookups(r, G * h / k, G * h / k, d);
        if (n > 1) {
          if (mine)
            comm(r, 8 * b * h + 8.0 * n * b + 2.0 * (n - 1) * b * d * e, global_link, 4);
          else
            comm(r, b * (ids + 2 * d * e), global_link, 4);
        }
        break;
      case ShardingType::column_wise: {
        const double cols = d / k;
        if (mine) lookups(r, G * h, G * h, cols);
        const double grads = s > 0 ? k * b * d * e : b * d * e;
        if (n > 1) comm(r, k * b * ids + b * d * e + grads, global_link, 4);
        break;
      }
      case ShardingType::table_row_wise:
        if (mine) {
          lookups(r, G * h / k, G * h / k, d);
          // Row-wise inside the group for the whole batch's ids, then pools back to their ranks.
          const double gb = G / k;
          if (k > 1) comm(r, 8 * gb * h + 8.0 * k * gb + 2.0 * (k - 1) * gb * d * e, node_link, 3);
          if (n > 1) comm(r, b * (ids + 2 * d * e), global_link, 2);
        } else if (n > 1) {
          comm(r, b * (ids + 2 * d * e), global_link, 4);
        }
        break;
    }
  }
  for (auto& rc : out.ranks) rc.step_s = rc.lookup_s + rc.comm_s;
  for (const auto& rc : out.ranks)
    out.table.bytes_per_rank = std::max(out.table.bytes_per_rank, rc.memory_bytes);
  out.table.lookups_per_step = G * h;
  return out;
}

void add(std::vector<RankCost>& acc, const std::vector<RankCost>& d) {
  for (size_t r = 0; r < acc.size(); ++r) {
    acc[r].memory_bytes += d[r].memory_bytes;
    acc[r].lookup_s += d[r].lookup_s;
    acc[r].comm_s += d[r].comm_s;
    acc[r].step_s += d[r].step_s;
  }
}

class Greedy {
 public:
  Greedy(const std::vector<TableInfo>& tables, const PlanRequest& req)
      : tables_(tables), req_(req), n_(req.ranks), acc_(static_cast<size_t>(req.ranks)) {}

  Expected<ShardPlan> run() {
    if (n_ < 1) return Status::errorf("a plan needs at least 1 rank, got {}", n_);
    if (req_.ranks_per_node < 0)
      return Status::errorf("--ranks-per-node must be 0 or positive, got {}", req_.ranks_per_node);
    if (req_.global_batch < 1)
      return Status::errorf("the global batch must be at least 1, got {}", req_.global_batch);
    plan_.ranks = n_;
    plan_.ranks_per_node = req_.ranks_per_node;
    plan_.tables.resize(tables_.size());
    placed_.assign(tables_.size(), false);
    std::vector<size_t> order(tables_.size());
    std::iota(order.begin(), order.end(), 0);
    // Largest first: big tables have the fewest places to go.
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return tableBytes(tables_[a]) > tableBytes(tables_[b]); });
    int64_t sharded_total = 0;
    for (size_t i : order)
      if (!tables_[i].pinned && tableBytes(tables_[i]) > kSmallTableBytes)
        sharded_total += tableBytes(tables_[i]);
    const double share = static_cast<double>(sharded_total) / n_;

    // 1. Replicated: data_parallel pins, then the small tables (all of them on one rank).
    for (size_t i : order) {
      const TableInfo& t = tables_[i];
      if (t.pinned == ShardingType::data_parallel) {
        KILN_RETURN_IF_ERROR(place(i, ShardingType::data_parallel, all(), "pinned in the model"));
      } else if (!t.pinned && (n_ == 1 || tableBytes(t) <= kSmallTableBytes)) {
        std::string why = n_ == 1 ? "one rank holds every table"
                                  : fmt::format(
                                        "small ({}): a replica on every rank costs little memory and its "
                                        "row gradients little traffic",
                                        human(static_cast<double>(tableBytes(t))));
        KILN_RETURN_IF_ERROR(place(i, ShardingType::data_parallel, all(), why));
      }
    }
    // 2. Row-wise: row_wise pins, the largest table, and any table above a balanced rank's share.
    bool largest = true;
    for (size_t i : order) {
      if (placed_[i]) continue;
      const TableInfo& t = tables_[i];
      if (t.pinned == ShardingType::row_wise) {
        KILN_RETURN_IF_ERROR(place(i, ShardingType::row_wise, all(), "pinned in the model"));
      } else if (!t.pinned && (largest || static_cast<double>(tableBytes(t)) > share)) {
        std::string why =
            largest ? fmt::format("the largest table ({}): its rows and lookups split over all {} ranks",
                                  human(static_cast<double>(tableBytes(t))), n_)
                    : fmt::format("{} is more than a balanced rank's share ({}) of the sharded tables",
                                  human(static_cast<double>(tableBytes(t))), human(share));
        largest = false;
        KILN_RETURN_IF_ERROR(place(i, ShardingType::row_wise, all(), why));
      }
    }
    // 3. Column- and table-row-wise pins.
    for (size_t i : order) {
      if (placed_[i]) continue;
      const TableInfo& t = tables_[i];
      if (t.pinned == ShardingType::column_wise) {
        int k = n_;
        while (t.dim % k != 0) --k;
        std::string why =
            k == n_ ? "pinned in the model"
                    : fmt::format("pinned in the model; dim {} splits over {} ranks at most", t.dim, k);
        KILN_RETURN_IF_ERROR(place(i, ShardingType::column_wise, leastLoaded(k), why));
      } else if (t.pinned == ShardingType::table_row_wise) {
        KILN_RETURN_IF_ERROR(place(i, ShardingType::table_row_wise, leastLoadedNode(),
                                   "pinned in the model; the least loaded node"));
      }
    }
    // 4. The rest table-wise, each on the rank that keeps the slowest rank fastest.
    for (size_t i : order) {
      if (placed_[i]) continue;
      const TableInfo& t = tables_[i];
      bool pinned = t.pinned == ShardingType::table_wise;
      KILN_RETURN_IF_ERROR(placeTableWise(i, pinned));
    }
    KILN_RETURN_IF_ERROR(completePlan(plan_, tables_));
    return plan_;
  }

 private:
  std::vector<int> all() const {
    std::vector<int> r(static_cast<size_t>(n_));
    std::iota(r.begin(), r.end(), 0);
    return r;
  }
  std::vector<int> leastLoaded(int k) const {
    std::vector<int> r = all();
    std::stable_sort(r.begin(), r.end(), [&](int a, int b) { return acc_[a].step_s < acc_[b].step_s; });
    r.resize(static_cast<size_t>(k));
    std::sort(r.begin(), r.end());
    return r;
  }
  std::vector<int> leastLoadedNode() const {
    const int g = req_.ranks_per_node > 0 ? std::min(req_.ranks_per_node, n_) : n_;
    int best = 0;
    double best_load = 0;
    for (int node = 0; node * g < n_; ++node) {
      double load = 0;
      for (int r = node * g; r < std::min(n_, (node + 1) * g); ++r)
        load += acc_[static_cast<size_t>(r)].step_s;
      if (node == 0 || load < best_load) {
        best = node;
        best_load = load;
      }
    }
    std::vector<int> r;
    for (int x = best * g; x < std::min(n_, (best + 1) * g); ++x) r.push_back(x);
    return r;
  }

  TablePlan entry(size_t i, ShardingType type, std::vector<int> ranks) const {
    TablePlan t;
    t.table = tables_[i].name;
    t.type = type;
    t.ranks = std::move(ranks);
    t.shards = layoutShards(t, tables_[i]);
    return t;
  }

  // The rank that would overflow, or -1; `short_by` its shortfall.
  int overflow(const Delta& d, int64_t& short_by) const {
    if (req_.memory_per_rank <= 0) return -1;
    for (int r = 0; r < n_; ++r) {
      int64_t total =
          acc_[static_cast<size_t>(r)].memory_bytes + d.ranks[static_cast<size_t>(r)].memory_bytes;
      if (total > req_.memory_per_rank) {
        short_by = total - req_.memory_per_rank;
        return r;
      }
    }
    return -1;
  }

  Status doesNotFit(size_t i, ShardingType type, const Delta& d, int r, int64_t short_by) const {
    int64_t used = acc_[static_cast<size_t>(r)].memory_bytes;
    return Status::error(fmt::format(
        "table '{}' does not fit: as {} it needs {} bytes ({}) on rank {}, which has {} of its {} bytes ({}) "
        "free; short by {} bytes ({})",
        tables_[i].name, shardingName(type), d.ranks[static_cast<size_t>(r)].memory_bytes,
        human(static_cast<double>(d.ranks[static_cast<size_t>(r)].memory_bytes)), r,
        req_.memory_per_rank - used, req_.memory_per_rank, human(static_cast<double>(req_.memory_per_rank)),
        short_by, human(static_cast<double>(short_by))));
  }

  Status commit(size_t i, TablePlan t, const Delta& d, std::string why) {
    add(acc_, d.ranks);
    t.reason = std::move(why);
    plan_.tables[i] = std::move(t);
    placed_[i] = true;
    return Status::ok();
  }

  Status place(size_t i, ShardingType type, std::vector<int> ranks, std::string why) {
    TablePlan t = entry(i, type, std::move(ranks));
    Delta d = tableDelta(t, tables_[i], req_, n_, req_.ranks_per_node);
    int64_t short_by = 0;
    int r = overflow(d, short_by);
    if (r >= 0) return doesNotFit(i, type, d, r, short_by);
    return commit(i, std::move(t), d, std::move(why));
  }

  Status placeTableWise(size_t i, bool pinned) {
    int best = -1;
    double best_time = 0;
    Delta best_delta;
    int64_t least_short = -1;
    int least_short_rank = 0;
    Delta least_short_delta;
    for (int r = 0; r < n_; ++r) {
      TablePlan t = entry(i, ShardingType::table_wise, {r});
      Delta d = tableDelta(t, tables_[i], req_, n_, req_.ranks_per_node);
      int64_t short_by = 0;
      int over = overflow(d, short_by);
      if (over >= 0) {
        if (least_short < 0 || short_by < least_short) {
          least_short = short_by;
          least_short_rank = over;
          least_short_delta = d;
        }
        continue;
      }
      double slowest = 0;
      for (int x = 0; x < n_; ++x)
        slowest =
            std::max(slowest, acc_[static_cast<size_t>(x)].step_s + d.ranks[static_cast<size_t>(x)].step_s);
      if (best < 0 || slowest < best_time - 1e-15) {
        best = r;
        best_time = slowest;
        best_delta = std::move(d);
      }
    }
    if (best >= 0) {
      std::string why =
          pinned ? fmt::format("pinned in the model; rank {} keeps the slowest rank fastest", best)
                 : fmt::format("on rank {}: the slowest rank's predicted time stays lowest ({:.3g} ms)", best,
                               best_time * 1e3);
      return commit(i, entry(i, ShardingType::table_wise, {best}), best_delta, why);
    }
    if (pinned)
      return doesNotFit(i, ShardingType::table_wise, least_short_delta, least_short_rank, least_short);
    return place(i, ShardingType::row_wise, all(),
                 "fits no single rank's free memory: its rows split over all ranks");
  }

  const std::vector<TableInfo>& tables_;
  const PlanRequest& req_;
  int n_;
  std::vector<RankCost> acc_;
  std::vector<bool> placed_;
  ShardPlan plan_;
};

}  // namespace

PlanCosts planCosts(const ShardPlan& plan, const std::vector<TableInfo>& tables, const PlanRequest& req) {
  PlanCosts out;
  out.ranks.assign(static_cast<size_t>(std::max(plan.ranks, 1)), RankCost{});
  for (const TablePlan& t : plan.tables) {
    auto it =
        std::find_if(tables.begin(), tables.end(), [&](const TableInfo& x) { return x.name == t.table; });
    if (it == tables.end()) {
      out.tables.push_back({});
      continue;
    }
    Delta d = tableDelta(t, *it, req, plan.ranks, plan.ranks_per_node);
    add(out.ranks, d.ranks);
    out.tables.push_back(d.table);
  }
  return out;
}

Expected<ShardPlan> autoPlan(const std::vector<TableInfo>& tables, const PlanRequest& req) {
  return Greedy(tables, req).run();
}

}  // namespace kiln::passes
