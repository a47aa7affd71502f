#include "runtime/cuda/kernel_set.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "codegen/cuda_emitter.h"

namespace kiln::cuda {

int archNumber(std::string_view arch) {
  std::string_view digits;
  if (arch.rfind("sm_", 0) == 0)
    digits = arch.substr(3);
  else if (arch.rfind("compute_", 0) == 0)
    digits = arch.substr(8);
  else
    return -1;
  if (!digits.empty() && (digits.back() == 'a' || digits.back() == 'f')) digits.remove_suffix(1);
  if (digits.size() < 2 || digits.size() > 3) return -1;
  int n = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

namespace {

// CUBIN archs before PTX archs, each by number, then by name (sm_90 before sm_90a).
bool archBefore(const std::string& a, const std::string& b) {
  const bool pa = a.rfind("compute_", 0) == 0, pb = b.rfind("compute_", 0) == 0;
  if (pa != pb) return pb;
  if (archNumber(a) != archNumber(b)) return archNumber(a) < archNumber(b);
  return a < b;
}

// The kernels the images of `arch` hold.
std::set<std::string> namesOf(const std::vector<KernelImage>& images, const std::string& arch) {
  std::set<std::string> names;
  for (const KernelImage& im : images)
    if (im.arch == arch) names.insert(im.kernels.begin(), im.kernels.end());
  return names;
}

void putU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
void putU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
void putString(std::string& out, std::string_view s) {
  putU32(out, static_cast<uint32_t>(s.size()));
  out += s;
}

// Reads the serialized form front to back; every read checks that the bytes are there.
class Reader {
 public:
  Reader(std::string_view bytes, std::string_view what) : bytes_(bytes), what_(what) {}
  size_t at() const { return at_; }
  size_t left() const { return bytes_.size() - at_; }
  void skip(size_t n) { at_ += std::min(n, left()); }

  Status need(uint64_t n, std::string_view field) const {
    if (n > left())
      return Status::errorf("{}: the kernel set is truncated: {} needs {} bytes at offset {}, {} are left",
                            what_, field, n, at_, left());
    return Status::ok();
  }
  Expected<uint64_t> uint(int bytes, std::string_view field) {
    KILN_RETURN_IF_ERROR(need(static_cast<uint64_t>(bytes), field));
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[at_ + i])) << (8 * i);
    at_ += static_cast<size_t>(bytes);
    return v;
  }
  // A length of `length_bytes` bytes, then that many bytes.
  Expected<std::string_view> string(int length_bytes, std::string_view field) {
    KILN_ASSIGN_OR_RETURN(uint64_t n, uint(length_bytes, field));
    KILN_RETURN_IF_ERROR(need(n, field));
    std::string_view s = bytes_.substr(at_, static_cast<size_t>(n));
    at_ += static_cast<size_t>(n);
    return s;
  }

 private:
  std::string_view bytes_, what_;
  size_t at_ = 0;
};

}  // namespace

void KernelSet::merge(KernelSet other) {
  std::map<std::string, std::set<std::string>> held;
  for (const KernelImage& im : images) held[im.arch].insert(im.kernels.begin(), im.kernels.end());
  for (KernelImage& im : other.images) {
    std::set<std::string>& have = held[im.arch];
    if (std::all_of(im.kernels.begin(), im.kernels.end(),
                    [&](const std::string& k) { return have.count(k); }))
      continue;
    have.insert(im.kernels.begin(), im.kernels.end());
    images.push_back(std::move(im));
  }
}

std::vector<std::string> KernelSet::archs() const {
  std::set<std::string> unique;
  for (const KernelImage& im : images) unique.insert(im.arch);
  std::vector<std::string> out(unique.begin(), unique.end());
  std::sort(out.begin(), out.end(), archBefore);
  return out;
}

std::vector<std::string> KernelSet::kernelNames() const {
  std::set<std::string> names;
  for (const KernelImage& im : images) names.insert(im.kernels.begin(), im.kernels.end());
  return {names.begin(), names.end()};
}

std::string KernelSet::serialize() const {
  std::string out(kMagic);
  putU32(out, kVersion);
  putU32(out, static_cast<uint32_t>(images.size()));
  for (const KernelImage& im : images) {
    putString(out, im.arch);
    putU32(out, static_cast<uint32_t>(im.kernels.size()));
    for (const std::string& k : im.kernels) putString(out, k);
    putU64(out, im.bytes.size());
    out += im.bytes;
  }
  putU64(out, codegen::fnv1a64(out));
  return out;
}

Expected<KernelSet> KernelSet::deserialize(std::string_view bytes, std::string_view what) {
  if (bytes.size() < kMagic.size() || bytes.substr(0, kMagic.size()) != kMagic)
    return Status::errorf("{}: not a kernel set (no '{}' magic)", what, kMagic);
  Reader body(bytes, what);
  body.skip(kMagic.size());
  KILN_ASSIGN_OR_RETURN(uint64_t version, body.uint(4, "the format version"));
  if (version != kVersion)
    return Status::errorf("{}: kernel set format version {}, this kiln reads version {}", what, version,
                          kVersion);
  KILN_ASSIGN_OR_RETURN(uint64_t count, body.uint(4, "the image count"));
  // An image takes at least its three lengths.
  KILN_RETURN_IF_ERROR(body.need(count * 16, fmt::format("{} images", count)));
  KernelSet set;
  for (uint64_t i = 0; i < count; ++i) {
    const std::string field = fmt::format("image {} of {}", i, count);
    KILN_ASSIGN_OR_RETURN(std::string_view arch, body.string(4, field + "'s arch"));
    if (archNumber(arch) < 0)
      return Status::errorf("{}: the kernel set is damaged: {} has arch '{}'", what, field,
                            std::string(arch.substr(0, 32)));
    KernelImage im;
    im.arch = std::string(arch);
    KILN_ASSIGN_OR_RETURN(uint64_t kernels, body.uint(4, field + "'s kernel count"));
    // Each name takes at least its 4-byte length: a count beyond that is damage, not a reason
    // to reserve gigabytes.
    KILN_RETURN_IF_ERROR(body.need(kernels * 4, field + "'s kernel names"));
    for (uint64_t k = 0; k < kernels; ++k) {
      KILN_ASSIGN_OR_RETURN(std::string_view name, body.string(4, field + "'s kernel name"));
      im.kernels.emplace_back(name);
    }
    KILN_ASSIGN_OR_RETURN(std::string_view image, body.string(8, field + "'s bytes"));
    im.bytes = std::string(image);
    set.images.push_back(std::move(im));
  }
  const size_t hashed = body.at();
  KILN_ASSIGN_OR_RETURN(uint64_t checksum, body.uint(8, "the checksum"));
  if (body.left() != 0)
    return Status::errorf("{}: the kernel set has {} bytes after its checksum", what, body.left());
  if (checksum != codegen::fnv1a64(bytes.substr(0, hashed)))
    return Status::errorf("{}: the kernel set is damaged (its checksum does not match)", what);
  return set;
}

Expected<std::vector<const KernelImage*>> KernelSet::select(const std::string& device_arch,
                                                            const std::vector<std::string>& names) const {
  const int device = archNumber(device_arch);
  if (device < 0 || device_arch.rfind("sm_", 0) != 0)
    return Status::errorf("bad GPU architecture '{}': expected sm_NN", device_arch);
  auto holdsAll = [&](const std::string& arch) {
    const std::set<std::string> held = namesOf(images, arch);
    return std::all_of(names.begin(), names.end(), [&](const std::string& n) { return held.count(n) > 0; });
  };
  std::string chosen;
  if (holdsAll(device_arch)) {
    chosen = device_arch;
  } else {
    int best = -1;
    for (const std::string& arch : archs()) {
      const int n = archNumber(arch);
      if (arch.rfind("compute_", 0) == 0 && n <= device && n > best && holdsAll(arch)) {
        best = n;
        chosen = arch;
      }
    }
  }
  if (chosen.empty()) {
    const std::vector<std::string> have = kernelNames();
    for (const std::string& n : names)
      if (!std::binary_search(have.begin(), have.end(), n))
        return Status::errorf("the compiled kernels have no '{}'", n);
    const std::vector<std::string> all = archs();
    return Status::errorf(
        "no compiled kernels load on this GPU ({}): the kernel set has {} (CUBIN runs only on its own "
        "arch; PTX on its arch and newer)",
        device_arch, all.empty() ? std::string("no images") : fmt::format("{}", fmt::join(all, ", ")));
  }
  std::set<std::string> wanted(names.begin(), names.end());
  std::vector<const KernelImage*> out;
  for (const KernelImage& im : images) {
    if (im.arch != chosen) continue;
    bool useful = false;
    for (const std::string& k : im.kernels) useful |= wanted.erase(k) > 0;
    if (useful) out.push_back(&im);
  }
  return out;
}

}  // namespace kiln::cuda
