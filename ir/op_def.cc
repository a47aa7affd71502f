#include "ir/op_def.h"

#include "ir/builder.h"

namespace kiln::ir {

const AttrSpec* OpDef::attrSpec(std::string_view n) const {
  for (const auto& a : attrs)
    if (a.name == n) return &a;
  return nullptr;
}

OpRegistry::OpRegistry() : by_code_(kNumOpCodes, nullptr) {
  registerCoreOps(*this);
  registerElementwiseOps(*this);
  registerMatmulOps(*this);
  registerShapeOps(*this);
  registerReduceOps(*this);
  registerEmbeddingOps(*this);
  registerLossOps(*this);
  registerOptimizerOps(*this);
  registerCollectiveOps(*this);
  registerRoutingOps(*this);
  registerExpertOps(*this);
  registerExpertParallelOps(*this);
  registerRandomOps(*this);
  registerRunningStateOps(*this);
}

OpRegistry& OpRegistry::get() {
  static OpRegistry registry;
  return registry;
}

bool OpRegistry::add(OpDef def) {
  std::string name = def.name;
  def.opcode = opCodeOf(name);
  auto [it, inserted] = defs_.emplace(std::move(name), std::move(def));
  // std::map never moves its elements, so the pointer stays valid.
  if (inserted && it->second.opcode != OpCode::Unknown)
    by_code_[static_cast<size_t>(it->second.opcode)] = &it->second;
  return inserted;
}

const OpDef* OpRegistry::lookup(OpCode code) const {
  size_t i = static_cast<size_t>(code);
  return i < by_code_.size() ? by_code_[i] : nullptr;
}

const OpDef* OpRegistry::lookup(std::string_view name) const {
  auto it = defs_.find(name);
  return it == defs_.end() ? nullptr : &it->second;
}

OpDef* OpRegistry::mutableLookup(std::string_view name) {
  auto it = defs_.find(name);
  return it == defs_.end() ? nullptr : &it->second;
}

std::vector<const OpDef*> OpRegistry::all() const {
  std::vector<const OpDef*> out;
  for (const auto& [_, d] : defs_) out.push_back(&d);
  return out;
}

std::vector<unsigned> writtenOperands(const Op& op) {
  const OpDef* def = op.def();
  if (!def || !def->has(kSideEffect)) return {};
  if (def->written) return def->written(op);
  std::vector<unsigned> all(op.numOperands());
  for (unsigned i = 0; i < all.size(); ++i) all[i] = i;
  return all;
}

std::optional<ScalarFn> scalarFnOf(const Op& op) {
  if (op.is(OpCode::Compare)) return findScalarFn(ScalarFnKind::Compare, op.strAttr("predicate"));
  const OpDef* def = op.def();
  return def ? def->scalar_fn : std::nullopt;
}

bool isPointwise(const Op& op) {
  switch (op.opcode()) {
    case OpCode::ReduceGrad:
      return op.strAttr("kind") != "max";
    case OpCode::Broadcast:
    case OpCode::Reshape:
    case OpCode::Transpose:
    case OpCode::Slice:
    case OpCode::Pad:
    case OpCode::Concat:
    case OpCode::Gather:
    case OpCode::Cast:
    case OpCode::BceWithLogitsGrad:
    // Per element of their result too: a counter-based mask, a hash of ids, a statistic's
    // selection, a state row read by id (codegen/emit/random_state.cc).
    case OpCode::Dropout:
    case OpCode::HashCross:
    case OpCode::RunningStat:
    case OpCode::LogFrequency:
      return true;
    default:
      return op.hasTrait(kElementwise) && !op.hasTrait(kSideEffect) && op.numResults() == 1;
  }
}

OpCode opCodeOf(ScalarFn fn) {
  switch (fn) {
#define KILN_UNARY(Name, ...) \
  case ScalarFn::Name:        \
    return OpCode::Name;
#define KILN_ACTIVATION(Name, ...) \
  case ScalarFn::Name:             \
    return OpCode::Name;
#define KILN_BINARY(Name, ...) \
  case ScalarFn::Name:         \
    return OpCode::Name;
#include "ir/scalar_fn.def"
    default:
      return OpCode::Unknown;
  }
}

bool isWideningCast(const Op& matmul, const Op& cast) {
  if (!matmul.is(OpCode::Matmul) || !cast.is(OpCode::Cast) || cast.operand(0) != matmul.result())
    return false;
  const DType from = matmul.result()->type().dtype();
  return (from == DType::bf16 || from == DType::f16) && cast.result()->type().dtype() == DType::f32;
}

Status expectRank(const Op& op, unsigned operand, int64_t rank) {
  const TensorType& t = op.operand(operand)->type();
  if (t.rank() != rank)
    return Status::errorf("'{}' expects operand #{} of rank {}, got {}", op.name(), operand, rank,
                          t.str());
  return Status::ok();
}

Expected<int64_t> normalizeAxis(const Op& op, int64_t axis, int64_t rank) {
  int64_t a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    return Status::errorf("'{}': axis {} is out of range for rank {}", op.name(), axis, rank);
  return a;
}

// ---- Builder ----------------------------------------------------------------------------------

void applyDefaultAttrs(const OpDef& def, AttrDict& attrs) {
  for (const auto& spec : def.attrs)
    if (spec.default_value && attrs.find(spec.name) == attrs.end()) attrs[spec.name] = *spec.default_value;
}

Expected<std::vector<TensorType>> inferResultTypes(const Op& op) {
  const OpDef* def = op.def();
  if (!def || !def->infer) return Status::errorf("'{}' has no shape inference", op.name());
  std::vector<TensorType> types;
  KILN_RETURN_IF_ERROR(def->infer(op, types));
  return types;
}

static Status checkSignature(const OpDef& def, const Op& op, bool check_results = true) {
  int n = static_cast<int>(op.numOperands());
  if (n < def.min_operands || (def.max_operands >= 0 && n > def.max_operands)) {
    if (def.min_operands == def.max_operands)
      return Status::errorf("'{}' expects {} operands, got {}", op.name(), def.min_operands, n);
    if (def.max_operands < 0)
      return Status::errorf("'{}' expects at least {} operands, got {}", op.name(), def.min_operands, n);
    return Status::errorf("'{}' expects {} to {} operands, got {}", op.name(), def.min_operands,
                          def.max_operands, n);
  }
  for (unsigned i = 0; i < op.numOperands(); ++i)
    if (!op.operand(i)) return Status::errorf("'{}' operand #{} is null", op.name(), i);
  if (check_results && def.num_results >= 0 && static_cast<int>(op.numResults()) != def.num_results)
    return Status::errorf("'{}' expects {} results, got {}", op.name(), def.num_results, op.numResults());
  for (const auto& spec : def.attrs) {
    const Attribute* a = op.attr(spec.name);
    if (!a) {
      if (spec.required) return Status::errorf("'{}' requires attribute '{}'", op.name(), spec.name);
      continue;
    }
    bool kind_ok = a->kind() == spec.kind ||
                   (spec.kind == Attribute::Kind::Float && a->kind() == Attribute::Kind::Int);
    if (!kind_ok)
      return Status::errorf("'{}' attribute '{}' has the wrong kind: {}", op.name(), spec.name, a->str());
    if (!spec.choices.empty()) {
      bool found = false;
      for (const auto& c : spec.choices) found |= (a->asString() == c);
      if (!found) {
        std::string list;
        for (const auto& c : spec.choices) list += (list.empty() ? "" : ", ") + c;
        return Status::errorf("'{}' attribute '{}' is \"{}\"; expected one of: {}", op.name(),
                              spec.name, a->asString(), list);
      }
    }
  }
  return Status::ok();
}

Status verifyOp(const Op& op) {
  const OpDef* def = op.def();
  if (!def) return Status::errorf("unknown op '{}'", op.name());
  KILN_RETURN_IF_ERROR(checkSignature(*def, op));
  if (!def->has(kTypeGiven) && def->infer) {
    KILN_ASSIGN_OR_RETURN(auto types, inferResultTypes(op));
    if (types.size() != op.numResults())
      return Status::errorf("'{}' infers {} results but has {}", op.name(), types.size(), op.numResults());
    for (unsigned i = 0; i < op.numResults(); ++i) {
      // Sharding annotations are added by planning passes; shapes and dtypes must agree.
      TensorType have = op.result(i)->type().withSharding(std::nullopt);
      if (have != types[i].withSharding(std::nullopt))
        return Status::errorf("'{}' result #{} has type {} but its operands give {}", op.name(), i,
                              op.result(i)->type().str(), types[i].str());
    }
  }
  if (def->verify) KILN_RETURN_IF_ERROR(def->verify(op));
  return Status::ok();
}

Op* Builder::insert(std::unique_ptr<Op> op) {
  assert(block_);
  return block_->insertBefore(before_, std::move(op));
}

Expected<Op*> Builder::create(const std::string& name, const std::vector<Value*>& operands, AttrDict attrs) {
  const OpDef* def = OpRegistry::get().lookup(name);
  if (!def) return Status::error(fmt::format("unknown op '{}'", name), loc_);
  applyDefaultAttrs(*def, attrs);
  // Infer on a detached op with no results, then give it its results.
  auto probe = Op::create(name, operands, {}, attrs, loc_);
  Status sig = checkSignature(*def, *probe, /*check_results=*/false);
  if (!sig) return std::move(sig).withLocation(loc_);
  if (!def->infer) return Status::error(fmt::format("'{}' needs stated result types", name), loc_);
  std::vector<TensorType> types;
  Status s = def->infer(*probe, types);
  if (!s) return std::move(s).withLocation(loc_);
  probe.reset();
  return createWithTypes(name, operands, types, std::move(attrs));
}

Expected<Value*> Builder::createValue(const std::string& name, const std::vector<Value*>& operands,
                                      AttrDict attrs) {
  KILN_ASSIGN_OR_RETURN(auto op, create(name, operands, std::move(attrs)));
  if (op->numResults() != 1)
    return Status::error(fmt::format("'{}' has {} results, expected 1", name, op->numResults()), loc_);
  return op->result(0);
}

Expected<Op*> Builder::createWithTypes(const std::string& name, const std::vector<Value*>& operands,
                                       const std::vector<TensorType>& result_types, AttrDict attrs) {
  const OpDef* def = OpRegistry::get().lookup(name);
  if (!def) return Status::error(fmt::format("unknown op '{}'", name), loc_);
  applyDefaultAttrs(*def, attrs);
  auto op = Op::create(name, operands, result_types, std::move(attrs), loc_);
  Status s = verifyOp(*op);
  if (!s) return std::move(s).withLocation(loc_);
  return insert(std::move(op));
}

}  // namespace kiln::ir
