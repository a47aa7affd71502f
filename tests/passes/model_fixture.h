// Helpers for pass tests over the models in models/: compile a model (tables capped small),
// build and clean up its training step, and make deterministic random inputs and parameters.
#pragma once

#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <type_traits>

#include <gtest/gtest.h>

#include "frontend/frontend.h"
#include "ir/interpreter.h"
#include "ir/op_def.h"
#include "passes/pass_manager.h"

namespace kiln::passes::testing {

inline const char* const kModels[] = {"dlrm", "dlrm_dcnv2", "dcn", "deepfm", "wide_deep"};

// The model's module after autodiff, canonicalize, cse, dce (or an error).
inline Expected<std::unique_ptr<ir::Module>> trainingModule(const std::string& name, const std::string& rows_cap = "1000") {
  frontend::DiagnosticEngine diags(&std::cerr);
  auto m = frontend::compileModelFile(std::string(KILN_SOURCE_DIR) + "/models/" + name + ".kiln",
                                      {{"rows_cap", rows_cap}}, diags);
  if (!m) return m.status();
  PassManager pm;
  KILN_RETURN_IF_ERROR(pm.addPipeline("autodiff,canonicalize,cse,dce"));
  auto r = pm.run(**m);
  if (!r) return r.status();
  return m;
}

// Inputs and parameters for every source of `f` at batch B, drawn from `rng`: ids in range,
// labels 0/1, lr and step 1, optimizer state positive (accumulators feed square roots), other
// floats (f32 or f64) uniform in [-half_width, half_width].
inline std::map<std::string, ir::HostTensor> randomSources(const ir::Function& f, int64_t batch, std::mt19937& rng,
                                                           double half_width = 0.5) {
  std::map<std::string, ir::HostTensor> out;
  ir::SymbolBindings s = {{"B", batch}};
  for (const auto& op : f.entry().ops()) {
    if (!op->hasTrait(ir::kSource)) continue;
    std::string name = op->strAttr("name");
    if (out.count(name)) continue;
    const ir::TensorType& t = op->result()->type();
    std::vector<int64_t> shape;
    for (const ir::Dim& d : t.shape()) shape.push_back(*d.evaluate(s));
    ir::HostTensor h(t.dtype(), shape);
    std::string role = op->strAttr("role");
    auto fill = [&](auto* data) {
      using T = std::remove_pointer_t<decltype(data)>;
      const T w = static_cast<T>(half_width);
      std::uniform_real_distribution<T> u(-w, w);
      for (int64_t i = 0; i < h.numel(); ++i) {
        T v = u(rng);
        if (role == "label") v = v > 0 ? T(1) : T(0);
        else if (role == "lr" || role == "step") v = T(1);
        else if (op->hasAttr("state_of")) v = T(0.25) + v * (T(0.05) / w);  // in [0.2, 0.3]
        data[i] = v;
      }
    };
    if (t.dtype() == ir::DType::i64) {
      std::uniform_int_distribution<int64_t> id(0, op->intAttr("rows", 1) - 1);
      for (int64_t i = 0; i < h.numel(); ++i) h.as<int64_t>()[i] = id(rng);
    } else if (t.dtype() == ir::DType::f32) {
      fill(h.as<float>());
    } else if (t.dtype() == ir::DType::f64) {
      fill(h.as<double>());
    }
    out.emplace(name, std::move(h));
  }
  return out;
}

inline std::map<std::string, ir::HostTensor> randomSources(const ir::Function& f, int64_t batch, unsigned seed = 7) {
  std::mt19937 rng(seed);
  return randomSources(f, batch, rng);
}

// Largest |a - b| / (1 + |b|) over two tensors of one shape.
inline double relativeDifference(const ir::HostTensor& a, const ir::HostTensor& b) {
  EXPECT_EQ(a.view.shape, b.view.shape);
  if (a.view.dtype != ir::DType::f32 || a.numel() != b.numel()) return 0;
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = a.as<float>()[i], y = b.as<float>()[i];
    worst = std::max(worst, std::abs(x - y) / (1.0 + std::abs(y)));
  }
  return worst;
}

// Runs @train_step of both modules on the same sources; outputs and every updated parameter and
// state tensor must agree within `tol`.
inline void expectSameTrainStep(const ir::Module& before, const ir::Module& after, int64_t batch, double tol = 1e-5) {
  const ir::Function* f0 = before.lookup("train_step");
  const ir::Function* f1 = after.lookup("train_step");
  ASSERT_TRUE(f0 && f1);
  auto s0 = randomSources(*f0, batch);
  auto s1 = s0;
  auto r0 = ir::interpretInPlace(*f0, s0, {{"B", batch}});
  auto r1 = ir::interpretInPlace(*f1, s1, {{"B", batch}});
  ASSERT_TRUE(r0) << r0.status().str();
  ASSERT_TRUE(r1) << r1.status().str();
  ASSERT_EQ(r0->size(), r1->size());
  for (size_t i = 0; i < r0->size(); ++i) EXPECT_LE(relativeDifference((*r1)[i], (*r0)[i]), tol) << "result " << i;
  for (const auto& [name, t] : s0) EXPECT_LE(relativeDifference(s1.at(name), t), tol) << name;
}

}  // namespace kiln::passes::testing
