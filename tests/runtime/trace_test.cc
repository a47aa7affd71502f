// The Tracer: its events, the Chrome trace-event JSON it writes (read back by runtime/json.h),
// units, ordering, recording on and off, several threads at once, the atomic write.
#include "runtime/trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "runtime/json.h"

namespace kiln::runtime {
namespace {

using Clock = Tracer::Clock;
using json::Json;

Json parseTrace(const Tracer& t) {
  auto doc = json::parse(t.json());
  EXPECT_TRUE(doc.isOk()) << doc.status().message();
  return doc.isOk() ? *doc : Json();
}

// The "X" events of a document, in file order.
std::vector<Json> completeEvents(const Json& doc) {
  std::vector<Json> out;
  for (const Json& e : doc.at("traceEvents"))
    if (e.at("ph") == "X") out.push_back(e);
  return out;
}

TEST(TracerTest, WritesCompleteEventsWithTheirFields) {
  Tracer t;
  Clock::time_point begin = Clock::now();
  Clock::time_point end = begin + std::chrono::microseconds(1500);
  t.complete("kiln.matmul", TraceCategory::Gemm, 2, streamTrack(1), begin, end, {{"seq", 7}});
  Json doc = parseTrace(t);
  std::vector<Json> x = completeEvents(doc);
  ASSERT_EQ(x.size(), 1u);
  EXPECT_EQ(x[0].at("name"), "kiln.matmul");
  EXPECT_EQ(x[0].at("cat"), "gemm");
  EXPECT_EQ(x[0].at("pid"), 2);
  EXPECT_EQ(x[0].at("tid"), 2);  // stream 1
  EXPECT_NEAR(x[0].at("dur").get<double>(), 1500.0, 1e-3);
  EXPECT_EQ(x[0].at("args").at("seq"), 7);
}

TEST(TracerTest, NamesEveryRankAndTrack) {
  Tracer t;
  Clock::time_point now = Clock::now();
  t.complete("a", TraceCategory::Host, 0, kHostTrack, now, now);
  t.complete("b", TraceCategory::Kernel, 0, streamTrack(0), now, now);
  t.complete("c", TraceCategory::Collective, 1, streamTrack(2), now, now);
  t.nameTrack(1, streamTrack(2), "comm");
  Json doc = parseTrace(t);
  std::map<std::pair<int, int>, std::string> threads;
  std::map<int, std::string> processes;
  for (const Json& e : doc.at("traceEvents")) {
    if (e.at("ph") != "M") continue;
    if (e.at("name") == "thread_name")
      threads[{e.at("pid").get<int>(), e.at("tid").get<int>()}] = e.at("args").at("name").get<std::string>();
    if (e.at("name") == "process_name")
      processes[e.at("pid").get<int>()] = e.at("args").at("name").get<std::string>();
  }
  EXPECT_EQ(processes, (std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}}));
  EXPECT_EQ(threads, (std::map<std::pair<int, int>, std::string>{
                         {{0, 0}, "host"}, {{0, 1}, "stream 0"}, {{1, 3}, "comm"}}));
}

TEST(TracerTest, ScopesMeasureMicrosecondsAndNest) {
  Tracer t;
  {
    Tracer::Scope outer(&t, "step 1", TraceCategory::Host);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    {
      Tracer::Scope inner(&t, "data wait", TraceCategory::Data);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Recorded on destruction, so the inner event came first; the file lists the outer first.
  std::vector<Json> x = completeEvents(parseTrace(t));
  ASSERT_EQ(x.size(), 2u);
  EXPECT_EQ(x[0].at("name"), "step 1");
  EXPECT_EQ(x[1].at("name"), "data wait");
  EXPECT_EQ(x[1].at("cat"), "data");
  double inner_ts = x[1].at("ts").get<double>(), inner_dur = x[1].at("dur").get<double>();
  double outer_ts = x[0].at("ts").get<double>(), outer_dur = x[0].at("dur").get<double>();
  // 20 ms is 20000 us (a loaded machine may sleep longer, not shorter).
  EXPECT_GE(inner_dur, 20000.0);
  EXPECT_LT(inner_dur, 2e6);
  EXPECT_GE(outer_dur, inner_dur + 4000.0);
  EXPECT_GE(inner_ts, outer_ts + 2000.0);
  EXPECT_LE(inner_ts + inner_dur, outer_ts + outer_dur);
}

TEST(TracerTest, OrdersByTrackThenStartWithEnclosingEventsFirst) {
  Tracer t;
  Clock::time_point t0 = Clock::now();
  auto at = [&](int us) { return t0 + std::chrono::microseconds(us); };
  t.complete("late", TraceCategory::Kernel, 0, 1, at(50), at(60));
  t.complete("child", TraceCategory::Kernel, 0, 1, at(10), at(20));
  t.complete("parent", TraceCategory::Host, 0, 1, at(10), at(40));
  t.complete("host", TraceCategory::Host, 0, 0, at(70), at(80));
  std::vector<std::string> names;
  for (const TraceEvent& e : t.events()) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"host", "parent", "child", "late"}));
}

TEST(TracerTest, DropsEventsWhileNotRecording) {
  Tracer t;
  t.setRecording(false);
  Clock::time_point now = Clock::now();
  t.complete("dropped", TraceCategory::Kernel, 0, 1, now, now);
  { Tracer::Scope s(&t, "dropped scope", TraceCategory::Host); }
  t.setRecording(true);
  t.collective("all_reduce", 0, 3, now, now + std::chrono::microseconds(5), 4096);
  std::vector<TraceEvent> events = t.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].name, "all_reduce");
  EXPECT_EQ(events[0].category, TraceCategory::Collective);
  EXPECT_EQ(events[0].args, (std::vector<std::pair<std::string, int64_t>>{{"bytes", 4096}}));
  // A scope without a tracer does nothing.
  Tracer::Scope none(nullptr, "nothing", TraceCategory::Host);
  none.end();
}

TEST(TracerTest, SeveralThreadsAtOnce) {
  Tracer t;
  constexpr int kThreads = 4, kEach = 2000;
  std::vector<std::thread> threads;
  for (int r = 0; r < kThreads; ++r)
    threads.emplace_back([&t, r] {
      for (int i = 0; i < kEach; ++i)
        Tracer::Scope s(&t, "op", TraceCategory::Kernel, r, streamTrack(0), {{"i", i}});
    });
  for (std::thread& th : threads) th.join();
  std::vector<Json> x = completeEvents(parseTrace(t));
  ASSERT_EQ(x.size(), static_cast<size_t>(kThreads * kEach));
  std::map<int, std::set<int64_t>> seen;
  for (const Json& e : x) seen[e.at("pid").get<int>()].insert(e.at("args").at("i").get<int64_t>());
  ASSERT_EQ(seen.size(), static_cast<size_t>(kThreads));
  for (const auto& [rank, is] : seen) EXPECT_EQ(is.size(), static_cast<size_t>(kEach)) << "rank " << rank;
}

TEST(TracerTest, WritesAtomically) {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("kiln_trace_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::string path = (dir / "trace.json").string();
  {
    std::ofstream old(path);
    old << "the previous trace";
  }
  Tracer t;
  Clock::time_point now = Clock::now();
  t.complete("step 2", TraceCategory::Host, 0, kHostTrack, now, now + std::chrono::microseconds(3));
  ASSERT_TRUE(t.write(path).isOk());
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto doc = json::parse(text.str());
  ASSERT_TRUE(doc.isOk()) << doc.status().message();
  EXPECT_EQ(completeEvents(*doc).size(), 1u);
  // Only the trace is left: the temporary file was renamed over it.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()),
            1);
  // A directory that does not exist is an error, not a crash, and the old file is untouched.
  Status bad = t.write((dir / "missing" / "trace.json").string());
  EXPECT_FALSE(bad.isOk());
  EXPECT_NE(bad.message().find("cannot create"), std::string::npos) << bad.message();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln::runtime
