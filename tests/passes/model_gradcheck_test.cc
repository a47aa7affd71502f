// Model-level gradient checks: for each model in models/ at a tiny size, the gradients that
// @train_step applies equal central finite differences of @forward's loss, all in f64.
//
// The module is cast to f64 before autodiff, and its train block is replaced by plain SGD with
// lr = 1, no momentum, no weight decay, no clipping and a constant schedule. One step then moves
// every parameter by exactly -grad, dense weights and the looked-up embedding rows alike, so the
// check covers the whole pipeline: every gradient rule, the summing of gradients of shared
// values, the sparse embedding path (duplicates combined) and the optimizer's application.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "frontend/frontend.h"
#include "ir/builder.h"
#include "ir/interpreter.h"
#include "ir/verifier.h"
#include "ir/op_def.h"
#include "passes/pass_manager.h"
#include "tests/passes/model_fixture.h"

namespace kiln::passes {
namespace {

// Tiny sizes: tables of a few rows (so a batch repeats ids and the duplicate path runs), and
// narrow layers where the model has a param for the width.
const std::map<std::string, frontend::ParamOverrides>& tinyOverrides() {
  static const std::map<std::string, frontend::ParamOverrides> k = {
      {"dlrm", {{"rows_cap", "5"}, {"emb_dim", "4"}, {"top", "[16, 8, 1]"}}},
      {"dlrm_dcnv2",
       {{"rows_cap", "5"},
        {"emb_dim", "4"},
        {"cross_rank", "8"},
        {"top", "[16, 8, 1]"},
        {"hot", "[2, 1, 3, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2]"}}},
      {"dcn", {{"rows_cap", "5"}, {"emb_dim", "3"}, {"cross_layers", "2"}}},
      {"deepfm", {{"rows_cap", "5"}, {"emb_dim", "3"}, {"deep_widths", "[8, 8, 1]"}}},
      {"wide_deep", {{"rows_cap", "5"}, {"deep_widths", "[16, 8, 1]"}}},
      {"activations", {}},
  };
  return k;
}

// Rewrites @forward to compute in f64: every stated f32 type (inputs, parameters, constants,
// reshapes, broadcasts) becomes f64, casts to f32 cast to f64, and shape inference carries the
// change through the rest of the graph. Loss ops produce f64 from f64 logits.
Status castForwardToF64(ir::Module& m) {
  ir::Function* f = m.lookup("forward");
  if (!f) return Status::error("no @forward");
  // In program order, so each op sees its operands' new types (the shape-inference pass would
  // do the same, but the pass manager verifies the half-rewritten IR before running it).
  for (ir::Op* op : f->entry().opList()) {
    if (op->name() == "kiln.cast" && op->strAttr("to") == "f32") op->setAttr("to", std::string("f64"));
    if (op->hasTrait(ir::kTerminator)) continue;
    if (op->hasTrait(ir::kTypeGiven)) {
      for (unsigned i = 0; i < op->numResults(); ++i) {
        ir::Value* v = op->result(i);
        if (v->type().dtype() == ir::DType::f32) v->setType(v->type().withDType(ir::DType::f64));
      }
      continue;
    }
    auto types = ir::inferResultTypes(*op);
    if (!types) return types.status();
    for (unsigned i = 0; i < op->numResults(); ++i) op->result(i)->setType((*types)[i]);
  }
  std::vector<ir::TensorType> results;
  for (ir::Value* v : f->returnOp()->operands()) results.push_back(v->type());
  f->setResultTypes(std::move(results));
  return ir::verify(m);
}

struct Checked {
  std::unique_ptr<ir::Module> module;
  size_t loss_index = 0;
};

Expected<Checked> prepare(const std::string& model) {
  frontend::DiagnosticEngine diags(&std::cerr);
  // Models of models/, and test models of tests/passes/models/ for layers no model uses yet.
  const bool test_model = model == "activations";
  auto m = frontend::compileModelFile(
      std::string(KILN_SOURCE_DIR) + (test_model ? "/tests/passes/models/" : "/models/") + model + ".kiln",
      tinyOverrides().at(model), diags);
  if (!m) return m.status();
  KILN_RETURN_IF_ERROR(castForwardToF64(**m));
  ir::AttrDict train = (*m)->attrs().at("kiln.train").asDict();
  train["optimizer"] = ir::AttrDict{{"kind", std::string("sgd")}, {"lr", 1.0}};
  train["embedding_optimizer"] = ir::AttrDict{{"kind", std::string("sgd")}, {"lr", 1.0}};
  train["lr_schedule"] = ir::AttrDict{{"kind", std::string("constant")}};
  train["grad_clip"] = 0.0;
  (*m)->mutableAttrs()["kiln.train"] = train;
  for (ir::Op* op : (*m)->lookup("forward")->entry().opList())  // per-table optimizers too
    if (op->name() == "kiln.parameter" && op->hasAttr("optimizer"))
      op->setAttr("optimizer", train["embedding_optimizer"]);
  PassManager pm;
  KILN_RETURN_IF_ERROR(pm.addPipeline("autodiff"));
  auto r = pm.run(**m);
  if (!r) return r.status();
  // The step differentiates the loss with the batch's statistics (Dice, batch norm): difference
  // the same function, not @forward's eval form with running ones.
  for (ir::Op* op : (*m)->lookup("forward")->entry().opList())
    if (op->is(ir::OpCode::RunningStat)) op->setAttr("training", true);
  Checked c;
  const ir::AttrArray& outputs = (*m)->attrs().at("kiln.outputs").asArray();
  for (size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].asString() == train.at("loss").asString()) c.loss_index = i;
  c.module = std::move(*m);
  return c;
}

// For each embedding table parameter, the rows its lookups read in this batch.
std::map<std::string, std::set<int64_t>> touchedRows(const ir::Function& f,
                                                     const std::map<std::string, ir::HostTensor>& sources) {
  std::map<std::string, std::set<int64_t>> rows;
  for (const ir::Op* op : f.entry().opList()) {
    if (op->name() != "kiln.embedding_bag") continue;
    const ir::Op* table = op->operand(0)->definingOp();
    const ir::Op* ids = op->operand(1)->definingOp();
    if (!table || !ids || table->name() != "kiln.parameter" || ids->name() != "kiln.input") continue;
    const ir::HostTensor& t = sources.at(ids->strAttr("name"));
    for (int64_t i = 0; i < t.numel(); ++i) rows[table->strAttr("name")].insert(t.as<int64_t>()[i]);
  }
  return rows;
}

double lossAt(const ir::Function& forward, const std::map<std::string, ir::HostTensor>& sources, size_t loss_index,
              int64_t batch) {
  auto r = ir::interpret(forward, sources, {{"B", batch}});
  EXPECT_TRUE(r) << r.status().str();
  if (!r) return NAN;
  return (*r)[loss_index].as<double>()[0];
}

class ModelGradcheck : public ::testing::TestWithParam<const char*> {};

TEST_P(ModelGradcheck, TrainStepGradientsMatchFiniteDifferences) {
  const std::string model = GetParam();
  constexpr int64_t kBatch = 3;
  constexpr double kStep = 1e-6;
  auto c = prepare(model);
  ASSERT_TRUE(c) << c.status().str();
  const ir::Function* forward = c->module->lookup("forward");
  const ir::Function* train_step = c->module->lookup("train_step");
  ASSERT_TRUE(forward && train_step);

  std::mt19937 rng(2024);
  std::map<std::string, ir::HostTensor> sources = testing::randomSources(*train_step, kBatch, rng, 1.0);
  // Parameters drawn at the scale of their initializers, so no layer saturates the sigmoid.
  std::map<std::string, std::string> params;  // name -> "dense" | "table"
  for (const ir::Op* op : forward->entry().opList()) {
    if (op->name() != "kiln.parameter" || !op->boolAttr("trainable", true)) continue;
    ir::HostTensor& p = sources.at(op->strAttr("name"));
    int64_t fan_in = p.view.shape.size() == 2 ? p.view.shape[1] : 1;
    bool table = false;
    for (const ir::Use& u : op->result()->uses()) table |= u.user->name() == "kiln.embedding_bag" && u.operand_index == 0;
    std::normal_distribution<double> n(0.0, table ? 0.5 : 1.0 / std::sqrt(static_cast<double>(fan_in)));
    for (int64_t i = 0; i < p.numel(); ++i) p.as<double>()[i] = n(rng);
    params[op->strAttr("name")] = table ? "table" : "dense";
  }
  ASSERT_FALSE(params.empty());

  // One step of SGD with lr = 1: the change of each parameter is -grad.
  std::map<std::string, ir::HostTensor> after = sources;
  auto step = ir::interpretInPlace(*train_step, after, {{"B", kBatch}});
  ASSERT_TRUE(step) << step.status().str();
  const double loss0 = lossAt(*forward, sources, c->loss_index, kBatch);
  ASSERT_TRUE(std::isfinite(loss0));

  std::map<std::string, std::set<int64_t>> rows = touchedRows(*forward, sources);
  int checked = 0, nonzero = 0;
  for (const auto& [name, kind] : params) {
    const ir::HostTensor& p = sources.at(name);
    std::vector<int64_t> entries;
    std::uniform_int_distribution<int64_t> any(0, p.numel() - 1);
    if (kind == "table") {
      // Entries of looked-up rows (their gradient is non-zero) and one of a row that was
      // probably not looked up (its gradient and its change must both be zero).
      int64_t dim = p.view.shape[1];
      const std::set<int64_t>& touched = rows[name];
      ASSERT_FALSE(touched.empty()) << name;
      std::vector<int64_t> r(touched.begin(), touched.end());
      std::shuffle(r.begin(), r.end(), rng);
      for (size_t i = 0; i < std::min<size_t>(2, r.size()); ++i)
        entries.push_back(r[i] * dim + std::uniform_int_distribution<int64_t>(0, dim - 1)(rng));
      entries.push_back(any(rng));
    } else {
      for (int i = 0; i < 3; ++i) entries.push_back(any(rng));
    }
    for (int64_t e : entries) {
      double applied = p.as<double>()[e] - after.at(name).as<double>()[e];
      std::map<std::string, ir::HostTensor> plus = sources, minus = sources;
      plus.at(name).as<double>()[e] += kStep;
      minus.at(name).as<double>()[e] -= kStep;
      double fd = (lossAt(*forward, plus, c->loss_index, kBatch) - lossAt(*forward, minus, c->loss_index, kBatch)) /
                  (2 * kStep);
      EXPECT_NEAR(applied, fd, 1e-7 + 1e-5 * std::abs(fd)) << model << ": " << name << "[" << e << "]";
      ++checked;
      nonzero += std::abs(fd) > 1e-9;
    }
  }
  // The check has teeth only if it saw gradients that are not zero.
  EXPECT_GE(nonzero, checked / 2) << model;
}

INSTANTIATE_TEST_SUITE_P(Models, ModelGradcheck,
                         ::testing::Values("dlrm", "dlrm_dcnv2", "dcn", "deepfm", "wide_deep", "activations"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace kiln::passes
