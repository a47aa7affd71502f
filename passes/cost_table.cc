#include "passes/cost_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kiln::passes {
namespace {

#include "cost_tables.inc"  // kBuiltinCostTables: {name, JSON text} of passes/costs/*.json

double lg(double v) { return std::log2(std::max(v, 1e-300)); }

// The segment [i, i+1] of ascending `xs` holding x, and x's fraction along it (0 or 1 outside).
void locate(const std::vector<double>& xs, double x, size_t& i, double& f) {
  if (xs.size() < 2 || x <= xs.front()) {
    i = 0;
    f = 0;
    return;
  }
  if (x >= xs.back()) {
    i = xs.size() - 2;
    f = 1;
    return;
  }
  i = static_cast<size_t>(std::upper_bound(xs.begin(), xs.end(), x) - xs.begin()) - 1;
  f = (lg(x) - lg(xs[i])) / (lg(xs[i + 1]) - lg(xs[i]));
}

using json = nlohmann::json;

Status fieldError(std::string_view file, std::string_view field, std::string_view what) {
  return Status::errorf("{}: '{}' {}", file, field, what);
}

Expected<double> positive(const json& obj, std::string_view file, std::string_view path, const char* key,
                          bool allow_zero = false) {
  auto it = obj.find(key);
  std::string name = fmt::format("{}.{}", path, key);
  if (it == obj.end() || !it->is_number()) return fieldError(file, name, "must be a number");
  double v = it->get<double>();
  if (!std::isfinite(v) || v < 0 || (v == 0 && !allow_zero))
    return fieldError(file, name, fmt::format("must be {}, got {}", allow_zero ? "at least 0" : "positive", v));
  return v;
}

// An ascending list of positive numbers (an axis), or of fractions in (0, 1] (values).
Expected<std::vector<double>> numbers(const json& obj, std::string_view file, std::string_view path,
                                      const char* key, bool axis) {
  auto it = obj.find(key);
  std::string name = fmt::format("{}.{}", path, key);
  if (it == obj.end() || !it->is_array() || it->empty()) return fieldError(file, name, "must be a non-empty list");
  std::vector<double> out;
  for (const json& v : *it) {
    if (!v.is_number()) return fieldError(file, name, "must hold numbers only");
    double x = v.get<double>();
    if (!std::isfinite(x) || x <= 0 || (!axis && x > 1))
      return fieldError(file, name,
                        fmt::format("holds {}: {}", x, axis ? "an axis is positive" : "an efficiency lies in (0, 1]"));
    if (axis && !out.empty() && x <= out.back())
      return fieldError(file, name, "must be strictly ascending");
    out.push_back(x);
  }
  return out;
}

Expected<LinkRates> link(const json& links, std::string_view file, const char* key) {
  auto it = links.find(key);
  std::string path = fmt::format("links.{}", key);
  if (it == links.end() || !it->is_object()) return fieldError(file, path, "must be an object");
  LinkRates l;
  KILN_ASSIGN_OR_RETURN(l.bytes_per_s, positive(*it, file, path, "bytes_per_s"));
  KILN_ASSIGN_OR_RETURN(l.latency_s, positive(*it, file, path, "latency_s", true));
  return l;
}

// The writer keeps the documented key order ("format" first), not nlohmann's alphabetical one.
using ordered_json = nlohmann::ordered_json;

ordered_json curveJson(const std::vector<double>& v) {
  ordered_json a = ordered_json::array();
  for (double x : v) a.push_back(x);
  return a;
}

}  // namespace

double Curve1::at(double v) const {
  if (y.empty()) return 1;
  size_t i;
  double f;
  locate(x, v, i, f);
  if (y.size() < 2) return y[0];
  return y[i] + f * (y[i + 1] - y[i]);
}

double Curve2::at(double vx, double vy) const {
  if (z.empty() || z[0].empty()) return 1;
  size_t i, j;
  double fx, fy;
  locate(x, vx, i, fx);
  locate(y, vy, j, fy);
  size_t i1 = std::min(i + 1, z.size() - 1), j1 = std::min(j + 1, z[0].size() - 1);
  double a = z[i][j] + fy * (z[i][j1] - z[i][j]);
  double b = z[i1][j] + fy * (z[i1][j1] - z[i1][j]);
  return a + fx * (b - a);
}

double CostTable::lookupSeconds(double bytes, double row_bytes, double pooling) const {
  if (bytes <= 0) return 0;
  double eff = std::max(lookup_efficiency.at(row_bytes, pooling), 1e-3);
  return bytes / (device_bytes_per_s * eff);
}

double CostTable::commSeconds(double bytes, double bytes_per_peer, const LinkRates& l, int collectives) const {
  if (bytes <= 0 && collectives == 0) return 0;
  double eff = std::max(a2a_efficiency.at(bytes_per_peer), 1e-3);
  return bytes / (l.bytes_per_s * eff) + collectives * l.latency_s;
}

Expected<CostTable> parseCostTable(std::string_view text, std::string_view file) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::errorf("{}: not a JSON object", file);
  auto fmt_it = j.find("format");
  if (fmt_it == j.end() || *fmt_it != "kiln-costs-1")
    return Status::errorf("{}: not a cost table (its \"format\" must be \"kiln-costs-1\")", file);
  CostTable t;
  if (auto it = j.find("target"); it != j.end() && it->is_string()) t.target = it->get<std::string>();
  else return fieldError(file, "target", "must be a string");
  if (auto it = j.find("source"); it != j.end() && it->is_string()) t.source = it->get<std::string>();
  auto mem = j.find("memory");
  if (mem == j.end() || !mem->is_object()) return fieldError(file, "memory", "must be an object");
  KILN_ASSIGN_OR_RETURN(t.device_bytes_per_s, positive(*mem, file, "memory", "device_bytes_per_s"));
  KILN_ASSIGN_OR_RETURN(t.host_bytes_per_s, positive(*mem, file, "memory", "host_bytes_per_s"));
  KILN_ASSIGN_OR_RETURN(t.pcie_bytes_per_s, positive(*mem, file, "memory", "pcie_bytes_per_s", true));
  auto links = j.find("links");
  if (links == j.end() || !links->is_object()) return fieldError(file, "links", "must be an object");
  KILN_ASSIGN_OR_RETURN(t.intra_node, link(*links, file, "intra_node"));
  KILN_ASSIGN_OR_RETURN(t.inter_node, link(*links, file, "inter_node"));

  if (auto c = j.find("compute"); c != j.end()) {
    if (!c->is_object()) return fieldError(file, "compute", "must be an object");
    KILN_ASSIGN_OR_RETURN(t.gemm_flops_per_s.f32, positive(*c, file, "compute", "gemm_f32_flops_per_s"));
    KILN_ASSIGN_OR_RETURN(t.gemm_flops_per_s.bf16, positive(*c, file, "compute", "gemm_bf16_flops_per_s"));
    KILN_ASSIGN_OR_RETURN(t.vector_flops_per_s.f32, positive(*c, file, "compute", "vector_flops_per_s"));
    t.vector_flops_per_s.bf16 = t.vector_flops_per_s.f32;
    KILN_ASSIGN_OR_RETURN(t.launch_s, positive(*c, file, "compute", "launch_s", true));
  }
  auto le = j.find("lookup_efficiency");
  if (le == j.end() || !le->is_object()) return fieldError(file, "lookup_efficiency", "must be an object");
  KILN_ASSIGN_OR_RETURN(t.lookup_efficiency.x, numbers(*le, file, "lookup_efficiency", "row_bytes", true));
  KILN_ASSIGN_OR_RETURN(t.lookup_efficiency.y, numbers(*le, file, "lookup_efficiency", "pooling", true));
  auto vals = le->find("values");
  if (vals == le->end() || !vals->is_array() || vals->size() != t.lookup_efficiency.x.size())
    return fieldError(file, "lookup_efficiency.values",
                      fmt::format("must hold one row per row_bytes entry ({})", t.lookup_efficiency.x.size()));
  for (size_t i = 0; i < vals->size(); ++i) {
    json row = {{"row", (*vals)[i]}};
    std::string path = fmt::format("lookup_efficiency.values[{}]", i);
    KILN_ASSIGN_OR_RETURN(std::vector<double> r, numbers(row, file, path, "row", false));
    if (r.size() != t.lookup_efficiency.y.size())
      return fieldError(file, path,
                        fmt::format("must hold one value per pooling entry ({})", t.lookup_efficiency.y.size()));
    t.lookup_efficiency.z.push_back(std::move(r));
  }
  auto ae = j.find("all_to_all_efficiency");
  if (ae == j.end() || !ae->is_object()) return fieldError(file, "all_to_all_efficiency", "must be an object");
  KILN_ASSIGN_OR_RETURN(t.a2a_efficiency.x, numbers(*ae, file, "all_to_all_efficiency", "message_bytes", true));
  KILN_ASSIGN_OR_RETURN(t.a2a_efficiency.y, numbers(*ae, file, "all_to_all_efficiency", "values", false));
  if (t.a2a_efficiency.y.size() != t.a2a_efficiency.x.size())
    return fieldError(file, "all_to_all_efficiency.values", "must hold one value per message_bytes entry");
  return t;
}

Expected<CostTable> builtinCostTable(std::string_view target) {
  std::string names;
  for (const auto& [name, text] : kBuiltinCostTables) {
    if (name == target) return parseCostTable(text, fmt::format("passes/costs/{}.json", name));
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  return Status::errorf("no built-in cost table for target '{}' (there are: {})", target, names);
}

Expected<CostTable> loadCostTable(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("cannot read cost table '{}'", path);
  std::stringstream s;
  s << in.rdbuf();
  return parseCostTable(s.str(), path);
}

std::string writeCostTable(const CostTable& t) {
  ordered_json j;
  j["format"] = "kiln-costs-1";
  j["target"] = t.target;
  j["source"] = t.source;
  j["memory"] = {{"device_bytes_per_s", t.device_bytes_per_s},
                 {"host_bytes_per_s", t.host_bytes_per_s},
                 {"pcie_bytes_per_s", t.pcie_bytes_per_s}};
  j["links"] = {{"intra_node", {{"bytes_per_s", t.intra_node.bytes_per_s}, {"latency_s", t.intra_node.latency_s}}},
                {"inter_node", {{"bytes_per_s", t.inter_node.bytes_per_s}, {"latency_s", t.inter_node.latency_s}}}};
  if (t.gemm_flops_per_s.f32 > 0)
    j["compute"] = {{"gemm_f32_flops_per_s", t.gemm_flops_per_s.f32},
                    {"gemm_bf16_flops_per_s", t.gemm_flops_per_s.bf16 > 0 ? t.gemm_flops_per_s.bf16 : t.gemm_flops_per_s.f32},
                    {"vector_flops_per_s", t.vector_flops_per_s.f32},
                    {"launch_s", t.launch_s}};
  ordered_json rows = ordered_json::array();
  for (const auto& r : t.lookup_efficiency.z) rows.push_back(curveJson(r));
  j["lookup_efficiency"] = {{"row_bytes", curveJson(t.lookup_efficiency.x)},
                            {"pooling", curveJson(t.lookup_efficiency.y)},
                            {"values", rows}};
  j["all_to_all_efficiency"] = {{"message_bytes", curveJson(t.a2a_efficiency.x)},
                                {"values", curveJson(t.a2a_efficiency.y)}};
  return j.dump(2) + "\n";
}

}  // namespace kiln::passes
