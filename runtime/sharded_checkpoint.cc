#include "runtime/sharded_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "runtime/json.h"

namespace kiln::runtime {

namespace {

constexpr const char* kFormat = "kiln.sharded_checkpoint";
constexpr int64_t kVersion = 1;
// Reads of small runs (a column range of many rows) are batched into reads of about this size.
constexpr uint64_t kReadChunkBytes = 64u << 20;

std::string dimsText(const std::vector<int64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// Elements in a box, or nullopt when the count overflows.
std::optional<uint64_t> volume(const std::vector<int64_t>& extent) {
  uint64_t n = 1;
  for (int64_t e : extent)
    if (e < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(e), &n)) return std::nullopt;
  return n;
}

// A piece as the tiling check sees it; `where` names it in messages.
struct Box {
  std::vector<int64_t> offset, extent;
  std::string where;
};

bool overlaps(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.offset.size(); ++d) {
    const int64_t lo = std::max(a.offset[d], b.offset[d]);
    const int64_t hi = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    if (lo >= hi) return false;
  }
  return true;
}

// Checks the boxes lie inside `shape` and tile it exactly: no two overlap and together they
// hold every element. `what` prefixes every message ("checkpoint index 'DIR/...': tensor 'emb'").
Status checkTiling(const std::string& what, const std::vector<int64_t>& shape,
                   const std::vector<Box>& boxes) {
  auto total = volume(shape);
  if (!total) return Status::errorf("{}: shape {} is impossibly large", what, dimsText(shape));
  uint64_t covered = 0;
  for (const Box& b : boxes) {
    if (b.offset.size() != shape.size() || b.extent.size() != shape.size())
      return Status::errorf("{}: the piece {} has {} offsets and {} extents for a tensor of rank {}", what,
                            b.where, b.offset.size(), b.extent.size(), shape.size());
    for (size_t d = 0; d < shape.size(); ++d)
      if (b.offset[d] < 0 || b.extent[d] < 0 || b.offset[d] > shape[d] ||
          b.extent[d] > shape[d] - b.offset[d])
        return Status::errorf("{}: the piece {} at offset {} of extent {} lies outside the shape {}", what,
                              b.where, dimsText(b.offset), dimsText(b.extent), dimsText(shape));
    // Each piece is inside the shape; only overlapping ones can make the sum overflow.
    if (__builtin_add_overflow(covered, *volume(b.extent), &covered)) covered = UINT64_MAX;
  }
  // Pairs of non-empty pieces, swept along dim 0: only pieces whose row ranges meet are
  // compared, so the many pieces of a row-wise table cost little.
  std::vector<size_t> order;
  for (size_t i = 0; i < boxes.size(); ++i)
    if (*volume(boxes[i].extent) > 0) order.push_back(i);
  if (!shape.empty())
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return boxes[a].offset[0] < boxes[b].offset[0]; });
  for (size_t x = 0; x < order.size(); ++x)
    for (size_t y = x + 1; y < order.size(); ++y) {
      const Box& first = boxes[order[x]];
      if (!shape.empty() && boxes[order[y]].offset[0] >= first.offset[0] + first.extent[0]) break;
      // Named in their listed order.
      const Box& a = boxes[std::min(order[x], order[y])];
      const Box& b = boxes[std::max(order[x], order[y])];
      if (overlaps(a, b))
        return Status::errorf("{}: the pieces {} (offset {}) and {} (offset {}) overlap", what, a.where,
                              dimsText(a.offset), b.where, dimsText(b.offset));
    }
  if (covered != *total)
    return Status::errorf("{}: the pieces cover {} of its {} elements (a gap)", what, covered, *total);
  return Status::ok();
}

std::optional<std::vector<int64_t>> intArray(const json::Json& j) {
  if (!j.is_array()) return std::nullopt;
  std::vector<int64_t> out;
  for (const json::Json& e : j) {
    auto v = json::asInt64(e);
    if (!v) return std::nullopt;
    out.push_back(*v);
  }
  return out;
}

json::Json toJson(const std::vector<int64_t>& v) {
  json::Json a = json::Json::array();
  for (int64_t x : v) a.push_back(x);
  return a;
}

// --- Agreement between ranks.

// Every rank learns whether every rank succeeded; a rank that failed returns its own error, the
// others one naming the first rank that failed.
Status agree(comm::Communicator& comm, const Status& local, const char* what) {
  const int32_t mine = local ? 0 : 1;
  std::vector<int32_t> all(static_cast<size_t>(comm.size()));
  KILN_RETURN_IF_ERROR(comm.allGatherSync(&mine, all.data(), 1, comm::DataType::i32));
  if (!local) return local;
  for (int r = 0; r < comm.size(); ++r)
    if (all[static_cast<size_t>(r)])
      return Status::errorf("sharded checkpoint: rank {} failed {} (its own error says why)", r, what);
  return Status::ok();
}

// Every rank's `text`, in rank order.
Expected<std::vector<std::string>> allGatherText(comm::Communicator& comm, const std::string& text) {
  const int64_t mine = static_cast<int64_t>(text.size());
  std::vector<int64_t> lens(static_cast<size_t>(comm.size()));
  KILN_RETURN_IF_ERROR(comm.allGatherSync(&mine, lens.data(), 1, comm::DataType::i64));
  std::vector<size_t> counts(lens.begin(), lens.end());
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::string all(total, '\0');
  KILN_RETURN_IF_ERROR(comm.allGatherV(text.data(), all.data(), counts, comm::DataType::u8).wait());
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t c : counts) {
    out.push_back(all.substr(at, c));
    at += c;
  }
  return out;
}

// --- The save plan every rank computes from every rank's descriptions.

struct PlannedPiece {
  int rank;               // the rank that writes it
  size_t local_index;     // into that rank's pieces
  std::string file_name;  // the tensor's name inside the shard file
  std::vector<int64_t> offset, extent;
};
struct PlannedTensor {
  std::string name;
  ir::DType dtype;
  std::vector<int64_t> shape;
  std::vector<PlannedPiece> pieces;
};

std::string describePieces(const std::vector<LocalPiece>& pieces) {
  json::Json list = json::Json::array();
  for (const LocalPiece& p : pieces)
    list.push_back({{"name", p.name},
                    {"dtype", safetensorsDType(p.view.dtype)},
                    {"shape", toJson(p.global_shape)},
                    {"offset", toJson(p.offset)},
                    {"extent", toJson(p.view.shape)},
                    {"replicated", p.replicated}});
  // Names were checked to be UTF-8-safe by dump's caller; a failure here is a bad name.
  auto text = json::dump(list);
  return text ? text.take() : std::string();
}

Expected<std::vector<PlannedTensor>> planSave(const std::vector<std::string>& descriptions) {
  std::vector<PlannedTensor> tensors;
  std::map<std::string, size_t> index;
  // Per tensor, the replicated regions seen so far (offset and extent), to keep the lowest rank's.
  std::map<std::string, std::set<std::pair<std::vector<int64_t>, std::vector<int64_t>>>> replicas;
  for (size_t r = 0; r < descriptions.size(); ++r) {
    const int rank = static_cast<int>(r);
    auto list = json::parse(descriptions[r]);
    if (!list || !list->is_array())
      return Status::errorf("sharded checkpoint: rank {} sent an unreadable description of its pieces", rank);
    std::map<std::string, int> pieces_of;  // per tensor, how many this rank writes
    for (size_t i = 0; i < list->size(); ++i) {
      const json::Json& d = (*list)[i];
      if (!d.is_object())
        return Status::errorf("sharded checkpoint: rank {} sent a malformed description", rank);
      const std::string name = d.value("name", "");
      auto dtype = parseSafetensorsDType(d.value("dtype", ""));
      auto field = [&](const char* key) { return d.contains(key) ? intArray(d[key]) : std::nullopt; };
      auto shape = field("shape");
      auto offset = field("offset");
      auto extent = field("extent");
      if (!dtype || !shape || !offset || !extent)
        return Status::errorf("sharded checkpoint: rank {} sent a malformed description of '{}'", rank, name);
      auto [it, inserted] = index.emplace(name, tensors.size());
      if (inserted) tensors.push_back({name, *dtype, *shape, {}});
      PlannedTensor& t = tensors[it->second];
      if (t.dtype != *dtype || t.shape != *shape)
        return Status::errorf(
            "sharded checkpoint: tensor '{}': rank {} holds a piece of a {} {} tensor, another rank "
            "of a {} {} one",
            name, rank, safetensorsDType(*dtype), dimsText(*shape), safetensorsDType(t.dtype),
            dimsText(t.shape));
      if (d.value("replicated", false) && !replicas[name].insert({*offset, *extent}).second)
        continue;  // a lower rank writes this replica
      t.pieces.push_back({rank, i, name, *offset, *extent});
      ++pieces_of[name];
    }
    // A rank holding several pieces of one tensor names each by its offset inside its file.
    for (PlannedTensor& t : tensors)
      if (pieces_of[t.name] > 1)
        for (PlannedPiece& p : t.pieces)
          if (p.rank == rank) p.file_name = fmt::format("{}@{}", t.name, fmt::join(p.offset, ","));
  }
  // By name: the index, and so a merged file, is then the same whatever layout wrote it.
  std::sort(tensors.begin(), tensors.end(),
            [](const PlannedTensor& a, const PlannedTensor& b) { return a.name < b.name; });
  for (const PlannedTensor& t : tensors) {
    std::vector<Box> boxes;
    for (const PlannedPiece& p : t.pieces)
      boxes.push_back({p.offset, p.extent, fmt::format("of rank {}", p.rank)});
    KILN_RETURN_IF_ERROR(checkTiling(fmt::format("sharded checkpoint: tensor '{}'", t.name), t.shape, boxes));
  }
  return tensors;
}

Status checkLocalPieces(const std::vector<LocalPiece>& pieces, int rank) {
  for (const LocalPiece& p : pieces) {
    if (p.offset.size() != p.global_shape.size() || p.view.shape.size() != p.global_shape.size())
      return Status::errorf(
          "sharded checkpoint: rank {}: the piece of '{}' has {} offsets and a {}-dim view for a "
          "tensor of rank {}",
          rank, p.name, p.offset.size(), p.view.shape.size(), p.global_shape.size());
    if (p.name.empty() || p.name == "__metadata__" || p.name.find('@') != std::string::npos)
      return Status::errorf(
          "sharded checkpoint: rank {}: '{}' cannot name a tensor (empty, reserved or with '@')", rank,
          p.name);
    if (safetensorsDType(p.view.dtype) == "?")
      return Status::errorf("sharded checkpoint: rank {}: tensor '{}' has a dtype safetensors cannot hold",
                            rank, p.name);
    if (!json::dump(json::Json(p.name)))
      return Status::errorf("sharded checkpoint: rank {}: a tensor name is not UTF-8", rank);
  }
  return Status::ok();
}

std::string indexPath(const std::string& dir) {
  return (std::filesystem::path(dir) / kShardedIndexFile).string();
}

// The step of the index in `dir`, or nullopt when there is none or it cannot be read.
std::optional<int64_t> currentStep(const std::string& dir) {
  std::ifstream in(indexPath(dir), std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = json::parse(ss.str());
  if (!j || !j->is_object() || !j->contains("step")) return std::nullopt;
  return json::asInt64((*j)["step"]);
}

Status writeIndex(const std::string& dir, int64_t step, int ranks, const std::vector<PlannedTensor>& tensors,
                  const std::map<std::string, std::string>& metadata) {
  json::Json index = json::Json::object();
  json::appendMember(index, "format", kFormat);
  json::appendMember(index, "version", kVersion);
  json::appendMember(index, "step", step);
  json::appendMember(index, "ranks", ranks);
  json::Json meta = json::Json::object();
  for (const auto& [k, v] : metadata) json::appendMember(meta, k, v);
  json::appendMember(index, "metadata", std::move(meta));
  json::Json list = json::Json::array();
  for (const PlannedTensor& t : tensors) {
    json::Json pieces = json::Json::array();
    for (const PlannedPiece& p : t.pieces)
      pieces.push_back({{"file", shardFileName(step, p.rank)},
                        {"name", p.file_name},
                        {"offset", toJson(p.offset)},
                        {"extent", toJson(p.extent)}});
    list.push_back({{"name", t.name},
                    {"dtype", safetensorsDType(t.dtype)},
                    {"shape", toJson(t.shape)},
                    {"pieces", std::move(pieces)}});
  }
  json::appendMember(index, "tensors", std::move(list));
  auto text = json::dump(index);
  if (!text)
    return Status::errorf("sharded checkpoint index '{}': {}", indexPath(dir), text.status().message());
  return writeFileAtomically(indexPath(dir), text.take() + "\n");
}

// Removes the shard files that `keep` does not name, and the temporary files of interrupted
// writes (of shards and of the index).
// Failing to remove one leaves a stray file, not a broken checkpoint, so it is not an error.
void removeOrphans(const std::string& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool shard = name.rfind("shard-", 0) == 0 &&
                       (name.size() > 12 && (name.compare(name.size() - 12, 12, ".safetensors") == 0 ||
                                             name.find(".safetensors.tmp.") != std::string::npos));
    const bool index_temp = name.rfind(std::string(kShardedIndexFile) + ".tmp.", 0) == 0;
    if ((shard && !keep.count(name)) || index_temp) std::filesystem::remove(entry.path(), ec);
  }
}

}  // namespace

std::string shardFileName(int64_t step, int rank) {
  return fmt::format("shard-{:08d}-r{:04d}.safetensors", step, rank);
}

Status saveShardedCheckpoint(comm::Communicator& comm, const std::string& dir, int64_t step,
                             const std::vector<LocalPiece>& pieces,
                             const std::map<std::string, std::string>& metadata) {
  const int rank = comm.rank();
  Status local = checkLocalPieces(pieces, rank);
  if (local && step < 0) local = Status::errorf("sharded checkpoint: step {} is negative", step);
  if (local && rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || !std::filesystem::is_directory(dir, ec))
      local = Status::errorf("cannot use '{}' as a checkpoint directory: {}", dir,
                             ec ? ec.message() : std::string("it is not a directory"));
    else if (currentStep(dir) == step)
      local = Status::errorf(
          "sharded checkpoint '{}' already holds step {}: its shard files are the ones its index "
          "names, so they cannot be rewritten in place",
          dir, step);
  }
  KILN_RETURN_IF_ERROR(agree(comm, local, "to prepare the checkpoint"));

  // Every rank plans from every rank's descriptions, so a bad layout fails everywhere alike,
  // before any file is written.
  KILN_ASSIGN_OR_RETURN(auto descriptions, allGatherText(comm, describePieces(pieces)));
  KILN_ASSIGN_OR_RETURN(auto plan, planSave(descriptions));

  std::vector<std::pair<std::string, ir::TensorView>> mine;
  for (const PlannedTensor& t : plan)
    for (const PlannedPiece& p : t.pieces)
      if (p.rank == rank) mine.emplace_back(p.file_name, pieces[p.local_index].view);
  Status wrote;
  if (!mine.empty())
    wrote = saveCheckpoint((std::filesystem::path(dir) / shardFileName(step, rank)).string(), mine,
                           {{"step", std::to_string(step)}, {"rank", std::to_string(rank)}});
  // The barrier the index waits for: after it every shard file is renamed into place and fsynced.
  KILN_RETURN_IF_ERROR(agree(comm, wrote, "to write its shard file"));

  Status indexed;
  if (rank == 0) {
    indexed = writeIndex(dir, step, comm.size(), plan, metadata);
    if (indexed) {
      std::set<std::string> keep;
      for (const PlannedTensor& t : plan)
        for (const PlannedPiece& p : t.pieces) keep.insert(shardFileName(step, p.rank));
      removeOrphans(dir, keep);
    }
  }
  return agree(comm, indexed, "to write the index");
}

// --- Reading.

bool ShardedCheckpoint::isShardedDir(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(indexPath(dir), ec);
}

const GlobalTensor* ShardedCheckpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Expected<ShardedCheckpoint> ShardedCheckpoint::open(const std::string& dir) {
  const std::string path = indexPath(dir);
  auto fail = [&](const std::string& msg) {
    return Status::errorf("sharded checkpoint index '{}': {}", path, msg);
  };
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("cannot open sharded checkpoint index '{}': {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  auto parsed = json::parse(ss.str());
  if (!parsed) return fail(parsed.status().message());
  const json::Json& j = *parsed;
  if (!j.is_object()) return fail("not a JSON object");
  if (!j.contains("format") || j["format"] != kFormat)
    return fail(fmt::format("'format' is not \"{}\"", kFormat));
  if (!j.contains("version") || json::asInt64(j["version"]) != kVersion)
    return fail(fmt::format("unsupported 'version' (this build reads version {})", kVersion));

  ShardedCheckpoint ck;
  ck.dir_ = dir;
  const int64_t step = j.contains("step") ? json::asInt64(j["step"]).value_or(-1) : -1;
  const int64_t ranks = j.contains("ranks") ? json::asInt64(j["ranks"]).value_or(0) : 0;
  if (step < 0) return fail("'step' must be a non-negative integer");
  if (ranks < 1 || ranks > (1 << 20)) return fail("'ranks' must be a positive integer");
  ck.step_ = step;
  ck.ranks_ = static_cast<int>(ranks);
  if (j.contains("metadata")) {
    if (!j["metadata"].is_object()) return fail("'metadata' must be an object of strings");
    for (const auto& [k, v] : j["metadata"].items()) {
      if (!v.is_string()) return fail(fmt::format("metadata '{}' must be a string", k));
      ck.metadata_[k] = v.get<std::string>();
    }
  }
  if (!j.contains("tensors") || !j["tensors"].is_array()) return fail("missing array 'tensors'");
  for (const json::Json& t : j["tensors"]) {
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
      return fail("every entry of 'tensors' needs a string 'name'");
    GlobalTensor g;
    g.name = t["name"].get<std::string>();
    auto bad = [&](const std::string& msg) { return fail(fmt::format("tensor '{}': {}", g.name, msg)); };
    if (ck.by_name_.count(g.name)) return bad("listed twice");
    auto dtype = t.contains("dtype") && t["dtype"].is_string()
                     ? parseSafetensorsDType(t["dtype"].get<std::string>())
                     : std::nullopt;
    if (!dtype) return bad("missing or unsupported 'dtype'");
    g.dtype = *dtype;
    auto shape = t.contains("shape") ? intArray(t["shape"]) : std::nullopt;
    if (!shape || std::any_of(shape->begin(), shape->end(), [](int64_t d) { return d < 0; }))
      return bad("'shape' must be an array of non-negative integers");
    g.shape = *shape;
    if (!t.contains("pieces") || !t["pieces"].is_array()) return bad("missing array 'pieces'");
    std::vector<Box> boxes;
    for (const json::Json& p : t["pieces"]) {
      ShardPiece piece;
      if (!p.is_object() || !p.contains("file") || !p["file"].is_string() || !p.contains("name") ||
          !p["name"].is_string())
        return bad("every piece needs a string 'file' and 'name'");
      piece.file = p["file"].get<std::string>();
      piece.name = p["name"].get<std::string>();
      // Files live in the checkpoint directory: a path elsewhere is refused, not followed.
      if (piece.file.empty() || piece.file == "." || piece.file == ".." ||
          piece.file.find('/') != std::string::npos)
        return bad(fmt::format("the piece file '{}' is not a file name inside the directory", piece.file));
      auto offset = p.contains("offset") ? intArray(p["offset"]) : std::nullopt;
      auto extent = p.contains("extent") ? intArray(p["extent"]) : std::nullopt;
      if (!offset || !extent)
        return bad(fmt::format("the piece in '{}' needs integer arrays 'offset' and 'extent'", piece.file));
      piece.offset = *offset;
      piece.extent = *extent;
      boxes.push_back({piece.offset, piece.extent, fmt::format("in '{}'", piece.file)});
      g.pieces.push_back(std::move(piece));
    }
    KILN_RETURN_IF_ERROR(
        checkTiling(fmt::format("sharded checkpoint index '{}': tensor '{}'", path, g.name), g.shape, boxes));
    ck.by_name_[g.name] = ck.tensors_.size();
    ck.tensors_.push_back(std::move(g));
  }

  // Every shard file the index names, checked against it.
  for (const GlobalTensor& g : ck.tensors_) {
    for (const ShardPiece& p : g.pieces) {
      const std::string file = (std::filesystem::path(dir) / p.file).string();
      auto it = ck.headers_.find(p.file);
      if (it == ck.headers_.end()) {
        std::error_code ec;
        if (!std::filesystem::exists(file, ec))
          return Status::errorf(
              "sharded checkpoint '{}': the shard file '{}' (a piece of tensor '{}') is missing", dir, file,
              g.name);
        KILN_ASSIGN_OR_RETURN(auto header, readCheckpointHeader(file));
        it = ck.headers_.emplace(p.file, std::move(header)).first;
      }
      const CheckpointEntry* e = it->second.find(p.name);
      if (!e)
        return Status::errorf("checkpoint '{}': no tensor '{}', which the index names as a piece of '{}'",
                              file, p.name, g.name);
      if (e->dtype != g.dtype || e->shape != p.extent)
        return Status::errorf(
            "checkpoint '{}': tensor '{}' is {} {} but the index says its piece of '{}' is {} {}", file,
            p.name, safetensorsDType(e->dtype), dimsText(e->shape), g.name, safetensorsDType(g.dtype),
            dimsText(p.extent));
    }
  }
  return ck;
}

Status ShardedCheckpoint::readSlice(const std::string& name, const std::vector<int64_t>& offset,
                                    const ir::TensorView& dst) const {
  const GlobalTensor* g = find(name);
  if (!g) return Status::errorf("sharded checkpoint '{}': no tensor '{}'", dir_, name);
  const std::vector<int64_t>& extent = dst.shape;
  const size_t rank = g->shape.size();
  if (dst.dtype != g->dtype)
    return Status::errorf("sharded checkpoint '{}': tensor '{}' is {}, not {}", dir_, name,
                          safetensorsDType(g->dtype), safetensorsDType(dst.dtype));
  bool inside = offset.size() == rank && extent.size() == rank;
  for (size_t d = 0; inside && d < rank; ++d)
    inside =
        offset[d] >= 0 && extent[d] >= 0 && offset[d] <= g->shape[d] && extent[d] <= g->shape[d] - offset[d];
  if (!inside)
    return Status::errorf(
        "sharded checkpoint '{}': the slice at {} of extent {} lies outside tensor '{}' of shape {}", dir_,
        dimsText(offset), dimsText(extent), name, dimsText(g->shape));
  if (volume(extent).value_or(0) == 0) return Status::ok();
  const uint64_t esz = static_cast<uint64_t>(ir::dtypeBytes(g->dtype));

  for (const ShardPiece& p : g->pieces) {
    std::vector<int64_t> lo(rank), hi(rank);
    bool empty = false;
    for (size_t d = 0; d < rank; ++d) {
      lo[d] = std::max(offset[d], p.offset[d]);
      hi[d] = std::min(offset[d] + extent[d], p.offset[d] + p.extent[d]);
      empty = empty || lo[d] >= hi[d];
    }
    if (empty) continue;
    // Runs contiguous in both the piece and the slice: the trailing dims the intersection spans
    // whole in both, plus the first dim it does not.
    size_t k = rank == 0 ? 0 : rank - 1;
    auto whole = [&](size_t d) { return hi[d] - lo[d] == p.extent[d] && hi[d] - lo[d] == extent[d]; };
    while (k > 0 && whole(k)) --k;
    uint64_t run = 1;
    for (size_t d = k; d < rank; ++d) run *= static_cast<uint64_t>(hi[d] - lo[d]);
    const uint64_t run_bytes = run * esz;
    // Row-major strides of the piece and of the slice, in elements.
    std::vector<uint64_t> src_stride(rank, 1), dst_stride(rank, 1);
    for (size_t d = rank; d-- > 1;) {
      src_stride[d - 1] = src_stride[d] * static_cast<uint64_t>(p.extent[d]);
      dst_stride[d - 1] = dst_stride[d] * static_cast<uint64_t>(extent[d]);
    }
    const CheckpointEntry* e = headers_.at(p.file).find(p.name);
    const std::string file = (std::filesystem::path(dir_) / p.file).string();
    // The runs come in row-major order of the dims before k, so their source offsets increase;
    // neighbours are read together, a batch at a time (bounded, however many rows a slice has).
    struct Run {
      uint64_t src, dst;  // byte offsets into the piece's data and into dst
    };
    char* out = static_cast<char*>(dst.data);
    std::vector<Run> batch;
    std::vector<char> buf;
    auto flush = [&]() -> Status {
      if (batch.empty()) return Status::ok();
      const uint64_t span = batch.back().src + run_bytes - batch.front().src;
      buf.resize(span);
      KILN_RETURN_IF_ERROR(
          readCheckpointBytes(file, e->file_offset + batch.front().src, span, buf.data(), p.name));
      for (const Run& r : batch)
        std::memcpy(out + r.dst, buf.data() + (r.src - batch.front().src), run_bytes);
      batch.clear();
      return Status::ok();
    };
    std::vector<int64_t> at(lo.begin(), lo.end());
    for (;;) {
      uint64_t s = 0, t = 0;
      for (size_t d = 0; d < rank; ++d) {
        s += static_cast<uint64_t>(at[d] - p.offset[d]) * src_stride[d];
        t += static_cast<uint64_t>(at[d] - offset[d]) * dst_stride[d];
      }
      const Run r{s * esz, t * esz};
      if (run_bytes >= kReadChunkBytes / 4) {  // a large run goes straight into place
        KILN_RETURN_IF_ERROR(
            readCheckpointBytes(file, e->file_offset + r.src, run_bytes, out + r.dst, p.name));
      } else {
        if (!batch.empty() &&
            (r.src + run_bytes - batch.front().src > kReadChunkBytes || batch.size() >= 65536))
          KILN_RETURN_IF_ERROR(flush());
        batch.push_back(r);
      }
      // The next index over the dims before k.
      bool done = true;
      for (size_t d = k; d > 0;) {
        --d;
        if (++at[d] < hi[d]) {
          done = false;
          break;
        }
        at[d] = lo[d];
      }
      if (done) break;
    }
    KILN_RETURN_IF_ERROR(flush());
  }
  return Status::ok();
}

Expected<ir::HostTensor> ShardedCheckpoint::loadSlice(const std::string& name,
                                                      const std::vector<int64_t>& offset,
                                                      const std::vector<int64_t>& extent) const {
  const GlobalTensor* g = find(name);
  if (!g) return Status::errorf("sharded checkpoint '{}': no tensor '{}'", dir_, name);
  if (!volume(extent))
    return Status::errorf("sharded checkpoint '{}': a slice of extent {} of tensor '{}'", dir_,
                          dimsText(extent), name);
  ir::HostTensor t;
  // Checked against the tensor before any allocation: a slice is at most the tensor.
  bool inside = offset.size() == g->shape.size() && extent.size() == g->shape.size();
  for (size_t d = 0; inside && d < extent.size(); ++d)
    inside = offset[d] >= 0 && extent[d] <= g->shape[d] - offset[d] && offset[d] <= g->shape[d];
  if (!inside)
    return Status::errorf(
        "sharded checkpoint '{}': the slice at {} of extent {} lies outside tensor '{}' of shape {}", dir_,
        dimsText(offset), dimsText(extent), name, dimsText(g->shape));
  t.reset(g->dtype, extent);
  KILN_RETURN_IF_ERROR(readSlice(name, offset, t.view));
  return t;
}

Expected<Checkpoint> ShardedCheckpoint::merge() const {
  Checkpoint out;
  out.metadata = metadata_;
  for (const GlobalTensor& g : tensors_) {
    KILN_ASSIGN_OR_RETURN(auto t, loadSlice(g.name, std::vector<int64_t>(g.shape.size(), 0), g.shape));
    out.tensors.emplace_back(g.name, std::move(t));
  }
  return out;
}

}  // namespace kiln::runtime
