#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>

#include "runtime/json.h"
#include "runtime/stop_signals.h"

namespace kiln::runtime {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; add byte swaps");

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // safetensors' own limit

struct DTypeName {
  ir::DType dtype;
  std::string_view name;
};
constexpr DTypeName kDTypes[] = {
    {ir::DType::f32, "F32"},         {ir::DType::f16, "F16"},         {ir::DType::bf16, "BF16"},
    {ir::DType::f64, "F64"},         {ir::DType::i32, "I32"},         {ir::DType::i64, "I64"},
    {ir::DType::i1, "BOOL"},         {ir::DType::f8e4m3, "F8_E4M3"},  {ir::DType::f8e5m2, "F8_E5M2"},
};

std::string shapeText(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

Status writeAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::errorf("cannot write '{}': {}", path, std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::ok();
}

// Writes a file through `write` into a temporary file next to `path` (so the rename stays within
// one file system), fsyncs it, renames it into place and fsyncs the folder.
Status writeAtomically(const std::string& path,
                       const std::function<Status(int fd, const std::string& tmp)>& write) {
  std::filesystem::path target(path);
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  // A second SIGINT/SIGTERM while this is written removes it (a first one lets it finish).
  PendingTempFile pending(tmp);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::errorf("cannot create '{}': {}", tmp, std::strerror(errno));
  Status st = write(fd, tmp);
  if (st && ::fsync(fd) != 0) st = Status::errorf("cannot fsync '{}': {}", tmp, std::strerror(errno));
  if (::close(fd) != 0 && st) st = Status::errorf("cannot close '{}': {}", tmp, std::strerror(errno));
  if (st && std::rename(tmp.c_str(), path.c_str()) != 0)
    st = Status::errorf("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(errno));
  if (!st) {
    ::unlink(tmp.c_str());
    return st;
  }
  // Make the rename itself durable.
  std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::ok();
}

}  // namespace

std::string_view safetensorsDType(ir::DType t) {
  for (const auto& d : kDTypes)
    if (d.dtype == t) return d.name;
  return "?";
}

std::optional<ir::DType> parseSafetensorsDType(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

const CheckpointEntry* CheckpointHeader::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const ir::HostTensor* Checkpoint::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

Status prepareCheckpointDir(const std::string& dir, uint64_t reserve_bytes) {
  const std::string where = dir.empty() ? "." : dir;
  std::error_code ec;
  std::filesystem::create_directories(where, ec);
  if (ec || !std::filesystem::is_directory(where, ec))
    return Status::errorf("cannot use '{}' as a checkpoint directory: {}", where,
                          ec ? ec.message() : std::string("it is not a directory"));
  const std::string probe =
      (std::filesystem::path(where) / (".kiln-write-test." + std::to_string(::getpid()))).string();
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return Status::errorf("cannot write into checkpoint directory '{}': {}", where, std::strerror(errno));
  // posix_fallocate reserves real blocks (glibc writes them where the file system cannot), so a
  // disk without room for a checkpoint, or a file size limit (ulimit -f) below one, fails here.
  const off_t reserve =
      static_cast<off_t>(std::min<uint64_t>(std::max<uint64_t>(reserve_bytes, 1), INT64_MAX));
  const int err = ::posix_fallocate(fd, 0, reserve);
  ::close(fd);
  ::unlink(probe.c_str());
  if (err != 0)
    return Status::errorf("cannot write a checkpoint of {} bytes into '{}': {}", reserve_bytes, where,
                          std::strerror(err));
  return Status::ok();
}

namespace {

// The safetensors header of `tensors` laid out in order: its JSON, padded so that the data starts
// 8-byte aligned. `what` names the checkpoint in errors.
Expected<std::string> checkpointHeader(const std::vector<std::pair<std::string, ir::TensorView>>& tensors,
                                       const std::map<std::string, std::string>& metadata,
                                       const std::string& what) {
  json::Json header = json::Json::object();
  json::Json& meta = header["__metadata__"] = json::Json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  std::set<std::string_view> names = {"__metadata__"};
  int64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    if (!names.insert(name).second)
      return Status::errorf("checkpoint '{}': duplicate or reserved tensor name '{}'", what, name);
    json::Json shape = json::Json::array();
    for (int64_t d : view.shape) shape.push_back(d);
    json::appendMember(header, name,
                       {{"dtype", safetensorsDType(view.dtype)},
                        {"shape", std::move(shape)},
                        {"data_offsets", {offset, offset + view.bytes()}}});
    offset += view.bytes();
  }
  auto dumped = json::dump(header);
  if (!dumped) return Status::errorf("checkpoint '{}': {}", what, dumped.status().message());
  std::string text = dumped.take();
  text.append((8 - text.size() % 8) % 8, ' ');  // pad so the data starts 8-byte aligned
  return text;
}

}  // namespace

Status saveCheckpoint(const std::string& path,
                      const std::vector<std::pair<std::string, ir::TensorView>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  KILN_ASSIGN_OR_RETURN(std::string text, checkpointHeader(tensors, metadata, path));
  uint64_t n = text.size();
  return writeAtomically(path, [&](int fd, const std::string& tmp) {
    Status st = writeAll(fd, &n, 8, tmp);
    if (st) st = writeAll(fd, text.data(), text.size(), tmp);
    for (size_t i = 0; st && i < tensors.size(); ++i)
      st = writeAll(fd, tensors[i].second.data, static_cast<size_t>(tensors[i].second.bytes()), tmp);
    return st;
  });
}

Expected<std::vector<uint8_t>> serializeCheckpoint(
    const std::vector<std::pair<std::string, ir::TensorView>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  KILN_ASSIGN_OR_RETURN(std::string text, checkpointHeader(tensors, metadata, "in memory"));
  const uint64_t n = text.size();
  size_t total = 8 + text.size();
  for (const auto& [name, view] : tensors) total += static_cast<size_t>(view.bytes());
  std::vector<uint8_t> out(total);
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, text.data(), text.size());
  size_t at = 8 + text.size();
  for (const auto& [name, view] : tensors) {
    if (view.bytes()) std::memcpy(out.data() + at, view.data, static_cast<size_t>(view.bytes()));
    at += static_cast<size_t>(view.bytes());
  }
  return out;
}

Status writeFileAtomically(const std::string& path, std::string_view bytes) {
  return writeAtomically(
      path, [&](int fd, const std::string& tmp) { return writeAll(fd, bytes.data(), bytes.size(), tmp); });
}

namespace {

Status checkpointError(const std::string& name, const std::string& msg) {
  return Status::errorf("checkpoint '{}': {}", name, msg);
}

// Checks the header length `n` read from the first 8 bytes of a file of `size` bytes.
Status checkHeaderLength(uint64_t n, uint64_t size, const std::string& name) {
  if (n > kMaxHeaderBytes)
    return checkpointError(name, fmt::format("header length {} is implausible (corrupt file?)", n));
  if (n > size - 8)
    return checkpointError(
        name, fmt::format("truncated: the header needs {} bytes but the file has {} after the length", n,
                          size - 8));
  return Status::ok();
}

// Where a tensor's bytes lie in the data section.
struct Span {
  uint64_t begin, end;
  size_t index;  // into Checkpoint::tensors
};

// Validates the JSON header `text` of a file with `data_bytes` bytes of data after it. Returns
// the metadata and the tensors (allocated, zero-filled) and sets `spans` to where their data
// lies, in file order. No tensor storage is allocated before the spans are known to tile the
// data, so a header claiming the same bytes for many tensors cannot make us allocate many times
// the file's size.
// With `allocate` false the tensors get their dtype and shape but no storage (a header read).
Expected<Checkpoint> parseHeader(std::string_view text, uint64_t data_bytes, const std::string& name,
                                 std::vector<Span>& spans, bool allocate = true) {
  auto fail = [&](const std::string& msg) { return checkpointError(name, msg); };
  auto header = json::parse(text);
  if (!header) return fail("bad header: " + header.status().message());
  if (!header->is_object()) return fail("bad header: not a JSON object");

  Checkpoint ckpt;
  std::vector<std::pair<ir::DType, std::vector<int64_t>>> types;  // of each tensor, allocated last
  spans.clear();
  for (const auto& item : header->items()) {
    // Named references, not a structured binding: clang (the fuzz build) cannot capture those.
    const std::string& tensor_name = item.key();
    const json::Json& entry = item.value();
    if (tensor_name == "__metadata__") {
      if (!entry.is_object()) return fail("'__metadata__' must be an object of strings");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return fail(fmt::format("metadata '{}' must be a string", k));
        ckpt.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& msg) { return fail(fmt::format("tensor '{}': {}", tensor_name, msg)); };
    if (!entry.is_object()) return bad("entry is not an object");
    auto member = [&](const char* key) -> const json::Json* {
      auto it = entry.find(key);
      return it == entry.end() ? nullptr : &*it;
    };
    const json::Json* dt = member("dtype");
    const json::Json* shape = member("shape");
    const json::Json* offs = member("data_offsets");
    if (!dt || !dt->is_string()) return bad("missing string 'dtype'");
    const std::string& dtype_name = dt->get_ref<const std::string&>();
    auto dtype = parseSafetensorsDType(dtype_name);
    if (!dtype) return bad(fmt::format("unsupported dtype '{}'", dtype_name));
    if (!shape || !shape->is_array()) return bad("missing array 'shape'");
    std::vector<int64_t> dims;
    for (const json::Json& d : *shape) {
      std::optional<int64_t> dim = json::asInt64(d);
      if (!dim || *dim < 0) return bad("shape entries must be non-negative integers");
      dims.push_back(*dim);
    }
    auto too_large = [&] { return bad(fmt::format("shape [{}] is impossibly large", fmt::join(dims, ","))); };
    uint64_t numel = 1;
    for (int64_t d : dims)
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) return too_large();
    std::optional<int64_t> begin, end;
    if (offs && offs->is_array() && offs->size() == 2)
      begin = json::asInt64((*offs)[0]), end = json::asInt64((*offs)[1]);
    if (!begin || !end) return bad("'data_offsets' must be [begin, end]");
    int64_t b = *begin, e = *end;
    if (b < 0 || e < b) return bad(fmt::format("bad data_offsets [{}, {}]", b, e));
    if (static_cast<uint64_t>(e) > data_bytes)
      return bad(fmt::format("data_offsets [{}, {}] run past the {} data bytes (truncated file?)", b, e, data_bytes));
    uint64_t want = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(ir::dtypeBytes(*dtype)), &want))
      return too_large();
    if (static_cast<uint64_t>(e - b) != want)
      return bad(fmt::format("data_offsets [{}, {}] hold {} bytes but {} {} needs {}", b, e, e - b,
                             dtype_name, shapeText(dims), want));
    spans.push_back({static_cast<uint64_t>(b), static_cast<uint64_t>(e), ckpt.tensors.size()});
    ckpt.tensors.emplace_back(tensor_name, ir::HostTensor());
    types.emplace_back(*dtype, std::move(dims));
  }
  std::vector<Span> sorted = spans;
  std::sort(sorted.begin(), sorted.end(), [](const Span& x, const Span& y) {
    return x.begin < y.begin || (x.begin == y.begin && x.end < y.end);
  });
  uint64_t at = 0;
  for (const Span& s : sorted) {
    const std::string& tensor_name = ckpt.tensors[s.index].first;
    if (s.begin < at)
      return fail(fmt::format("tensor '{}': its data overlaps another tensor's", tensor_name));
    if (s.begin > at)
      return fail(fmt::format("tensor '{}': a gap of {} bytes before its data", tensor_name, s.begin - at));
    at = s.end;
  }
  if (at != data_bytes) return fail(fmt::format("{} bytes of data follow the last tensor", data_bytes - at));
  for (size_t i = 0; i < types.size(); ++i) {
    ir::HostTensor& t = ckpt.tensors[i].second;
    if (allocate) {
      t.reset(types[i].first, std::move(types[i].second));
    } else {
      t.view.dtype = types[i].first;
      t.view.shape = std::move(types[i].second);
    }
  }
  return ckpt;
}

// The header length in the first 8 bytes of a checkpoint of `size` bytes held in memory, checked.
Expected<uint64_t> headerLengthOf(const void* data, uint64_t size, const std::string& name) {
  if (size < 8)
    return checkpointError(name,
                           fmt::format("truncated: {} bytes, too short for the 8-byte header length", size));
  uint64_t n = 0;
  std::memcpy(&n, data, 8);
  KILN_RETURN_IF_ERROR(checkHeaderLength(n, size, name));
  return n;
}

}  // namespace

Expected<Checkpoint> parseCheckpoint(std::string_view bytes, const std::string& name) {
  const uint64_t size = bytes.size();
  KILN_ASSIGN_OR_RETURN(const uint64_t n, headerLengthOf(bytes.data(), size, name));
  std::vector<Span> spans;
  KILN_ASSIGN_OR_RETURN(auto ckpt, parseHeader(bytes.substr(8, n), size - 8 - n, name, spans));
  for (const Span& s : spans)
    if (s.end > s.begin)  // an empty tensor's storage may have no address
      std::memcpy(ckpt.tensors[s.index].second.storage.data(), bytes.data() + 8 + n + s.begin,
                  s.end - s.begin);
  return ckpt;
}

Expected<Checkpoint> viewCheckpoint(std::span<uint8_t> bytes, const std::string& name,
                                    std::shared_ptr<const void> keep_alive) {
  const uint64_t size = bytes.size();
  KILN_ASSIGN_OR_RETURN(const uint64_t n, headerLengthOf(bytes.data(), size, name));
  std::vector<Span> spans;
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, n);
  KILN_ASSIGN_OR_RETURN(auto ckpt, parseHeader(text, size - 8 - n, name, spans, /*allocate=*/false));
  for (const Span& s : spans) {
    auto& [tensor_name, t] = ckpt.tensors[s.index];
    uint8_t* data = bytes.data() + 8 + n + s.begin;
    if (reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(ir::dtypeBytes(t.view.dtype)) != 0)
      return checkpointError(name, fmt::format("tensor '{}' is not aligned to its {}-byte elements",
                                               tensor_name, ir::dtypeBytes(t.view.dtype)));
    t = ir::HostTensor::external(t.view.dtype, t.view.shape, data, keep_alive);
  }
  return ckpt;
}

namespace {

// An open checkpoint file whose header has been read and validated.
class CheckpointFile {
 public:
  ~CheckpointFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  Status open(const std::string& path, bool allocate) {
    path_ = path;
    // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer (a watcher of update
    // files hung so); it is refused below. Reads of a regular file ignore the flag.
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) return Status::errorf("cannot open checkpoint '{}': {}", path, std::strerror(errno));
    struct stat stt;
    if (::fstat(fd_, &stt) != 0) return Status::errorf("cannot stat '{}': {}", path, std::strerror(errno));
    if (!S_ISREG(stt.st_mode))
      return Status::errorf("checkpoint '{}' is not a regular file (a FIFO, a socket or a device): not read",
                            path);
    const uint64_t size = static_cast<uint64_t>(stt.st_size);
    if (size < 8)
      return checkpointError(
          path, fmt::format("truncated: {} bytes, too short for the 8-byte header length", size));
    uint64_t n = 0;
    KILN_RETURN_IF_ERROR(readAt(&n, 8, 0));
    KILN_RETURN_IF_ERROR(checkHeaderLength(n, size, path));
    std::string text(n, '\0');
    KILN_RETURN_IF_ERROR(readAt(text.data(), n, 8));
    data_start_ = 8 + n;
    KILN_ASSIGN_OR_RETURN(ckpt_, parseHeader(text, size - 8 - n, path, spans_, allocate));
    return Status::ok();
  }
  Status readAt(void* dst, uint64_t n, uint64_t at) const {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(at));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        return Status::errorf("cannot read checkpoint '{}': {}", path_,
                              r < 0 ? std::strerror(errno) : "unexpected end of file");
      p += r;
      n -= static_cast<uint64_t>(r);
      at += static_cast<uint64_t>(r);
    }
    return Status::ok();
  }

  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  Checkpoint ckpt_;
  std::vector<Span> spans_;
};

}  // namespace

Expected<Checkpoint> loadCheckpoint(const std::string& path) {
  // The header is read and checked first, then the data straight into the tensors: a
  // checkpoint is never held in memory twice.
  CheckpointFile f;
  KILN_RETURN_IF_ERROR(f.open(path, /*allocate=*/true));
  for (const Span& s : f.spans_)
    KILN_RETURN_IF_ERROR(
        f.readAt(f.ckpt_.tensors[s.index].second.storage.data(), s.end - s.begin, f.data_start_ + s.begin));
  return std::move(f.ckpt_);
}

Expected<CheckpointHeader> readCheckpointHeader(const std::string& path) {
  CheckpointFile f;
  KILN_RETURN_IF_ERROR(f.open(path, /*allocate=*/false));
  CheckpointHeader h;
  h.metadata = std::move(f.ckpt_.metadata);
  for (const Span& s : f.spans_) {
    auto& [name, t] = f.ckpt_.tensors[s.index];
    h.tensors.push_back({name, t.view.dtype, t.view.shape, f.data_start_ + s.begin, s.end - s.begin});
  }
  return h;
}

Status readCheckpointBytes(const std::string& path, uint64_t file_offset, uint64_t n, void* dst,
                           const std::string& what) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return Status::errorf("cannot open checkpoint '{}' (tensor '{}'): {}", path, what, std::strerror(errno));
  char* p = static_cast<char*>(dst);
  Status st;
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(file_offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      st = Status::errorf("cannot read checkpoint '{}' (tensor '{}'): {}", path, what,
                          r < 0 ? std::strerror(errno) : "unexpected end of file");
      break;
    }
    p += r;
    n -= static_cast<uint64_t>(r);
    file_offset += static_cast<uint64_t>(r);
  }
  ::close(fd);
  return st;
}

Status restoreTensors(const Checkpoint& ckpt, const std::map<std::string, ir::TensorView>& dest, const std::string& path) {
  for (const auto& [name, view] : dest) {
    const ir::HostTensor* t = ckpt.find(name);
    if (!t) return Status::errorf("checkpoint '{}': no tensor '{}', which the model needs", path, name);
    if (t->view.dtype != view.dtype || t->view.shape != view.shape)
      return Status::errorf("checkpoint '{}': tensor '{}' is {} {} but the model expects {} {}", path, name,
                            safetensorsDType(t->view.dtype), shapeText(t->view.shape), safetensorsDType(view.dtype),
                            shapeText(view.shape));
  }
  for (const auto& [name, t] : ckpt.tensors)
    if (!dest.count(name)) return Status::errorf("checkpoint '{}': tensor '{}' is not a parameter of the model", path, name);
  for (const auto& [name, view] : dest) std::memcpy(view.data, ckpt.find(name)->storage.data(), static_cast<size_t>(view.bytes()));
  return Status::ok();
}

Status copyRegion(const ir::TensorView& whole, const std::vector<int64_t>& offset,
                  const ir::TensorView& dst) {
  const size_t rank = whole.shape.size();
  if (dst.shape.size() != rank || offset.size() != rank || dst.dtype != whole.dtype)
    return Status::errorf("a {}-d region cannot be taken from a {}-d tensor", dst.shape.size(), rank);
  for (size_t d = 0; d < rank; ++d)
    if (offset[d] < 0 || offset[d] + dst.shape[d] > whole.shape[d])
      return Status::errorf("region at offset {} of extent {} leaves the tensor's shape {}",
                            fmt::join(offset, "x"), fmt::join(dst.shape, "x"), fmt::join(whole.shape, "x"));
  if (dst.numel() == 0) return Status::ok();
  const size_t elem = ir::dtypeBytes(whole.dtype);
  // Row by row along the last dim: `index` walks dst's outer dims.
  const int64_t inner = rank ? dst.shape[rank - 1] : 1;
  const int64_t rows = dst.numel() / inner;
  std::vector<int64_t> index(rank ? rank - 1 : 0, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t src = 0;
    for (size_t d = 0; d < rank; ++d) src = src * whole.shape[d] + offset[d] + (d + 1 < rank ? index[d] : 0);
    std::memcpy(static_cast<char*>(dst.data) + static_cast<size_t>(r * inner) * elem,
                static_cast<const char*>(whole.data) + static_cast<size_t>(src) * elem,
                static_cast<size_t>(inner) * elem);
    for (size_t d = index.size(); d-- > 0;) {
      if (++index[d] < dst.shape[d]) break;
      index[d] = 0;
    }
  }
  return Status::ok();
}

}  // namespace kiln::runtime
