// Cost tables (passes/cost_table.h): the built-in tables against their JSON files read here with
// nlohmann directly, the curves and the cost formulas against values worked out by hand, the
// writer's round trip, and each malformed table's error naming the field at fault.
#include "passes/cost_table.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kiln::passes {
namespace {

using json = nlohmann::json;

std::string readSourceFile(const std::string& rel) {
  std::ifstream in(std::string(KILN_SOURCE_DIR) + "/" + rel, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// --- The built-in tables.

TEST(CostTable, EveryBuiltinTableLoadsAndMatchesItsFile) {
  for (const char* name : {"cpu", "h200", "h100", "a100"}) {
    SCOPED_TRACE(name);
    auto t = builtinCostTable(name);
    ASSERT_TRUE(t.isOk()) << t.status().str();
    std::string text = readSourceFile(std::string("passes/costs/") + name + ".json");
    ASSERT_FALSE(text.empty());
    json j = json::parse(text);
    EXPECT_EQ(t->target, name);
    EXPECT_EQ(t->target, j["target"].get<std::string>());
    EXPECT_EQ(t->device_bytes_per_s, j["memory"]["device_bytes_per_s"].get<double>());
    EXPECT_EQ(t->host_bytes_per_s, j["memory"]["host_bytes_per_s"].get<double>());
    EXPECT_EQ(t->pcie_bytes_per_s, j["memory"]["pcie_bytes_per_s"].get<double>());
    EXPECT_EQ(t->intra_node.bytes_per_s, j["links"]["intra_node"]["bytes_per_s"].get<double>());
    EXPECT_EQ(t->intra_node.latency_s, j["links"]["intra_node"]["latency_s"].get<double>());
    EXPECT_EQ(t->inter_node.bytes_per_s, j["links"]["inter_node"]["bytes_per_s"].get<double>());
    EXPECT_EQ(t->inter_node.latency_s, j["links"]["inter_node"]["latency_s"].get<double>());
    EXPECT_EQ(t->lookup_efficiency.x, j["lookup_efficiency"]["row_bytes"].get<std::vector<double>>());
    EXPECT_EQ(t->lookup_efficiency.y, j["lookup_efficiency"]["pooling"].get<std::vector<double>>());
    EXPECT_EQ(t->lookup_efficiency.z, j["lookup_efficiency"]["values"].get<std::vector<std::vector<double>>>());
    EXPECT_EQ(t->a2a_efficiency.x, j["all_to_all_efficiency"]["message_bytes"].get<std::vector<double>>());
    EXPECT_EQ(t->a2a_efficiency.y, j["all_to_all_efficiency"]["values"].get<std::vector<double>>());
    // A table of a real device has rates and curves.
    EXPECT_GT(t->device_bytes_per_s, 1e9);
    EXPECT_EQ(t->lookup_efficiency.z.size(), t->lookup_efficiency.x.size());
    EXPECT_FALSE(t->a2a_efficiency.x.empty());
  }
  // The figures `kiln calibrate` keeps for the link between machines: 100 Gb Ethernet, 10 us.
  auto cpu = builtinCostTable("cpu");
  ASSERT_TRUE(cpu.isOk());
  EXPECT_EQ(cpu->inter_node.bytes_per_s, 12.5e9);
  EXPECT_EQ(cpu->inter_node.latency_s, 1e-5);
  EXPECT_EQ(cpu->pcie_bytes_per_s, 0);
}

TEST(CostTable, UnknownBuiltinListsTheKnownOnes) {
  auto t = builtinCostTable("tpu9");
  ASSERT_FALSE(t.isOk());
  const std::string& m = t.status().message();
  EXPECT_NE(m.find("tpu9"), std::string::npos) << m;
  for (const char* name : {"cpu", "h200", "h100", "a100"}) EXPECT_NE(m.find(name), std::string::npos) << m;
}

TEST(CostTable, LoadCostTableOfAMissingFileIsAnError) {
  auto t = loadCostTable("/nonexistent/costs.json");
  ASSERT_FALSE(t.isOk());
  EXPECT_NE(t.status().message().find("/nonexistent/costs.json"), std::string::npos);
}

// --- Curves: linear in log2 of the axes, flat beyond the ends.

TEST(Curve1, ExactPointsLog2InterpolationAndClamping) {
  Curve1 c{{2, 8, 32}, {0.2, 0.6, 1.0}};
  EXPECT_DOUBLE_EQ(c.at(2), 0.2);
  EXPECT_DOUBLE_EQ(c.at(8), 0.6);
  EXPECT_DOUBLE_EQ(c.at(32), 1.0);
  // log2: 4 lies halfway between 2 and 8 (1, 2, 3), 16 halfway between 8 and 32.
  EXPECT_DOUBLE_EQ(c.at(4), 0.4);
  EXPECT_DOUBLE_EQ(c.at(16), 0.8);
  // 2 * sqrt(2): log2 1.5, a quarter of the way from 2 to 8: 0.2 + 0.25 * 0.4.
  EXPECT_NEAR(c.at(2 * std::sqrt(2.0)), 0.3, 1e-12);
  // Not linear in x: 5 lies (log2(5) - 1) / 2 = 0.66 of the way from 2 to 8, not 0.5.
  EXPECT_NEAR(c.at(5), 0.2 + (std::log2(5.0) - 1) / 2 * 0.4, 1e-12);
  // Flat outside.
  EXPECT_DOUBLE_EQ(c.at(1), 0.2);
  EXPECT_DOUBLE_EQ(c.at(0.001), 0.2);
  EXPECT_DOUBLE_EQ(c.at(0), 0.2);
  EXPECT_DOUBLE_EQ(c.at(1e12), 1.0);
  // One point: a constant.
  Curve1 one{{10}, {0.5}};
  EXPECT_DOUBLE_EQ(one.at(1), 0.5);
  EXPECT_DOUBLE_EQ(one.at(1000), 0.5);
}

TEST(Curve2, ExactPointsBilinearInLog2AndClamping) {
  // z[i][j] at (x[i], y[j]).
  Curve2 c{{32, 128}, {1, 16}, {{0.2, 0.4}, {0.6, 1.0}}};
  EXPECT_DOUBLE_EQ(c.at(32, 1), 0.2);
  EXPECT_DOUBLE_EQ(c.at(32, 16), 0.4);
  EXPECT_DOUBLE_EQ(c.at(128, 1), 0.6);
  EXPECT_DOUBLE_EQ(c.at(128, 16), 1.0);
  // 64 is halfway between 32 and 128 in log2 (5, 6, 7); 4 halfway between 1 and 16 (0, 2, 4).
  EXPECT_DOUBLE_EQ(c.at(64, 1), 0.4);
  EXPECT_DOUBLE_EQ(c.at(64, 16), 0.7);
  EXPECT_DOUBLE_EQ(c.at(32, 4), 0.3);
  EXPECT_DOUBLE_EQ(c.at(128, 4), 0.8);
  EXPECT_DOUBLE_EQ(c.at(64, 4), (0.2 + 0.4 + 0.6 + 1.0) / 4);
  // y = 2: a quarter of the way from 1 to 16 in log2; x = 32: the first row.
  EXPECT_DOUBLE_EQ(c.at(32, 2), 0.25);
  // Clamped on each axis and on both.
  EXPECT_DOUBLE_EQ(c.at(8, 4), 0.3);
  EXPECT_DOUBLE_EQ(c.at(4096, 4), 0.8);
  EXPECT_DOUBLE_EQ(c.at(64, 0.5), 0.4);
  EXPECT_DOUBLE_EQ(c.at(64, 1000), 0.7);
  EXPECT_DOUBLE_EQ(c.at(8, 1000), 0.4);
  EXPECT_DOUBLE_EQ(c.at(4096, 0.5), 0.6);
}

TEST(Curve2, ThreeByThreeGridPicksTheRightCell) {
  // z = i + 10 j at (2^i, 4^j): bilinear in log2 reproduces it exactly anywhere inside.
  Curve2 c{{1, 2, 4}, {1, 4, 16}, {{0, 10, 20}, {1, 11, 21}, {2, 12, 22}}};
  EXPECT_DOUBLE_EQ(c.at(2, 4), 11);
  EXPECT_DOUBLE_EQ(c.at(4, 16), 22);
  EXPECT_NEAR(c.at(std::pow(2.0, 1.25), std::pow(4.0, 1.5)), 1.25 + 15, 1e-12);
  EXPECT_NEAR(c.at(std::pow(2.0, 0.5), std::pow(4.0, 0.25)), 0.5 + 2.5, 1e-12);
}

// --- The cost formulas.

CostTable handTable() {
  CostTable t;
  t.target = "hand";
  t.device_bytes_per_s = 20e9;
  t.host_bytes_per_s = 10e9;
  t.lookup_efficiency = Curve2{{64, 256}, {1, 16}, {{0.25, 0.5}, {0.5, 1.0}}};
  t.a2a_efficiency = Curve1{{1024, 1048576}, {0.1, 0.9}};
  t.intra_node = {10e9, 5e-6};
  t.inter_node = {1e9, 2e-5};
  return t;
}

TEST(CostTable, LookupSecondsByHand) {
  CostTable t = handTable();
  // 1 GB at efficiency 0.5 of 20 GB/s: 0.1 s.
  EXPECT_DOUBLE_EQ(t.lookupSeconds(1e9, 256, 1), 0.1);
  EXPECT_DOUBLE_EQ(t.lookupSeconds(1e9, 64, 16), 0.1);
  // Efficiency 1: 0.05 s; 0.25: 0.2 s.
  EXPECT_DOUBLE_EQ(t.lookupSeconds(1e9, 256, 16), 0.05);
  EXPECT_DOUBLE_EQ(t.lookupSeconds(1e9, 64, 1), 0.2);
  // (128, 4): the middle of the cell, efficiency (0.25 + 0.5 + 0.5 + 1) / 4 = 0.5625.
  EXPECT_NEAR(t.lookupSeconds(1.125e9, 128, 4), 1.125e9 / (20e9 * 0.5625), 1e-15);
  EXPECT_NEAR(t.lookupSeconds(1.125e9, 128, 4), 0.1, 1e-12);
  // Clamped: short rows, one id, below the grid.
  EXPECT_DOUBLE_EQ(t.lookupSeconds(1e9, 8, 0.5), 0.2);
  EXPECT_EQ(t.lookupSeconds(0, 256, 16), 0);
}

TEST(CostTable, CommSecondsByHand) {
  CostTable t = handTable();
  // 1 MiB a peer: efficiency 0.9 of 10 GB/s, plus the latency of two collectives.
  EXPECT_NEAR(t.commSeconds(9e8, 1048576, t.intra_node, 2), 0.1 + 2 * 5e-6, 1e-15);
  // 32 KiB a peer: log2 15, halfway from 10 to 20: efficiency 0.5.
  EXPECT_NEAR(t.commSeconds(1e6, 32768, t.intra_node, 1), 1e6 / 5e9 + 5e-6, 1e-15);
  // Below the curve (flat at 0.1), over the slower link.
  EXPECT_NEAR(t.commSeconds(1e6, 16, t.inter_node, 1), 1e6 / 1e8 + 2e-5, 1e-15);
  // Above it: flat at 0.9.
  EXPECT_NEAR(t.commSeconds(9e9, 1e9, t.inter_node, 0), 10.0, 1e-12);
  // No bytes: the latencies alone; nothing at all: zero.
  EXPECT_NEAR(t.commSeconds(0, 1024, t.intra_node, 3), 1.5e-5, 1e-18);
  EXPECT_EQ(t.commSeconds(0, 1024, t.intra_node, 0), 0);
}

// --- Writing and reading back.

TEST(CostTable, WriteThenParseRoundTrips) {
  CostTable t = handTable();
  t.source = "a test's table, \"quoted\"\nwith a newline";
  t.pcie_bytes_per_s = 0;
  t.device_bytes_per_s = 12345678901.25;
  t.intra_node.latency_s = 3.3e-6;
  t.lookup_efficiency = Curve2{{32, 64, 1024}, {1, 4}, {{0.1234, 0.2}, {0.3, 0.45678}, {0.0001, 1}}};
  t.a2a_efficiency = Curve1{{1024, 4096, 16777216}, {0.01, 0.333, 1}};
  std::string text = writeCostTable(t);
  EXPECT_NE(text.find("\"format\": \"kiln-costs-1\""), std::string::npos) << text;
  auto back = parseCostTable(text, "roundtrip.json");
  ASSERT_TRUE(back.isOk()) << back.status().str();
  EXPECT_EQ(back->target, t.target);
  EXPECT_EQ(back->source, t.source);
  EXPECT_EQ(back->device_bytes_per_s, t.device_bytes_per_s);
  EXPECT_EQ(back->host_bytes_per_s, t.host_bytes_per_s);
  EXPECT_EQ(back->pcie_bytes_per_s, 0);
  EXPECT_EQ(back->intra_node.bytes_per_s, t.intra_node.bytes_per_s);
  EXPECT_EQ(back->intra_node.latency_s, t.intra_node.latency_s);
  EXPECT_EQ(back->inter_node.bytes_per_s, t.inter_node.bytes_per_s);
  EXPECT_EQ(back->inter_node.latency_s, t.inter_node.latency_s);
  EXPECT_EQ(back->lookup_efficiency.x, t.lookup_efficiency.x);
  EXPECT_EQ(back->lookup_efficiency.y, t.lookup_efficiency.y);
  EXPECT_EQ(back->lookup_efficiency.z, t.lookup_efficiency.z);
  EXPECT_EQ(back->a2a_efficiency.x, t.a2a_efficiency.x);
  EXPECT_EQ(back->a2a_efficiency.y, t.a2a_efficiency.y);
  // Written again, the same text.
  EXPECT_EQ(writeCostTable(*back), text);
  // And the JSON is what the format says, read by nlohmann.
  json j = json::parse(text);
  EXPECT_EQ(j["memory"]["device_bytes_per_s"].get<double>(), 12345678901.25);
  EXPECT_EQ(j["lookup_efficiency"]["values"][2][0].get<double>(), 0.0001);
  EXPECT_EQ(j["all_to_all_efficiency"]["message_bytes"][2].get<double>(), 16777216);
}

TEST(CostTable, BuiltinTablesSurviveTheWriter) {
  for (const char* name : {"cpu", "h200", "h100", "a100"}) {
    auto t = builtinCostTable(name);
    ASSERT_TRUE(t.isOk());
    auto back = parseCostTable(writeCostTable(*t), name);
    ASSERT_TRUE(back.isOk()) << back.status().str();
    EXPECT_EQ(writeCostTable(*back), writeCostTable(*t));
  }
}

// --- Malformed tables: each error names the field.

// A valid table written out by hand; each case below breaks one thing in it.
const char* kValid = R"({
  "format": "kiln-costs-1",
  "target": "t",
  "source": "s",
  "memory": {"device_bytes_per_s": 1e10, "host_bytes_per_s": 1e10, "pcie_bytes_per_s": 0},
  "links": {"intra_node": {"bytes_per_s": 1e10, "latency_s": 1e-6},
            "inter_node": {"bytes_per_s": 1e9, "latency_s": 1e-5}},
  "lookup_efficiency": {"row_bytes": [32, 64], "pooling": [1, 4, 16],
                        "values": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]},
  "all_to_all_efficiency": {"message_bytes": [1024, 65536], "values": [0.1, 0.9]}
})";

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << "the test's table has no '" << from << "'";
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

void expectError(const std::string& text, const std::vector<std::string>& parts) {
  auto t = parseCostTable(text, "bad.json");
  ASSERT_FALSE(t.isOk()) << text;
  const std::string& m = t.status().message();
  EXPECT_NE(m.find("bad.json"), std::string::npos) << m;
  for (const std::string& part : parts) EXPECT_NE(m.find(part), std::string::npos) << "'" << part << "' not in: " << m;
}

TEST(CostTable, TheHandWrittenTableParses) {
  auto t = parseCostTable(kValid, "good.json");
  ASSERT_TRUE(t.isOk()) << t.status().str();
  EXPECT_EQ(t->target, "t");
  EXPECT_EQ(t->lookup_efficiency.z[1][2], 0.6);
  EXPECT_EQ(t->a2a_efficiency.y[1], 0.9);
  EXPECT_EQ(t->pcie_bytes_per_s, 0);
}

TEST(CostTable, WrongFormat) {
  expectError(replaced(kValid, "kiln-costs-1", "kiln-costs-2"), {"format", "kiln-costs-1"});
  expectError(replaced(kValid, "\"format\": \"kiln-costs-1\",", ""), {"format"});
  expectError(replaced(kValid, "\"kiln-costs-1\"", "1"), {"format"});
}

TEST(CostTable, MissingOrWrongObjects) {
  expectError(replaced(kValid, "\"memory\"", "\"mem\""), {"memory"});
  expectError(replaced(kValid, "\"links\"", "\"linkz\""), {"links"});
  expectError(replaced(kValid, "\"inter_node\"", "\"inter\""), {"links.inter_node"});
  expectError(replaced(kValid, "\"target\": \"t\"", "\"target\": 3"), {"target"});
  expectError(replaced(kValid, "\"host_bytes_per_s\": 1e10, ", ""), {"memory.host_bytes_per_s"});
  expectError(replaced(kValid, "\"device_bytes_per_s\": 1e10", "\"device_bytes_per_s\": \"fast\""),
              {"memory.device_bytes_per_s"});
  expectError(replaced(kValid, "\"all_to_all_efficiency\"", "\"a2a\""), {"all_to_all_efficiency"});
  expectError(replaced(kValid, "\"lookup_efficiency\"", "\"lookups\""), {"lookup_efficiency"});
}

TEST(CostTable, NegativeOrZeroRates) {
  expectError(replaced(kValid, "\"device_bytes_per_s\": 1e10", "\"device_bytes_per_s\": -1e10"),
              {"memory.device_bytes_per_s", "positive"});
  expectError(replaced(kValid, "\"device_bytes_per_s\": 1e10", "\"device_bytes_per_s\": 0"),
              {"memory.device_bytes_per_s"});
  expectError(replaced(kValid, "\"pcie_bytes_per_s\": 0", "\"pcie_bytes_per_s\": -5"), {"memory.pcie_bytes_per_s"});
  expectError(replaced(kValid, "{\"bytes_per_s\": 1e9,", "{\"bytes_per_s\": -1e9,"), {"links.inter_node.bytes_per_s"});
  expectError(replaced(kValid, "\"latency_s\": 1e-6", "\"latency_s\": -1e-6"), {"links.intra_node.latency_s"});
}

TEST(CostTable, ValuesRowOfTheWrongLength) {
  expectError(replaced(kValid, "[0.4, 0.5, 0.6]", "[0.4, 0.5]"), {"lookup_efficiency.values[1]", "pooling"});
  expectError(replaced(kValid, "[[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]", "[[0.1, 0.2, 0.3]]"),
              {"lookup_efficiency.values", "row_bytes"});
  expectError(replaced(kValid, "\"values\": [0.1, 0.9]", "\"values\": [0.1, 0.5, 0.9]"),
              {"all_to_all_efficiency.values"});
}

TEST(CostTable, AxisNotAscending) {
  expectError(replaced(kValid, "[1, 4, 16]", "[1, 16, 4]"), {"lookup_efficiency.pooling", "ascending"});
  expectError(replaced(kValid, "[32, 64]", "[64, 64]"), {"lookup_efficiency.row_bytes", "ascending"});
  expectError(replaced(kValid, "[1024, 65536]", "[65536, 1024]"), {"all_to_all_efficiency.message_bytes"});
  expectError(replaced(kValid, "[32, 64]", "[0, 64]"), {"lookup_efficiency.row_bytes"});
  expectError(replaced(kValid, "[32, 64]", "[]"), {"lookup_efficiency.row_bytes"});
}

TEST(CostTable, EfficiencyOutOfRange) {
  expectError(replaced(kValid, "[0.4, 0.5, 0.6]", "[0.4, 1.5, 0.6]"), {"lookup_efficiency.values[1]", "(0, 1]"});
  expectError(replaced(kValid, "[0.1, 0.2, 0.3]", "[0.1, 0, 0.3]"), {"lookup_efficiency.values[0]"});
  expectError(replaced(kValid, "\"values\": [0.1, 0.9]", "\"values\": [0.1, 1.01]"),
              {"all_to_all_efficiency.values", "(0, 1]"});
  // Exactly 1 is allowed.
  EXPECT_TRUE(parseCostTable(replaced(kValid, "[0.4, 0.5, 0.6]", "[0.4, 0.5, 1]"), "ok.json").isOk());
}

TEST(CostTable, NotJson) {
  expectError("{\"format\": \"kiln-costs-1\", ", {"JSON"});
  expectError("", {"JSON"});
  expectError("[1, 2, 3]", {"JSON object"});
}

}  // namespace
}  // namespace kiln::passes

namespace kiln::passes {
namespace {

// The optional compute section (what `kiln calibrate` measures for the simulator): absent, the
// rates stay 0; written, they come back; a bad one names its field.
TEST(CostTable, ComputeSectionIsOptionalAndRoundTrips) {
  auto builtin = builtinCostTable("h200");
  ASSERT_TRUE(builtin);
  EXPECT_EQ(builtin->gemm_flops_per_s.f32, 0);
  EXPECT_EQ(writeCostTable(*builtin).find("\"compute\""), std::string::npos);
  CostTable t = *builtin;
  t.gemm_flops_per_s = {9.0e10, 9.0e10};
  t.vector_flops_per_s = {5.5e9, 5.5e9};
  t.launch_s = 2.5e-7;
  const std::string text = writeCostTable(t);
  auto back = parseCostTable(text, "compute.json");
  ASSERT_TRUE(back) << back.status().str();
  EXPECT_EQ(back->gemm_flops_per_s.f32, 9.0e10);
  EXPECT_EQ(back->gemm_flops_per_s.bf16, 9.0e10);
  EXPECT_EQ(back->vector_flops_per_s.f32, 5.5e9);
  EXPECT_EQ(back->launch_s, 2.5e-7);
  std::string bad = text;
  bad.replace(bad.find("\"gemm_f32_flops_per_s\": 90000000000.0"), 37, "\"gemm_f32_flops_per_s\": -1.0");
  auto err = parseCostTable(bad, "compute.json");
  ASSERT_FALSE(err);
  EXPECT_NE(err.status().message().find("compute.gemm_f32_flops_per_s"), std::string::npos) << err.status().message();
}

}  // namespace
}  // namespace kiln::passes
