// libFuzzer harness for Criteo TSV files: the bytes as a data file, read by the batch reader
// `kiln train` uses (lenient: malformed lines skipped; strict: the first one is an error), and
// converted by `kiln data convert`. Any input must end in batches or a located error, never a
// crash, a hang or a leak; the conversion must hold exactly the lines the reader keeps.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "runtime/data/binary_format.h"
#include "tests/fuzz/data_fuzz.h"

namespace {

using namespace kiln;

std::vector<data::RawSample> allRecords(const std::string& path) {
  std::vector<data::RawSample> out;
  data::TsvOptions opts;
  opts.on_skip = [](const Status&) {};
  auto src = data::openRecords({path}, opts);
  if (!src) return out;
  for (;;) {
    data::RawSample s;
    auto got = (*src)->next(s);
    fuzz::check(got.isOk(), "the lenient reader of a file it opened never fails");
    if (!*got) return out;
    out.push_back(s);
  }
}

bool sameSample(const data::RawSample& a, const data::RawSample& b) {
  return a.label == b.label && a.missing == b.missing && std::memcmp(a.dense, b.dense, sizeof a.dense) == 0 &&
         std::memcmp(a.cats, b.cats, sizeof a.cats) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::MemFile file(std::string_view(reinterpret_cast<const char*>(data), size));
  fuzz::ReadResult lenient = fuzz::readAllBatches(file.path(), /*strict=*/false);
  fuzz::ReadResult strict = fuzz::readBatches(file.path(), /*strict=*/true, /*epochs=*/2, /*resume=*/false);
  fuzz::check(!strict.to_the_end || (lenient.to_the_end && lenient.samples == strict.samples),
              "a file the strict reader reads whole reads the same leniently");

  // `kiln data convert`: a binary file holding the lines the lenient reader keeps.
  static const std::string out = "/dev/shm/kiln-tsv-fuzz-" + std::to_string(::getpid()) + ".bin";
  data::TsvOptions opts;
  opts.on_skip = [](const Status&) {};
  auto stats = data::convertToBinary({file.path()}, out, opts);
  if (stats) {
    std::vector<data::RawSample> text = allRecords(file.path()), binary = allRecords(out);
    fuzz::check(static_cast<int64_t>(text.size()) == stats->records && binary.size() == text.size(),
                "the binary file holds as many records as the TSV file has good lines");
    for (size_t i = 0; i < text.size(); ++i)
      fuzz::check(sameSample(text[i], binary[i]), "a converted record is the line's sample");
    fuzz::check(!lenient.to_the_end || lenient.samples == 2 * stats->records,
                "two epochs read every good line twice");
    std::remove(out.c_str());
  }
  return 0;
}
