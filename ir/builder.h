// Builds ops at an insertion point, filling in default attributes and inferring result types
// from the op table.
#pragma once

#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/op_def.h"

namespace kiln::ir {

class Builder {
 public:
  Builder() = default;
  explicit Builder(Block& block) { setInsertionPointToEnd(block); }

  void setInsertionPointToEnd(Block& b) {
    block_ = &b;
    before_ = nullptr;
  }
  // New ops go right before `op`.
  void setInsertionPoint(Op* op) {
    block_ = op->parentBlock();
    before_ = op;
  }
  Block* block() const { return block_; }
  Op* insertionPoint() const { return before_; }

  void setLocation(Location l) { loc_ = std::move(l); }
  const Location& location() const { return loc_; }

  // Creates an op whose result types the op table infers. Errors (wrong arity, missing
  // attribute, incompatible shapes) come back with the builder's current location.
  Expected<Op*> create(const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {});
  // Same, returning the single result.
  Expected<Value*> createValue(const std::string& name, const std::vector<Value*>& operands,
                               AttrDict attrs = {});
  // Creates an op with stated result types (input, parameter, reshape, ...); still verified.
  Expected<Op*> createWithTypes(const std::string& name, const std::vector<Value*>& operands,
                                const std::vector<TensorType>& result_types, AttrDict attrs = {});
  // The same by opcode, for code outside ir/ops/ (which never spells an op's name).
  Expected<Op*> create(OpCode code, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    return create(std::string(opName(code)), operands, std::move(attrs));
  }
  Expected<Value*> createValue(OpCode code, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    return createValue(std::string(opName(code)), operands, std::move(attrs));
  }
  Expected<Op*> createWithTypes(OpCode code, const std::vector<Value*>& operands,
                                const std::vector<TensorType>& result_types, AttrDict attrs = {}) {
    return createWithTypes(std::string(opName(code)), operands, result_types, std::move(attrs));
  }
  // Inserts an already-built op.
  Op* insert(std::unique_ptr<Op> op);

 private:
  Block* block_ = nullptr;
  Op* before_ = nullptr;
  Location loc_;
};

// Fills absent attributes with their defaults from the op table.
void applyDefaultAttrs(const OpDef& def, AttrDict& attrs);
// Checks arity and attributes of an op against its table entry, then runs inference and
// compares with the op's result types, then the op's verify hook.
Status verifyOp(const Op& op);
// Runs an op's inference on its current operands and attributes.
Expected<std::vector<TensorType>> inferResultTypes(const Op& op);

}  // namespace kiln::ir
