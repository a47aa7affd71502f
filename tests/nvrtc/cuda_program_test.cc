// The CUDA executor's Program (codegen::buildCudaProgram), checked on the CPU: groups on the
// streams the schedule pass chose, events wherever a group reads or updates in place what
// another stream touched, a fork from and a join into stream 0, and an arena plan in which no
// two buffers that may be live at once overlap. Happens-before is recomputed here from the
// instructions alone (stream order plus record -> wait edges), independently of the planner's
// vector clocks.
#include "codegen/cuda_program.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "codegen/emit/embedding_sort.h"
#include "codegen/kernel_lowering.h"
#include "frontend/frontend.h"
#include "ir/op_def.h"
#include "ir/parser.h"
#include "passes/pass_manager.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;
using codegen::InstrKind;
using codegen::Instruction;

// Reachability over the instructions: a before b iff a path of stream-order and event edges
// leads from a to b.
class HappensBefore {
 public:
  explicit HappensBefore(const codegen::Program& p) {
    for (const codegen::Stream& s : p.streams)
      for (const Instruction& in : s.instrs) {
        nodes_.push_back(&in);
        stream_[&in] = s.id;
      }
    std::sort(nodes_.begin(), nodes_.end(),
              [](const Instruction* a, const Instruction* b) { return a->seq < b->seq; });
    const size_t n = nodes_.size();
    for (size_t i = 0; i < n; ++i) index_[nodes_[i]] = i;
    std::vector<std::vector<size_t>> preds(n);
    std::map<int, size_t> record_of;
    for (const codegen::Stream& s : p.streams)
      for (size_t i = 1; i < s.instrs.size(); ++i)
        preds[index_[&s.instrs[i]]].push_back(index_[&s.instrs[i - 1]]);
    for (size_t i = 0; i < n; ++i)
      if (nodes_[i]->kind == InstrKind::RecordEvent) record_of[nodes_[i]->event] = i;
    for (size_t i = 0; i < n; ++i)
      if (nodes_[i]->kind == InstrKind::WaitEvent) {
        auto it = record_of.find(nodes_[i]->event);
        EXPECT_NE(it, record_of.end()) << "event " << nodes_[i]->event << " is waited for but never recorded";
        if (it != record_of.end()) preds[i].push_back(it->second);
      }
    // Every edge points forward in seq order (validate() checks records precede waits), so one
    // pass in that order closes the relation.
    before_.assign(n, std::vector<bool>(n, false));
    for (size_t i = 0; i < n; ++i)
      for (size_t j : preds[i]) {
        EXPECT_LT(j, i) << "an edge runs backwards in the global order";
        before_[i][j] = true;
        for (size_t k = 0; k < n; ++k)
          if (before_[j][k]) before_[i][k] = true;
      }
  }
  bool operator()(const Instruction* a, const Instruction* b) const {
    return before_[index_.at(b)][index_.at(a)];
  }
  int stream(const Instruction* in) const { return stream_.at(in); }
  const std::vector<const Instruction*>& inOrder() const { return nodes_; }

 private:
  std::vector<const Instruction*> nodes_;
  std::map<const Instruction*, size_t> index_;
  std::map<const Instruction*, int> stream_;
  std::vector<std::vector<bool>> before_;  // before_[b][a]: a happens before b
};

struct Checked {
  int cross_stream_reads = 0;   // reads of a value another stream wrote
  int cross_stream_writes = 0;  // in-place writes over a value another stream read
  int overlapping_pairs = 0;    // arena buffers sharing bytes at different times
};

// Checks every property in the header comment; returns counts so callers can assert that the
// interesting cases occurred.
Checked checkProgram(const codegen::CudaProgram& cp, const std::vector<codegen::LoweredGroup>& groups) {
  Checked c;
  const codegen::Program& p = cp.program;
  EXPECT_TRUE(codegen::validate(p).isOk());
  EXPECT_TRUE(p.planned);
  HappensBefore hb(p);

  // Launches: one per group, on the group's stream.
  std::map<const Instruction*, size_t> group_of;
  for (const Instruction* in : hb.inOrder())
    if (in->kind == InstrKind::Launch) {
      auto it = in->attrs.find("group");
      EXPECT_NE(it, in->attrs.end());
      size_t g = static_cast<size_t>(it->second.asInt());
      EXPECT_LT(g, groups.size());
      EXPECT_EQ(hb.stream(in), groups[g].stream) << "group " << g;
      EXPECT_EQ(group_of.count(in), 0u);
      group_of[in] = g;
    }
  EXPECT_EQ(group_of.size(), groups.size());

  // Which buffers each group reads, defines and writes in place, from its ops (not from what
  // buildCudaProgram derived).
  std::map<const ir::Value*, int> buffer_of;
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t j = 0; j < groups[g].buffers.size(); ++j)
      if (groups[g].buffers[j].value) buffer_of[groups[g].buffers[j].value] = cp.group_buffers[g][j];
  auto accesses = [&](size_t g, std::set<int>& reads, std::set<int>& defines, std::set<int>& in_place) {
    std::set<const ir::Op*> ops(groups[g].ops.begin(), groups[g].ops.end());
    for (const ir::Op* op : groups[g].ops) {
      for (const ir::Value* v : op->results())
        if (buffer_of.count(codegen::outerValue(v))) defines.insert(buffer_of.at(codegen::outerValue(v)));
      for (const ir::Value* v : op->operands()) {
        const ir::Op* def = v->definingOp();
        if (def && ops.count(def)) continue;
        const ir::Value* outer = codegen::outerValue(v);
        if (!buffer_of.count(outer)) continue;  // a splat constant folded into the kernel
        reads.insert(buffer_of.at(outer));
        // Updates write their parameter operands (the weights and optimizer state; the verifier
        // requires those to be kiln.parameter values), not lr or step.
        const ir::Op* source = outer->definingOp();
        if (op->hasTrait(ir::kSideEffect) && source && source->name() == "kiln.parameter")
          in_place.insert(buffer_of.at(outer));
      }
    }
  };
  std::map<int, const Instruction*> last_write;
  std::map<int, std::vector<const Instruction*>> readers;
  for (const Instruction* in : hb.inOrder()) {
    if (in->kind != InstrKind::Launch) continue;
    std::set<int> reads, defines, in_place;
    accesses(group_of.at(in), reads, defines, in_place);
    for (int b : reads) {
      auto w = last_write.find(b);
      if (w == last_write.end()) continue;
      if (hb.stream(w->second) != hb.stream(in)) ++c.cross_stream_reads;
      EXPECT_TRUE(hb(w->second, in)) << "buffer " << b << " ('" << p.buffers[b].name << "') is read by seq "
                                     << in->seq << " on stream " << hb.stream(in) << " before its writer seq "
                                     << w->second->seq << " is waited for";
    }
    for (int b : in_place)
      for (const Instruction* r : readers[b]) {
        if (r == in) continue;
        if (hb.stream(r) != hb.stream(in)) ++c.cross_stream_writes;
        EXPECT_TRUE(hb(r, in)) << "buffer " << b << " ('" << p.buffers[b].name
                               << "') is updated in place by seq " << in->seq << " while seq " << r->seq
                               << " on stream " << hb.stream(r) << " may still read it";
      }
    for (int b : reads) readers[b].push_back(in);
    for (int b : in_place) {
      last_write[b] = in;
      readers[b].clear();
    }
    for (int b : defines) {
      last_write[b] = in;
      readers[b].clear();
    }
  }

  // Fork and join: every other stream starts after stream 0's first instruction and finishes
  // before stream 0's last.
  const codegen::Stream& s0 = p.streams.front();
  EXPECT_EQ(s0.id, 0);
  for (const codegen::Stream& s : p.streams) {
    if (s.id == 0 || s.instrs.empty()) continue;
    EXPECT_EQ(s.instrs.front().kind, InstrKind::WaitEvent) << "stream " << s.id << " starts without the fork";
    EXPECT_TRUE(hb(&s0.instrs.front(), &s.instrs.front()));
    EXPECT_TRUE(hb(&s.instrs.back(), &s0.instrs.back()))
        << "stream " << s.id << " is not joined into stream 0";
  }

  // The arena: buffers sharing bytes are never live at once. Uses are the instructions naming
  // a buffer; a result of the program is also used by the end of the step (after everything).
  std::map<int, std::vector<const Instruction*>> uses;
  for (const Instruction* in : hb.inOrder()) {
    for (int b : in->operands) uses[b].push_back(in);
    for (int b : in->results) uses[b].push_back(in);
  }
  std::set<int> results(p.results.begin(), p.results.end());
  auto allBefore = [&](int a, int b) {  // every use of a happens before every use of b
    if (results.count(a)) return false;
    for (const Instruction* x : uses[a])
      for (const Instruction* y : uses[b])
        if (!hb(x, y)) return false;
    return true;
  };
  for (const codegen::Buffer& a : p.buffers) {
    if (!a.inArena() || a.bytes == 0 || uses[a.id].empty()) continue;
    EXPECT_EQ(a.offset % 256, 0) << "buffer " << a.id;
    EXPECT_LE(a.offset + a.bytes, p.arena_bytes);
    for (const codegen::Buffer& b : p.buffers) {
      if (b.id <= a.id || !b.inArena() || b.bytes == 0 || uses[b.id].empty()) continue;
      if (a.offset >= b.offset + b.bytes || b.offset >= a.offset + a.bytes) continue;
      ++c.overlapping_pairs;
      EXPECT_TRUE(allBefore(a.id, b.id) || allBefore(b.id, a.id))
          << "buffers " << a.id << " ('" << a.name << "') and " << b.id << " ('" << b.name
          << "') share arena bytes and may be live at once";
    }
  }
  return c;
}

// A stream-1 lookup feeding a stream-0 sum, a stream-0 reader of the table, and the stream-1
// sparse update of that table, which must wait for both.
const char* kTwoStreams = R"(
func.func @train_step() -> (!kiln.tensor<Bx4xf32>, !kiln.tensor<f32>) {
  %x = "kiln.input"() {name = "dense"} : () -> !kiln.tensor<Bx4xf32>
  %ids = "kiln.input"() {name = "ids"} : () -> !kiln.tensor<Bx2xi32>
  %lr = "kiln.input"() {name = "lr"} : () -> !kiln.tensor<f32>
  %step = "kiln.input"() {name = "step"} : () -> !kiln.tensor<f32>
  %table = "kiln.parameter"() {name = "table"} : () -> !kiln.tensor<10x4xf32>
  %w = "kiln.parameter"() {name = "w"} : () -> !kiln.tensor<4x4xf32>
  %e = "kiln.embedding_bag"(%table, %ids) {kiln.stream = 1} : (!kiln.tensor<10x4xf32>, !kiln.tensor<Bx2xi32>) -> !kiln.tensor<Bx4xf32>
  %h = "kiln.matmul"(%x, %w) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4x4xf32>) -> !kiln.tensor<Bx4xf32>
  %r = "kiln.relu"(%h) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %s = "kiln.add"(%r, %e) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %n = "kiln.reduce"(%table) {axes = [0, 1], kind = "sum"} : (!kiln.tensor<10x4xf32>) -> !kiln.tensor<f32>
  "kiln.embedding_bag_update"(%table, %ids, %s, %lr, %step) {optimizer = "sgd", lr = 1.0, kiln.stream = 1} : (!kiln.tensor<10x4xf32>, !kiln.tensor<Bx2xi32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<f32>, !kiln.tensor<f32>) -> ()
  "func.return"(%s, %n) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<f32>) -> ()
}
)";

// kTwoStreams parsed (`f`: its @train_step) and lowered at B = 8 (`groups`).
class TwoStreamStep : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = ir::parseModule(kTwoStreams, "<test>");
    ASSERT_TRUE(m) << m.status().str();
    module_ = m.take();
    f_ = module_->lookup("train_step");
    ASSERT_NE(f_, nullptr);
    auto g = codegen::lowerFunction(*f_, {{"B", 8}});
    ASSERT_TRUE(g) << g.status().message();
    groups_ = g.take();
  }
  std::unique_ptr<ir::Module> module_;
  const ir::Function* f_ = nullptr;
  std::vector<codegen::LoweredGroup> groups_;
};

TEST_F(TwoStreamStep, TwoStreamsWaitForTheirProducersAndReaders) {
  const ir::Function& f = *f_;
  std::vector<codegen::LoweredGroup>& groups = groups_;
  auto cp = codegen::buildCudaProgram(f, groups, {{"B", 8}});
  ASSERT_TRUE(cp) << cp.status().message();
  const codegen::Program& p = cp->program;
  ASSERT_EQ(p.streams.size(), 2u) << p.str();
  EXPECT_EQ(p.streams[1].id, 1);
  Checked c = checkProgram(*cp, groups);
  EXPECT_GE(c.cross_stream_reads, 2) << p.str();   // stream 0 reads the lookup; stream 1 reads %s
  EXPECT_GE(c.cross_stream_writes, 1) << p.str();  // the update waits for the stream-0 reduce
  // Inputs are copied on stream 0, so stream 1 starts with the fork.
  EXPECT_EQ(p.streams[1].instrs.front().kind, InstrKind::WaitEvent);
  EXPECT_EQ(cp->inputs.size(), 4u);
  EXPECT_EQ(cp->error_flags.size(), 2u);  // the lookup's and the update's
}

// The sparse update reads its ids and gradient through an address table: a buffer outside the
// arena whose words name the program buffers, which the runtime writes once they are placed.
TEST_F(TwoStreamStep, TheEmbeddingBackwardsAddressTableNamesItsBuffers) {
  const ir::Function& f = *f_;
  std::vector<codegen::LoweredGroup>& groups = groups_;
  auto cp = codegen::buildCudaProgram(f, groups, {{"B", 8}});
  ASSERT_TRUE(cp) << cp.status().message();
  const codegen::Program& p = cp->program;
  ASSERT_EQ(cp->address_tables.size(), 1u);
  const codegen::CudaProgram::AddressTable& t = cp->address_tables[0];
  const codegen::Buffer& tb = p.buffers[static_cast<size_t>(t.buffer)];
  EXPECT_FALSE(tb.inArena()) << p.str();
  ASSERT_EQ(t.words.size(), 2u * codegen::emit::kTableWords);  // one table and the end row
  const int ids = t.words[codegen::emit::kIdsAddress].buffer, grad = t.words[codegen::emit::kGradAddress].buffer;
  ASSERT_GE(ids, 0);
  ASSERT_GE(grad, 0);
  EXPECT_EQ(p.buffers[static_cast<size_t>(ids)].name, "ids");
  EXPECT_EQ(grad, p.results[0]);  // %s
  EXPECT_EQ(t.words[codegen::emit::kDim].value, 4);
  EXPECT_EQ(t.words[codegen::emit::kOccurrences].value, 16);  // B x 2
  EXPECT_EQ(t.words[codegen::emit::kTableWords + codegen::emit::kBegin].value, 16);
  // Placed: the address words become the buffers' addresses, the rest stay as they are.
  std::vector<uint64_t> address(p.buffers.size());
  for (size_t b = 0; b < address.size(); ++b) address[b] = 0x10000 * (b + 1);
  std::vector<int64_t> words = t.at(address);
  EXPECT_EQ(words[codegen::emit::kIdsAddress], static_cast<int64_t>(address[static_cast<size_t>(ids)]));
  EXPECT_EQ(words[codegen::emit::kWeightsAddress], 0);
  EXPECT_EQ(words[codegen::emit::kDim], 4);
  // Every group kernel takes a handful of parameters; the ids and gradient are not among them.
  for (const codegen::LoweredGroup& g : groups)
    for (const codegen::Kernel& k : g.kernels)
      if (k.kind == codegen::KernelKind::Source) EXPECT_LE(k.buffers.size(), 8u) << k.name;
}

TEST_F(TwoStreamStep, OneStreamNeedsNoEvents) {
  const ir::Function& f = *f_;
  std::vector<codegen::LoweredGroup>& groups = groups_;
  for (auto& g : groups) g.stream = 0;
  auto cp = codegen::buildCudaProgram(f, groups, {{"B", 8}});
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_EQ(cp->program.streams.size(), 1u);
  EXPECT_EQ(cp->program.num_events, 0);
  EXPECT_EQ(cp->program.numInstructions(), static_cast<int>(groups.size()));
  checkProgram(*cp, groups);
}

// Every model's training step through the product's pipeline (fusion, then the schedule pass
// that puts embedding work on stream 1).
class ModelCudaProgram : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelCudaProgram, StreamsEventsAndArenaAreSafe) {
  std::ostringstream diag_text;
  frontend::DiagnosticEngine diags(&diag_text);
  auto m = frontend::compileModelFile(GetParam(), {}, diags);
  ASSERT_TRUE(m) << diag_text.str();
  passes::PassManager pm;
  ASSERT_TRUE(pm.addPipeline("autodiff,canonicalize,cse,dce,fusion,schedule").isOk());
  auto r = pm.run(**m);
  ASSERT_TRUE(r) << r.status().message();
  const ir::Function& f = *(*m)->lookup("train_step");
  const ir::SymbolBindings symbols = {{"B", 64}};
  auto groups = codegen::lowerFunction(f, symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  auto cp = codegen::buildCudaProgram(f, *groups, symbols);
  ASSERT_TRUE(cp) << cp.status().message();
  bool tables = false;
  const_cast<ir::Function&>(f).walk([&](ir::Op& op) { tables |= op.is(ir::OpCode::EmbeddingBag); });
  // The recommendation models' embedding work runs on stream 1; a model without tables (the MoE
  // layer, the language model) keeps one stream, and its program must be just as safe.
  if (tables)
    ASSERT_EQ(cp->program.streams.size(), 2u) << "the schedule pass puts embedding work on stream 1";
  Checked c = checkProgram(*cp, *groups);
  if (tables) EXPECT_GT(c.cross_stream_reads, 0);
  EXPECT_GT(c.overlapping_pairs, 0) << "the arena reuses no block at all";
}

INSTANTIATE_TEST_SUITE_P(Models, ModelCudaProgram, ::testing::ValuesIn(modelFiles()),
                         [](const auto& info) { return fs::path(info.param).stem().string(); });

}  // namespace
}  // namespace kiln::testing
