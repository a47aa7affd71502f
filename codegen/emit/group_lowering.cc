#include "codegen/emit/group_lowering.h"

#include "codegen/emit/emitter_registry.h"
#include "ir/op_def.h"

namespace kiln::codegen::emit {

using ir::Op;
using ir::Value;

std::string opLabel(const Op& op) {
  std::string s = "'" + op.name() + "'";
  if (op.location().known()) s += " at " + op.location().str();
  return s;
}

std::string valueName(const Value* v) {
  if (!v->nameHint().empty()) return v->nameHint();
  if (Op* d = v->definingOp()) {
    if (d->hasAttr("name")) return d->strAttr("name");
    return d->name().substr(d->name().find('.') + 1) + "#" + std::to_string(v->index());
  }
  return "arg" + std::to_string(v->index());
}

std::string shortOpName(const Op& op) { return op.name().substr(op.name().find('.') + 1); }

int64_t product(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

int64_t nextPow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

KernelBuilder KernelBuilder::ofKind(std::string name, KernelKind kind) {
  KernelBuilder kb;
  kb.k.name = std::move(name);
  kb.k.kind = kind;
  return kb;
}

KernelBuilder KernelBuilder::pointwise(std::string name, std::vector<int64_t> space) {
  KernelBuilder kb = ofKind(std::move(name), KernelKind::Pointwise);
  kb.k.space = std::move(space);
  return kb;
}

KernelBuilder KernelBuilder::row(std::string name, std::vector<int64_t> space,
                                 std::vector<int64_t> row_space) {
  KernelBuilder kb = ofKind(std::move(name), KernelKind::Row);
  kb.k.space = space.empty() ? std::vector<int64_t>{1} : std::move(space);
  kb.k.row_space = std::move(row_space);
  return kb;
}

std::vector<int> KernelBuilder::spaceCoords() {
  std::vector<int> coords;
  for (size_t i = 0; i < k.space.size(); ++i) coords.push_back(k.exprs.coord(static_cast<int>(i)));
  return coords;
}

GroupLowering::GroupLowering(const std::vector<const Op*>& ops, const ir::SymbolBindings& symbols, int sms)
    : symbols_(symbols), sms_(sms), in_group_(ops.begin(), ops.end()) {
  out_.ops = ops;
}

void GroupLowering::setGemm(const Op& matmul, const GemmCall& call) {
  out_.gemm = &matmul;
  out_.gemm_call = call;
}

Expected<std::vector<int64_t>> GroupLowering::shapeOf(const Value* v) const {
  return concreteShape(v->type(), symbols_);
}

int GroupLowering::groupBuffer(const Value* inner, bool written) {
  const Value* v = outerValue(inner);
  bool defined = inner->definingOp() && in_group_.count(inner->definingOp());
  auto it = value_buffer_.find(v);
  if (it != value_buffer_.end()) {
    out_.buffers[static_cast<size_t>(it->second)].written |= written;
    out_.buffers[static_cast<size_t>(it->second)].defined |= defined;
    return it->second;
  }
  auto shape = shapeOf(v);
  GroupBuffer b{v, valueName(v), v->type().dtype(), shape ? product(*shape) : 0, written, defined};
  out_.buffers.push_back(b);
  int id = static_cast<int>(out_.buffers.size() - 1);
  value_buffer_[v] = id;
  return id;
}

int GroupLowering::tempBuffer(std::string name, DType dtype, int64_t elements) {
  out_.buffers.push_back({nullptr, std::move(name), dtype, elements, true});
  return static_cast<int>(out_.buffers.size() - 1);
}

int GroupLowering::addressTable(std::string name, std::vector<AddressWord> words) {
  GroupBuffer b{nullptr, std::move(name), DType::i64, static_cast<int64_t>(words.size()), false};
  b.words = std::move(words);
  out_.buffers.push_back(std::move(b));
  return static_cast<int>(out_.buffers.size() - 1);
}

int GroupLowering::bind(KernelBuilder& kb, int group_buffer, bool written) {
  auto it = kb.kernel_buffer.find(group_buffer);
  const GroupBuffer& gb = out_.buffers[static_cast<size_t>(group_buffer)];
  if (it != kb.kernel_buffer.end()) {
    kb.k.buffers[static_cast<size_t>(it->second)].written |= written;
    return it->second;
  }
  int id = kb.k.addBuffer(gb.name, gb.dtype, gb.elements, written);
  kb.kernel_buffer[group_buffer] = id;
  kb.args.push_back(group_buffer);
  return id;
}

Status GroupLowering::addSourceKernel(Kernel k, const std::vector<int>& group_buffers, const std::string& context) {
  if (group_buffers.size() != k.buffers.size())
    return Status::errorf("{}: kernel '{}' takes {} buffers, got {}", context, k.name, k.buffers.size(),
                          group_buffers.size());
  std::vector<KernelBuffer> declared = std::move(k.buffers);
  KernelBuilder kb = KernelBuilder::ofKind(k.name, KernelKind::Source);
  kb.k = std::move(k);
  kb.k.buffers.clear();
  for (size_t i = 0; i < declared.size(); ++i) {
    int id = bind(kb, group_buffers[i], declared[i].written);
    const KernelBuffer& got = kb.k.buffers[static_cast<size_t>(id)];
    if (id != static_cast<int>(i) || got.dtype != declared[i].dtype || got.elements < declared[i].elements)
      return Status::errorf("{}: buffer '{}' ({} x {}) does not fit kernel '{}' parameter b{} ({} x {})", context,
                            got.name, ir::dtypeName(got.dtype), got.elements, kb.k.name, i,
                            ir::dtypeName(declared[i].dtype), declared[i].elements);
  }
  return finish(kb);
}

Status GroupLowering::finish(KernelBuilder& kb) {
  KILN_RETURN_IF_ERROR(validate(kb.k));
  kb.k.sms = sms_;
  out_.kernels.push_back(std::move(kb.k));
  out_.args.push_back(std::move(kb.args));
  return Status::ok();
}

bool GroupLowering::computedInGroup(const Value* v) const {
  const Op* d = v->definingOp();
  return d && in_group_.count(d) && isPointwiseOp(*d);
}

Expected<int> GroupLowering::load(KernelBuilder& kb, const Value* v, int offset) {
  ExprGraph& g = kb.g();
  const Op* d = outerValue(v)->definingOp();
  if (d && d->is(ir::OpCode::Constant) && d->attr("value") && d->attr("value")->isNumber())
    return g.constant(d->attr("value")->asDouble(), v->type().dtype());
  DType t = v->type().dtype();
  if (t != DType::f32 && t != DType::bf16 && t != DType::f64 && t != DType::i32 && t != DType::i64 &&
      t != DType::i1)
    return Status::errorf("the CUDA backend does not support {} tensors ({})", ir::dtypeName(t),
                          v->type().str());
  return g.load(bindValue(kb, v, false), t, offset);
}

Expected<int> GroupLowering::valueAt(KernelBuilder& kb, const Value* v, const std::vector<int>& coords) {
  auto key = std::make_pair(v, coords);
  auto it = kb.memo.find(key);
  if (it != kb.memo.end()) return it->second;
  auto r = computeValueAt(kb, v, coords);
  if (r) kb.memo[key] = *r;
  return r;
}

Expected<int> GroupLowering::computeValueAt(KernelBuilder& kb, const Value* v,
                                            const std::vector<int>& coords) {
  KILN_ASSIGN_OR_RETURN(auto shape, shapeOf(v));
  if (!computedInGroup(v)) return load(kb, v, rowMajorOffset(kb.g(), coords, shape));
  const Op& op = *v->definingOp();
  const ExpressionRule* rule = EmitterRegistry::get().expressionFor(op);
  if (!rule) return Status::errorf("{} has no CUDA lowering", opLabel(op));
  return (*rule)(*this, kb, op, ExprSite{v, coords, shape});
}

Expected<int> GroupLowering::operandAt(KernelBuilder& kb, const Op& op, unsigned i,
                                       const std::vector<int>& coords) {
  const Value* x = op.operand(i);
  KILN_ASSIGN_OR_RETURN(auto xs, shapeOf(x));
  std::vector<int> c;
  size_t lead = coords.size() - xs.size();
  for (size_t j = 0; j < xs.size(); ++j) c.push_back((xs)[j] == 1 ? kb.g().intConstant(0) : coords[lead + j]);
  return valueAt(kb, x, c);
}

std::vector<const Value*> GroupLowering::liveOuts() const {
  std::vector<const Value*> outs;
  for (const Op* op : out_.ops)
    for (const Value* r : op->results()) {
      bool escapes = !r->hasUses();
      for (const ir::Use& u : r->uses())
        if (!in_group_.count(u.user)) escapes = true;
      if (escapes) outs.push_back(r);
    }
  return outs;
}

AxisRow GroupLowering::axisRow(Kernel& k, const std::vector<int64_t>& xs, int64_t axis) {
  AxisRow r;
  for (size_t i = 0; i < xs.size(); ++i)
    if (static_cast<int64_t>(i) != axis) k.space.push_back(xs[i]);
  k.row_space = {xs[static_cast<size_t>(axis)]};
  if (k.space.empty()) k.space = {1};
  int oi = 0;
  int row_coord = k.exprs.coord(static_cast<int>(k.space.size()));
  for (size_t i = 0; i < xs.size(); ++i)
    r.coords.push_back(static_cast<int64_t>(i) == axis ? row_coord : k.exprs.coord(oi++));
  for (size_t i = 0; i < k.space.size(); ++i) r.outer.push_back(k.exprs.coord(static_cast<int>(i)));
  return r;
}

int GroupLowering::expShiftedRow(Kernel& k, int v) {
  ExprGraph& g = k.exprs;
  const DType ct = g.typeOf(v);
  k.phases.push_back({Phase::Kind::Reduce, Combiner::Max, v, {}});
  int shifted = g.unary(ExprOp::Exp, g.binary(ExprOp::Sub, v, g.rowValue(0, ct)));
  k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, shifted, {}});
  return shifted;
}

Expected<BagIds> GroupLowering::bagIds(const Op& op, const Value* ids, const Value* lengths) {
  BagIds b;
  b.ids = ids;
  KILN_ASSIGN_OR_RETURN(auto is, shapeOf(ids));
  if (ids->type().rank() == 2) {
    b.batch = (is)[0];
    b.hotness = (is)[1];
    return b;
  }
  if (ids->type().rank() != 1 || !lengths)
    return Status::errorf("{}: ids must be [batch, hotness], or [N] with lengths [batch]", opLabel(op));
  KILN_ASSIGN_OR_RETURN(auto ls, shapeOf(lengths));
  b.lengths = lengths;
  b.batch = (ls)[0];
  b.num_ids = (is)[0];
  return b;
}

Expected<BagIds> GroupLowering::bagIdsOf(const Op& bag) {
  const bool flat = bag.operand(1)->type().rank() == 1;
  return bagIds(bag, bag.operand(1), flat && bag.numOperands() > 2 ? bag.operand(2) : nullptr);
}

const Value* GroupLowering::bagWeights(const Op& bag) {
  const unsigned at = bag.operand(1)->type().rank() == 1 ? 3 : 2;
  return bag.numOperands() > at ? bag.operand(at) : nullptr;
}

Status GroupLowering::scanLengths(const std::vector<BagIds>& bags) {
  const int64_t batch = bags.empty() ? 0 : bags.front().batch;
  KernelBuilder kb = KernelBuilder::ofKind("bag_offsets", KernelKind::BagOffsets);
  auto flush = [&]() -> Status {
    if (kb.k.tables.empty()) return Status::ok();
    kb.k.error_flag = bind(kb, errorFlag(), true);
    KILN_RETURN_IF_ERROR(finish(kb));
    kb = KernelBuilder::ofKind("bag_offsets", KernelKind::BagOffsets);
    return Status::ok();
  };
  for (const BagIds& b : bags) {
    if (!b.lengths || offsets_of_.count(b.lengths)) continue;
    if (b.batch != batch)
      return Status::errorf("jagged bags of one group must share the batch ({} vs {})", b.batch, batch);
    // A table adds its lengths and offsets; the error flag comes last.
    if (kb.k.buffers.size() + 3 > kMaxKernelParams) KILN_RETURN_IF_ERROR(flush());
    kb.k.batch = b.batch;
    int offsets = tempBuffer(valueName(b.lengths) + ".offsets", DType::i64, b.batch + 1);
    offsets_of_[b.lengths] = offsets;
    EmbeddingTable t;
    t.lengths = bindValue(kb, b.lengths, false);
    t.offsets = bind(kb, offsets, true);
    t.num_ids = b.num_ids;
    t.flag_index = errorSubject(valueName(b.lengths), b.num_ids);
    kb.k.tables.push_back(t);
  }
  return flush();
}

void GroupLowering::bindIds(KernelBuilder& kb, EmbeddingTable& t, const BagIds& b) {
  t.ids = bindValue(kb, b.ids, false);
  t.hotness = b.hotness;
  if (b.lengths) {
    t.offsets = bind(kb, offsets_of_.at(b.lengths), false);
    t.num_ids = b.num_ids;
  }
}

int GroupLowering::errorFlag() {
  if (error_flag_ < 0) error_flag_ = tempBuffer("embedding_errors", DType::i32, 2);
  return error_flag_;
}

int GroupLowering::errorSubject(std::string name, int64_t bound) {
  out_.error_subjects.push_back({std::move(name), bound, static_cast<int>(out_.kernels.size())});
  return static_cast<int>(out_.error_subjects.size() - 1);
}

}  // namespace kiln::codegen::emit

namespace kiln::codegen {

std::vector<int64_t> addressTableWords(const GroupBuffer& table, const std::vector<uint64_t>& address) {
  std::vector<int64_t> words;
  for (const AddressWord& w : table.words)
    words.push_back(w.buffer >= 0 ? static_cast<int64_t>(address[static_cast<size_t>(w.buffer)] +
                                                         static_cast<uint64_t>(w.value))
                                  : w.value);
  return words;
}

}  // namespace kiln::codegen
