#include "codegen/kernel_interpreter.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ir/scalar_fn.h"
#include "ir/tensor_view.h"

namespace kiln::codegen {
namespace {

// A scalar of any compute type: floats in f (f32 values kept exactly representable as float),
// integers and i1 in i.
struct Val {
  double f = 0;
  int64_t i = 0;
};

class Evaluator {
 public:
  Evaluator(const Kernel& k, const std::vector<void*>& buffers)
      : k_(k), g_(k.exprs), buffers_(buffers), vals_(g_.size()), stamp_(g_.size(), 0) {}

  std::vector<int64_t> coords;
  std::vector<Val> row_values;

  // Starts a new logical thread: memoized values are forgotten.
  void next() { ++gen_; }

  Val eval(int id) {
    if (stamp_[static_cast<size_t>(id)] == gen_) return vals_[static_cast<size_t>(id)];
    Val v = compute(g_[id]);
    vals_[static_cast<size_t>(id)] = v;
    stamp_[static_cast<size_t>(id)] = gen_;
    return v;
  }

  Status store(const Store& s) {
    if (s.guard >= 0 && !eval(s.guard).i) return Status::ok();
    int64_t idx = eval(s.index).i;
    const KernelBuffer& b = k_.buffers[static_cast<size_t>(s.buffer)];
    if (idx < 0 || idx >= b.elements)
      return Status::errorf("kernel '{}' stores out of bounds: {}[{}] of {}", k_.name, b.name, idx, b.elements);
    Val v = eval(s.value);
    if (s.accumulate) {
      // One logical thread at a time: the atomic add is a plain add in the compute type.
      Val old = read(s.buffer, idx);
      if (ir::isFloat(b.dtype)) v.f = b.dtype == DType::f64 ? old.f + v.f : static_cast<float>(old.f) + static_cast<float>(v.f);
      else v.i = old.i + v.i;
    }
    write(s.buffer, idx, v);
    return Status::ok();
  }

  Val read(int buffer, int64_t idx) {
    const KernelBuffer& b = k_.buffers[static_cast<size_t>(buffer)];
    if (idx < 0 || idx >= b.elements) {
      error_ = fmt::format("kernel '{}' loads out of bounds: {}[{}] of {}", k_.name, b.name, idx, b.elements);
      return {};
    }
    void* p = buffers_[static_cast<size_t>(buffer)];
    Val v;
    switch (b.dtype) {
      case DType::f32: v.f = static_cast<float*>(p)[idx]; break;
      case DType::f64: v.f = static_cast<double*>(p)[idx]; break;
      case DType::bf16: v.f = ir::bf16ToFloat(static_cast<uint16_t*>(p)[idx]); break;
      case DType::i32: v.i = static_cast<int32_t*>(p)[idx]; break;
      case DType::i64: v.i = static_cast<int64_t*>(p)[idx]; break;
      case DType::i1: v.i = static_cast<uint8_t*>(p)[idx] != 0; break;
      default: break;
    }
    return v;
  }

  void write(int buffer, int64_t idx, Val v) {
    void* p = buffers_[static_cast<size_t>(buffer)];
    switch (k_.buffers[static_cast<size_t>(buffer)].dtype) {
      case DType::f32: static_cast<float*>(p)[idx] = static_cast<float>(v.f); break;
      case DType::f64: static_cast<double*>(p)[idx] = v.f; break;
      case DType::bf16: static_cast<uint16_t*>(p)[idx] = ir::floatToBf16(static_cast<float>(v.f)); break;
      case DType::i32: static_cast<int32_t*>(p)[idx] = static_cast<int32_t>(v.i); break;
      case DType::i64: static_cast<int64_t*>(p)[idx] = v.i; break;
      case DType::i1: static_cast<uint8_t*>(p)[idx] = v.i != 0; break;
      default: break;
    }
  }

  const std::string& error() const { return error_; }

 private:
  Val compute(const Expr& e) {
    Val v;
    switch (e.op) {
      case ExprOp::Const: v.f = e.fvalue; v.i = e.ivalue; return v;
      case ExprOp::Coord: v.i = coords[static_cast<size_t>(e.index)]; return v;
      case ExprOp::RowValue: return row_values[static_cast<size_t>(e.index)];
      case ExprOp::Load: return read(e.buffer, eval(e.a).i);
      case ExprOp::BagOf: {  // kiln_bag_of's binary search
        const int64_t p = eval(e.a).i;
        int64_t lo = 0, hi = e.ivalue - 1;
        while (lo < hi) {
          const int64_t mid = (lo + hi) / 2;
          if (read(e.buffer, mid + 1).i > p) hi = mid;
          else lo = mid + 1;
        }
        v.i = lo;
        return v;
      }
      case ExprOp::Select: return eval(e.a).i ? eval(e.b) : eval(e.c);
      case ExprOp::Cast: return cast(eval(e.a), g_.typeOf(e.a), e.type);
      default: break;
    }
    const Val a = eval(e.a);
    if (e.op == ExprOp::RoundBf16) {
      v.f = ir::bf16ToFloat(ir::floatToBf16(static_cast<float>(a.f)));
      return v;
    }
    // A function of scalar_fn.def, evaluated in its operands' type.
    const ir::ScalarFn fn = *scalarFnOf(e.op);
    const ir::ScalarFnInfo& info = ir::scalarFnInfo(fn);
    const Val b = info.arity == 2 ? eval(e.b) : Val{};
    const DType t = g_.typeOf(e.a);
    if (t == DType::f32 || t == DType::f64) {
      double r = t == DType::f32
                     ? ir::scalar::evaluate<float>(fn, static_cast<float>(a.f), static_cast<float>(b.f))
                     : ir::scalar::evaluate<double>(fn, a.f, b.f);
      if (info.isPredicate())
        v.i = r != 0;
      else
        v.f = r;
      return v;
    }
    v.i = ir::scalar::evaluate<int64_t>(fn, a.i, b.i);
    if (info.isPredicate())
      v.i = v.i != 0;
    else if (t == DType::i32)
      v.i = static_cast<int32_t>(v.i);
    return v;
  }

  static Val cast(Val x, DType from, DType to) {
    Val v;
    bool ff = ir::isFloat(from), tf = ir::isFloat(to);
    if (tf) v.f = ff ? (to == DType::f32 ? static_cast<float>(x.f) : x.f) : (to == DType::f32 ? static_cast<float>(x.i) : static_cast<double>(x.i));
    else if (to == DType::i1) v.i = ff ? x.f != 0 : x.i != 0;
    else v.i = ff ? static_cast<int64_t>(x.f) : x.i;
    if (to == DType::i32) v.i = static_cast<int32_t>(v.i);
    return v;
  }

  const Kernel& k_;
  const ExprGraph& g_;
  const std::vector<void*>& buffers_;
  std::vector<Val> vals_;
  std::vector<uint32_t> stamp_;
  uint32_t gen_ = 1;
  std::string error_;
};

void unflatten(int64_t flat, const std::vector<int64_t>& shape, std::vector<int64_t>& out, size_t at) {
  for (size_t j = shape.size(); j-- > 0;) {
    out[at + j] = flat % shape[j];
    flat /= shape[j];
  }
}

Status runPointwise(const Kernel& k, Evaluator& ev) {
  ev.coords.assign(k.space.size(), 0);
  for (int64_t i = 0, n = k.spaceSize(); i < n; ++i) {
    unflatten(i, k.space, ev.coords, 0);
    ev.next();
    for (const Store& s : k.stores) KILN_RETURN_IF_ERROR(ev.store(s));
    if (!ev.error().empty()) return Status::error(ev.error());
  }
  return Status::ok();
}

Status runRow(const Kernel& k, Evaluator& ev) {
  size_t outer = k.space.size();
  ev.coords.assign(outer + k.row_space.size(), 0);
  int64_t rows = k.rowSize();
  for (int64_t o = 0, n = k.spaceSize(); o < n; ++o) {
    unflatten(o, k.space, ev.coords, 0);
    ev.row_values.clear();
    ev.next();
    if (k.guard >= 0 && !ev.eval(k.guard).i) continue;
    for (const Phase& p : k.phases) {
      if (p.kind == Phase::Kind::Reduce) {
        bool f32 = k.exprs.typeOf(p.value) == DType::f32;
        double acc = ir::scalar::identity<double>(p.combiner);
        for (int64_t r = 0; r < rows; ++r) {
          unflatten(r, k.row_space, ev.coords, outer);
          ev.next();
          double x = ev.eval(p.value).f;
          acc = ir::scalar::combine<double>(p.combiner, acc, x);
          if (f32) acc = static_cast<float>(acc);
        }
        ev.row_values.push_back(Val{acc, 0});
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          unflatten(r, k.row_space, ev.coords, outer);
          ev.next();
          for (const Store& s : p.stores) KILN_RETURN_IF_ERROR(ev.store(s));
        }
      }
      if (!ev.error().empty()) return Status::error(ev.error());
    }
    ev.next();
    for (const Store& s : k.stores) KILN_RETURN_IF_ERROR(ev.store(s));
    if (!ev.error().empty()) return Status::error(ev.error());
  }
  return Status::ok();
}

// The CUDA kernel's order exactly (ColumnTile): per (slab, column), row group g folds rows
// g, g + groups, ... of the slab, then the groups meet as a tree, so the bits match the GPU's.
Status runColumnReduce(const Kernel& k, Evaluator& ev) {
  const ColumnTile t = columnTile(k);
  const Phase& p = k.phases[0];
  const bool f32 = k.exprs.typeOf(p.value) == DType::f32;
  const size_t outer = k.space.size();
  const std::vector<int64_t> kept(k.space.begin() + 1, k.space.end());
  const int64_t rows = k.rowSize();
  auto combine = [&](double a, double b) {
    const double c = ir::scalar::combine<double>(p.combiner, a, b);
    return f32 ? static_cast<double>(static_cast<float>(c)) : c;
  };
  std::vector<double> part(static_cast<size_t>(t.groups));
  ev.coords.assign(outer + k.row_space.size(), 0);
  for (int64_t s = 0; s < t.slabs; ++s)
    for (int64_t col = 0; col < t.columns; ++col) {
      ev.coords[0] = s;
      unflatten(col, kept, ev.coords, 1);
      const int64_t end = std::min(rows, (s + 1) * t.slab_rows);
      for (int g = 0; g < t.groups; ++g) {
        double acc = ir::scalar::identity<double>(p.combiner);
        for (int64_t r = s * t.slab_rows + g; r < end; r += t.groups) {
          unflatten(r, k.row_space, ev.coords, outer);
          ev.next();
          acc = combine(acc, ev.eval(p.value).f);
        }
        part[static_cast<size_t>(g)] = acc;
      }
      for (int half = t.groups / 2; half > 0; half /= 2)
        for (int g = 0; g < half; ++g)
          part[static_cast<size_t>(g)] = combine(part[static_cast<size_t>(g)], part[static_cast<size_t>(g + half)]);
      if (!ev.error().empty()) return Status::error(ev.error());
      ev.row_values = {Val{part[0], 0}};
      ev.next();
      for (const Store& st : k.stores) KILN_RETURN_IF_ERROR(ev.store(st));
      if (!ev.error().empty()) return Status::error(ev.error());
    }
  return Status::ok();
}

int64_t readId(const KernelBuffer& b, const void* p, int64_t i) {
  return b.dtype == DType::i32 ? static_cast<const int32_t*>(p)[i] : static_cast<const int64_t*>(p)[i];
}

float readFloat(const KernelBuffer& b, const void* p, int64_t i) {
  switch (b.dtype) {
    case DType::bf16: return ir::bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::f64: return static_cast<float>(static_cast<const double*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Records {code, the table's group-wide flag_index}; the first error wins.
void setError(const Kernel& k, const std::vector<void*>& bufs, const EmbeddingTable& t, int code = 1) {
  int32_t* flag = static_cast<int32_t*>(bufs[static_cast<size_t>(k.error_flag)]);
  if (flag[0] == 0) {
    flag[0] = code;
    flag[1] = t.flag_index;
  }
}

// The CUDA scan's result: offsets[b + 1] = min(offsets[b] + max(lengths[b], 0), n), and the
// error {2, table} for a negative length or a total above n (the ids buffer's size).
Status runBagOffsets(const Kernel& k, const std::vector<void*>& bufs) {
  for (size_t ti = 0; ti < k.tables.size(); ++ti) {
    const EmbeddingTable& t = k.tables[ti];
    const KernelBuffer& lb = k.buffers[static_cast<size_t>(t.lengths)];
    const void* lengths = bufs[static_cast<size_t>(t.lengths)];
    auto* offsets = static_cast<int64_t*>(bufs[static_cast<size_t>(t.offsets)]);
    int64_t total = 0;
    bool bad = false;
    offsets[0] = 0;
    for (int64_t b = 0; b < k.batch; ++b) {
      int64_t len = readId(lb, lengths, b);
      if (len < 0) {
        bad = true;
        len = 0;
      }
      total += len;
      offsets[b + 1] = std::min(total, t.num_ids);
    }
    if (bad || total > t.num_ids) setError(k, bufs, t, 2);
  }
  return Status::ok();
}

// Pooled lookups, bag by bag.
Status runEmbedding(const Kernel& k, const std::vector<void*>& bufs) {
  for (size_t ti = 0; ti < k.tables.size(); ++ti) {
    const EmbeddingTable& t = k.tables[ti];
    const KernelBuffer& idb = k.buffers[static_cast<size_t>(t.ids)];
    const void* ids = bufs[static_cast<size_t>(t.ids)];
    const void* wts = t.weights >= 0 ? bufs[static_cast<size_t>(t.weights)] : nullptr;
    const KernelBuffer* wb = t.weights >= 0 ? &k.buffers[static_cast<size_t>(t.weights)] : nullptr;
    const KernelBuffer& ob = k.buffers[static_cast<size_t>(t.out)];
    void* out = bufs[static_cast<size_t>(t.out)];
    const auto* offsets = t.jagged() ? static_cast<const int64_t*>(bufs[static_cast<size_t>(t.offsets)]) : nullptr;
    std::vector<float> acc(static_cast<size_t>(t.dim));
    for (int64_t b = 0; b < k.batch; ++b) {
      // Bag b is ids [lo, hi): from the scanned offsets, or b*H + [0, H).
      const int64_t lo = offsets ? offsets[b] : b * t.hotness;
      const int64_t hi = offsets ? offsets[b + 1] : lo + t.hotness;
      const float scale = t.mean && hi > lo ? 1.0f / static_cast<float>(hi - lo) : 1.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      const KernelBuffer& tb = k.buffers[static_cast<size_t>(t.weight)];
      const void* table = bufs[static_cast<size_t>(t.weight)];
      for (int64_t p = lo; p < hi; ++p) {
        int64_t id = readId(idb, ids, p);
        if (id < 0 || id >= t.rows) {
          setError(k, bufs, t);
          continue;
        }
        float w = wts ? readFloat(*wb, wts, p) : 1.0f;
        for (int64_t d = 0; d < t.dim; ++d) acc[static_cast<size_t>(d)] += w * readFloat(tb, table, id * t.dim + d);
      }
      for (int64_t d = 0; d < t.dim; ++d) {
        int64_t at = b * t.out_stride + t.out_offset + d;
        float v = acc[static_cast<size_t>(d)] * scale;
        if (ob.dtype == DType::bf16) static_cast<uint16_t*>(out)[at] = ir::floatToBf16(v);
        else if (ob.dtype == DType::f64) static_cast<double*>(out)[at] = v;
        else static_cast<float*>(out)[at] = v;
      }
    }
  }
  return Status::ok();
}

}  // namespace

Status interpret(const Kernel& k, const std::vector<void*>& buffers) {
  if (buffers.size() != k.buffers.size())
    return Status::errorf("kernel '{}' takes {} buffers, got {}", k.name, k.buffers.size(), buffers.size());
  KILN_RETURN_IF_ERROR(validate(k));
  Evaluator ev(k, buffers);
  switch (k.kind) {
    case KernelKind::Pointwise: return runPointwise(k, ev);
    case KernelKind::Row: return runRow(k, ev);
    case KernelKind::ColumnReduce: return runColumnReduce(k, ev);
    case KernelKind::EmbeddingForward: return runEmbedding(k, buffers);
    case KernelKind::BagOffsets: return runBagOffsets(k, buffers);
    case KernelKind::Source:
      return Status::errorf(
          "kernel '{}' is CUDA source written by its emitter: the interpreter cannot run it "
          "(simt or a GPU does)",
          k.name);
  }
  return Status::ok();
}

Status interpretGroup(const LoweredGroup& g, const std::vector<void*>& group_buffers) {
  if (group_buffers.size() != g.buffers.size())
    return Status::errorf("the group has {} buffers, got {}", g.buffers.size(), group_buffers.size());
  for (size_t i = 0; i < g.kernels.size(); ++i) {
    const Kernel& k = g.kernels[i];
    std::vector<void*> args;
    for (int b : g.args[i]) args.push_back(group_buffers[static_cast<size_t>(b)]);
    if (k.error_flag >= 0) std::memset(args[static_cast<size_t>(k.error_flag)], 0, 2 * sizeof(int32_t));
    KILN_RETURN_IF_ERROR(interpret(k, args));
    if (k.error_flag >= 0) {
      const auto* flag = static_cast<const int32_t*>(args[static_cast<size_t>(k.error_flag)]);
      if (flag[0]) {
        // The flag's table is numbered across the group, whichever kernel set it.
        if (flag[1] < 0 || static_cast<size_t>(flag[1]) >= g.error_subjects.size())
          return Status::errorf("kernel '{}' set error {} naming table {}, which the group does not have", k.name,
                                flag[0], flag[1]);
        const ErrorSubject& e = g.error_subjects[static_cast<size_t>(flag[1])];
        if (flag[0] == 2)
          return Status::errorf("jagged bags '{}': a length is negative or the lengths add up to more than the {} ids",
                                e.name, e.bound);
        return Status::errorf("embedding table '{}': an id is out of range [0, {})", e.name, e.bound);
      }
    }
  }
  return Status::ok();
}

}  // namespace kiln::codegen
