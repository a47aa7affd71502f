// The embedding backward's generated CUDA run on the host (simt) against the CPU reference, and
// under several block and thread orders (KILN_SIMT_SEED), which must all give the same bits.
//
// Every update group here is a fused `embedding_update` group (the shape kiln's fusion pass
// gives a model's sparse updates): tables with fixed hotness and jagged bags, per-id weights,
// sum and mean pooling, duplicate ids, empty bags, and a hot id with 4096 occurrences.
//
// The atomic hash-table backward this replaced (an EmbeddingInsert kernel claiming each id's
// slot, then an EmbeddingAccumulate kernel doing one atomicAdd per occurrence into its id's row)
// fails the same check: run once over one id with 4096 occurrences under seeds 0 to 3, its
// summed row differed between seed 0 and each of seeds 1, 2 and 3 (the same additions, in the
// order the warps happened to run).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "codegen/cuda_emitter.h"
#include "codegen/emit/embedding_sort.h"
#include "codegen/kernel_lowering.h"
#include "tests/nvrtc/embedding_update_groups.h"
#include "tests/nvrtc/op_cases.h"
#include "tests/simt/host_module.h"

namespace kiln::testing {
namespace {

// Runs every kernel of `g` in simt over guarded copies of `storage` (one tensor per group
// buffer), with the block order seeded by `seed` (0: the default order), and copies back.
Status runGroup(const codegen::LoweredGroup& g, std::vector<ir::HostTensor>& storage, unsigned seed) {
  std::vector<const codegen::Kernel*> kernels;
  for (const codegen::Kernel& k : g.kernels) kernels.push_back(&k);
  KILN_ASSIGN_OR_RETURN(auto module, simt::HostModule::compile(codegen::emitModule(kernels)));
  std::vector<simt::GuardedBuffer> bufs;
  std::vector<uint64_t> address;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    KILN_ASSIGN_OR_RETURN(auto b, simt::GuardedBuffer::allocate(std::max<size_t>(storage[i].storage.size(), 1),
                                                                ir::dtypeBytes(g.buffers[i].dtype)));
    if (!storage[i].storage.empty()) std::memcpy(b.data(), storage[i].storage.data(), storage[i].storage.size());
    address.push_back(reinterpret_cast<uint64_t>(b.data()));
    bufs.push_back(std::move(b));
  }
  fillAddressTables(g, address);
  setenv("KILN_SIMT_SEED", std::to_string(seed).c_str(), 1);
  Status s = Status::ok();
  for (size_t k = 0; k < g.kernels.size() && s.isOk(); ++k) {
    std::string name;
    codegen::emitKernel(g.kernels[k], &name);
    std::vector<void*> args;
    for (int gb : g.args[k]) args.push_back(bufs[static_cast<size_t>(gb)].data());
    s = module->launch(name, codegen::launchConfig(g.kernels[k]), args);
  }
  unsetenv("KILN_SIMT_SEED");
  for (size_t i = 0; i < g.buffers.size(); ++i)
    if (!storage[i].storage.empty()) std::memcpy(storage[i].storage.data(), bufs[i].data(), storage[i].storage.size());
  return s;
}

// Fixed and jagged, weighted and not, sum and mean, duplicates, empty bags (the lengths fill
// leaves some), and table 3: one id taking all 64 x 64 = 4096 occurrences.
std::vector<UpdateTable> mixedTables() {
  return {
      {50, 12, DType::i64, 4, 0, 50, false, false, "sgd"},
      {7, 40, DType::i32, 3, 0, 7, true, true, "adagrad"},
      {20, 8, DType::i64, 0, 300, 20, true, true, "rowwise_adagrad"},
      {3, 4, DType::i32, 64, 0, 1, false, false, "sgd"},
      {9, 33, DType::i32, 0, 90, 9, false, false, "sgd"},
  };
}

struct Ran {
  OpCase c;
  CaseRun run;
  codegen::LoweredGroup g;
};

Ran prepare(OpCase c, unsigned seed) {
  std::mt19937 rng(seed);
  auto run = runReference(c, rng);
  EXPECT_TRUE(run) << run.status().message();
  auto g = codegen::lowerFusedGroup("embedding_update", c.group, c.symbols);
  EXPECT_TRUE(g) << g.status().message();
  return {std::move(c), run ? run.take() : CaseRun{}, g ? g.take() : codegen::LoweredGroup{}};
}

TEST(SimtEmbeddingBackward, MatchesTheCpuReference) {
  Ran r = prepare(updateGroup("mixed", 64, mixedTables()), 11);
  std::vector<ir::HostTensor> host = groupStorage(r.g, r.run);
  clearErrorFlags(r.g, host);
  Status s = runGroup(r.g, host, 0);
  ASSERT_TRUE(s.isOk()) << s.message();
  expectNoErrorFlagged(r.g, host);
  EXPECT_EQ(expectGroupMatchesReference(r.g, host, r.run, r.c.tol, "simt"), 7);  // 5 tables, 2 states
}

TEST(SimtEmbeddingBackward, BitIdenticalUnderEveryOrder) {
  Ran r = prepare(updateGroup("mixed", 64, mixedTables()), 12);
  std::vector<std::vector<ir::HostTensor>> results;
  for (unsigned seed : {0u, 1u, 2u, 3u}) {
    std::vector<ir::HostTensor> host = groupStorage(r.g, r.run);
    clearErrorFlags(r.g, host);
    Status s = runGroup(r.g, host, seed);
    ASSERT_TRUE(s.isOk()) << s.message();
    results.push_back(std::move(host));
  }
  for (size_t i = 0; i < r.g.buffers.size(); ++i) {
    const codegen::GroupBuffer& b = r.g.buffers[i];
    if (!b.value || !b.written) continue;
    for (size_t run = 1; run < results.size(); ++run)
      EXPECT_EQ(std::memcmp(results[0][i].storage.data(), results[run][i].storage.data(), results[0][i].storage.size()),
                0)
          << b.name << " differs between seed 0 and seed " << run;
  }
}

// The kernels share one error flag; the table it names is numbered across the group, so a bad
// id in the second table's update is reported as that table, not the first.
TEST(SimtEmbeddingBackward, AnIdOutOfRangeFlagsItsTable) {
  for (int bad_table : {0, 1}) {
    SCOPED_TRACE(bad_table);
    Ran r = prepare(updateGroup("two_updates", 4,
                                {{5, 4, DType::i64, 2, 0, 5, false, false, "sgd"},
                                 {8, 6, DType::i32, 3, 0, 8, false, false, "sgd"}}),
                    7);
    std::vector<ir::HostTensor> host = groupStorage(r.g, r.run);
    clearErrorFlags(r.g, host);
    int flag = -1;
    for (size_t i = 0; i < r.g.buffers.size(); ++i) {
      const codegen::GroupBuffer& b = r.g.buffers[i];
      if (b.name == "embedding_errors") flag = static_cast<int>(i);
      if (b.value && b.value->definingOp()->strAttr("name") == "cats." + std::to_string(bad_table)) {
        if (host[i].view.dtype == DType::i32) host[i].as<int32_t>()[5] = 8;  // rows [0, 8)
        else host[i].as<int64_t>()[5] = -1;
      }
    }
    ASSERT_GE(flag, 0);
    Status s = runGroup(r.g, host, 0);
    ASSERT_TRUE(s.isOk()) << s.message();
    const int32_t* err = host[static_cast<size_t>(flag)].as<int32_t>();
    EXPECT_EQ(err[0], 1);
    ASSERT_GE(err[1], 0);
    ASSERT_LT(static_cast<size_t>(err[1]), r.g.error_subjects.size());
    EXPECT_EQ(r.g.error_subjects[static_cast<size_t>(err[1])].name, "tables." + std::to_string(bad_table));
  }
}

// 1,100 tables in one group (the hash-table backward's per-table kernel parameters broke past
// about 1,020): the backward's kernels take a fixed handful of parameters, ONE fused launch
// steps every table's rows (all are sgd at lr 0.1), and every table matches plain loops over the
// inputs: each distinct id's row moves by lr * 0.1 times its summed gradient (TableSums), every
// other row stays as it was.
TEST(SimtEmbeddingBackward, ElevenHundredTablesInOneGroup) {
  std::vector<UpdateTable> tables;
  for (int i = 0; i < 1100; ++i) {
    // Some jagged tables: their lengths' scan (BagOffsets) still takes two parameters per table.
    if (i % 50 == 0) tables.push_back({5, 4 + i % 5, DType::i64, 0, 10, 5, i % 2 == 0, i % 2 == 0, "sgd"});
    else tables.push_back({3 + i % 7, 4, DType::i32, 2, 0, 3 + i % 7, i % 5 == 0, i % 4 == 0, "sgd"});
  }
  Ran r = prepare(updateGroup("many_tables", 4, tables), 13);
  std::vector<TableSums> want = referenceSums(r.c, r.run, tables);
  int updates = 0;
  for (const codegen::Kernel& k : r.g.kernels) {
    EXPECT_LE(k.buffers.size() * sizeof(void*), 4096u) << k.name;
    updates += k.name == "embedding_update_sgd";
  }
  EXPECT_EQ(updates, 1);
  // A scan, the keys, two radix passes (4 + 11 key bits: scan, scatter; histogram, scan,
  // scatter), the segments (count, scan, list), the pieces' partials, the update.
  EXPECT_EQ(r.g.kernels.size(), 12u);
  std::vector<ir::HostTensor> host = groupStorage(r.g, r.run);
  const std::vector<ir::HostTensor> before = groupStorage(r.g, r.run);
  clearErrorFlags(r.g, host);
  Status s = runGroup(r.g, host, 0);
  ASSERT_TRUE(s.isOk()) << s.message();
  expectNoErrorFlagged(r.g, host);

  float lr = 0;
  std::vector<int> table_buffer(tables.size(), -1);
  for (size_t i = 0; i < r.g.buffers.size(); ++i) {
    const ir::Value* v = r.g.buffers[i].value;
    if (!v) continue;
    const std::string name = v->definingOp()->strAttr("name");
    if (name == "lr") lr = host[i].as<float>()[0];
    if (name.rfind("tables.", 0) == 0) table_buffer[std::stoul(name.substr(7))] = static_cast<int>(i);
  }
  ASSERT_GT(lr, 0.0f);
  int bad = 0;
  for (size_t t = 0; t < tables.size() && bad < 5; ++t) {
    ASSERT_GE(table_buffer[t], 0) << "table " << t;
    const float* got = host[static_cast<size_t>(table_buffer[t])].as<float>();
    const float* old = before[static_cast<size_t>(table_buffer[t])].as<float>();
    const int64_t dim = tables[t].dim;
    std::vector<float> expect(old, old + tables[t].rows * dim);
    const TableSums& w = want[t];
    for (size_t o = 0; o < w.ids.size(); ++o)
      for (int64_t d = 0; d < dim; ++d)
        expect[static_cast<size_t>(w.ids[o] * dim + d)] -= 0.1f * lr * w.rows[o][static_cast<size_t>(d)];
    for (size_t e = 0; e < expect.size(); ++e)
      if (!(std::fabs(got[e] - expect[e]) <= 1e-5f * (1 + std::fabs(expect[e])))) {
        ADD_FAILURE() << "table " << t << " element " << e << ": " << got[e] << ", want " << expect[e];
        ++bad;
      }
  }
}

}  // namespace
}  // namespace kiln::testing
