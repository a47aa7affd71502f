#include "runtime/checkpoint.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "runtime/json.h"
#include "test_util.h"

namespace kiln::runtime {
namespace {

using data::testing::readFile;
using data::testing::TempDir;

ir::HostTensor ramp(ir::DType t, std::vector<int64_t> shape) {
  ir::HostTensor h(t, std::move(shape));
  for (size_t i = 0; i < h.storage.size(); ++i) h.storage[i] = static_cast<unsigned char>(i * 37 + 11);
  return h;
}

// Writes a file in safetensors layout from a header text and a data section.
std::string rawFile(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  return out + header + data;
}

TEST(Checkpoint, RoundTripAndLayout) {
  TempDir dir;
  ir::HostTensor w = ramp(ir::DType::f32, {3, 4}), ids = ramp(ir::DType::i64, {5}), h = ramp(ir::DType::bf16, {2, 1, 3}),
                 s = ramp(ir::DType::f32, {}), empty = ramp(ir::DType::f32, {0, 7});
  std::vector<std::pair<std::string, ir::TensorView>> tensors = {
      {"top.0.weight", w.view}, {"tables.3.adagrad_sum", ids.view}, {"x", h.view}, {"scalar", s.view}, {"empty", empty.view}};
  std::map<std::string, std::string> meta = {{"step", "50"}, {"model", "dlrm \"v2\"\n"}, {"data", "epoch=0,file=1"}};
  std::string path = dir.file("ckpt.safetensors");
  ASSERT_TRUE(saveCheckpoint(path, tensors, meta).isOk());
  // Only the checkpoint remains: the temporary file was renamed.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.file("")), {}), 1);

  // The layout, read independently: length, JSON header, data in the order given.
  std::string bytes = readFile(path);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  auto header = json::parse(bytes.substr(8, n));
  ASSERT_TRUE(header.isOk()) << header.status().str();
  ASSERT_TRUE(header->contains("top.0.weight"));
  EXPECT_EQ((*header)["top.0.weight"].dump(), R"({"dtype":"F32","shape":[3,4],"data_offsets":[0,48]})");
  EXPECT_EQ((*header)["tables.3.adagrad_sum"].dump(),
            R"({"dtype":"I64","shape":[5],"data_offsets":[48,88]})");
  EXPECT_EQ((*header)["x"]["dtype"], "BF16");
  EXPECT_EQ((*header)["__metadata__"]["step"], "50");
  EXPECT_EQ(bytes.size(), 8 + n + 48 + 40 + 12 + 4);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + 48, ids.storage.data(), 40), 0);

  auto ckpt = loadCheckpoint(path);
  ASSERT_TRUE(ckpt.isOk()) << ckpt.status().str();
  EXPECT_EQ(ckpt->metadata, meta);
  ASSERT_EQ(ckpt->tensors.size(), 5u);
  for (const auto& [name, view] : tensors) {
    const ir::HostTensor* t = ckpt->find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->view.dtype, view.dtype);
    EXPECT_EQ(t->view.shape, view.shape);
    EXPECT_EQ(std::memcmp(t->storage.data(), view.data, static_cast<size_t>(view.bytes())), 0) << name;
  }

  // Restoring into the model's tensors.
  ir::HostTensor w2(ir::DType::f32, {3, 4}), ids2(ir::DType::i64, {5}), h2(ir::DType::bf16, {2, 1, 3}), s2(ir::DType::f32, {}),
      e2(ir::DType::f32, {0, 7});
  std::map<std::string, ir::TensorView> dest = {
      {"top.0.weight", w2.view}, {"tables.3.adagrad_sum", ids2.view}, {"x", h2.view}, {"scalar", s2.view}, {"empty", e2.view}};
  ASSERT_TRUE(restoreTensors(*ckpt, dest, path).isOk());
  EXPECT_EQ(w2.storage, w.storage);
  EXPECT_EQ(h2.storage, h.storage);
  // Overwriting an existing checkpoint replaces it.
  ASSERT_TRUE(saveCheckpoint(path, {{"only", s.view}}, {}).isOk());
  EXPECT_EQ(loadCheckpoint(path)->tensors.size(), 1u);
}

TEST(Checkpoint, RestoreChecksTheModelsExpectations) {
  TempDir dir;
  ir::HostTensor w = ramp(ir::DType::f32, {3, 4});
  std::string path = dir.file("c.safetensors");
  ASSERT_TRUE(saveCheckpoint(path, {{"w", w.view}}, {}).isOk());
  auto ckpt = loadCheckpoint(path);
  ASSERT_TRUE(ckpt.isOk());
  ir::HostTensor wrong_shape(ir::DType::f32, {4, 3}), wrong_type(ir::DType::bf16, {3, 4}), other(ir::DType::f32, {1});
  Status st = restoreTensors(*ckpt, {{"w", wrong_shape.view}}, path);
  EXPECT_EQ(st.message(), "checkpoint '" + path + "': tensor 'w' is F32 [3, 4] but the model expects F32 [4, 3]");
  st = restoreTensors(*ckpt, {{"w", wrong_type.view}}, path);
  EXPECT_EQ(st.message(), "checkpoint '" + path + "': tensor 'w' is F32 [3, 4] but the model expects BF16 [3, 4]");
  st = restoreTensors(*ckpt, {{"w", w.view}, {"v", other.view}}, path);
  EXPECT_EQ(st.message(), "checkpoint '" + path + "': no tensor 'v', which the model needs");
  st = restoreTensors(*ckpt, {}, path);
  EXPECT_EQ(st.message(), "checkpoint '" + path + "': tensor 'w' is not a parameter of the model");
}

TEST(Checkpoint, EveryCorruptionIsANamedError) {
  TempDir dir;
  ir::HostTensor a = ramp(ir::DType::f32, {2, 2}), b = ramp(ir::DType::i32, {3});
  std::string good_path = dir.file("good.safetensors");
  ASSERT_TRUE(saveCheckpoint(good_path, {{"a", a.view}, {"b", b.view}}, {{"step", "1"}}).isOk());
  std::string good = readFile(good_path);
  uint64_t n;
  std::memcpy(&n, good.data(), 8);
  auto errorOf = [&](const std::string& content) {
    std::string p = dir.write("bad.safetensors", content);
    auto c = loadCheckpoint(p);
    return c.isOk() ? std::string("ok") : c.status().message();
  };
  const std::string pre = "checkpoint '" + dir.file("bad.safetensors") + "': ";
  const std::string data(28, '\0');  // 16 + 12 bytes
  struct Case {
    std::string content, error;
  };
  std::vector<Case> cases = {
      {good.substr(0, 5), "truncated: 5 bytes, too short for the 8-byte header length"},
      {good.substr(0, 8 + n / 2),
       fmt::format("truncated: the header needs {} bytes but the file has {} after the length", n, n / 2)},
      {good.substr(0, good.size() - 4),
       "tensor 'b': data_offsets [16, 28] run past the 24 data bytes (truncated file?)"},
      {std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}",
       "header length 9223372036854775807 is implausible (corrupt file?)"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},)", data),
       "bad header: invalid JSON at byte"},
      {rawFile(R"([1, 2])", ""), "bad header: not a JSON object"},
      {rawFile(R"({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}})", "abcd"),
       "tensor 'a': unsupported dtype 'Q7'"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", "abcd"),
       "tensor 'a': shape entries must be non-negative integers"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", "abcd"),
       "tensor 'a': data_offsets [0, 4] hold 4 bytes but F32 [2] needs 8"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", "abcd"),
       "tensor 'a': bad data_offsets [4, 0]"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", "abcd"),
       "tensor 'a': 'data_offsets' must be [begin, end]"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1]}})", "abcd"),
       "tensor 'a': 'data_offsets' must be [begin, end]"},
      {rawFile(R"({"a": {"shape": [1], "data_offsets": [0, 4]}})", "abcd"),
       "tensor 'a': missing string 'dtype'"},
      {rawFile(
           R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "I32", "shape": [1], "data_offsets": [2, 6]}})",
           "abcdefgh"),
       "tensor 'b': its data overlaps another tensor's"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", "abcdefgh"),
       "tensor 'a': a gap of 4 bytes before its data"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", "abcdefgh"),
       "4 bytes of data follow the last tensor"},
      {rawFile(R"({"__metadata__": {"step": 5}})", ""), "metadata 'step' must be a string"},
      // Wrong JSON types are named errors too, never exceptions from the JSON library.
      {rawFile(R"({"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}})", "abcdefgh"),
       "tensor 'a': shape entries must be non-negative integers"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", "abcd"),
       "tensor 'a': shape entries must be non-negative integers"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": {"n": 1}, "data_offsets": [0, 4]}})", "abcd"),
       "tensor 'a': missing array 'shape'"},
      {rawFile(R"({"a": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})", "abcd"),
       "tensor 'a': missing string 'dtype'"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}})", "abcd"),
       "tensor 'a': 'data_offsets' must be [begin, end]"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551615]}})", "abcd"),
       "tensor 'a': 'data_offsets' must be [begin, end]"},
      {rawFile(R"({"a": 3})", ""), "tensor 'a': entry is not an object"},
      {rawFile(R"({"__metadata__": []})", ""), "'__metadata__' must be an object of strings"},
      // Two readers could disagree on which of two equal keys counts.
      {rawFile(
           R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}})",
           "abcd"),
       "bad header: duplicate key \"a\""},
      {rawFile(R"({"a": )" + std::string(100000, '['), ""),
       "bad header: invalid JSON: nested deeper than 64 levels"},
      {rawFile(R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 4]}})",
               "abcd"),
       "tensor 'a': shape [4611686018427387904,8] is impossibly large"},
  };
  for (const Case& c : cases) {
    std::string e = errorOf(c.content);
    EXPECT_EQ(e.rfind(pre + c.error, 0), 0u) << "want: " << c.error << "\n got: " << e;
    // The same bytes in memory (what the safetensors fuzzer runs) give the same error.
    auto in_memory = parseCheckpoint(c.content, dir.file("bad.safetensors"));
    EXPECT_EQ(in_memory.isOk() ? std::string("ok") : in_memory.status().message(), e);
  }
  EXPECT_EQ(errorOf(good), "ok");
  auto in_memory = parseCheckpoint(good, "good");
  ASSERT_TRUE(in_memory.isOk()) << in_memory.status().str();
  EXPECT_EQ(in_memory->find("a")->storage, a.storage);
  EXPECT_EQ(in_memory->find("b")->storage, b.storage);
  EXPECT_EQ(in_memory->metadata.at("step"), "1");
  auto missing = loadCheckpoint(dir.file("none.safetensors"));
  ASSERT_FALSE(missing.isOk());
  EXPECT_NE(missing.status().message().find("none.safetensors"), std::string::npos);
  // Metadata that is not UTF-8 cannot go into a JSON header: an error, not an exception.
  Status st = saveCheckpoint(dir.file("c.safetensors"), {{"a", a.view}}, {{"data_position", "file=\xff"}});
  ASSERT_FALSE(st.isOk());
  EXPECT_NE(st.message().find("UTF-8"), std::string::npos) << st.message();
  // A save into a folder that does not exist fails cleanly.
  EXPECT_FALSE(saveCheckpoint(dir.file("no/such/dir/c.safetensors"), {{"a", a.view}}, {}).isOk());
}

// The address space this process has mapped, in bytes.
size_t mappedBytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0;
  statm >> pages;
  return pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// Issue 12, found while fuzzing the safetensors header: the loader allocated each tensor as it
// read its entry, before checking that the tensors' data does not overlap, so a header naming
// the same bytes for many tensors made it allocate many times the file's size (and end in an
// uncaught std::bad_alloc). Under a memory limit far below that, the load must still end in the
// overlap error.
TEST(Checkpoint, OverlappingTensorsAreRejectedBeforeAllocating) {
  TempDir dir;
  constexpr int kTensors = 256;
  constexpr int64_t kFloats = 1 << 20;  // 4 MiB of data, claimed by every tensor: 1 GiB in all
  std::string header = "{";
  for (int i = 0; i < kTensors; ++i)
    header += fmt::format(R"({}"t{}": {{"dtype": "F32", "shape": [{}], "data_offsets": [0, {}]}})",
                          i ? ", " : "", i, kFloats, kFloats * 4);
  header += "}";
  const std::string path = dir.write("overlap.safetensors", rawFile(header, std::string(kFloats * 4, '\0')));
  EXPECT_EXIT(
      {
        // Room for the file's 4 MiB and the loader's own needs, not for 1 GiB of tensors.
        struct rlimit limit;
        ::getrlimit(RLIMIT_AS, &limit);
        limit.rlim_cur = mappedBytes() + (256u << 20);
        ::setrlimit(RLIMIT_AS, &limit);
        auto c = loadCheckpoint(path);
        bool overlap =
            !c.isOk() && c.status().message().find("its data overlaps another tensor's") != std::string::npos;
        std::_Exit(overlap ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace kiln::runtime
