#include "driver/compiled_model.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/json.h"

namespace kiln::driver {

std::string cpuProgramSection(std::string_view function) { return fmt::format("program.cpu.{}", function); }

bool CompiledModel::has(std::string_view function) const {
  return std::find(functions.begin(), functions.end(), function) != functions.end();
}

std::string compiledMetaJson(const CompiledModel& c) {
  json::Json j = json::Json::object();
  j["name"] = c.name;
  j["source"] = c.source;
  j["kiln_version"] = c.kiln_version;
  j["target"] = c.target;
  j["max_batch"] = c.max_batch;
  j["functions"] = c.functions;
  j["devices"] = c.devices;
  j["archs"] = c.archs;
  json::Json sets = json::Json::object();
  for (const auto& [k, v] : c.overrides) sets[k] = v;
  j["set"] = sets;
  auto text = json::dump(j);
  return text ? *text : "{}";
}

Status parseCompiledMeta(std::string_view text, CompiledModel& c) {
  KILN_ASSIGN_OR_RETURN(json::Json j, json::parse(text));
  auto bad = [](std::string_view what) {
    return Status::errorf("the payload's metadata is damaged: {}", what);
  };
  if (!j.is_object()) return bad("not an object");
  auto str = [&](const char* key, std::string& out) {
    if (!j.contains(key) || !j[key].is_string()) return false;
    out = j[key].get<std::string>();
    return true;
  };
  auto list = [&](const char* key, std::vector<std::string>& out) {
    if (!j.contains(key) || !j[key].is_array()) return false;
    for (const auto& v : j[key]) {
      if (!v.is_string()) return false;
      out.push_back(v.get<std::string>());
    }
    return true;
  };
  if (!str("name", c.name) || !str("source", c.source) || !str("kiln_version", c.kiln_version) ||
      !str("target", c.target))
    return bad("a name, source, version or target is missing");
  if (!j.contains("max_batch")) return bad("no max_batch");
  auto max_batch = json::asInt64(j["max_batch"]);
  if (!max_batch || *max_batch < 1) return bad("max_batch is not a positive integer");
  c.max_batch = *max_batch;
  if (!list("functions", c.functions) || !list("devices", c.devices) || !list("archs", c.archs))
    return bad("functions, devices or archs are not lists of strings");
  if (j.contains("set") && j["set"].is_object())
    for (const auto& [k, v] : j["set"].items())
      if (v.is_string()) c.overrides[k] = v.get<std::string>();
  return Status::ok();
}

Expected<std::shared_ptr<const CompiledModel>> loadCompiledModel(
    std::shared_ptr<const runtime::Payload> payload) {
  auto c = std::make_shared<CompiledModel>();
  const runtime::Payload& p = *payload;
  auto where = [&](const Status& s) { return Status::errorf("{}: {}", p.path(), s.message()); };
  KILN_ASSIGN_OR_RETURN(std::string meta, p.text(kMetaSection));
  if (Status s = parseCompiledMeta(meta, *c); !s) return where(s);
  KILN_ASSIGN_OR_RETURN(c->module_text, p.text(kModuleSection));
  for (const char* function : {"train_step", "forward"}) {
    const std::string name = cpuProgramSection(function);
    if (!p.has(name)) continue;
    KILN_ASSIGN_OR_RETURN(auto bytes, p.section(name));
    auto program = codegen::Program::deserialize(bytes.data(), bytes.size());
    if (!program)
      return Status::errorf("{}: payload section '{}': {}", p.path(), name, program.status().message());
    c->cpu_programs.emplace(function, program.take());
  }
  if (!c->cpu_programs.count("forward"))
    return Status::errorf("{}: the payload has no forward program", p.path());
  if (p.has(kWeightsSection)) {
    KILN_ASSIGN_OR_RETURN(c->weights, p.writableSection(kWeightsSection));
  }
  if (p.has(kCudaKernelsSection)) {
    KILN_ASSIGN_OR_RETURN(auto bytes, p.section(kCudaKernelsSection));
    c->cuda_kernels = std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  c->payload = std::move(payload);
  return std::shared_ptr<const CompiledModel>(std::move(c));
}

}  // namespace kiln::driver
