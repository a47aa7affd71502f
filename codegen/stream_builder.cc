#include "codegen/stream_builder.h"

#include <algorithm>

namespace kiln::codegen {

int StreamBuilder::launch(int stream, Instruction in, const std::vector<int>& written_in_place) {
  const int step = static_cast<int>(launch_at_.size());
  std::map<int, int> latest;  // producer stream -> position of the latest launch to wait for
  for (int earlier : hazards_.add(step, stream, in.operands, written_in_place, in.results)) {
    const int at = launch_at_[static_cast<size_t>(earlier)];
    int& l = latest.try_emplace(pending_[static_cast<size_t>(at)].stream, -1).first->second;
    l = std::max(l, at);
  }
  for (const auto& [_, at] : latest) wait(stream, at);
  pending_.push_back({stream, std::move(in), -1, true});
  const int at = static_cast<int>(pending_.size()) - 1;
  launch_at_.push_back(at);
  last_launch_[stream] = at;
  return at;
}

void StreamBuilder::wait(int stream, int at) {
  Pending& prod = pending_[static_cast<size_t>(at)];
  int& joined = joined_.try_emplace({stream, prod.stream}, -1).first->second;
  if (at <= joined) return;
  joined = at;
  if (prod.record_event < 0) prod.record_event = num_events_++;
  Instruction w;
  w.kind = InstrKind::WaitEvent;
  w.event = prod.record_event;
  pending_.push_back({stream, std::move(w), -1, true});
}

int StreamBuilder::marker(int stream) {
  pending_.push_back({stream, {}, -1, false});
  return static_cast<int>(pending_.size()) - 1;
}

void StreamBuilder::assembleInto(Program& p) {
  std::map<int, Stream> streams;
  streams[0].id = 0;
  int seq = 0;
  auto emit = [&](int s, Instruction in) {
    in.seq = seq++;
    streams[s].id = s;
    streams[s].instrs.push_back(std::move(in));
  };
  // A record must precede any wait on it: waits are always added after the point they wait for.
  for (Pending& pd : pending_) {
    if (pd.emit) emit(pd.stream, std::move(pd.instr));
    if (pd.record_event >= 0) {
      Instruction rec;
      rec.kind = InstrKind::RecordEvent;
      rec.event = pd.record_event;
      emit(pd.stream, std::move(rec));
    }
  }
  for (auto& [_, s] : streams) p.streams.push_back(std::move(s));
  p.num_events = num_events_;
  pending_.clear();
}

}  // namespace kiln::codegen
