// Test helpers for fused groups: wrap ops of a function into a `kiln.fused` op the way the
// fusion pass lays one out (block arguments for the group's inputs, a kiln.yield of the values
// used outside), and run a whole lowered function on the CPU through the kernel interpreter.
#pragma once

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "codegen/kernel_interpreter.h"
#include "codegen/kernel_lowering.h"
#include "ir/ir.h"
#include "ir/op_def.h"
#include "ir/tensor_view.h"

namespace kiln::testing {

// Moves `members` (ops of f's entry block, in block order) into one kiln.fused op of `kind`
// placed where the last member was. Parameters that an op updates in place stay captured, as
// the fusion pass keeps them. Returns the fused op.
inline ir::Op* fuseOps(ir::Function& f, const std::vector<ir::Op*>& members, const std::string& kind) {
  ir::Block& block = f.entry();
  std::set<const ir::Op*> in(members.begin(), members.end());
  std::vector<ir::Value*> inputs, outputs;
  std::map<ir::Value*, unsigned> input_index;
  for (ir::Op* m : members) {
    for (ir::Value* v : m->operands()) {
      bool captured =
          m->hasTrait(ir::kSideEffect) && v->definingOp() && v->definingOp()->name() == "kiln.parameter";
      if ((!v->definingOp() || !in.count(v->definingOp())) && !input_index.count(v) && !captured) {
        input_index[v] = static_cast<unsigned>(inputs.size());
        inputs.push_back(v);
      }
    }
    for (ir::Value* r : m->results())
      if (std::any_of(r->uses().begin(), r->uses().end(),
                      [&](const ir::Use& u) { return !in.count(u.user); }))
        outputs.push_back(r);
  }
  std::vector<ir::TensorType> types;
  for (ir::Value* v : outputs) types.push_back(v->type());
  auto fused = ir::Op::create("kiln.fused", inputs, types, {{"kind", ir::Attribute(kind)}});
  ir::Block& body = fused->addRegion().addBlock();
  for (ir::Value* v : inputs) body.addArgument(v->type());
  ir::Op* fop = block.insertBefore(members.back(), std::move(fused));
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::vector<ir::Use> uses = outputs[i]->uses();
    for (const ir::Use& u : uses)
      if (!in.count(u.user)) u.user->setOperand(u.operand_index, fop->result(static_cast<unsigned>(i)));
  }
  for (ir::Op* m : members) {
    ir::Op* moved = body.push_back(block.remove(m));
    for (unsigned i = 0; i < moved->numOperands(); ++i) {
      auto it = input_index.find(moved->operand(i));
      if (it != input_index.end()) moved->setOperand(i, body.argument(it->second));
    }
  }
  body.push_back(ir::Op::create("kiln.yield", outputs, {}));
  return fop;
}

// Every group of a lowered function run by the kernel interpreter. `values` holds the tensors of
// the function's values: inputs and parameters filled by the caller (parameters are updated in
// place); every other value a group writes is allocated here, poisoned first with `poison`.
template <typename PoisonFn>
Status interpretFunction(const std::vector<codegen::LoweredGroup>& groups, const ir::SymbolBindings& symbols,
                         std::map<const ir::Value*, ir::HostTensor>& values, PoisonFn poison) {
  for (const codegen::LoweredGroup& g : groups) {
    if (g.gemm) return Status::error("interpretFunction: a GEMM has no kernel to interpret");
    std::vector<ir::HostTensor> temps(g.buffers.size());
    std::vector<void*> ptrs;
    for (size_t i = 0; i < g.buffers.size(); ++i) {
      const codegen::GroupBuffer& b = g.buffers[i];
      ir::HostTensor* t = nullptr;
      if (b.value) {
        auto it = values.find(b.value);
        if (it == values.end()) {
          auto shape = codegen::concreteShape(b.value->type(), symbols);
          if (!shape) return shape.status();
          it = values.emplace(b.value, ir::HostTensor(b.dtype, *shape)).first;
          poison(it->second);
        }
        t = &it->second;
      } else {
        temps[i] = ir::HostTensor(b.dtype, {b.elements});
        poison(temps[i]);
        t = &temps[i];
      }
      ptrs.push_back(t->view.data);
    }
    KILN_RETURN_IF_ERROR(codegen::interpretGroup(g, ptrs));
  }
  return Status::ok();
}

// Runs ops (of one block, in order) through their CPU references; `values` holds the inputs and
// receives every result. Side-effecting ops update their operands' tensors in place.
inline Status referenceRun(const std::vector<const ir::Op*>& ops, const ir::SymbolBindings& symbols,
                           std::map<const ir::Value*, ir::HostTensor>& values) {
  ir::CpuContext ctx;
  ctx.symbols = &symbols;
  for (const ir::Op* op : ops) {
    if (!op->def() || !op->def()->cpu) return Status::errorf("{} has no CPU reference", op->name());
    std::vector<const ir::TensorView*> in;
    for (ir::Value* v : op->operands()) {
      auto it = values.find(v);
      if (it == values.end()) return Status::errorf("{}: an operand has no value", op->name());
      in.push_back(&it->second.view);
    }
    std::vector<ir::TensorView*> out;
    for (ir::Value* r : op->results()) {
      auto shape = codegen::concreteShape(r->type(), symbols);
      if (!shape) return shape.status();
      values[r] = ir::HostTensor(r->type().dtype(), *shape);
      out.push_back(&values[r].view);
    }
    KILN_RETURN_IF_ERROR(op->def()->cpu(*op, in, out, ctx));
  }
  return Status::ok();
}

}  // namespace kiln::testing
