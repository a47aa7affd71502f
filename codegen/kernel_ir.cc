#include "codegen/kernel_ir.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "ir/target.h"

namespace kiln::codegen {

int defaultGridSms() {
  static const int sms = h200Target().cores;
  return sms;
}

int gridSms(const Target& target) { return target.kind == TargetKind::gpu ? target.cores : defaultGridSms(); }

int64_t waveBlocks(int sms, int block) {
  // Registers and shared memory are the kernel's (ptxas's); threads and the block cap are the
  // same on every target, so any target's rules give them.
  static const Target gpu = h200Target();
  return int64_t{sms} * blocksPerSm(gpu, block, 0, 0).blocks;
}

const char* exprOpName(ExprOp op) {
  if (auto fn = scalarFnOf(op)) return ir::scalarFnInfo(*fn).spelling.data();
  switch (op) {
    case ExprOp::Const: return "const";
    case ExprOp::Coord: return "coord";
    case ExprOp::RowValue: return "row_value";
    case ExprOp::Load: return "load";
    case ExprOp::BagOf:
      return "bag_of";
    case ExprOp::RoundBf16:
      return "round_bf16";
    case ExprOp::Select: return "select";
    case ExprOp::Cast: return "cast";
    default:
      return "?";
  }
}

bool isUnary(ExprOp op) {
  auto fn = scalarFnOf(op);
  return op == ExprOp::RoundBf16 || (fn && ir::arityOf(*fn) == 1);
}
bool isBinary(ExprOp op) {
  auto fn = scalarFnOf(op);
  return fn && ir::arityOf(*fn) == 2;
}
bool isComparison(ExprOp op) {
  auto fn = scalarFnOf(op);
  return fn && ir::scalarFnInfo(*fn).isPredicate() && ir::scalarFnInfo(*fn).arity == 2;
}

const char* kernelKindName(KernelKind k) {
  switch (k) {
    case KernelKind::Pointwise: return "pointwise";
    case KernelKind::Row: return "row";
    case KernelKind::ColumnReduce: return "column_reduce";
    case KernelKind::EmbeddingForward: return "embedding_forward";
    case KernelKind::BagOffsets: return "bag_offsets";
    case KernelKind::Source:
      return "source";
  }
  return "?";
}

DType computeType(DType t) {
  switch (t) {
    case DType::f32:
    case DType::bf16:
    case DType::f16:
    case DType::f8e4m3:
    case DType::f8e5m2: return DType::f32;
    default: return t;
  }
}

namespace {

uint64_t hashExpr(const Expr& e) {
  uint64_t fbits;
  std::memcpy(&fbits, &e.fvalue, 8);
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(static_cast<uint64_t>(e.op));
  mix(static_cast<uint64_t>(e.type));
  mix(static_cast<uint64_t>(static_cast<int64_t>(e.a)));
  mix(static_cast<uint64_t>(static_cast<int64_t>(e.b)));
  mix(static_cast<uint64_t>(static_cast<int64_t>(e.c)));
  mix(static_cast<uint64_t>(static_cast<int64_t>(e.buffer)));
  mix(static_cast<uint64_t>(static_cast<int64_t>(e.index)));
  mix(static_cast<uint64_t>(e.ivalue));
  mix(fbits);
  return h;
}

}  // namespace

int ExprGraph::add(const Expr& e) {
  if (buckets_.empty()) buckets_.resize(256);
  uint64_t h = hashExpr(e);
  auto& bucket = buckets_[h % buckets_.size()];
  for (int id : bucket)
    if (nodes_[static_cast<size_t>(id)] == e) return id;
  nodes_.push_back(e);
  int id = static_cast<int>(nodes_.size() - 1);
  bucket.push_back(id);
  if (nodes_.size() > buckets_.size() * 4) {  // keep buckets short
    std::vector<std::vector<int>> bigger(buckets_.size() * 4);
    for (size_t i = 0; i < nodes_.size(); ++i)
      bigger[hashExpr(nodes_[i]) % bigger.size()].push_back(static_cast<int>(i));
    buckets_ = std::move(bigger);
  }
  return id;
}

int ExprGraph::constant(double v, DType t) {
  Expr e;
  e.op = ExprOp::Const;
  e.type = computeType(t);
  if (ir::isFloat(e.type))
    e.fvalue = e.type == DType::f32 ? static_cast<double>(static_cast<float>(v)) : v;
  else
    e.ivalue = static_cast<int64_t>(v);
  return add(e);
}

int ExprGraph::intConstant(int64_t v, DType t) {
  Expr e;
  e.op = ExprOp::Const;
  e.type = t;
  e.ivalue = v;
  return add(e);
}

int ExprGraph::coord(int axis) {
  Expr e;
  e.op = ExprOp::Coord;
  e.type = DType::i64;
  e.index = axis;
  return add(e);
}

int ExprGraph::rowValue(int phase, DType t) {
  Expr e;
  e.op = ExprOp::RowValue;
  e.type = t;
  e.index = phase;
  return add(e);
}

int ExprGraph::load(int buffer, DType storage, int offset) {
  assert(typeOf(offset) == DType::i64);
  Expr e;
  e.op = ExprOp::Load;
  e.type = computeType(storage);
  e.buffer = buffer;
  e.a = offset;
  return add(e);
}

int ExprGraph::bagOf(int offsets_buffer, int64_t batch, int position) {
  assert(typeOf(position) == DType::i64);
  Expr e;
  e.op = ExprOp::BagOf;
  e.type = DType::i64;
  e.buffer = offsets_buffer;
  e.a = position;
  e.ivalue = batch;
  return add(e);
}

int ExprGraph::unary(ExprOp op, int x) {
  assert(isUnary(op));
  Expr e;
  e.op = op;
  e.type = typeOf(x);
  e.a = x;
  return add(e);
}

int ExprGraph::binary(ExprOp op, int x, int y) {
  assert(isBinary(op) && typeOf(x) == typeOf(y));
  // Fold the index arithmetic of static shapes: x*1, x+0, x/1 and constant pairs.
  const Expr& ex = (*this)[x];
  const Expr& ey = (*this)[y];
  if (typeOf(x) == DType::i64 && !isComparison(op)) {
    if (ex.op == ExprOp::Const && ey.op == ExprOp::Const) {
      const bool folds = op == ExprOp::Add || op == ExprOp::Sub || op == ExprOp::Mul ||
                         ((op == ExprOp::Div || op == ExprOp::Rem) && ey.ivalue != 0);
      if (folds) return intConstant(ir::scalar::evaluate<int64_t>(*scalarFnOf(op), ex.ivalue, ey.ivalue));
    }
    if (ey.op == ExprOp::Const) {
      if ((op == ExprOp::Add || op == ExprOp::Sub) && ey.ivalue == 0) return x;
      if ((op == ExprOp::Mul || op == ExprOp::Div) && ey.ivalue == 1) return x;
      if (op == ExprOp::Mul && ey.ivalue == 0) return y;
      if (op == ExprOp::Rem && ey.ivalue == 1) return intConstant(0);
    }
    if (ex.op == ExprOp::Const) {
      if (op == ExprOp::Add && ex.ivalue == 0) return y;
      if (op == ExprOp::Mul && ex.ivalue == 1) return y;
      if (op == ExprOp::Mul && ex.ivalue == 0) return x;
    }
  }
  Expr e;
  e.op = op;
  e.type = isComparison(op) ? DType::i1 : typeOf(x);
  e.a = x;
  e.b = y;
  return add(e);
}

int ExprGraph::select(int cond, int x, int y) {
  assert(typeOf(cond) == DType::i1 && typeOf(x) == typeOf(y));
  if (x == y) return x;
  Expr e;
  e.op = ExprOp::Select;
  e.type = typeOf(x);
  e.a = cond;
  e.b = x;
  e.c = y;
  return add(e);
}

int ExprGraph::cast(int x, DType to) {
  DType t = computeType(to);
  if (typeOf(x) == t) return x;
  Expr e;
  e.op = ExprOp::Cast;
  e.type = t;
  e.a = x;
  return add(e);
}

int Kernel::addBuffer(std::string n, DType dtype, int64_t elements, bool written) {
  buffers.push_back({std::move(n), dtype, elements, written});
  return static_cast<int>(buffers.size() - 1);
}

int64_t Kernel::spaceSize() const {
  int64_t n = 1;
  for (int64_t d : space) n *= d;
  return n;
}

int64_t Kernel::rowSize() const {
  int64_t n = 1;
  for (int64_t d : row_space) n *= d;
  return n;
}

ColumnTile columnTile(const Kernel& k) {
  ColumnTile t;
  t.slabs = k.space.empty() ? 1 : k.space[0];
  t.columns = t.slabs > 0 ? k.spaceSize() / t.slabs : 0;
  while (t.lanes < 32 && t.lanes < t.columns) t.lanes *= 2;
  t.groups = ColumnTile::kThreads / t.lanes;
  t.strips = (t.columns + t.lanes - 1) / t.lanes;
  const int64_t rows = k.rowSize();
  t.slab_rows = std::max<int64_t>(1, (rows + t.slabs - 1) / std::max<int64_t>(t.slabs, 1));
  return t;
}

int rowMajorOffset(ExprGraph& g, const std::vector<int>& coords, const std::vector<int64_t>& shape) {
  assert(coords.size() == shape.size());
  int off = g.intConstant(0);
  for (size_t i = 0; i < shape.size(); ++i)
    off = g.binary(ExprOp::Add, g.binary(ExprOp::Mul, off, g.intConstant(shape[i])), coords[i]);
  return off;
}

namespace {

bool isComputeType(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::i32 || t == DType::i64 || t == DType::i1;
}

// Checks the nodes reachable from `roots` may be evaluated where only `coords` coordinates
// and `row_values` row values exist.
Status checkScope(const Kernel& k, const std::vector<int>& roots, int coords, int row_values,
                  const char* where) {
  std::vector<int> stack(roots.begin(), roots.end());
  std::vector<bool> seen(k.exprs.size(), false);
  while (!stack.empty()) {
    int id = stack.back();
    stack.pop_back();
    if (id < 0) continue;
    if (static_cast<size_t>(id) >= k.exprs.size())
      return Status::errorf("kernel '{}': {} refers to missing node {}", k.name, where, id);
    if (seen[static_cast<size_t>(id)]) continue;
    seen[static_cast<size_t>(id)] = true;
    const Expr& e = k.exprs[id];
    if (e.op == ExprOp::Coord && e.index >= coords)
      return Status::errorf("kernel '{}': {} uses coordinate {} outside its scope", k.name, where, e.index);
    if (e.op == ExprOp::RowValue && e.index >= row_values)
      return Status::errorf("kernel '{}': {} uses row value {} before it is computed", k.name, where, e.index);
    for (int o : {e.a, e.b, e.c}) stack.push_back(o);
  }
  return Status::ok();
}

Status checkStores(const Kernel& k, const std::vector<Store>& stores, int coords, int row_values,
                   const char* where) {
  for (const Store& s : stores) {
    if (s.buffer < 0 || static_cast<size_t>(s.buffer) >= k.buffers.size() || !k.buffers[static_cast<size_t>(s.buffer)].written)
      return Status::errorf("kernel '{}': {} stores to buffer {} that is not an output", k.name, where, s.buffer);
    if (k.exprs.typeOf(s.index) != DType::i64)
      return Status::errorf("kernel '{}': {} store index is not i64", k.name, where);
    if (k.exprs.typeOf(s.value) != computeType(k.buffers[static_cast<size_t>(s.buffer)].dtype))
      return Status::errorf("kernel '{}': {} stores {} into a {} buffer", k.name, where,
                            ir::dtypeName(k.exprs.typeOf(s.value)), ir::dtypeName(k.buffers[static_cast<size_t>(s.buffer)].dtype));
    if (s.accumulate && k.buffers[static_cast<size_t>(s.buffer)].dtype == DType::i1)
      return Status::errorf("kernel '{}': {} accumulates into an i1 buffer", k.name, where);
    if (s.guard >= 0 && k.exprs.typeOf(s.guard) != DType::i1)
      return Status::errorf("kernel '{}': {} store guard is not i1", k.name, where);
    KILN_RETURN_IF_ERROR(checkScope(k, {s.index, s.value, s.guard}, coords, row_values, where));
  }
  return Status::ok();
}

}  // namespace

Status validate(const Kernel& k) {
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[static_cast<int>(i)];
    if (!isComputeType(e.type))
      return Status::errorf("kernel '{}': node {} has storage type {}", k.name, i, ir::dtypeName(e.type));
    for (int o : {e.a, e.b, e.c})
      if (o >= static_cast<int>(i))
        return Status::errorf("kernel '{}': node {} uses a later node {}", k.name, i, o);
    if (e.op == ExprOp::Load && (e.buffer < 0 || static_cast<size_t>(e.buffer) >= k.buffers.size()))
      return Status::errorf("kernel '{}': node {} loads from missing buffer {}", k.name, i, e.buffer);
    if (e.op == ExprOp::BagOf &&
        (e.buffer < 0 || static_cast<size_t>(e.buffer) >= k.buffers.size() ||
         k.buffers[static_cast<size_t>(e.buffer)].dtype != DType::i64 || e.ivalue < 1 ||
         k.buffers[static_cast<size_t>(e.buffer)].elements < e.ivalue + 1 || e.a < 0 ||
         k.exprs.typeOf(e.a) != DType::i64))
      return Status::errorf("kernel '{}': node {} needs i64 offsets of at least one bag and an i64 position", k.name, i);
  }
  if (k.error_flag >= 0 && (static_cast<size_t>(k.error_flag) >= k.buffers.size() ||
                            k.buffers[static_cast<size_t>(k.error_flag)].dtype != DType::i32 ||
                            !k.buffers[static_cast<size_t>(k.error_flag)].written))
    return Status::errorf("kernel '{}': the error flag must be a written i32 buffer", k.name);
  for (const EmbeddingTable& t : k.tables)
    if (t.flag_index < 0 && k.kind != KernelKind::Pointwise && k.kind != KernelKind::Row)
      return Status::errorf("kernel '{}': a table has no error-flag index", k.name);
  int outer = static_cast<int>(k.space.size());
  switch (k.kind) {
    case KernelKind::Pointwise:
      return checkStores(k, k.stores, outer, 0, "pointwise");
    case KernelKind::Row: {
      int all = outer + static_cast<int>(k.row_space.size());
      if (k.guard >= 0) KILN_RETURN_IF_ERROR(checkScope(k, {k.guard}, outer, 0, "guard"));
      int reduces = 0;
      for (const Phase& p : k.phases) {
        if (p.kind == Phase::Kind::Reduce) {
          if (!ir::isFloat(k.exprs.typeOf(p.value)))
            return Status::errorf("kernel '{}': reduce phase folds a non-float value", k.name);
          KILN_RETURN_IF_ERROR(checkScope(k, {p.value}, all, reduces, "reduce phase"));
          ++reduces;
        } else {
          KILN_RETURN_IF_ERROR(checkStores(k, p.stores, all, reduces, "map phase"));
        }
      }
      return checkStores(k, k.stores, outer, reduces, "row epilogue");
    }
    case KernelKind::ColumnReduce: {
      if (k.space.empty() || k.space[0] < 1 || k.phases.size() != 1 ||
          k.phases[0].kind != Phase::Kind::Reduce || k.guard >= 0)
        return Status::errorf("kernel '{}': a column reduction needs a space of [slabs, ...] and one reduce phase",
                              k.name);
      const ColumnTile t = columnTile(k);
      if ((t.slabs - 1) * t.slab_rows >= k.rowSize())
        return Status::errorf("kernel '{}': {} slabs of {} rows leave the last one empty", k.name, t.slabs,
                              t.slab_rows);
      const int value = k.phases[0].value;
      if (!ir::isFloat(k.exprs.typeOf(value)))
        return Status::errorf("kernel '{}': reduce phase folds a non-float value", k.name);
      KILN_RETURN_IF_ERROR(
          checkScope(k, {value}, outer + static_cast<int>(k.row_space.size()), 0, "column reduce phase"));
      return checkStores(k, k.stores, outer, 1, "column epilogue");
    }
    case KernelKind::EmbeddingForward:
      for (const EmbeddingTable& t : k.tables) {
        for (int b : {t.weight, t.ids, t.out})
          if (b < 0 || static_cast<size_t>(b) >= k.buffers.size())
            return Status::errorf("kernel '{}': an embedding table lacks a buffer", k.name);
        if (t.jagged() && (static_cast<size_t>(t.offsets) >= k.buffers.size() ||
                           k.buffers[static_cast<size_t>(t.offsets)].dtype != DType::i64))
          return Status::errorf("kernel '{}': a jagged table needs i64 offsets", k.name);
      }
      if (k.error_flag < 0) return Status::errorf("kernel '{}': embedding kernels need an error flag", k.name);
      return Status::ok();
    case KernelKind::BagOffsets:
      for (const EmbeddingTable& t : k.tables) {
        if (t.lengths < 0 || static_cast<size_t>(t.lengths) >= k.buffers.size() || !t.jagged() ||
            static_cast<size_t>(t.offsets) >= k.buffers.size() ||
            k.buffers[static_cast<size_t>(t.offsets)].dtype != DType::i64 ||
            k.buffers[static_cast<size_t>(t.offsets)].elements < k.batch + 1)
          return Status::errorf("kernel '{}': a scan needs lengths and i64 offsets [batch + 1]", k.name);
      }
      if (k.error_flag < 0) return Status::errorf("kernel '{}': a bag-offsets scan needs an error flag", k.name);
      return Status::ok();
    case KernelKind::Source:
      if (k.source.empty()) return Status::errorf("kernel '{}': a source kernel has no body", k.name);
      if (k.grid < 1 || k.grid > (int64_t{1} << 31) - 1 || k.block < 32 || k.block > 1024 ||
          k.block % 32 != 0)
        return Status::errorf(
            "kernel '{}': launch <<<{}, {}>>> is out of range (block: 32..1024, whole warps)", k.name, k.grid,
            k.block);
      return Status::ok();
  }
  return Status::ok();
}

}  // namespace kiln::codegen
