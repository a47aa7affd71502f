// Scheduling: embedding work on stream 1 with events where values cross streams, a peak no
// higher than before, and the same training-step numbers.
#include <gtest/gtest.h>

#include "codegen/lower_cpu.h"
#include "ir/verifier.h"
#include "passes/peak_memory.h"
#include "tests/passes/model_fixture.h"

namespace kiln::passes {
namespace {

using testing::kModels;
using testing::trainingModule;

class ScheduleOnModels : public ::testing::TestWithParam<const char*> {};

TEST_P(ScheduleOnModels, StreamsEventsPeakAndNumbers) {
  auto m = trainingModule(GetParam());
  auto reference = trainingModule(GetParam());
  ASSERT_TRUE(m && reference);
  (*m)->mutableAttrs()["kiln.symbols"] = ir::Attribute(ir::AttrDict{{"B", ir::Attribute(int64_t{64})}});
  const ir::Function& ts = *(*m)->lookup("train_step");
  auto before = estimatePeakBytes(ts, {{"B", 64}});
  ASSERT_TRUE(before);
  PassManager pm;
  ASSERT_TRUE(pm.addPipeline("fusion,schedule").isOk());
  auto r = pm.run(**m);
  ASSERT_TRUE(r) << r.status().str();
  int on_stream_1 = 0;
  for (const auto& op : ts.entry().ops()) {
    if (op->intAttr("kiln.stream", 0) != 1) continue;
    ++on_stream_1;
    EXPECT_TRUE(op->name() == "kiln.fused" || op->name() == "kiln.embedding_bag" ||
                op->name() == "kiln.embedding_bag_update" || op->name() == "kiln.slice")
        << op->name();
  }
  EXPECT_GT(on_stream_1, 0);
  auto p = codegen::lowerForCpu(ts, {{"B", 64}});
  ASSERT_TRUE(p) << p.status().str();
  ASSERT_EQ(p->streams.size(), 2u);
  int waits = 0, records = 0;
  for (const codegen::Stream& s : p->streams)
    for (const codegen::Instruction& in : s.instrs) {
      waits += in.kind == codegen::InstrKind::WaitEvent;
      records += in.kind == codegen::InstrKind::RecordEvent;
    }
  EXPECT_GT(waits, 0);
  EXPECT_GT(records, 0);
  auto after = estimatePeakBytes(ts, {{"B", 64}});
  ASSERT_TRUE(after);
  EXPECT_EQ(*after, p->peak_bytes);
  testing::expectSameTrainStep(**reference, **m, 4);
}

INSTANTIATE_TEST_SUITE_P(Models, ScheduleOnModels, ::testing::ValuesIn(kModels));

}  // namespace
}  // namespace kiln::passes
