// `kiln data`: data-file tools. `kiln data convert IN.tsv... OUT.bin` turns Criteo TSV files
// into Kiln's binary format; `kiln data info FILE...` checks data files as training reads them.
#include <chrono>
#include <cstdio>
#include <memory>

#include "runtime/data/binary_format.h"
#include "tools/cli.h"

namespace kiln::cli {
namespace {

// --strict and --quiet as reader options: skipped lines reported, the first 20 of them (enough to
// find the problem without flooding the terminal).
data::TsvOptions tsvOptions(const ArgParser& p) {
  data::TsvOptions opts;
  opts.strict = p.flag("strict");
  // One count however often the readers copy the sink.
  auto reported = std::make_shared<int64_t>(0);
  opts.on_skip = [quiet = p.flag("quiet"), reported](const Status& s) {
    if (!quiet && (*reported)++ < 20) std::fprintf(stderr, "%s (line skipped)\n", s.str().c_str());
  };
  return opts;
}

int runConvert(const std::vector<std::string>& args) {
  ArgParser p("data convert", "kiln data convert IN.tsv... OUT.bin [--strict]",
              "Converts Criteo TSV files (label, 13 integer and 26 hex categorical features per line) into\n"
              "one Kiln binary data file, which trains read without parsing text. Malformed lines are\n"
              "reported with file:line and skipped, or stop the conversion with --strict.");
  p.addFlag("strict", "stop at the first malformed line (exit 1, no output written)");
  p.addFlag("quiet", "do not report each skipped line");
  p.setPositionals("IN.tsv... OUT.bin", 2, -1, "the TSV files, read in order, then the binary file to write");
  int code;
  if (!p.parse(args, &code)) return code;
  std::vector<std::string> inputs(p.positionals().begin(), p.positionals().end() - 1);
  const std::string& output = p.positionals().back();
  for (const auto& in : inputs)
    if (in == output) return p.usageError(fmt::format("the output '{}' is also an input", output));
  data::TsvOptions opts = tsvOptions(p);
  auto start = std::chrono::steady_clock::now();
  auto stats = data::convertToBinary(inputs, output, std::move(opts));
  if (!stats) {
    std::fprintf(stderr, "%s\n", stats.status().str().c_str());
    return kExitError;
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s: %lld records (%lld bytes), %lld malformed lines skipped, %.2f s\n", output.c_str(),
              static_cast<long long>(stats->records),
              static_cast<long long>(data::kBinaryHeaderBytes + stats->records * data::kBinaryRecordBytes),
              static_cast<long long>(stats->malformed), secs);
  return kExitOk;
}

int runInfo(const std::vector<std::string>& args) {
  ArgParser p("data info", "kiln data info FILE... [--strict] [--header-only]",
              "Checks data files as training reads them and prints their record counts. A binary file's\n"
              "header and every record are checked (exit 1 at the first corrupt one, which training would\n"
              "stop at); a TSV file's malformed lines are reported and counted, as training skips them\n"
              "(exit 1 with --strict, as training with --strict stops at them).");
  p.setPositionals("FILE...", 1, -1, "Kiln binary or Criteo TSV data files");
  p.addFlag("strict", "a malformed TSV line is an error (exit 1), as for kiln train --strict");
  p.addFlag("header-only", "binary files: check the header against the file size, read no record");
  p.addFlag("quiet", "do not report each skipped TSV line");
  int code;
  if (!p.parse(args, &code)) return code;
  for (const auto& f : p.positionals()) {
    const bool binary = data::isBinaryFile(f);
    if (binary && p.flag("header-only")) {
      auto n = data::checkBinaryFile(f);
      if (!n) {
        std::fprintf(stderr, "%s\n", n.status().str().c_str());
        return kExitError;
      }
      std::printf("%s: %lld records, version %u (header checked)\n", f.c_str(), static_cast<long long>(*n),
                  data::kBinaryVersion);
      continue;
    }
    // The reader training opens, so a file passes here exactly when training would read it.
    data::TsvOptions opts = tsvOptions(p);
    auto src = data::openRecords({f}, std::move(opts));
    if (!src) {
      std::fprintf(stderr, "%s\n", src.status().str().c_str());
      return kExitError;
    }
    int64_t records = 0;
    data::RawSample sample;
    for (;;) {
      auto got = (*src)->next(sample);
      if (!got) {
        std::fprintf(stderr, "%s\n", got.status().str().c_str());
        return kExitError;
      }
      if (!*got) break;
      ++records;
    }
    if (binary)
      std::printf("%s: %lld records, version %u\n", f.c_str(), static_cast<long long>(records),
                  data::kBinaryVersion);
    else
      std::printf("%s: %lld records (Criteo TSV), %lld malformed lines skipped\n", f.c_str(),
                  static_cast<long long>(records), static_cast<long long>((*src)->malformed()));
  }
  return kExitOk;
}

}  // namespace

int runData(const std::vector<std::string>& args) {
  return runSubcommands(
      "data",
      {{"convert", "Convert Criteo TSV files into one Kiln binary data file", runConvert},
       {"info", "Check data files as training reads them and print their record counts", runInfo}},
      args);
}

}  // namespace kiln::cli
