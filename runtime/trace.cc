#include "runtime/trace.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

namespace kiln::runtime {

std::string_view traceCategoryName(TraceCategory c) {
  switch (c) {
    case TraceCategory::Kernel:
      return "kernel";
    case TraceCategory::Gemm:
      return "gemm";
    case TraceCategory::Collective:
      return "collective";
    case TraceCategory::Wait:
      return "wait";
    case TraceCategory::Host:
      return "host";
    case TraceCategory::Data:
      return "data";
  }
  return "host";
}

void Tracer::complete(TraceEvent event) {
  if (!recording()) return;
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::move(event));
}

void Tracer::complete(std::string name, TraceCategory category, int rank, int track, Clock::time_point begin,
                      Clock::time_point end, std::vector<std::pair<std::string, int64_t>> args) {
  if (!recording()) return;
  double ts = toUs(begin);
  complete(
      TraceEvent{std::move(name), category, rank, track, ts, std::max(toUs(end) - ts, 0.0), std::move(args)});
}

void Tracer::collective(std::string name, int rank, int track, Clock::time_point begin, Clock::time_point end,
                        int64_t bytes) {
  complete(std::move(name), TraceCategory::Collective, rank, track, begin, end, {{"bytes", bytes}});
}

void Tracer::absorb(const Tracer& other) {
  if (&other == this) return;
  const double shift = std::chrono::duration<double, std::micro>(other.origin_ - origin_).count();
  std::vector<TraceEvent> events;
  std::map<std::pair<int, int>, std::string> names;
  {
    std::lock_guard<std::mutex> lock(other.mu_);
    events = other.events_;
    names = other.track_names_;
  }
  for (TraceEvent& e : events) e.ts_us += shift;
  std::lock_guard<std::mutex> lock(mu_);
  events_.insert(events_.end(), std::make_move_iterator(events.begin()),
                 std::make_move_iterator(events.end()));
  track_names_.insert(names.begin(), names.end());
}

void Tracer::nameTrack(int rank, int track, std::string name) {
  std::lock_guard<std::mutex> lock(mu_);
  track_names_[{rank, track}] = std::move(name);
}

Tracer::Scope::Scope(Tracer* tracer, std::string name, TraceCategory category, int rank, int track,
                     std::vector<std::pair<std::string, int64_t>> args)
    : tracer_(tracer && tracer->recording() ? tracer : nullptr) {
  if (!tracer_) return;
  event_ = TraceEvent{std::move(name), category, rank, track, 0, 0, std::move(args)};
  begin_ = Clock::now();
}

void Tracer::Scope::end() {
  if (!tracer_) return;
  Clock::time_point end = Clock::now();
  event_.ts_us = tracer_->toUs(begin_);
  event_.dur_us = std::max(tracer_->toUs(end) - event_.ts_us, 0.0);
  tracer_->complete(std::move(event_));
  tracer_ = nullptr;
}

std::vector<TraceEvent> Tracer::events() const {
  std::vector<TraceEvent> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out = events_;
  }
  std::stable_sort(out.begin(), out.end(), [](const TraceEvent& a, const TraceEvent& b) {
    if (a.rank != b.rank) return a.rank < b.rank;
    if (a.track != b.track) return a.track < b.track;
    if (a.ts_us != b.ts_us) return a.ts_us < b.ts_us;
    return a.dur_us > b.dur_us;
  });
  return out;
}

std::string Tracer::json() const {
  using Json = nlohmann::json;
  std::vector<TraceEvent> events = this->events();
  std::map<std::pair<int, int>, std::string> names;
  {
    std::lock_guard<std::mutex> lock(mu_);
    names = track_names_;
  }
  // Every track that has an event gets a name, and every rank a process name; sort indices keep
  // ranks and tracks in numeric order in the viewers (they sort by name otherwise).
  std::set<std::pair<int, int>> tracks;
  for (const TraceEvent& e : events) tracks.insert({e.rank, e.track});
  for (const auto& [key, _] : names) tracks.insert(key);
  Json list = Json::array();
  auto meta = [&](const char* what, int pid, int tid, Json args) {
    Json m = {{"ph", "M"}, {"name", what}, {"pid", pid}, {"tid", tid}, {"args", std::move(args)}};
    list.push_back(std::move(m));
  };
  std::set<int> ranks;
  for (const auto& [rank, track] : tracks) {
    if (ranks.insert(rank).second) {
      meta("process_name", rank, 0, {{"name", fmt::format("rank {}", rank)}});
      meta("process_sort_index", rank, 0, {{"sort_index", rank}});
    }
    auto it = names.find({rank, track});
    std::string name = it != names.end()     ? it->second
                       : track == kHostTrack ? std::string("host")
                                             : fmt::format("stream {}", track - 1);
    meta("thread_name", rank, track, {{"name", name}});
    meta("thread_sort_index", rank, track, {{"sort_index", track}});
  }
  for (const TraceEvent& e : events) {
    Json x = {{"ph", "X"},      {"name", e.name}, {"cat", traceCategoryName(e.category)},
              {"pid", e.rank},  {"tid", e.track}, {"ts", e.ts_us},
              {"dur", e.dur_us}};
    if (!e.args.empty()) {
      Json args = Json::object();
      for (const auto& [k, v] : e.args) args[k] = v;
      x["args"] = std::move(args);
    }
    list.push_back(std::move(x));
  }
  Json doc = {{"traceEvents", std::move(list)}, {"displayTimeUnit", "ms"}};
  // Names come from op and kernel names; replace rather than throw on a stray byte.
  return doc.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

Status Tracer::write(const std::string& path) const {
  std::string text = json();
  // Beside the target, so the rename stays on one file system and a reader never sees half a file.
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::errorf("cannot create '{}': {}", tmp, std::strerror(errno));
  Status st = Status::ok();
  for (size_t done = 0; done < text.size();) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      st = Status::errorf("cannot write '{}': {}", tmp, std::strerror(errno));
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0 && st) st = Status::errorf("cannot close '{}': {}", tmp, std::strerror(errno));
  if (st && std::rename(tmp.c_str(), path.c_str()) != 0)
    st = Status::errorf("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(errno));
  if (!st) ::unlink(tmp.c_str());
  return st;
}

}  // namespace kiln::runtime
