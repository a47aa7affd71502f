// The check behind the sharded-step tests (sharded_step_test.cc on in-process ranks,
// sharded_step_mpi_test.cc on MPI processes): one rank trains its slice of every global batch
// with its own sharded program, and every piece it holds must equal the same region of the
// single-rank run's tensors (within f32 rounding: the sums run in another order).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/comm/communicator.h"
#include "runtime/data/synthetic.h"
#include "tools/model_session.h"

namespace kiln::cli::testing {

struct Model {
  const char* name;
  const char* path;
  frontend::ParamOverrides overrides;
};

// Every model of models/ at a size one core trains in well under a second per step.
inline std::vector<Model> models() {
  return {
      {"tiny", "tests/reliability/Inputs/tiny.kiln", {}},
      {"dlrm", "models/dlrm.kiln", {{"rows_cap", "97"}, {"emb_dim", "8"}, {"top", "[16, 1]"}}},
      {"dlrm_dcnv2",
       "models/dlrm_dcnv2.kiln",
       {{"rows_cap", "97"}, {"emb_dim", "8"}, {"cross_rank", "8"}, {"top", "[16, 1]"}}},
      {"dcn", "models/dcn.kiln", {{"rows_cap", "97"}, {"emb_dim", "8"}}},
      {"deepfm", "models/deepfm.kiln", {{"rows_cap", "97"}}},
      {"wide_deep", "models/wide_deep.kiln", {{"rows_cap", "97"}}},
  };
}

inline SessionOptions options(const Model& m, int64_t batch) {
  SessionOptions o;
  o.model_path = std::string(KILN_SOURCE_DIR) + "/" + m.path;
  o.overrides = m.overrides;
  o.batch = batch;
  o.seed = 3;
  return o;
}

// Samples [first, first + n) of the training stream.
inline data::Batch batchOf(const ModelSession& s, int64_t first, int64_t n) {
  data::SyntheticGenerator gen(s.trainSpec(), {.seed = 3});
  data::Batch b;
  gen.generate(first, n, b);
  return b;
}

struct Trajectory {
  std::vector<double> losses;                     // per step: the global batch's loss
  std::map<std::string, ir::HostTensor> tensors;  // the single-rank run's final tensors
};

constexpr int64_t kGlobalBatch = 48;

inline Trajectory singleRank(const Model& m, int steps) {
  std::ostringstream diag;
  auto s = ModelSession::create(options(m, kGlobalBatch), diag);
  EXPECT_TRUE(s) << s.status().str() << diag.str();
  Trajectory r;
  if (!s) return r;
  for (int step = 1; step <= steps; ++step) {
    auto out = (*s)->trainStep(batchOf(**s, (step - 1) * kGlobalBatch, kGlobalBatch), 1.0, step);
    EXPECT_TRUE(out) << out.status().str();
    r.losses.push_back(out ? out->loss : NAN);
  }
  for (const std::string& name : (*s)->checkpointNames()) {
    const ir::HostTensor* t = (*s)->params().find(name);
    ir::HostTensor copy(t->view.dtype, t->view.shape);
    std::memcpy(copy.view.data, t->view.data, static_cast<size_t>(t->view.bytes()));
    r.tensors.emplace(name, std::move(copy));
  }
  return r;
}

// The element of `t` at global position (row, col) of a [rows, cols] or [rows] tensor.
inline double at(const ir::HostTensor& t, int64_t row, int64_t col) {
  const int64_t cols = t.view.shape.size() > 1 ? t.view.shape[1] : 1;
  return t.as<float>()[row * cols + col];
}

// Rank comm.rank()'s part of a run where every table is `sharding` ("" = the automatic plan):
// `steps` steps on its slice of the global batches; its losses go to `losses`, and every piece
// it holds is compared with `want`.
inline Status checkRank(comm::Communicator& c, const Model& m, const std::string& sharding, int steps,
                        const Trajectory& want, std::vector<double>& losses) {
  const int ranks = c.size();
  std::ostringstream diag;
  SessionOptions o = options(m, kGlobalBatch / ranks);
  o.comm = &c;
  o.sharding = sharding;
  KILN_ASSIGN_OR_RETURN(auto s, ModelSession::create(o, diag));
  const int64_t b = kGlobalBatch / ranks;
  for (int step = 1; step <= steps; ++step) {
    KILN_ASSIGN_OR_RETURN(auto out,
                          s->trainStep(batchOf(*s, (step - 1) * kGlobalBatch + c.rank() * b, b), 1.0, step));
    losses.push_back(out.loss);
  }
  for (const runtime::LocalPiece& p : s->localPieces()) {
    auto it = want.tensors.find(p.name);
    EXPECT_NE(it, want.tensors.end()) << p.name;
    if (it == want.tensors.end()) continue;
    const ir::HostTensor& full = it->second;
    EXPECT_EQ(p.global_shape, full.view.shape) << p.name;
    const int64_t rows = p.view.shape[0], cols = p.view.shape.size() > 1 ? p.view.shape[1] : 1;
    int bad = 0;
    for (int64_t r = 0; r < rows && bad < 3; ++r)
      for (int64_t col = 0; col < cols && bad < 3; ++col) {
        const double got = static_cast<const float*>(p.view.data)[r * cols + col];
        const double ref = at(full, p.offset[0] + r, (p.offset.size() > 1 ? p.offset[1] : 0) + col);
        if (std::fabs(got - ref) > 2e-5 + 2e-4 * std::fabs(ref)) {
          ADD_FAILURE() << p.name << " on rank " << c.rank() << " at [" << p.offset[0] + r << ", " << col
                        << "]: " << got << " vs single-rank " << ref;
          ++bad;
        }
      }
  }
  return Status::ok();
}

// The global batch's loss of each step against the single-rank run's.
inline void expectLossesMatch(const std::vector<double>& mean, const Trajectory& want) {
  ASSERT_EQ(mean.size(), want.losses.size());
  for (size_t step = 0; step < mean.size(); ++step)
    EXPECT_NEAR(mean[step], want.losses[step], 1e-5 + 1e-4 * std::fabs(want.losses[step]))
        << "step " << step + 1;
}

}  // namespace kiln::cli::testing
