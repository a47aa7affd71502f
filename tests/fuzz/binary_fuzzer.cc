// libFuzzer harness for Kiln binary data files: the bytes as a data file, checked as `kiln data
// info` does and read by the batch reader `kiln train` uses. Its header carries a checksum that
// random mutations rarely keep, so each input is also run with the checksum made right: that
// fuzzes the layout and record-count checks and the records behind them.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "runtime/data/binary_format.h"
#include "tests/fuzz/data_fuzz.h"

namespace {

using namespace kiln;

// FNV-1a 64, the header checksum of runtime/data/binary_format.h.
uint64_t fnv1a(const unsigned char* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

void run(std::string_view bytes) {
  fuzz::MemFile file(bytes);
  auto records = data::checkBinaryFile(file.path());
  fuzz::ReadResult read = fuzz::readAllBatches(file.path(), /*strict=*/false);
  if (records && read.to_the_end)
    fuzz::check(read.samples == 2 * *records, "two epochs read every record twice");
  if (read.opened && bytes.substr(0, 8) == std::string_view(data::kBinaryMagic, 8))
    fuzz::check(records.isOk(), "the reader opens only binary files whose header checks");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  run(bytes);
  if (size >= static_cast<size_t>(data::kBinaryHeaderBytes)) {
    uint64_t sum = fnv1a(reinterpret_cast<const unsigned char*>(bytes.data()), 40);
    std::memcpy(bytes.data() + 40, &sum, sizeof sum);
    run(bytes);
  }
  return 0;
}
