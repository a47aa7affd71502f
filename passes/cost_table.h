// The measured rates the sharding planner and the simulator cost plans with: one table per target,
// kept in the repository (passes/costs/NAME.json, built into the binary) and written for the
// machine it runs on by `kiln calibrate`. Where ir/target.h describes a device for the compiler's
// passes (FLOP rates, launch cost), a cost table says how fast the embedding part of a step runs:
// the memory and link rates, and how far below them real kernels land, as curves:
//
//   lookup efficiency    the fraction of the device's memory bandwidth an embedding lookup (or
//                        its sparse update) reaches, by the bytes of one row and the pooling
//                        factor (ids per sample): short rows waste most of each memory sector,
//                        and few ids per output pay the output's write for little gathering;
//   all_to_all efficiency the fraction of the link rate a collective reaches, by the bytes one
//                        rank sends one peer: small messages are latency, large ones streaming.
//
// Between the measured points a curve is interpolated linearly in log2 of its axes and held
// flat beyond its ends. The format (docs/distributed.md, "The cost model"):
//
//   {"format": "kiln-costs-1", "target": "h200", "source": "...",
//    "memory": {"device_bytes_per_s": ..., "host_bytes_per_s": ..., "pcie_bytes_per_s": ...},
//    "links": {"intra_node": {"bytes_per_s": ..., "latency_s": ...}, "inter_node": {...}},
//    "compute": {"gemm_f32_flops_per_s": ..., "gemm_bf16_flops_per_s": ..., "vector_flops_per_s": ...,
//                "launch_s": ...},   (optional: the simulator's compute rates)
//    "lookup_efficiency": {"row_bytes": [...], "pooling": [...], "values": [[...], ...]},
//    "all_to_all_efficiency": {"message_bytes": [...], "values": [...]}}
//
// `values` of the lookups has one row per `row_bytes` entry, one column per `pooling` entry.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"
#include "ir/target.h"

namespace kiln::passes {

// y(x) over ascending points, linear in log2(x) between them, flat outside.
struct Curve1 {
  std::vector<double> x, y;
  double at(double x) const;
};

// z(x, y) over a grid, bilinear in log2 of both axes, flat outside.
struct Curve2 {
  std::vector<double> x, y;
  std::vector<std::vector<double>> z;  // z[i][j] at (x[i], y[j])
  double at(double x, double y) const;
};

struct CostTable {
  std::string target;  // the target it describes ("h200", or what `kiln calibrate` names)
  std::string source;  // where the figures come from: datasheets, or a calibration run
  double device_bytes_per_s = 0;  // HBM on a GPU, DRAM on a CPU
  double host_bytes_per_s = 0;    // host DRAM (the embedding cache's backing store)
  double pcie_bytes_per_s = 0;    // host to device, per direction (0 on a CPU)
  LinkRates intra_node;           // per direction, per rank
  LinkRates inter_node;
  // Optional, for the simulator (`kiln plan --simulate`): compute rates measured by `kiln
  // calibrate`; 0 keeps the target's (ir/target.h).
  FlopRates gemm_flops_per_s;
  FlopRates vector_flops_per_s;
  double launch_s = 0;
  Curve2 lookup_efficiency;   // by (row bytes, pooling factor)
  Curve1 a2a_efficiency;      // by bytes per peer

  // Seconds to gather `rows` rows of `row_bytes` each at `pooling` ids per output row (a
  // lookup), or to read and write them back (an update: pass the bytes moved).
  double lookupSeconds(double bytes, double row_bytes, double pooling) const;
  // Seconds for one rank to move `bytes` over `link` in a collective whose messages to each peer
  // are `bytes_per_peer`, plus the link's latency once per collective.
  double commSeconds(double bytes, double bytes_per_peer, const LinkRates& link, int collectives) const;
};

// Parses a kiln-costs-1 table; errors name `file` and the field at fault.
Expected<CostTable> parseCostTable(std::string_view text, std::string_view file);
// The built-in table of a target (passes/costs/NAME.json): cpu, h200, h100, a100.
Expected<CostTable> builtinCostTable(std::string_view target);
// Reads a table from a file (what `kiln calibrate -o` wrote).
Expected<CostTable> loadCostTable(const std::string& path);
// The table as kiln-costs-1 JSON, as `kiln calibrate` writes it.
std::string writeCostTable(const CostTable& t);

}  // namespace kiln::passes
