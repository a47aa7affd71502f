// The payload of an ahead-of-time compiled model (`kiln compile`, docs/aot.md): named sections
// of bytes appended to a prebuilt runner (the `kiln-runner` executable or the `libkiln-aot.so`
// library), found from the end of the file through a fixed-size footer, so that compiling a
// model needs no C++ compiler and the result is one self-contained file.
//
//   [runner ELF bytes][header][section table][section data ...][footer]
//
//   header:   "KILNPAYL" | u32 version | u32 section count
//   table:    per section: u32 name length | name | u64 offset | u64 size | u64 hash
//             (offsets from the header's first byte; data 64-byte aligned)
//   footer:   u64 payload offset in the file | u64 payload size | u64 hash of header + table |
//             u32 version | "KILNEND" + '\1'   (40 bytes, little-endian)
//
// Every section carries its own hash, checked when the section is read, so a start-up that needs
// only the programs does not hash the weights twice; the table's hash is checked at open. A file
// without the footer, of another payload version, truncated or with a flipped byte is a clear
// error naming the file, never a crash.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

// Bumped whenever the layout of the payload or of a section it holds changes; a runner reads
// exactly its own version.
inline constexpr uint32_t kPayloadVersion = 1;

// A fast 64-bit hash of bytes (four independent multiply-xor lanes over 8-byte words; above 1 MiB
// the hash of its 1 MiB chunks' hashes, taken on several threads): it finds damage, not
// adversaries.
uint64_t payloadHash(const uint8_t* data, size_t size);

class PayloadWriter {
 public:
  void add(std::string name, std::vector<uint8_t> bytes);
  void add(std::string name, std::string_view text);
  // The header, table and data, without the footer (the footer needs the file offset);
  // `table_bytes` gets the length of header and table, which the footer's hash covers.
  std::vector<uint8_t> serialize(size_t* table_bytes = nullptr) const;
  // Writes `runner`'s bytes followed by the payload and footer to `out_path`, through a
  // temporary file renamed into place, executable when `executable`.
  Status writeAppended(const std::string& runner, const std::string& out_path, bool executable) const;

 private:
  std::vector<std::pair<std::string, std::vector<uint8_t>>> sections_;
};

class Payload {
 public:
  // Maps `path` read-only and checks the footer, the version and the table's hash.
  static Expected<Payload> open(const std::string& path);
  Payload(Payload&&) noexcept;
  Payload& operator=(Payload&&) noexcept;
  ~Payload();

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t size() const { return payload_size_; }
  bool has(std::string_view name) const;
  std::vector<std::string> names() const;
  // A section's bytes (valid while this object lives), its hash checked on the first read.
  Expected<std::span<const uint8_t>> section(std::string_view name) const;
  // The same bytes, writable: the file is mapped privately, so writes change this process's
  // copy only (a compiled model's weights, trained in place).
  Expected<std::span<uint8_t>> writableSection(std::string_view name) const;
  Expected<std::string> text(std::string_view name) const;
  uint64_t sectionSize(std::string_view name) const;  // 0 when absent

 private:
  Payload() = default;
  struct Entry {
    std::string name;
    uint64_t offset = 0, size = 0, hash = 0;
    mutable bool checked = false;
  };
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* base_ = nullptr;  // the header
  uint64_t payload_size_ = 0;
  uint32_t version_ = 0;
  std::vector<Entry> entries_;
};

// The file this process runs from (/proc/self/exe), or the shared object that holds `symbol`
// (dladdr): where a runner finds its own payload.
Expected<std::string> selfExecutablePath();
Expected<std::string> sharedObjectPathOf(const void* symbol);

}  // namespace kiln::runtime
