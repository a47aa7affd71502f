#include "runtime/memory.h"

#include <fmt/format.h>
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <sstream>

#include "ir/checked.h"

namespace kiln::runtime {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Each line of `text` in turn.
template <typename Fn>
void forEachLine(std::string_view text, Fn&& fn) {
  while (!text.empty()) {
    size_t nl = text.find('\n');
    fn(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
}

std::optional<std::string> readSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

Expected<uint64_t> parseByteSize(std::string_view text) {
  auto bad = [&]() {
    return Status::errorf("expected a size such as 8G, 512M, 1.5GiB or a byte count, got '{}'", text);
  };
  std::string_view t = trim(text);
  size_t digits_end = 0;
  while (digits_end < t.size() && std::isdigit(static_cast<unsigned char>(t[digits_end]))) ++digits_end;
  std::string_view whole = t.substr(0, digits_end), fraction;
  size_t pos = digits_end;
  if (pos < t.size() && t[pos] == '.') {
    size_t f = ++pos;
    while (pos < t.size() && std::isdigit(static_cast<unsigned char>(t[pos]))) ++pos;
    fraction = t.substr(f, pos - f);
    if (fraction.empty()) return bad();
  }
  if (whole.empty() && fraction.empty()) return bad();
  const std::string unit = lower(trim(t.substr(pos)));
  uint64_t multiplier = 1;
  static const char kLetters[] = "kmgtpe";
  if (!unit.empty() && unit != "b") {
    const char* letter = std::strchr(kLetters, unit[0]);
    if (!letter) return bad();
    const std::string rest = unit.substr(1);
    uint64_t base = 0;
    if (rest.empty() || rest == "i" || rest == "ib")
      base = 1024;
    else if (rest == "b")
      base = 1000;
    else
      return bad();
    for (const char* l = kLetters; l <= letter; ++l) multiplier *= base;  // at most 1024^6 = 2^60
  }
  auto integral = whole.empty() ? std::optional<uint64_t>(0) : parseUint64(whole);
  std::optional<uint64_t> bytes;
  if (integral) bytes = checkedMulU(*integral, multiplier);
  if (!bytes) return Status::errorf("'{}' is more than 2^64-1 bytes", text);
  if (!fraction.empty()) {
    // The fraction's share, rounded down to whole bytes; 19 digits already exceed any multiplier.
    long double part = 0, scale = 1;
    for (char c : fraction.substr(0, 19)) {
      scale /= 10;
      part += static_cast<long double>(c - '0') * scale;
    }
    bytes = checkedAddU(*bytes, static_cast<uint64_t>(part * static_cast<long double>(multiplier)));
    if (!bytes) return Status::errorf("'{}' is more than 2^64-1 bytes", text);
  }
  if (*bytes == 0) return Status::errorf("a size must be positive, got '{}'", text);
  return *bytes;
}

std::string formatBytes(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} byte{}", bytes, bytes == 1 ? "" : "s");
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes) / 1024;
  size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(kUnits)) v /= 1024, ++u;
  return v >= 100 ? fmt::format("{:.0f} {}", v, kUnits[u]) : fmt::format("{:.3g} {}", v, kUnits[u]);
}

std::optional<uint64_t> parseStatusKb(std::string_view status, std::string_view key) {
  std::optional<uint64_t> out;
  forEachLine(status, [&](std::string_view line) {
    if (out || line.size() <= key.size() || line.substr(0, key.size()) != key || line[key.size()] != ':')
      return;
    std::string_view v = trim(line.substr(key.size() + 1));
    std::string_view unit;
    if (size_t sp = v.find(' '); sp != std::string_view::npos) unit = trim(v.substr(sp)), v = v.substr(0, sp);
    auto n = parseUint64(v);
    if (!n) return;
    if (unit == "kB")
      n = checkedMulU(*n, 1024);
    else if (!unit.empty())
      return;
    out = n;
  });
  return out;
}

std::optional<uint64_t> parseMemAvailable(std::string_view meminfo) {
  return parseStatusKb(meminfo, "MemAvailable");
}

std::optional<uint64_t> parseCgroupNumber(std::string_view text) { return parseUint64(trim(text)); }

std::optional<uint64_t> parseCgroupLimit(std::string_view text) {
  if (trim(text) == "max") return std::nullopt;
  auto n = parseCgroupNumber(text);
  // cgroup v1 writes "no limit" as LONG_MAX rounded down to a page (9223372036854771712).
  if (n && *n >= (uint64_t{1} << 62)) return std::nullopt;
  return n;
}

std::optional<uint64_t> parseKeyValue(std::string_view text, std::string_view key) {
  std::optional<uint64_t> out;
  forEachLine(text, [&](std::string_view line) {
    if (out || line.size() <= key.size() || line.substr(0, key.size()) != key || line[key.size()] != ' ')
      return;
    out = parseUint64(trim(line.substr(key.size() + 1)));
  });
  return out;
}

CgroupPaths parseProcSelfCgroup(std::string_view text) {
  CgroupPaths p;
  forEachLine(text, [&](std::string_view line) {
    size_t a = line.find(':');
    if (a == std::string_view::npos) return;
    size_t b = line.find(':', a + 1);
    if (b == std::string_view::npos) return;
    std::string_view id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1);
    std::string path(trim(line.substr(b + 1)));
    if (id == "0" && controllers.empty()) {
      p.v2 = path;
      return;
    }
    // v1: "4:memory:/path", possibly with other controllers ("4:cpu,memory:/path").
    std::string_view rest = controllers;
    while (!rest.empty()) {
      size_t comma = rest.find(',');
      if (rest.substr(0, comma) == "memory") p.v1_memory = path;
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  });
  return p;
}

std::optional<uint64_t> MemoryNeed::total() const {
  uint64_t sum = 0;
  for (const MemoryConsumer& c : consumers) {
    auto s = checkedAddU(sum, c.bytes);
    if (!s) return std::nullopt;
    sum = *s;
  }
  return sum;
}

std::vector<std::pair<std::string, uint64_t>> MemoryNeed::byKind() const {
  std::vector<std::pair<std::string, uint64_t>> out;
  for (const MemoryConsumer& c : consumers) {
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& k) { return k.first == c.kind; });
    if (it == out.end())
      out.emplace_back(c.kind, c.bytes);
    else
      it->second = checkedAddU(it->second, c.bytes).value_or(UINT64_MAX);
  }
  return out;
}

namespace {

// The tightest of the cgroup and its ancestors, `root` + `path`, reading `limit_file` and
// `usage_file` there; usage leaves out the inactive file cache the kernel reclaims first (as
// the kubelet's working set does).
void tightenByCgroup(const std::string& root, std::string path, const char* limit_file,
                     const char* usage_file, const char* inactive_key, MemoryLimit& best) {
  while (true) {
    const std::string dir = root + (path == "/" ? "" : path);
    if (auto text = readSmallFile(dir + "/" + limit_file)) {
      if (auto limit = parseCgroupLimit(*text)) {
        uint64_t usage = 0;
        if (auto u = readSmallFile(dir + "/" + usage_file)) usage = parseCgroupNumber(*u).value_or(0);
        if (auto stat = readSmallFile(dir + "/memory.stat"))
          usage -= std::min(usage, parseKeyValue(*stat, inactive_key).value_or(0));
        const uint64_t left = *limit - std::min(*limit, usage);
        if (!best.bytes || left < *best.bytes) {
          best.bytes = left;
          best.source = fmt::format("the cgroup limit in {}/{} ({}, {} of it in use)", dir, limit_file,
                                    formatBytes(*limit), formatBytes(usage));
        }
      }
    }
    if (path.empty() || path == "/") break;
    size_t slash = path.find_last_of('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
}

void tightenByRlimit(int resource, const char* name, const char* status_key, MemoryLimit& best) {
  struct rlimit rl;
  if (getrlimit(resource, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  uint64_t mapped = 0;
  if (auto status = readSmallFile("/proc/self/status"))
    mapped = parseStatusKb(*status, status_key).value_or(0);
  const uint64_t limit = rl.rlim_cur, left = limit - std::min<uint64_t>(limit, mapped);
  if (!best.bytes || left < *best.bytes) {
    best.bytes = left;
    best.source =
        fmt::format("{} ({}, {} of it already mapped)", name, formatBytes(limit), formatBytes(mapped));
    best.address_space = resource == RLIMIT_AS;
  }
}

}  // namespace

MemoryLimit availableMemory(std::optional<uint64_t> flag_limit) {
  MemoryLimit best;
  if (flag_limit) {
    best.bytes = *flag_limit;
    best.source = "--memory-limit";
  }
  if (auto meminfo = readSmallFile("/proc/meminfo"))
    if (auto avail = parseMemAvailable(*meminfo); avail && (!best.bytes || *avail < *best.bytes)) {
      best.bytes = *avail;
      best.source = "MemAvailable in /proc/meminfo";
    }
  if (auto cgroup = readSmallFile("/proc/self/cgroup")) {
    CgroupPaths paths = parseProcSelfCgroup(*cgroup);
    if (!paths.v2.empty()) {
      // A pure v2 host mounts the hierarchy at /sys/fs/cgroup; a hybrid one under unified/.
      std::string root =
          readSmallFile("/sys/fs/cgroup/cgroup.controllers") ? "/sys/fs/cgroup" : "/sys/fs/cgroup/unified";
      tightenByCgroup(root, paths.v2, "memory.max", "memory.current", "inactive_file", best);
    }
    if (!paths.v1_memory.empty())
      tightenByCgroup("/sys/fs/cgroup/memory", paths.v1_memory, "memory.limit_in_bytes",
                      "memory.usage_in_bytes", "total_inactive_file", best);
  }
  tightenByRlimit(RLIMIT_AS, "the address-space limit RLIMIT_AS, ulimit -v", "VmSize", best);
  tightenByRlimit(RLIMIT_DATA, "the data limit RLIMIT_DATA, ulimit -d", "VmData", best);
  return best;
}

uint64_t addressSpaceReserve(int threads) {
  uint64_t stack = 8ull << 20;
  struct rlimit rl;
  if (getrlimit(RLIMIT_STACK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) stack = rl.rlim_cur;
  const uint64_t others = 2 * static_cast<uint64_t>(std::max(threads, 1) - 1) + 1;
  return others * stack + (40ull << 20);
}

bool singleHeapUnderAddressLimit() {
  struct rlimit rl;
  if (getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return false;
  return mallopt(M_ARENA_MAX, 1) == 1;
}

std::string outOfMemoryNote() {
  const MemoryLimit limit = availableMemory(std::nullopt);
  if (!limit.bytes) return "out of memory";
  return fmt::format("out of memory: {} left under {}", formatBytes(*limit.bytes), limit.source);
}

Status checkMemoryFits(const MemoryNeed& need, const MemoryLimit& limit, size_t top) {
  const std::optional<uint64_t> total = need.total();
  if (total && (!limit.bytes || *total <= *limit.bytes)) return Status::ok();
  std::vector<const MemoryConsumer*> largest;
  for (const MemoryConsumer& c : need.consumers) largest.push_back(&c);
  std::stable_sort(largest.begin(), largest.end(),
                   [](const MemoryConsumer* a, const MemoryConsumer* b) { return a->bytes > b->bytes; });
  largest.resize(std::min(top, largest.size()));

  std::string msg;
  if (!total)
    msg = "not enough memory: the run needs more than 2^64-1 bytes";
  else
    msg = fmt::format(
        "not enough memory: the run needs {} ({} bytes), {} ({} bytes) are available: {} short",
        formatBytes(*total), *total, formatBytes(*limit.bytes), *limit.bytes,
        *total - *limit.bytes < 1024
            ? formatBytes(*total - *limit.bytes)
            : fmt::format("{} ({} bytes)", formatBytes(*total - *limit.bytes), *total - *limit.bytes));
  if (limit.bytes) msg += fmt::format("\n  limit: {}", limit.source);
  msg += "\n  largest:";
  for (const MemoryConsumer* c : largest)
    msg += fmt::format("\n    {} ({}): {}{}", c->what, c->kind, formatBytes(c->bytes),
                       c->bytes < 1024 ? "" : fmt::format(" ({} bytes)", c->bytes));
  msg += "\n  by kind:";
  for (const auto& [kind, bytes] : need.byKind()) msg += fmt::format(" {} {};", kind, formatBytes(bytes));
  msg.pop_back();
  return Status::error(msg);
}

}  // namespace kiln::runtime
