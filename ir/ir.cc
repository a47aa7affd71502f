#include "ir/ir.h"

#include <algorithm>
#include <unordered_map>

#include "ir/op_def.h"

namespace kiln::ir {

// ---- Value ------------------------------------------------------------------------------------

Block* Value::parentBlock() const { return def_ ? def_->parentBlock() : block_; }

void Value::replaceAllUsesWith(Value* other) {
  assert(other != this);
  // setOperand edits uses_, so iterate over a copy.
  std::vector<Use> uses = uses_;
  for (const Use& u : uses) u.user->setOperand(u.operand_index, other);
}

// ---- Region -----------------------------------------------------------------------------------

Block& Region::addBlock() {
  blocks_.push_back(std::make_unique<Block>(this));
  return *blocks_.back();
}

Function* Region::parentFunction() const {
  if (parent_func_) return parent_func_;
  return parent_op_ ? parent_op_->parentFunction() : nullptr;
}

// ---- Op ---------------------------------------------------------------------------------------

std::unique_ptr<Op> Op::create(std::string name, const std::vector<Value*>& operands,
                               const std::vector<TensorType>& result_types, AttrDict attrs,
                               Location loc) {
  std::unique_ptr<Op> op(new Op());
  op->def_ = OpRegistry::get().lookup(name);
  op->code_ = op->def_ ? op->def_->opcode : OpCode::Unknown;
  op->name_ = std::move(name);
  op->loc_ = std::move(loc);
  op->attrs_ = std::move(attrs);
  for (Value* v : operands) op->addOperand(v);
  for (size_t i = 0; i < result_types.size(); ++i)
    op->results_.push_back(
        std::unique_ptr<Value>(new Value(result_types[i], op.get(), nullptr, static_cast<unsigned>(i))));
  return op;
}

Op::~Op() {
  // Regions go first: their ops may use values from outside.
  regions_.clear();
  dropAllOperands();
}

static void eraseUse(std::vector<Use>& uses, Op* user, unsigned index) {
  auto it = std::find_if(uses.begin(), uses.end(),
                         [&](const Use& u) { return u.user == user && u.operand_index == index; });
  assert(it != uses.end());
  uses.erase(it);
}

void Op::setOperand(unsigned i, Value* v) {
  Value* old = operands_[i];
  if (old == v) return;
  if (old) eraseUse(old->uses_, this, i);
  operands_[i] = v;
  if (v) v->uses_.push_back({this, i});
}

void Op::addOperand(Value* v) {
  operands_.push_back(v);
  if (v) v->uses_.push_back({this, static_cast<unsigned>(operands_.size() - 1)});
}

void Op::setOperands(const std::vector<Value*>& vs) {
  dropAllOperands();
  for (Value* v : vs) addOperand(v);
}

void Op::dropAllOperands() {
  for (unsigned i = 0; i < operands_.size(); ++i)
    if (operands_[i]) eraseUse(operands_[i]->uses_, this, i);
  operands_.clear();
}

std::vector<Value*> Op::results() const {
  std::vector<Value*> out;
  out.reserve(results_.size());
  for (const auto& r : results_) out.push_back(r.get());
  return out;
}

const Attribute* Op::attr(std::string_view k) const {
  auto it = attrs_.find(k);
  return it == attrs_.end() ? nullptr : &it->second;
}

void Op::removeAttr(std::string_view k) {
  auto it = attrs_.find(k);
  if (it != attrs_.end()) attrs_.erase(it);
}

int64_t Op::intAttr(std::string_view k, int64_t dflt) const {
  const Attribute* a = attr(k);
  return a && a->isInt() ? a->asInt() : dflt;
}
double Op::floatAttr(std::string_view k, double dflt) const {
  const Attribute* a = attr(k);
  return a && a->isNumber() ? a->asDouble() : dflt;
}
bool Op::boolAttr(std::string_view k, bool dflt) const {
  const Attribute* a = attr(k);
  return a && a->isBool() ? a->asBool() : dflt;
}
std::string Op::strAttr(std::string_view k, std::string dflt) const {
  const Attribute* a = attr(k);
  return a && a->isString() ? a->asString() : dflt;
}
std::vector<int64_t> Op::intsAttr(std::string_view k) const {
  const Attribute* a = attr(k);
  return a ? a->asInts() : std::vector<int64_t>{};
}

Region& Op::addRegion() {
  regions_.push_back(std::make_unique<Region>(this));
  return *regions_.back();
}

Function* Op::parentFunction() const {
  return block_ && block_->parentRegion() ? block_->parentRegion()->parentFunction() : nullptr;
}

bool Op::hasTrait(uint32_t trait) const { return def_ && (def_->traits & trait) != 0; }

// ---- Block ------------------------------------------------------------------------------------

Block::~Block() {
  // Operands first: a block a pass left invalid (the verifier's error on its way out) may use a
  // value before the op that defines it. Then back to front, so that the ops of a region go
  // before the values outside it that they use.
  for (auto& op : ops_) op->dropAllOperands();
  while (!ops_.empty()) ops_.pop_back();
}

Value* Block::addArgument(TensorType t, std::string name_hint) {
  args_.push_back(std::unique_ptr<Value>(
      new Value(std::move(t), nullptr, this, static_cast<unsigned>(args_.size()))));
  args_.back()->setNameHint(std::move(name_hint));
  return args_.back().get();
}

std::vector<Value*> Block::arguments() const {
  std::vector<Value*> out;
  for (const auto& a : args_) out.push_back(a.get());
  return out;
}

std::vector<Op*> Block::opList() const {
  std::vector<Op*> out;
  out.reserve(ops_.size());
  for (const auto& op : ops_) out.push_back(op.get());
  return out;
}

Op* Block::push_back(std::unique_ptr<Op> op) {
  op->block_ = this;
  ops_.push_back(std::move(op));
  return ops_.back().get();
}

Block::OpList::iterator Block::find(Op* op) {
  return std::find_if(ops_.begin(), ops_.end(), [&](const auto& p) { return p.get() == op; });
}

Op* Block::insertBefore(Op* before, std::unique_ptr<Op> op) {
  op->block_ = this;
  auto it = before ? find(before) : ops_.end();
  return ops_.insert(it, std::move(op))->get();
}

std::unique_ptr<Op> Block::remove(Op* op) {
  auto it = find(op);
  assert(it != ops_.end());
  std::unique_ptr<Op> out = std::move(*it);
  ops_.erase(it);
  out->block_ = nullptr;
  return out;
}

void Block::erase(Op* op) {
#ifndef NDEBUG
  for (unsigned i = 0; i < op->numResults(); ++i) assert(!op->result(i)->hasUses());
#endif
  remove(op);
}

// ---- Function / Module ------------------------------------------------------------------------

Function::Function(std::string name, Module* parent)
    : name_(std::move(name)), module_(parent), body_(nullptr, this) {
  body_.addBlock();
}

Op* Function::returnOp() const {
  Op* last = entry().back();
  return last && last->is(OpCode::Return) ? last : nullptr;
}

size_t Function::numOps() const {
  size_t n = 0;
  const_cast<Function*>(this)->walk([&](Op&) { ++n; });
  return n;
}

Function& Module::addFunction(std::string name) {
  functions_.push_back(std::make_unique<Function>(std::move(name), this));
  return *functions_.back();
}

Function* Module::lookup(std::string_view name) const {
  for (const auto& f : functions_)
    if (f->name() == name) return f.get();
  return nullptr;
}

void Module::eraseFunction(std::string_view name) {
  std::erase_if(functions_, [&](const auto& f) { return f->name() == name; });
}

// ---- Cloning ----------------------------------------------------------------------------------

namespace {
void cloneBlockInto(const Block& src, Block& dst, std::unordered_map<const Value*, Value*>& map) {
  for (Value* a : src.arguments()) map[a] = dst.addArgument(a->type(), a->nameHint());
  for (const auto& op : src.ops()) {
    std::vector<Value*> operands;
    for (Value* v : op->operands()) {
      auto it = map.find(v);
      operands.push_back(it == map.end() ? v : it->second);
    }
    std::vector<TensorType> types;
    for (Value* r : op->results()) types.push_back(r->type());
    Op* copy = dst.push_back(Op::create(op->name(), operands, types, op->attrs(), op->location()));
    for (unsigned i = 0; i < op->numResults(); ++i) {
      copy->result(i)->setNameHint(op->result(i)->nameHint());
      map[op->result(i)] = copy->result(i);
    }
    for (const auto& r : op->regions()) {
      Region& nr = copy->addRegion();
      for (const auto& b : r->blocks()) cloneBlockInto(*b, nr.addBlock(), map);
    }
  }
}
}  // namespace

Function& cloneFunction(const Function& src, Module& dst, std::string new_name) {
  Function& f = dst.addFunction(std::move(new_name));
  f.setResultTypes(src.resultTypes());
  f.mutableAttrs() = src.attrs();
  f.loc = src.loc;
  std::unordered_map<const Value*, Value*> map;
  cloneBlockInto(src.entry(), f.entry(), map);
  return f;
}

}  // namespace kiln::ir
