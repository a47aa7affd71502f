// The payload of a compiled model (runtime/payload.h): sections appended to a runner file and
// read back; a foreign, truncated, damaged or other-version file is an error, never a crash.
#include "runtime/payload.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace kiln::runtime {
namespace {

using ::testing::HasSubstr;

class PayloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kiln_payload_test." + std::to_string(::getpid()) + "." +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    // A stand-in runner: any bytes, of a length that is not a multiple of the alignment.
    runner_ = (dir_ / "runner").string();
    std::vector<uint8_t> bytes(1001);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
    write(runner_, bytes);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::vector<uint8_t> read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  static void write(const std::string& path, const std::vector<uint8_t>& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  // A payload of three sections (one empty) appended to the runner.
  std::string compiled() {
    PayloadWriter w;
    w.add("meta.json", std::string_view(R"({"name":"m"})"));
    std::vector<uint8_t> big(100000);
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
    w.add("weights", big);
    w.add("empty", std::vector<uint8_t>{});
    const std::string out = (dir_ / "model").string();
    EXPECT_TRUE(w.writeAppended(runner_, out, true).isOk());
    return out;
  }

  std::filesystem::path dir_;
  std::string runner_;
};

TEST_F(PayloadTest, SectionsRoundTripAfterTheRunnerBytes) {
  const std::string out = compiled();
  auto p = Payload::open(out);
  ASSERT_TRUE(p.isOk()) << p.status().str();
  EXPECT_EQ(p->version(), kPayloadVersion);
  EXPECT_EQ(p->names(), (std::vector<std::string>{"meta.json", "weights", "empty"}));
  auto meta = p->text("meta.json");
  ASSERT_TRUE(meta.isOk());
  EXPECT_EQ(*meta, R"({"name":"m"})");
  auto weights = p->section("weights");
  ASSERT_TRUE(weights.isOk());
  ASSERT_EQ(weights->size(), 100000u);
  for (size_t i = 0; i < weights->size(); i += 997)
    ASSERT_EQ((*weights)[i], static_cast<uint8_t>((i * 2654435761u) >> 13)) << i;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(weights->data()) % 64, 0u) << "sections are aligned for in-place use";
  EXPECT_TRUE(p->section("empty").isOk());
  EXPECT_EQ(p->sectionSize("weights"), 100000u);
  EXPECT_FALSE(p->has("nothing"));
  auto missing = p->section("nothing");
  ASSERT_FALSE(missing.isOk());
  EXPECT_THAT(missing.status().message(), HasSubstr("no section 'nothing'"));
  // The runner's bytes come first, unchanged, and the file is executable.
  std::vector<uint8_t> file = read(out), runner = read(runner_);
  ASSERT_GT(file.size(), runner.size());
  EXPECT_TRUE(std::equal(runner.begin(), runner.end(), file.begin()));
  EXPECT_NE(std::filesystem::status(out).permissions() & std::filesystem::perms::owner_exec,
            std::filesystem::perms::none);
}

TEST_F(PayloadTest, ARunnerThatCarriesAPayloadGetsItReplaced) {
  const std::string first = compiled();
  PayloadWriter w;
  w.add("only", std::string_view("x"));
  const std::string second = (dir_ / "second").string();
  ASSERT_TRUE(w.writeAppended(first, second, false).isOk());
  auto p = Payload::open(second);
  ASSERT_TRUE(p.isOk()) << p.status().str();
  EXPECT_EQ(p->names(), std::vector<std::string>{"only"});
  EXPECT_LT(read(second).size(), read(first).size());
}

TEST_F(PayloadTest, AForeignOrShortFileHasNoPayload) {
  auto r = Payload::open(runner_);
  ASSERT_FALSE(r.isOk());
  EXPECT_THAT(r.status().message(), HasSubstr("no Kiln payload"));
  EXPECT_THAT(r.status().message(), HasSubstr(runner_));
  const std::string tiny = (dir_ / "tiny").string();
  write(tiny, {1, 2, 3});
  r = Payload::open(tiny);
  ASSERT_FALSE(r.isOk());
  EXPECT_THAT(r.status().message(), HasSubstr("no Kiln payload"));
  r = Payload::open((dir_ / "absent").string());
  ASSERT_FALSE(r.isOk());
  EXPECT_THAT(r.status().message(), HasSubstr("No such file"));
}

TEST_F(PayloadTest, AnotherVersionIsNamed) {
  const std::string out = compiled();
  std::vector<uint8_t> bytes = read(out);
  bytes[bytes.size() - 12] = 7;  // the footer's version (u32 before the 8-byte magic)
  write(out, bytes);
  auto r = Payload::open(out);
  ASSERT_FALSE(r.isOk());
  EXPECT_THAT(r.status().message(), HasSubstr("payload version 7"));
  EXPECT_THAT(r.status().message(), HasSubstr("recompile"));
}

TEST_F(PayloadTest, TruncationIsAnErrorAtEveryLength) {
  const std::string out = compiled();
  const std::vector<uint8_t> bytes = read(out);
  const std::string cut = (dir_ / "cut").string();
  // Cut anywhere, the footer is gone or misplaced: never read as a payload.
  for (size_t n :
       {size_t{0}, size_t{39}, size_t{40}, bytes.size() / 2, bytes.size() - 41, bytes.size() - 1}) {
    write(cut, std::vector<uint8_t>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n)));
    EXPECT_FALSE(Payload::open(cut).isOk()) << "cut to " << n << " bytes";
  }
  // Cut from the front (the footer intact but its offset now past the data).
  write(cut, std::vector<uint8_t>(bytes.begin() + 64, bytes.end()));
  auto r = Payload::open(cut);
  ASSERT_FALSE(r.isOk());
  EXPECT_THAT(r.status().message(), HasSubstr("damaged"));
}

TEST_F(PayloadTest, AFlippedByteIsCaughtByTheTableOrTheSectionChecksum) {
  const std::string out = compiled();
  const std::vector<uint8_t> bytes = read(out);
  auto good = Payload::open(out);
  ASSERT_TRUE(good.isOk());
  const size_t payload_start = bytes.size() - 40 - good->size();
  const std::string bad = (dir_ / "bad").string();
  // Every byte of the header, table and footer: open fails or, if it opens (a flipped alignment
  // pad), every section still reads back intact or fails its checksum. Never a crash.
  std::vector<size_t> positions;
  for (size_t i = payload_start; i < payload_start + 256; ++i) positions.push_back(i);
  for (size_t i = payload_start + 256; i < payload_start + 90000; i += 4099) positions.push_back(i);
  for (size_t i = bytes.size() - 40; i < bytes.size(); ++i) positions.push_back(i);
  for (size_t i : positions) {
    std::vector<uint8_t> b = bytes;
    b[i] ^= 0x5a;
    write(bad, b);
    auto p = Payload::open(bad);
    if (!p.isOk()) continue;
    bool all_intact = true;
    for (const std::string& name : p->names()) {
      auto s = p->section(name);
      if (!s.isOk()) {
        EXPECT_THAT(s.status().message(), HasSubstr("fails its checksum"));
        all_intact = false;
      }
    }
    // Inside the weights every byte counts.
    if (i >= payload_start + 256 && i < bytes.size() - 40) {
      EXPECT_FALSE(all_intact) << "a data byte at " << i;
    }
  }
}

TEST(PayloadHash, DiffersOnAnySingleBitAndOnLength) {
  std::vector<uint8_t> data(133);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i);
  const uint64_t h = payloadHash(data.data(), data.size());
  for (size_t i = 0; i < data.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      data[i] ^= static_cast<uint8_t>(1 << bit);
      ASSERT_NE(payloadHash(data.data(), data.size()), h) << i << ":" << bit;
      data[i] ^= static_cast<uint8_t>(1 << bit);
    }
  EXPECT_NE(payloadHash(data.data(), data.size() - 1), h);
  EXPECT_EQ(payloadHash(data.data(), data.size()), h);
}

}  // namespace
}  // namespace kiln::runtime
