// The Kiln IR: an SSA graph in MLIR's shape.
//
//   Module    holds Functions (and module attributes such as the training configuration);
//   Function  holds one Region, its body;
//   Region    holds Blocks (Kiln uses a single block per region);
//   Block     holds arguments and an ordered list of Ops;
//   Op        has a name (looked up in the op table), operands, results, attributes and
//             optionally regions (a fused group holds the ops it fused);
//   Value     is an op result or a block argument, typed by a TensorType.
//
// Ownership flows down: a Module owns its Functions, a Block its Ops, an Op its results and
// regions. Values track their uses so that passes can rewrite in place.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ir/attribute.h"
#include "ir/opcode.h"
#include "ir/status.h"
#include "ir/types.h"

namespace kiln::ir {

class Block;
class Function;
class Op;
class Region;
struct OpDef;

struct Use {
  Op* user;
  unsigned operand_index;
};

class Value {
 public:
  const TensorType& type() const { return type_; }
  void setType(TensorType t) { type_ = std::move(t); }

  // The op that defines this value, or nullptr for a block argument.
  Op* definingOp() const { return def_; }
  // The block this value lives in (the argument's block, or the defining op's block).
  Block* parentBlock() const;
  // Result number or argument number.
  unsigned index() const { return index_; }
  bool isBlockArgument() const { return def_ == nullptr; }

  // A readable name for the printer (`%dense`); printers make names unique.
  const std::string& nameHint() const { return name_hint_; }
  void setNameHint(std::string n) { name_hint_ = std::move(n); }

  const std::vector<Use>& uses() const { return uses_; }
  bool hasUses() const { return !uses_.empty(); }
  void replaceAllUsesWith(Value* other);

 private:
  friend class Op;
  friend class Block;
  Value(TensorType t, Op* def, Block* block, unsigned index)
      : type_(std::move(t)), def_(def), block_(block), index_(index) {}

  TensorType type_;
  Op* def_ = nullptr;
  Block* block_ = nullptr;  // for block arguments
  unsigned index_ = 0;
  std::string name_hint_;
  std::vector<Use> uses_;
};

class Region {
 public:
  explicit Region(Op* parent_op = nullptr, Function* parent_func = nullptr)
      : parent_op_(parent_op), parent_func_(parent_func) {}
  Block& addBlock();
  std::vector<std::unique_ptr<Block>>& blocks() { return blocks_; }
  const std::vector<std::unique_ptr<Block>>& blocks() const { return blocks_; }
  Block& front() { return *blocks_.front(); }
  const Block& front() const { return *blocks_.front(); }
  bool empty() const { return blocks_.empty(); }
  Op* parentOp() const { return parent_op_; }
  Function* parentFunction() const;

 private:
  Op* parent_op_;
  Function* parent_func_;
  std::vector<std::unique_ptr<Block>> blocks_;
};

class Op {
 public:
  ~Op();
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;

  // Creates a detached op; insert it with Block::push_back / insertBefore (or use the Builder).
  static std::unique_ptr<Op> create(std::string name, const std::vector<Value*>& operands,
                                    const std::vector<TensorType>& result_types, AttrDict attrs = {},
                                    Location loc = {});
  static std::unique_ptr<Op> create(OpCode code, const std::vector<Value*>& operands,
                                    const std::vector<TensorType>& result_types, AttrDict attrs = {},
                                    Location loc = {}) {
    return create(std::string(opName(code)), operands, result_types, std::move(attrs), std::move(loc));
  }

  const std::string& name() const { return name_; }
  // The op-table entry, or nullptr for an op the table does not know.
  const OpDef* def() const { return def_; }
  // What the op is (OpCode::Unknown for an op ops.def does not list).
  OpCode opcode() const { return code_; }
  bool is(OpCode code) const { return code_ == code; }
  template <typename... Codes>
  bool isAnyOf(Codes... codes) const {
    return ((code_ == codes) || ...);
  }
  const Location& location() const { return loc_; }
  void setLocation(Location l) { loc_ = std::move(l); }

  // Operands.
  unsigned numOperands() const { return static_cast<unsigned>(operands_.size()); }
  Value* operand(unsigned i) const { return operands_[i]; }
  const std::vector<Value*>& operands() const { return operands_; }
  void setOperand(unsigned i, Value* v);
  void addOperand(Value* v);
  void setOperands(const std::vector<Value*>& vs);
  // Drops every operand (and the uses they record).
  void dropAllOperands();

  // Results.
  unsigned numResults() const { return static_cast<unsigned>(results_.size()); }
  Value* result(unsigned i = 0) const { return results_[i].get(); }
  std::vector<Value*> results() const;

  // Attributes.
  const AttrDict& attrs() const { return attrs_; }
  AttrDict& mutableAttrs() { return attrs_; }
  bool hasAttr(std::string_view k) const { return attrs_.find(k) != attrs_.end(); }
  const Attribute* attr(std::string_view k) const;
  void setAttr(std::string k, Attribute v) { attrs_[std::move(k)] = std::move(v); }
  void removeAttr(std::string_view k);
  // Typed getters with defaults, for verified ops.
  int64_t intAttr(std::string_view k, int64_t dflt = 0) const;
  double floatAttr(std::string_view k, double dflt = 0) const;
  bool boolAttr(std::string_view k, bool dflt = false) const;
  std::string strAttr(std::string_view k, std::string dflt = "") const;
  std::vector<int64_t> intsAttr(std::string_view k) const;

  // Regions.
  Region& addRegion();
  std::vector<std::unique_ptr<Region>>& regions() { return regions_; }
  const std::vector<std::unique_ptr<Region>>& regions() const { return regions_; }

  Block* parentBlock() const { return block_; }
  Function* parentFunction() const;

  // True if this op is known by the op table to have the given trait.
  bool hasTrait(uint32_t trait) const;

 private:
  friend class Block;
  Op() = default;

  std::string name_;
  const OpDef* def_ = nullptr;
  OpCode code_ = OpCode::Unknown;
  Location loc_;
  std::vector<Value*> operands_;
  std::vector<std::unique_ptr<Value>> results_;
  AttrDict attrs_;
  std::vector<std::unique_ptr<Region>> regions_;
  Block* block_ = nullptr;
};

class Block {
 public:
  explicit Block(Region* parent) : parent_(parent) {}
  ~Block();

  Region* parentRegion() const { return parent_; }

  Value* addArgument(TensorType t, std::string name_hint = "");
  unsigned numArguments() const { return static_cast<unsigned>(args_.size()); }
  Value* argument(unsigned i) const { return args_[i].get(); }
  std::vector<Value*> arguments() const;

  using OpList = std::list<std::unique_ptr<Op>>;
  OpList& ops() { return ops_; }
  const OpList& ops() const { return ops_; }
  bool empty() const { return ops_.empty(); }
  Op* back() const { return ops_.empty() ? nullptr : ops_.back().get(); }
  // The ops in order, as raw pointers (safe to iterate while erasing other ops).
  std::vector<Op*> opList() const;

  Op* push_back(std::unique_ptr<Op> op);
  Op* insertBefore(Op* before, std::unique_ptr<Op> op);
  // Removes and destroys an op whose results have no remaining uses.
  void erase(Op* op);
  // Detaches an op without destroying it.
  std::unique_ptr<Op> remove(Op* op);
  // Position of op in this block (for dominance checks).
  OpList::iterator find(Op* op);

 private:
  Region* parent_;
  std::vector<std::unique_ptr<Value>> args_;
  OpList ops_;
};

class Module;

class Function {
 public:
  Function(std::string name, Module* parent);

  const std::string& name() const { return name_; }
  void setName(std::string n) { name_ = std::move(n); }
  Module* parentModule() const { return module_; }

  Region& body() { return body_; }
  const Region& body() const { return body_; }
  Block& entry() { return body_.front(); }
  const Block& entry() const { return body_.front(); }

  const std::vector<TensorType>& resultTypes() const { return result_types_; }
  void setResultTypes(std::vector<TensorType> t) { result_types_ = std::move(t); }

  const AttrDict& attrs() const { return attrs_; }
  AttrDict& mutableAttrs() { return attrs_; }

  // The terminating func.return op, or nullptr.
  Op* returnOp() const;

  // Calls fn on every op, nested regions included, in order (pre-order).
  template <typename Fn>
  void walk(Fn&& fn);
  size_t numOps() const;

  Location loc;

 private:
  std::string name_;
  Module* module_;
  Region body_;
  std::vector<TensorType> result_types_;
  AttrDict attrs_;
};

class Module {
 public:
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  Function& addFunction(std::string name);
  Function* lookup(std::string_view name) const;
  std::vector<std::unique_ptr<Function>>& functions() { return functions_; }
  const std::vector<std::unique_ptr<Function>>& functions() const { return functions_; }
  void eraseFunction(std::string_view name);

  const AttrDict& attrs() const { return attrs_; }
  AttrDict& mutableAttrs() { return attrs_; }
  // The file this module was read or lowered from, for diagnostics.
  std::string source_file;

 private:
  std::vector<std::unique_ptr<Function>> functions_;
  AttrDict attrs_;
};

namespace detail {
template <typename Fn>
void walkBlock(Block& b, Fn& fn) {
  for (Op* op : b.opList()) {
    fn(*op);
    for (auto& r : op->regions())
      for (auto& blk : r->blocks()) walkBlock(*blk, fn);
  }
}
}  // namespace detail

template <typename Fn>
void Function::walk(Fn&& fn) {
  for (auto& b : body_.blocks()) detail::walkBlock(*b, fn);
}

// Deep-copies a function (with its nested regions) into `dst` under a new name.
Function& cloneFunction(const Function& src, Module& dst, std::string new_name);

}  // namespace kiln::ir
