// The CUDA executor's input pipeline, without a GPU: the staging layout, the operations each
// stage/launch/collect issues, the refusals of unsafe calls, and the hazard checker over the
// schedules the trainer and run() use (and over orders missing one kind of wait, which it must
// flag: every wait the pipeline issues is needed). Then the executor's host side emulated on
// ordinary memory, uploads deferred as on a copy stream: batches the data thread placed in a
// staging pool skip the host copy, and every step reads exactly its batch's bytes.
#include "runtime/cuda/input_pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "runtime/data/staging_pool.h"

namespace kiln::cuda {
namespace {

using K = PipelineOpKind;

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

std::vector<K> kinds(const std::vector<PipelineOp>& ops) {
  std::vector<K> out;
  for (const PipelineOp& op : ops) out.push_back(op.kind);
  return out;
}

TEST(StagingLayout, AlignsEveryTensorAndCountsTheTotal) {
  StagingLayout l = StagingLayout::plan({13 * 4 * 2, 0, 5, 256}, 64);
  EXPECT_EQ(l.offset, (std::vector<size_t>{0, 128, 128, 192}));
  EXPECT_EQ(l.bytes, (std::vector<size_t>{104, 0, 5, 256}));
  EXPECT_EQ(l.total, 448u);
  for (size_t o : l.offset) EXPECT_EQ(o % 64, 0u);
  // No tensors (a function without inputs) still gets an address.
  EXPECT_EQ(StagingLayout::plan({}, 64).total, 1u);
}

TEST(InputPipeline, FirstUseOfASlotWaitsForNothingLaterUsesWait) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  auto t0 = p.stage(ops);
  ASSERT_TRUE(t0) << t0.status().message();
  EXPECT_EQ(*t0, 0);
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::FillPinned, K::Upload, K::RecordUploaded}));
  ops.clear();
  ASSERT_TRUE(p.launch(0, ops));
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::ComputeWaitUploaded, K::CopyIn, K::RecordConsumed, K::RunStep,
                                        K::Download, K::RecordDone}));
  for (const PipelineOp& op : ops) EXPECT_EQ(op.slot, 0);
  ops.clear();
  ASSERT_TRUE(p.stage(ops));  // ticket 1, slot 1: first use
  ASSERT_TRUE(p.collect(0, ops));
  ASSERT_TRUE(p.launch(1, ops));
  ops.clear();
  auto t2 = p.stage(ops);  // slot 0 again: waits for its upload and for step 0's CopyIn
  ASSERT_TRUE(t2);
  EXPECT_EQ(*t2, 2);
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::HostWaitUploaded, K::FillPinned, K::CopyWaitConsumed, K::Upload,
                                        K::RecordUploaded}));
  for (const PipelineOp& op : ops) EXPECT_EQ(op.slot, 0);
}

// The trainer's order: launch step i, stage step i+1 while it runs, collect step i.
std::vector<PipelineOp> trainerSchedule(InputPipeline& p, int steps) {
  std::vector<PipelineOp> ops;
  auto current = p.stage(ops);
  EXPECT_TRUE(current);
  for (int i = 0; i < steps; ++i) {
    EXPECT_TRUE(p.launch(*current, ops));
    Expected<int64_t> next = Status::error("last step");
    if (i + 1 < steps) {
      next = p.stage(ops);
      EXPECT_TRUE(next) << next.status().message();
    }
    EXPECT_TRUE(p.collect(*current, ops));
    if (next) current = next;
  }
  return ops;
}

// Two batches ahead: stage i+2 before step i is collected (the deepest the slots allow).
std::vector<PipelineOp> deepSchedule(InputPipeline& p, int steps, bool in_place = false) {
  std::vector<PipelineOp> ops;
  std::vector<int64_t> tickets;
  for (int i = 0; i < 2; ++i) tickets.push_back(*p.stage(ops, in_place));
  for (int i = 0; i < steps; ++i) {
    EXPECT_TRUE(p.launch(tickets[static_cast<size_t>(i)], ops));
    if (i + 2 < steps) {
      auto t = p.stage(ops, in_place);
      EXPECT_TRUE(t) << t.status().message();
      tickets.push_back(*t);
    }
    if (i >= 1) {
      EXPECT_TRUE(p.collect(tickets[static_cast<size_t>(i - 1)], ops));
    }
  }
  EXPECT_TRUE(p.collect(tickets.back(), ops));
  return ops;
}

TEST(InputPipeline, TrainerOrderIsSafeWithOneOrTwoSlots) {
  for (int slots : {1, 2, 3}) {
    InputPipeline p(slots);
    std::vector<PipelineOp> ops = trainerSchedule(p, 10);
    EXPECT_EQ(joined(findPipelineHazards(ops, slots)), "") << slots << " slots";
    EXPECT_TRUE(p.staged().empty());
    EXPECT_TRUE(p.inFlight().empty());
  }
}

TEST(InputPipeline, RunOrderIsSafe) {
  InputPipeline p;
  std::vector<PipelineOp> ops;
  for (int i = 0; i < 5; ++i) {
    auto t = p.stage(ops);
    ASSERT_TRUE(t);
    ASSERT_TRUE(p.launch(*t, ops));
    ASSERT_TRUE(p.collect(*t, ops));
  }
  EXPECT_EQ(joined(findPipelineHazards(ops, p.slots())), "");
}

TEST(InputPipeline, TwoAheadIsSafe) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops = deepSchedule(p, 8);
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
}

// Without any one kind of wait the deep order races: the checker must say so, naming the memory.
TEST(InputPipeline, EveryKindOfWaitIsNeeded) {
  const std::vector<std::pair<K, std::string>> cases = {
      {K::HostWaitUploaded, "pinned["},      // the host refills a slot the copy stream still reads
      {K::CopyWaitConsumed, "landing["},     // an upload overwrites a slot a step has not copied in
      {K::ComputeWaitUploaded, "landing["},  // a step copies in a slot before its upload lands
      {K::HostWaitDone, "result slot["},     // the host reads results before their download
  };
  for (const auto& [removed, memory] : cases) {
    InputPipeline p(2);
    std::vector<PipelineOp> ops = deepSchedule(p, 6);
    ops.erase(
        std::remove_if(ops.begin(), ops.end(), [&](const PipelineOp& op) { return op.kind == removed; }),
        ops.end());
    std::vector<std::string> hazards = findPipelineHazards(ops, 2);
    ASSERT_FALSE(hazards.empty()) << "without " << pipelineOpName(removed);
    EXPECT_NE(joined(hazards).find(memory), std::string::npos) << joined(hazards);
  }
}

TEST(InputPipeline, CheckerCatchesASlotMixUp) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops = trainerSchedule(p, 3);
  // Step 1 copying in slot 0 (ticket 0's upload) instead of its own.
  for (PipelineOp& op : ops)
    if (op.ticket == 1 && op.kind == K::CopyIn) op.slot = 0;
  const std::string hazards = joined(findPipelineHazards(ops, 2));
  EXPECT_NE(hazards.find("landing[0]: CopyIn(slot 0, ticket 1) reads ticket 0's data"), std::string::npos)
      << hazards;
}

TEST(InputPipeline, RefusesUnsafeCalls) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  ASSERT_TRUE(p.stage(ops));
  ASSERT_TRUE(p.stage(ops));
  auto third = p.stage(ops);  // both landing slots still wait for their steps
  ASSERT_FALSE(third);
  EXPECT_NE(third.status().message().find("staged and not launched"), std::string::npos);
  Status early = p.launch(1, ops);  // ticket 0 was staged first
  ASSERT_FALSE(early);
  EXPECT_NE(early.message().find("before ticket 0"), std::string::npos) << early.message();
  EXPECT_FALSE(p.collect(0, ops));  // not launched
  ASSERT_TRUE(p.launch(0, ops));
  ASSERT_TRUE(p.launch(1, ops));
  ASSERT_TRUE(p.stage(ops));         // ticket 2
  Status unread = p.launch(2, ops);  // ticket 0's results still in result slot 0
  ASSERT_FALSE(unread);
  EXPECT_NE(unread.message().find("collect ticket 0"), std::string::npos) << unread.message();
  ASSERT_TRUE(p.collect(0, ops));
  EXPECT_FALSE(p.collect(0, ops));  // twice
  EXPECT_FALSE(p.drop(0));          // collected already
  EXPECT_EQ(p.inFlight(), (std::vector<int64_t>{1}));
  EXPECT_EQ(p.staged(), (std::vector<int64_t>{2}));
}

// The session drops a staged batch the trainer did not train on next (a short last batch, a
// stop); the slots stay safe afterwards.
TEST(InputPipeline, DroppedTicketLeavesTheSlotsSafe) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops = trainerSchedule(p, 3);
  auto ahead = p.stage(ops);
  ASSERT_TRUE(ahead);
  ASSERT_TRUE(p.drop(*ahead));
  EXPECT_FALSE(p.launch(*ahead, ops));
  std::vector<PipelineOp> more = trainerSchedule(p, 4);
  ops.insert(ops.end(), more.begin(), more.end());
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
}

// A launch that failed part way is dropped by the executor; later tickets may reuse its slots.
TEST(InputPipeline, DroppedLaunchLeavesTheSlotsSafe) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  auto t0 = p.stage(ops);
  ASSERT_TRUE(t0);
  std::vector<PipelineOp> launched;
  ASSERT_TRUE(p.launch(*t0, launched));
  launched.resize(3);  // failed after RecordConsumed: no step, no download, no done
  ops.insert(ops.end(), launched.begin(), launched.end());
  ASSERT_TRUE(p.drop(*t0));
  EXPECT_TRUE(p.inFlight().empty());
  std::vector<PipelineOp> more = trainerSchedule(p, 4);  // tickets 1..4, slot 0 again at 2 and 4
  ops.insert(ops.end(), more.begin(), more.end());
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
}

TEST(InputPipeline, InPlaceStagingSkipsTheFillAndItsHostWait) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  ASSERT_TRUE(p.stage(ops, /*in_place=*/true));
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::FillPinnedSkipped, K::Upload, K::RecordUploaded}));
  EXPECT_TRUE(ops[1].from_buffer);
  EXPECT_EQ(ops[1].str(), "Upload(slot 0, ticket 0, from its buffer)");
  ASSERT_TRUE(p.launch(0, ops));
  ASSERT_TRUE(p.stage(ops));
  ASSERT_TRUE(p.collect(0, ops));
  ASSERT_TRUE(p.launch(1, ops));
  ops.clear();
  ASSERT_TRUE(p.stage(ops, /*in_place=*/true));  // slot 0 again: the landing slot still waits
  EXPECT_EQ(kinds(ops),
            (std::vector<K>{K::FillPinnedSkipped, K::CopyWaitConsumed, K::Upload, K::RecordUploaded}));
}

// Placed and copied batches alternating, and the deep order in place: no hazard; without the
// copy stream's wait (needed in the deep order, where no collect orders the host after the
// copy-in) the in-place upload overwrites a landing slot not yet copied in.
TEST(InputPipeline, InPlaceAndFilledBatchesMixSafely) {
  InputPipeline p(2);
  std::vector<PipelineOp> ops;
  auto current = p.stage(ops, true);
  ASSERT_TRUE(current);
  for (int i = 0; i < 9; ++i) {
    ASSERT_TRUE(p.launch(*current, ops));
    auto next = p.stage(ops, i % 3 != 0);
    ASSERT_TRUE(next);
    ASSERT_TRUE(p.collect(*current, ops));
    current = next;
  }
  ASSERT_TRUE(p.launch(*current, ops));
  ASSERT_TRUE(p.collect(*current, ops));
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
  InputPipeline deep(2);
  ops = deepSchedule(deep, 6, /*in_place=*/true);
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
  ops.erase(std::remove_if(ops.begin(), ops.end(),
                           [](const PipelineOp& op) { return op.kind == K::CopyWaitConsumed; }),
            ops.end());
  EXPECT_NE(joined(findPipelineHazards(ops, 2)).find("landing["), std::string::npos);
}

// The executor's host side on ordinary memory: per slot a pinned, a landing and a result copy;
// uploads queue on an emulated copy stream and run when something waits for them (a host wait,
// the compute stream's wait, a staging buffer's fence), so an upload reads its source as late
// as a real DMA may.
class EmulatedExecutor {
 public:
  EmulatedExecutor(const data::StagingBufferLayout& pool_layout, const StagingLayout& layout, int slots)
      : pipeline_(slots), layout_(layout), names_(pool_layout.names) {
    for (int s = 0; s < slots; ++s) {
      pinned_.emplace_back(layout.total);
      landing_.emplace_back(layout.total);
    }
    inputs_.resize(layout.total);
    uploaded_mark_.assign(static_cast<size_t>(slots), 0);
  }
  // As the executor's destructor waits for its copy stream: nothing left for a fence to run.
  ~EmulatedExecutor() {
    runCopyStream(done_ + copy_stream_.size());
    if (pool_)
      for (int b = 0; b < pool_->buffers(); ++b) pool_->setFence(b, nullptr);
  }
  void usePool(std::shared_ptr<data::StagingPool> pool) { pool_ = std::move(pool); }

  // stage(): the views in layout order (a name the batch lacks is an error in the executor).
  Expected<int64_t> stage(const std::map<std::string, ir::TensorView>& batch, std::vector<PipelineOp>& all) {
    std::vector<const void*> data;
    std::vector<size_t> bytes;
    for (const std::string& n : names_) {
      const ir::TensorView& v = batch.at(n);
      data.push_back(v.data);
      bytes.push_back(static_cast<size_t>(v.bytes()));
    }
    const HostFill fill = planHostFill(layout_, data, bytes, pool_.get());
    std::vector<PipelineOp> ops;
    KILN_ASSIGN_OR_RETURN(int64_t t, pipeline_.stage(ops, fill.inPlace()));
    for (const PipelineOp& op : ops) {
      auto& pinned = pinned_[static_cast<size_t>(op.slot)];
      switch (op.kind) {
        case K::HostWaitUploaded:
          runCopyStream(uploaded_mark_[static_cast<size_t>(op.slot)]);
          break;
        case K::FillPinned:
          for (size_t i : fill.copies) std::memcpy(pinned.data() + layout_.offset[i], data[i], bytes[i]);
          host_copied_ += fill.copy_bytes;
          break;
        case K::FillPinnedSkipped: {
          KILN_RETURN_IF_ERROR(pool_->waitFence(fill.buffer));
          uint8_t* base = pool_->base(fill.buffer);
          for (size_t i : fill.copies) std::memcpy(base + layout_.offset[i], data[i], bytes[i]);
          host_copied_ += fill.copy_bytes;
          break;
        }
        case K::CopyWaitConsumed:
          break;  // the compute stream is emulated in order: CopyIn ran at launch
        case K::Upload: {
          const uint8_t* src = op.from_buffer ? pool_->base(fill.buffer) : pinned.data();
          auto* dst = landing_[static_cast<size_t>(op.slot)].data();
          const size_t n = layout_.total;
          copy_stream_.push_back([src, dst, n] { std::memcpy(dst, src, n); });
          break;
        }
        case K::RecordUploaded: {
          const size_t mark = done_ + copy_stream_.size();
          uploaded_mark_[static_cast<size_t>(op.slot)] = mark;
          if (fill.inPlace())
            pool_->setFence(fill.buffer, [this, mark] {
              runCopyStream(mark);
              return Status::ok();
            });
          break;
        }
        default:
          return Status::errorf("stage() issued {}", op.str());
      }
    }
    all.insert(all.end(), ops.begin(), ops.end());
    return t;
  }
  // launch() and collect() at once: what the step read, per input name.
  Expected<std::map<std::string, std::vector<uint8_t>>> launchAndCollect(int64_t t,
                                                                         std::vector<PipelineOp>& all) {
    std::vector<PipelineOp> ops;
    KILN_RETURN_IF_ERROR(pipeline_.launch(t, ops));
    KILN_RETURN_IF_ERROR(pipeline_.collect(t, ops));
    for (const PipelineOp& op : ops) {
      if (op.kind == K::ComputeWaitUploaded) runCopyStream(uploaded_mark_[static_cast<size_t>(op.slot)]);
      if (op.kind == K::CopyIn) inputs_ = landing_[static_cast<size_t>(op.slot)];
    }
    all.insert(all.end(), ops.begin(), ops.end());
    std::map<std::string, std::vector<uint8_t>> read;
    for (size_t i = 0; i < names_.size(); ++i)
      read[names_[i]].assign(inputs_.begin() + static_cast<long>(layout_.offset[i]),
                             inputs_.begin() + static_cast<long>(layout_.offset[i] + layout_.bytes[i]));
    return read;
  }
  size_t hostCopied() const { return host_copied_; }
  size_t uploadsPending() const { return copy_stream_.size(); }

 private:
  void runCopyStream(size_t through) {
    while (done_ < through && !copy_stream_.empty()) {
      copy_stream_.front()();
      copy_stream_.pop_front();
      ++done_;
    }
  }

  InputPipeline pipeline_;
  StagingLayout layout_;
  std::vector<std::string> names_;
  std::shared_ptr<data::StagingPool> pool_;
  std::vector<std::vector<uint8_t>> pinned_, landing_;
  std::vector<uint8_t> inputs_;
  std::deque<std::function<void()>> copy_stream_;
  size_t done_ = 0;
  std::vector<size_t> uploaded_mark_;
  size_t host_copied_ = 0;
};

// A batch of B samples: dense f32 [B, 13], jagged ids i64 (up to 3 per sample: `ids` of them),
// label f32 [B]; its bytes differ from every other seed's.
data::Batch makeBatch(int64_t b, int64_t ids, uint32_t seed) {
  data::Batch batch;
  batch.size = b;
  batch.names = {"dense", "ids", "label"};
  batch.tensors.emplace_back(ir::DType::f32, std::vector<int64_t>{b, 13});
  batch.tensors.emplace_back(ir::DType::i64, std::vector<int64_t>{ids});
  batch.tensors.emplace_back(ir::DType::f32, std::vector<int64_t>{b});
  uint32_t x = seed * 2654435761u + 1;
  for (ir::HostTensor& t : batch.tensors)
    for (unsigned char& c : t.storage) {
      x = x * 1664525u + 1013904223u;
      c = static_cast<unsigned char>(x >> 24);
    }
  return batch;
}

// The layout the executor plans for batch B (inputs in declaration order, then lr and step).
struct Layouts {
  StagingLayout slots;
  data::StagingBufferLayout pool;
};
Layouts layoutsFor(int64_t b) {
  Layouts l;
  l.pool.names = {"dense", "ids", "label", "lr", "step"};
  l.slots = StagingLayout::plan(
      {static_cast<size_t>(b * 13 * 4), static_cast<size_t>(3 * b * 8), static_cast<size_t>(b * 4), 4, 4},
      256);
  l.pool.offset = l.slots.offset;
  l.pool.bytes = l.slots.bytes;
  l.pool.total = l.slots.total;
  return l;
}

std::vector<uint8_t> bytesOf(const ir::HostTensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.view.data);
  return {p, p + t.view.bytes()};
}

// The views a step takes: the batch's, and the lr and step scalars the trainer adds.
std::map<std::string, ir::TensorView> stepViews(const data::Batch& b, float* scalars) {
  std::map<std::string, ir::TensorView> v;
  for (size_t i = 0; i < b.names.size(); ++i) v[b.names[i]] = b.tensors[i].view;
  v["lr"] = ir::TensorView{ir::DType::f32, {}, &scalars[0]};
  v["step"] = ir::TensorView{ir::DType::f32, {}, &scalars[1]};
  return v;
}

// What a step must read: the batch's bytes (a jagged input's slot past its ids is never read,
// so only the batch's own bytes are compared), and the scalars.
void expectStepRead(const std::map<std::string, std::vector<uint8_t>>& read,
                    const std::map<std::string, std::vector<uint8_t>>& want, const float* scalars, int step) {
  for (const auto& [name, bytes] : want) {
    ASSERT_GE(read.at(name).size(), bytes.size()) << name;
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), read.at(name).begin())) << name << " at step " << step;
  }
  float lr = 0, st = 0;
  std::memcpy(&lr, read.at("lr").data(), 4);
  std::memcpy(&st, read.at("step").data(), 4);
  EXPECT_EQ(lr, scalars[0]) << step;
  EXPECT_EQ(st, scalars[1]) << step;
}

// The trainer's order with batches the data thread placed: no host copy of the batch (only the
// 8 bytes of lr and step), every step reads its own batch, and the plan is hazard-free.
TEST(StagedInPlace, EveryStepReadsItsBatchAndTheHostCopiesOnlyTheScalars) {
  const int64_t b = 64;
  Layouts l = layoutsFor(b);
  auto pool = data::StagingPool::create(l.pool, 4);
  ASSERT_TRUE(pool) << pool.status().message();
  EmulatedExecutor ex(l.pool, l.slots, 2);
  ex.usePool(*pool);
  const int steps = 8;
  std::vector<data::Batch> batches;
  std::vector<std::map<std::string, std::vector<uint8_t>>> want;
  std::vector<std::array<float, 2>> scalars;
  for (int i = 0; i < steps; ++i) {
    batches.push_back(makeBatch(b, 2 * b + i, static_cast<uint32_t>(i)));  // ids of several counts
    std::map<std::string, std::vector<uint8_t>> w;
    for (size_t k = 0; k < batches.back().names.size(); ++k)
      w[batches.back().names[k]] = bytesOf(batches.back().tensors[k]);
    want.push_back(w);
    scalars.push_back({0.5f + static_cast<float>(i), static_cast<float>(i + 1)});
  }
  std::vector<PipelineOp> ops;
  std::deque<data::Batch> held;  // the data thread places each batch a step before it is staged
  auto place = [&](int i) {
    data::Batch moved = std::move(batches[static_cast<size_t>(i)]);
    EXPECT_TRUE((*pool)->place(moved)) << i;
    EXPECT_GE((*pool)->find(moved.tensors[0].view.data), 0);
    held.push_back(std::move(moved));
  };
  place(0);
  place(1);
  auto current = ex.stage(stepViews(held[0], scalars[0].data()), ops);
  ASSERT_TRUE(current) << current.status().message();
  for (int i = 0; i < steps; ++i) {
    if (i + 2 < steps) place(i + 2);
    Expected<int64_t> next = Status::error("last");
    if (i + 1 < steps) {
      next = ex.stage(stepViews(held[1], scalars[static_cast<size_t>(i + 1)].data()), ops);
      ASSERT_TRUE(next) << next.status().message();
    }
    auto read = ex.launchAndCollect(*current, ops);
    ASSERT_TRUE(read) << read.status().message();
    expectStepRead(*read, want[static_cast<size_t>(i)], scalars[static_cast<size_t>(i)].data(), i);
    held.pop_front();  // the trainer lets go of the batch it trained on
    if (next) current = next;
  }
  EXPECT_EQ(ex.hostCopied(), static_cast<size_t>(steps) * 8);
  EXPECT_EQ(std::count_if(ops.begin(), ops.end(),
                          [](const PipelineOp& op) { return op.kind == K::FillPinnedSkipped; }),
            steps);
  EXPECT_EQ(std::count_if(ops.begin(), ops.end(),
                          [](const PipelineOp& op) {
                            return op.kind == K::FillPinned || op.kind == K::HostWaitUploaded;
                          }),
            0);
  EXPECT_EQ(joined(findPipelineHazards(ops, 2)), "");
  EXPECT_EQ((*pool)->stats().placed, steps);
}

// A batch laid out for another batch size (the data's short last batch, placed in a pool of
// another executor's layout), and one the data thread did not place: copied by the host as
// before, and read correctly.
TEST(StagedInPlace, ABatchOfAnotherSizeIsCopiedByTheHost) {
  Layouts big = layoutsFor(64), small = layoutsFor(40);
  auto other_pool = data::StagingPool::create(small.pool, 2);
  auto pool = data::StagingPool::create(big.pool, 2);
  ASSERT_TRUE(other_pool && pool);
  EmulatedExecutor ex(big.pool, big.slots, 2);
  ex.usePool(*pool);
  data::Batch shorter = makeBatch(40, 100, 7);
  std::map<std::string, std::vector<uint8_t>> want;
  for (size_t k = 0; k < shorter.names.size(); ++k) want[shorter.names[k]] = bytesOf(shorter.tensors[k]);
  ASSERT_TRUE((*other_pool)->place(shorter));
  float scalars[2] = {1.f, 3.f};
  std::vector<PipelineOp> ops;
  auto t = ex.stage(stepViews(shorter, scalars), ops);
  ASSERT_TRUE(t);
  EXPECT_EQ(kinds(ops), (std::vector<K>{K::FillPinned, K::Upload, K::RecordUploaded}));
  auto read = ex.launchAndCollect(*t, ops);
  ASSERT_TRUE(read);
  expectStepRead(*read, want, scalars, 0);
  size_t batch_bytes = 8;
  for (const auto& [n, w] : want) batch_bytes += w.size();
  EXPECT_EQ(ex.hostCopied(), batch_bytes);

  // Too big for the pool's layout: not placed, left as it was.
  data::Batch bigger = makeBatch(80, 100, 8);
  const void* before = bigger.tensors[0].view.data;
  EXPECT_FALSE((*pool)->place(bigger));
  EXPECT_EQ(bigger.tensors[0].view.data, before);
  EXPECT_EQ((*pool)->stats().did_not_fit, 1);

  // A batch one of whose inputs lies in the pool but not at its place: copied whole.
  data::Batch placed = makeBatch(64, 128, 9);
  ASSERT_TRUE((*pool)->place(placed));
  std::map<std::string, ir::TensorView> views = stepViews(placed, scalars);
  std::swap(views["dense"], views["label"]);
  std::vector<const void*> data;
  std::vector<size_t> bytes;
  for (const std::string& n : big.pool.names) {
    data.push_back(views[n].data);
    bytes.push_back(static_cast<size_t>(views[n].bytes()));
  }
  HostFill fill = planHostFill(big.slots, data, bytes, pool->get());
  EXPECT_FALSE(fill.inPlace());
  EXPECT_EQ(fill.copies.size(), 5u);
}

// The pool never hands out a buffer an upload still reads: a batch staged from buffer 0 and let
// go before its upload ran (a dropped stage), then the next batch placed in the only buffer. The
// pool waits for the fence, so the upload reads the first batch; without it the step would read
// the second's bytes.
TEST(StagedInPlace, APlacedBufferIsNotReusedBeforeItsUpload) {
  Layouts l = layoutsFor(32);
  auto pool = data::StagingPool::create(l.pool, 1);
  ASSERT_TRUE(pool);
  EmulatedExecutor ex(l.pool, l.slots, 2);
  ex.usePool(*pool);
  float scalars[2] = {0.25f, 1.f};
  std::vector<PipelineOp> ops;
  std::map<std::string, std::vector<uint8_t>> want;
  Expected<int64_t> t = Status::error("");
  {
    data::Batch first = makeBatch(32, 90, 1);
    for (size_t k = 0; k < first.names.size(); ++k) want[first.names[k]] = bytesOf(first.tensors[k]);
    ASSERT_TRUE((*pool)->place(first));
    t = ex.stage(stepViews(first, scalars), ops);
    ASSERT_TRUE(t);
    EXPECT_EQ(ex.uploadsPending(), 1u);
  }  // `first` destroyed: its buffer goes back while the upload is pending
  data::Batch second = makeBatch(32, 90, 2);
  data::Batch none_free = makeBatch(32, 90, 3);
  ASSERT_TRUE((*pool)->place(second));
  EXPECT_EQ(ex.uploadsPending(), 0u);  // the fence ran the upload before the copy
  EXPECT_EQ((*pool)->stats().fence_waits, 1);
  EXPECT_FALSE((*pool)->place(none_free));  // the one buffer is leased: the host copies this one
  EXPECT_EQ((*pool)->stats().none_free, 1);
  auto read = ex.launchAndCollect(*t, ops);
  ASSERT_TRUE(read);
  expectStepRead(*read, want, scalars, 0);
}

}  // namespace
}  // namespace kiln::cuda
