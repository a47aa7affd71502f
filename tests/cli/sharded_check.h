// The check behind the sharded-step tests (sharded_step_test.cc on in-process ranks,
// sharded_step_mpi_test.cc on MPI processes): one rank trains its slice of every global batch
// with its own sharded program, and every piece it holds must equal the same region of the
// single-rank run's tensors (within f32 rounding: the sums run in another order).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "passes/plan_json.h"
#include "passes/shard.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/local_group.h"
#include "runtime/data/synthetic.h"
#include "tools/session_flags.h"

namespace kiln::cli::testing {

struct Model {
  const char* name;
  std::string path;  // under the source tree, or absolute
  frontend::ParamOverrides overrides;
  int ep = 1;  // expert parallelism of its MoE layers
};

// Model `m` with its 26 Criteo sparse features cut to one per entry of `rows` (each the table's
// rows), in a file of its own. The rows below are every size the 26 capped at 97 have: tables
// smaller than the rank count (3), row counts the ranks do not divide (97, 63, 10, 14) and several
// tables per rank. (If the model no longer declares `ids[B, 26]`, the original file is kept and
// its 26 features against these tables are a located error, not a silently different test.)
inline Model withSparseFeatures(Model m, const std::vector<int>& rows = {97, 97, 3, 63, 10, 4, 14, 36}) {
  std::ifstream in(std::string(KILN_SOURCE_DIR) + "/" + m.path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  m.overrides["rows"] = fmt::format("[{}]", fmt::join(rows, ", "));
  const std::string criteo = "ids[B, 26]";
  const size_t at = text.find(criteo);
  if (at == std::string::npos) return m;
  text.replace(at, criteo.size(), fmt::format("ids[B, {}]", rows.size()));
  const auto copy = std::filesystem::temp_directory_path() /
                    fmt::format("kiln_{}_{}features_{}.kiln", m.name, rows.size(), ::getpid());
  std::ofstream(copy) << text;
  m.path = copy.string();
  return m;
}

// Every model of models/ at a size one core trains in well under a second per step.
// deepfm and wide_deep keep 8 of the 26 sparse features: each has two tables per feature, and
// the passes' time grows faster than the table count (their sharded steps compiled at 26
// features took 4x dlrm's, ~60% of this test's time); dlrm, dlrm_dcnv2 and dcn keep all 26.
inline std::vector<Model> models() {
  return {
      {"tiny", "tests/reliability/Inputs/tiny.kiln", {}},
      {"dlrm", "models/dlrm.kiln", {{"rows_cap", "97"}, {"emb_dim", "8"}, {"top", "[16, 1]"}}},
      {"dlrm_dcnv2",
       "models/dlrm_dcnv2.kiln",
       {{"rows_cap", "97"}, {"emb_dim", "8"}, {"cross_rank", "8"}, {"top", "[16, 1]"}}},
      {"dcn", "models/dcn.kiln", {{"rows_cap", "97"}, {"emb_dim", "8"}}},
      withSparseFeatures({"deepfm", "models/deepfm.kiln", {}}),
      withSparseFeatures({"wide_deep", "models/wide_deep.kiln", {}}),
  };
}

// A small MoE language model (embedding, attention, one MoE layer with `moe_options`, head) in a
// file of its own, for the expert-parallel tests: 8 experts, top-2, sequences of 8 tokens.
inline Model moeModel(const char* name, const std::string& moe_options, int ep) {
  const auto path =
      std::filesystem::temp_directory_path() / fmt::format("kiln_ep_{}_{}.kiln", name, ::getpid());
  std::ofstream(path) << "model moe_ep {\n"
                         "  dim B\n"
                         "  input tokens: i32[B, 8] vocab(64)\n"
                         "  input targets: i32[B, 8]\n"
                         "  h = embedding(tokens, 64, 16)\n"
                         "  h = h + attention(rmsnorm(h), 2, kv_heads = 1)\n"
                         "  h = h + moe(rmsnorm(h), experts = 8, topk = 2, hidden = 16, "
                      << moe_options
                      << ")\n"
                         "  logits = linear(rmsnorm(h), 64, bias = false)\n"
                         "  output logits\n"
                         "  train {\n"
                         "    loss = softmax_cross_entropy(logits, targets)\n"
                         "    label = targets\n"
                         "    optimizer = adamw(lr = 0.01, weight_decay = 0.01)\n"
                         "    metrics = [loss]\n"
                         "  }\n"
                         "}\n";
  return {name, path.string(), {}, ep};
}

inline driver::SessionOptions options(const Model& m, int64_t batch) {
  driver::SessionOptions o;
  o.model_path = m.path.front() == '/' ? m.path : std::string(KILN_SOURCE_DIR) + "/" + m.path;
  o.overrides = m.overrides;
  o.batch = batch;
  o.seed = 3;
  return o;
}

// Samples [first, first + n) of the training stream.
inline data::Batch batchOf(const driver::Session& s, int64_t first, int64_t n) {
  data::SyntheticGenerator gen(s.trainSpec(), {.seed = 3});
  data::Batch b;
  gen.generate(first, n, b);
  return b;
}

struct Trajectory {
  std::vector<double> losses;                     // per step: the global batch's loss
  std::map<std::string, ir::HostTensor> tensors;  // the single-rank run's final tensors
  // The last step's per-expert counts of each MoE layer ("moe.0.counts"): the global batch's.
  std::map<std::string, std::vector<double>> counts;
};

inline bool isCounts(const std::string& stat) {
  return stat.size() > 7 && stat.compare(stat.size() - 7, 7, ".counts") == 0;
}

constexpr int64_t kGlobalBatch = 48;

inline Trajectory singleRank(const Model& m, int steps) {
  std::ostringstream diag;
  auto s = driver::Session::create(options(m, kGlobalBatch), diag);
  EXPECT_TRUE(s) << s.status().str() << diag.str();
  Trajectory r;
  if (!s) return r;
  for (int step = 1; step <= steps; ++step) {
    auto out = (*s)->trainStep(batchOf(**s, (step - 1) * kGlobalBatch, kGlobalBatch), 1.0, step);
    EXPECT_TRUE(out) << out.status().str();
    r.losses.push_back(out ? out->loss : NAN);
    if (out)
      for (const auto& [stat, v] : out->stats)
        if (isCounts(stat)) r.counts[stat] = v;
  }
  for (const std::string& name : (*s)->checkpointNames()) {
    const ir::HostTensor* t = (*s)->params().find(name);
    ir::HostTensor copy(t->view.dtype, t->view.shape);
    std::memcpy(copy.view.data, t->view.data, static_cast<size_t>(t->view.bytes()));
    r.tensors.emplace(name, std::move(copy));
  }
  return r;
}

// A tensor seen as [d0, d1, inner]: its first two dims and the product of the others.
inline std::array<int64_t, 3> asThreeDims(const std::vector<int64_t>& shape) {
  std::array<int64_t, 3> d{shape.empty() ? 1 : shape[0], shape.size() > 1 ? shape[1] : 1, 1};
  for (size_t i = 2; i < shape.size(); ++i) d[2] *= shape[i];
  return d;
}

// Rank comm.rank()'s part of a run where every table is `sharding` ("" = the automatic plan):
// `steps` steps on its slice of the global batches; its losses go to `losses`, and every piece
// it holds is compared with `want`.
// (`plan_path`, when given, is the plan instead: a plan file, such as hybridPlanFile's.)
// (`pipeline`: the pipelined step, each step given the next one's batch.)
inline Status checkRank(comm::Communicator& c, const Model& m, const std::string& sharding, int steps,
                        const Trajectory& want, std::vector<double>& losses, const std::string& plan_path = "",
                        bool pipeline = false) {
  const int ranks = c.size();
  std::ostringstream diag;
  driver::SessionOptions o = options(m, kGlobalBatch / ranks);
  o.comm = &c;
  o.sharding = sharding;
  o.plan_path = plan_path;
  o.pipeline = pipeline;
  o.ep = m.ep;
  KILN_ASSIGN_OR_RETURN(auto s, driver::Session::create(o, diag));
  const int64_t b = kGlobalBatch / ranks;
  std::vector<std::pair<std::string, std::vector<double>>> last_stats;
  if (pipeline && !s->pipelined()) return Status::error("the session did not build the pipelined step");
  for (int step = 1; step <= steps; ++step) {
    const data::Batch mine = batchOf(*s, (step - 1) * kGlobalBatch + c.rank() * b, b);
    KILN_ASSIGN_OR_RETURN(auto out, pipeline ? s->trainStep(mine, batchOf(*s, step * kGlobalBatch + c.rank() * b, b),
                                                            1.0, step)
                                             : s->trainStep(mine, 1.0, step));
    losses.push_back(out.loss);
    last_stats = std::move(out.stats);
  }
  // (A trajectory without tensors compares the losses only.)
  for (const runtime::LocalPiece& p :
       want.tensors.empty() ? std::vector<runtime::LocalPiece>{} : s->localPieces()) {
    auto it = want.tensors.find(p.name);
    EXPECT_NE(it, want.tensors.end()) << p.name;
    if (it == want.tensors.end()) continue;
    const ir::HostTensor& full = it->second;
    EXPECT_EQ(p.global_shape, full.view.shape) << p.name;
    // Pieces are row blocks, column blocks, or both: their dims beyond the second are whole.
    const auto local = asThreeDims(p.view.shape), global = asThreeDims(full.view.shape);
    const int64_t row0 = p.offset.empty() ? 0 : p.offset[0], col0 = p.offset.size() > 1 ? p.offset[1] : 0;
    int bad = 0;
    for (int64_t r = 0; r < local[0] && bad < 3; ++r)
      for (int64_t col = 0; col < local[1] && bad < 3; ++col)
        for (int64_t i = 0; i < local[2] && bad < 3; ++i) {
          const double got = static_cast<const float*>(p.view.data)[(r * local[1] + col) * local[2] + i];
          const double ref = full.as<float>()[((row0 + r) * global[1] + col0 + col) * global[2] + i];
          if (std::fabs(got - ref) > 2e-5 + 2e-4 * std::fabs(ref)) {
            ADD_FAILURE() << p.name << " on rank " << c.rank() << " at [" << row0 + r << ", " << col0 + col
                          << ", " << i << "]: " << got << " vs single-rank " << ref;
            ++bad;
          }
        }
  }
  // Every rank reports the global batch's per-expert counts.
  for (const auto& [stat, v] : last_stats) {
    if (!isCounts(stat) || want.tensors.empty()) continue;
    auto it = want.counts.find(stat);
    EXPECT_NE(it, want.counts.end()) << stat;
    if (it != want.counts.end()) {
      EXPECT_EQ(v, it->second) << stat << " on rank " << c.rank();
    }
  }
  return Status::ok();
}

// checkRank on `ranks` in-process ranks (threads of a LocalGroup); every rank's losses averaged
// per step: the global batch's loss.
inline std::vector<double> runRanks(const Model& m, const std::string& sharding, int ranks, int steps,
                                    const Trajectory& want, const std::string& plan_path = "", bool pipeline = false) {
  std::vector<std::vector<double>> losses(static_cast<size_t>(ranks));
  std::mutex mu;
  comm::LocalGroup group(ranks);
  Status st = group.run([&](comm::Communicator& c) -> Status {
    std::vector<double> mine;
    Status s = checkRank(c, m, sharding, steps, want, mine, plan_path, pipeline);
    std::lock_guard<std::mutex> lock(mu);
    losses[static_cast<size_t>(c.rank())] = std::move(mine);
    return s;
  });
  EXPECT_TRUE(st) << st.str();
  std::vector<double> mean(static_cast<size_t>(steps), 0.0);
  for (const auto& l : losses)
    for (size_t i = 0; i < l.size() && i < mean.size(); ++i) mean[i] += l[i] / ranks;
  return mean;
}

// A plan file for `ranks` ranks where every table is `sharding` (laid out as the shard pass's
// `sharding` option lays it out) and, unless data_parallel, a hybrid table (`hot`): its even
// rows are replicated on every rank, so that about half of any id stream is hot and half
// travels; with `dedup`, row-block tables route de-duplicated ids.
inline std::string planFile(const Model& m, const std::string& sharding, int ranks, bool hot, bool dedup) {
  std::ostringstream diag;
  auto s = driver::Session::create(options(m, kGlobalBatch), diag);
  EXPECT_TRUE(s) << s.status().str() << diag.str();
  if (!s) return "";
  auto tables = passes::tablesOf((*s)->module());
  EXPECT_TRUE(tables) << tables.status().str();
  if (!tables) return "";
  passes::ShardOptions o;
  o.ranks = ranks;
  o.sharding = sharding;
  auto plan = passes::planFor(*tables, o);
  EXPECT_TRUE(plan) << plan.status().str();
  if (!plan) return "";
  using passes::ShardingType;
  for (size_t i = 0; i < plan->tables.size(); ++i) {
    passes::TablePlan& t = plan->tables[i];
    if (hot && t.type != ShardingType::data_parallel)
      for (int64_t row = 0; row < (*tables)[i].rows; row += 2) t.hot.ids.push_back(row);
    t.dedup = dedup && passes::hasRowBlocks(t.type);
  }
  const auto path = std::filesystem::temp_directory_path() /
                    fmt::format("kiln_plan_{}_{}_{}_{}{}_{}.json", m.name, sharding, ranks, hot ? "hot" : "",
                                dedup ? "dedup" : "", ::getpid());
  std::ofstream(path) << passes::writePlanJson(*plan);
  return path.string();
}
inline std::string hybridPlanFile(const Model& m, const std::string& sharding, int ranks) {
  return planFile(m, sharding, ranks, /*hot=*/true, /*dedup=*/false);
}

// The global batch's loss of each step against the single-rank run's.
inline void expectLossesMatch(const std::vector<double>& mean, const Trajectory& want) {
  ASSERT_EQ(mean.size(), want.losses.size());
  for (size_t step = 0; step < mean.size(); ++step)
    EXPECT_NEAR(mean[step], want.losses[step], 1e-5 + 1e-4 * std::fabs(want.losses[step]))
        << "step " << step + 1;
}

}  // namespace kiln::cli::testing
