#include "runtime/cuda/input_pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

namespace kiln::cuda {

StagingLayout StagingLayout::plan(const std::vector<size_t>& bytes, size_t alignment) {
  StagingLayout l;
  alignment = std::max<size_t>(alignment, 1);
  for (size_t b : bytes) {
    l.offset.push_back(l.total);
    l.bytes.push_back(b);
    l.total += (b + alignment - 1) / alignment * alignment;
  }
  l.total = std::max<size_t>(l.total, 1);
  return l;
}

const char* pipelineOpName(PipelineOpKind k) {
  switch (k) {
    case PipelineOpKind::HostWaitUploaded:
      return "HostWaitUploaded";
    case PipelineOpKind::FillPinned:
      return "FillPinned";
    case PipelineOpKind::FillPinnedSkipped:
      return "FillPinnedSkipped";
    case PipelineOpKind::CopyWaitConsumed:
      return "CopyWaitConsumed";
    case PipelineOpKind::Upload:
      return "Upload";
    case PipelineOpKind::RecordUploaded:
      return "RecordUploaded";
    case PipelineOpKind::ComputeWaitUploaded:
      return "ComputeWaitUploaded";
    case PipelineOpKind::CopyIn:
      return "CopyIn";
    case PipelineOpKind::RecordConsumed:
      return "RecordConsumed";
    case PipelineOpKind::RunStep:
      return "RunStep";
    case PipelineOpKind::Download:
      return "Download";
    case PipelineOpKind::RecordDone:
      return "RecordDone";
    case PipelineOpKind::HostWaitDone:
      return "HostWaitDone";
    case PipelineOpKind::ReadResults:
      return "ReadResults";
  }
  return "?";
}

std::string PipelineOp::str() const {
  return fmt::format("{}(slot {}, ticket {}{})", pipelineOpName(kind), slot, ticket,
                     from_buffer ? ", from its buffer" : "");
}

HostFill planHostFill(const StagingLayout& layout, const std::vector<const void*>& data,
                      const std::vector<size_t>& bytes, const data::StagingPool* pool) {
  HostFill fill;
  std::vector<int> in_buffer(data.size(), -1);
  if (pool && pool->layout().total == layout.total) {
    for (size_t i = 0; i < data.size(); ++i) {
      if (bytes[i] == 0) continue;  // an empty view's address means nothing
      in_buffer[i] = pool->find(data[i]);
      if (in_buffer[i] < 0) continue;
      const bool at_its_offset = data[i] == pool->base(in_buffer[i]) + layout.offset[i];
      if (!at_its_offset || (fill.buffer >= 0 && fill.buffer != in_buffer[i])) {
        fill.buffer = -1;  // laid out by another executor, or split over buffers: copy it all
        std::fill(in_buffer.begin(), in_buffer.end(), -1);
        break;
      }
      fill.buffer = in_buffer[i];
    }
  }
  for (size_t i = 0; i < data.size(); ++i) {
    if (fill.inPlace() && in_buffer[i] == fill.buffer) continue;
    if (bytes[i] == 0) continue;
    fill.copies.push_back(i);
    fill.copy_bytes += bytes[i];
  }
  return fill;
}

InputPipeline::InputPipeline(int slots) : slots_(std::max(slots, 1)) {}

InputPipeline::State InputPipeline::stateOf(int64_t ticket) const {
  auto it = tickets_.find(ticket);
  return it == tickets_.end() ? State::Finished : it->second;
}

Expected<int64_t> InputPipeline::stage(std::vector<PipelineOp>& ops, bool in_place) {
  const int64_t n = next_;
  const int s = slotOf(n);
  // Landing slot s is read by ticket n - slots's CopyIn: its `consumed` must be recorded before
  // the new upload's wait is enqueued, or the wait would see an older record.
  if (stateOf(n - slots_) == State::Staged)
    return Status::errorf(
        "input pipeline: {} batches are staged and not launched (ticket {} holds slot {}); launch "
        "or drop one first",
        slots_, n - slots_, s);
  ++next_;
  tickets_[n] = State::Staged;
  if (in_place) {
    // pinned[s] is not written: no host wait. The buffer's own reuse waits in the pool.
    ops.push_back({PipelineOpKind::FillPinnedSkipped, s, n, true});
  } else {
    if (n >= slots_) ops.push_back({PipelineOpKind::HostWaitUploaded, s, n});
    ops.push_back({PipelineOpKind::FillPinned, s, n});
  }
  if (n >= slots_) ops.push_back({PipelineOpKind::CopyWaitConsumed, s, n});
  ops.push_back({PipelineOpKind::Upload, s, n, in_place});
  ops.push_back({PipelineOpKind::RecordUploaded, s, n});
  return n;
}

Status InputPipeline::launch(int64_t ticket, std::vector<PipelineOp>& ops) {
  if (stateOf(ticket) != State::Staged)
    return Status::errorf("input pipeline: ticket {} is not staged (launched, dropped or never handed out)",
                          ticket);
  const std::vector<int64_t> waiting = staged();
  if (waiting.front() != ticket)
    return Status::errorf("input pipeline: ticket {} launched before ticket {}, staged earlier", ticket,
                          waiting.front());
  // Result slot s still holds ticket - slots's results until the host reads them.
  if (stateOf(ticket - slots_) == State::Launched)
    return Status::errorf(
        "input pipeline: collect ticket {} before launching ticket {} (they share result slot {})",
        ticket - slots_, ticket, slotOf(ticket));
  const int s = slotOf(ticket);
  tickets_[ticket] = State::Launched;
  for (PipelineOpKind k :
       {PipelineOpKind::ComputeWaitUploaded, PipelineOpKind::CopyIn, PipelineOpKind::RecordConsumed,
        PipelineOpKind::RunStep, PipelineOpKind::Download, PipelineOpKind::RecordDone})
    ops.push_back({k, s, ticket});
  return Status::ok();
}

Status InputPipeline::collect(int64_t ticket, std::vector<PipelineOp>& ops) {
  if (stateOf(ticket) != State::Launched)
    return Status::errorf("input pipeline: ticket {} is not in flight (not launched, or collected already)",
                          ticket);
  tickets_.erase(ticket);
  ops.push_back({PipelineOpKind::HostWaitDone, slotOf(ticket), ticket});
  ops.push_back({PipelineOpKind::ReadResults, slotOf(ticket), ticket});
  return Status::ok();
}

Status InputPipeline::drop(int64_t ticket) {
  if (stateOf(ticket) == State::Finished)
    return Status::errorf("input pipeline: ticket {} is neither staged nor in flight", ticket);
  // Its upload may still be running: the next stage into the slot waits for it (HostWaitUploaded
  // and stream order on the copy stream), and nothing will read the landing slot meanwhile. A
  // launched ticket's download may be too: the next launch into its result slot comes after it
  // on stream 0, and its `done` is recorded anew before anyone waits on it.
  tickets_.erase(ticket);
  return Status::ok();
}

std::vector<int64_t> InputPipeline::staged() const {
  std::vector<int64_t> out;
  for (const auto& [t, state] : tickets_)
    if (state == State::Staged) out.push_back(t);
  return out;
}

std::vector<int64_t> InputPipeline::inFlight() const {
  std::vector<int64_t> out;
  for (const auto& [t, state] : tickets_)
    if (state == State::Launched) out.push_back(t);
  return out;
}

namespace {

enum Agent { kHost = 0, kCopy = 1, kCompute = 2 };
using Clock = std::array<uint64_t, 3>;

void join(Clock& into, const Clock& from) {
  for (size_t i = 0; i < into.size(); ++i) into[i] = std::max(into[i], from[i]);
}

struct Access {
  Agent agent;
  uint64_t time;
  std::string op;
};

// One piece of memory: its last write (and whose data it holds) and the reads since.
struct Memory {
  bool written = false;
  Access write{kHost, 0, ""};
  int64_t ticket = -1;
  std::vector<Access> reads;
};

}  // namespace

std::vector<std::string> findPipelineHazards(const std::vector<PipelineOp>& ops, int slots) {
  std::vector<std::string> hazards;
  std::array<Clock, 3> clock{};                   // per agent
  std::map<std::pair<int, int>, Clock> recorded;  // (record kind, slot) -> clock at the record
  std::map<std::string, Memory> memory;

  auto ordered = [&](const Access& before, Agent now) { return clock[now][before.agent] >= before.time; };
  auto touch = [&](Agent a, const std::string& name, bool write, const PipelineOp& op) {
    Memory& m = memory[name];
    Access here{a, clock[a][a], op.str()};
    if (m.written && !ordered(m.write, a))
      hazards.push_back(fmt::format("{}: {} is not ordered after {}", name, here.op, m.write.op));
    if (write) {
      for (const Access& r : m.reads)
        if (!ordered(r, a))
          hazards.push_back(fmt::format("{}: {} is not ordered after {}", name, here.op, r.op));
      m.written = true;
      m.write = here;
      m.ticket = op.ticket;
      m.reads.clear();
    } else {
      if (m.ticket != op.ticket)
        hazards.push_back(fmt::format("{}: {} reads ticket {}'s data", name, here.op, m.ticket));
      m.reads.push_back(here);
    }
  };
  auto waitFor = [&](Agent a, int kind, int slot) {
    auto it = recorded.find({kind, slot});
    if (it != recorded.end()) join(clock[a], it->second);  // never recorded: no wait (as in CUDA)
  };
  enum { kUploaded, kConsumed, kDone };

  for (const PipelineOp& op : ops) {
    const int s = op.slot;
    if (s < 0 || s >= slots) {
      hazards.push_back(fmt::format("{}: no slot {} of {}", op.str(), s, slots));
      continue;
    }
    // A staging buffer holds one ticket's batch: the pool, not this plan, orders its reuse.
    const std::string buffer = fmt::format("staging buffer of ticket {}", op.ticket);
    const std::string pinned = fmt::format("pinned[{}]", s), landing = fmt::format("landing[{}]", s),
                      result_slot = fmt::format("result slot[{}]", s);
    Agent a = kHost;
    switch (op.kind) {
      case PipelineOpKind::HostWaitUploaded:
      case PipelineOpKind::FillPinned:
      case PipelineOpKind::FillPinnedSkipped:
      case PipelineOpKind::HostWaitDone:
      case PipelineOpKind::ReadResults:
        a = kHost;
        break;
      case PipelineOpKind::CopyWaitConsumed:
      case PipelineOpKind::Upload:
      case PipelineOpKind::RecordUploaded:
        a = kCopy;
        break;
      default:
        a = kCompute;
        break;
    }
    // Stream work runs after everything the host did before enqueuing it.
    if (a != kHost) join(clock[a], clock[kHost]);
    ++clock[a][a];
    switch (op.kind) {
      case PipelineOpKind::HostWaitUploaded:
        waitFor(kHost, kUploaded, s);
        break;
      case PipelineOpKind::FillPinned:
        touch(kHost, pinned, true, op);
        break;
      case PipelineOpKind::FillPinnedSkipped:
        touch(kHost, buffer, true, op);  // the scalars outside the data thread's copy
        break;
      case PipelineOpKind::CopyWaitConsumed:
        waitFor(kCopy, kConsumed, s);
        break;
      case PipelineOpKind::Upload:
        touch(kCopy, op.from_buffer ? buffer : pinned, false, op);
        touch(kCopy, landing, true, op);
        break;
      case PipelineOpKind::RecordUploaded:
        recorded[{kUploaded, s}] = clock[kCopy];
        break;
      case PipelineOpKind::ComputeWaitUploaded:
        waitFor(kCompute, kUploaded, s);
        break;
      case PipelineOpKind::CopyIn:
        touch(kCompute, landing, false, op);
        touch(kCompute, "inputs", true, op);
        break;
      case PipelineOpKind::RecordConsumed:
        recorded[{kConsumed, s}] = clock[kCompute];
        break;
      case PipelineOpKind::RunStep:
        touch(kCompute, "inputs", false, op);
        touch(kCompute, "results", true, op);
        break;
      case PipelineOpKind::Download:
        touch(kCompute, "results", false, op);
        touch(kCompute, result_slot, true, op);
        break;
      case PipelineOpKind::RecordDone:
        recorded[{kDone, s}] = clock[kCompute];
        break;
      case PipelineOpKind::HostWaitDone:
        waitFor(kHost, kDone, s);
        break;
      case PipelineOpKind::ReadResults:
        touch(kHost, result_slot, false, op);
        break;
    }
  }
  return hazards;
}

}  // namespace kiln::cuda
