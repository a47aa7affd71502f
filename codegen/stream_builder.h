// Builds a Program's per-stream instruction lists from launches given in one global order (a
// valid serial execution), adding the events that keep a run of the streams side by side equal
// to that order (ir::StreamHazards): a launch waits for the last writer of each buffer it reads,
// and one that writes buffers in place also for their readers since; of each other stream only
// the latest such launch is waited for, since a stream runs in order. Used by the CPU lowering
// (codegen/lower_cpu.cc) and the CUDA executor's Program (runtime/cuda/cuda_executor.cc).
#pragma once

#include <map>
#include <utility>
#include <vector>

#include "codegen/program.h"
#include "ir/arena_plan.h"

namespace kiln::codegen {

class StreamBuilder {
 public:
  // Adds `in` (a launch over buffer ids) on `stream`, after the waits its buffers need;
  // `written_in_place` are the operands it updates in place. Returns its position.
  int launch(int stream, Instruction in, const std::vector<int>& written_in_place = {});
  // `stream` waits for the instruction at `at`, unless it already waited for that one or a
  // later one of the same stream.
  void wait(int stream, int at);
  // A point on `stream` that others may wait for, with no instruction of its own (a fork).
  int marker(int stream);
  // Stream -> position of its latest launch.
  const std::map<int, int>& lastLaunch() const { return last_launch_; }
  // Moves everything into `p`: streams (stream 0 first, always present) with seq numbers and a
  // record right after each instruction something waits for; sets p.num_events.
  void assembleInto(Program& p);

 private:
  struct Pending {
    int stream = 0;
    Instruction instr;
    int record_event = -1;  // recorded on `stream` right after this point, -1 if nobody waits
    bool emit = true;       // false for a marker
  };
  std::vector<Pending> pending_;
  std::map<std::pair<int, int>, int> joined_;  // (stream, other stream) -> latest position waited for
  ir::StreamHazards hazards_;                   // steps: launches in order
  std::vector<int> launch_at_;                  // launch -> its position
  std::map<int, int> last_launch_;
  int num_events_ = 0;
};

}  // namespace kiln::codegen
