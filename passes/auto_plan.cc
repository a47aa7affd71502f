#include "passes/auto_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <optional>

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

std::string ms(double s) { return fmt::format("{:.3g} ms", s * 1e3); }

int64_t tableBytes(const TableInfo& t) { return t.rows * t.bytesPerRow(); }

// "row_wise over 0-7", "table_wise on rank 3", "data_parallel".
std::string describe(const TablePlan& t) { return t.kind().describe(t.ranks); }

// ---------------------------------------------------------------------------------------------
// The cost of one table's choice

// What one table adds to each rank (memory, lookup time, link time) and its own totals, per the
// formulas of auto_plan.h: the exchange of its ids, pools and gradients is its kind's
// (ShardingKind::addRankCosts); memory, hot rows and de-duplicated routing are the same for
// every type.
struct Delta {
  std::vector<RankCost> ranks;
  TableCost table;
};

Delta tableDelta(const TablePlan& t, const TableInfo& info, const PlanRequest& req, int n, int rpn) {
  Delta out;
  out.ranks.assign(static_cast<size_t>(n), RankCost{});
  const CostTable& costs = req.costs;
  const double G = static_cast<double>(req.global_batch);
  const double b = G / n, h = info.lookups_per_sample, e = static_cast<double>(ir::dtypeBytes(info.dtype));
  const double d = static_cast<double>(info.dim), s = static_cast<double>(info.state_bytes_per_row);
  const bool multi_node = rpn > 0 && n > rpn;
  const LinkRates& global_link = multi_node ? costs.inter_node : costs.intra_node;
  const LinkRates& node_link = costs.intra_node;
  const ShardingKind& kind = t.kind();
  // Hot rows replicated (TablePlan::hot): only the cold ids travel and are looked up by their
  // owners, and from row blocks only the samples with a cold id get a pool back (the shard pass
  // compacts the returned pools; column shards still return every sample's columns).
  const bool hybrid = t.hot.rows > 0 && !kind.replicated();
  const double cold_ids = hybrid ? 1 - t.hot.id_share : 1;
  const double cold_pools = hybrid && kind.rowBlocks() ? 1 - t.hot.sample_share : 1;
  const double ids = 8 * h * cold_ids + 8;  // one sample's (cold) ids and its length
  const double de = d * e * cold_pools;     // one sample's pool (or its gradient), when it travels
  const int k = static_cast<int>(t.ranks.size());
  std::vector<bool> holds(static_cast<size_t>(n), false);
  // Ranks outside [0, n) (a plan completePlan has not checked) hold nothing here.
  for (int r : t.ranks)
    if (r >= 0 && r < n) holds[static_cast<size_t>(r)] = true;
  for (const TableShard& sh : t.shards)
    if (sh.rank >= 0 && sh.rank < n)
      out.ranks[static_cast<size_t>(sh.rank)].memory_bytes +=
          sh.rows() * (sh.cols() * ir::dtypeBytes(info.dtype) + info.state_bytes_per_row);
  // Lookup time on a rank: the forward reads `fwd` rows of `cols` columns, the update reads and
  // writes `upd` rows and their state, at the efficiency of the row's size and the pooling.
  auto lookups = [&](int r, double fwd, double upd, double cols) {
    out.ranks[static_cast<size_t>(r)].lookup_s +=
        costs.lookupSeconds(fwd * cols * e + upd * (2 * cols * e + 2 * s), cols * e, h);
  };
  // Link time on a rank: `bytes` over `peers` peers in `collectives` collectives.
  auto comm = [&](int r, double bytes, int peers, const LinkRates& link, int collectives) {
    const double per_peer = bytes / std::max(1, peers) / std::max(1, collectives);
    out.ranks[static_cast<size_t>(r)].comm_s += costs.commSeconds(bytes, per_peer, link, collectives);
    out.table.comm_bytes_per_step += bytes;
  };
  // De-duplicated routing (TablePlan::dedup): a rank's distinct (cold) ids go straight to their
  // owners, one row comes back for each and its gradient returns; three exchanges, no lengths,
  // no pools. The rank pools its samples from those rows and builds their gradient itself.
  const bool dedup = t.dedup && kind.rowBlocks();
  const double distinct = h * cold_ids * t.unique_share;  // rows a sample brings in, on average
  for (int r = 0; r < n && dedup; ++r) {
    const double moved = b * (8 * distinct + 2 * distinct * d * e);  // a rank's ids, rows and gradients
    lookups(r, 2 * b * h * cold_ids, 0, d);                           // the pooling and its gradient
    // The de-duplicating sort: four radix passes over the 8-byte ids and their positions.
    out.ranks[static_cast<size_t>(r)].lookup_s += b * h * cold_ids * 64 / costs.device_bytes_per_s;
    if (holds[static_cast<size_t>(r)]) {
      lookups(r, G * distinct / k, G * distinct / k, d);
      if (n > 1) comm(r, moved * (k - 1 + n - 1) / k, n - 1, global_link, 3);
    } else if (n > 1) {
      comm(r, moved, k, global_link, 3);
    }
  }
  if (!dedup) {
    CostTerms terms;
    terms.n = n, terms.k = k;
    terms.G = G, terms.b = b, terms.h = h, terms.d = d, terms.e = e, terms.s = s;
    terms.cold_ids = cold_ids, terms.ids = ids, terms.de = de;
    terms.lookups = lookups;
    terms.comm = [&](int r, double bytes, int peers, Link link, int collectives) {
      comm(r, bytes, peers, link == Link::node ? node_link : global_link, collectives);
    };
    for (int r = 0; r < n; ++r) kind.addRankCosts(terms, r, holds[static_cast<size_t>(r)]);
  }
  if (hybrid) {
    // Every rank holds the hot rows, looks up its own samples' hot ids, and applies the hot rows'
    // update from the global batch's gradients, as the shard pass runs it: all-reduced as a dense
    // [hot rows, d] block that rides in the dense gradients' buckets (no collective of its own)
    // where the optimizer leaves zero-gradient rows alone, else gathered per sample (ids and
    // pooled gradients, two collectives) as a data_parallel table's.
    const double H = static_cast<double>(t.hot.rows);
    const bool dense = info.hot_dense_update;
    for (int r = 0; r < n; ++r) {
      out.ranks[static_cast<size_t>(r)].memory_bytes += t.hot.rows * info.bytesPerRow();
      lookups(r, b * h * t.hot.id_share, dense ? H : G * h * t.hot.id_share, d);
      if (n > 1) {
        if (dense)
          comm(r, 2.0 * (n - 1) / n * H * d * e, n - 1, global_link, 0);
        else
          comm(r, (n - 1) * b * (8 * h * t.hot.id_share + 8 + d * e), n - 1, global_link, 2);
      }
    }
  }
  for (auto& rc : out.ranks) rc.step_s = rc.lookup_s + rc.comm_s;
  for (const auto& rc : out.ranks)
    out.table.bytes_per_rank = std::max(out.table.bytes_per_rank, rc.memory_bytes);
  out.table.lookups_per_step = G * h;
  return out;
}

void add(std::vector<RankCost>& acc, const std::vector<RankCost>& d, int sign = 1) {
  for (size_t r = 0; r < acc.size(); ++r) {
    acc[r].memory_bytes += sign * d[r].memory_bytes;
    acc[r].lookup_s += sign * d[r].lookup_s;
    acc[r].comm_s += sign * d[r].comm_s;
    acc[r].step_s += sign * d[r].step_s;
  }
}

// ---------------------------------------------------------------------------------------------
// Comparing plans

// A plan's rank by the search's order: within memory first, then within the memory balance, then
// the critical path, then the time summed over ranks (less work, and balance among the ranks off
// the critical path), then the fullest rank's memory.
struct Score {
  int64_t overflow = 0;   // bytes over the limit, summed over ranks (0: fits)
  double over_cap = 0;    // seconds of the critical path above the step cap
  double unbalanced = 0;  // bytes outside the balance band, summed over ranks
  double step = 0, total = 0;
  int64_t memory = 0;
};

bool better(const Score& a, const Score& b) {
  if (a.overflow != b.overflow) return a.overflow < b.overflow;
  if (std::abs(a.over_cap - b.over_cap) > 1e-12) return a.over_cap < b.over_cap;
  if (std::abs(a.unbalanced - b.unbalanced) > 0.5) return a.unbalanced < b.unbalanced;
  auto differs = [](double x, double y) { return std::abs(x - y) > 1e-9 * std::max(std::abs(x), std::abs(y)); };
  if (differs(a.step, b.step)) return a.step < b.step;
  if (differs(a.total, b.total)) return a.total < b.total;
  return a.memory < b.memory;
}

// The memory balance band of a request: with memory_balance b > 1 and M the tables' bytes (each
// counted once) over the ranks, [M / b - slack, M b + slack], where slack is a small table's
// bytes (so that tiny models are not forced apart). Replicas count against it: they hold memory
// on every rank.
struct Band {
  double lo = 0, hi = 0;  // hi 0: no band
  double step_cap = 0;    // seconds; 0: none
};

Band balanceBand(const std::vector<TableInfo>& tables, const PlanRequest& req) {
  Band b;
  if (req.memory_balance <= 1 || req.ranks < 2) return b;
  double mean = 0;
  for (const TableInfo& t : tables) mean += static_cast<double>(tableBytes(t));
  mean /= req.ranks;
  const double slack = static_cast<double>(kSmallTableBytes);
  b.lo = mean / req.memory_balance - slack;
  b.hi = mean * req.memory_balance + slack;
  return b;
}

// The score of per-rank totals `acc`, with `minus` taken out and `plus` added per rank.
Score score(const std::vector<RankCost>& acc, int64_t limit, const Band& band,
            const std::vector<const Delta*>& minus = {}, const std::vector<const Delta*>& plus = {}) {
  Score s;
  std::vector<int64_t> mems(acc.size());
  for (size_t r = 0; r < acc.size(); ++r) {
    double step = acc[r].step_s;
    int64_t mem = acc[r].memory_bytes;
    for (const Delta* d : minus) {
      step -= d->ranks[r].step_s;
      mem -= d->ranks[r].memory_bytes;
    }
    for (const Delta* d : plus) {
      step += d->ranks[r].step_s;
      mem += d->ranks[r].memory_bytes;
    }
    s.step = std::max(s.step, step);
    s.total += step;
    s.memory = std::max(s.memory, mem);
    if (limit > 0 && mem > limit) s.overflow += mem - limit;
    mems[r] = mem;
  }
  if (band.step_cap > 0) s.over_cap = std::max(0.0, s.step - band.step_cap);
  if (band.hi > 0)
    for (int64_t m : mems) {
      const double x = static_cast<double>(m);
      s.unbalanced += std::max(0.0, x - band.hi) + std::max(0.0, band.lo - x);
    }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Pins and choices

// Where a table's pin comes from, for reasons and errors ("" when it has none).
std::string pinOrigin(const TableInfo& t, const PlanPin* pin) {
  if (pin) return pin->loc.known() ? fmt::format("pinned by {}", pin->loc.str()) : "pinned by the constraints";
  return t.pinned ? "pinned in the model" : "";
}

// The tables with the constraints' pins applied; an error where a constraint contradicts the
// model's own pin.
Expected<std::vector<TableInfo>> withPins(const std::vector<TableInfo>& tables, const PlanRequest& req,
                                          std::vector<const PlanPin*>& pins) {
  std::vector<TableInfo> out = tables;
  pins.assign(tables.size(), nullptr);
  for (const PlanPin& p : req.pins) {
    auto it = std::find_if(out.begin(), out.end(), [&](const TableInfo& t) { return t.name == p.table; });
    if (it == out.end()) {
      std::string names;
      for (const auto& t : tables) names += (names.empty() ? "" : ", ") + t.name;
      return Status::error(fmt::format("unknown table '{}' (the model's tables: {})", p.table, names), p.loc);
    }
    size_t i = static_cast<size_t>(it - out.begin());
    if (pins[i]) {
      return Status::error(fmt::format("table '{}' is constrained twice (first at {})", p.table, pins[i]->loc.str()),
                           p.loc);
    }
    if (it->pinned && *it->pinned != p.type)
      return Status::error(fmt::format("table '{}' is pinned {} in the model; the constraint asks for {}", p.table,
                                       shardingName(*it->pinned), shardingName(p.type)),
                           p.loc);
    it->pinned = p.type;
    pins[i] = &p;
  }
  return out;
}

TablePlan makePlan(const TableInfo& info, ShardingType type, std::vector<int> ranks) {
  TablePlan t;
  t.table = info.name;
  t.type = type;
  t.ranks = std::move(ranks);
  t.shards = layoutShards(t, info);
  if (!t.kind().replicated()) t.hot = info.hot;
  return t;
}

// Every choice the search considers for a table: each type's candidate placements
// (ShardingKind::candidateRanks), the types in the registry's order. `pinned` restricts it to its
// type; a pin's ranks to those.
std::vector<TablePlan> choices(const TableInfo& info, const PlanPin* pin, int n, int rpn) {
  std::vector<TablePlan> out;
  if (pin && !pin->ranks.empty()) {
    out.push_back(makePlan(info, pin->type, pin->ranks));
    return out;
  }
  for (ShardingType type : shardingTypes()) {
    if (info.pinned && *info.pinned != type) continue;
    for (std::vector<int>& ranks : shardingKind(type).candidateRanks(info, info.pinned.has_value(), n, rpn))
      out.push_back(makePlan(info, type, std::move(ranks)));
  }
  return out;
}

bool samePlacement(const TablePlan& a, const TablePlan& b) { return a.type == b.type && a.ranks == b.ranks; }

// ---------------------------------------------------------------------------------------------
// The greedy start

class Greedy {
 public:
  Greedy(const std::vector<TableInfo>& tables, const PlanRequest& req)
      : tables_(tables), req_(req), n_(req.ranks), acc_(static_cast<size_t>(req.ranks)) {}

  Expected<ShardPlan> run() {
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
        KILN_RETURN_IF_ERROR(place(i, ShardingType::data_parallel, all(), "pinned"));
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
        KILN_RETURN_IF_ERROR(place(i, ShardingType::row_wise, all(), "pinned"));
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
    // 3. Column- and table-row-wise pins, and pins of any type the greedy has no rule for.
    for (size_t i : order) {
      if (placed_[i]) continue;
      const TableInfo& t = tables_[i];
      if (t.pinned == ShardingType::column_wise) {
        int k = n_;
        while (t.dim % k != 0) --k;
        std::string why =
            k == n_ ? "pinned" : fmt::format("pinned; dim {} splits over {} ranks at most", t.dim, k);
        KILN_RETURN_IF_ERROR(place(i, ShardingType::column_wise, leastLoaded(k), why));
      } else if (t.pinned == ShardingType::table_row_wise) {
        KILN_RETURN_IF_ERROR(
            place(i, ShardingType::table_row_wise, leastLoadedNode(), "pinned; the least loaded node"));
      } else if (t.pinned && *t.pinned != ShardingType::table_wise) {
        KILN_RETURN_IF_ERROR(placePinned(i));
      }
    }
    // 4. The rest table-wise, each on the rank that keeps the slowest rank fastest.
    for (size_t i : order) {
      if (placed_[i]) continue;
      KILN_RETURN_IF_ERROR(placeTableWise(i, tables_[i].pinned == ShardingType::table_wise));
    }
    KILN_RETURN_IF_ERROR(completePlan(plan_, tables_));
    return plan_;
  }

 private:
  std::vector<int> all() const { return rankRange(0, n_); }
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
      for (int r = node * g; r < std::min(n_, (node + 1) * g); ++r) load += acc_[static_cast<size_t>(r)].step_s;
      if (node == 0 || load < best_load) {
        best = node;
        best_load = load;
      }
    }
    return rankRange(best * g, std::min(n_, (best + 1) * g));
  }

  // The rank that would overflow, or -1; `short_by` its shortfall.
  int overflow(const Delta& d, int64_t& short_by) const {
    if (req_.memory_per_rank <= 0) return -1;
    for (int r = 0; r < n_; ++r) {
      int64_t total = acc_[static_cast<size_t>(r)].memory_bytes + d.ranks[static_cast<size_t>(r)].memory_bytes;
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
        human(static_cast<double>(d.ranks[static_cast<size_t>(r)].memory_bytes)), r, req_.memory_per_rank - used,
        req_.memory_per_rank, human(static_cast<double>(req_.memory_per_rank)), short_by,
        human(static_cast<double>(short_by))));
  }

  Status commit(size_t i, TablePlan t, const Delta& d, std::string why) {
    add(acc_, d.ranks);
    t.reason = std::move(why);
    plan_.tables[i] = std::move(t);
    placed_[i] = true;
    return Status::ok();
  }

  Status place(size_t i, ShardingType type, std::vector<int> ranks, std::string why) {
    TablePlan t = makePlan(tables_[i], type, std::move(ranks));
    Delta d = tableDelta(t, tables_[i], req_, n_, req_.ranks_per_node);
    int64_t short_by = 0;
    int r = overflow(d, short_by);
    if (r >= 0) return doesNotFit(i, type, d, r, short_by);
    return commit(i, std::move(t), d, std::move(why));
  }

  // A table pinned to a type without a rule of its own: of the placements its kind offers, the
  // one that keeps the slowest rank fastest, within memory.
  Status placePinned(size_t i) {
    const std::vector<TablePlan> options = choices(tables_[i], nullptr, n_, req_.ranks_per_node);
    if (options.empty())
      return Status::errorf("table '{}' is pinned {}, which offers no placement on {} ranks", tables_[i].name,
                            shardingName(*tables_[i].pinned), n_);
    int best = -1;
    double best_time = 0;
    Delta best_delta;
    for (size_t o = 0; o < options.size(); ++o) {
      Delta d = tableDelta(options[o], tables_[i], req_, n_, req_.ranks_per_node);
      int64_t short_by = 0;
      if (int r = overflow(d, short_by); r >= 0) {
        if (o + 1 == options.size() && best < 0) return doesNotFit(i, options[o].type, d, r, short_by);
        continue;
      }
      double slowest = 0;
      for (int x = 0; x < n_; ++x)
        slowest =
            std::max(slowest, acc_[static_cast<size_t>(x)].step_s + d.ranks[static_cast<size_t>(x)].step_s);
      if (best < 0 || slowest < best_time - 1e-15) {
        best = static_cast<int>(o);
        best_time = slowest;
        best_delta = std::move(d);
      }
    }
    return commit(i, options[static_cast<size_t>(best)], best_delta,
                  "pinned; the slowest rank stays fastest there");
  }

  Status placeTableWise(size_t i, bool pinned) {
    int best = -1;
    double best_time = 0;
    Delta best_delta;
    int64_t least_short = -1;
    int least_short_rank = 0;
    Delta least_short_delta;
    for (int r = 0; r < n_; ++r) {
      TablePlan t = makePlan(tables_[i], ShardingType::table_wise, {r});
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
        slowest = std::max(slowest, acc_[static_cast<size_t>(x)].step_s + d.ranks[static_cast<size_t>(x)].step_s);
      if (best < 0 || slowest < best_time - 1e-15) {
        best = r;
        best_time = slowest;
        best_delta = std::move(d);
      }
    }
    if (best >= 0) {
      std::string why =
          pinned ? fmt::format("pinned; rank {} keeps the slowest rank fastest", best)
                 : fmt::format("on rank {}: the slowest rank's predicted time stays lowest ({})", best, ms(best_time));
      return commit(i, makePlan(tables_[i], ShardingType::table_wise, {best}), best_delta, why);
    }
    if (pinned) return doesNotFit(i, ShardingType::table_wise, least_short_delta, least_short_rank, least_short);
    return place(i, ShardingType::row_wise, all(), "fits no single rank's free memory: its rows split over all ranks");
  }

  const std::vector<TableInfo>& tables_;
  const PlanRequest& req_;
  int n_;
  std::vector<RankCost> acc_;
  std::vector<bool> placed_;
  ShardPlan plan_;
};

// ---------------------------------------------------------------------------------------------
// The search: local moves from a start until none gains

class Search {
 public:
  Search(const std::vector<TableInfo>& tables, const std::vector<const PlanPin*>& pins, const PlanRequest& req)
      : tables_(tables),
        pins_(pins),
        req_(req),
        n_(req.ranks),
        band_(),
        acc_(static_cast<size_t>(req.ranks)) {
    for (size_t i = 0; i < tables_.size(); ++i) {
      options_.push_back(choices(tables_[i], pins_[i], n_, req_.ranks_per_node));
      std::vector<Delta> d;
      for (const TablePlan& o : options_.back()) d.push_back(tableDelta(o, tables_[i], req_, n_, req_.ranks_per_node));
      deltas_.push_back(std::move(d));
    }
  }

  // Starts from `start` (its entries in module order); an entry that is not among a table's
  // choices (a pin's ranks differ) becomes the first choice of the table.
  void start(const ShardPlan& start) {
    chosen_.assign(tables_.size(), 0);
    for (size_t i = 0; i < tables_.size(); ++i) {
      const TablePlan& want = start.tables[i];
      bool found = false;
      for (size_t o = 0; o < options_[i].size(); ++o)
        if (samePlacement(options_[i][o], want)) {
          chosen_[i] = o;
          found = true;
        }
      if (!found && !(pins_[i] && !pins_[i]->ranks.empty())) {
        // A start outside the choices (a pinned column split on the least loaded ranks): one more.
        options_[i].push_back(makePlan(tables_[i], want.type, want.ranks));
        deltas_[i].push_back(tableDelta(options_[i].back(), tables_[i], req_, n_, req_.ranks_per_node));
        chosen_[i] = options_[i].size() - 1;
      }
      add(acc_, deltas_[i][chosen_[i]].ranks);
    }
  }

  void improve() {
    // Each applied move strictly improves the score, so this ends; the cap only bounds the time.
    for (int round = 0; round < 100000; ++round) {
      Score best = score(acc_, req_.memory_per_rank, band_);
      const Score now = best;
      size_t bi = 0, bo = 0, bj = SIZE_MAX, bq = 0;
      // Re-place one table: another type, or other ranks.
      for (size_t i = 0; i < tables_.size(); ++i) {
        const Delta* cur = &deltas_[i][chosen_[i]];
        for (size_t o = 0; o < options_[i].size(); ++o) {
          if (o == chosen_[i]) continue;
          Score s = score(acc_, req_.memory_per_rank, band_, {cur}, {&deltas_[i][o]});
          if (better(s, best)) {
            best = s;
            bi = i, bo = o, bj = SIZE_MAX;
          }
        }
      }
      // Swap the owners of two table-wise tables.
      for (size_t i = 0; i < tables_.size(); ++i) {
        const TablePlan& pi = options_[i][chosen_[i]];
        if (pi.type != ShardingType::table_wise || (pins_[i] && !pins_[i]->ranks.empty())) continue;
        for (size_t j = i + 1; j < tables_.size(); ++j) {
          const TablePlan& pj = options_[j][chosen_[j]];
          if (pj.type != ShardingType::table_wise || pj.ranks == pi.ranks || (pins_[j] && !pins_[j]->ranks.empty()))
            continue;
          size_t oi = tableWiseOn(i, pj.ranks[0]), oj = tableWiseOn(j, pi.ranks[0]);
          if (oi == SIZE_MAX || oj == SIZE_MAX) continue;
          Score s = score(acc_, req_.memory_per_rank, band_, {&deltas_[i][chosen_[i]], &deltas_[j][chosen_[j]]},
                          {&deltas_[i][oi], &deltas_[j][oj]});
          if (better(s, best)) {
            best = s;
            bi = i, bo = oi, bj = j, bq = oj;
          }
        }
      }
      // Out of single moves: re-place two tables at once, where the choices are few enough.
      if (!better(best, now) && pairMoves()) {
        for (size_t i = 0; i < tables_.size(); ++i)
          for (size_t j = i + 1; j < tables_.size(); ++j)
            for (size_t oi = 0; oi < options_[i].size(); ++oi)
              for (size_t oj = 0; oj < options_[j].size(); ++oj) {
                if (oi == chosen_[i] || oj == chosen_[j]) continue;
                Score s = score(acc_, req_.memory_per_rank, band_, {&deltas_[i][chosen_[i]], &deltas_[j][chosen_[j]]},
                                {&deltas_[i][oi], &deltas_[j][oj]});
                if (better(s, best)) {
                  best = s;
                  bi = i, bo = oi, bj = j, bq = oj;
                }
              }
      }
      if (!better(best, now)) break;
      move(bi, bo);
      if (bj != SIZE_MAX) move(bj, bq);
    }
  }

  Score current() const { return score(acc_, req_.memory_per_rank, band_); }
  // The second phase: within the memory balance band, the critical path at most `cap`.
  void balance(const Band& band) { band_ = band; }

  ShardPlan plan() const {
    ShardPlan p;
    p.ranks = n_;
    p.ranks_per_node = req_.ranks_per_node;
    for (size_t i = 0; i < tables_.size(); ++i) p.tables.push_back(options_[i][chosen_[i]]);
    return p;
  }

  // The fullest rank and its shortfall, for a plan that does not fit.
  Status doesNotFit() const {
    size_t worst = 0;
    for (size_t r = 1; r < acc_.size(); ++r)
      if (acc_[r].memory_bytes > acc_[worst].memory_bytes) worst = r;
    int64_t over = acc_[worst].memory_bytes - req_.memory_per_rank;
    std::string held;
    for (size_t i = 0; i < tables_.size(); ++i) {
      int64_t m = deltas_[i][chosen_[i]].ranks[worst].memory_bytes;
      if (m > 0) held += fmt::format("{}{} {}", held.empty() ? "" : ", ", tables_[i].name, human(static_cast<double>(m)));
    }
    return Status::errorf(
        "the tables do not fit: the best plan found needs {} bytes ({}) on rank {} of its {} bytes ({}); short by {} "
        "bytes ({}). Rank {} holds {}",
        acc_[worst].memory_bytes, human(static_cast<double>(acc_[worst].memory_bytes)), worst, req_.memory_per_rank,
        human(static_cast<double>(req_.memory_per_rank)), over, human(static_cast<double>(over)), worst, held);
  }

 private:
  // Pair moves cost the square of the choices: small problems only (the oracle's size).
  bool pairMoves() const {
    size_t total = 0;
    for (const auto& o : options_) total += o.size();
    return total <= kPairMoveChoices;
  }
  static constexpr size_t kPairMoveChoices = 400;

  size_t tableWiseOn(size_t i, int rank) const {
    for (size_t o = 0; o < options_[i].size(); ++o)
      if (options_[i][o].type == ShardingType::table_wise && options_[i][o].ranks[0] == rank) return o;
    return SIZE_MAX;
  }
  void move(size_t i, size_t o) {
    add(acc_, deltas_[i][chosen_[i]].ranks, -1);
    chosen_[i] = o;
    add(acc_, deltas_[i][o].ranks);
  }

  const std::vector<TableInfo>& tables_;
  const std::vector<const PlanPin*>& pins_;
  const PlanRequest& req_;
  int n_;
  Band band_;
  std::vector<std::vector<TablePlan>> options_;
  std::vector<std::vector<Delta>> deltas_;
  std::vector<size_t> chosen_;
  std::vector<RankCost> acc_;
};

// ---------------------------------------------------------------------------------------------
// The baselines

// Places each table of `types` (in descending order of its cost where it is placed) on the
// candidate whose slowest rank stays fastest, within memory: TorchRec's greedy perf partitioner.
Expected<ShardPlan> placeBaseline(const std::vector<TableInfo>& tables, const std::vector<const PlanPin*>& pins,
                                  const PlanRequest& req, const std::vector<ShardingType>& types,
                                  const std::vector<std::string>& why) {
  const int n = req.ranks;
  std::vector<RankCost> acc(static_cast<size_t>(n));
  ShardPlan plan;
  plan.ranks = n;
  plan.ranks_per_node = req.ranks_per_node;
  plan.tables.resize(tables.size());
  std::vector<double> weight(tables.size());
  for (size_t i = 0; i < tables.size(); ++i) {
    Delta d = tableDelta(makePlan(tables[i], ShardingType::table_wise, {0}), tables[i], req, n, req.ranks_per_node);
    weight[i] = d.ranks[0].step_s;
  }
  std::vector<size_t> order(tables.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return weight[a] > weight[b]; });
  for (size_t i : order) {
    std::vector<TablePlan> opts;
    for (TablePlan& o : choices(tables[i], pins[i], n, req.ranks_per_node))
      if (o.type == types[i]) opts.push_back(std::move(o));
    if (opts.empty()) {
      // A placement the search leaves out as never better (table_row_wise on one node) is the
      // baseline's all the same: what the type offers a table pinned to it.
      TableInfo t = tables[i];
      t.pinned = types[i];
      opts = choices(t, nullptr, n, req.ranks_per_node);
    }
    int best = -1;
    Score best_score;
    Delta best_delta;
    for (size_t o = 0; o < opts.size(); ++o) {
      Delta d = tableDelta(opts[o], tables[i], req, n, req.ranks_per_node);
      Score s = score(acc, req.memory_per_rank, Band{}, {}, {&d});
      if (best < 0 || better(s, best_score)) {
        best = static_cast<int>(o);
        best_score = s;
        best_delta = std::move(d);
      }
    }
    if (best < 0) return Status::errorf("table '{}' has no {} placement", tables[i].name, shardingName(types[i]));
    if (best_score.overflow > 0)
      return Status::errorf("table '{}' does not fit as {} within {} a rank", tables[i].name, shardingName(types[i]),
                            human(static_cast<double>(req.memory_per_rank)));
    add(acc, best_delta.ranks);
    plan.tables[i] = opts[static_cast<size_t>(best)];
    plan.tables[i].reason = why[i];
  }
  return plan;
}

// EMBark's baseline: every table row-wise inside one node group, the groups chosen to balance;
// with one node, row_wise over all ranks (the same layout, without pooling back).
Expected<ShardPlan> tableRowWisePlan(const std::vector<TableInfo>& tables, const std::vector<const PlanPin*>& pins,
                                     const PlanRequest& req) {
  const bool one_node = req.ranks_per_node <= 0 || req.ranks_per_node >= req.ranks;
  std::vector<ShardingType> types;
  std::vector<std::string> why;
  for (const TableInfo& t : tables) {
    types.push_back(t.pinned ? *t.pinned : one_node ? ShardingType::row_wise : ShardingType::table_row_wise);
    why.push_back(t.pinned ? "pinned" : "the table-row-wise baseline: every table row-wise within a node");
  }
  return placeBaseline(tables, pins, req, types, why);
}

// TorchRec's rules as they play out on the MLPerf tables: every table table-wise, placed by
// the greedy perf partitioner (largest cost first, on the rank whose cost stays lowest), except
// the tables whose lookups exceed one rank's share of all the lookups: on one rank they would be
// the critical path, so they go row-wise. No table is replicated.
Expected<ShardPlan> torchRecPlan(const std::vector<TableInfo>& tables, const std::vector<const PlanPin*>& pins,
                                 const PlanRequest& req) {
  double lookups = 0;
  for (const TableInfo& t : tables) lookups += t.lookups_per_sample;
  const double share = lookups / req.ranks;
  std::vector<ShardingType> types;
  std::vector<std::string> why;
  for (const TableInfo& t : tables) {
    if (t.pinned) {
      types.push_back(*t.pinned);
      why.push_back("pinned");
    } else if (req.ranks > 1 && t.lookups_per_sample > share) {
      types.push_back(ShardingType::row_wise);
      why.push_back(fmt::format("TorchRec's rules: {:.3g} ids a sample, more than a rank's share ({:.3g})",
                                t.lookups_per_sample, share));
    } else {
      types.push_back(ShardingType::table_wise);
      why.push_back("TorchRec's rules: table-wise, placed by the greedy perf partitioner");
    }
  }
  return placeBaseline(tables, pins, req, types, why);
}

// ---------------------------------------------------------------------------------------------
// Reasons

// The search's reason for every entry of `plan`: its predicted step against the best alternative
// of another type (or, for a pinned table, what unpinning would give).
void explainChoices(ShardPlan& plan, const std::vector<TableInfo>& tables, const std::vector<const PlanPin*>& pins,
                    const PlanRequest& req) {
  for (size_t i = 0; i < plan.tables.size(); ++i) {
    std::vector<OptionCost> opts = explainTable(plan, tables, req, i);
    const OptionCost* mine = nullptr;
    const OptionCost* alt = nullptr;
    for (const OptionCost& o : opts) {
      if (o.chosen) mine = &o;
      else if (!alt && o.option.type != plan.tables[i].type) alt = &o;
    }
    if (!alt)
      for (const OptionCost& o : opts)
        if (!o.chosen) {
          alt = &o;
          break;
        }
    std::string pin = pinOrigin(tables[i], pins[i]);
    std::string text = fmt::format("{}{}: {}", pin.empty() ? "" : pin + "; ", describe(plan.tables[i]),
                                   mine ? ms(mine->step_s) : "?");
    if (alt) {
      std::string mem = human(static_cast<double>(alt->max_memory));
      text += fmt::format("; {}{} would {}", pin.empty() ? "" : "unpinned, ", describe(alt->option),
                          alt->fits ? fmt::format("be {} and {} on its fullest rank", ms(alt->step_s), mem)
                                    : fmt::format("not fit ({} on its fullest rank)", mem));
    }
    plan.tables[i].reason = text;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string_view strategyName(PlanStrategy s) {
  switch (s) {
    case PlanStrategy::search: return "search";
    case PlanStrategy::greedy: return "greedy";
    case PlanStrategy::table_row_wise: return "table_row_wise";
    case PlanStrategy::torchrec: return "torchrec";
  }
  return "?";
}

std::optional<PlanStrategy> parseStrategy(std::string_view name) {
  for (PlanStrategy s : {PlanStrategy::search, PlanStrategy::greedy, PlanStrategy::table_row_wise, PlanStrategy::torchrec})
    if (strategyName(s) == name) return s;
  return std::nullopt;
}

Expected<PlanRequest> planRequestFor(const Target& target) {
  PlanRequest req;
  KILN_ASSIGN_OR_RETURN(req.costs, builtinCostTable(target.name));
  return req;
}

double PlanCosts::step_s() const {
  double s = 0;
  for (const RankCost& r : ranks) s = std::max(s, r.step_s);
  return s;
}

int PlanCosts::critical_rank() const {
  int best = 0;
  for (size_t r = 0; r < ranks.size(); ++r)
    if (ranks[r].step_s > ranks[static_cast<size_t>(best)].step_s) best = static_cast<int>(r);
  return best;
}

double PlanCosts::memory_imbalance() const {
  if (ranks.empty()) return 1;
  int64_t lo = ranks[0].memory_bytes, hi = lo;
  for (const RankCost& r : ranks) {
    lo = std::min(lo, r.memory_bytes);
    hi = std::max(hi, r.memory_bytes);
  }
  return lo > 0 ? static_cast<double>(hi) / static_cast<double>(lo) : (hi > 0 ? INFINITY : 1.0);
}

double PlanCosts::total_s() const {
  double sum = 0;
  for (const RankCost& r : ranks) sum += r.step_s;
  return sum;
}

double PlanCosts::time_imbalance() const {
  if (ranks.empty()) return 1;
  double mean = total_s() / static_cast<double>(ranks.size());
  return mean > 0 ? step_s() / mean : 1.0;
}

PlanCosts planCosts(const ShardPlan& plan, const std::vector<TableInfo>& tables, const PlanRequest& req) {
  PlanCosts out;
  out.ranks.assign(static_cast<size_t>(std::max(plan.ranks, 1)), RankCost{});
  for (const TablePlan& t : plan.tables) {
    auto it = std::find_if(tables.begin(), tables.end(), [&](const TableInfo& x) { return x.name == t.table; });
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

std::vector<OptionCost> explainTable(const ShardPlan& plan, const std::vector<TableInfo>& tables,
                                     const PlanRequest& req, size_t index) {
  std::vector<OptionCost> out;
  if (index >= plan.tables.size()) return out;
  auto it = std::find_if(tables.begin(), tables.end(), [&](const TableInfo& x) { return x.name == plan.tables[index].table; });
  if (it == tables.end()) return out;
  TableInfo info = *it;
  info.pinned.reset();  // every choice, as if unpinned
  PlanCosts costs = planCosts(plan, tables, req);
  Delta cur = tableDelta(plan.tables[index], info, req, plan.ranks, plan.ranks_per_node);
  std::vector<TablePlan> opts = choices(info, nullptr, plan.ranks, plan.ranks_per_node);
  bool has_chosen = false;
  for (const TablePlan& o : opts) has_chosen |= samePlacement(o, plan.tables[index]);
  if (!has_chosen) opts.push_back(plan.tables[index]);
  for (TablePlan& o : opts) {
    Delta d = tableDelta(o, info, req, plan.ranks, plan.ranks_per_node);
    Score s = score(costs.ranks, req.memory_per_rank, Band{}, {&cur}, {&d});
    OptionCost c;
    c.chosen = samePlacement(o, plan.tables[index]);
    c.option = std::move(o);
    c.option.reason.clear();
    c.step_s = s.step;
    c.max_memory = s.memory;
    c.fits = s.overflow == 0;
    out.push_back(std::move(c));
  }
  std::stable_sort(out.begin(), out.end(), [](const OptionCost& a, const OptionCost& b) {
    if (a.fits != b.fits) return a.fits;
    return a.step_s < b.step_s;
  });
  return out;
}

Expected<ShardPlan> autoPlan(const std::vector<TableInfo>& raw_tables, const PlanRequest& req) {
  const int n = req.ranks;
  if (n < 1) return Status::errorf("a plan needs at least 1 rank, got {}", n);
  if (req.ranks_per_node < 0)
    return Status::errorf("--ranks-per-node must be 0 or positive, got {}", req.ranks_per_node);
  if (req.global_batch < 1) return Status::errorf("the global batch must be at least 1, got {}", req.global_batch);
  if (req.costs.device_bytes_per_s <= 0) return Status::error("the plan request has no cost table");
  std::vector<const PlanPin*> pins;
  KILN_ASSIGN_OR_RETURN(std::vector<TableInfo> tables, withPins(raw_tables, req, pins));
  for (size_t i = 0; i < tables.size(); ++i) {
    if (!pins[i] || pins[i]->ranks.empty()) continue;
    TablePlan t = makePlan(tables[i], pins[i]->type, pins[i]->ranks);
    if (Status s = checkTablePlan(t, tables[i], n, req.ranks_per_node); !s)
      return Status::error(s.message(), pins[i]->loc);
    t.shards = layoutShards(t, tables[i]);
    Delta d = tableDelta(t, tables[i], req, n, req.ranks_per_node);
    for (int r = 0; r < n && req.memory_per_rank > 0; ++r)
      if (d.ranks[static_cast<size_t>(r)].memory_bytes > req.memory_per_rank)
        return Status::error(
            fmt::format("the constraint cannot be met: table '{}' as {} needs {} bytes ({}) on rank {}, more than "
                        "the {} bytes ({}) a rank has",
                        tables[i].name, describe(t), d.ranks[static_cast<size_t>(r)].memory_bytes,
                        human(static_cast<double>(d.ranks[static_cast<size_t>(r)].memory_bytes)), r,
                        req.memory_per_rank, human(static_cast<double>(req.memory_per_rank))),
            pins[i]->loc);
  }
  ShardPlan plan;
  switch (req.strategy) {
    case PlanStrategy::table_row_wise: {
      KILN_ASSIGN_OR_RETURN(plan, tableRowWisePlan(tables, pins, req));
      break;
    }
    case PlanStrategy::torchrec: {
      KILN_ASSIGN_OR_RETURN(plan, torchRecPlan(tables, pins, req));
      break;
    }
    case PlanStrategy::greedy: {
      KILN_ASSIGN_OR_RETURN(ShardPlan greedy, Greedy(tables, req).run());
      // The greedy's choices, with a constraint's ranks where it names them.
      Search search(tables, pins, req);
      search.start(greedy);
      plan = search.plan();
      for (size_t i = 0; i < plan.tables.size(); ++i) {
        std::string pin = pinOrigin(tables[i], pins[i]);
        const std::string& why = greedy.tables[i].reason;
        plan.tables[i].reason = !pin.empty() && why.rfind("pinned", 0) == 0 ? pin + why.substr(6)
                                : !pin.empty()                               ? pin
                                                                             : why;
      }
      break;
    }
    case PlanStrategy::search: {
      // Local search from several starts, the best result kept: the greedy, the two baselines,
      // and everything row-wise (the most even memory; it fits whenever anything does).
      auto greedy = Greedy(tables, req).run();
      std::vector<ShardPlan> starts;
      if (greedy) starts.push_back(*greedy);
      if (auto t = torchRecPlan(tables, pins, req)) starts.push_back(t.take());
      if (auto t = tableRowWisePlan(tables, pins, req)) starts.push_back(t.take());
      ShardPlan rw;
      for (const TableInfo& t : tables)
        rw.tables.push_back(makePlan(t, t.pinned ? *t.pinned : ShardingType::row_wise, rankRange(0, n)));
      starts.push_back(std::move(rw));
      // Phase 1: the fastest plan from each start.
      std::vector<Search> runs;
      size_t best = 0;
      for (const ShardPlan& st : starts) {
        runs.emplace_back(tables, pins, req);
        runs.back().start(st);
        runs.back().improve();
        if (better(runs.back().current(), runs[best].current())) best = runs.size() - 1;
      }
      if (runs[best].current().overflow > 0) {
        if (!greedy) return greedy.status();  // the greedy's error names the first table that did not fit
        return runs[best].doesNotFit();
      }
      // Phase 2: balance the memory, giving up at most kBalanceSlack of the fastest step for it,
      // from each phase-1 result and again from each start.
      Band band = balanceBand(tables, req);
      if (band.hi > 0) {
        band.step_cap = runs[best].current().step * (1 + kBalanceSlack);
        for (const ShardPlan& st : starts) {
          runs.emplace_back(tables, pins, req);
          runs.back().start(st);
        }
        for (size_t i = 0; i < runs.size(); ++i) {
          runs[i].balance(band);
          runs[i].improve();
        }
        best = 0;
        for (size_t i = 1; i < runs.size(); ++i)
          if (better(runs[i].current(), runs[best].current())) best = i;
      }
      const Search* winner = &runs[best];
      plan = winner->plan();
      KILN_RETURN_IF_ERROR(completePlan(plan, tables));
      explainChoices(plan, tables, pins, req);
      return plan;
    }
  }
  KILN_RETURN_IF_ERROR(completePlan(plan, tables));
  return plan;
}

Expected<ShardPlan> exhaustivePlan(const std::vector<TableInfo>& raw_tables, const PlanRequest& req,
                                   int64_t max_plans) {
  std::vector<const PlanPin*> pins;
  KILN_ASSIGN_OR_RETURN(std::vector<TableInfo> tables, withPins(raw_tables, req, pins));
  const int n = req.ranks;
  std::vector<std::vector<TablePlan>> opts;
  std::vector<std::vector<Delta>> deltas;
  double combos = 1;
  for (size_t i = 0; i < tables.size(); ++i) {
    opts.push_back(choices(tables[i], pins[i], n, req.ranks_per_node));
    combos *= static_cast<double>(opts.back().size());
    std::vector<Delta> d;
    for (const TablePlan& o : opts.back()) d.push_back(tableDelta(o, tables[i], req, n, req.ranks_per_node));
    deltas.push_back(std::move(d));
  }
  if (combos > static_cast<double>(max_plans))
    return Status::errorf("{:.3g} plans are more than the {} an exhaustive search may try", combos, max_plans);
  const Band band;  // by time alone: the first phase of the search
  std::vector<size_t> pick(tables.size(), 0), best_pick;
  Score best;
  bool found = false;
  std::vector<RankCost> acc(static_cast<size_t>(n));
  // Depth-first over the tables; acc holds the tables above `depth`.
  std::function<void(size_t)> walk = [&](size_t depth) {
    if (depth == tables.size()) {
      Score s = score(acc, req.memory_per_rank, band);
      if (s.overflow == 0 && (!found || better(s, best))) {
        best = s;
        best_pick = pick;
        found = true;
      }
      return;
    }
    for (size_t o = 0; o < opts[depth].size(); ++o) {
      pick[depth] = o;
      add(acc, deltas[depth][o].ranks);
      walk(depth + 1);
      add(acc, deltas[depth][o].ranks, -1);
    }
  };
  walk(0);
  if (!found) return Status::error("no combination of choices fits the memory");
  ShardPlan plan;
  plan.ranks = n;
  plan.ranks_per_node = req.ranks_per_node;
  for (size_t i = 0; i < tables.size(); ++i) plan.tables.push_back(opts[i][best_pick[i]]);
  KILN_RETURN_IF_ERROR(completePlan(plan, tables));
  return plan;
}

}  // namespace kiln::passes
