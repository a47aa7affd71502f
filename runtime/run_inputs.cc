#include "runtime/run_inputs.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <vector>

#include "runtime/json.h"

namespace kiln::runtime {
namespace {

constexpr const char* kSynthetic = "synthetic";

Expected<DataFileId> identify(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::errorf("cannot open data file '{}': {}", path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0)
    return Status::errorf("cannot stat data file '{}': {}", path, std::strerror(errno));
  if (S_ISDIR(st.st_mode)) return Status::errorf("'{}' is a directory, not a data file", path);
  DataFileId id{path, static_cast<uint64_t>(st.st_size), 0};
  std::vector<char> head(static_cast<size_t>(std::min<uint64_t>(id.size, RunInputs::kHeadBytes)));
  size_t got = 0;
  while (got < head.size()) {
    ssize_t r = ::pread(fd, head.data() + got, head.size() - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::errorf("cannot read data file '{}': {}", path, std::strerror(errno));
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  id.head_hash = fnv1a64(head.data(), got);
  return id;
}

template <typename T>
Expected<T> parseNumber(const std::map<std::string, std::string>& meta, const char* key) {
  auto it = meta.find(key);
  if (it == meta.end()) return Status::errorf("the checkpoint metadata has no '{}'", key);
  T v{};
  const std::string& s = it->second;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc::result_out_of_range)
    return Status::errorf("'{}' in the checkpoint metadata is out of range: '{}'", key, s);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty())
    return Status::errorf("bad '{}' in the checkpoint metadata: '{}'", key, s);
  return v;
}

std::string fileText(const DataFileId& f) {
  return fmt::format("'{}' ({} bytes, first block {:016x})", f.path, f.size, f.head_hash);
}

}  // namespace

Expected<RunInputs> RunInputs::describe(const std::string& model, uint64_t seed, int64_t batch,
                                        const std::vector<std::string>& data) {
  RunInputs r;
  r.model = model;
  r.seed = seed;
  r.batch = batch;
  r.synthetic = data.size() == 1 && data[0] == kSynthetic;
  if (!r.synthetic)
    for (const std::string& path : data) {
      KILN_ASSIGN_OR_RETURN(DataFileId id, identify(path));
      r.files.push_back(std::move(id));
    }
  return r;
}

void RunInputs::toMetadata(std::map<std::string, std::string>& meta) const {
  meta["model"] = model;
  meta["seed"] = std::to_string(seed);
  meta["batch"] = std::to_string(batch);
  json::Json list = json::Json::array();
  if (synthetic) list.push_back(kSynthetic);
  for (const DataFileId& f : files)
    list.push_back(
        {{"path", f.path}, {"size", f.size}, {"head_fnv1a64", fmt::format("{:016x}", f.head_hash)}});
  // Paths come from the command line; one that is not UTF-8 cannot be JSON. Record what can be
  // recorded: the size and hash still identify the file.
  auto text = json::dump(list);
  meta["data_files"] = text ? text.take() : "[]";
}

Expected<RunInputs> RunInputs::fromMetadata(const std::map<std::string, std::string>& meta,
                                            bool* files_recorded) {
  RunInputs r;
  if (auto it = meta.find("model"); it != meta.end()) r.model = it->second;
  KILN_ASSIGN_OR_RETURN(r.seed, parseNumber<uint64_t>(meta, "seed"));
  KILN_ASSIGN_OR_RETURN(r.batch, parseNumber<int64_t>(meta, "batch"));
  auto it = meta.find("data_files");
  *files_recorded = it != meta.end();
  if (!*files_recorded) return r;
  auto parsed = json::parse(it->second);
  auto bad = [&](const std::string& why) {
    return Status::errorf("bad 'data_files' in the checkpoint metadata: {}", why);
  };
  if (!parsed) return bad(parsed.status().message());
  if (!parsed->is_array()) return bad("not an array");
  for (const json::Json& f : *parsed) {
    if (f.is_string() && f.get<std::string>() == kSynthetic) {
      r.synthetic = true;
      continue;
    }
    if (!f.is_object() || !f.contains("path") || !f["path"].is_string() || !f.contains("size") ||
        !f["size"].is_number_unsigned() || !f.contains("head_fnv1a64") || !f["head_fnv1a64"].is_string())
      return bad("an entry is not {path, size, head_fnv1a64}");
    DataFileId id;
    id.path = f["path"].get<std::string>();
    id.size = f["size"].get<uint64_t>();
    const std::string hash = f["head_fnv1a64"].get<std::string>();
    auto [end, ec] = std::from_chars(hash.data(), hash.data() + hash.size(), id.head_hash, 16);
    if (ec != std::errc() || end != hash.data() + hash.size()) return bad(fmt::format("bad hash '{}'", hash));
    r.files.push_back(std::move(id));
  }
  return r;
}

bool sameData(const RunInputs& a, const RunInputs& b) {
  auto sameFile = [](const DataFileId& x, const DataFileId& y) {
    return x.size == y.size && x.head_hash == y.head_hash;
  };
  return a.synthetic == b.synthetic &&
         std::equal(a.files.begin(), a.files.end(), b.files.begin(), b.files.end(), sameFile);
}

std::vector<std::string> compareRunInputs(const RunInputs& saved, const RunInputs& now) {
  std::vector<std::string> diffs;
  if (saved.model != now.model)
    diffs.push_back(fmt::format("the model is '{}', the checkpoint's is '{}'", now.model, saved.model));
  if (saved.seed != now.seed)
    diffs.push_back(fmt::format("the seed is {}, the checkpoint's is {}", now.seed, saved.seed));
  if (saved.batch != now.batch)
    diffs.push_back(fmt::format("the batch is {}, the checkpoint's is {}", now.batch, saved.batch));
  if (saved.synthetic != now.synthetic) {
    diffs.push_back(now.synthetic ? "the data is synthetic, the checkpoint's was read from files"
                                  : "the data is read from files, the checkpoint's was synthetic");
    return diffs;
  }
  if (saved.files.size() != now.files.size()) {
    diffs.push_back(fmt::format("{} data files are given, the checkpoint's run read {}", now.files.size(),
                                saved.files.size()));
    return diffs;
  }
  for (size_t i = 0; i < now.files.size(); ++i) {
    const DataFileId &a = saved.files[i], &b = now.files[i];
    if (a.size != b.size || a.head_hash != b.head_hash)
      diffs.push_back(
          fmt::format("data file {} is {}, the checkpoint's was {}", i + 1, fileText(b), fileText(a)));
  }
  return diffs;
}

}  // namespace kiln::runtime
