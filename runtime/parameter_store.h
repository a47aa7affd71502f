// The parameter store: every parameter and optimizer state by name, shared by @forward,
// @train_step and evaluation; checkpoints are this store written out. A parameter is
// initialized from its `kiln.parameter` op's attributes with a seed derived from the run's seed
// and its name, so initial values do not depend on op order.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/tensor_view.h"

namespace kiln::runtime {

class ThreadPool;

// How one parameter is initialized (the attributes of its kiln.parameter op).
struct ParameterInit {
  std::string kind = "zeros";  // zeros, ones, constant, normal, uniform, xavier_uniform, xavier_normal
  double value = 0;            // constant
  double mean = 0, std = 1;    // normal
  double low = 0, high = 1;    // uniform
  static Expected<ParameterInit> fromOp(const ir::Op& op);
};

// Where a shard lies in its global tensor (the shard pass's global_shape and offset attributes).
// With `rows`, local row i is global row rows[i] (a hybrid table's replica of its hot rows: the
// shard pass's hot_rows) and offset[0] is unused.
struct GlobalPlace {
  std::vector<int64_t> shape, offset;
  std::vector<int64_t> rows;
};

// Fills `t` (f32, f64 or bf16) by `init`; xavier uses fan_in/fan_out of the [out, in, ...]
// layout. Threaded over element ranges when a pool is given; the result does not depend on it.
// With `place`, `t` is that region of the global tensor and gets exactly the values the whole
// tensor's initialization gives there (draws and fans are the global tensor's), so N ranks start
// from the single-rank model.
Status initializeTensor(ir::HostTensor& t, const ParameterInit& init, uint64_t seed,
                        ThreadPool* pool = nullptr, const GlobalPlace* place = nullptr);

// A kiln.parameter's concrete shape and size, computed from its type before anything is
// allocated (the memory check adds these up; the store allocates exactly these).
struct ParameterSpec {
  std::string name;
  ir::DType dtype = ir::DType::f32;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  bool optimizer_state = false;  // the op has `state_of` (an optimizer's accumulator of a weight)
  const ir::Op* op = nullptr;
};

// The spec of one kiln.parameter op under `symbols`; an error, located at the op, names an
// unbound or bounded dim or a size beyond int64 (e.g. a table of more than 2^63 bytes).
Expected<ParameterSpec> parameterSpec(const ir::Op& op, const ir::SymbolBindings& symbols);
// The message of a failed allocation of `spec`: its name, type and bytes.
std::string allocationFailure(const ParameterSpec& spec);
// Every kiln.parameter of `m`, each name once, in the order the store creates them.
Expected<std::vector<ParameterSpec>> parameterSpecs(const ir::Module& m, const ir::SymbolBindings& symbols);

class ParameterStore {
 public:
  bool contains(std::string_view name) const { return params_.find(name) != params_.end(); }
  ir::HostTensor* find(std::string_view name);
  const ir::HostTensor* find(std::string_view name) const;
  ir::HostTensor& set(const std::string& name, ir::HostTensor t);
  std::vector<std::string> names() const;
  size_t size() const { return params_.size(); }
  int64_t totalBytes() const;

  // Creates each kiln.parameter of `f` that the store lacks, shaped by its type (symbols bound
  // by `symbols`) and initialized from its attributes with parameterSeed(run_seed, name) (a
  // hybrid table's replica, `hot_of` T: as T's hot rows are, with T's seed).
  // Parameters already present are checked against the declared type and kept.
  // With `values` false they are allocated (zeros) but not initialized: a caller that loads
  // every value from a checkpoint next.
  // Parameters named in `leave_out` are neither allocated nor initialized (a serving session's
  // tables, which a store holds).
  Status initializeFrom(const ir::Function& f, uint64_t run_seed, const ir::SymbolBindings& symbols = {},
                        ThreadPool* pool = nullptr, bool values = true,
                        const std::set<std::string, std::less<>>* leave_out = nullptr);
  // Same over every function of a module.
  Status initializeFrom(const ir::Module& m, uint64_t run_seed, const ir::SymbolBindings& symbols = {},
                        ThreadPool* pool = nullptr, bool values = true,
                        const std::set<std::string, std::less<>>* leave_out = nullptr);

 private:
  std::map<std::string, ir::HostTensor, std::less<>> params_;
};

}  // namespace kiln::runtime
