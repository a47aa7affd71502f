// The pieces that keep one run from losing another's work (issue 12): the checkpoint directory
// lock, the record of a run's inputs that resume checks, and saves that leave the old checkpoint
// whole when the disk refuses the new one.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "runtime/checkpoint.h"
#include "runtime/dir_lock.h"
#include "runtime/run_inputs.h"
#include "test_util.h"

namespace kiln::runtime {
namespace {

using data::testing::readFile;
using data::testing::TempDir;

std::vector<std::string> listDir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(DirLock, ASecondWriterFailsNamingTheFirst) {
  TempDir dir;
  std::vector<std::string> notes;
  auto first = DirLock::acquire(dir.file(""), &notes);
  ASSERT_TRUE(first.isOk()) << first.status().str();
  EXPECT_TRUE(first->held());
  EXPECT_TRUE(notes.empty());
  // flock locks belong to an open file: a second open in this process conflicts like another
  // process would.
  auto second = DirLock::acquire(dir.file(""), &notes);
  ASSERT_FALSE(second.isOk());
  EXPECT_NE(
      second.status().message().find("is in use by another kiln process (pid " + std::to_string(::getpid())),
      std::string::npos)
      << second.status().message();
  // The failed attempt left the holder's name in place.
  EXPECT_NE(readFile(dir.file("kiln.lock")).find("pid " + std::to_string(::getpid())), std::string::npos);
}

TEST(DirLock, ReleasedCleanlyItIsTakenWithoutAWarning) {
  TempDir dir;
  std::vector<std::string> notes;
  { ASSERT_TRUE(DirLock::acquire(dir.file(""), &notes).isOk()); }
  EXPECT_EQ(readFile(dir.file("kiln.lock")), "");
  auto again = DirLock::acquire(dir.file(""), &notes);
  ASSERT_TRUE(again.isOk());
  EXPECT_TRUE(notes.empty());
}

TEST(DirLock, ADeadHoldersLockIsTakenOverAndItsTemporariesRemoved) {
  TempDir dir;
  // What a holder killed mid-save leaves: its name in the lock file (the kernel dropped the lock
  // itself) and a temporary checkpoint.
  dir.write("kiln.lock", "pid 4242 on host elsewhere since 2026-01-01 00:00:00 UTC\n");
  dir.write("checkpoint.safetensors.tmp.4242", std::string(1000, 'x'));
  dir.write(".kiln-write-test.4242", "x");
  // Not Kiln's, or not stale: left alone.
  dir.write("notes.tmp.4242", "keep");
  dir.write("checkpoint.safetensors.tmp.12ab", "keep");
  dir.write("checkpoint.safetensors", "keep");
  std::vector<std::string> notes;
  auto lock = DirLock::acquire(dir.file(""), &notes);
  ASSERT_TRUE(lock.isOk()) << lock.status().str();
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[0].find("took over the lock"), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("pid 4242 on host elsewhere"), std::string::npos) << notes[0];
  EXPECT_NE(notes[1].find("removed 2 temporary files (1001 bytes)"), std::string::npos) << notes[1];
  EXPECT_EQ(listDir(dir.file("")),
            (std::vector<std::string>{"checkpoint.safetensors", "checkpoint.safetensors.tmp.12ab",
                                      "kiln.lock", "notes.tmp.4242"}));
}

TEST(RunInputs, Fnv1a64MatchesThePublishedVectors) {
  // From the FNV reference test suite (Fowler, Noll, Vo).
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar", 6), 0x85944171f73967e8ull);
}

TEST(RunInputs, RoundTripsThroughMetadataAndFindsEachDifference) {
  TempDir dir;
  std::string a = dir.write("a.tsv", "1\t2\n3\t4\n"), b = dir.write("b.tsv", "5\t6\n");
  auto saved = RunInputs::describe("dlrm", 7, 256, {a, b});
  ASSERT_TRUE(saved.isOk()) << saved.status().str();
  EXPECT_EQ(saved->files[0].size, 8u);
  EXPECT_EQ(saved->files[0].head_hash, fnv1a64("1\t2\n3\t4\n", 8));
  std::map<std::string, std::string> meta;
  saved->toMetadata(meta);
  bool recorded = false;
  auto back = RunInputs::fromMetadata(meta, &recorded);
  ASSERT_TRUE(back.isOk()) << back.status().str();
  EXPECT_TRUE(recorded);
  EXPECT_EQ(back->files, saved->files);
  EXPECT_EQ(back->seed, 7u);
  EXPECT_TRUE(compareRunInputs(*back, *saved).empty());

  // The same bytes under another name are the same data.
  std::filesystem::copy_file(a, dir.file("moved.tsv"));
  auto moved = RunInputs::describe("dlrm", 7, 256, {dir.file("moved.tsv"), b});
  EXPECT_TRUE(compareRunInputs(*back, *moved).empty());
  EXPECT_TRUE(sameData(*back, *moved));

  // Another seed, batch, order of files, and a file grown by a line: each one named.
  dir.write("b.tsv", "5\t6\n7\t8\n");
  auto now = RunInputs::describe("dlrm", 8, 128, {b, a});
  std::vector<std::string> diffs = compareRunInputs(*back, *now);
  ASSERT_EQ(diffs.size(), 4u);
  EXPECT_EQ(diffs[0], "the seed is 8, the checkpoint's is 7");
  EXPECT_EQ(diffs[1], "the batch is 128, the checkpoint's is 256");
  EXPECT_NE(diffs[2].find("data file 1 is '" + b + "' (8 bytes"), std::string::npos) << diffs[2];
  EXPECT_NE(diffs[3].find("data file 2 is '" + a + "'"), std::string::npos) << diffs[3];
  EXPECT_FALSE(sameData(*back, *now));

  auto synthetic = RunInputs::describe("dlrm", 7, 256, {"synthetic"});
  ASSERT_TRUE(synthetic.isOk());
  EXPECT_EQ(compareRunInputs(*back, *synthetic),
            (std::vector<std::string>{"the data is synthetic, the checkpoint's was read from files"}));
}

TEST(RunInputs, MalformedMetadataIsAnError) {
  bool recorded = true;
  std::map<std::string, std::string> meta{{"model", "m"}, {"seed", "1"}, {"batch", "8"}};
  auto old = RunInputs::fromMetadata(meta, &recorded);
  ASSERT_TRUE(old.isOk());
  EXPECT_FALSE(recorded);
  meta["batch"] = "99999999999999999999";
  EXPECT_NE(RunInputs::fromMetadata(meta, &recorded)
                .status()
                .message()
                .find("'batch' in the checkpoint metadata is out of range"),
            std::string::npos);
  meta["batch"] = "8x";
  EXPECT_NE(RunInputs::fromMetadata(meta, &recorded).status().message().find("bad 'batch'"),
            std::string::npos);
  meta["batch"] = "8";
  for (const char* files :
       {"{", "{}", "[{\"path\": 1}]", "[{\"path\":\"a\",\"size\":-1,\"head_fnv1a64\":\"00\"}]",
        "[{\"path\":\"a\",\"size\":1,\"head_fnv1a64\":\"zz\"}]"}) {
    meta["data_files"] = files;
    auto r = RunInputs::fromMetadata(meta, &recorded);
    ASSERT_FALSE(r.isOk()) << files;
    EXPECT_NE(r.status().message().find("bad 'data_files'"), std::string::npos) << r.status().message();
  }
}

// A save the file system refuses (here RLIMIT_FSIZE, as `ulimit -f`; a full disk fails the same
// write) returns an error and leaves the last checkpoint as it was, with no temporary file.
TEST(Checkpoint, ASaveRefusedByTheDiskKeepsTheOldCheckpoint) {
  TempDir dir;
  std::vector<float> small(16, 1.0f), big(64 * 1024, 2.0f);
  auto view = [](std::vector<float>& v) {
    return ir::TensorView{ir::DType::f32, {static_cast<int64_t>(v.size())}, v.data()};
  };
  const std::string path = dir.file("checkpoint.safetensors");
  ASSERT_TRUE(saveCheckpoint(path, {{"w", view(small)}}, {{"step", "1"}}).isOk());
  const std::string before = readFile(path);

  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{64 * 1024, 64 * 1024};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    Status probe = prepareCheckpointDir(dir.file(""), 256 * 1024);
    Status save = saveCheckpoint(path, {{"w", view(big)}}, {{"step", "2"}});
    bool ok = !probe.isOk() && probe.message().find("File too large") != std::string::npos && !save.isOk() &&
              save.message().find("File too large") != std::string::npos;
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the probe and the save should both fail with EFBIG";
  EXPECT_EQ(readFile(path), before);
  EXPECT_EQ(listDir(dir.file("")), std::vector<std::string>{"checkpoint.safetensors"});
}

}  // namespace
}  // namespace kiln::runtime
