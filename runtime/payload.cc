#include "runtime/payload.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

namespace kiln::runtime {
namespace {

constexpr char kHeaderMagic[8] = {'K', 'I', 'L', 'N', 'P', 'A', 'Y', 'L'};
constexpr char kFooterMagic[8] = {'K', 'I', 'L', 'N', 'E', 'N', 'D', '\1'};
constexpr size_t kFooterBytes = 8 + 8 + 8 + 4 + 8;
constexpr size_t kAlign = 64;

void put(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint64_t get(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// A bounds-checked reader over the table.
struct Cursor {
  const uint8_t* p;
  const uint8_t* end;
  bool take(size_t n, const uint8_t** at) {
    if (static_cast<size_t>(end - p) < n) return false;
    *at = p;
    p += n;
    return true;
  }
};

}  // namespace

namespace {

uint64_t mix(uint64_t h, uint64_t w) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  h ^= w;
  h *= kMul;
  return h ^ (h >> 31);
}

// Four independent lanes over 8-byte words, so the multiplies overlap.
uint64_t laneHash(const uint8_t* data, size_t size) {
  uint64_t lane[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                      0x082EFA98EC4E6C89ull};
  size_t i = 0;
  for (; i + 32 <= size; i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, data + i + 8 * l, 8);
      lane[l] = mix(lane[l], w);
    }
  uint64_t h = static_cast<uint64_t>(size);
  for (uint64_t l : lane) h = mix(h, l);
  for (; i < size; ++i) h = mix(h, data[i]);
  return h;
}

constexpr size_t kHashChunk = size_t{1} << 20;

}  // namespace

uint64_t payloadHash(const uint8_t* data, size_t size) {
  if (size <= kHashChunk) return laneHash(data, size);
  // A tree: the hash of the chunks' hashes. The chunks are hashed on several threads (a model's
  // weights are hundreds of megabytes, checked at start-up); the value does not depend on how many.
  const size_t chunks = (size + kHashChunk - 1) / kHashChunk;
  std::vector<uint64_t> hashes(chunks);
  const size_t threads = std::min<size_t>({chunks, std::max(1u, std::thread::hardware_concurrency()), 16});
  auto work = [&](size_t t) {
    for (size_t c = t; c < chunks; c += threads)
      hashes[c] = laneHash(data + c * kHashChunk, std::min(kHashChunk, size - c * kHashChunk));
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (std::thread& t : pool) t.join();
  return mix(laneHash(reinterpret_cast<const uint8_t*>(hashes.data()), hashes.size() * 8), size);
}

void PayloadWriter::add(std::string name, std::vector<uint8_t> bytes) {
  sections_.emplace_back(std::move(name), std::move(bytes));
}

void PayloadWriter::add(std::string name, std::string_view text) {
  add(std::move(name), std::vector<uint8_t>(text.begin(), text.end()));
}

std::vector<uint8_t> PayloadWriter::serialize(size_t* table_bytes_out) const {
  std::vector<uint8_t> table;
  table.insert(table.end(), kHeaderMagic, kHeaderMagic + 8);
  put(table, kPayloadVersion, 4);
  put(table, sections_.size(), 4);
  size_t table_bytes = table.size();
  for (const auto& [name, bytes] : sections_) table_bytes += 4 + name.size() + 24;
  uint64_t offset = (table_bytes + kAlign - 1) / kAlign * kAlign;
  std::vector<uint64_t> offsets;
  for (const auto& [name, bytes] : sections_) {
    put(table, name.size(), 4);
    table.insert(table.end(), name.begin(), name.end());
    put(table, offset, 8);
    put(table, bytes.size(), 8);
    put(table, payloadHash(bytes.data(), bytes.size()), 8);
    offsets.push_back(offset);
    offset = (offset + bytes.size() + kAlign - 1) / kAlign * kAlign;
  }
  if (table_bytes_out) *table_bytes_out = table.size();
  std::vector<uint8_t> out = std::move(table);
  for (size_t s = 0; s < sections_.size(); ++s) {
    out.resize(offsets[s], 0);
    out.insert(out.end(), sections_[s].second.begin(), sections_[s].second.end());
  }
  return out;
}

Status PayloadWriter::writeAppended(const std::string& runner, const std::string& out_path,
                                    bool executable) const {
  std::ifstream in(runner, std::ios::binary);
  if (!in) return Status::errorf("cannot read the runner {}: {}", runner, std::strerror(errno));
  std::vector<uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The runner itself may carry a payload (a compiled model used as the runner): drop it.
  if (auto old = Payload::open(runner)) file.resize(file.size() - old->size() - kFooterBytes);
  // The payload starts aligned, so its sections can be mapped in place.
  file.resize((file.size() + kAlign - 1) / kAlign * kAlign, 0);
  const uint64_t payload_offset = file.size();
  size_t table_end = 0;
  std::vector<uint8_t> payload = serialize(&table_end);
  file.insert(file.end(), payload.begin(), payload.end());
  put(file, payload_offset, 8);
  put(file, payload.size(), 8);
  put(file, payloadHash(payload.data(), table_end), 8);
  put(file, kPayloadVersion, 4);
  file.insert(file.end(), kFooterMagic, kFooterMagic + 8);

  const std::string tmp = out_path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::errorf("cannot write {}: {}", tmp, std::strerror(errno));
    out.write(reinterpret_cast<const char*>(file.data()), static_cast<std::streamsize>(file.size()));
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp);
      return Status::errorf("writing {} failed: {}", tmp, std::strerror(errno));
    }
  }
  if (executable) ::chmod(tmp.c_str(), 0755);
  std::error_code ec;
  std::filesystem::rename(tmp, out_path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    return Status::errorf("cannot write {}: {}", out_path, ec.message());
  }
  return Status::ok();
}

Payload::Payload(Payload&& o) noexcept { *this = std::move(o); }

Payload& Payload::operator=(Payload&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
    path_ = std::move(o.path_);
    map_ = o.map_;
    map_size_ = o.map_size_;
    base_ = o.base_;
    payload_size_ = o.payload_size_;
    version_ = o.version_;
    entries_ = std::move(o.entries_);
    o.map_ = nullptr;
    o.map_size_ = 0;
  }
  return *this;
}

Payload::~Payload() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

Expected<Payload> Payload::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::errorf("{}: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Status::errorf("{}: {}", path, std::strerror(errno));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < kFooterBytes) {
    ::close(fd);
    return Status::errorf("{}: no Kiln payload (the file is {} bytes)", path, size);
  }
  // Private and writable: a compiled model trains its embedded weights in place, and the writes
  // stay in this process (copy on write), never reaching the file.
  void* m = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return Status::errorf("{}: cannot map the file: {}", path, std::strerror(errno));
  Payload p;
  p.path_ = path;
  p.map_ = static_cast<const uint8_t*>(m);
  p.map_size_ = size;

  const uint8_t* footer = p.map_ + size - kFooterBytes;
  if (std::memcmp(footer + 28, kFooterMagic, 8) != 0)
    return Status::errorf(
        "{}: no Kiln payload at the end of the file (not made by `kiln compile`, or cut short)", path);
  const uint64_t offset = get(footer, 8), payload_size = get(footer + 8, 8), table_hash = get(footer + 16, 8);
  p.version_ = static_cast<uint32_t>(get(footer + 24, 4));
  if (p.version_ != kPayloadVersion)
    return Status::errorf(
        "{}: payload version {}, but this runner reads version {} (recompile the model with "
        "this Kiln)",
        path, p.version_, kPayloadVersion);
  if (offset > size - kFooterBytes || payload_size != size - kFooterBytes - offset || payload_size < 16)
    return Status::errorf(
        "{}: the payload footer points outside the file (offset {}, {} bytes, file {} bytes): "
        "the file is damaged",
        path, offset, payload_size, size);
  p.base_ = p.map_ + offset;
  p.payload_size_ = payload_size;
  if (std::memcmp(p.base_, kHeaderMagic, 8) != 0 || get(p.base_ + 8, 4) != kPayloadVersion)
    return Status::errorf("{}: the payload header is damaged", path);

  Cursor c{p.base_ + 16, p.base_ + payload_size};
  const uint64_t count = get(p.base_ + 12, 4);
  const auto damaged = [&](std::string_view what) {
    return Status::errorf("{}: the payload's section table is damaged ({})", path, what);
  };
  for (uint64_t s = 0; s < count; ++s) {
    const uint8_t* at = nullptr;
    if (!c.take(4, &at)) return damaged("it ends early");
    const uint64_t n = get(at, 4);
    if (!c.take(n, &at)) return damaged("a name runs past the end");
    Entry e;
    e.name.assign(reinterpret_cast<const char*>(at), n);
    if (!c.take(24, &at)) return damaged("it ends early");
    e.offset = get(at, 8);
    e.size = get(at + 8, 8);
    e.hash = get(at + 16, 8);
    if (e.offset > payload_size || e.size > payload_size - e.offset)
      return damaged(fmt::format("section '{}' lies outside the payload", e.name));
    p.entries_.push_back(std::move(e));
  }
  if (payloadHash(p.base_, static_cast<size_t>(c.p - p.base_)) != table_hash)
    return Status::errorf("{}: the payload's section table fails its checksum: the file is damaged", path);
  return p;
}

bool Payload::has(std::string_view name) const {
  for (const Entry& e : entries_)
    if (e.name == name) return true;
  return false;
}

std::vector<std::string> Payload::names() const {
  std::vector<std::string> out;
  for (const Entry& e : entries_) out.push_back(e.name);
  return out;
}

uint64_t Payload::sectionSize(std::string_view name) const {
  for (const Entry& e : entries_)
    if (e.name == name) return e.size;
  return 0;
}

Expected<std::span<const uint8_t>> Payload::section(std::string_view name) const {
  for (const Entry& e : entries_) {
    if (e.name != name) continue;
    std::span<const uint8_t> bytes(base_ + e.offset, static_cast<size_t>(e.size));
    if (!e.checked) {
      if (payloadHash(bytes.data(), bytes.size()) != e.hash)
        return Status::errorf("{}: payload section '{}' fails its checksum: the file is damaged", path_,
                              name);
      e.checked = true;
    }
    return bytes;
  }
  return Status::errorf("{}: the payload has no section '{}'", path_, name);
}

Expected<std::span<uint8_t>> Payload::writableSection(std::string_view name) const {
  KILN_ASSIGN_OR_RETURN(auto bytes, section(name));
  return std::span<uint8_t>(const_cast<uint8_t*>(bytes.data()), bytes.size());
}

Expected<std::string> Payload::text(std::string_view name) const {
  KILN_ASSIGN_OR_RETURN(auto bytes, section(name));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

Expected<std::string> selfExecutablePath() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return Status::errorf("cannot find this executable (/proc/self/exe): {}", ec.message());
  return p.string();
}

Expected<std::string> sharedObjectPathOf(const void* symbol) {
  Dl_info info{};
  if (::dladdr(symbol, &info) == 0 || !info.dli_fname)
    return Status::error("cannot find the shared library this code was loaded from (dladdr)");
  return std::string(info.dli_fname);
}

}  // namespace kiln::runtime
