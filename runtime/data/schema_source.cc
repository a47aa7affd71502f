// Text files under a model's schema: each file's header binds the named columns, then every
// line is parsed by SchemaParser. Positions resume as Criteo TSV's do (file, byte offset, line).
#include <memory>

#include "runtime/data/line_reader.h"
#include "runtime/data/schema.h"

namespace kiln::data {

namespace {

class SchemaTextSource final : public RowSource {
 public:
  SchemaTextSource(const BatchSpec& spec, std::vector<std::string> files, TsvOptions opts)
      : spec_(spec),
        paths_(files),
        lines_(std::move(files), opts.max_line_bytes,
               "not a line of a data file (is this a TSV or CSV file?)"),
        opts_(std::move(opts)) {}

  // Opens file `file` at `offset` (0: its start, past the header line of a named schema).
  Status openAt(size_t file, int64_t offset, int64_t line) {
    if (file >= paths_.size()) return lines_.open(file, 0, 0);
    parser_ = std::make_unique<SchemaParser>(spec_, Schema::of(spec_), delimiterFor(paths_[file]));
    if (parser_->needsHeader()) {
      KILN_RETURN_IF_ERROR(lines_.open(file, 0, 0));
      std::string_view header;
      KILN_ASSIGN_OR_RETURN(bool got, lines_.next(&header));
      if (!got)
        return locatedError("the file is empty, but the model's columns are found by its header line",
                            paths_[file], 1, 1);
      if (Status s = parser_->bindHeader(header); !s) return locatedError(s.message(), paths_[file], 1, 1);
      if (offset == 0) return Status::ok();
    }
    return lines_.open(file, offset, line);
  }

  Expected<bool> next(Record& r) override {
    return nextParsedLine(
        lines_, opts_, malformed_,
        [&](std::string_view line, int64_t* col) { return parser_->parse(line, r, col); },
        [&](size_t file) { return openAt(file, 0, 0); });
  }

  Status seek(const StreamPosition& pos) override {
    if (pos.file < 0 || static_cast<size_t>(pos.file) > paths_.size())
      return Status::errorf("data position names file {} but the stream has {} files", pos.file,
                            paths_.size());
    return openAt(static_cast<size_t>(pos.file), pos.offset, pos.line);
  }

  StreamPosition position() const override {
    StreamPosition p;
    p.file = static_cast<int64_t>(lines_.file());
    p.offset = lines_.offset();
    p.line = lines_.line();
    return p;
  }

  int64_t malformed() const override { return malformed_; }

 private:
  BatchSpec spec_;  // the parser refers to it
  std::vector<std::string> paths_;
  LineReader lines_;
  TsvOptions opts_;
  std::unique_ptr<SchemaParser> parser_;
  int64_t malformed_ = 0;
};

}  // namespace

Expected<std::unique_ptr<RowSource>> openSchemaText(const BatchSpec& spec, std::vector<std::string> files,
                                                    TsvOptions opts) {
  if (files.empty()) return Status::error("no data files given");
  for (const std::string& f : files) KILN_RETURN_IF_ERROR(checkDataFile(f));
  auto src = std::make_unique<SchemaTextSource>(spec, std::move(files), std::move(opts));
  KILN_RETURN_IF_ERROR(src->openAt(0, 0, 0));
  return std::unique_ptr<RowSource>(std::move(src));
}

}  // namespace kiln::data
