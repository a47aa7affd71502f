#include "codegen/memory_planner.h"

#include <map>

#include <fmt/format.h>

#include "ir/arena_plan.h"

namespace kiln::codegen {

Status planMemory(Program& p, const MemoryPlanOptions& options) {
  KILN_RETURN_IF_ERROR(validate(p));
  if (options.alignment <= 0 || (options.alignment & (options.alignment - 1)))
    return Status::errorf("memory planner: alignment {} is not a power of two", options.alignment);
  // Every instruction is a step of the plan, on its stream; a wait joins the stream that
  // recorded its event (ir/arena_plan.h keeps reuse across streams behind such joins).
  std::map<const Instruction*, int> stream_of;
  for (const Stream& s : p.streams)
    for (const Instruction& in : s.instrs) stream_of[&in] = s.id;
  std::vector<const Instruction*> order = static_cast<const Program&>(p).ordered();
  const int n = static_cast<int>(order.size());
  std::vector<ir::ArenaStep> steps(order.size());
  std::map<int, int> recorded_at;  // event -> step
  for (int t = 0; t < n; ++t) {
    const Instruction& in = *order[static_cast<size_t>(t)];
    ir::ArenaStep& s = steps[static_cast<size_t>(t)];
    s.stream = stream_of.at(&in);
    s.operands = in.operands;
    s.results = in.results;
    if (in.kind == InstrKind::RecordEvent) recorded_at[in.event] = t;
    if (in.kind == InstrKind::WaitEvent) s.waits.push_back(recorded_at.at(in.event));  // validate() checked
    if (in.kind == InstrKind::Launch) s.in_place = ir::inPlaceKind(in.op);
  }
  std::vector<ir::ArenaBuffer> buffers(p.buffers.size());
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    const Buffer& buf = p.buffers[b];
    buffers[b] = {buf.bytes, buf.type, buf.inArena(), buf.kind == BufferKind::Output};
  }
  ir::ArenaPlan plan = ir::planArena(steps, buffers, {options.alignment, options.in_place});

  auto seqAt = [&](int pos) { return pos >= n ? (n ? order.back()->seq + 1 : 0) : order[pos]->seq; };
  for (size_t b = 0; b < p.buffers.size(); ++b) {
    Buffer& buf = p.buffers[b];
    buf.first_use = plan.first[b] < 0 ? -1 : seqAt(plan.first[b]);
    buf.last_use = plan.last[b] < 0 ? -1 : seqAt(plan.last[b]);
    buf.offset = buf.inArena() ? plan.offset[b] : buf.offset;
    buf.in_place_of = plan.in_place_of[b];
  }
  p.peak_bytes = plan.peak;
  p.arena_bytes = (plan.peak + options.alignment - 1) / options.alignment * options.alignment;
  p.planned = true;
  return Status::ok();
}

std::string memoryPlanStr(const Program& p) {
  std::string out = fmt::format("memory plan @{}", p.function);
  for (const auto& [k, v] : p.symbols) out += fmt::format(" {}={}", k, v);
  out += "\n";
  auto range = [](const Buffer& b) {
    if (b.first_use < 0) return std::string("unused");
    return fmt::format("[{}, {}]", b.first_use, b.last_use);
  };
  for (const Buffer& b : p.buffers) {
    std::string line = fmt::format("  %b{:<4} {:<6}", b.id, bufferKindName(b.kind));
    if (b.inArena())
      line += fmt::format(" offset={:<10}", b.offset);
    else
      line += fmt::format(" {:<17}", "outside-arena");
    line += fmt::format(" bytes={:<10} live={:<12} {}", b.bytes, range(b), b.type.str());
    if (!b.name.empty()) line += fmt::format(" {}", ir::quoteString(b.name));
    if (b.in_place_of >= 0) line += fmt::format(" in_place_of=%b{}", b.in_place_of);
    out += fmt::format("{}\n", line);
  }
  int64_t outside = 0;
  for (const Buffer& b : p.buffers)
    if (!b.inArena()) outside += b.bytes;
  out += fmt::format("outside_arena_bytes: {}\n", outside);
  out += fmt::format("peak_bytes: {}\n", p.peak_bytes);
  return out;
}

}  // namespace kiln::codegen
