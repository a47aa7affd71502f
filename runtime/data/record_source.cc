// What every data file is checked for before it is read: that it opens, and is neither a
// directory nor a compressed file (which would otherwise read as one malformed line after another).
#include "runtime/data/record_source.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>

namespace kiln::data {

namespace {

struct CompressedKind {
  std::string_view article;
  std::string_view name;
  std::string_view magic;
  std::string_view decompress;  // the command that decompresses a copy, keeping the original
};

constexpr CompressedKind kCompressedKinds[] = {
    {"a", "gzip", std::string_view("\x1f\x8b", 2), "gunzip -k"},
    {"a", "zstd", std::string_view("\x28\xb5\x2f\xfd", 4), "zstd -d"},
    {"a", "bzip2", std::string_view("BZh", 3), "bunzip2 -k"},
    {"an", "xz", std::string_view("\xfd\x37\x7a\x58\x5a\x00", 6), "unxz -k"},
};

}  // namespace

Status checkDataFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return Status::errorf("'{}' is a directory, not a data file", path);
  std::FILE* fp = std::fopen(path.c_str(), "rb");
  if (!fp) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
  char head[8];
  size_t n = std::fread(head, 1, sizeof head, fp);
  std::fclose(fp);
  std::string_view start(head, n);
  // No Criteo line starts with these bytes (a label is 0 or 1), so naming them rejects no TSV.
  for (const CompressedKind& k : kCompressedKinds)
    if (start.substr(0, k.magic.size()) == k.magic)
      return Status::errorf(
          "'{}' is {} {} file: decompress it first ({} '{}'); Kiln reads Criteo TSV and Kiln binary files",
          path, k.article, k.name, k.decompress, path);
  return Status::ok();
}

}  // namespace kiln::data
