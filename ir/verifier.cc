#include "ir/verifier.h"

#include <unordered_set>

#include "ir/builder.h"
#include "ir/op_def.h"

namespace kiln::ir {
namespace {

Status located(Status s, const Op& op, const Function& f) {
  std::string msg = fmt::format("in @{}: {}", f.name(), s.message());
  return Status::error(std::move(msg), op.location().known() ? op.location() : f.loc);
}

// `visible` holds the values defined before the current point: block arguments of enclosing
// blocks and results of earlier ops. Regions of an op see the values visible at that op.
Status verifyBlock(const Block& block, const Function& f, std::unordered_set<const Value*> visible,
                   bool is_function_body) {
  for (Value* a : block.arguments()) visible.insert(a);
  const Op* last = block.back();
  for (const auto& op_ptr : block.ops()) {
    const Op& op = *op_ptr;
    for (unsigned i = 0; i < op.numOperands(); ++i) {
      const Value* v = op.operand(i);
      if (!v) return located(Status::errorf("'{}' operand #{} is null", op.name(), i), op, f);
      if (!visible.count(v))
        return located(Status::errorf("'{}' operand #{} does not dominate its use", op.name(), i), op, f);
    }
    if (op.hasTrait(kTerminator) && &op != last)
      return located(Status::errorf("'{}' must be the last op of its block", op.name()), op, f);
    Status s = verifyOp(op);
    if (!s) return located(std::move(s), op, f);
    for (const auto& r : op.regions())
      for (const auto& b : r->blocks()) {
        Status rs = verifyBlock(*b, f, visible, false);
        if (!rs) return rs;
      }
    for (unsigned i = 0; i < op.numResults(); ++i) visible.insert(op.result(i));
  }
  if (is_function_body) {
    if (!last || !last->is(OpCode::Return))
      return Status::error(fmt::format("function @{} must end with func.return", f.name()), f.loc);
    if (last->numOperands() != f.resultTypes().size())
      return located(Status::errorf("func.return has {} operands but @{} returns {} values",
                                    last->numOperands(), f.name(), f.resultTypes().size()),
                     *last, f);
    for (unsigned i = 0; i < last->numOperands(); ++i)
      if (last->operand(i)->type().withSharding(std::nullopt) != f.resultTypes()[i].withSharding(std::nullopt))
        return located(Status::errorf("func.return operand #{} has type {} but @{} declares {}", i,
                                      last->operand(i)->type().str(), f.name(), f.resultTypes()[i].str()),
                       *last, f);
  }
  return Status::ok();
}

}  // namespace

Status verify(const Function& f) {
  if (f.body().blocks().size() != 1)
    return Status::error(fmt::format("function @{} must have exactly one block", f.name()), f.loc);
  return verifyBlock(f.entry(), f, {}, true);
}

Status verify(const Module& m) {
  std::unordered_set<std::string> names;
  for (const auto& f : m.functions()) {
    if (!names.insert(f->name()).second)
      return Status::error(fmt::format("function @{} is defined twice", f->name()), f->loc);
    KILN_RETURN_IF_ERROR(verify(*f));
  }
  return Status::ok();
}

}  // namespace kiln::ir
