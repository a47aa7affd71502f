#include "codegen/emit/emitter_registry.h"

#include <set>

namespace kiln::codegen::emit {

EmitterRegistry::EmitterRegistry() {
  registerPointwiseEmitters(*this);
  registerReductionEmitters(*this);
  registerSoftmaxLossEmitters(*this);
  registerEmbeddingLookupEmitters(*this);
  registerEmbeddingUpdateEmitters(*this);
  registerOptimizerEmitters(*this);
  registerScatterEmitters(*this);
  registerGemmEmitters(*this);
  registerNoKernelOps(*this);
}

const EmitterRegistry& EmitterRegistry::get() {
  static const EmitterRegistry r;
  return r;
}

void EmitterRegistry::addExpression(std::string_view op, ExpressionRule rule, SupportsFn supports) {
  expressions_.emplace(std::string(op), Expression{std::move(rule), supports});
}

void EmitterRegistry::addOpEmitter(std::string_view op, OpEmitter emitter) {
  emitters_.emplace(std::string(op), std::move(emitter));
}

void EmitterRegistry::addFusedEmitter(std::string_view kind, GroupEmitterFn lower) {
  fused_[std::string(kind)] = lower;
}

void EmitterRegistry::setPointwiseChain(ChainEmitterFn lower) { pointwise_chain_ = lower; }

void EmitterRegistry::addNoKernel(std::string_view op, NoKernel why, std::string reason) {
  no_kernel_[std::string(op)] = {why, std::move(reason)};
}

const ExpressionRule* EmitterRegistry::expressionFor(const ir::Op& op) const {
  auto [lo, hi] = expressions_.equal_range(op.name());
  for (auto it = lo; it != hi; ++it)
    if (!it->second.supports || it->second.supports(op)) return &it->second.rule;
  return nullptr;
}

const OpEmitter* EmitterRegistry::emitterFor(const ir::Op& op) const {
  auto [lo, hi] = emitters_.equal_range(op.name());
  for (auto it = lo; it != hi; ++it)
    if (!it->second.supports || it->second.supports(op)) return &it->second;
  return nullptr;
}

GroupEmitterFn EmitterRegistry::fusedEmitter(std::string_view kind) const {
  auto it = fused_.find(kind);
  return it == fused_.end() ? nullptr : it->second;
}

std::vector<std::string> EmitterRegistry::loweringsOf(std::string_view op) const {
  std::vector<std::string> out;
  if (expressions_.count(op)) out.push_back("expression");
  auto [lo, hi] = emitters_.equal_range(op);
  for (auto it = lo; it != hi; ++it) out.push_back(it->second.emitter);
  return out;
}

NoKernel EmitterRegistry::noKernel(std::string_view op, std::string* reason) const {
  auto it = no_kernel_.find(op);
  if (it == no_kernel_.end()) return NoKernel::kNone;
  if (reason) *reason = it->second.reason;
  return it->second.why;
}

std::vector<std::string> EmitterRegistry::registeredOps() const {
  std::set<std::string> names;
  for (const auto& [op, _] : expressions_) names.insert(op);
  for (const auto& [op, _] : emitters_) names.insert(op);
  for (const auto& [op, _] : no_kernel_) names.insert(op);
  return {names.begin(), names.end()};
}

std::vector<std::string> EmitterRegistry::fusedKinds() const {
  std::vector<std::string> out;
  for (const auto& [kind, _] : fused_) out.push_back(kind);
  return out;
}

// The ops no emitter lowers. groupOps skips sources and terminators (isSourceOrTerminator in
// kernel_lowering.h) and lowerFunction hands a kiln.fused op's region to its kind's emitter;
// the registry test checks that every source and terminator of the op table is marked here.
void registerNoKernelOps(EmitterRegistry& r) {
  const NoKernel runs_without = NoKernel::kRunsWithout;
  r.addNoKernel("kiln.input", runs_without, "a source: a buffer the batch is copied into");
  r.addNoKernel("kiln.parameter", runs_without, "a source: a buffer of the session's parameters");
  r.addNoKernel("kiln.constant", runs_without,
                "a source: evaluated by its CPU reference and uploaded once (a splat is inlined into "
                "the kernels reading it)");
  r.addNoKernel("func.return", runs_without, "a terminator: its operands are the Program's results");
  r.addNoKernel("kiln.yield", runs_without, "a terminator: its operands are the fused op's results");
  r.addNoKernel("kiln.fused", runs_without, "its region is lowered by the fused emitter of its kind");
  r.addNoKernel("kiln.pad", NoKernel::kNotLowered,
                "slice's adjoint has no CUDA lowering yet: a step that pads fails to lower (the CPU "
                "backend runs it)");
}

}  // namespace kiln::codegen::emit
