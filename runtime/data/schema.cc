#include "runtime/data/schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>

#include "runtime/data/line_reader.h"
#include "runtime/data/sample.h"

namespace kiln::data {

namespace {

std::string_view kindName(ColumnKind k) {
  switch (k) {
    case ColumnKind::Label:
      return "label";
    case ColumnKind::Dense:
      return "dense column";
    case ColumnKind::Categorical:
      return "categorical column";
  }
  return "column";
}

bool isListSeparator(char c) { return c == ',' || c == ';' || c == '|' || c == ' '; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// `t` without one '+' before a digit or a point: from_chars takes no plus sign, which printf("%+g")
// and spreadsheets write. A sign after it ("+-1") stays an error.
std::string_view withoutPlus(std::string_view t) {
  if (t.size() > 1 && t[0] == '+' && (std::isdigit(static_cast<unsigned char>(t[1])) || t[1] == '.'))
    t.remove_prefix(1);
  return t;
}

enum class DenseParse { Ok, NotANumber, OutOfRange };

// A dense value: a decimal number (as from_chars reads it, after an optional '+') within f32's
// range. One below its smallest denormal is 0 and one among the denormals the nearest of them (as
// strtof rounds): from_chars calls both out of range, but 1e-50 is a number whose f32 is 0, and
// refusing it refused files that tools write. One beyond f32's largest is out of range: it would be
// an infinity.
DenseParse parseDense(std::string_view text, float* out) {
  const std::string_view t = withoutPlus(text);
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), *out);
  if (end != t.data() + t.size() || (ec != std::errc() && ec != std::errc::result_out_of_range))
    return DenseParse::NotANumber;
  if (ec == std::errc()) return std::isfinite(*out) ? DenseParse::Ok : DenseParse::NotANumber;
  // Out of range, and the whole text a number: strtof says which way (C locale: kiln sets none).
  const std::string copy(t);
  const float v = std::strtof(copy.c_str(), nullptr);
  if (!std::isfinite(v)) return DenseParse::OutOfRange;
  *out = v;
  return DenseParse::Ok;
}

}  // namespace

std::string SchemaColumn::describe(const BatchSpec& spec) const {
  return fmt::format("{} {} of input '{}'", kindName(kind), ref.str(),
                     spec.inputs[static_cast<size_t>(input)].name);
}

Schema Schema::of(const BatchSpec& spec) {
  Schema s;
  s.layout = spec.layout;
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const InputSpec& in = spec.inputs[i];
    std::vector<SchemaColumn>* into = in.role == InputRole::Label    ? &s.labels
                                      : in.role == InputRole::Dense  ? &s.dense
                                      : in.role == InputRole::Sparse ? &s.cats
                                                                     : nullptr;
    if (!into) continue;
    for (const ColumnRef& ref : in.columns) {
      SchemaColumn c{.ref = ref, .input = static_cast<int>(i)};
      c.kind = in.role == InputRole::Label   ? ColumnKind::Label
               : in.role == InputRole::Dense ? ColumnKind::Dense
                                             : ColumnKind::Categorical;
      if (in.role == InputRole::Sparse) {
        c.list = in.variableLength();
        c.hotness = in.hotness;
        c.max_values = in.idsPerSample();
      }
      into->push_back(std::move(c));
    }
  }
  return s;
}

std::vector<const SchemaColumn*> Schema::all() const {
  std::vector<const SchemaColumn*> out;
  for (const auto* kind : {&labels, &dense, &cats})
    for (const SchemaColumn& c : *kind) out.push_back(&c);
  return out;
}

uint64_t categoricalValue(std::string_view text) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v, 10);
  if (ec == std::errc() && end == text.data() + text.size()) return v;
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

char delimiterFor(const std::string& path) {
  return path.size() >= 4 && path.compare(path.size() - 4, 4, ".csv") == 0 ? ',' : '\t';
}

SchemaParser::SchemaParser(const BatchSpec& spec, Schema schema, char delimiter)
    : spec_(spec), schema_(std::move(schema)), delimiter_(delimiter), columns_(schema_.all()) {
  field_of_.assign(columns_.size(), -1);
  if (schema_.layout == DataLayout::Positional)
    for (size_t i = 0; i < columns_.size(); ++i) field_of_[i] = columns_[i]->ref.position;
}

void SchemaParser::split(std::string_view line) {
  fields_.clear();
  size_t i = 0;
  for (;;) {
    if (delimiter_ == ',' && i < line.size() && line[i] == '"') {
      // A quoted CSV field: up to the closing quote (a doubled quote is part of the text).
      size_t j = i + 1;
      while (j < line.size() && !(line[j] == '"' && (j + 1 == line.size() || line[j + 1] != '"')))
        j += line[j] == '"' ? 2 : 1;
      fields_.emplace_back(i + 1, std::min(j, line.size()));
      i = std::min(j + 1, line.size());
      size_t next = line.find(delimiter_, i);
      if (next == std::string_view::npos) return;
      i = next + 1;
      continue;
    }
    size_t next = line.find(delimiter_, i);
    fields_.emplace_back(i, next == std::string_view::npos ? line.size() : next);
    if (next == std::string_view::npos) return;
    i = next + 1;
  }
}

Status SchemaParser::bindHeader(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  split(line);
  std::map<std::string_view, size_t> field_of_name;
  for (size_t f = 0; f < fields_.size(); ++f) {
    std::string_view name = trim(line.substr(fields_[f].first, fields_[f].second - fields_[f].first));
    field_of_name.emplace(name, f);  // the first of two equal names
  }
  expected_fields_ = static_cast<int64_t>(fields_.size());
  for (size_t i = 0; i < columns_.size(); ++i) {
    auto it = field_of_name.find(columns_[i]->ref.name);
    if (it == field_of_name.end()) {
      std::string names;
      for (size_t f = 0; f < fields_.size() && f < 12; ++f)
        names += fmt::format(
            "{}'{}'", f ? ", " : "",
            printableField(trim(line.substr(fields_[f].first, fields_[f].second - fields_[f].first))));
      if (fields_.size() > 12) names += fmt::format(", ... ({} in all)", fields_.size());
      return Status::errorf("the header line has no column '{}', the {} of input '{}'; it has {}",
                            columns_[i]->ref.name, kindName(columns_[i]->kind),
                            spec_.inputs[static_cast<size_t>(columns_[i]->input)].name, names);
    }
    field_of_[i] = static_cast<int64_t>(it->second);
  }
  return Status::ok();
}

Status SchemaParser::parse(std::string_view line, Record& r, int64_t* col) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  split(line);
  const auto got = static_cast<int64_t>(fields_.size());
  const char* sep = delimiter_ == ',' ? "comma" : "tab";
  if (expected_fields_ >= 0 && got != expected_fields_) {
    *col = static_cast<int64_t>(line.size() + 1);
    return Status::errorf("expected {} {}-separated fields (as the header has), got {}", expected_fields_,
                          sep, got);
  }
  r.labels.resize(schema_.labels.size());
  r.dense.resize(schema_.dense.size());
  r.ends.resize(schema_.cats.size());
  r.values.clear();
  size_t label = 0, dense = 0, cat = 0;
  for (size_t i = 0; i < columns_.size(); ++i) {
    const SchemaColumn& c = *columns_[i];
    const int64_t field = field_of_[i];
    if (field >= got) {
      *col = static_cast<int64_t>(line.size() + 1);
      return Status::errorf("expected at least {} {}-separated fields (the {} is field {}), got {}",
                            field + 1, sep, c.describe(spec_), field + 1, got);
    }
    const auto [b, e] = fields_[static_cast<size_t>(field)];
    std::string_view text = line.substr(b, e - b);
    *col = static_cast<int64_t>(b + 1);
    switch (c.kind) {
      case ColumnKind::Label: {
        double v = 0;
        const std::string_view t = withoutPlus(text);
        auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
        if (ec != std::errc() || end != t.data() + t.size() || (v != 0 && v != 1))
          return Status::errorf("{} must be 0 or 1, got '{}'", c.describe(spec_), printableField(text));
        r.labels[label++] = static_cast<float>(v);
        break;
      }
      case ColumnKind::Dense: {
        float v = 0;
        std::string_view t = trim(text);
        if (!t.empty()) {
          const DenseParse got = parseDense(t, &v);
          if (got == DenseParse::NotANumber)
            return Status::errorf("{} is not a finite number: '{}'", c.describe(spec_), printableField(text));
          if (got == DenseParse::OutOfRange)
            return Status::errorf("{} is beyond f32's range (+-3.4e38): '{}'", c.describe(spec_),
                                  printableField(text));
        }
        r.dense[dense++] = v;
        break;
      }
      case ColumnKind::Categorical: {
        int count = 0;
        size_t k = 0;
        while (k < text.size()) {
          size_t stop = k;
          while (stop < text.size() && !isListSeparator(text[stop])) ++stop;
          if (stop > k) {
            if (++count > c.max_values) {
              if (c.list)
                return Status::errorf("{} holds more than its bound of {} values (max_hotness)",
                                      c.describe(spec_), c.max_values);
              return Status::errorf("{} holds more than {} value(s){}", c.describe(spec_), c.max_values,
                                    c.max_values == 1 ? ": declare a list with max_hotness(n)" : "");
            }
            r.values.push_back(categoricalValue(text.substr(k, stop - k)));
          }
          k = stop + 1;
        }
        if (!c.list && count != 0 && count != c.hotness)
          return Status::errorf(
              "{} holds {} value(s), but its input has hotness {} (leave the field empty when "
              "missing)",
              c.describe(spec_), count, c.hotness);
        r.ends[cat++] = static_cast<int32_t>(r.values.size());
        break;
      }
    }
  }
  return Status::ok();
}

void assembleRecords(const BatchSpec& spec, const Record* recs, int64_t n, Batch& batch) {
  allocateBatch(spec, n, batch);
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const InputSpec& in = spec.inputs[i];
    ir::HostTensor& t = batch.tensors[i];
    const auto first = static_cast<size_t>(in.first_column);
    switch (in.role) {
      case InputRole::Label:
      case InputRole::Dense: {
        const int k = in.role == InputRole::Label ? in.label_count : in.dense_count;
        float* d = t.as<float>();
        for (int64_t r = 0; r < n; ++r) {
          const std::vector<float>& src = in.role == InputRole::Label ? recs[r].labels : recs[r].dense;
          for (int j = 0; j < k; ++j) d[r * k + j] = src[first + static_cast<size_t>(j)];
        }
        break;
      }
      case InputRole::Sparse: {
        const bool i64 = in.type.dtype() == ir::DType::i64;
        auto putRow = [&](int64_t at, int64_t row) {
          if (i64)
            t.as<int64_t>()[at] = row;
          else
            t.as<int32_t>()[at] = static_cast<int32_t>(row);
        };
        auto put = [&](int64_t at, uint64_t raw) { putRow(at, mapId(raw, in.id_map, in.rows)); };
        if (in.variableLength()) {
          ir::HostTensor& lt = batch.tensors[static_cast<size_t>(in.lengths_input)];
          lt.reset(ir::DType::i32, {n});
          int64_t total = 0;
          for (int64_t r = 0; r < n; ++r) total += recs[r].ends[first] - recs[r].begin(first);
          t.reset(in.type.dtype(), {total});
          int64_t at = 0;
          for (int64_t r = 0; r < n; ++r) {
            const int32_t b = recs[r].begin(first), e = recs[r].ends[first];
            lt.as<int32_t>()[r] = e - b;
            for (int32_t k = b; k < e; ++k) put(at++, recs[r].values[static_cast<size_t>(k)]);
          }
          break;
        }
        const int h = in.hotness;
        for (int64_t r = 0; r < n; ++r) {
          const int32_t b = recs[r].begin(first);
          const bool missing = recs[r].ends[first] == b;
          for (int k = 0; k < h; ++k) {
            if (missing)
              putRow(r * h + k, kMissingRow);
            else
              put(r * h + k, recs[r].values[static_cast<size_t>(b + k)]);
          }
        }
        break;
      }
      default:
        break;  // lengths are written with their ids, weights below
    }
  }
  fillUnitWeights(spec, batch);
}

}  // namespace kiln::data
