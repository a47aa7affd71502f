#include "runtime/serving/update_file.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>

#include "ir/ops/kernel_util.h"
#include "runtime/checkpoint.h"
#include "runtime/data/batch.h"
#include "runtime/random.h"

namespace kiln::serving {
namespace {

constexpr std::string_view kPrefix = "update-";
constexpr std::string_view kSuffix = ".safetensors";
constexpr std::string_view kIds = "ids/";
constexpr std::string_view kRows = "rows/";
constexpr std::string_view kDense = "dense/";

std::optional<int64_t> parseInt(std::string_view s) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

bool startsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// FNV-1a 64 of every tensor's name, dtype, shape and bytes, in name order, as 16 hex digits. A
// file copied into the watched folder has its full size before its tail is written: it parses as
// a valid safetensors file whose last rows are zeros, so the reader recomputes this before
// applying anything.
std::string contentChecksum(std::vector<std::pair<std::string, const ir::TensorView*>> tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  uint64_t h = 0xcbf29ce484222325ull;
  for (const auto& [name, v] : tensors) {
    // With its terminating NUL: names "a" + "bc" hash apart from "ab" + "c".
    h = runtime::fnv1a64(name.data(), name.size() + 1, h);
    const std::string_view dtype = runtime::safetensorsDType(v->dtype);
    h = runtime::fnv1a64(dtype.data(), dtype.size(), h);
    h = runtime::fnv1a64(v->shape.data(), v->shape.size() * sizeof(int64_t), h);
    h = runtime::fnv1a64(v->data, static_cast<size_t>(v->bytes()), h);
  }
  return fmt::format("{:016x}", h);
}

}  // namespace

std::string updateFileName(int64_t version) { return fmt::format("{}{:012}{}", kPrefix, version, kSuffix); }

std::optional<int64_t> parseUpdateFileName(std::string_view name) {
  if (!startsWith(name, kPrefix) || name.size() <= kPrefix.size() + kSuffix.size() ||
      name.substr(name.size() - kSuffix.size()) != kSuffix)
    return std::nullopt;
  std::string_view digits = name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  for (char c : digits)
    if (c < '0' || c > '9') return std::nullopt;
  return parseInt(digits);
}

Status writeUpdate(const std::string& dir, const ModelUpdate& u) {
  std::vector<std::pair<std::string, ir::TensorView>> tensors;
  // The id tensors must outlive the save.
  std::vector<ir::HostTensor> ids(u.tables.size());
  for (size_t t = 0; t < u.tables.size(); ++t) {
    const TableRows& tr = u.tables[t];
    ids[t].reset(ir::DType::i64, {static_cast<int64_t>(tr.ids.size())});
    if (!tr.ids.empty()) std::memcpy(ids[t].view.data, tr.ids.data(), tr.ids.size() * sizeof(int64_t));
    tensors.emplace_back(std::string(kIds) + tr.table, ids[t].view);
    tensors.emplace_back(std::string(kRows) + tr.table, tr.rows.view);
  }
  for (const auto& [name, t] : u.dense) tensors.emplace_back(std::string(kDense) + name, t.view);
  std::vector<std::pair<std::string, const ir::TensorView*>> summed;
  for (const auto& [name, v] : tensors) summed.emplace_back(name, &v);
  const std::map<std::string, std::string> meta = {{"kiln.update", "2"},
                                                   {"version", std::to_string(u.version)},
                                                   {"base", std::to_string(u.base)},
                                                   {"model", u.model},
                                                   {"checksum", contentChecksum(std::move(summed))}};
  return runtime::saveCheckpoint((std::filesystem::path(dir) / updateFileName(u.version)).string(), tensors,
                                 meta);
}

Expected<ModelUpdate> readUpdate(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto ckpt, runtime::loadCheckpoint(path));
  auto meta = [&](const char* key) -> std::optional<std::string> {
    auto it = ckpt.metadata.find(key);
    return it == ckpt.metadata.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  if (meta("kiln.update") == "1")
    return Status::errorf(
        "'{}' is an update file of an older kiln (kiln.update 1, without a checksum, so it "
        "cannot be told complete): publish it again with this one",
        path);
  if (meta("kiln.update") != "2")
    return Status::errorf("'{}' is not a Kiln update file (no kiln.update metadata)", path);
  // Before anything is taken from it: a file whose tail is not yet written (or is damaged) holds
  // rows that are not the trainer's. The watcher retries it at the next poll.
  std::vector<std::pair<std::string, const ir::TensorView*>> summed;
  for (const auto& [name, t] : ckpt.tensors) summed.emplace_back(name, &t.view);
  if (const std::string got = contentChecksum(std::move(summed)); meta("checksum") != got)
    return Status::errorf(
        "'{}': its data does not match its checksum ({} in the header, {} in the data): the file is not "
        "completely written yet, or damaged; it is not applied",
        path, meta("checksum").value_or("none"), got);
  ModelUpdate u;
  auto version = parseInt(meta("version").value_or(""));
  auto base = parseInt(meta("base").value_or(""));
  if (!version || !base || *base > *version)
    return Status::errorf("'{}': the update's version and base must be integers with base <= version", path);
  u.version = *version;
  u.base = *base;
  u.model = meta("model").value_or("");
  std::map<std::string, ir::HostTensor> ids, rows;
  for (auto& [name, t] : ckpt.tensors) {
    std::string_view n = name;
    if (startsWith(n, kIds)) {
      ids.emplace(std::string(n.substr(kIds.size())), std::move(t));
    } else if (startsWith(n, kRows)) {
      rows.emplace(std::string(n.substr(kRows.size())), std::move(t));
    } else if (startsWith(n, kDense)) {
      u.dense.emplace_back(std::string(n.substr(kDense.size())), std::move(t));
    } else {
      return Status::errorf("'{}': unexpected tensor '{}'", path, name);
    }
  }
  for (auto& [table, id_tensor] : ids) {
    auto r = rows.find(table);
    const ir::TensorView& iv = id_tensor.view;
    if (r == rows.end()) return Status::errorf("'{}': table '{}' has ids but no rows", path, table);
    const ir::TensorView& rv = r->second.view;
    if (iv.dtype != ir::DType::i64 || iv.rank() != 1 || rv.dtype != ir::DType::f32 || rv.rank() != 2 ||
        rv.shape[0] != iv.shape[0])
      return Status::errorf("'{}': table '{}' needs ids i64[n] and rows f32[n, dim], got [{}] and [{}]", path,
                            table, fmt::join(iv.shape, ", "), fmt::join(rv.shape, ", "));
    TableRows tr;
    tr.table = table;
    tr.ids.assign(iv.as<int64_t>(), iv.as<int64_t>() + iv.shape[0]);
    for (size_t i = 1; i < tr.ids.size(); ++i)
      if (tr.ids[i] <= tr.ids[i - 1])
        return Status::errorf("'{}': table '{}' ids are not ascending", path, table);
    tr.rows = std::move(r->second);
    rows.erase(r);
    u.tables.push_back(std::move(tr));
  }
  if (!rows.empty()) return Status::errorf("'{}': table '{}' has rows but no ids", path, rows.begin()->first);
  return u;
}

Expected<std::vector<std::pair<int64_t, std::string>>> listUpdates(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    auto v = parseUpdateFileName(it->path().filename().string());
    // Only regular files (or links to them): opening a FIFO of an update's name blocked the
    // watcher until something wrote to it, and with it the server's shutdown.
    std::error_code type_ec;
    if (v && it->is_regular_file(type_ec)) out.emplace_back(*v, it->path().string());
  }
  if (ec) return Status::errorf("cannot list the update folder '{}': {}", dir, ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

UpdatePublisher::UpdatePublisher(std::string dir, std::string model, std::vector<ServedTable> tables,
                                 std::vector<std::string> dense, int64_t base)
    : dir_(std::move(dir)),
      model_(std::move(model)),
      tables_(std::move(tables)),
      dense_(std::move(dense)),
      base_(base),
      touched_(tables_.size()) {}

void UpdatePublisher::noteBatch(const data::Batch& batch) {
  for (size_t t = 0; t < tables_.size(); ++t)
    for (const std::string& name : tables_[t].id_inputs) {
      const ir::HostTensor* in = batch.find(name);
      if (!in) continue;
      const ir::TensorView& v = in->view;
      for (int64_t i = 0, n = v.numel(); i < n; ++i) {
        const int64_t id = ir::kernels::loadIndex(v, i);
        if (id >= 0 && id < tables_[t].rows) touched_[t].insert(id);
      }
    }
}

Status UpdatePublisher::publish(int64_t version, const runtime::ParameterStore& params) {
  ModelUpdate u;
  u.version = version;
  u.base = base_;
  u.model = model_;
  for (size_t t = 0; t < tables_.size(); ++t) {
    const ServedTable& table = tables_[t];
    const ir::HostTensor* whole = params.find(table.name);
    if (!whole) return Status::errorf("--publish: the parameter store has no table '{}'", table.name);
    TableRows tr;
    tr.table = table.name;
    tr.ids.assign(touched_[t].begin(), touched_[t].end());
    tr.rows.reset(ir::DType::f32, {static_cast<int64_t>(tr.ids.size()), table.dim});
    const auto row_bytes = static_cast<size_t>(table.dim) * sizeof(float);
    for (size_t i = 0; i < tr.ids.size(); ++i)
      std::memcpy(tr.rows.view.as<float>() + i * static_cast<size_t>(table.dim),
                  whole->view.as<float>() + static_cast<size_t>(tr.ids[i]) * static_cast<size_t>(table.dim),
                  row_bytes);
    u.tables.push_back(std::move(tr));
  }
  for (const std::string& name : dense_) {
    const ir::HostTensor* p = params.find(name);
    if (!p) return Status::errorf("--publish: the parameter store has no '{}'", name);
    u.dense.emplace_back(name, ir::HostTensor::external(p->view.dtype, p->view.shape, p->view.data, nullptr));
  }
  KILN_RETURN_IF_ERROR(writeUpdate(dir_, u));
  base_ = version;
  for (auto& s : touched_) s.clear();
  return Status::ok();
}

}  // namespace kiln::serving
