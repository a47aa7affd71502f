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
  registerMoeEmitters(*this);
  registerRandomStateEmitters(*this);
  registerNoKernelOps(*this);
}

const EmitterRegistry& EmitterRegistry::get() {
  static const EmitterRegistry r;
  return r;
}

void EmitterRegistry::addExpression(ir::OpCode op, ExpressionRule rule, SupportsFn supports) {
  expressions_.emplace(op, Expression{std::move(rule), supports});
}

void EmitterRegistry::addOpEmitter(ir::OpCode op, OpEmitter emitter) {
  emitters_.emplace(op, std::move(emitter));
}

void EmitterRegistry::addFusedEmitter(std::string_view kind, GroupEmitterFn lower) {
  fused_[std::string(kind)] = lower;
}

void EmitterRegistry::setPointwiseChain(ChainEmitterFn lower) { pointwise_chain_ = lower; }

void EmitterRegistry::addNoKernel(ir::OpCode op, NoKernel why, std::string reason) {
  no_kernel_[op] = {why, std::move(reason)};
}

const ExpressionRule* EmitterRegistry::expressionFor(const ir::Op& op) const {
  auto [lo, hi] = expressions_.equal_range(op.opcode());
  for (auto it = lo; it != hi; ++it)
    if (!it->second.supports || it->second.supports(op)) return &it->second.rule;
  return nullptr;
}

const OpEmitter* EmitterRegistry::emitterFor(const ir::Op& op) const {
  auto [lo, hi] = emitters_.equal_range(op.opcode());
  for (auto it = lo; it != hi; ++it)
    if (!it->second.supports || it->second.supports(op)) return &it->second;
  return nullptr;
}

GroupEmitterFn EmitterRegistry::fusedEmitter(std::string_view kind) const {
  auto it = fused_.find(kind);
  return it == fused_.end() ? nullptr : it->second;
}

std::vector<std::string> EmitterRegistry::loweringsOf(ir::OpCode op) const {
  std::vector<std::string> out;
  if (expressions_.count(op)) out.push_back("expression");
  auto [lo, hi] = emitters_.equal_range(op);
  for (auto it = lo; it != hi; ++it) out.push_back(it->second.emitter);
  return out;
}

NoKernel EmitterRegistry::noKernel(ir::OpCode op, std::string* reason) const {
  auto it = no_kernel_.find(op);
  if (it == no_kernel_.end()) return NoKernel::kNone;
  if (reason) *reason = it->second.reason;
  return it->second.why;
}

std::vector<ir::OpCode> EmitterRegistry::registeredOps() const {
  std::set<ir::OpCode> names;
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
  r.addNoKernel(ir::OpCode::Input, runs_without, "a source: a buffer the batch is copied into");
  r.addNoKernel(ir::OpCode::Parameter, runs_without, "a source: a buffer of the session's parameters");
  r.addNoKernel(ir::OpCode::Constant, runs_without,
                "a source: evaluated by its CPU reference and uploaded once (a splat is inlined into "
                "the kernels reading it)");
  r.addNoKernel(ir::OpCode::Return, runs_without, "a terminator: its operands are the Program's results");
  r.addNoKernel(ir::OpCode::Yield, runs_without, "a terminator: its operands are the fused op's results");
  r.addNoKernel(ir::OpCode::Fused, runs_without, "its region is lowered by the fused emitter of its kind");
  // Collectives move data between ranks through the communicator (NCCL on GPUs), issued by the
  // runtime on a communication stream; there is no kernel to generate.
  for (ir::OpCode op : {ir::OpCode::AllReduce, ir::OpCode::ReduceScatter, ir::OpCode::AllGather,
                        ir::OpCode::AllToAll, ir::OpCode::AllToAllV})
    r.addNoKernel(op, NoKernel::kNotLowered,
                  "a collective: it runs through the communicator (NCCL), not a generated kernel; the "
                  "CUDA backend does not issue collectives yet");
  for (ir::OpCode op : {ir::OpCode::BucketizeIds, ir::OpCode::SplitHotIds, ir::OpCode::DedupIds, ir::OpCode::CompactRows,
                        ir::OpCode::ExpandRows, ir::OpCode::EmbeddingBagDenseGrad})
    r.addNoKernel(op, NoKernel::kNotLowered,
                  "the shard pass's id routing (and a hybrid table's dense hot-row gradient) runs on the host "
                  "next to its collectives; the CUDA backend does not run sharded steps yet");
  // Expert parallelism's ops appear only in a sharded step (the shard pass puts them around the
  // all_to_all_v of a MoE layer's dispatch and combine).
  for (ir::OpCode op : {ir::OpCode::MoeRouteCounts, ir::OpCode::MoeEpSplit, ir::OpCode::MoeSortChunks,
                        ir::OpCode::MoeChunkOffsets})
    r.addNoKernel(op, NoKernel::kNotLowered,
                  "expert parallelism's counting and chunk sorting run in sharded steps only; the CUDA "
                  "backend does not run sharded steps yet");
}

}  // namespace kiln::codegen::emit
