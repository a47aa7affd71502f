// Schemas: a model's inputs bound to file columns (by header name or position), the TSV and CSV
// readers under them, list fields, several labels, resume, and the synthetic data of a schema.
#include "runtime/data/schema.h"

#include <cmath>

#include "runtime/data/batch_reader.h"
#include "runtime/data/sample.h"
#include "test_util.h"

namespace kiln::data {
namespace {

using testing::B;
using testing::TempDir;
using testing::tt;

ir::Attribute names(std::vector<std::string> v) {
  ir::AttrArray a;
  for (auto& s : v) a.push_back(ir::Attribute(s));
  return ir::Attribute(a);
}

// labels f32[B, 2] (click, like), dense f32[B, 3] (d0..d2), one id (item, 100 rows, modulo),
// a list of at most 4 ids (hist, 50 rows, modulo), and a fixed 2-hot field (pair).
std::vector<std::pair<ir::AttrDict, ir::TensorType>> namedInputs() {
  std::vector<std::pair<ir::AttrDict, ir::TensorType>> in;
  in.push_back({{{"name", "labels"}, {"role", "label"}, {"columns", names({"click", "like"})}},
                tt(ir::DType::f32, {B(), ir::Dim::fixed(2)})});
  in.push_back({{{"name", "dense"}, {"role", "dense"}, {"columns", names({"d0", "d1", "d2"})}},
                tt(ir::DType::f32, {B(), ir::Dim::fixed(3)})});
  in.push_back({{{"name", "item"},
                 {"role", "sparse"},
                 {"feature", 0},
                 {"rows", 100},
                 {"hotness", 1},
                 {"columns", names({"item"})}},
                tt(ir::DType::i64, {B(), ir::Dim::fixed(1)})});
  in.push_back({{{"name", "hist"},
                 {"role", "sparse"},
                 {"feature", 1},
                 {"rows", 50},
                 {"max_hotness", 4},
                 {"columns", names({"hist"})}},
                tt(ir::DType::i64, {ir::Dim::bounded(B().times(4))})});
  in.push_back({{{"name", "hist.lengths"}, {"role", "lengths"}, {"feature", 1}}, tt(ir::DType::i32, {B()})});
  in.push_back({{{"name", "pair"},
                 {"role", "sparse"},
                 {"feature", 2},
                 {"rows", 1000},
                 {"hotness", 2},
                 {"columns", names({"pair"})}},
                tt(ir::DType::i64, {B(), ir::Dim::fixed(2)})});
  return in;
}

BatchSpec namedSpec() {
  auto s = fromInputs(namedInputs());
  EXPECT_TRUE(s.isOk()) << (s ? "" : s.status().str());
  return *s;
}

std::vector<float> floats(const Batch& b, const std::string& name) {
  const ir::HostTensor* t = b.find(name);
  return std::vector<float>(t->as<float>(), t->as<float>() + t->numel());
}

std::vector<int64_t> ids(const Batch& b, const std::string& name) {
  const ir::HostTensor* t = b.find(name);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < t->numel(); ++i)
    out.push_back(t->view.dtype == ir::DType::i32 ? t->as<int32_t>()[i] : t->as<int64_t>()[i]);
  return out;
}

Batch readOne(const BatchSpec& spec, const std::string& path, int64_t batch, Status* error = nullptr) {
  DataOptions o;
  o.paths = {path};
  o.batch_size = batch;
  o.strict = true;
  auto r = openBatchReader(spec, o);
  EXPECT_TRUE(r.isOk()) << r.status().str();
  Batch b;
  auto got = (*r)->next(b);
  if (error)
    *error = got ? Status::ok() : got.status();
  else
    EXPECT_TRUE(got.isOk() && *got) << (got ? "no batch" : got.status().str());
  return b;
}

TEST(Schema, InputsWithColumnsMakeANamedLayout) {
  BatchSpec spec = namedSpec();
  EXPECT_EQ(spec.layout, DataLayout::Named);
  Schema s = Schema::of(spec);
  ASSERT_EQ(s.labels.size(), 2u);
  ASSERT_EQ(s.dense.size(), 3u);
  ASSERT_EQ(s.cats.size(), 3u);
  EXPECT_EQ(s.labels[1].ref.name, "like");
  EXPECT_TRUE(s.cats[1].list);
  EXPECT_EQ(s.cats[1].max_values, 4);
  EXPECT_EQ(s.cats[2].hotness, 2);
  EXPECT_EQ(spec.find("dense")->first_column, 0);
  EXPECT_EQ(spec.find("pair")->first_column, 2);
}

TEST(Schema, EveryInputBindsColumnsAllByNameOrAllByPosition) {
  auto in = namedInputs();
  in[1].first.erase("columns");
  auto s = fromInputs(in);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.status().message().find("input 'dense': binds no file columns, but 'labels' does"),
            std::string::npos)
      << s.status().message();
  in = namedInputs();
  in[1].first["columns"] = ir::Attribute(
      ir::AttrArray{ir::Attribute(int64_t{3}), ir::Attribute(int64_t{4}), ir::Attribute(int64_t{5})});
  s = fromInputs(in);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.status().message().find("reads column #3 but 'labels' reads column 'click'"), std::string::npos)
      << s.status().message();
}

TEST(Schema, CategoricalValuesAreNumbersOrHashedText) {
  EXPECT_EQ(categoricalValue("12"), 12u);
  EXPECT_EQ(categoricalValue("18446744073709551615"), 18446744073709551615ull);
  // FNV-1a 64 of "a": offset basis xor 'a', times the prime (mod 2^64), computed by hand.
  EXPECT_EQ(categoricalValue("a"), (0xcbf29ce484222325ull ^ 0x61ull) * 0x100000001b3ull);
  EXPECT_NE(categoricalValue("18446744073709551616"), 0u);  // too big for u64: hashed, not wrapped
  EXPECT_EQ(delimiterFor("x.csv"), ',');
  EXPECT_EQ(delimiterFor("x.tsv"), '\t');
}

TEST(Schema, TsvFindsColumnsByHeaderInAnyOrderWithListsAndMissingValues) {
  TempDir dir;
  // Extra columns (note) are ignored; columns come in any order.
  std::string path = dir.write("u.tsv",
                               "hist\tnote\tlike\td2\tpair\tclick\td0\titem\td1\n"
                               "3,7,51\tx\t1\t-0.5\t5,6\t0\t1.25\t42\t2e-1\n"
                               "\tyy\t0\t\t\t1\t3\tabc\t0\n");
  BatchSpec spec = namedSpec();
  Batch b = readOne(spec, path, 2);
  ASSERT_EQ(b.size, 2);
  EXPECT_EQ(floats(b, "labels"), (std::vector<float>{0, 1, 1, 0}));
  EXPECT_EQ(floats(b, "dense"), (std::vector<float>{1.25f, 0.2f, -0.5f, 3, 0, 0}));
  EXPECT_EQ(ids(b, "item"), (std::vector<int64_t>{42, static_cast<int64_t>(categoricalValue("abc") % 100)}));
  // The list: 3 ids then none (an empty field), 51 mod 50 = 1.
  EXPECT_EQ(ids(b, "hist.lengths"), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(ids(b, "hist"), (std::vector<int64_t>{3, 7, 1}));
  // The fixed 2-hot field: its two values, then the missing row twice.
  EXPECT_EQ(ids(b, "pair"), (std::vector<int64_t>{5, 6, kMissingRow, kMissingRow}));
}

TEST(Schema, CsvReadsQuotedListsAndResumesAtAPosition) {
  TempDir dir;
  std::string text = "click,like,d0,d1,d2,item,hist,pair\n";
  for (int i = 0; i < 10; ++i)
    text += fmt::format("{},{},{},0,0,{},\"{},{}\",{}|{}\n", i % 2, (i / 2) % 2, i, i * 3, i, i + 1, 2 * i,
                        3 * i);
  std::string path = dir.write("u.csv", text);
  BatchSpec spec = namedSpec();
  DataOptions o;
  o.paths = {path};
  o.batch_size = 4;
  o.strict = true;
  auto r = openBatchReader(spec, o);
  ASSERT_TRUE(r.isOk()) << r.status().str();
  Batch b;
  ASSERT_TRUE(*(*r)->next(b));
  EXPECT_EQ(ids(b, "hist"), (std::vector<int64_t>{0, 1, 1, 2, 2, 3, 3, 4}));
  EXPECT_EQ(ids(b, "pair"), (std::vector<int64_t>{0, 0, 2, 3, 4, 6, 6, 9}));
  const StreamPosition after = b.end;
  ASSERT_TRUE(*(*r)->next(b));
  const std::vector<float> second = floats(b, "dense");
  // A fresh reader seeks past the header and the first four lines.
  auto again = openBatchReader(spec, o);
  ASSERT_TRUE(again.isOk());
  ASSERT_TRUE((*again)->seek(after).isOk());
  Batch c;
  ASSERT_TRUE(*(*again)->next(c));
  EXPECT_EQ(floats(c, "dense"), second);
  EXPECT_EQ(floats(c, "dense")[0], 4.0f);
}

TEST(Schema, BinaryVersion2HoldsTheSchemaAndReadsAsTheTextDoes) {
  TempDir dir;
  std::string text = "pair\tclick\tlike\td0\td1\td2\titem\thist\textra\n";
  for (int i = 0; i < 9; ++i)
    text += fmt::format("{},{}\t{}\t{}\t{}\t0.5\t-1\t{}\t{}\tz\n", i, i + 1, i % 2, (i / 3) % 2, i, i * 7,
                        i % 3 ? fmt::format("{},{}", i, i * 2) : "");
  std::string tsv = dir.write("u.tsv", text), bin = dir.file("u.bin");
  BatchSpec spec = namedSpec();
  auto stats = convertSchemaToBinary(spec, {tsv}, bin);
  ASSERT_TRUE(stats.isOk()) << stats.status().str();
  EXPECT_EQ(stats->records, 9);
  EXPECT_TRUE(isBinaryFile(bin));
  Batch from_text = readOne(spec, tsv, 9), from_bin = readOne(spec, bin, 9);
  for (const char* name : {"labels", "dense"})
    EXPECT_EQ(floats(from_bin, name), floats(from_text, name)) << name;
  for (const char* name : {"item", "hist", "hist.lengths", "pair"})
    EXPECT_EQ(ids(from_bin, name), ids(from_text, name)) << name;
  EXPECT_EQ(ids(from_bin, "hist.lengths"), (std::vector<int64_t>{0, 2, 2, 0, 2, 2, 0, 2, 2}));

  // Another model reads the columns it needs by name: here only 'like' and 'item'.
  std::vector<std::pair<ir::AttrDict, ir::TensorType>> in;
  in.push_back({{{"name", "y"}, {"role", "label"}, {"columns", names({"like"})}}, tt(ir::DType::f32, {B()})});
  in.push_back({{{"name", "item"},
                 {"role", "sparse"},
                 {"feature", 0},
                 {"rows", 5},
                 {"hotness", 1},
                 {"columns", names({"item"})}},
                tt(ir::DType::i64, {B(), ir::Dim::fixed(1)})});
  auto other = fromInputs(in);
  ASSERT_TRUE(other.isOk());
  Batch part = readOne(*other, bin, 9);
  EXPECT_EQ(floats(part, "y"), (std::vector<float>{0, 0, 0, 1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(ids(part, "item"), (std::vector<int64_t>{0, 2, 4, 1, 3, 0, 2, 4, 1}));  // 7i mod 5

  // Resume at a batch's end position.
  DataOptions o;
  o.paths = {bin};
  o.batch_size = 4;
  auto r = openBatchReader(spec, o);
  ASSERT_TRUE(r.isOk());
  Batch b;
  ASSERT_TRUE(*(*r)->next(b));
  auto again = openBatchReader(spec, o);
  ASSERT_TRUE((*again)->seek(b.end).isOk());
  Batch c;
  ASSERT_TRUE(*(*again)->next(c));
  EXPECT_EQ(floats(c, "dense")[0], 4.0f);

  // Missing columns, the other layout, and a cut file are clear errors.
  in[0].first["columns"] = names({"share"});
  auto missing = fromInputs(in);
  DataOptions om;
  om.paths = {bin};
  auto m = openBatchReader(*missing, om);
  ASSERT_FALSE(m.isOk());
  EXPECT_NE(m.status().str().find("has no label 'share' of input 'y'; it has 'click', 'like'"),
            std::string::npos)
      << m.status().str();
  auto criteo = openBatchReader(testing::criteoSpec(), om);
  ASSERT_FALSE(criteo.isOk());
  EXPECT_NE(criteo.status().str().find("holds a model's own schema (binary version 2)"), std::string::npos)
      << criteo.status().str();
  std::string bytes = testing::readFile(bin);
  std::string cut = dir.write("cut.bin", bytes.substr(0, bytes.size() - 3));
  Status error;
  readOne(spec, cut, 9, &error);
  EXPECT_NE(error.str().find("corrupt record 8"), std::string::npos) << error.str();
}

TEST(Schema, BadLinesAreLocatedErrors) {
  TempDir dir;
  const std::string header = "click\tlike\td0\td1\td2\titem\thist\tpair\n";
  struct Case {
    std::string line, error;
  };
  std::vector<Case> cases = {
      {"2\t0\t0\t0\t0\t1\t1\t1,2\n", ":2:1: error: label 'click' of input 'labels' must be 0 or 1, got '2'"},
      {"1\t0\t0\tx\t0\t1\t1\t1,2\n",
       ":2:7: error: dense column 'd1' of input 'dense' is not a finite number: 'x'"},
      {"1\t0\t0\t0\t0\t1\t1,2,3,4,5\t1,2\n",
       ":2:13: error: categorical column 'hist' of input 'hist' holds more than its bound of 4 values "
       "(max_hotness)"},
      {"1\t0\t0\t0\t0\t1,2\t1\t1,2\n",
       ":2:11: error: categorical column 'item' of input 'item' holds more than 1 value(s): declare a list "
       "with "
       "max_hotness(n)"},
      {"1\t0\t0\t0\t0\t1\t1\t7\n",
       ":2:15: error: categorical column 'pair' of input 'pair' holds 1 value(s), but its input has hotness "
       "2"},
      {"1\t0\t0\t0\n", ":2:8: error: expected 8 tab-separated fields (as the header has), got 4"},
  };
  BatchSpec spec = namedSpec();
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string path = dir.write(fmt::format("bad{}.tsv", i), header + cases[i].line);
    Status error;
    readOne(spec, path, 1, &error);
    ASSERT_FALSE(error.isOk()) << cases[i].line;
    EXPECT_NE(error.str().find(path + cases[i].error), std::string::npos) << error.str();
  }
  // A header without a column the model reads.
  std::string path = dir.write("nohist.tsv", "click\tlike\td0\td1\td2\titem\tpair\n1\t0\t0\t0\t0\t1\t1,2\n");
  DataOptions o;
  o.paths = {path};
  auto r = openBatchReader(spec, o);
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().str().find(path + ":1:1: error: the header line has no column 'hist', the categorical "
                                         "column of input 'hist'; it has 'click', 'like'"),
            std::string::npos)
      << r.status().str();
}

// Issue 35: 1e-50 and +0.5 were "not a finite number" (from_chars takes no '+' and calls a value
// below f32's denormals out of range). The expected values are the compiler's own f32 literals.
TEST(Schema, DenseValuesAreDecimalNumbersWithinF32Range) {
  TempDir dir;
  const std::string header = "click\tlike\td0\td1\td2\titem\thist\tpair\n";
  std::string path = dir.write("numbers.tsv", header +
                                                  "+1\t0\t1e-50\t+0.5\t1e-40\t1\t1\t1,2\n"
                                                  "0\t+0\t-1e-50\t3.4028234e38\t+.25e1\t1\t1\t1,2\n");
  BatchSpec spec = namedSpec();
  Batch b = readOne(spec, path, 2);
  ASSERT_EQ(b.size, 2);
  EXPECT_EQ(floats(b, "labels"), (std::vector<float>{1, 0, 0, 0}));
  const std::vector<float> dense = floats(b, "dense");
  EXPECT_EQ(dense, (std::vector<float>{0.0f, 0.5f, 1e-40f, -0.0f, 3.4028234e38f, 2.5f}));
  EXPECT_TRUE(std::signbit(dense[3]));  // -1e-50 is -0, as strtof gives
  struct Case {
    std::string field, error;
  };
  const std::vector<Case> bad = {
      {"1e39", "dense column 'd1' of input 'dense' is beyond f32's range (+-3.4e38): '1e39'"},
      {"-3.5e38", "dense column 'd1' of input 'dense' is beyond f32's range (+-3.4e38): '-3.5e38'"},
      {"+-1", "dense column 'd1' of input 'dense' is not a finite number: '+-1'"},
      {"++1", "is not a finite number: '++1'"},
      {"+", "is not a finite number: '+'"},
      {"+inf", "is not a finite number: '+inf'"},
      {"1e-50x", "is not a finite number: '1e-50x'"},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    std::string p =
        dir.write(fmt::format("bad{}.tsv", i), header + "1\t0\t0\t" + bad[i].field + "\t0\t1\t1\t1,2\n");
    Status error;
    readOne(spec, p, 1, &error);
    ASSERT_FALSE(error.isOk()) << bad[i].field;
    EXPECT_NE(error.str().find(p + ":2:7: error: "), std::string::npos) << error.str();
    EXPECT_NE(error.str().find(bad[i].error), std::string::npos) << error.str();
  }
}

TEST(Schema, PositionsNeedNoHeader) {
  // dense f32[B, 2] from columns 2 and 0, the label from column 1, one id from column 3.
  std::vector<std::pair<ir::AttrDict, ir::TensorType>> in;
  in.push_back({{{"name", "y"},
                 {"role", "label"},
                 {"columns", ir::Attribute(ir::AttrArray{ir::Attribute(int64_t{1})})}},
                tt(ir::DType::f32, {B()})});
  in.push_back(
      {{{"name", "x"},
        {"role", "dense"},
        {"columns", ir::Attribute(ir::AttrArray{ir::Attribute(int64_t{2}), ir::Attribute(int64_t{0})})}},
       tt(ir::DType::f32, {B(), ir::Dim::fixed(2)})});
  in.push_back({{{"name", "c"},
                 {"role", "sparse"},
                 {"feature", 0},
                 {"rows", 10},
                 {"hotness", 1},
                 {"columns", ir::Attribute(ir::AttrArray{ir::Attribute(int64_t{3})})}},
                tt(ir::DType::i64, {B(), ir::Dim::fixed(1)})});
  auto spec = fromInputs(in);
  ASSERT_TRUE(spec.isOk()) << spec.status().str();
  EXPECT_EQ(spec->layout, DataLayout::Positional);
  TempDir dir;
  std::string path = dir.write("p.tsv", "5\t1\t7\t23\n6\t0\t8\t4\n");
  Batch b = readOne(*spec, path, 2);
  EXPECT_EQ(floats(b, "y"), (std::vector<float>{1, 0}));
  EXPECT_EQ(floats(b, "x"), (std::vector<float>{7, 5, 8, 6}));
  EXPECT_EQ(ids(b, "c"), (std::vector<int64_t>{3, 4}));
  std::string shorter = dir.write("s.tsv", "5\t1\t7\n");
  Status error;
  readOne(*spec, shorter, 1, &error);
  EXPECT_NE(error.str().find(":1:6: error: expected at least 4 tab-separated fields"), std::string::npos)
      << error.str();
}

TEST(Schema, CriteoLayoutLimitsApplyToFilesNotToSyntheticData) {
  // A dense input of 20 features under the Criteo layout: synthetic data fills it, files cannot.
  std::vector<std::pair<ir::AttrDict, ir::TensorType>> in;
  in.push_back({{{"name", "x"}, {"role", "dense"}}, tt(ir::DType::f32, {B(), ir::Dim::fixed(20)})});
  in.push_back({{{"name", "label"}, {"role", "label"}}, tt(ir::DType::f32, {B()})});
  auto spec = fromInputs(in);
  ASSERT_TRUE(spec.isOk());
  EXPECT_TRUE(checkReadable(*spec, false).isOk());
  Status files = checkReadable(*spec, true);
  ASSERT_FALSE(files.isOk());
  EXPECT_NE(files.message().find("reads 20 dense features, but the Criteo layout has 13"), std::string::npos);
}

TEST(Schema, SyntheticDataFillsEverySchemaWithLearnableLabels) {
  BatchSpec spec = namedSpec();
  SyntheticOptions so;
  so.seed = 3;
  SyntheticGenerator gen(spec, so);
  Batch b;
  const int64_t n = 20000;
  gen.generate(0, n, b);
  const std::vector<float> y = floats(b, "labels");
  const std::vector<float> x = floats(b, "dense");
  ASSERT_EQ(y.size(), static_cast<size_t>(2 * n));
  // Each label's rate lies away from 0 and 1, and the two tasks are different functions.
  double rate[2] = {0, 0}, differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    rate[0] += y[static_cast<size_t>(2 * i)];
    rate[1] += y[static_cast<size_t>(2 * i + 1)];
    differ += y[static_cast<size_t>(2 * i)] != y[static_cast<size_t>(2 * i + 1)];
  }
  for (double r : rate) {
    EXPECT_GT(r / n, 0.1);
    EXPECT_LT(r / n, 0.9);
  }
  EXPECT_GT(differ / n, 0.1);
  // A schema's dense columns are standard normal.
  double mean = 0, sq = 0;
  for (float v : x) mean += v, sq += static_cast<double>(v) * v;
  mean /= static_cast<double>(x.size());
  EXPECT_NEAR(mean, 0.0, 0.03);
  EXPECT_NEAR(sq / static_cast<double>(x.size()), 1.0, 0.05);
  // List lengths lie in 1..4; ids in their tables.
  for (int64_t len : ids(b, "hist.lengths")) {
    EXPECT_GE(len, 1);
    EXPECT_LE(len, 4);
  }
  for (int64_t id : ids(b, "pair")) EXPECT_LT(static_cast<uint64_t>(id), 1000u);
  // The same samples again from the same (seed, index).
  Batch again;
  gen.generate(0, n, again);
  EXPECT_EQ(floats(again, "labels"), y);
}

}  // namespace
}  // namespace kiln::data
