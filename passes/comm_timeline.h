// How much of a scheduled step's communication the compute stream waits for: the step played on
// two resources, as the CPU executor and the CUDA streams run it. Compute ops run one after
// another on the compute stream, each costing passes::CostModel's time; collectives run one
// after another on the comm stream, each costing ir::collectiveSeconds on the target's links.
// An op starts when its stream is free and its operands are ready; a collective is issued as
// soon as its operands are, and the compute stream stalls only where an op needs a collective's
// result (or writes in place what one still sends) before it arrives. The step ends when both
// streams are done, so a transfer nothing waits for is exposed at the end.
//
// Without overlap every collective is waited on where it is issued: the exposed time is the sum
// of their times. kiln dump --stats prints both (docs/passes.md, "Communication timeline").
#pragma once

#include "ir/collective.h"
#include "ir/ir.h"
#include "ir/status.h"
#include "passes/cost_model.h"

namespace kiln::passes {

struct CommTimeline {
  double compute_seconds = 0;                  // the compute stream's busy time
  double comm_seconds = 0;                     // every collective's time, end to end
  double exposed_comm_seconds = 0;             // compute stalled on communication, with overlap
  double exposed_comm_seconds_no_overlap = 0;  // the same, waiting on each collective at once
  double step_seconds = 0;                     // when the later stream finishes
  int collectives = 0;
};

// How long `op` keeps its stream busy: a collective its ring time on `scope`'s links (at
// `symbols`), any other op its cost-model time (0 for one that launches no work).
double streamSeconds(const ir::Op& op, const CostModel& cost, const ir::SymbolBindings& symbols,
                     ir::LinkScope scope);

// Plays the entry block of `f` in its order (the schedule's) over `cost`'s target and symbols.
CommTimeline simulateCommTimeline(const ir::Function& f, const CostModel& cost,
                                  ir::LinkScope scope = ir::LinkScope::intra_node);

}  // namespace kiln::passes
