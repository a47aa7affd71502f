// Sharded checkpoints: saved by 1-4 in-process ranks under each sharding of issue 13, read back
// at another rank count and another layout, and compared byte for byte with the global tensors
// (sliced here by a plain element loop, not by the reader). Plus the crash, cleanup and
// corrupt-index cases.
#include "runtime/sharded_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "runtime/comm/local_group.h"
#include "runtime/json.h"
#include "runtime/run_inputs.h"

namespace kiln::runtime {
namespace {

namespace fs = std::filesystem;

enum class Layout { row_wise, column_wise, table_wise, data_parallel, mixed };
constexpr Layout kLayouts[] = {Layout::row_wise, Layout::column_wise, Layout::table_wise,
                               Layout::data_parallel, Layout::mixed};

struct Global {
  std::string name;
  ir::HostTensor tensor;
};

// Parameters and optimizer state of a small model, of several dtypes and ranks, with rows that
// do not divide by 3 or 4, each byte distinct enough that a misplaced element shows.
std::vector<Global> makeGlobals() {
  std::vector<Global> g;
  auto add = [&](const std::string& name, ir::DType t, std::vector<int64_t> shape) {
    g.push_back({name, ir::HostTensor(t, std::move(shape))});
    auto& st = g.back().tensor.storage;
    for (size_t i = 0; i < st.size(); ++i)
      st[i] = static_cast<unsigned char>((i * 131 + g.size() * 17 + 7) % 251);
  };
  add("emb.weight", ir::DType::f32, {10, 6});
  add("emb.weight.adagrad", ir::DType::f32, {10, 6});
  add("tbl", ir::DType::bf16, {7, 5});
  add("dense.w", ir::DType::f64, {5, 3});
  add("bias", ir::DType::i64, {7});
  add("cube", ir::DType::i32, {4, 3, 5});
  add("step_count", ir::DType::i64, {});
  return g;
}

// The region [offset, offset + extent) of `t`, by a loop over its elements.
ir::HostTensor extract(const ir::HostTensor& t, const std::vector<int64_t>& offset,
                       const std::vector<int64_t>& extent) {
  ir::HostTensor out(t.view.dtype, extent);
  const size_t esz = static_cast<size_t>(ir::dtypeBytes(t.view.dtype));
  const size_t rank = extent.size();
  for (int64_t i = 0; i < out.numel(); ++i) {
    int64_t rem = i, global = 0, stride = 1;
    std::vector<int64_t> idx(rank);
    for (size_t d = rank; d-- > 0;) {
      idx[d] = rem % extent[d];
      rem /= extent[d];
    }
    for (size_t d = rank; d-- > 0;) {
      global += (idx[d] + offset[d]) * stride;
      stride *= t.view.shape[d];
    }
    std::memcpy(out.storage.data() + static_cast<size_t>(i) * esz,
                t.storage.data() + static_cast<size_t>(global) * esz, esz);
  }
  return out;
}

// [begin, size) of part i of n split into `parts`: the first n % parts parts one longer.
std::pair<int64_t, int64_t> evenSplit(int64_t n, int parts, int i) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = i * base + std::min<int64_t>(i, extra);
  return {begin, base + (i < extra ? 1 : 0)};
}

struct Region {
  std::vector<int64_t> offset, extent;
  bool replicated = false;
};

// The regions rank `r` of `n` holds of tensor `index` (of `g`) under `layout`.
std::vector<Region> regionsOf(Layout layout, const Global& g, size_t index, int r, int n) {
  const std::vector<int64_t>& shape = g.tensor.view.shape;
  if (layout == Layout::mixed) {
    constexpr Layout kMix[] = {Layout::row_wise,      Layout::row_wise,   Layout::column_wise,
                               Layout::data_parallel, Layout::table_wise, Layout::column_wise,
                               Layout::data_parallel};
    layout = kMix[index % std::size(kMix)];
  }
  std::vector<int64_t> zero(shape.size(), 0);
  // A scalar cannot be split: it is replicated under the split layouts.
  if (shape.empty() && (layout == Layout::row_wise || layout == Layout::column_wise))
    layout = Layout::data_parallel;
  switch (layout) {
    case Layout::table_wise:
      if (static_cast<int>(index % static_cast<size_t>(n)) != r) return {};
      return {{zero, shape}};
    case Layout::data_parallel:
      return {{zero, shape, true}};
    case Layout::row_wise:
    case Layout::column_wise: {
      const size_t dim = layout == Layout::column_wise && shape.size() >= 2 ? 1 : 0;
      auto [begin, size] = evenSplit(shape[dim], n, r);
      Region reg{zero, shape};
      reg.offset[dim] = begin;
      reg.extent[dim] = size;
      return {reg};
    }
    case Layout::mixed:
      break;
  }
  return {};
}

// Rank r's pieces: owned copies of its regions, and LocalPieces viewing them.
struct RankPieces {
  std::vector<std::unique_ptr<ir::HostTensor>> data;
  std::vector<LocalPiece> pieces;
};
RankPieces piecesOf(const std::vector<Global>& globals, Layout layout, int r, int n) {
  RankPieces rp;
  for (size_t i = 0; i < globals.size(); ++i)
    for (const Region& reg : regionsOf(layout, globals[i], i, r, n)) {
      rp.data.push_back(std::make_unique<ir::HostTensor>(extract(globals[i].tensor, reg.offset, reg.extent)));
      rp.pieces.push_back(
          {globals[i].name, globals[i].tensor.view.shape, reg.offset, rp.data.back()->view, reg.replicated});
    }
  return rp;
}

std::map<std::string, std::string> metadataOf(int64_t step) {
  std::map<std::string, std::string> meta = {{"step", std::to_string(step)}, {"data_position", "12345"}};
  RunInputs in;
  in.model = "tiny.kiln";
  in.seed = 7;
  in.batch = 64;
  in.synthetic = true;
  in.toMetadata(meta);
  return meta;
}

Status save(const std::vector<Global>& globals, Layout layout, int n, const std::string& dir, int64_t step) {
  std::vector<RankPieces> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(piecesOf(globals, layout, r, n));
  comm::LocalGroup group(n);
  group.setTimeout(std::chrono::milliseconds(20000));
  // Each rank's own result (run() would return whichever failed first in time): rank 0's error
  // is the one with the reason.
  std::vector<Status> results(static_cast<size_t>(n));
  Status run = group.run([&](comm::Communicator& c) {
    results[static_cast<size_t>(c.rank())] =
        saveShardedCheckpoint(c, dir, step, ranks[static_cast<size_t>(c.rank())].pieces, metadataOf(step));
    return Status::ok();
  });
  if (!run) return run;
  for (const Status& s : results)
    if (!s) return results[0] ? s : results[0];
  return Status::ok();
}

class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            fmt::format("kiln_sharded_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<std::string> shardFiles() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename().string().rfind("shard-", 0) == 0) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  json::Json readIndex() const {
    std::ifstream in(fs::path(dir_) / kShardedIndexFile);
    std::stringstream ss;
    ss << in.rdbuf();
    return *json::parse(ss.str());
  }
  void writeIndexText(const std::string& text) const {
    std::ofstream(fs::path(dir_) / kShardedIndexFile) << text;
  }
  void writeIndex(const json::Json& j) const { writeIndexText(*json::dump(j)); }
  std::string openError() const {
    auto ck = ShardedCheckpoint::open(dir_);
    return ck ? std::string("(opened)") : ck.status().message();
  }

  std::string dir_;
};

bool sameBytes(const ir::HostTensor& a, const ir::HostTensor& b) {
  return a.view.dtype == b.view.dtype && a.view.shape == b.view.shape && a.storage == b.storage;
}

TEST_F(ShardedCheckpointTest, ReshardsToEveryRankCountAndLayout) {
  const auto globals = makeGlobals();
  for (int n = 1; n <= 4; ++n)
    for (Layout saved : kLayouts) {
      SCOPED_TRACE(fmt::format("saved by {} ranks, layout {}", n, static_cast<int>(saved)));
      fs::remove_all(dir_);
      Status saved_ok = save(globals, saved, n, dir_, 10 + n);
      ASSERT_TRUE(saved_ok) << saved_ok.message();
      auto ck = ShardedCheckpoint::open(dir_);
      ASSERT_TRUE(ck) << ck.status().message();
      EXPECT_EQ(ck->step(), 10 + n);
      EXPECT_EQ(ck->ranks(), n);
      EXPECT_EQ(ck->metadata(), metadataOf(10 + n));
      // A replicated tensor is written once, by rank 0.
      for (const GlobalTensor& t : ck->tensors())
        if (saved == Layout::data_parallel) {
          ASSERT_EQ(t.pieces.size(), 1u);
          EXPECT_EQ(t.pieces[0].file, shardFileName(10 + n, 0));
        }
      for (int m = 1; m <= 4; ++m)
        for (Layout loaded : kLayouts)
          for (int r = 0; r < m; ++r)
            for (size_t i = 0; i < globals.size(); ++i)
              for (const Region& reg : regionsOf(loaded, globals[i], i, r, m)) {
                auto got = ck->loadSlice(globals[i].name, reg.offset, reg.extent);
                ASSERT_TRUE(got) << got.status().message();
                EXPECT_TRUE(sameBytes(*got, extract(globals[i].tensor, reg.offset, reg.extent)))
                    << globals[i].name << " on rank " << r << " of " << m << ", layout "
                    << static_cast<int>(loaded);
              }
      // Arbitrary interior regions too (a plan of another kind).
      const auto& emb = globals[0].tensor;
      auto got = ck->loadSlice("emb.weight", {3, 1}, {5, 4});
      ASSERT_TRUE(got);
      EXPECT_TRUE(sameBytes(*got, extract(emb, {3, 1}, {5, 4})));
      auto merged = ck->merge();
      ASSERT_TRUE(merged);
      ASSERT_EQ(merged->tensors.size(), globals.size());
      // In name order, whatever the layout.
      for (size_t i = 1; i < merged->tensors.size(); ++i)
        EXPECT_LT(merged->tensors[i - 1].first, merged->tensors[i].first);
      for (const Global& g : globals) {
        const ir::HostTensor* t = merged->find(g.name);
        ASSERT_NE(t, nullptr) << g.name;
        EXPECT_TRUE(sameBytes(*t, g.tensor)) << g.name;
      }
    }
}

TEST_F(ShardedCheckpointTest, RankWithSeveralPiecesOfOneTensor) {
  // Rank 0 holds rows [0, 3) and [7, 10), rank 1 rows [3, 7): a table_row_wise-like layout.
  const auto globals = makeGlobals();
  const ir::HostTensor& emb = globals[0].tensor;
  std::vector<ir::HostTensor> parts = {extract(emb, {0, 0}, {3, 6}), extract(emb, {7, 0}, {3, 6}),
                                       extract(emb, {3, 0}, {4, 6})};
  std::vector<std::vector<LocalPiece>> pieces = {
      {{"emb.weight", {10, 6}, {0, 0}, parts[0].view}, {"emb.weight", {10, 6}, {7, 0}, parts[1].view}},
      {{"emb.weight", {10, 6}, {3, 0}, parts[2].view}}};
  comm::LocalGroup group(2);
  ASSERT_TRUE(group.run([&](comm::Communicator& c) {
    return saveShardedCheckpoint(c, dir_, 5, pieces[static_cast<size_t>(c.rank())], {});
  }));
  auto ck = ShardedCheckpoint::open(dir_);
  ASSERT_TRUE(ck) << ck.status().message();
  auto whole = ck->loadSlice("emb.weight", {0, 0}, {10, 6});
  ASSERT_TRUE(whole);
  EXPECT_TRUE(sameBytes(*whole, emb));
  auto part = ck->loadSlice("emb.weight", {2, 2}, {6, 3});
  ASSERT_TRUE(part);
  EXPECT_TRUE(sameBytes(*part, extract(emb, {2, 2}, {6, 3})));
}

TEST_F(ShardedCheckpointTest, LargeRunsAndManyPieces) {
  // Rows of 16.8 MB, read straight into place rather than through the batching buffer.
  const int64_t cols = 4200000;
  ir::HostTensor big(ir::DType::f32, {2, cols});
  for (int64_t i = 0; i < big.numel(); ++i) big.as<float>()[i] = static_cast<float>(i % 1000003);
  ir::HostTensor row0 = extract(big, {0, 0}, {1, cols}), row1 = extract(big, {1, 0}, {1, cols});
  // And a table of 1000 one-row pieces, all on one rank (the tiling check must stay cheap).
  ir::HostTensor rows(ir::DType::i32, {1000, 3});
  for (int64_t i = 0; i < rows.numel(); ++i) rows.as<int32_t>()[i] = static_cast<int32_t>(i * 7);
  std::vector<ir::HostTensor> row_pieces;
  for (int64_t r = 0; r < 1000; ++r) row_pieces.push_back(extract(rows, {r, 0}, {1, 3}));
  std::vector<std::vector<LocalPiece>> pieces = {{{"big", {2, cols}, {0, 0}, row0.view}},
                                                 {{"big", {2, cols}, {1, 0}, row1.view}}};
  for (int64_t r = 0; r < 1000; ++r)
    pieces[1].push_back({"rows", {1000, 3}, {r, 0}, row_pieces[static_cast<size_t>(r)].view});
  comm::LocalGroup group(2);
  ASSERT_TRUE(group.run([&](comm::Communicator& c) {
    return saveShardedCheckpoint(c, dir_, 1, pieces[static_cast<size_t>(c.rank())], {});
  }));
  auto ck = ShardedCheckpoint::open(dir_);
  ASSERT_TRUE(ck) << ck.status().message();
  auto whole = ck->loadSlice("big", {0, 0}, {2, cols});
  ASSERT_TRUE(whole);
  EXPECT_TRUE(sameBytes(*whole, big));
  auto cut = ck->loadSlice("big", {0, 1000}, {2, cols - 1000});
  ASSERT_TRUE(cut);
  for (int64_t r = 0; r < 2; ++r)
    EXPECT_EQ(std::memcmp(cut->as<float>() + r * (cols - 1000), big.as<float>() + r * cols + 1000,
                          static_cast<size_t>(cols - 1000) * 4),
              0);
  auto all_rows = ck->loadSlice("rows", {0, 0}, {1000, 3});
  ASSERT_TRUE(all_rows);
  EXPECT_TRUE(sameBytes(*all_rows, rows));
  auto column = ck->loadSlice("rows", {100, 2}, {500, 1});
  ASSERT_TRUE(column);
  EXPECT_TRUE(sameBytes(*column, extract(rows, {100, 2}, {500, 1})));
}

TEST_F(ShardedCheckpointTest, CrashBeforeTheIndexKeepsThePreviousStepAndTheNextSaveCleansUp) {
  const auto globals = makeGlobals();
  ASSERT_TRUE(save(globals, Layout::row_wise, 2, dir_, 1));
  // What a crash after the shards of step 2 and before its index leaves: step 2's shard files
  // (here of other contents) and a temporary file of an interrupted write.
  ir::HostTensor junk(ir::DType::f32, {3});
  for (int r = 0; r < 2; ++r)
    ASSERT_TRUE(
        saveCheckpoint((fs::path(dir_) / shardFileName(2, r)).string(), {{"emb.weight", junk.view}}, {}));
  std::ofstream(fs::path(dir_) / (shardFileName(2, 1) + ".tmp.999")) << "partial";
  std::ofstream(fs::path(dir_) / (std::string(kShardedIndexFile) + ".tmp.999")) << "{\"partial";

  auto ck = ShardedCheckpoint::open(dir_);
  ASSERT_TRUE(ck) << ck.status().message();
  EXPECT_EQ(ck->step(), 1);
  auto merged = ck->merge();
  ASSERT_TRUE(merged);
  for (const Global& g : globals) EXPECT_TRUE(sameBytes(*merged->find(g.name), g.tensor)) << g.name;

  // The next save, on 3 ranks, leaves only its own shards.
  ASSERT_TRUE(save(globals, Layout::column_wise, 3, dir_, 3));
  EXPECT_EQ(shardFiles(),
            (std::vector<std::string>{shardFileName(3, 0), shardFileName(3, 1), shardFileName(3, 2)}));
  auto again = ShardedCheckpoint::open(dir_);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->step(), 3);
  auto merged3 = again->merge();
  ASSERT_TRUE(merged3);
  for (const Global& g : globals) EXPECT_TRUE(sameBytes(*merged3->find(g.name), g.tensor)) << g.name;
}

TEST_F(ShardedCheckpointTest, BadLayoutsFailOnEveryRankAndKeepThePreviousCheckpoint) {
  const auto globals = makeGlobals();
  ASSERT_TRUE(save(globals, Layout::table_wise, 2, dir_, 1));
  const ir::HostTensor& emb = globals[0].tensor;
  ir::HostTensor top = extract(emb, {0, 0}, {4, 6}), rest = extract(emb, {5, 0}, {5, 6});
  ir::HostTensor wide = extract(emb, {0, 0}, {6, 6});
  ir::HostTensor as_f64(ir::DType::f64, {5, 6});
  struct Case {
    const char* what;
    std::vector<std::vector<LocalPiece>> pieces;
    const char* error;
  };
  const std::vector<Case> cases = {
      {"gap",
       {{{"emb.weight", {10, 6}, {0, 0}, top.view}}, {{"emb.weight", {10, 6}, {5, 0}, rest.view}}},
       "tensor 'emb.weight': the pieces cover 54 of its 60 elements (a gap)"},
      {"overlap",
       {{{"emb.weight", {10, 6}, {0, 0}, wide.view}}, {{"emb.weight", {10, 6}, {5, 0}, rest.view}}},
       "tensor 'emb.weight': the pieces of rank 0 (offset [0, 0]) and of rank 1 (offset [5, 0]) overlap"},
      {"unmarked replica",
       {{{"emb.weight", {10, 6}, {0, 0}, emb.view}}, {{"emb.weight", {10, 6}, {0, 0}, emb.view}}},
       "overlap"},
      {"out of bounds", {{{"emb.weight", {10, 6}, {5, 0}, wide.view}}, {}}, "lies outside the shape [10, 6]"},
      {"dtype",
       {{{"emb.weight", {10, 6}, {0, 0}, as_f64.view}}, {{"emb.weight", {10, 6}, {5, 0}, rest.view}}},
       "tensor 'emb.weight': rank 1 holds a piece of a F32 [10, 6] tensor, another rank of a F64 [10, 6] "
       "one"},
      {"rank mismatch",
       {{{"emb.weight", {10, 6}, {0}, top.view}}, {}},
       "rank 0: the piece of 'emb.weight' has 1 offsets"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    comm::LocalGroup group(2);
    std::vector<std::string> errors(2);
    Status st = group.run([&](comm::Communicator& comm) {
      Status s = saveShardedCheckpoint(comm, dir_, 2, c.pieces[static_cast<size_t>(comm.rank())], {});
      errors[static_cast<size_t>(comm.rank())] = s ? "(saved)" : s.message();
      return Status::ok();  // keep the group whole: each rank must fail on its own
    });
    ASSERT_TRUE(st);
    // Layout errors are found by every rank alike; a rank's own bad piece by that rank, which
    // the others name.
    for (const std::string& e : errors)
      EXPECT_TRUE(e.find(c.error) != std::string::npos ||
                  e.find("rank 0 failed to prepare") != std::string::npos)
          << e;
    EXPECT_NE(errors[0].find(c.error), std::string::npos) << errors[0];
    auto ck = ShardedCheckpoint::open(dir_);
    ASSERT_TRUE(ck) << ck.status().message();
    EXPECT_EQ(ck->step(), 1);
    EXPECT_EQ(shardFiles(), (std::vector<std::string>{shardFileName(1, 0), shardFileName(1, 1)}));
  }
  // The same step again would rewrite the files the index names.
  Status st = save(globals, Layout::row_wise, 2, dir_, 1);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("already holds step 1"), std::string::npos) << st.message();
}

TEST_F(ShardedCheckpointTest, CorruptIndexesAreNamedErrors) {
  const auto globals = makeGlobals();
  ASSERT_TRUE(save(globals, Layout::row_wise, 2, dir_, 4));
  const json::Json good = readIndex();
  const std::string index = (fs::path(dir_) / kShardedIndexFile).string();
  auto tensorAt = [](json::Json& j, const std::string& name) -> json::Json& {
    for (json::Json& t : j["tensors"])
      if (t["name"] == name) return t;
    throw std::runtime_error("no tensor " + name);
  };

  writeIndexText("{\"format\": \"kiln.sharded_checkpoint\", ");
  EXPECT_NE(openError().find("sharded checkpoint index '" + index + "': invalid JSON"), std::string::npos)
      << openError();

  json::Json gap = good;
  tensorAt(gap, "tbl")["pieces"].erase(1);
  writeIndex(gap);
  EXPECT_NE(openError().find("tensor 'tbl': the pieces cover 20 of its 35 elements (a gap)"),
            std::string::npos)
      << openError();

  json::Json overlap = good;
  tensorAt(overlap, "emb.weight")["pieces"][1]["offset"] = {2, 0};
  writeIndex(overlap);
  EXPECT_NE(
      openError().find("tensor 'emb.weight': the pieces in '" + shardFileName(4, 0) +
                       "' (offset [0, 0]) and in '" + shardFileName(4, 1) + "' (offset [2, 0]) overlap"),
      std::string::npos)
      << openError();

  json::Json dtype = good;
  tensorAt(dtype, "dense.w")["dtype"] = "F32";
  writeIndex(dtype);
  EXPECT_NE(openError().find(
                "tensor 'dense.w' is F64 [3, 3] but the index says its piece of 'dense.w' is F32 [3, 3]"),
            std::string::npos)
      << openError();
  EXPECT_NE(openError().find(shardFileName(4, 0)), std::string::npos);

  json::Json escape = good;
  tensorAt(escape, "bias")["pieces"][0]["file"] = "../elsewhere.safetensors";
  writeIndex(escape);
  EXPECT_NE(openError().find("tensor 'bias': the piece file '../elsewhere.safetensors' is not a file name"),
            std::string::npos)
      << openError();

  json::Json renamed = good;
  tensorAt(renamed, "bias")["pieces"][0]["name"] = "nope";
  writeIndex(renamed);
  EXPECT_NE(openError().find("no tensor 'nope', which the index names as a piece of 'bias'"),
            std::string::npos)
      << openError();

  writeIndex(good);
  ASSERT_EQ(openError(), "(opened)");
  fs::remove(fs::path(dir_) / shardFileName(4, 1));
  EXPECT_NE(openError().find("the shard file '" + (fs::path(dir_) / shardFileName(4, 1)).string() +
                             "' (a piece of tensor"),
            std::string::npos)
      << openError();
  EXPECT_NE(openError().find("is missing"), std::string::npos);

  fs::remove(index);
  EXPECT_NE(openError().find("cannot open sharded checkpoint index"), std::string::npos);
}

TEST_F(ShardedCheckpointTest, SlicesOutsideTheTensorAreErrors) {
  const auto globals = makeGlobals();
  ASSERT_TRUE(save(globals, Layout::row_wise, 3, dir_, 1));
  auto ck = ShardedCheckpoint::open(dir_);
  ASSERT_TRUE(ck);
  auto r = ck->loadSlice("emb.weight", {8, 0}, {3, 6});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("lies outside tensor 'emb.weight' of shape [10, 6]"),
            std::string::npos);
  EXPECT_FALSE(ck->loadSlice("emb.weight", {0}, {3}));
  auto missing = ck->loadSlice("nope", {}, {});
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("no tensor 'nope'"), std::string::npos);
  ir::HostTensor wrong(ir::DType::f64, {2, 6});
  EXPECT_FALSE(ck->readSlice("emb.weight", {0, 0}, wrong.view));
}

}  // namespace
}  // namespace kiln::runtime
