// Comparing a model's tensors computed by a backend under test (the GPU, the generated CUDA on
// the host) with the CPU executor's, shared by gpu_model_test and simt_model_test.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ir/tensor_view.h"
#include "runtime/data/batch_reader.h"
#include "tools/session_flags.h"

namespace kiln::testing {

inline double valueAt(const ir::HostTensor& t, int64_t i) {
  switch (t.view.dtype) {
    case ir::DType::bf16: return ir::bf16ToFloat(t.as<uint16_t>()[i]);
    case ir::DType::f64: return t.as<double>()[i];
    default: return t.as<float>()[i];
  }
}

// Elements of `got` off by more than `tol` relative to `want` (|got - want| / (1e-3 + |want|);
// a NaN on either side is off), and the worst of them.
//
// Tests bound the fraction that is off rather than the worst element: Adagrad's first step
// moves a weight by about lr * g / |g|, so where a gradient sums to nearly zero, rounding in a
// different order moves that weight differently. Such elements are a handful per million; a
// bug (a wrong index, a missed update) shifts whole rows.
struct TensorDiff {
  int64_t off = 0, total = 0;
  double worst = 0;
  int64_t worst_at = -1;
  double got_at_worst = 0, want_at_worst = 0;
  // How many may be off: one per thousand, and one more (a relu whose input rounds across zero
  // flips one gradient term).
  int64_t allowed() const { return 1 + total / 1000; }
  std::string str() const {
    return fmt::format("{} of {} elements off; worst [{}]: {} vs {} (relative {:.3g})", off, total, worst_at,
                       got_at_worst, want_at_worst, worst);
  }
};

inline TensorDiff compareTensors(const ir::HostTensor& got, const ir::HostTensor& want, double tol) {
  TensorDiff d;
  d.total = want.numel();
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = valueAt(got, i), w = valueAt(want, i);
    double rel = std::fabs(g - w) / (1e-3 + std::fabs(w));
    if (std::isnan(rel)) rel = std::isnan(g) && std::isnan(w) ? 0 : INFINITY;
    if (rel > tol) ++d.off;
    if (rel > d.worst || d.worst_at < 0) {
      d.worst = rel;
      d.worst_at = i;
      d.got_at_worst = g;
      d.want_at_worst = w;
    }
  }
  return d;
}

// The tolerance of a parameter or optimizer state after a few steps, by its storage type.
inline double stateTolerance(ir::DType t) { return t == ir::DType::bf16 ? 2e-2 : 2e-3; }

// The models the backend tests run: every model as written with exact f32 GEMMs (precision
// f32_strict, so that the backend matches the CPU to f32 rounding), and the two DLRMs as R1 runs
// them, with bf16 GEMMs or with TF32 GEMMs (precision f32, the default), and SGD. (With bf16 or
// TF32 GEMMs, gradients differ in the last bit where a sum rounds the other way; row-wise
// Adagrad's first step divides each row's gradient by its norm, which turns that into large
// differences in rows whose contributions nearly cancel. SGD's step stays proportional.)
struct ModelCase {
  const char* model;
  // "" = the model's own train block at precision f32_strict; "bf16" = bf16 GEMMs and SGD;
  // "tf32" = precision f32 (TF32 GEMMs on a GPU) and SGD.
  const char* precision;
  bool bf16() const { return std::string(precision) == "bf16"; }
  bool tf32() const { return std::string(precision) == "tf32"; }
  std::string name() const { return std::string(model) + (*precision ? std::string("_") + precision : ""); }
  // Points `o` at the model file and applies the case's train-block overrides.
  void apply(driver::SessionOptions& o) const {
    o.model_path = std::string(KILN_SOURCE_DIR) + "/models/" + model + ".kiln";
    if (!bf16() && !tf32()) {
      o.train_overrides = {{"precision", ir::Attribute(std::string("f32_strict"))}};
      return;
    }
    const ir::AttrDict sgd = {{"kind", ir::Attribute(std::string("sgd"))}, {"lr", ir::Attribute(0.01)}};
    o.train_overrides = {{"precision", ir::Attribute(std::string(bf16() ? "bf16" : "f32"))},
                         {"optimizer", ir::Attribute(sgd)},
                         {"embedding_optimizer", ir::Attribute(sgd)}};
  }
};
inline const std::vector<ModelCase>& modelCases() {
  static const std::vector<ModelCase> cases = {
      {"dlrm", ""},     {"dcn", ""},        {"deepfm", ""},           {"wide_deep", ""},   {"dlrm_dcnv2", ""},
      {"dlrm", "bf16"}, {"dlrm_dcnv2", "bf16"}, {"dlrm", "tf32"}, {"dlrm_dcnv2", "tf32"}};
  return cases;
}

// A session of the case's model on the host (small tables keep the CPU side fast; the code is
// the same): `batch` samples a step, seed 3, on `device`.
inline std::unique_ptr<driver::Session> makeSession(const ModelCase& c, int64_t batch, const std::string& rows_cap,
                                                      const std::string& device = "cpu", int threads = 1) {
  driver::SessionOptions o;
  c.apply(o);
  o.overrides["rows_cap"] = rows_cap;
  o.batch = batch;
  o.threads = threads;
  o.seed = 3;
  o.device = device;
  std::ostringstream diag;
  auto s = driver::Session::create(o, diag);
  EXPECT_TRUE(s) << s.status().message() << "\n" << diag.str();
  return s ? s.take() : nullptr;
}

// The first `n` synthetic training batches of `batch` samples (seed 11) for the session's model.
inline std::vector<data::Batch> syntheticBatches(const driver::Session& s, int64_t batch, int n) {
  data::DataOptions opts;
  opts.paths = {"synthetic"};
  opts.batch_size = batch;
  opts.epochs = 0;
  opts.synthetic.seed = 11;
  std::vector<data::Batch> out;
  auto reader = data::openBatchReader(s.trainSpec(), opts);
  EXPECT_TRUE(reader) << reader.status().message();
  if (!reader) return out;
  for (int i = 0; i < n; ++i) {
    data::Batch b;
    auto more = (*reader)->next(b);
    EXPECT_TRUE(more && *more);
    out.push_back(std::move(b));
  }
  return out;
}

// bf16 GEMM outputs: a sum rounded the other way is off by one bf16 step (2^-8 relative), and
// gradients carry that on into the parameters. TF32 rounds each GEMM input to a 10-bit mantissa
// (2^-11 relative): the loss and logits within a quarter of bf16's margins. The parameters
// not: a bias of about 1e-4 after a few SGD steps is the sum of gradients that went through TF32
// GEMMs, and ends up to 1% off (measured on dlrm: 0.0096 relative at worst, top.2.bias), as under
// bf16; they share its 2e-2.
inline double lossTolerance(const ModelCase& c) { return c.bf16() ? 2e-3 : c.tf32() ? 5e-4 : 1e-4; }
inline double logitTolerance(const ModelCase& c) { return c.bf16() ? 2e-2 : c.tf32() ? 5e-3 : 1e-3; }
inline double stateTolerance(const ModelCase& c, ir::DType t) {
  return c.bf16() || c.tf32() ? 2e-2 : stateTolerance(t);
}

}  // namespace kiln::testing
