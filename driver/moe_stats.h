// Load statistics of a model's Mixture-of-Experts layers over a logging window: tokens per
// expert (min, max, coefficient of variation), the fraction of routed slots dropped by capacity,
// the mean balancing losses, and for an expert-parallel layer the tokens each EP rank computes. The
// Trainer (driver/trainer.h) feeds it each step's statistics (StepOutputs::stats), hands its window
// to the progress line and writes it to the metrics file (docs/moe.md, "Load statistics").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ir/attribute.h"
#include "runtime/json.h"

namespace kiln::driver {

struct MoeLayerStats {
  std::string name;
  double min = 0, max = 0, mean = 0;     // tokens per expert per step
  double cv = 0;                         // std / mean of tokens per expert
  double dropped = 0;                    // dropped slots / routed slots
  std::map<std::string, double> losses;  // "aux_loss", "seq_aux_loss", "z_loss": window means
  int64_t ep = 1;                        // the layer's EP size (kiln.train's moe entry)
  std::vector<double> rank_tokens;       // with ep > 1: tokens per EP rank per step
  // The busiest EP rank's tokens over the EP ranks' mean (1 without expert parallelism).
  double rankMaxOverMean() const;
};

class MoeStatsWindow {
 public:
  // The layers kiln.train's `moe` describes (none for a model without MoE layers).
  explicit MoeStatsWindow(const ir::AttrDict& train);
  bool empty() const { return layers_.empty(); }

  // One step: its statistics and the samples this rank's step covered.
  void add(const std::vector<std::pair<std::string, std::vector<double>>>& stats, int64_t samples);
  // The window's statistics per layer; then the window restarts.
  std::vector<MoeLayerStats> take();

  // " | moe cv 0.12 max/mean 1.31 drop 0.0%" for the layer least in balance, with
  // " ep max/mean 1.12" after max/mean (the least balanced expert-parallel layer's EP ranks)
  // where a layer has ep > 1; "" when empty.
  static std::string progressText(const std::vector<MoeLayerStats>& layers);
  // {"moe": {"<layer>": {"tokens_min": .., "tokens_max": .., "tokens_cv": .., "dropped": .., ...}}};
  // a layer with ep > 1 adds "ep" and "rank_tokens": [tokens per EP rank per step].
  static void addToMetrics(const std::vector<MoeLayerStats>& layers, json::Json& extra);

 private:
  struct Layer {
    std::string name;
    int64_t experts = 0, topk = 0, tokens_per_sample = 1, ep = 1;
    std::vector<double> counts;  // summed over the window's steps
    double slots = 0;            // routed slots over the window
    int64_t steps = 0;
    std::map<std::string, std::pair<double, int64_t>> losses;  // sum, steps
  };
  std::vector<Layer> layers_;
};

}  // namespace kiln::driver
