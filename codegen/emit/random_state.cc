// The emitter of counter-based random numbers, hashed id crosses and running state
// (ir/ops/random.cc, ir/ops/running_state.cc). The kernels compute the very numbers of the CPU
// references: the same splitmix64 hashing (the kernel functions HashMix and CounterBits of
// ir/scalar_fn.def) over the same counters.
//   - kiln.dropout, kiln.hash_cross, kiln.running_stat and kiln.log_frequency are expression
//     rules: computed inline in the Pointwise kernel of their group;
//   - kiln.running_stat_update is one Pointwise kernel over the running statistic, in place;
//   - kiln.frequency_update is one Row kernel over the batch's ids: id i counts the ids of its
//     state row (and those before it), and the first of them writes the row, so the update is
//     the CPU reference's whatever the ids' order and no two threads write one row.
#include "codegen/emit/emitter_registry.h"
#include "ir/op_def.h"
#include "ir/random.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

int i64(ExprGraph& g, int x) { return g.cast(x, DType::i64); }

// The coordinates of linear position `flat` of a row-major shape.
std::vector<int> coordsOf(ExprGraph& g, int flat, const std::vector<int64_t>& shape) {
  std::vector<int> c(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const int extent = g.intConstant(shape[d]);
    c[d] = g.binary(ExprOp::Rem, flat, extent);
    flat = g.binary(ExprOp::Div, flat, extent);
  }
  return c;
}

// (x mod n) in [0, n), for any sign of x: the CPU references' stateRow and crossBucket.
int floorMod(ExprGraph& g, int x, int64_t n) {
  const int m = g.intConstant(n);
  return g.binary(ExprOp::Rem, g.binary(ExprOp::Add, g.binary(ExprOp::Rem, x, m), m), m);
}

// Inverted dropout: element i is kept when uniformAt(randomStream(seed, step, salt), i) >= p.
Expected<int> dropoutAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  KILN_ASSIGN_OR_RETURN(int x, gl.operandAt(kb, op, 0, at.coords));
  const double p = op.floatAttr("p", 0.0);
  if (!op.boolAttr("training", false) || p == 0) return x;
  ExprGraph& g = kb.g();
  KILN_ASSIGN_OR_RETURN(int step, gl.valueAt(kb, op.operand(1), {}));
  const uint64_t seeded = ir::splitMix64(static_cast<uint64_t>(op.intAttr("seed", 0)));
  int stream = g.binary(ExprOp::HashMix, g.intConstant(static_cast<int64_t>(seeded)), i64(g, step));
  stream = g.binary(ExprOp::HashMix, stream, g.intConstant(op.intAttr("salt", 0)));
  const int bits = g.binary(ExprOp::CounterBits, stream, rowMajorOffset(g, at.coords, at.shape));
  const int u = g.binary(ExprOp::Mul, g.cast(bits, DType::f64), g.constant(0x1.0p-53, DType::f64));
  const int keep = g.binary(ExprOp::Ge, u, g.constant(p, DType::f64));
  const DType ct = g.typeOf(x);
  return g.select(keep, g.binary(ExprOp::Mul, x, g.constant(1.0 / (1.0 - p), ct)), g.constant(0, ct));
}

Expected<int> hashCrossAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  int h = g.intConstant(static_cast<int64_t>(ir::hashCrossStart(op.intAttr("salt", 0))));
  for (unsigned j = 0; j < op.numOperands(); ++j) {
    KILN_ASSIGN_OR_RETURN(int id, gl.operandAt(kb, op, j, at.coords));
    h = g.binary(ExprOp::HashMix, h, i64(g, id));
  }
  return floorMod(g, h, op.intAttr("buckets"));
}

Expected<int> runningStatAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  return gl.operandAt(kb, op, op.boolAttr("training", false) ? 0 : 1, at.coords);
}

// -log(period) of the id's state row, the prior's for a row never seen.
Expected<int> logFrequencyAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  KILN_ASSIGN_OR_RETURN(auto ss, gl.shapeOf(op.operand(1)));
  KILN_ASSIGN_OR_RETURN(int id, gl.operandAt(kb, op, 0, at.coords));
  const int row = floorMod(g, i64(g, id), ss[0]);
  KILN_ASSIGN_OR_RETURN(int period, gl.valueAt(kb, op.operand(1), {row, g.intConstant(1)}));
  const int zero = g.constant(0, DType::f32);
  const int p = g.select(g.binary(ExprOp::Gt, period, zero), period,
                         g.constant(op.floatAttr("prior", 1.0), DType::f32));
  return g.unary(ExprOp::Neg, g.unary(ExprOp::Log, p));
}

Status lowerRunningStatUpdate(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* running = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto rs, gl.shapeOf(running));
  KernelBuilder kb = KernelBuilder::pointwise("running_stat_update", {product(rs)});
  ExprGraph& g = kb.g();
  const DType dt = running->type().dtype(), ct = computeType(dt);
  const int i = g.coord(0);
  const int buf = gl.bindValue(kb, running, true);
  const int r = g.load(buf, dt, i);
  const int b = g.cast(g.load(gl.bindValue(kb, op.operand(1), false), op.operand(1)->type().dtype(), i), ct);
  const double m = op.floatAttr("momentum", 0.1);
  const int keep = g.binary(ExprOp::Sub, g.constant(1, ct), g.constant(m, ct));
  const int v =
      g.binary(ExprOp::Add, g.binary(ExprOp::Mul, keep, r), g.binary(ExprOp::Mul, g.constant(m, ct), b));
  kb.k.stores.push_back({buf, i, g.cast(v, dt), -1});
  return gl.finish(kb);
}

// Thread i (the outer coordinate) sums over all ids j (the row): how many share its state row,
// and how many of those come before it. The first id of a row (none before) updates the row.
Status lowerFrequencyUpdate(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* state = op.operand(0);
  const Value* ids = op.operand(1);
  KILN_ASSIGN_OR_RETURN(auto ss, gl.shapeOf(state));
  KILN_ASSIGN_OR_RETURN(auto is, gl.shapeOf(ids));
  const int64_t n = product(is), rows = ss[0];
  KernelBuilder kb = KernelBuilder::row("frequency_update", {n}, {n});
  ExprGraph& g = kb.g();
  const int i = g.coord(0), j = g.coord(1);
  KILN_ASSIGN_OR_RETURN(int id_i, gl.valueAt(kb, ids, coordsOf(g, i, is)));
  KILN_ASSIGN_OR_RETURN(int id_j, gl.valueAt(kb, ids, coordsOf(g, j, is)));
  const int row = floorMod(g, i64(g, id_i), rows);
  const int same = g.binary(ExprOp::Eq, floorMod(g, i64(g, id_j), rows), row);
  const int one = g.constant(1, DType::f32), zero = g.constant(0, DType::f32);
  kb.k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.select(same, one, zero), {}});
  const int before = g.binary(ExprOp::And, same, g.binary(ExprOp::Lt, j, i));
  kb.k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.select(before, one, zero), {}});
  const int count = g.rowValue(0, DType::f32);
  const int first = g.binary(ExprOp::Eq, g.rowValue(1, DType::f32), zero);
  // In f64, as the CPU reference computes it.
  const int buf = gl.bindValue(kb, state, true);
  const int at_last = g.binary(ExprOp::Mul, row, g.intConstant(2));
  const int at_period = g.binary(ExprOp::Add, at_last, g.intConstant(1));
  KILN_ASSIGN_OR_RETURN(int step, gl.valueAt(kb, op.operand(2), {}));
  const int t = g.cast(step, DType::f64);
  const int last = g.cast(g.load(buf, DType::f32, at_last), DType::f64);
  const int period = g.cast(g.load(buf, DType::f32, at_period), DType::f64);
  const int gap = g.binary(ExprOp::Div, g.binary(ExprOp::Sub, t, last), g.cast(count, DType::f64));
  const double alpha = op.floatAttr("alpha", 0.01);
  const int smoothed = g.binary(ExprOp::Add, g.binary(ExprOp::Mul, g.constant(1 - alpha, DType::f64), period),
                                g.binary(ExprOp::Mul, g.constant(alpha, DType::f64), gap));
  const int seen = g.binary(ExprOp::Gt, period, g.constant(0, DType::f64));
  kb.k.stores.push_back({buf, at_period, g.cast(g.select(seen, smoothed, gap), DType::f32), first});
  kb.k.stores.push_back({buf, at_last, g.cast(t, DType::f32), first});
  return gl.finish(kb);
}

}  // namespace

void registerRandomStateEmitters(EmitterRegistry& r) {
  r.addExpression(ir::OpCode::Dropout, dropoutAt);
  r.addExpression(ir::OpCode::HashCross, hashCrossAt);
  r.addExpression(ir::OpCode::RunningStat, runningStatAt);
  r.addExpression(ir::OpCode::LogFrequency, logFrequencyAt);
  r.addOpEmitter(ir::OpCode::RunningStatUpdate, {"random_state", lowerRunningStatUpdate});
  r.addOpEmitter(ir::OpCode::FrequencyUpdate, {"random_state", lowerFrequencyUpdate});
}

}  // namespace kiln::codegen::emit
