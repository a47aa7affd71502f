// The bookkeeping of the CUDA executor's input pipeline (docs/runtime.md, "Feeding the GPU"),
// with no driver call in it, so that the CPU tests check the order of every copy, wait and
// record the executor issues.
//
// A step's batch moves in three hops: the host copies it into a pinned slot (FillPinned), a copy
// stream uploads that slot into a device landing slot of the same index (Upload), and the compute
// stream (the Program's stream 0) copies the landing slot into the step's own input buffers
// (CopyIn) right before the step. The step (a CUDA graph, whose addresses are baked at capture)
// therefore always reads the same input buffers, while the upload of the next batch lands in the
// other slot during this step. Results go back the same way: the compute stream downloads them
// into a pinned result slot, and the host waits only for that slot's event.
//
// Slots rotate by ticket (ticket n uses slot n % slots). The waits that make reuse safe:
//   - the host waits for slot s's previous upload before overwriting its pinned memory;
//   - the copy stream waits for the step that last read landing slot s to have copied it out
//     (`consumed`, recorded right after CopyIn, so the next upload starts early in a step);
//   - the compute stream waits for the upload of its own ticket (`uploaded`);
//   - the host waits for its ticket's `done` (after the results' download) before reading them.
// Per-step order on the compute stream covers the rest (CopyIn of step n+1 comes after step n
// finished reading its inputs, since the Program joins every stream back to stream 0).
//
// A batch the data thread already copied into a buffer of the executor's staging pool
// (runtime/data/staging_pool.h, laid out as the slots) skips the first hop: FillPinnedSkipped
// copies only the inputs outside the buffer (the lr and step scalars, a few bytes) into it, and
// the Upload reads the buffer instead of pinned[s]. The pool waits for that upload (a fence on
// uploaded[s]) before handing the buffer out again; pinned[s], untouched, needs no host wait.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ir/status.h"
#include "runtime/data/staging_pool.h"

namespace kiln::cuda {

// Where each of a set of tensors lies in one contiguous block, each at an aligned offset: the
// pinned and landing slots of the inputs, and the pinned slots of the results.
struct StagingLayout {
  std::vector<size_t> offset;  // per tensor
  std::vector<size_t> bytes;   // per tensor, its full (bound) size
  size_t total = 0;            // at least 1, so that every slot has an address

  static StagingLayout plan(const std::vector<size_t>& bytes, size_t alignment);
};

enum class PipelineOpKind : uint8_t {
  // stage(): the host fills pinned slot s, the copy stream uploads it.
  HostWaitUploaded,   // host: cuEventSynchronize(uploaded[s]) (the slot's previous upload read it)
  FillPinned,         // host: memcpy of the batch into pinned[s]
  FillPinnedSkipped,  // host: the batch lies in a staging buffer; only inputs outside it copied there
  CopyWaitConsumed,   // copy stream: cuStreamWaitEvent(consumed[s]) (landing[s] copied out)
  Upload,             // copy stream: pinned[s] (or the batch's staging buffer) -> landing[s]
  RecordUploaded,     // copy stream: cuEventRecord(uploaded[s])
  // launch(): the compute stream takes the inputs, runs the step and downloads its results.
  ComputeWaitUploaded,  // compute stream: cuStreamWaitEvent(uploaded[s])
  CopyIn,               // compute stream: landing[s] -> the step's input buffers
  RecordConsumed,       // compute stream: cuEventRecord(consumed[s])
  RunStep,              // compute stream: the step (graph replay or eager)
  Download,             // compute stream: the results and error flags -> result slot s
  RecordDone,           // compute stream: cuEventRecord(done[s])
  // collect(): the host reads them.
  HostWaitDone,  // host: cuEventSynchronize(done[s])
  ReadResults,   // host: reads result slot s
};
const char* pipelineOpName(PipelineOpKind k);

struct PipelineOp {
  PipelineOpKind kind;
  int slot = 0;
  int64_t ticket = 0;
  bool from_buffer = false;  // FillPinnedSkipped and its Upload: the batch's staging buffer
  std::string str() const;   // "Upload(slot 1, ticket 3)", "Upload(slot 1, ticket 3, from its buffer)"
};

// How stage() gets a batch into page-locked memory: the block its Upload reads, and the inputs
// the host copies into that block first.
struct HostFill {
  int buffer = -1;             // the staging buffer the batch lies in; -1: the slot's pinned memory
  std::vector<size_t> copies;  // indices of the inputs to copy: all of them, or those outside the buffer
  size_t copy_bytes = 0;
  bool inPlace() const { return buffer >= 0; }
};
// `data[i]` and `bytes[i]`: input i's view (`layout` places it); `pool`: the executor's staging
// pool (nullptr: none). In place when some input lies in a pool buffer and every input that does
// lies in that buffer at its own offset; an input lying anywhere else in a pool buffer makes it a
// plain fill.
HostFill planHostFill(const StagingLayout& layout, const std::vector<const void*>& data,
                      const std::vector<size_t>& bytes, const data::StagingPool* pool);

// Hands out tickets and says, for each call, which operations the executor issues in which
// order. Refuses the calls that would make a slot's reuse unsafe (they are caller bugs, reported
// as errors, never a wait the caller did not ask for).
class InputPipeline {
 public:
  static constexpr int kDefaultSlots = 2;
  explicit InputPipeline(int slots = kDefaultSlots);

  int slots() const { return slots_; }
  int slotOf(int64_t ticket) const { return static_cast<int>(ticket % slots_); }

  // Stages the next batch: appends its operations to `ops` and returns its ticket. At most
  // `slots` batches may be staged and not launched (the landing slot of ticket n is free once
  // ticket n - slots has been launched: its CopyIn is then ordered before the new upload).
  // `in_place`: the batch lies in a staging buffer (HostFill::inPlace), which the upload reads.
  Expected<int64_t> stage(std::vector<PipelineOp>& ops, bool in_place = false);
  // Launches a staged ticket, the oldest staged first. Its result slot must have been read:
  // ticket - slots collected (or dropped, or never launched).
  Status launch(int64_t ticket, std::vector<PipelineOp>& ops);
  // Waits for a launched ticket's results and reads them.
  Status collect(int64_t ticket, std::vector<PipelineOp>& ops);
  // Forgets a ticket whose results will not be read: a staged batch that will not run (the
  // trainer staged a batch it will not train on), or a launch that failed part way. Either way
  // the slot's next user still waits for what was enqueued (the upload, the copy-in), and nothing
  // reads what it left in its result slot.
  Status drop(int64_t ticket);

  // Tickets staged and not yet launched or dropped, oldest first.
  std::vector<int64_t> staged() const;
  // Tickets launched and not yet collected.
  std::vector<int64_t> inFlight() const;

 private:
  enum class State : uint8_t { Staged, Launched, Finished };  // Finished: collected or dropped
  State stateOf(int64_t ticket) const;                        // Finished for tickets forgotten or < 0

  int slots_;
  int64_t next_ = 0;
  std::map<int64_t, State> tickets_;  // every ticket not yet Finished
};

// Replays `ops` on a model of the three agents (host, copy stream, compute stream) with vector
// clocks: an operation on a stream happens after everything the host did before enqueuing it,
// a wait joins the clock a record captured, and a host wait joins the host with it. Returns one
// line per conflicting pair of accesses to the same memory (pinned, landing, input and result
// slots) with no happens-before between them, and per read of a slot that holds another
// ticket's data; empty when the order is safe.
std::vector<std::string> findPipelineHazards(const std::vector<PipelineOp>& ops, int slots);

}  // namespace kiln::cuda
