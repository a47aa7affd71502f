// A timeline of a run in Chrome's trace-event format (`kiln train --trace FILE`), which Perfetto
// (ui.perfetto.dev) and chrome://tracing open: {"traceEvents": [...]} of "X" (complete) events
// with ts and dur in microseconds, and "M" (metadata) events naming each track.
//
// Tracks: one process per rank (pid = rank) and, inside it, one thread per track (tid):
// kHostTrack for the host's own phases (data wait, the step, evaluation, checkpoint save) and
// streamTrack(s) for each Program stream s, where the executors put every kernel and GEMM. A
// communication stream is a Program stream like any other, so its collectives land on their own
// track and a reader sees whether they overlap the compute of stream 0.
//
// Hook for the communicators (runtime/comm/): a collective records itself with collective(),
// from its issue to its completion, on the track of the stream it runs on (category
// "collective", its bytes on the wire as an argument); the time a rank blocks waiting on a
// request is a complete() of category Wait on the waiting track. In-process ranks share one
// Tracer (every call is thread-safe) and pass their own rank; MPI ranks each hold one.
//
// Recording can be switched off and on (the --trace-steps window): offered events are dropped
// while it is off, so the instrumented code needs no window logic of its own.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

enum class TraceCategory { Kernel, Gemm, Collective, Wait, Host, Data };

// "kernel", "gemm", "collective", "wait", "host", "data": the event's "cat".
std::string_view traceCategoryName(TraceCategory c);

// The host's track in every rank; Program stream s is track streamTrack(s).
inline constexpr int kHostTrack = 0;
constexpr int streamTrack(int stream) { return stream + 1; }

struct TraceEvent {
  std::string name;
  TraceCategory category = TraceCategory::Host;
  int rank = 0;
  int track = kHostTrack;
  double ts_us = 0;  // since the tracer's origin
  double dur_us = 0;
  std::vector<std::pair<std::string, int64_t>> args;  // shown in the viewer's details pane
};

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  Tracer() : origin_(Clock::now()) {}

  // Every event's clock: microseconds since the tracer was made.
  double toUs(Clock::time_point t) const {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  }
  double nowUs() const { return toUs(Clock::now()); }

  void setRecording(bool on) { recording_.store(on, std::memory_order_relaxed); }
  bool recording() const { return recording_.load(std::memory_order_relaxed); }

  // Adds one complete event (dropped while not recording).
  void complete(TraceEvent event);
  void complete(std::string name, TraceCategory category, int rank, int track, Clock::time_point begin,
                Clock::time_point end, std::vector<std::pair<std::string, int64_t>> args = {});
  // A collective from its issue to its completion (see the header comment).
  void collective(std::string name, int rank, int track, Clock::time_point begin, Clock::time_point end,
                  int64_t bytes);

  // Adds every event and track name of `other`, whatever this one's recording state, its times
  // moved onto this tracer's clock: in-process ranks each record into their own tracer (each
  // opens its own --trace-steps window) and rank 0 writes them as one file.
  void absorb(const Tracer& other);

  // Names a track ("stream 1 (embeddings)"); unnamed tracks are "host" and "stream N".
  void nameTrack(int rank, int track, std::string name);

  // Times a host phase from construction to destruction (or end()), recorded on destruction.
  class Scope {
   public:
    Scope(Tracer* tracer, std::string name, TraceCategory category, int rank = 0, int track = kHostTrack,
          std::vector<std::pair<std::string, int64_t>> args = {});
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope() { end(); }
    void end();

   private:
    Tracer* tracer_;  // null: a no-op scope (no --trace)
    TraceEvent event_;
    Clock::time_point begin_;
  };

  // The events so far, ordered by rank, track, start, longer first (an enclosing event precedes
  // the events it contains, as the viewers nest them).
  std::vector<TraceEvent> events() const;
  // The whole document, metadata events first.
  std::string json() const;
  // Writes json() to `path` atomically: a temporary file beside it, then a rename.
  Status write(const std::string& path) const;

 private:
  Clock::time_point origin_;
  std::atomic<bool> recording_{true};
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
  std::map<std::pair<int, int>, std::string> track_names_;
};

}  // namespace kiln::runtime
