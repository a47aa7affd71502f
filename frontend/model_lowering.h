// Internal to the frontend: the evaluator that runs a model's body at compile time and builds
// its @forward function. Semantic analysis happens here: names resolve, compile-time values
// (params, lists, loops, user functions) are computed, and every tensor operation is checked
// for types and shapes as its IR op is built. Errors unwind to the enclosing statement, whose
// target becomes a poison value that silences follow-on errors, so a run reports each
// independent mistake once.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "frontend/ast.h"
#include "frontend/diagnostics.h"
#include "frontend/value.h"
#include "ir/builder.h"
#include "ir/ir.h"

namespace kiln::frontend {

// Thrown after an error was reported (or when a poison value is used): unwinds to the statement.
struct EvalError {};

class ModelLowering {
 public:
  ModelLowering(DiagnosticEngine& diags, std::map<std::string, const ast::FnDecl*> fns,
                std::map<std::string, std::string> overrides)
      : diags_(diags), fns_(std::move(fns)), overrides_(std::move(overrides)) {}

  // Builds the module; nullptr when errors were reported.
  std::unique_ptr<ir::Module> run(const ast::ModelDecl& model);

  // ---- used by the builtin layers (layers.cc) and the train block (train_config.cc) ----
  struct CallArgs {
    Location loc;
    std::string callee;
    std::vector<Val> positional;
    std::vector<Location> positional_locs;
    std::vector<std::pair<std::string, Val>> named;
    std::vector<Location> named_locs;
    std::string target;  // the assignment this call is the whole right side of, for naming
  };
  // Arguments matched to a declared parameter list: bound[i] is parameter i, if given.
  struct Bound {
    std::vector<std::optional<Val>> values;
    std::vector<Location> locs;
    const Val* get(size_t i) const { return values[i] ? &*values[i] : nullptr; }
  };

 private:
  friend struct Builtins;
  struct Binding {
    Val value;
    Location loc;
    bool used = false;
    const char* what = "value";  // for the unused warning: value, input, param
  };
  struct Frame {
    std::map<std::string, Binding> vars;
    std::string prefix;  // parameter-name prefix, e.g. "top." inside `top = tower(x)`
    std::map<std::string, int> kind_counters;
    int loop_depth = 0;
    bool is_function = false;
    std::optional<Val> returned;
  };

  // statements
  void execBlock(const ast::Block& b);
  void exec(const ast::Stmt& s);
  void execInput(const ast::Stmt& s);
  void execParam(const ast::Stmt& s);
  void execUnpack(const ast::Stmt& s);
  void execTrain(const ast::Stmt& s);
  void bind(const std::string& name, Val v, const Location& loc, const char* what = "value");
  void warnUnused(const Binding& b, const std::string& name);
  void endFrame(Frame& f);

  // expressions
  Val eval(const ast::Expr& e, const std::string& target = "");
  // The file columns of an input's `columns(...)` clause, one per feature (inputs.cc).
  ir::AttrArray columnsArg(const ast::Modifier& m, size_t n);
  Val evalName(const ast::Expr& e);
  Val evalBinary(const ast::Expr& e);
  // `x < y` with a tensor on either side: kiln.compare, an i1 tensor.
  ir::Value* compareTensors(const ast::Expr& e, const Val& a, const Val& b);
  Val evalIndex(const ast::Expr& e);
  Val evalCall(const ast::Expr& e, const std::string& target);

 public:
  // Calls any callable value (builtin, user function, embedding collection).
  Val call(const Val& callee, CallArgs& args);
  Val callUser(const ast::FnDecl& fn, CallArgs& args);
  Bound bindArgs(CallArgs& args, const std::vector<std::string>& params, size_t required);

  // Reports and unwinds.
  [[noreturn]] void fail(const Location& loc, std::string msg);
  void warn(const Location& loc, std::string msg);
  // Poison values unwind silently: their error was reported where they were made.
  void checkNotError(const Val& v) {
    if (v.kind == Val::Kind::Error) throw EvalError{};
  }

  // typed accessors that report a located error on mismatch
  ir::Value* tensorArg(const Val& v, const Location& loc, const char* what);
  int64_t intArg(const Val& v, const Location& loc, const char* what);
  double numberArg(const Val& v, const Location& loc, const char* what);
  bool boolArg(const Val& v, const Location& loc, const char* what);
  std::string wordArg(const Val& v, const Location& loc, const char* what);
  // An int or list of ints broadcast to n values (n = 0: the list's own length).
  std::vector<int64_t> intsArg(const Val& v, const Location& loc, const char* what, size_t n = 0);
  // A record (optimizer, schedule, initializer); a bare builtin name is a record with no fields.
  Val recordArg(const Val& v, const Location& loc, const char* what);

  // IR construction at the current location
  ir::Value* emit(ir::OpCode op, const std::vector<ir::Value*>& operands, ir::AttrDict attrs = {});
  ir::Value* emitTyped(ir::OpCode op, const std::vector<ir::Value*>& operands, const ir::TensorType& type,
                       ir::AttrDict attrs = {});
  // An op of several results (kiln.topk), its types inferred.
  std::vector<ir::Value*> emitResults(ir::OpCode op, const std::vector<ir::Value*>& operands,
                                      ir::AttrDict attrs = {});
  ir::Value* scalarConstant(double v, ir::DType dtype);
  ir::Value* reshape(ir::Value* x, ir::Shape shape);
  ir::Value* binaryOp(const char* op, ir::Value* a, ir::Value* b, const Location& loc);
  // A trainable parameter; `init` is an initializer record.
  ir::Value* makeParam(const std::string& name, const ir::TensorType& type, const Val& init, const Location& loc,
                       ir::AttrDict extra = {});
  // The dotted name prefix for a parametric layer of `kind` called with `args`.
  std::string layerName(const CallArgs& args, const std::string& kind, const Val* explicit_name);
  // Applies an activation (any callable) to a tensor.
  ir::Value* activate(const Val& act, ir::Value* x, const Location& loc);
  // Flattens tensors and lists of tensors into one list.
  std::vector<ir::Value*> tensorList(const Val& v, const Location& loc, const char* what);

  ir::Builder& builder() { return builder_; }
  Frame& frame() { return frames_.back(); }
  const std::string& currentTarget() const { return current_target_; }
  void noteLabelName(std::string n) { label_name_ = std::move(n); }

  // The compiled train block, assembled by train_config.cc.
  struct TrainConfig {
    bool present = false;
    Location loc;
    ir::Value* loss = nullptr;
    std::string prediction;
    Location prediction_loc;
    // `prediction = [a, b]`: the tasks' logits side by side, [B, k] (output "prediction").
    ir::Value* prediction_value = nullptr;
    // `loss = [l0, l1]`: each task's loss, reported as statistic task_loss.<i>; `loss` is their
    // sum weighted by `loss_weights`.
    std::vector<ir::Value*> task_losses;
    std::string label = "label";
    ir::AttrDict attrs;  // optimizer, embedding_optimizer, lr_schedule, grad_clip, precision, metrics
  };
  TrainConfig& train() { return train_; }
  // The train block's parts (train_config.cc).
  ir::Value* scalarLoss(const Val& v, const Location& loc, const std::string& what);
  ir::Value* taskPredictions(const ast::Expr& list);
  void weightTaskLosses(const std::vector<double>& weights, const Location& weights_loc, bool has_weights,
                        const Location& loss_loc);
  // A loss a layer adds to the training loss (a MoE balancing loss), once, by name; it is also
  // a step statistic.
  void addAuxLoss(const std::string& name, ir::Value* loss);
  // A value @forward and @train_step also return, for the progress line and the metrics file
  // (kiln.train's `stats`): MoE per-expert counts, balancing losses.
  void addStat(const std::string& name, ir::Value* v);
  // A MoE layer's shape for its load statistics (kiln.train's `moe`: name, experts, topk,
  // tokens per sample).
  void addMoeLayer(ir::AttrDict info) { moe_layers_.push_back(std::move(info)); }

 private:
  DiagnosticEngine& diags_;
  std::map<std::string, const ast::FnDecl*> fns_;
  std::map<std::string, std::string> overrides_;
  std::set<std::string> used_overrides_;

  std::unique_ptr<ir::Module> module_;
  ir::Function* forward_ = nullptr;
  ir::Builder builder_;
  std::deque<Frame> frames_;  // a deque: references to a frame survive calls pushing more
  std::set<std::string> param_names_;
  std::set<std::string> layer_prefixes_;
  std::set<std::string> warned_;
  std::string current_target_;
  std::string label_name_ = "label";
  std::vector<std::pair<std::string, ir::Value*>> outputs_;
  std::vector<Location> output_locs_;
  std::vector<std::pair<std::string, ir::Value*>> aux_losses_, stats_;
  ir::AttrArray moe_layers_;
  int64_t next_feature_ = 0;
  int64_t fuel_ = 2'000'000;
  bool out_of_fuel_ = false;
  int call_depth_ = 0;
  TrainConfig train_;
};

// The builtins: functions, layers and record makers the language provides (layers.cc).
using BuiltinFn = Val (*)(ModelLowering& L, ModelLowering::CallArgs& args);
struct BuiltinInfo {
  BuiltinFn fn;
  const char* summary;
};
const BuiltinInfo* findBuiltin(const std::string& name);
// The builtins of tensor_builtins.cc (where, matmul, einsum, topk, ...) and transformer.cc
// (embedding, swiglu, attention), added to the table of layers.cc.
void addTensorBuiltins(std::map<std::string, BuiltinInfo>& table);
void addTransformerBuiltins(std::map<std::string, BuiltinInfo>& table);
// The sequence builtins of sequence.cc (lengths, sequence_mask, sequence_pool, din_attention).
void addSequenceBuiltins(std::map<std::string, BuiltinInfo>& table);
// The recommendation builtins of recsys.cc (cross_ids, batch_norm, in_batch_softmax, in_batch_recall).
void addRecsysBuiltins(std::map<std::string, BuiltinInfo>& table);

// The rows a sparse input that only cross_ids reads declares: its raw ids feed the hash. A
// table that reads it too sets its own.
constexpr int64_t kRawIdRows = int64_t{1} << 62;

// Per-channel statistics of x [B, ..., C] over every axis but the last, each [C]: the batch's in
// training, the running averages `name.running_mean` and `name.running_var` (non-trainable,
// moved by `momentum` each train step) in eval and predict (recsys.cc; batch_norm and dice).
struct NormStatistics {
  ir::Value* mean = nullptr;
  ir::Value* var = nullptr;
};
NormStatistics normStatistics(ModelLowering& L, ir::Value* x, const std::string& name, double momentum,
                              const Location& loc);

// Helpers shared by the builtin files (layers.cc): each reports a located error on bad input.
int64_t staticLastDim(ModelLowering& L, ir::Value* x, const Location& loc, const char* what);
int64_t positiveInt(ModelLowering& L, const Val& v, const Location& loc, const char* what);
ir::Value* floatTensor(ModelLowering& L, const Val& v, const Location& loc, const char* what);
// An initializer record with its defaults filled in; `dflt` names the initializer when v is null.
Val initRecord(ModelLowering& L, const Val* v, const Location& loc, const char* dflt);
// Axes of a reduction: an int, a list of ints, or (absent) every axis; negatives count from the end.
std::vector<int64_t> axesArg(ModelLowering& L, const Val* v, const Location& loc, int64_t rank);
ir::Value* reduce(ModelLowering& L, ir::Value* x, const char* kind, std::vector<int64_t> axes, bool keep);
// x W^T (+ b) with W: [out, in] named `name.weight` (and `name.bias`).
ir::Value* linearLayer(ModelLowering& L, ir::Value* x, int64_t out, bool bias, const Val& init,
                       const std::string& name, const Location& loc);
// a * b when the product is a dim (a factor times at most one symbol); nullopt otherwise.
std::optional<ir::Dim> dimProduct(const ir::Dim& a, const ir::Dim& b);
// kiln.transpose by perm, or x itself for the identity.
ir::Value* transposeTo(ModelLowering& L, ir::Value* x, const std::vector<int64_t>& perm);
// The f32 (or dt) mask [B, len] of padded sequences with `lengths` (integer [B]): 1 at positions
// below the sample's length, else 0. `inside` gets the i1 form when given.
ir::Value* sequenceMask(ModelLowering& L, ir::Value* lengths, int64_t len, ir::DType dt,
                        ir::Value** inside = nullptr);
// The lengths of a sequence argument: `explicit_lengths` when given (an integer [B] tensor, a
// variable-length sparse input, or a sequence carrying lengths), else those `x` carries; an
// error at `loc` when there are none.
ir::Value* sequenceLengths(ModelLowering& L, const Val& x, const Val* explicit_lengths, const Location& loc,
                           const char* what);
// Bare words that name settings rather than functions: dtypes, metrics, id maps.
bool isWord(const std::string& name);
// Optimizer settings as the attribute dictionaries of docs/model-ir.md, every field filled in
// (train_config.cc).
ir::Attribute denseOptimizerAttr(ModelLowering& L, const Val& v, const Location& loc);
ir::Attribute embeddingOptimizerAttr(ModelLowering& L, const Val& v, const Location& loc);
// The Mixture-of-Experts layer `moe(x, experts = E, ...)` (moe.cc).
Val lowerMoe(ModelLowering& L, ModelLowering::CallArgs& args);
// Applies an embedding collection to sparse features (inputs.cc).
Val applyEmbeddings(ModelLowering& L, const Val& tables, ModelLowering::CallArgs& args);

}  // namespace kiln::frontend
