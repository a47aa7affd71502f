// Liveness and arena layout over a schedule of steps on one or more streams: the one algorithm
// behind codegen's memory planner (codegen/memory_planner.h, which plans a Program) and the
// passes' peak estimate (passes/peak_memory.h, which plans a function before codegen), so the
// two cannot drift apart.
//
// Steps are given in a global order that is a valid serial execution (the CPU runs it as is).
// On a GPU, steps of different streams run concurrently except where a step waits for an
// earlier one (an event), so a block of the arena may go to a new buffer only when every use of
// its previous owner happens before the new owner's first step. Happens-before is tracked with
// one vector clock per step (streams are few). With a single stream this is plain best-fit
// reuse in program order.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "ir/types.h"

namespace kiln::ir {

struct ArenaBuffer {
  int64_t bytes = 0;
  TensorType type;         // for the in-place rule: a result may take over an operand of its type
  bool in_arena = true;    // false: inputs, parameters (live elsewhere, never placed)
  bool live_to_end = false;  // returned: stays live after the last step
};

enum class InPlace : uint8_t {
  kNever,
  kSameType,   // elementwise: element i is read before element i is written
  kSameBytes,  // reshape: the same bytes under another shape
};

// How the op named `op_name` may share a dying operand's storage: elementwise ops without side
// effects element by element, reshapes as the same bytes, everything else not at all. The one
// rule the memory planner, the peak estimate and remat's live profile all apply.
InPlace inPlaceKind(std::string_view op_name);

struct ArenaStep {
  int stream = 0;
  std::vector<int> operands, results;  // buffer ids
  std::vector<int> waits;              // earlier steps (by index) this step waits for
  InPlace in_place = InPlace::kNever;
};

struct ArenaPlanOptions {
  int64_t alignment = 64;  // a power of two
  bool in_place = true;
};

struct ArenaPlan {
  std::vector<int64_t> offset;  // per buffer; -1 outside the arena, 0 for a buffer never written
  std::vector<int> in_place_of;  // per buffer: the buffer whose block it took over, or -1
  std::vector<int> first, last;  // per buffer: step indices of its live range (-1: unused)
  int64_t peak = 0;              // high-water mark: max over buffers of offset + bytes
};

// Lays out the arena. Buffers outside the arena are live from the start; a result nobody reads
// is live at its step only.
ArenaPlan planArena(const std::vector<ArenaStep>& steps, const std::vector<ArenaBuffer>& buffers,
                    const ArenaPlanOptions& options = {});

// The waits that keep a multi-stream schedule equal to its serial order, computed as steps are
// added in that order: a step waits for the last writer of each buffer it reads, and a step that
// writes buffers in place (an optimizer update) also for every earlier reader of them since
// their last write. Only steps on other streams are returned (a stream is ordered already).
class StreamHazards {
 public:
  // Registers step `step` on `stream` and returns the earlier steps it must wait for.
  std::vector<int> add(int step, int stream, const std::vector<int>& reads, const std::vector<int>& writes_in_place,
                       const std::vector<int>& results);

 private:
  struct Access {
    int last_write = -1;
    std::vector<int> readers;  // since the last write
  };
  std::vector<Access> access_;
  std::vector<int> stream_of_;
  Access& at(int buffer);
};

}  // namespace kiln::ir
