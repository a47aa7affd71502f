// `kiln data`: data-file tools. `kiln data convert IN.tsv... OUT.bin` turns Criteo TSV files
// into Kiln's binary format; `kiln data info FILE...` checks data files as training reads them;
// `kiln data tokens --vocab V --tokens N --out FILE` writes a token file of the synthetic chain.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string_view>

#include "frontend/frontend.h"
#include "runtime/checkpoint.h"
#include "runtime/data/batch_reader.h"
#include "runtime/data/binary_format.h"
#include "runtime/data/line_reader.h"
#include "runtime/data/markov_tokens.h"
#include "runtime/data/schema.h"
#include "tools/cli.h"
#include "tools/session_flags.h"
#include "tools/serve_http.h"

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
  ArgParser p("data convert", "kiln data convert IN.tsv... OUT.bin [--model MODEL.kiln] [--strict]",
              "Converts Criteo TSV files (label, 13 integer and 26 hex categorical features per line) into\n"
              "one Kiln binary data file, which trains read without parsing text; with --model, text files\n"
              "(TSV or CSV) under that model's schema (its inputs' columns(...)) into a version-2 file that\n"
              "names its columns. Malformed lines are reported with file:line and skipped, or stop the\n"
              "conversion with --strict.");
  p.addOption("model", "MODEL.kiln", "read the inputs under this model's schema (its columns(...))");
  p.addOption("set", "NAME=VALUE", "with --model: override a model param", std::nullopt, true);
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
  Expected<data::ConvertStats> stats = Status::error("unset");
  if (p.has("model")) {
    frontend::ParamOverrides overrides;
    for (const std::string& s : p.getAll("set"))
      if (Status st = frontend::addOverride(s, overrides); !st.isOk()) return p.usageError(st.message());
    frontend::DiagnosticEngine diags(&std::cerr);
    auto m = frontend::compileModelFile(p.get("model"), overrides, diags);
    if (!m) {
      std::fprintf(stderr, "kiln data convert: error: %s: the model has errors\n", p.get("model").c_str());
      return kExitError;
    }
    auto spec = data::fromFunction(*(*m)->lookup("forward"));
    if (spec && spec->layout == data::DataLayout::Criteo)
      return p.usageError(fmt::format(
          "'{}' reads the Criteo layout (no columns(...)): convert without --model", p.get("model")));
    stats = spec ? data::convertSchemaToBinary(*spec, inputs, output, std::move(opts))
                 : Expected<data::ConvertStats>(spec.status());
  } else {
    stats = data::convertToBinary(inputs, output, std::move(opts));
  }
  if (!stats) {
    std::fprintf(stderr, "%s\n", stats.status().str().c_str());
    return kExitError;
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(output, ec);
  std::printf("wrote %s: %lld records (%lld bytes), %lld malformed lines skipped, %.2f s\n", output.c_str(),
              static_cast<long long>(stats->records), static_cast<long long>(ec ? 0 : bytes),
              static_cast<long long>(stats->malformed), secs);
  return kExitOk;
}

// The spec of MODEL's @forward (--model, --set), or the exit code after printing why not.
Expected<data::BatchSpec> modelSpec(ArgParser& p, const char* command, int* code) {
  frontend::ParamOverrides overrides;
  for (const std::string& s : p.getAll("set"))
    if (Status st = frontend::addOverride(s, overrides); !st.isOk()) {
      *code = p.usageError(st.message());
      return st;
    }
  frontend::DiagnosticEngine diags(&std::cerr);
  auto m = frontend::compileModelFile(p.get("model"), overrides, diags);
  *code = kExitError;
  if (!m) {
    std::fprintf(stderr, "kiln %s: error: %s: the model has errors\n", command, p.get("model").c_str());
    return Status::error("the model has errors");
  }
  auto spec = data::fromFunction(*(*m)->lookup("forward"));
  if (!spec) printError(command, spec.status());
  return spec;
}

// Without a model a text file is Criteo TSV. A first line whose label field is not a number is a
// header line, which only a file of a model's own columns has: reading it as Criteo reported every
// line of a valid file as malformed. Its label field, or nothing when the line is Criteo-like.
std::optional<std::string> headerLabel(const std::string& path) {
  std::FILE* fp = std::fopen(path.c_str(), "rb");
  if (!fp) return std::nullopt;  // the reader names the error
  char buf[4096];
  const size_t n = std::fread(buf, 1, sizeof buf, fp);
  std::fclose(fp);
  std::string_view line(buf, n);
  if (line.substr(0, 3) == "\xef\xbb\xbf") line.remove_prefix(3);  // a UTF-8 byte-order mark
  line = line.substr(0, line.find_first_of("\t\n\r"));
  if (line.empty() || line.find_first_not_of("0123456789.+-eE ") == std::string_view::npos)
    return std::nullopt;
  return std::string(line.substr(0, 64));
}

int runInfo(const std::vector<std::string>& args) {
  ArgParser p("data info", "kiln data info FILE... [--model MODEL.kiln] [--strict] [--header-only]",
              "Checks data files as training reads them and prints their record counts. With --model, each\n"
              "file is read by the reader `kiln train MODEL --data FILE` opens (its schema, its bounds, the\n"
              "refusal of a file of another layout). Without it: Criteo TSV and version-1 binary files as a\n"
              "Criteo-layout model reads them, and version-2 (schema) binary files under their own header.\n"
              "A binary file's header and every record are checked (exit 1 at the first corrupt one, which\n"
              "training would stop at); a TSV file's malformed lines are reported and counted, as training\n"
              "skips them (exit 1 with --strict, as training with --strict stops at them). Files that hold\n"
              "no sample at all are exit 1, as training refuses them.");
  p.setPositionals("FILE...", 1, -1, "data files: binary, TSV or CSV");
  p.addOption("model", "MODEL.kiln", "read the files as training this model reads them (its columns(...))");
  p.addOption("set", "NAME=VALUE", "with --model: override a model param", std::nullopt, true);
  p.addFlag("strict", "a malformed TSV line is an error (exit 1), as for kiln train --strict");
  p.addFlag("header-only", "binary files: check the header against the file size, read no record");
  p.addFlag("quiet", "do not report each skipped TSV line");
  int code;
  if (!p.parse(args, &code)) return code;
  std::optional<data::BatchSpec> spec;
  if (p.has("model")) {
    auto s = modelSpec(p, "data info", &code);
    if (!s) return code;
    spec = s.take();
  }
  int64_t total = 0;
  for (const auto& f : p.positionals()) {
    const bool binary = data::isBinaryFile(f);
    const auto v2 =
        binary ? data::schemaBinaryInfo(f) : Expected<std::string>(Status::error("not version 2"));
    if (binary && p.flag("header-only")) {
      if (v2) {
        std::printf("%s: %s (header checked)\n", f.c_str(), v2->c_str());
        continue;
      }
      auto n = data::checkBinaryFile(f);
      if (!n) {
        std::fprintf(stderr, "%s\n", n.status().str().c_str());
        return kExitError;
      }
      std::printf("%s: %lld records, version %u (header checked)\n", f.c_str(), static_cast<long long>(*n),
                  data::kBinaryVersion);
      total += *n;  // not read: counted as the header says
      continue;
    }
    if (spec) {
      // The very reader training opens for this model, batch by batch.
      data::DataOptions o;
      o.paths = {f};
      o.batch_size = 1024;
      o.strict = p.flag("strict");
      int64_t malformed = 0;
      o.on_skip = [quiet = p.flag("quiet"), &malformed](const Status& s) {
        if (!quiet && malformed < 20) std::fprintf(stderr, "%s (line skipped)\n", s.str().c_str());
        ++malformed;
      };
      auto reader = data::openBatchReader(*spec, std::move(o));
      if (!reader) {
        std::fprintf(stderr, "%s\n", reader.status().str().c_str());
        return kExitError;
      }
      int64_t records = 0;
      data::Batch batch;
      for (;;) {
        auto got = (*reader)->next(batch);
        if (!got) {
          std::fprintf(stderr, "%s\n", got.status().str().c_str());
          return kExitError;
        }
        if (!*got) break;
        records += batch.size;
      }
      total += records;
      if (binary)
        std::printf("%s: %lld records (binary, version %u)\n", f.c_str(), static_cast<long long>(records),
                    v2 ? data::kSchemaBinaryVersion : data::kBinaryVersion);
      else
        std::printf("%s: %lld records (%s), %lld malformed lines skipped\n", f.c_str(),
                    static_cast<long long>(records),
                    spec->layout == data::DataLayout::Criteo ? "Criteo TSV" : "text, the model's columns",
                    static_cast<long long>(malformed));
      continue;
    }
    if (v2) {
      // A model's own schema: every record under the file's header (what any model checks).
      auto n = data::checkSchemaBinaryRecords(f);
      if (!n) {
        std::fprintf(stderr, "%s\n", n.status().str().c_str());
        return kExitError;
      }
      total += *n;
      std::printf("%s: %s (every record checked; --model MODEL.kiln reads them as MODEL does)\n", f.c_str(),
                  v2->c_str());
      continue;
    }
    if (!binary)
      if (auto label = headerLabel(f)) {
        std::fprintf(stderr,
                     "%s:1:1: error: the first line is not a Criteo sample (its label is '%s'): a header "
                     "line, as a file of a model's own columns has; check it as that model reads it: kiln "
                     "data info --model MODEL.kiln %s\n",
                     f.c_str(), data::printableField(*label).c_str(), f.c_str());
        return kExitError;
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
    total += records;
    if (binary)
      std::printf("%s: %lld records, version %u\n", f.c_str(), static_cast<long long>(records),
                  data::kBinaryVersion);
    else
      std::printf("%s: %lld records (Criteo TSV), %lld malformed lines skipped\n", f.c_str(),
                  static_cast<long long>(records), static_cast<long long>((*src)->malformed()));
  }
  if (total == 0) {
    // As `kiln train --data` on these files says.
    std::fprintf(stderr, "kiln data info: error: the data files hold no samples\n");
    return kExitError;
  }
  return kExitOk;
}

// Writes `n` tokens of `walk` to `path` as little-endian ids of `dtype`: PATH.tmp, fsync, rename.
Status writeTokenFile(data::MarkovWalk& walk, int64_t n, data::TokenDType dtype, const std::string& path) {
  const std::string tmp = path + ".tmp";
  std::FILE* fp = std::fopen(tmp.c_str(), "wb");
  if (!fp) return Status::errorf("cannot write '{}': {}", tmp, std::strerror(errno));
  const int bytes = data::tokenBytes(dtype);
  std::vector<unsigned char> chunk;
  bool ok = true;
  for (int64_t done = 0; done < n && ok;) {
    const int64_t count = std::min<int64_t>(n - done, int64_t{1} << 18);
    chunk.resize(static_cast<size_t>(count * bytes));
    for (int64_t i = 0; i < count; ++i) {
      const auto id = static_cast<uint32_t>(walk.next());
      for (int b = 0; b < bytes; ++b)
        chunk[static_cast<size_t>(i * bytes + b)] = static_cast<unsigned char>(id >> (8 * b));
    }
    ok = std::fwrite(chunk.data(), 1, chunk.size(), fp) == chunk.size();
    done += count;
  }
  ok = ok && std::fflush(fp) == 0 && ::fsync(fileno(fp)) == 0;
  const int saved_errno = errno;
  ok = std::fclose(fp) == 0 && ok;
  std::error_code ec;
  if (!ok) {
    std::filesystem::remove(tmp, ec);
    return Status::errorf("cannot write '{}': {}", tmp, std::strerror(saved_errno));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Status::errorf("cannot rename '{}' to '{}': {}", tmp, path, ec.message());
  return Status::ok();
}

int runTokens(const std::vector<std::string>& args) {
  ArgParser p(
      "data tokens", "kiln data tokens --vocab V --tokens N --out FILE [--seed S] [--token-dtype u16|u32]",
      "Writes a token file for language models: N tokens of the synthetic Markov chain over V tokens\n"
      "(the chain `kiln train --data synthetic --seed S` trains on), as flat little-endian ids\n"
      "(nanoGPT's train.bin layout), and prints the chain's entropy rate.");
  p.addOption("vocab", "V", "the vocabulary size");
  p.addOption("tokens", "N", "how many tokens to write");
  p.addOption("out", "FILE", "the token file to write");
  p.addOption("seed", "S", "the chain's seed (as kiln train --seed)", "0");
  p.addOption("token-dtype", "u16|u32",
              "the id type (default: by the name, .bin and .u16 are u16, .u32 u32)");
  int code;
  if (!p.parse(args, &code)) return code;
  if (!p.has("vocab") || !p.has("tokens") || !p.has("out"))
    return p.usageError("--vocab, --tokens and --out are required");
  auto vocab = p.getInt("vocab"), tokens = p.getInt("tokens"), seed = p.getInt("seed");
  if (!vocab || !tokens || !seed) return kExitUsage;
  if (*vocab < 1 || *tokens < 1) return p.usageError("--vocab and --tokens must be positive");
  const std::string out = p.get("out");
  auto dtype = data::tokenDTypeFor(out, p.get("token-dtype"));
  if (!dtype) return p.usageError(dtype.status().message());
  if (*dtype == data::TokenDType::U16 && *vocab > (int64_t{1} << 16))
    return p.usageError(fmt::format(
        "--vocab {} does not fit u16 ids (at most 65536): write u32 (--token-dtype u32)", *vocab));
  if (*vocab > data::kMaxSyntheticVocab)
    return p.usageError(fmt::format("--vocab {}: the synthetic chain takes at most {} tokens", *vocab,
                                    data::kMaxSyntheticVocab));
  // The training stream's chain: kiln train seeds its synthetic data with --seed + 1.
  data::MarkovChain chain(*vocab, static_cast<uint64_t>(*seed) + 1);
  data::MarkovWalk walk(chain, static_cast<uint64_t>(*seed));
  if (Status st = writeTokenFile(walk, *tokens, *dtype, out); !st) {
    printError("data tokens", st);
    return kExitError;
  }
  std::printf("wrote %s: %lld %s tokens over a vocab of %lld, entropy floor %.4f nats\n", out.c_str(),
              static_cast<long long>(*tokens), std::string(data::tokenDTypeName(*dtype)).c_str(),
              static_cast<long long>(*vocab), chain.entropyRate());
  return kExitOk;
}

// `kiln data requests MODEL.kiln --data ... -o FILE`: infer request bodies of the data as the
// model reads it, one per line, for kiln serve's clients, tests and bench/serve.sh.
int runRequests(const std::vector<std::string>& raw_args) {
  ArgParser p("data requests", "kiln data requests MODEL.kiln --data synthetic|PATH... [-o FILE] [flags]",
              "Writes KServe v2 infer request bodies (JSON, one per line) holding the samples of the data as\n"
              "MODEL reads them, --batch samples each: what a client of kiln serve sends.");
  const ModelSource& model = modelFileSource();
  model.addModelArgument(p);
  p.addOption("data", "synthetic|PATH", "the data (synthetic: its held-out stream)", std::nullopt, true);
  p.addOption("batch", "B", "samples per request", "1");
  p.addOption("samples", "N", "samples of the synthetic stream, or at most this many of the files", "1024");
  p.addOption("output", "FILE", "where to write them (also -o FILE; default stdout)");
  addModelFlags(p, model);
  int code;
  if (!p.parse(expandOutputShorthand(raw_args), &code)) return code;
  auto batch = p.getInt("batch");
  auto samples = p.getInt("samples");
  if (!batch || !samples) return kExitUsage;
  if (*batch < 1 || *samples < 1) return p.usageError("--batch and --samples must be positive");
  driver::SessionOptions so;
  if (!model.readModelArgument(p, so, &code)) return code;
  so.batch = *batch;
  so.training = false;
  so.external_tables = true;  // the spec is all this needs: leave the tables unallocated
  if (!readModelFlags(p, model, so, &code)) return code;
  auto session = model.open(so, std::cerr);
  if (!session) {
    printError("data requests", session.status());
    return kExitError;
  }
  data::DataOptions opts;
  opts.paths = p.getAll("data");
  opts.batch_size = *batch;
  opts.epochs = 1;
  opts.synthetic.seed = so.seed + 1;  // the held-out stream of the task kiln train learns
  opts.synthetic.stream = 1;
  opts.synthetic_samples = *samples;
  auto reader = data::openBatchReader((*session)->forwardSpec(), opts);
  if (!reader) {
    printError("data requests", reader.status());
    return kExitError;
  }
  std::string out;
  data::Batch b;
  int64_t written = 0;
  while (written < *samples) {
    auto more = (*reader)->next(b);
    if (!more) {
      printError("data requests", more.status());
      return kExitError;
    }
    if (!*more) break;
    out += inferRequestBody(b, (*session)->forwardSpec());
    out += '\n';
    written += b.size;
  }
  const std::string path = p.get("output");
  if (path.empty()) {
    std::fwrite(out.data(), 1, out.size(), stdout);
  } else if (Status st = runtime::writeFileAtomically(path, out); !st) {
    printError("data requests", st);
    return kExitError;
  }
  std::fprintf(stderr, "wrote %lld samples\n", static_cast<long long>(written));
  return kExitOk;
}

}  // namespace

int runData(const std::vector<std::string>& args) {
  return runSubcommands(
      "data",
      {{"convert", "Convert Criteo TSV files into one Kiln binary data file", runConvert},
       {"info", "Check data files as training reads them and print their record counts", runInfo},
       {"requests", "Write infer request bodies for kiln serve from data, as the model reads it", runRequests},
       {"tokens", "Write a token file of the synthetic Markov chain (for language models)", runTokens}},
      args);
}

}  // namespace kiln::cli
