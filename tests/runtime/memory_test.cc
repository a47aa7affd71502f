// Issue 12, defect 2: the memory accounting the run checks before it allocates. Sizes as users
// write them, /proc and cgroup files parsed from strings (as a machine with those limits would
// show them), and the message of a run that does not fit.
#include "runtime/memory.h"

#include <gtest/gtest.h>

namespace kiln::runtime {
namespace {

TEST(Memory, ParsesSizesAsUsersWriteThem) {
  const std::pair<const char*, uint64_t> cases[] = {
      {"1.5GiB", 1610612736},
      {"8G", 8589934592},
      {"512M", 536870912},
      {"100k", 102400},
      {"1KB", 1000},
      {"2gb", 2000000000},
      {"4000000000", 4000000000},
      {"3Ki", 3072},
      {"7b", 7},
      {"0.5KiB", 512},
      {" 1T ", 1099511627776},
      {"15EiB", 15ull << 60},
      {"18446744073709551615", 18446744073709551615ull},
  };
  for (const auto& [text, bytes] : cases) {
    auto v = parseByteSize(text);
    ASSERT_TRUE(v) << text << ": " << v.status().message();
    EXPECT_EQ(*v, bytes) << text;
  }
  for (const char* bad : {"", "G", "12XB", "-5", "1.2.3", "1.", "8 GB extra", "0", "0.0001"}) {
    auto v = parseByteSize(bad);
    EXPECT_FALSE(v) << "'" << bad << "' gave " << *v;
  }
  // Beyond 2^64: an error, never a wrapped count.
  for (const char* huge : {"16EiB", "99999999999999999999999", "18446744073709551616", "20000000000G"}) {
    auto v = parseByteSize(huge);
    ASSERT_FALSE(v) << huge << " gave " << *v;
    EXPECT_NE(v.status().message().find("2^64-1"), std::string::npos) << v.status().message();
  }
}

TEST(Memory, FormatsSizesInBinaryUnits) {
  EXPECT_EQ(formatBytes(0), "0 bytes");
  EXPECT_EQ(formatBytes(1), "1 byte");
  EXPECT_EQ(formatBytes(1023), "1023 bytes");
  EXPECT_EQ(formatBytes(1536), "1.5 KiB");
  EXPECT_EQ(formatBytes(512ull << 20), "512 MiB");
  EXPECT_EQ(formatBytes(105561493568), "98.3 GiB");
  EXPECT_EQ(formatBytes(UINT64_MAX), "16 EiB");
}

TEST(Memory, ReadsMemAvailableFromMeminfo) {
  const char* meminfo =
      "MemTotal:       24576000 kB\n"
      "MemFree:         1000000 kB\n"
      "MemAvailable:   20000000 kB\n"
      "Buffers:          123456 kB\n";
  EXPECT_EQ(parseMemAvailable(meminfo), uint64_t{20000000} * 1024);
  EXPECT_EQ(parseMemAvailable("MemTotal: 5 kB\n"), std::nullopt);  // kernels before 3.14
  EXPECT_EQ(parseMemAvailable("MemAvailable: lots\n"), std::nullopt);
  EXPECT_EQ(parseStatusKb("Name:\tkiln\nVmSize:\t  189440 kB\nVmData:\t 1024 kB\n", "VmSize"),
            uint64_t{189440} * 1024);
  EXPECT_EQ(parseStatusKb("VmSizeX:\t 1 kB\n", "VmSize"), std::nullopt);
}

TEST(Memory, ReadsCgroupLimitsAndUsage) {
  // v2 memory.max, v1 memory.limit_in_bytes.
  EXPECT_EQ(parseCgroupLimit("max\n"), std::nullopt);
  EXPECT_EQ(parseCgroupLimit("8589934592\n"), uint64_t{8589934592});
  EXPECT_EQ(parseCgroupLimit("9223372036854771712\n"), std::nullopt);  // v1's "no limit"
  EXPECT_EQ(parseCgroupLimit("garbage"), std::nullopt);
  EXPECT_EQ(parseCgroupNumber("82812928\n"), uint64_t{82812928});
  const char* stat = "anon 1000\nfile 5000\ninactive_file 4096\nactive_file 904\n";
  EXPECT_EQ(parseKeyValue(stat, "inactive_file"), uint64_t{4096});
  EXPECT_EQ(parseKeyValue(stat, "file"), uint64_t{5000});
  EXPECT_EQ(parseKeyValue(stat, "total_inactive_file"), std::nullopt);

  // A pure v2 host, and a hybrid one whose v1 memory controller has its own path.
  CgroupPaths v2 = parseProcSelfCgroup("0::/user.slice/user-1000.slice/session-3.scope\n");
  EXPECT_EQ(v2.v2, "/user.slice/user-1000.slice/session-3.scope");
  EXPECT_EQ(v2.v1_memory, "");
  CgroupPaths hybrid = parseProcSelfCgroup(
      "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/9151e1\n2:cpu,cpuacct:/\n0::/\n");
  EXPECT_EQ(hybrid.v1_memory, "/process_api/9151e1");
  EXPECT_EQ(hybrid.v2, "/");
  EXPECT_EQ(parseProcSelfCgroup("3:cpu,memory:/docker/abc\n").v1_memory, "/docker/abc");
}

MemoryNeed exampleNeed() {
  MemoryNeed need;
  need.add("parameter \"tables.0\"", "weights", 20480000000);
  need.add("parameter \"tables.0.rowwise_adagrad_sum\"", "optimizer state", 160000000);
  need.add("parameter \"tables.9\"", "weights", 20480000000);
  need.add("@train_step's activations", "activations", 46000000);
  need.add("parameter \"tables.10\"", "weights", 1570793472);
  need.add("6 batches of 256 samples", "data buffers", 2700000);
  return need;
}

TEST(Memory, ARunThatFitsIsOk) {
  MemoryNeed need = exampleNeed();
  const uint64_t total = 20480000000ull * 2 + 160000000 + 46000000 + 1570793472 + 2700000;
  EXPECT_EQ(need.total(), total);
  EXPECT_TRUE(checkMemoryFits(need, MemoryLimit{total, "--memory-limit"}).isOk());
  EXPECT_TRUE(checkMemoryFits(need, MemoryLimit{std::nullopt, ""}).isOk());  // nothing limits it
}

TEST(Memory, ARunThatDoesNotFitNamesTheLargestTheTotalTheLimitAndTheShortfall) {
  MemoryNeed need = exampleNeed();
  const uint64_t total = *need.total(), limit = 23ull << 30;
  Status s = checkMemoryFits(need, MemoryLimit{limit, "MemAvailable in /proc/meminfo"});
  ASSERT_FALSE(s.isOk());
  const std::string& m = s.message();
  EXPECT_NE(m.find(fmt::format("the run needs 39.8 GiB ({} bytes)", total)), std::string::npos) << m;
  EXPECT_NE(m.find(fmt::format("23 GiB ({} bytes) are available", limit)), std::string::npos) << m;
  EXPECT_NE(m.find(fmt::format("({} bytes) short", total - limit)), std::string::npos) << m;
  EXPECT_NE(m.find("limit: MemAvailable in /proc/meminfo"), std::string::npos) << m;
  // The three largest, largest first; the fourth is not named.
  size_t t0 = m.find("parameter \"tables.0\" (weights): 19.1 GiB (20480000000 bytes)");
  size_t t9 = m.find("parameter \"tables.9\" (weights): 19.1 GiB (20480000000 bytes)");
  size_t t10 = m.find("parameter \"tables.10\" (weights): 1.46 GiB (1570793472 bytes)");
  ASSERT_NE(t0, std::string::npos) << m;
  ASSERT_NE(t9, std::string::npos) << m;
  ASSERT_NE(t10, std::string::npos) << m;
  EXPECT_LT(t0, t9);
  EXPECT_LT(t9, t10);
  EXPECT_EQ(m.find("rowwise_adagrad_sum"), std::string::npos) << m;
  EXPECT_NE(
      m.find(
          "by kind: weights 39.6 GiB; optimizer state 153 MiB; activations 43.9 MiB; data buffers 2.57 MiB"),
      std::string::npos)
      << m;
}

TEST(Memory, ATotalBeyond64BitsIsReportedNotWrapped) {
  MemoryNeed need;
  need.add("a", "weights", UINT64_MAX - 10);
  need.add("b", "weights", 11);
  EXPECT_EQ(need.total(), std::nullopt);
  Status s = checkMemoryFits(need, MemoryLimit{std::nullopt, ""});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("more than 2^64-1 bytes"), std::string::npos) << s.message();
}

TEST(Memory, TheFlagLimitsWhatTheMachineHas) {
  MemoryLimit one = availableMemory(uint64_t{1});
  EXPECT_EQ(one.bytes, uint64_t{1});
  EXPECT_EQ(one.source, "--memory-limit");
  MemoryLimit machine = availableMemory(std::nullopt);
  if (machine.bytes) {
    EXPECT_FALSE(machine.source.empty());
  }
}

}  // namespace
}  // namespace kiln::runtime
