#include "passes/cost_model.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "ir/ops/kernel_util.h"
#include "ir/precision.h"

namespace kiln::passes {

CostModel::CostModel(Target target, ir::SymbolBindings symbols)
    : target_(std::move(target)), symbols_(std::move(symbols)) {}

bool CostModel::launchesWork(const ir::Op& op) {
  return !(op.hasTrait(ir::kSource) || op.hasTrait(ir::kTerminator) || op.is(ir::OpCode::Constant));
}

// Every symbol a function's types mention gets a value: the model's, else the default.
ir::SymbolBindings CostModel::bind(const ir::Function* f) const {
  ir::SymbolBindings s = symbols_;
  if (!f) return s;
  auto note = [&](const ir::TensorType& t) {
    for (const ir::Dim& d : t.shape())
      if (!d.sym().empty() && !s.count(d.sym())) s[d.sym()] = kDefaultSymbolValue;
  };
  const_cast<ir::Function*>(f)->walk([&](ir::Op& op) {
    for (ir::Value* r : op.results()) note(r->type());
  });
  for (ir::Value* a : f->entry().arguments()) note(a->type());
  return s;
}

double CostModel::valueBytes(const ir::Value& v) const {
  ir::SymbolBindings s = symbols_;
  for (const ir::Dim& d : v.type().shape())
    if (!d.sym().empty() && !s.count(d.sym())) s[d.sym()] = kDefaultSymbolValue;
  return ir::kernels::typeBytes(v.type(), s);
}

double CostModel::time(const GroupCost& c) const {
  double vector_flops = std::max(0.0, c.flops - c.gemm_flops);
  // A GPU multiplies bf16 on its tensor cores, f32 in TF32 there too unless the precision is
  // f32_strict (then on its CUDA cores); elementwise math runs in f32 (the kernels widen bf16
  // operands).
  double narrow_gemm_flops = std::max(0.0, c.gemm_flops - c.f32_gemm_flops);
  const FlopRates& gemm = target_.gemm_flops_per_s;
  const double tf32_flops = gemm.tf32 > 0 ? std::min(c.tf32_gemm_flops, c.f32_gemm_flops) : 0;
  double compute = narrow_gemm_flops / gemm.bf16 + (c.f32_gemm_flops - tf32_flops) / gemm.f32 +
                   (tf32_flops > 0 ? tf32_flops / gemm.tf32 : 0) + vector_flops / target_.vector_flops_per_s.f32;
  double memory = c.bytes / target_.bytes_per_s;
  return std::max(compute, memory) + c.launches * target_.launch_s;
}

GroupCost CostModel::opCost(const ir::Op& op) const {
  if (op.is(ir::OpCode::Fused) && !op.regions().empty() && !op.regions().front()->empty()) {
    std::vector<const ir::Op*> members;
    for (const auto& inner : op.regions().front()->front().ops())
      if (launchesWork(*inner)) members.push_back(inner.get());
    return groupCost(members);
  }
  return groupCost({&op});
}

GroupCost CostModel::groupCost(const std::vector<const ir::Op*>& ops) const {
  GroupCost g;
  if (ops.empty()) return g;
  ir::SymbolBindings symbols = bind(ops.front()->parentFunction());
  std::unordered_set<const ir::Op*> members(ops.begin(), ops.end());
  // The hooks count every operand read and every result written by each op; a group reads a
  // value once and keeps values that do not leave it out of memory.
  std::unordered_map<const ir::Value*, int> readers;
  for (const ir::Op* op : ops) {
    if (!launchesWork(*op)) continue;
    const ir::OpDef* def = op->def();
    ir::OpCost c = def && def->cost ? def->cost(*op, symbols)
                                    : ir::OpCost{0, ir::kernels::operandAndResultBytes(*op, symbols)};
    g.flops += c.flops;
    if (op->is(ir::OpCode::Matmul)) {
      g.gemm_flops += c.flops;
      if (!FlopRates::narrow(op->operand(0)->type().dtype())) g.f32_gemm_flops += c.flops;
      if (ir::allowsTf32(*op)) g.tf32_gemm_flops += c.flops;
    }
    g.bytes += c.bytes;
    std::unordered_set<const ir::Value*> seen;
    for (const ir::Value* v : op->operands())
      if (seen.insert(v).second) ++readers[v];
  }
  for (const auto& [v, n] : readers) {
    double b = ir::kernels::typeBytes(v->type(), symbols);
    bool internal = v->definingOp() && members.count(v->definingOp());
    g.bytes -= b * (internal ? n : n - 1);
  }
  for (const ir::Op* op : ops)
    for (const ir::Value* r : op->results()) {
      bool escapes = false;
      for (const ir::Use& u : r->uses()) escapes |= !members.count(u.user);
      if (!escapes && r->hasUses()) g.bytes -= ir::kernels::typeBytes(r->type(), symbols);
    }
  g.bytes = std::max(0.0, g.bytes);
  g.launches = std::any_of(ops.begin(), ops.end(), [](const ir::Op* o) { return launchesWork(*o); }) ? 1 : 0;
  return g;
}

double CostModel::fusionBenefit(const std::vector<const ir::Op*>& ops) const {
  double unfused = 0;
  for (const ir::Op* op : ops) unfused += time(opCost(*op));
  return unfused - time(groupCost(ops));
}

ir::SymbolBindings planningSymbols(const ir::Module& m) {
  ir::SymbolBindings s;
  auto it = m.attrs().find("kiln.symbols");
  if (it != m.attrs().end() && it->second.isDict())
    for (const auto& [k, v] : it->second.asDict())
      if (v.isInt()) s[k] = v.asInt();
  return s;
}

ir::SymbolBindings bindAllSymbols(const ir::Function& f, ir::SymbolBindings symbols) {
  auto bind = [&](const ir::Value* v) {
    for (const ir::Dim& d : v->type().shape())
      if (!d.sym().empty() && !symbols.count(d.sym())) symbols[d.sym()] = CostModel::kDefaultSymbolValue;
  };
  // The function's arguments too: a symbol may appear in no op's result (a sum_to folding B away).
  if (!f.body().empty())
    for (unsigned i = 0; i < f.entry().numArguments(); ++i) bind(f.entry().argument(i));
  const_cast<ir::Function&>(f).walk([&](ir::Op& op) {
    for (const ir::Value* r : op.results()) bind(r);
  });
  return symbols;
}

}  // namespace kiln::passes
