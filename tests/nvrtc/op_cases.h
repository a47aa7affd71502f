// Small IR programs, one per op kind the CUDA backend lowers, shared by the kernel-semantics
// test (interpreted kernel IR vs the op's CPU reference), the NVRTC compile test and the GPU op
// test (CUDA vs the CPU reference), with the helpers that run and compare them.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "codegen/kernel_lowering.h"
#include "ir/builder.h"
#include "ir/ir.h"
#include "ir/op_def.h"
#include "ir/tensor_view.h"

namespace kiln::testing {

using ir::Attribute;
using ir::AttrDict;
using ir::Dim;
using ir::DType;
using ir::TensorType;
using ir::Value;

// How an input is filled. Lengths: non-negative bag sizes (some empty) adding up to `range`,
// the number of ids of a jagged bag.
enum class Fill { Normal, Positive, Ids, Probabilities, Labels01, Lengths };

struct OpCase {
  std::string name;
  std::unique_ptr<ir::Module> module;
  ir::SymbolBindings symbols;
  std::vector<const ir::Op*> group;  // the ops lowered together
  std::map<const Value*, std::pair<Fill, int64_t>> fills;  // int64: id range for Fill::Ids
  double tol = 2e-5;
  size_t expected_kernels = 0;  // 0: not checked
};

class CaseBuilder {
 public:
  explicit CaseBuilder(std::string name) {
    c_.name = std::move(name);
    c_.module = std::make_unique<ir::Module>();
    f_ = &c_.module->addFunction("f");
    f_->body().addBlock();
    b_.setInsertionPointToEnd(f_->entry());
  }

  Value* input(const std::string& name, DType t, ir::Shape shape, Fill fill = Fill::Normal, int64_t range = 0) {
    auto op = b_.createWithTypes("kiln.input", {}, {TensorType(t, std::move(shape))}, {{"name", Attribute(name)}});
    Value* v = (*op)->result();
    c_.fills[v] = {fill, range};
    return v;
  }
  Value* param(const std::string& name, DType t, ir::Shape shape, Fill fill = Fill::Normal) {
    auto op = b_.createWithTypes("kiln.parameter", {}, {TensorType(t, std::move(shape))}, {{"name", Attribute(name)}});
    Value* v = (*op)->result();
    c_.fills[v] = {fill, 0};
    return v;
  }
  // Adds an op to the group under test.
  ir::Op* op(const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    auto r = b_.create(name, operands, std::move(attrs));
    if (!r) throw std::runtime_error(c_.name + ": " + r.status().message());
    c_.group.push_back(*r);
    return *r;
  }
  ir::Op* opWithType(const std::string& name, const std::vector<Value*>& operands, TensorType t, AttrDict attrs = {}) {
    auto r = b_.createWithTypes(name, operands, {std::move(t)}, std::move(attrs));
    if (!r) throw std::runtime_error(c_.name + ": " + r.status().message());
    c_.group.push_back(*r);
    return *r;
  }
  CaseBuilder& tol(double t) {
    c_.tol = t;
    return *this;
  }
  CaseBuilder& kernels(size_t n) {
    c_.expected_kernels = n;
    return *this;
  }
  CaseBuilder& bind(const std::string& sym, int64_t v) {
    c_.symbols[sym] = v;
    return *this;
  }
  OpCase take() { return std::move(c_); }

 private:
  OpCase c_;
  ir::Function* f_;
  ir::Builder b_;
};

// Every model file in models/, sorted (the models every codegen test runs over).
inline std::vector<std::string> modelFiles() {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(KILN_SOURCE_DIR) / "models"))
    if (e.path().extension() == ".kiln") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

inline ir::Shape S(std::initializer_list<int64_t> dims) {
  ir::Shape s;
  for (int64_t d : dims) s.push_back(Dim::fixed(d));
  return s;
}

// The operands of a kiln.embedding_bag_update after its gradient, for a 6 x 12 table: the
// optimizer's state slots (positive), lr and step.
inline void appendUpdateTail(CaseBuilder& b, std::vector<ir::Value*>& operands, const std::string& opt) {
  const int nstate = opt == "sgd" ? 0 : opt == "adam" ? 2 : 1;
  for (int i = 0; i < nstate; ++i)
    operands.push_back(b.param("s" + std::to_string(i), ir::DType::f32, opt == "rowwise_adagrad" ? S({6}) : S({6, 12}),
                               Fill::Positive));
  operands.push_back(b.input("lr", ir::DType::f32, {}, Fill::Positive));
  operands.push_back(b.input("step", ir::DType::f32, {}, Fill::Ids, 4));
}

inline std::vector<OpCase> allOpCases() {
  std::vector<OpCase> cases;
  auto add = [&](CaseBuilder& b) { cases.push_back(b.take()); };
  const DType f32 = DType::f32;

  {  // A chain of elementwise ops with a broadcast bias: one kernel, two live-out values.
    CaseBuilder b("elementwise_chain");
    Value* x = b.input("x", f32, S({4, 6}));
    Value* bias = b.input("bias", f32, S({6}));
    Value* y = b.input("y", f32, S({4, 6}));
    Value* s = b.op("kiln.add", {x, bias})->result();
    Value* r = b.op("kiln.relu", {s})->result();
    Value* m = b.op("kiln.mul", {r, y})->result();
    b.op("kiln.sub", {m, s});
    b.kernels(1);
    add(b);
  }
  {  // The same chain large enough that its kernel takes four elements a thread: x, y and both
     // results at the flat index as 16-byte accesses, the broadcast bias per element.
    CaseBuilder b("elementwise_chain_vectorized");
    Value* x = b.input("x", f32, S({64, 96}));
    Value* bias = b.input("bias", f32, S({96}));
    Value* y = b.input("y", f32, S({64, 96}));
    Value* s = b.op("kiln.add", {x, bias})->result();
    Value* m = b.op("kiln.mul", {b.op("kiln.relu", {s})->result(), y})->result();
    b.op("kiln.sub", {m, s});
    b.kernels(1);
    add(b);
  }
  {  // Vectorized bf16: 8-byte loads widened to f32, a rounded bf16 result.
    CaseBuilder b("vectorized_bf16");
    Value* x = b.input("x", DType::bf16, S({32, 128}));
    Value* y = b.op("kiln.cast", {b.input("y", f32, S({32, 128}))}, {{"to", Attribute("bf16")}})->result();
    b.op("kiln.silu", {b.op("kiln.mul", {x, y})->result()});
    b.kernels(1);
    b.tol(1e-2);
    add(b);
  }
  {  // Vectorized i32 accesses next to a transpose whose loads are not at the flat index.
    CaseBuilder b("vectorized_i32_transpose");
    Value* i = b.input("i", DType::i32, S({64, 64}), Fill::Ids, 1000);
    b.op("kiln.add", {i, b.op("kiln.transpose", {i}, {{"perm", Attribute::ints({1, 0})}})->result()});
    b.kernels(1);
    add(b);
  }
  for (const char* u : {"kiln.neg", "kiln.abs", "kiln.exp", "kiln.tanh", "kiln.sigmoid", "kiln.relu",
                        "kiln.gelu", "kiln.silu", "kiln.softplus", "kiln.hardswish"}) {
    CaseBuilder b(std::string("unary_") + (u + 5));
    b.op(u, {b.input("x", f32, S({3, 5}))});
    add(b);
  }
  for (const char* u : {"kiln.log", "kiln.sqrt", "kiln.rsqrt"}) {
    CaseBuilder b(std::string("unary_") + (u + 5));
    b.op(u, {b.input("x", f32, S({3, 5}), Fill::Positive)});
    add(b);
  }
  for (const char* bin : {"kiln.sub", "kiln.div", "kiln.max", "kiln.min"}) {
    CaseBuilder b(std::string("binary_") + (bin + 5));
    b.op(bin, {b.input("x", f32, S({2, 3, 4})), b.input("y", f32, S({3, 1}), Fill::Positive)});
    add(b);
  }
  {
    CaseBuilder b("binary_pow");
    b.op("kiln.pow", {b.input("x", f32, S({2, 5}), Fill::Positive), b.input("y", f32, S({2, 5}))});
    add(b);
  }
  {
    CaseBuilder b("binary_elu");
    b.op("kiln.elu", {b.input("x", f32, S({3, 5})), b.input("alpha", f32, S({}), Fill::Positive)});
    add(b);
  }
  {
    CaseBuilder b("binary_prelu");
    b.op("kiln.prelu", {b.input("x", f32, S({3, 5})), b.param("slope", f32, S({5}))});
    add(b);
  }
  {
    CaseBuilder b("compare_select");
    Value* x = b.input("x", f32, S({4, 4}));
    Value* y = b.input("y", f32, S({4}));
    Value* c = b.op("kiln.compare", {x, y}, {{"predicate", Attribute("gt")}})->result();
    b.op("kiln.select", {c, x, b.input("z", f32, S({4, 4}))});
    b.kernels(1);
    add(b);
  }
  {
    CaseBuilder b("cast_bf16_roundtrip");
    Value* x = b.input("x", f32, S({3, 7}));
    Value* h = b.op("kiln.cast", {x}, {{"to", Attribute("bf16")}})->result();
    Value* e = b.op("kiln.exp", {h})->result();
    b.op("kiln.cast", {e}, {{"to", Attribute("f32")}});
    b.tol(1e-2);
    add(b);
  }
  {
    CaseBuilder b("bf16_storage");
    Value* x = b.input("x", DType::bf16, S({5, 8}));
    Value* y = b.input("y", DType::bf16, S({8}));
    b.op("kiln.silu", {b.op("kiln.mul", {x, y})->result()});
    b.tol(1e-2);
    add(b);
  }
  {
    CaseBuilder b("cast_to_i32");
    b.op("kiln.cast", {b.input("x", f32, S({4, 3}))}, {{"to", Attribute("i32")}});
    add(b);
  }
  {
    CaseBuilder b("transpose");
    b.op("kiln.transpose", {b.input("x", f32, S({2, 3, 4}))}, {{"perm", Attribute::ints({2, 0, 1})}});
    add(b);
  }
  {
    CaseBuilder b("slice");
    b.op("kiln.slice", {b.input("x", f32, S({3, 10}))},
         {{"axis", Attribute(int64_t{1})}, {"start", Attribute(int64_t{2})}, {"limit", Attribute(int64_t{7})}});
    add(b);
  }
  {
    CaseBuilder b("pad");
    b.op("kiln.pad", {b.input("x", f32, S({3, 4, 5}))},
         {{"axis", Attribute(int64_t{1})}, {"low", Attribute(int64_t{2})}, {"high", Attribute(int64_t{3})}});
    add(b);
  }
  {
    CaseBuilder b("concat");
    b.op("kiln.concat", {b.input("a", f32, S({3, 2})), b.input("b", f32, S({3, 5})), b.input("c", f32, S({3, 1}))},
         {{"axis", Attribute(int64_t{1})}});
    add(b);
  }
  {
    CaseBuilder b("gather");
    b.op("kiln.gather", {b.input("x", f32, S({6, 4})), b.input("i", DType::i64, S({5}), Fill::Ids, 6)},
         {{"axis", Attribute(int64_t{0})}});
    add(b);
  }
  {  // gather's adjoint along axis 1 (DLRM's interaction backward); ids repeat, so adds collide.
    CaseBuilder b("scatter_add_axis1");
    b.op("kiln.scatter_add", {b.input("base", f32, S({4, 9})), b.input("i", DType::i64, S({12}), Fill::Ids, 9),
                              b.input("u", f32, S({4, 12}))},
         {{"axis", Attribute(int64_t{1})}});
    b.kernels(2);
    add(b);
  }
  {  // Leading axis, 2-D indices, inner dims.
    CaseBuilder b("scatter_add_axis0_inner");
    b.op("kiln.scatter_add", {b.input("base", f32, S({6, 2, 3})), b.input("i", DType::i32, S({2, 4}), Fill::Ids, 6),
                              b.input("u", f32, S({2, 4, 2, 3}))});
    add(b);
  }
  {
    CaseBuilder b("reshape_then_relu");
    Value* x = b.input("x", f32, S({4, 6}));
    Value* r = b.opWithType("kiln.reshape", {x}, TensorType(f32, S({2, 12})))->result();
    b.op("kiln.relu", {r});
    add(b);
  }
  {
    CaseBuilder b("broadcast");
    b.opWithType("kiln.broadcast", {b.input("x", f32, S({1, 5}))}, TensorType(f32, S({3, 5})));
    add(b);
  }
  for (const char* kind : {"sum", "mean", "max"})
    for (std::vector<int64_t> axes : std::vector<std::vector<int64_t>>{{1}, {0}, {0, 2}, {0, 1, 2}}) {
      std::string n = std::string("reduce_") + kind + "_axes";
      for (int64_t a : axes) n += std::to_string(a);
      CaseBuilder b(n);
      b.op("kiln.reduce", {b.input("x", f32, S({5, 7, 3}))},
           {{"kind", Attribute(kind)}, {"axes", Attribute::ints(axes)}, {"keepdims", Attribute(axes.size() == 1)}});
      add(b);
    }
  {  // A symbolic batch bound at lowering time.
    CaseBuilder b("reduce_symbolic_batch");
    b.op("kiln.reduce", {b.input("x", f32, {Dim::symbol("B"), Dim::fixed(9)})},
         {{"kind", Attribute("sum")}, {"axes", Attribute::ints({0})}});
    b.bind("B", 11);
    add(b);
  }
  for (int64_t axis : {-1, 0}) {
    CaseBuilder b(axis < 0 ? "softmax_last_axis" : "softmax_axis0");
    b.op("kiln.softmax", {b.input("x", f32, S({4, 9}))}, {{"axis", Attribute(axis)}});
    add(b);
  }
  for (const char* red : {"mean", "sum"}) {
    CaseBuilder b(std::string("bce_with_logits_") + red);
    b.op("kiln.bce_with_logits", {b.input("x", f32, S({16})), b.input("y", f32, S({16}), Fill::Labels01)},
         {{"reduction", Attribute(red)}});
    b.tol(1e-5);
    add(b);
  }
  {  // A loss of 131,072 elements: its total is a two-pass fold (16 slabs, then their partials).
    CaseBuilder b("bce_with_logits_two_pass");
    b.op("kiln.bce_with_logits", {b.input("x", f32, S({512, 256})), b.input("y", f32, S({512, 256}), Fill::Labels01)});
    b.kernels(2);
    b.tol(1e-5);
    add(b);
  }
  {  // 32,768 rows: the per-row losses, then their mean as a two-pass fold.
    CaseBuilder b("softmax_cross_entropy_two_pass");
    b.op("kiln.softmax_cross_entropy",
         {b.input("x", f32, S({32768, 4})), b.input("y", DType::i64, S({32768}), Fill::Ids, 4)});
    b.kernels(3);
    b.tol(1e-5);
    add(b);
  }
  {
    CaseBuilder b("softmax_cross_entropy_ids");
    b.op("kiln.softmax_cross_entropy", {b.input("x", f32, S({6, 5})), b.input("y", DType::i64, S({6}), Fill::Ids, 5)});
    b.kernels(2);
    add(b);
  }
  {
    CaseBuilder b("softmax_cross_entropy_probs");
    b.op("kiln.softmax_cross_entropy",
         {b.input("x", f32, S({6, 5})), b.input("y", f32, S({6, 5}), Fill::Probabilities)}, {{"reduction", Attribute("sum")}});
    add(b);
  }
  for (const char* act : {"relu", "gelu", "silu", "softplus", "hardswish"}) {
    CaseBuilder b(std::string("activation_grad_") + act);
    b.op("kiln.activation_grad", {b.input("x", f32, S({3, 8})), b.input("dy", f32, S({3, 8}))},
         {{"activation", Attribute(act)}});
    add(b);
  }
  for (const char* red : {"mean", "sum"}) {  // the backward ops autodiff emits
    CaseBuilder b(std::string("bce_with_logits_grad_") + red);
    b.op("kiln.bce_with_logits_grad", {b.input("x", f32, S({12})), b.input("y", f32, S({12}), Fill::Labels01),
                                       b.input("g", f32, {}, Fill::Positive)}, {{"reduction", Attribute(red)}});
    add(b);
  }
  {
    CaseBuilder b("softmax_cross_entropy_grad_ids");
    b.op("kiln.softmax_cross_entropy_grad", {b.input("x", f32, S({6, 5})), b.input("y", DType::i64, S({6}), Fill::Ids, 5),
                                             b.input("g", f32, {}, Fill::Positive)});
    add(b);
  }
  for (const char* kind : {"sum", "mean", "max"}) {
    CaseBuilder b(std::string("reduce_grad_") + kind);
    Value* x = b.input("x", f32, S({4, 6}));
    Value* g = b.input("g", f32, S({4}));
    std::vector<Value*> operands = {g};
    if (std::string(kind) == "max") {
      Value* y = b.input("y", f32, S({4}));
      operands = {g, x, y};
    }
    b.opWithType("kiln.reduce_grad", operands, TensorType(f32, S({4, 6})),
                 {{"kind", Attribute(kind)}, {"axes", Attribute::ints({1})}});
    add(b);
  }
  {
    CaseBuilder b("sum_to");
    b.opWithType("kiln.sum_to", {b.input("x", f32, S({5, 3, 4}))}, TensorType(f32, S({3, 1})));
    add(b);
  }
  // Folds cut into pieces (codegen/emit/reduction.cc), at the smallest shapes that cut: leading
  // dims folded by ColumnReduce slabs, then the slabs; long rows of few outputs by chunks.
  {  // A bias gradient: 1100 rows in 4 slabs, 70 columns in strips of 32.
    CaseBuilder b("sum_to_column_slabs");
    b.opWithType("kiln.sum_to", {b.input("x", f32, S({1100, 70}))}, TensorType(f32, S({70})));
    b.kernels(2);
    add(b);
  }
  {  // A whole tensor: one column, 33309 rows in 4 slabs.
    CaseBuilder b("reduce_mean_whole_slabs");
    b.op("kiln.reduce", {b.input("x", f32, S({9, 3701}))},
         {{"kind", Attribute("mean")}, {"axes", Attribute::ints({0, 1})}});
    b.kernels(2);
    add(b);
  }
  {  // bf16 in and out, f32 partials.
    CaseBuilder b("reduce_max_column_slabs_bf16");
    b.op("kiln.reduce", {b.input("x", DType::bf16, S({1030, 33}))},
         {{"kind", Attribute("max")}, {"axes", Attribute::ints({0})}});
    b.kernels(2);
    add(b);
  }
  {  // Two rows of 33001: four chunks each, the last one ragged.
    CaseBuilder b("reduce_sum_row_chunks");
    b.op("kiln.reduce", {b.input("x", f32, S({2, 33001}))},
         {{"kind", Attribute("sum")}, {"axes", Attribute::ints({1})}});
    b.kernels(2).tol(1e-4);
    add(b);
  }
  struct Dense {
    const char* kind;
    AttrDict attrs;
    int state;
  };
  for (const Dense& d : std::vector<Dense>{
           {"sgd", {}, 0},
           {"sgd", {{"momentum", Attribute(0.9)}, {"nesterov", Attribute(true)}}, 1},
           {"adagrad", {{"weight_decay", Attribute(0.01)}}, 1},
           {"adam", {}, 2},
           {"adamw", {{"weight_decay", Attribute(0.1)}}, 2}}) {
    CaseBuilder b(std::string("optimizer_") + d.kind + (d.attrs.empty() ? "" : "_with_options"));
    Value* p = b.param("w", f32, S({4, 5}));
    std::vector<Value*> operands = {p, b.input("g", f32, S({4, 5}))};
    for (int i = 0; i < d.state; ++i) operands.push_back(b.param("s" + std::to_string(i), f32, S({4, 5}), Fill::Positive));
    operands.push_back(b.input("lr", f32, {}, Fill::Positive));
    operands.push_back(b.input("step", f32, {}, Fill::Ids, 3));
    AttrDict attrs = d.attrs;
    attrs["kind"] = Attribute(d.kind);
    attrs["lr"] = Attribute(0.05);
    b.op("kiln.optimizer_update", operands, attrs);
    b.tol(1e-4);
    add(b);
  }
  {  // Three parameters stepped by one group: two adam tensors of 9,000 and 300 elements (3 and 1
     // blocks of one multi-tensor launch; the second scaled by a clipping factor, which is a
     // per-tensor word) and an sgd with momentum (a launch of its own).
    CaseBuilder b("optimizer_multi_tensor");
    Value* lr = b.input("lr", f32, {}, Fill::Positive);
    Value* step = b.input("step", f32, {}, Fill::Ids, 3);
    auto adam = [&](const std::string& n, ir::Shape shape, Value* scale) {
      std::vector<Value*> operands = {b.param("w" + n, f32, shape), b.input("g" + n, f32, shape),
                                      b.param("m" + n, f32, shape, Fill::Positive),
                                      b.param("v" + n, f32, shape, Fill::Positive), lr, step};
      AttrDict attrs = {{"kind", Attribute("adam")}, {"lr", Attribute(0.05)}, {"weight_decay", Attribute(0.01)}};
      if (scale) {
        operands.push_back(scale);
        attrs["scaled"] = Attribute(true);
      }
      b.op("kiln.optimizer_update", operands, attrs);
    };
    adam("0", S({90, 100}), nullptr);
    b.op("kiln.optimizer_update",
         {b.param("w2", f32, S({7, 3})), b.input("g2", f32, S({7, 3})), b.param("s2", f32, S({7, 3})), lr, step},
         {{"kind", Attribute("sgd")}, {"lr", Attribute(0.1)}, {"momentum", Attribute(0.9)}});
    adam("1", S({300}), b.input("clip", f32, {}, Fill::Positive));
    b.kernels(2);
    b.tol(1e-4);
    add(b);
  }
  {  // Two tables of one collection in one launch: sum and weighted mean.
    CaseBuilder b("embedding_bags_two_tables");
    Value* t0 = b.param("tables.0", f32, S({10, 8}));
    Value* t1 = b.param("tables.1", f32, S({7, 40}));
    b.op("kiln.embedding_bag", {t0, b.input("cats.0", DType::i64, S({5, 3}), Fill::Ids, 10)});
    b.op("kiln.embedding_bag", {t1, b.input("cats.1", DType::i32, S({5, 2}), Fill::Ids, 7), b.input("w", f32, S({5, 2}))},
         {{"mode", Attribute("mean")}});
    b.kernels(1);
    add(b);
  }
  for (const char* opt : {"sgd", "adagrad", "rowwise_adagrad", "adam"}) {
    for (bool weighted : {false, true}) {
      CaseBuilder b(std::string("embedding_update_") + opt + (weighted ? "_weighted_mean" : ""));
      Value* table = b.param("tables.0", f32, S({6, 12}));
      // 8 samples of 3 ids over 6 rows: duplicates within and across samples.
      std::vector<Value*> operands = {table, b.input("ids", DType::i64, S({8, 3}), Fill::Ids, 6)};
      if (weighted) operands.push_back(b.input("w", f32, S({8, 3})));
      operands.push_back(b.input("grad", f32, S({8, 12})));
      appendUpdateTail(b, operands, opt);
      AttrDict attrs = {{"optimizer", Attribute(opt)}, {"lr", Attribute(0.1)}, {"weight_decay", Attribute(0.01)}};
      if (weighted) {
        attrs["weighted"] = Attribute(true);
        attrs["mode"] = Attribute("mean");
      }
      b.op("kiln.embedding_bag_update", operands, attrs);
      b.kernels(7);  // keys, one radix pass (scan, scatter), segments (count, scan, list), sums + row update
      b.tol(1e-4);
      add(b);
    }
  }
  {  // Jagged ids (ids[N] + lengths[B], empty bags included) next to a fixed-hotness bag: one
     // scan of both lengths, then one lookup launch.
    CaseBuilder b("embedding_bags_jagged");
    Value* t0 = b.param("tables.0", f32, S({10, 8}));
    Value* t1 = b.param("tables.1", f32, S({7, 40}));
    Value* t2 = b.param("tables.2", f32, S({5, 16}));
    b.op("kiln.embedding_bag", {t0, b.input("cats.0", DType::i64, S({13}), Fill::Ids, 10),
                                b.input("cats.0.lengths", DType::i32, S({6}), Fill::Lengths, 13)});
    b.op("kiln.embedding_bag", {t1, b.input("cats.1", DType::i32, S({9}), Fill::Ids, 7),
                                b.input("cats.1.lengths", DType::i64, S({6}), Fill::Lengths, 9), b.input("w", f32, S({9}))},
         {{"mode", Attribute("mean")}});
    b.op("kiln.embedding_bag", {t2, b.input("cats.2", DType::i64, S({6, 2}), Fill::Ids, 5)});
    b.kernels(2);
    add(b);
  }
  {  // Sequence ids padded to [B, 3] (bags longer than 3 keep their first 3): a scan, then one
     // pointwise launch.
    CaseBuilder b("jagged_to_padded");
    b.op("kiln.jagged_to_padded",
         {b.input("hist", DType::i64, S({13}), Fill::Ids, 10),
          b.input("hist.lengths", DType::i32, S({6}), Fill::Lengths, 13)},
         {{"length", Attribute(int64_t{3})}});
    b.kernels(2);
    add(b);
  }
  for (const char* opt : {"sgd", "rowwise_adagrad", "adam"}) {
    CaseBuilder b(std::string("embedding_update_jagged_") + opt);
    Value* table = b.param("tables.0", f32, S({6, 12}));
    // 8 samples holding 20 ids over 6 rows, weighted mean: duplicates, empty bags.
    std::vector<Value*> operands = {table, b.input("ids", DType::i64, S({20}), Fill::Ids, 6),
                                    b.input("lengths", DType::i32, S({8}), Fill::Lengths, 20), b.input("w", f32, S({20})),
                                    b.input("grad", f32, S({8, 12}))};
    appendUpdateTail(b, operands, opt);
    b.op("kiln.embedding_bag_update", operands,
         {{"optimizer", Attribute(opt)}, {"lr", Attribute(0.1)}, {"weighted", Attribute(true)}, {"mode", Attribute("mean")}});
    b.kernels(8);  // lengths scan, keys, one radix pass, segments (3), sums + row update
    b.tol(1e-4);
    add(b);
  }
  {  // The per-id weights' gradient of a fixed-hotness bag: one dot product per id.
    CaseBuilder b("embedding_weight_grad");
    b.op("kiln.embedding_bag_weight_grad", {b.param("tables.0", f32, S({7, 10})),
                                            b.input("ids", DType::i64, S({5, 3}), Fill::Ids, 7),
                                            b.input("grad", f32, S({5, 10}))},
         {{"mode", Attribute("mean")}});
    b.kernels(1);
    b.tol(1e-5);
    add(b);
  }
  for (const char* mode : {"sum", "mean"}) {  // jagged: each id position finds its bag (empty bags included)
    CaseBuilder b(std::string("embedding_weight_grad_jagged_") + mode);
    b.op("kiln.embedding_bag_weight_grad", {b.param("tables.0", f32, S({9, 40})),
                                            b.input("ids", DType::i32, S({17}), Fill::Ids, 9),
                                            b.input("lengths", DType::i64, S({7}), Fill::Lengths, 17),
                                            b.input("grad", f32, S({7, 40}))},
         {{"mode", Attribute(mode)}});
    b.kernels(2);  // scan, one row reduction per id
    b.tol(1e-5);
    add(b);
  }
  {
    CaseBuilder b("embedding_grad_sqnorm");
    b.op("kiln.embedding_bag_grad_sqnorm", {b.input("ids", DType::i64, S({8, 2}), Fill::Ids, 5), b.input("grad", f32, S({8, 6}))});
    b.tol(1e-4);
    add(b);
  }
  {  // Training dropout after an activation: the counter-based mask inline, one launch.
    CaseBuilder b("dropout_training");
    Value* r = b.op("kiln.relu", {b.input("x", f32, S({6, 40}))})->result();
    b.op("kiln.dropout", {r, b.input("step", f32, {}, Fill::Ids, 50)},
         {{"p", Attribute(0.3)},
          {"seed", Attribute(int64_t{7})},
          {"salt", Attribute(int64_t{12345})},
          {"training", Attribute(true)}});
    b.kernels(1);
    add(b);
  }
  {  // Hashed crosses of ids of two integer types.
    CaseBuilder b("hash_cross");
    b.op("kiln.hash_cross",
         {b.input("a", DType::i64, S({9, 1}), Fill::Ids, 1000),
          b.input("b", DType::i32, S({9, 1}), Fill::Ids, 40),
          b.input("c", DType::i64, S({9, 1}), Fill::Ids, 7)},
         {{"buckets", Attribute(int64_t{97})}, {"salt", Attribute(int64_t{31})}});
    b.kernels(1);
    add(b);
  }
  {  // Batch norm's statistic in training (the batch's) and the running update, in place.
    CaseBuilder b("running_stat_update");
    Value* batch = b.input("mean", f32, S({7}));
    Value* running = b.param("bn.running_mean", f32, S({7}));
    b.op("kiln.running_stat", {batch, running}, {{"training", Attribute(true)}});
    add(b);
    CaseBuilder u("running_stat_update_in_place");
    u.op(
        "kiln.running_stat_update",
        {u.param("bn.running_var", f32, S({7}), Fill::Positive), u.input("var", f32, S({7}), Fill::Positive)},
        {{"momentum", Attribute(0.25)}});
    u.kernels(1);
    add(u);
  }
  {  // log q of ids from the estimator's state; rows of period <= 0 take the prior.
    CaseBuilder b("log_frequency");
    b.op("kiln.log_frequency",
         {b.input("ids", DType::i64, S({10, 1}), Fill::Ids, 30), b.param("freq", f32, S({8, 2}))},
         {{"prior", Attribute(50.0)}});
    b.kernels(1);
    add(b);
  }
  {  // The estimator's step: 16 ids over 6 state rows, duplicates counted together.
    CaseBuilder b("frequency_update");
    b.op("kiln.frequency_update",
         {b.param("freq", f32, S({6, 2})), b.input("ids", DType::i32, S({16}), Fill::Ids, 24),
          b.input("step", f32, {}, Fill::Ids, 9)},
         {{"alpha", Attribute(0.2)}});
    b.kernels(1);
    b.tol(1e-5);
    add(b);
  }
  return cases;
}

// Fills a host tensor as `fill` says, deterministically from `rng`.
inline void fillTensor(ir::HostTensor& t, Fill fill, int64_t range, std::mt19937& rng) {
  if (fill == Fill::Lengths) {
    // Sorted cut points in [0, range]: the gaps between them are the lengths.
    const int64_t n = t.numel();
    std::vector<int64_t> cuts = {0, range};
    for (int64_t i = 1; i < n; ++i) cuts.push_back(static_cast<int64_t>(rng() % static_cast<uint32_t>(range + 1)));
    std::sort(cuts.begin(), cuts.end());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = cuts[static_cast<size_t>(i) + 1] - cuts[static_cast<size_t>(i)];
      if (t.view.dtype == DType::i32) t.as<int32_t>()[i] = static_cast<int32_t>(len);
      else t.as<int64_t>()[i] = len;
    }
    return;
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.1f, 2.0f);
  int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    float v = 0;
    int64_t id = 0;
    switch (fill) {
      case Fill::Normal: v = normal(rng); break;
      case Fill::Positive: v = uni(rng); break;
      case Fill::Labels01: v = static_cast<float>(rng() % 2); break;
      case Fill::Lengths: break;  // handled above
      case Fill::Probabilities: v = uni(rng); break;
      case Fill::Ids:
        id = static_cast<int64_t>(rng() % static_cast<uint32_t>(range));
        v = static_cast<float>(id + 1);  // float inputs (a step) get 1..range
        break;
    }
    switch (t.view.dtype) {
      case DType::f32: t.as<float>()[i] = v; break;
      case DType::f64: t.as<double>()[i] = v; break;
      case DType::bf16: t.as<uint16_t>()[i] = ir::floatToBf16(v); break;
      case DType::i32: t.as<int32_t>()[i] = static_cast<int32_t>(fill == Fill::Ids ? id : static_cast<int64_t>(v)); break;
      case DType::i64: t.as<int64_t>()[i] = fill == Fill::Ids ? id : static_cast<int64_t>(v); break;
      default: break;
    }
  }
  if (fill == Fill::Probabilities && t.view.rank() == 2 && t.view.dtype == DType::f32) {
    int64_t rows = t.view.shape[0], cols = t.view.shape[1];
    for (int64_t r = 0; r < rows; ++r) {
      float s = 0;
      for (int64_t c = 0; c < cols; ++c) s += t.as<float>()[r * cols + c];
      for (int64_t c = 0; c < cols; ++c) t.as<float>()[r * cols + c] /= s;
    }
  }
}

// A kiln.input `name` of static `shape` built at `b`, filled Normal from `rng`, its tensor put in
// `values`: for tests that build a function op by op beside its CPU references.
inline Value* addRandomInput(ir::Builder& b, std::mt19937& rng, std::map<const Value*, ir::HostTensor>& values,
                             const char* name, const ir::Shape& shape, DType dtype) {
  auto op = b.createWithTypes("kiln.input", {}, {TensorType(dtype, shape)}, {{"name", Attribute(name)}});
  EXPECT_TRUE(op) << op.status().message();
  if (!op) return nullptr;
  std::vector<int64_t> dims;
  for (const Dim& d : shape) dims.push_back(d.size());
  ir::HostTensor t(dtype, dims);
  fillTensor(t, Fill::Normal, 0, rng);
  Value* v = (*op)->result();
  values[v] = std::move(t);
  return v;
}

// ---- Running a case: inputs, the CPU reference, poisoning and comparison ---------------------
// Shared by the interpreter test (tests/nvrtc/kernel_semantics_test.cc) and the GPU test
// (tests/gpu/gpu_ops_test.cc), which run the same cases against the same oracle.

inline double readAsDouble(const ir::TensorView& v, int64_t i) {
  switch (v.dtype) {
    case DType::f32: return v.as<float>()[i];
    case DType::f64: return v.as<double>()[i];
    case DType::bf16: return ir::bf16ToFloat(v.as<uint16_t>()[i]);
    case DType::i32: return v.as<int32_t>()[i];
    case DType::i64: return static_cast<double>(v.as<int64_t>()[i]);
    case DType::i1: return v.as<uint8_t>()[i];
    default: return 0;
  }
}

// NaN for floats, 0xA5 bytes otherwise: an element a kernel forgets to write fails the comparison.
inline void poison(ir::HostTensor& t) {
  if (t.view.dtype == DType::f32)
    for (int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  else if (t.view.dtype == DType::bf16)
    for (int64_t i = 0; i < t.numel(); ++i) t.as<uint16_t>()[i] = 0x7fc0;
  else
    std::memset(t.view.data, 0xA5, t.storage.size());
}

// |got - want| <= tol * (1 + |want|) elementwise; the first few misses are reported, each
// naming `what` and the side that computed `got` ("kernel", "GPU").
inline void expectClose(const ir::TensorView& got, const ir::TensorView& want, double tol, const std::string& what,
                        const char* computed_by) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  int bad = 0;
  for (int64_t i = 0; i < got.numel() && bad < 5; ++i) {
    double g = readAsDouble(got, i), w = readAsDouble(want, i);
    if (!(std::fabs(g - w) <= tol * (1 + std::fabs(w)))) {
      ADD_FAILURE() << what << "[" << i << "]: " << computed_by << " " << g << ", reference " << w;
      ++bad;
    }
  }
}

// A case's random inputs and the reference's results. `inputs` holds pristine copies for the
// side under test; `ref` the inputs as the CPU reference left them (updated state) and every
// result of the group.
struct CaseRun {
  std::map<const Value*, ir::HostTensor> inputs, ref;
};

inline Expected<CaseRun> runReference(const OpCase& c, std::mt19937& rng) {
  CaseRun r;
  for (const auto& [v, fill] : c.fills) {
    auto shape = codegen::concreteShape(v->type(), c.symbols);
    if (!shape) return shape.status();
    ir::HostTensor t(v->type().dtype(), *shape);
    fillTensor(t, fill.first, fill.second, rng);
    r.ref[v] = t;
    r.inputs[v] = t;
  }
  ir::CpuContext ctx;
  ctx.symbols = &c.symbols;
  for (const ir::Op* op : c.group) {
    if (!op->def()->cpu) return Status::errorf("{} has no CPU reference", op->name());
    std::vector<const ir::TensorView*> in;
    for (Value* v : op->operands()) in.push_back(&r.ref.at(v).view);
    std::vector<ir::TensorView*> out;
    for (Value* res : op->results()) {
      auto shape = codegen::concreteShape(res->type(), c.symbols);
      if (!shape) return shape.status();
      r.ref[res] = ir::HostTensor(res->type().dtype(), *shape);
      out.push_back(&r.ref[res].view);
    }
    KILN_RETURN_IF_ERROR(op->def()->cpu(*op, in, out, ctx));
  }
  return r;
}

// Host storage for each buffer of a lowered group: a case input's pristine copy, or a poisoned
// tensor (results, temporaries).
inline std::vector<ir::HostTensor> groupStorage(const codegen::LoweredGroup& g, const CaseRun& run) {
  std::vector<ir::HostTensor> storage(g.buffers.size());
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    const codegen::GroupBuffer& b = g.buffers[i];
    if (b.value && run.inputs.count(b.value)) {
      storage[i] = run.inputs.at(b.value);
    } else {
      storage[i] = ir::HostTensor(b.dtype, {b.elements});
      poison(storage[i]);
    }
  }
  return storage;
}

// What every backend's op test starts from: case `index` of allOpCases(), its CPU reference on
// fresh random inputs (drawn from `seed` + index) and its lowered group. The case owns the
// module the group's ops live in.
struct PreparedCase {
  OpCase c;
  CaseRun run;
  codegen::LoweredGroup group;
};
inline Expected<PreparedCase> prepareCase(int index, unsigned seed) {
  std::vector<OpCase> cases = allOpCases();
  PreparedCase p{std::move(cases[static_cast<size_t>(index)]), {}, {}};
  std::mt19937 rng(seed + static_cast<unsigned>(index));
  auto run = runReference(p.c, rng);
  if (!run) return Status::errorf("{}: {}", p.c.name, run.status().message());
  p.run = run.take();
  auto lowered = codegen::lowerGroup(p.c.group, p.c.symbols);
  if (!lowered) return Status::errorf("{}: {}", p.c.name, lowered.status().message());
  p.group = lowered.take();
  return p;
}

// Writes each address table of `g` (GroupBuffer::words) into its buffer, the group's buffers
// being host memory at `address` (simt), as the executor writes them once it placed the buffers.
inline void fillAddressTables(const codegen::LoweredGroup& g, const std::vector<uint64_t>& address) {
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    if (g.buffers[i].words.empty()) continue;
    std::vector<int64_t> words = codegen::addressTableWords(g.buffers[i], address);
    std::memcpy(reinterpret_cast<void*>(address[i]), words.data(), words.size() * sizeof(int64_t));
  }
}

// The group's embedding error flags start clear, as the executor leaves them before each step.
inline void clearErrorFlags(const codegen::LoweredGroup& g, std::vector<ir::HostTensor>& storage) {
  for (size_t i = 0; i < g.buffers.size(); ++i)
    if (g.buffers[i].name == "embedding_errors") std::memset(storage[i].view.data, 0, storage[i].storage.size());
}

// After the kernels ran (and the flags were copied back): no embedding error was flagged.
inline void expectNoErrorFlagged(const codegen::LoweredGroup& g, const std::vector<ir::HostTensor>& storage) {
  for (size_t i = 0; i < g.buffers.size(); ++i)
    if (g.buffers[i].name == "embedding_errors") {
      EXPECT_EQ(storage[i].as<int32_t>()[0], 0) << "the kernels flagged an error for table " << storage[i].as<int32_t>()[1];
    }
}

// Compares every value the group wrote (results, updated parameters and state) with the
// reference; returns how many were compared.
inline int expectGroupMatchesReference(const codegen::LoweredGroup& g, const std::vector<ir::HostTensor>& storage,
                                       const CaseRun& run, double tol, const char* computed_by) {
  int checked = 0;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    const codegen::GroupBuffer& b = g.buffers[i];
    if (!b.value || !b.written) continue;
    ir::TensorView got = storage[i].view;
    got.shape = run.ref.at(b.value).view.shape;
    expectClose(got, run.ref.at(b.value).view, tol, b.name, computed_by);
    ++checked;
  }
  return checked;
}

}  // namespace kiln::testing
