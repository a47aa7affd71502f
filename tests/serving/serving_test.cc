// The serving pieces below the HTTP layer: the batch-invariant GEMM, which tables a store
// serves, a batch's gathered rows, and the update files of kiln train --publish.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <random>

#include "ir/builder.h"
#include "runtime/cpu/kernels/invariant_gemm.h"
#include "runtime/data/batch.h"
#include "runtime/serving/served_tables.h"
#include "runtime/serving/update_file.h"

namespace kiln::serving {
namespace {

std::vector<float> randomFloats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(gen);
  return v;
}

bool sameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// C(i, j) by one fma chain over k, written out here rather than taken from the kernel's file.
float fmaChain(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, const float* b, int64_t i,
               int64_t j) {
  float acc = 0.0f;
  for (int64_t kk = 0; kk < k; ++kk)
    acc = std::fma(ta ? a[kk * m + i] : a[i * k + kk], tb ? b[j * k + kk] : b[kk * n + j], acc);
  return acc;
}

TEST(InvariantGemm, EveryElementIsOneFmaChainWhateverTheShape) {
  runtime::ThreadPool pool(2);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1},
                             {7, 33, 13},
                             {64, 16, 200},
                             {13, 5, 1},
                             {6, 17, 64}}) {
        auto a = randomFloats(static_cast<size_t>(m * k), 1);
        auto b = randomFloats(static_cast<size_t>(k * n), 2);
        std::vector<float> c(static_cast<size_t>(m * n), NAN);
        runtime::cpu::invariantSgemm(ta, tb, m, n, k, a.data(), b.data(), c.data(), pool);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j)
            ASSERT_TRUE(sameBits(c[static_cast<size_t>(i * n + j)],
                                 fmaChain(ta, tb, m, n, k, a.data(), b.data(), i, j)))
                << "ta=" << ta << " tb=" << tb << " m=" << m << " n=" << n << " k=" << k << " at " << i << ","
                << j;
      }
}

TEST(InvariantGemm, ARowScoresTheSameAloneAndInAnyBatch) {
  runtime::ThreadPool one(1), three(3);
  const int64_t k = 300, n = 40;
  auto w = randomFloats(static_cast<size_t>(n * k), 3);
  auto x = randomFloats(static_cast<size_t>(50 * k), 4);
  std::vector<float> all(static_cast<size_t>(50 * n));
  runtime::cpu::invariantSgemm(false, true, 50, n, k, x.data(), w.data(), all.data(), three);
  for (int64_t row : {0, 5, 6, 31, 49}) {
    std::vector<float> alone(static_cast<size_t>(n));
    runtime::cpu::invariantSgemm(false, true, 1, n, k, x.data() + row * k, w.data(), alone.data(), one);
    for (int64_t j = 0; j < n; ++j)
      ASSERT_TRUE(sameBits(alone[static_cast<size_t>(j)], all[static_cast<size_t>(row * n + j)]));
  }
}

// @forward of a small model, built op by op.
struct ForwardBuilder {
  ir::Module m;
  ir::Function& fn = m.addFunction("forward");
  ir::Builder b{fn.entry()};
  ir::Value* param(const std::string& name, int64_t rows, int64_t dim, ir::DType t = ir::DType::f32) {
    auto op = b.createWithTypes("kiln.parameter", {},
                                {ir::TensorType(t, {ir::Dim::fixed(rows), ir::Dim::fixed(dim)})},
                                {{"name", name}, {"init", "zeros"}});
    EXPECT_TRUE(op.isOk()) << op.status().str();
    return (*op)->result();
  }
  ir::Value* ids(const std::string& name, int feature, int64_t rows) {
    auto op = b.createWithTypes("kiln.input", {},
                                {ir::TensorType(ir::DType::i64, {ir::Dim::symbol("B"), ir::Dim::fixed(1)})},
                                {{"name", name}, {"role", "sparse"}, {"feature", feature}, {"rows", rows}});
    EXPECT_TRUE(op.isOk()) << op.status().str();
    return (*op)->result();
  }
  ir::Value* lookup(ir::Value* table, ir::Value* ids) {
    auto op = b.create(ir::OpCode::EmbeddingBag, {table, ids}, {{"mode", "sum"}});
    EXPECT_TRUE(op.isOk()) << op.status().str();
    return (*op)->result();
  }
};

data::Batch idsBatch(const std::vector<std::pair<std::string, std::vector<int64_t>>>& inputs) {
  data::Batch b;
  for (const auto& [name, ids] : inputs) {
    b.names.push_back(name);
    ir::HostTensor t(ir::DType::i64, {static_cast<int64_t>(ids.size()), 1});
    std::memcpy(t.view.data, ids.data(), ids.size() * sizeof(int64_t));
    b.tensors.push_back(std::move(t));
    b.size = static_cast<int64_t>(ids.size());
  }
  return b;
}

TEST(ServedTables, OnlyTablesReadByInputIdsAlone) {
  ForwardBuilder f;
  ir::Value* t0 = f.param("t0", 100, 4);
  ir::Value* shared = f.param("shared", 50, 4);
  ir::Value* wide = f.param("wide", 30, 1);
  ir::Value* deep = f.param("deep", 30, 4);
  ir::Value* dense_too = f.param("dense_too", 20, 4);
  ir::Value* beside = f.param("beside", 20, 4);
  ir::Value* bf = f.param("bf", 20, 4, ir::DType::bf16);
  f.lookup(t0, f.ids("c0", 0, 100));
  f.lookup(shared, f.ids("c1", 1, 50));
  f.lookup(shared, f.ids("c2", 2, 50));
  // Wide & Deep: one feature read by two tables, which then share the batch's distinct ids.
  ir::Value* c3 = f.ids("c3", 3, 30);
  f.lookup(wide, c3);
  f.lookup(deep, c3);
  // A table also read whole (here by a matmul) stays, and so does the table sharing its ids.
  ir::Value* c4 = f.ids("c4", 4, 20);
  ir::Value* pooled = f.lookup(dense_too, c4);
  f.lookup(beside, c4);
  ASSERT_TRUE(f.b.create(ir::OpCode::Matmul, {pooled, dense_too}, {{"transpose_b", true}}).isOk());
  f.lookup(bf, f.ids("c5", 5, 20));
  std::vector<ServedTable> served = findServedTables(f.fn);
  std::map<std::string, std::pair<std::vector<std::string>, int>> got;
  for (const ServedTable& t : served) got[t.name] = {t.id_inputs, t.group};
  using Want = std::map<std::string, std::pair<std::vector<std::string>, int>>;
  EXPECT_EQ(
      got,
      (Want{
          {"t0", {{"c0"}, 0}}, {"shared", {{"c1", "c2"}, 1}}, {"wide", {{"c3"}, 2}}, {"deep", {{"c3"}, 2}}}));
  for (const ServedTable& t : served)
    if (t.name == "t0") {
      EXPECT_EQ(std::make_pair(t.rows, t.dim), std::make_pair(int64_t{100}, int64_t{4}));
    }
}

TEST(GatherRows, AGroupSharesItsDistinctIds) {
  const std::vector<ServedTable> tables = {{"wide", 10, 1, {"a"}, 0}, {"deep", 10, 2, {"a"}, 0}};
  auto g = gatherRows(tables, idsBatch({{"a", {4, 2, 4}}}),
                      [](size_t t, std::span<const int64_t> ids, float* out) {
                        for (size_t i = 0; i < ids.size() * (t == 0 ? 1 : 2); ++i)
                          out[i] = static_cast<float>(t * 100) + static_cast<float>(i);
                        return Status::ok();
                      });
  ASSERT_TRUE(g.isOk()) << g.status().str();
  EXPECT_EQ(g->ids[0], (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(g->ids[1], g->ids[0]);
  ASSERT_EQ(g->remapped_inputs.size(), 1u);
  const int64_t* r = g->remapped_inputs[0].second.view.as<int64_t>();
  EXPECT_EQ(std::vector<int64_t>(r, r + 3), (std::vector<int64_t>{1, 0, 1}));
}

TEST(GatherRows, DistinctIdsOnceRemappedOntoTheirRows) {
  const std::vector<ServedTable> tables = {{"shared", 10, 2, {"a", "b"}, 0}};
  const data::Batch batch = idsBatch({{"a", {7, 3, 7}}, {"b", {3, 9, 0}}});
  std::vector<std::vector<int64_t>> asked;
  auto g = gatherRows(tables, batch, [&](size_t t, std::span<const int64_t> ids, float* out) {
    EXPECT_EQ(t, 0u);
    asked.emplace_back(ids.begin(), ids.end());
    for (size_t i = 0; i < ids.size(); ++i) {
      out[2 * i] = static_cast<float>(ids[i]);
      out[2 * i + 1] = -static_cast<float>(ids[i]);
    }
    return Status::ok();
  });
  ASSERT_TRUE(g.isOk()) << g.status().str();
  EXPECT_EQ(asked, (std::vector<std::vector<int64_t>>{{0, 3, 7, 9}}));
  ASSERT_EQ(g->remapped_inputs.size(), 2u);
  // Each remapped id points at its own row: rows[remapped] == the original id.
  for (const auto& [name, t] : g->remapped_inputs) {
    const ir::HostTensor* orig = batch.find(name);
    for (int64_t i = 0; i < 3; ++i) {
      const int64_t at = t.view.as<int64_t>()[i];
      EXPECT_EQ(g->rows[0].view.as<float>()[at * 2], static_cast<float>(orig->view.as<int64_t>()[i])) << name;
    }
  }
}

TEST(GatherRows, AnIdOutOfRangeNamesTheInputAndSample) {
  const std::vector<ServedTable> tables = {{"t", 10, 2, {"a"}, 0}};
  auto g = gatherRows(tables, idsBatch({{"a", {1, 10}}}),
                      [](size_t, std::span<const int64_t>, float*) { return Status::ok(); });
  ASSERT_FALSE(g.isOk());
  EXPECT_NE(g.status().message().find("input 'a': id 10 of sample 1 is out of range [0, 10)"),
            std::string::npos)
      << g.status().message();
}

class UpdateFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("kiln_update_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(UpdateFiles, ThePublisherWritesTheRowsTrainingReadAndTheDenseWeights) {
  runtime::ParameterStore params;
  ir::HostTensor& table = params.set("t", ir::HostTensor(ir::DType::f32, {6, 2}));
  for (int i = 0; i < 12; ++i) table.view.as<float>()[i] = static_cast<float>(i);
  ir::HostTensor& w = params.set("w", ir::HostTensor(ir::DType::f32, {3}));
  for (int i = 0; i < 3; ++i) w.view.as<float>()[i] = 0.5f * static_cast<float>(i);
  UpdatePublisher pub(dir_.string(), "m", {{"t", 6, 2, {"ids"}, 0}}, {"w"}, 100);
  pub.noteBatch(idsBatch({{"ids", {4, 1, 4}}}));
  pub.noteBatch(idsBatch({{"ids", {5}}}));
  ASSERT_TRUE(pub.publish(110, params).isOk());
  pub.noteBatch(idsBatch({{"ids", {0}}}));
  ASSERT_TRUE(pub.publish(120, params).isOk());
  // A temporary file beside them is not an update.
  std::ofstream(dir_ / "update-000000000130.safetensors.tmp.1") << "partial";
  auto files = listUpdates(dir_.string());
  ASSERT_TRUE(files.isOk());
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ((*files)[0].first, 110);
  auto u = readUpdate((*files)[0].second);
  ASSERT_TRUE(u.isOk()) << u.status().str();
  EXPECT_EQ(u->version, 110);
  EXPECT_EQ(u->base, 100);
  EXPECT_EQ(u->model, "m");
  ASSERT_EQ(u->tables.size(), 1u);
  EXPECT_EQ(u->tables[0].ids, (std::vector<int64_t>{1, 4, 5}));
  const float* rows = u->tables[0].rows.view.as<float>();
  EXPECT_EQ(std::vector<float>(rows, rows + 6), (std::vector<float>{2, 3, 8, 9, 10, 11}));
  ASSERT_EQ(u->dense.size(), 1u);
  EXPECT_EQ(u->dense[0].first, "w");
  EXPECT_EQ(u->dense[0].second.view.as<float>()[2], 1.0f);
  auto second = readUpdate((*files)[1].second);
  ASSERT_TRUE(second.isOk());
  EXPECT_EQ(second->base, 110);
  EXPECT_EQ(second->tables[0].ids, (std::vector<int64_t>{0}));
}

// Issue 35: a file copied into the watched folder is at its full size before its tail is written;
// it parsed as a valid update of wrong rows (zeros) and was applied. The checksum refuses it until
// the copy completes.
TEST_F(UpdateFiles, AFileWhoseTailIsNotYetWrittenIsRefusedByItsChecksum) {
  runtime::ParameterStore params;
  ir::HostTensor& table = params.set("t", ir::HostTensor(ir::DType::f32, {6, 2}));
  for (int i = 0; i < 12; ++i) table.view.as<float>()[i] = static_cast<float>(i + 1);
  params.set("w", ir::HostTensor(ir::DType::f32, {3})).view.as<float>()[2] = 7.0f;
  UpdatePublisher pub(dir_.string(), "m", {{"t", 6, 2, {"ids"}, 0}}, {"w"}, 100);
  pub.noteBatch(idsBatch({{"ids", {1, 5}}}));
  ASSERT_TRUE(pub.publish(110, params).isOk());
  const std::string path = (dir_ / updateFileName(110)).string();
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(bytes.size(), 40u);
  // The last 16 bytes not yet written: zeros, as a file extended to its size reads.
  std::string torn = bytes;
  std::fill(torn.end() - 16, torn.end(), '\0');
  std::ofstream(path, std::ios::binary | std::ios::trunc) << torn;
  auto refused = readUpdate(path);
  ASSERT_FALSE(refused.isOk()) << "an update whose tail is zeros was read";
  EXPECT_NE(refused.status().message().find("does not match its checksum"), std::string::npos)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find(path), std::string::npos) << refused.status().message();
  // One byte changed anywhere in the data is refused too; the whole file is read.
  std::string flipped = bytes;
  flipped[flipped.size() - 1] ^= 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << flipped;
  EXPECT_FALSE(readUpdate(path).isOk());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  auto whole = readUpdate(path);
  ASSERT_TRUE(whole.isOk()) << whole.status().str();
  ASSERT_EQ(whole->tables.size(), 1u);
  EXPECT_EQ(whole->tables[0].ids, (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(whole->tables[0].rows.view.as<float>()[3], 12.0f);  // row 5, column 1: 5 * 2 + 1 + 1
}

// A FIFO of an update's name blocked the watcher in open(), and then the server's shutdown.
TEST_F(UpdateFiles, AFifoOfAnUpdatesNameIsSkippedAndNeverBlocks) {
  runtime::ParameterStore params;
  params.set("t", ir::HostTensor(ir::DType::f32, {6, 2}));
  UpdatePublisher pub(dir_.string(), "m", {{"t", 6, 2, {"ids"}, 0}}, {}, 100);
  ASSERT_TRUE(pub.publish(110, params).isOk());
  const std::string fifo = (dir_ / updateFileName(120)).string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  auto files = listUpdates(dir_.string());
  ASSERT_TRUE(files.isOk());
  ASSERT_EQ(files->size(), 1u);
  EXPECT_EQ((*files)[0].first, 110);
  // Read directly (a FIFO put in place after the listing), it is an error at once, not a wait.
  auto read = std::async(std::launch::async, [&] { return readUpdate(fifo); });
  if (read.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    // Unblock the reader so the test can end: a writer opening the FIFO, then closing it.
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
    FAIL() << "readUpdate of a FIFO blocked";
  }
  auto got = read.get();
  ASSERT_FALSE(got.isOk());
  EXPECT_NE(got.status().message().find("not a regular file"), std::string::npos) << got.status().message();
}

TEST_F(UpdateFiles, NamesAndBadFiles) {
  EXPECT_EQ(updateFileName(42), "update-000000000042.safetensors");
  EXPECT_EQ(parseUpdateFileName("update-000000000042.safetensors"), 42);
  EXPECT_EQ(parseUpdateFileName("update-42.safetensors.tmp.7"), std::nullopt);
  EXPECT_EQ(parseUpdateFileName("update-.safetensors"), std::nullopt);
  EXPECT_EQ(parseUpdateFileName("update-4x.safetensors"), std::nullopt);
  const std::string path = (dir_ / "update-000000000001.safetensors").string();
  std::ofstream(path) << "not a safetensors file";
  EXPECT_FALSE(readUpdate(path).isOk());
  auto missing = listUpdates((dir_ / "nope").string());
  EXPECT_FALSE(missing.isOk());
}

}  // namespace
}  // namespace kiln::serving
