#include "runtime/parameter_store.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <new>
#include <set>
#include <stdexcept>

#include "runtime/cpu/thread_pool.h"
#include "runtime/memory.h"
#include "runtime/random.h"

namespace kiln::runtime {

Expected<ParameterInit> ParameterInit::fromOp(const ir::Op& op) {
  ParameterInit p;
  p.kind = op.strAttr("init", "zeros");
  p.value = op.floatAttr("value", 0.0);
  p.mean = op.floatAttr("mean", 0.0);
  p.std = op.floatAttr("std", 1.0);
  p.low = op.floatAttr("low", 0.0);
  p.high = op.floatAttr("high", 1.0);
  static const char* kKinds[] = {"zeros", "ones", "constant", "normal", "uniform", "xavier_uniform", "xavier_normal"};
  bool known = false;
  for (const char* k : kKinds) known |= p.kind == k;
  if (!known)
    return Status::error(fmt::format("parameter \"{}\": unknown initializer '{}'", op.strAttr("name"), p.kind),
                         op.location());
  if (p.kind == "normal" && !(p.std >= 0))
    return Status::error(fmt::format("parameter \"{}\": normal std must be >= 0, got {}", op.strAttr("name"), p.std),
                         op.location());
  if (p.kind == "uniform" && !(p.low <= p.high))
    return Status::error(fmt::format("parameter \"{}\": uniform needs low <= high, got [{}, {}]", op.strAttr("name"),
                                     p.low, p.high),
                         op.location());
  return p;
}

Status initializeTensor(ir::HostTensor& t, const ParameterInit& init, uint64_t seed, ThreadPool* pool,
                        const GlobalPlace* place) {
  ir::DType dt = t.view.dtype;
  if (dt != ir::DType::f32 && dt != ir::DType::f64 && dt != ir::DType::bf16) {
    if (init.kind == "zeros") {
      std::fill(t.storage.begin(), t.storage.end(), 0);
      return Status::ok();
    }
    return Status::errorf("cannot initialize a {} tensor with '{}'", ir::dtypeName(dt), init.kind);
  }
  const auto& local = t.view.shape;
  if (place && (place->shape.size() != local.size() || place->offset.size() != local.size()))
    return Status::errorf("a shard of rank {} cannot lie in a tensor of rank {}", local.size(),
                          place->shape.size());
  if (place && !place->rows.empty()) {
    if (local.empty() || static_cast<int64_t>(place->rows.size()) != local[0])
      return Status::errorf("{} rows are placed for a tensor of {}", place->rows.size(), local.empty() ? 0 : local[0]);
    for (int64_t r : place->rows)
      if (r < 0 || r >= place->shape[0])
        return Status::errorf("row {} lies outside the tensor's {} rows", r, place->shape[0]);
  }
  const auto& shape = place ? place->shape : local;
  // [out, in, receptive...], as PyTorch computes fans.
  double receptive = 1;
  for (size_t i = 2; i < shape.size(); ++i) receptive *= static_cast<double>(shape[i]);
  double fan_out = shape.empty() ? 1 : static_cast<double>(shape[0]) * receptive;
  double fan_in = shape.size() < 2 ? fan_out : static_cast<double>(shape[1]) * receptive;

  enum { Const, Normal, Uniform } how = Const;
  double a = 0, b = 0;  // constant: a; normal: mean a, std b; uniform: [a, b)
  if (init.kind == "zeros") a = 0;
  else if (init.kind == "ones") a = 1;
  else if (init.kind == "constant") a = init.value;
  else if (init.kind == "normal") how = Normal, a = init.mean, b = init.std;
  else if (init.kind == "uniform") how = Uniform, a = init.low, b = init.high;
  else if (init.kind == "xavier_uniform") {
    double limit = std::sqrt(6.0 / (fan_in + fan_out));
    how = Uniform, a = -limit, b = limit;
  } else if (init.kind == "xavier_normal") {
    how = Normal, a = 0, b = std::sqrt(2.0 / (fan_in + fan_out));
  } else {
    return Status::errorf("unknown initializer '{}'", init.kind);
  }

  CounterRng rng(seed);
  // The global element number of local element i: its draws are the whole tensor's.
  auto global = [&](int64_t i) -> uint64_t {
    if (!place) return static_cast<uint64_t>(i);
    int64_t g = 0, stride = 1;
    for (size_t d = local.size(); d-- > 0;) {
      const int64_t at = i % local[d];
      g += (d == 0 && !place->rows.empty() ? place->rows[static_cast<size_t>(at)] : place->offset[d] + at) * stride;
      i /= local[d];
      stride *= shape[d];
    }
    return static_cast<uint64_t>(g);
  };
  auto fill = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      double v = how == Const    ? a
                 : how == Normal ? a + b * rng.normal(global(i))
                                 : a + (b - a) * rng.uniform(global(i));
      if (dt == ir::DType::f32) t.as<float>()[i] = static_cast<float>(v);
      else if (dt == ir::DType::f64) t.as<double>()[i] = v;
      else t.as<uint16_t>()[i] = ir::floatToBf16(static_cast<float>(v));
    }
  };
  int64_t n = t.numel();
  if (pool) pool->parallelFor(n, 1 << 16, fill);
  else fill(0, n);
  return Status::ok();
}

ir::HostTensor* ParameterStore::find(std::string_view name) {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

const ir::HostTensor* ParameterStore::find(std::string_view name) const {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

ir::HostTensor& ParameterStore::set(const std::string& name, ir::HostTensor t) {
  return params_[name] = std::move(t);
}

std::vector<std::string> ParameterStore::names() const {
  std::vector<std::string> out;
  for (const auto& [k, _] : params_) out.push_back(k);
  return out;
}

int64_t ParameterStore::totalBytes() const {
  int64_t n = 0;
  for (const auto& [_, t] : params_) n += t.view.bytes();
  return n;
}

std::string allocationFailure(const ParameterSpec& spec) {
  return fmt::format("out of memory: cannot allocate parameter \"{}\" {}[{}] ({}, {} bytes){}", spec.name,
                     ir::dtypeName(spec.dtype), fmt::join(spec.shape, ", "),
                     formatBytes(static_cast<uint64_t>(spec.bytes)), spec.bytes,
                     spec.optimizer_state ? ", an optimizer state" : "");
}

Expected<ParameterSpec> parameterSpec(const ir::Op& op, const ir::SymbolBindings& symbols) {
  ParameterSpec p;
  p.name = op.strAttr("name");
  p.op = &op;
  p.optimizer_state = op.hasAttr("state_of");
  const ir::TensorType& type = op.result()->type();
  p.dtype = type.dtype();
  for (const ir::Dim& d : type.shape()) {
    auto v = d.evaluate(symbols);
    if (!v || d.isBounded())
      return Status::error(
          fmt::format("parameter \"{}\" of type {} has no concrete shape", p.name, type.str()),
          op.location());
    p.shape.push_back(*v);
  }
  // Checked: a --set rows_cap=... beyond 2^63 bytes would otherwise wrap to a small allocation.
  auto bytes = type.checkedBytes(symbols);
  if (!bytes)
    return Status::error(fmt::format("parameter \"{}\": {}", p.name, bytes.status().message()),
                         op.location());
  p.bytes = *bytes;
  return p;
}

Expected<std::vector<ParameterSpec>> parameterSpecs(const ir::Module& m, const ir::SymbolBindings& symbols) {
  std::vector<ParameterSpec> out;
  std::set<std::string, std::less<>> seen;
  Status status;
  for (const auto& f : m.functions())
    const_cast<ir::Function&>(*f).walk([&](ir::Op& op) {
      if (!status.isOk() || !op.is(ir::OpCode::Parameter) || seen.count(op.strAttr("name"))) return;
      auto p = parameterSpec(op, symbols);
      if (!p) {
        status = p.status();
        return;
      }
      seen.insert(p->name);
      out.push_back(p.take());
    });
  if (!status.isOk()) return status;
  return out;
}

Status ParameterStore::initializeFrom(const ir::Function& f, uint64_t run_seed,
                                      const ir::SymbolBindings& symbols, ThreadPool* pool, bool values,
                                      const std::set<std::string, std::less<>>* leave_out) {
  Status status;
  const_cast<ir::Function&>(f).walk([&](ir::Op& op) {
    if (!status.isOk() || !op.is(ir::OpCode::Parameter)) return;
    auto spec = parameterSpec(op, symbols);
    if (!spec) {
      status = spec.status();
      return;
    }
    const std::string& name = spec->name;
    if (leave_out && leave_out->count(name)) return;
    const ir::TensorType& type = op.result()->type();
    if (const ir::HostTensor* have = find(name)) {
      if (have->view.dtype != type.dtype() || have->view.shape != spec->shape)
        status = Status::error(fmt::format("parameter \"{}\" is declared as {} but the store holds {} [{}]", name,
                                           type.str(), ir::dtypeName(have->view.dtype), fmt::join(have->view.shape, ", ")),
                               op.location());
      return;
    }
    auto init = ParameterInit::fromOp(op);
    if (!init) {
      status = init.status();
      return;
    }
    // The memory check ran before (driver/session.cc), but what it read may have changed or
    // another process may take it first: a failed allocation names the parameter, not bad_alloc.
    ir::HostTensor t;
    try {
      t.reset(type.dtype(), spec->shape);
    } catch (const std::bad_alloc&) {
      status = Status::error(allocationFailure(*spec), op.location());
      return;
    } catch (const std::length_error&) {
      status = Status::error(allocationFailure(*spec), op.location());
      return;
    }
    if (!values) {
      set(name, std::move(t));
      return;
    }
    GlobalPlace place{op.intsAttr("global_shape"), op.intsAttr("offset"), op.intsAttr("hot_rows")};
    if (!place.rows.empty()) place.offset.assign(place.shape.size(), 0);
    const std::string seeded_as = op.hasAttr("hot_of") ? op.strAttr("hot_of") : name;
    Status s = initializeTensor(t, *init, parameterSeed(run_seed, seeded_as), pool,
                                place.shape.empty() ? nullptr : &place);
    if (!s.isOk()) {
      status = Status::error(fmt::format("parameter \"{}\": {}", name, s.message()), op.location());
      return;
    }
    set(name, std::move(t));
  });
  return status;
}

Status ParameterStore::initializeFrom(const ir::Module& m, uint64_t run_seed,
                                      const ir::SymbolBindings& symbols, ThreadPool* pool, bool values,
                                      const std::set<std::string, std::less<>>* leave_out) {
  for (const auto& f : m.functions())
    KILN_RETURN_IF_ERROR(initializeFrom(*f, run_seed, symbols, pool, values, leave_out));
  return Status::ok();
}

}  // namespace kiln::runtime
