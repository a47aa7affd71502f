#include "driver/moe_stats.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace kiln::driver {

namespace {

int64_t intField(const ir::AttrDict& d, const char* key, int64_t dflt) {
  auto it = d.find(key);
  return it != d.end() && it->second.isInt() ? it->second.asInt() : dflt;
}

}  // namespace

MoeStatsWindow::MoeStatsWindow(const ir::AttrDict& train) {
  auto it = train.find("moe");
  if (it == train.end() || !it->second.isArray()) return;
  for (const ir::Attribute& a : it->second.asArray()) {
    if (!a.isDict()) continue;
    const ir::AttrDict& d = a.asDict();
    auto name = d.find("name");
    if (name == d.end() || !name->second.isString()) continue;
    Layer l;
    l.name = name->second.asString();
    l.experts = intField(d, "experts", 0);
    l.topk = intField(d, "topk", 1);
    l.tokens_per_sample = intField(d, "tokens_per_sample", 1);
    l.ep = intField(d, "ep", 1);
    // The shard pass refuses an EP size that does not split the experts evenly.
    if (l.ep < 1 || l.experts % l.ep != 0) l.ep = 1;
    l.counts.assign(static_cast<size_t>(std::max<int64_t>(l.experts, 0)), 0.0);
    layers_.push_back(std::move(l));
  }
}

void MoeStatsWindow::add(const std::vector<std::pair<std::string, std::vector<double>>>& stats,
                         int64_t samples) {
  for (Layer& l : layers_) {
    const std::string prefix = l.name + ".";
    bool seen = false;
    for (const auto& [name, values] : stats) {
      if (name.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string what = name.substr(prefix.size());
      if (what == "counts" && values.size() == l.counts.size()) {
        for (size_t e = 0; e < values.size(); ++e) l.counts[e] += values[e];
        seen = true;
      } else if (values.size() == 1) {
        auto& [sum, n] = l.losses[what];
        sum += values[0];
        ++n;
      }
    }
    if (seen) {
      l.slots += static_cast<double>(samples * l.tokens_per_sample * l.topk);
      ++l.steps;
    }
  }
}

std::vector<MoeLayerStats> MoeStatsWindow::take() {
  std::vector<MoeLayerStats> out;
  for (Layer& l : layers_) {
    if (l.steps == 0) continue;
    MoeLayerStats s;
    s.name = l.name;
    const double steps = static_cast<double>(l.steps);
    double sum = 0, sq = 0;
    s.min = l.counts.empty() ? 0 : *std::min_element(l.counts.begin(), l.counts.end()) / steps;
    s.max = l.counts.empty() ? 0 : *std::max_element(l.counts.begin(), l.counts.end()) / steps;
    for (double c : l.counts) sum += c / steps;
    s.mean = l.counts.empty() ? 0 : sum / static_cast<double>(l.counts.size());
    for (double c : l.counts) sq += (c / steps - s.mean) * (c / steps - s.mean);
    s.cv = s.mean > 0 ? std::sqrt(sq / static_cast<double>(l.counts.size())) / s.mean : 0;
    // Kept tokens never exceed the routed slots; padding rows are not counted by the op.
    s.dropped = l.slots > 0 ? std::max(0.0, 1.0 - sum * steps / l.slots) : 0;
    for (const auto& [what, sn] : l.losses) s.losses[what] = sn.first / static_cast<double>(sn.second);
    s.ep = l.ep;
    if (l.ep > 1) {
      // EP rank j owns experts [j*L, (j+1)*L): the tokens it computes are theirs.
      const size_t local = l.counts.size() / static_cast<size_t>(l.ep);
      s.rank_tokens.assign(static_cast<size_t>(l.ep), 0.0);
      for (size_t e = 0; e < l.counts.size(); ++e) s.rank_tokens[e / local] += l.counts[e] / steps;
    }
    out.push_back(std::move(s));
    std::fill(l.counts.begin(), l.counts.end(), 0.0);
    l.slots = 0;
    l.steps = 0;
    l.losses.clear();
  }
  return out;
}

double MoeLayerStats::rankMaxOverMean() const {
  if (rank_tokens.empty()) return 1.0;
  double sum = 0;
  for (double t : rank_tokens) sum += t;
  const double mean = sum / static_cast<double>(rank_tokens.size());
  return mean > 0 ? *std::max_element(rank_tokens.begin(), rank_tokens.end()) / mean : 0.0;
}

std::string MoeStatsWindow::progressText(const std::vector<MoeLayerStats>& layers) {
  if (layers.empty()) return "";
  const MoeLayerStats* worst = &layers[0];
  double dropped = 0, aux = 0, ep_imbalance = 0;
  bool any_ep = false;
  for (const MoeLayerStats& s : layers) {
    if (s.cv > worst->cv) worst = &s;
    dropped = std::max(dropped, s.dropped);
    for (const auto& [what, v] : s.losses) aux += v;
    if (s.ep > 1) {
      // The busiest EP rank sets the step's pace: show the layer where it waits the most.
      any_ep = true;
      ep_imbalance = std::max(ep_imbalance, s.rankMaxOverMean());
    }
  }
  std::string text = fmt::format(" | moe cv {:.2f} max/mean {:.2f}", worst->cv,
                                 worst->mean > 0 ? worst->max / worst->mean : 0.0);
  if (any_ep) text += fmt::format(" ep max/mean {:.2f}", ep_imbalance);
  text += fmt::format(" drop {:.1f}%", 100 * dropped);
  if (aux > 0) text += fmt::format(" aux {:.4f}", aux);
  return text;
}

void MoeStatsWindow::addToMetrics(const std::vector<MoeLayerStats>& layers, json::Json& extra) {
  if (layers.empty()) return;
  json::Json moe = json::Json::object();
  for (const MoeLayerStats& s : layers) {
    json::Json l = json::Json::object();
    l["tokens_min"] = s.min;
    l["tokens_max"] = s.max;
    l["tokens_mean"] = s.mean;
    l["tokens_cv"] = s.cv;
    l["dropped"] = s.dropped;
    for (const auto& [what, v] : s.losses) l[what] = v;
    if (s.ep > 1) {
      l["ep"] = s.ep;
      l["rank_tokens"] = s.rank_tokens;
    }
    moe[s.name] = std::move(l);
  }
  extra["moe"] = std::move(moe);
}

}  // namespace kiln::driver
