#include "ir/interpreter.h"

#include <cstring>
#include <memory>
#include <unordered_map>

#include "ir/op_def.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

class Interpreter {
 public:
  Interpreter(const Function& f, std::map<std::string, HostTensor>& tensors, const SymbolBindings& symbols,
              const InterpretOptions& options)
      : f_(f), tensors_(tensors), symbols_(symbols), options_(options) {}

  Expected<std::vector<HostTensor>> run() {
    std::vector<const TensorView*> returned;
    KILN_RETURN_IF_ERROR(runBlock(f_.entry(), returned));
    std::vector<HostTensor> out;
    for (const TensorView* v : returned) {
      HostTensor t(v->dtype, v->shape);
      std::memcpy(t.view.data, v->data, static_cast<size_t>(v->bytes()));
      out.push_back(std::move(t));
    }
    return out;
  }

 private:
  Status located(const Op& op, const Status& s) const {
    const Location& loc =
        op.location().known() ? op.location() : (s.location().known() ? s.location() : f_.loc);
    return Status::error(fmt::format("in @{}: {}", f_.name(), s.message()), loc);
  }
  Status located(const Op& op, std::string message) const {
    return located(op, Status::error(std::move(message)));
  }

  // A fresh buffer for a value of type t at its bound size.
  Expected<TensorView*> allocate(const Op& op, const TensorType& t) {
    std::vector<int64_t> shape;
    for (const Dim& d : t.shape()) {
      auto n = d.evaluate(symbols_);
      if (!n) return located(op, fmt::format("symbol '{}' of {} is not bound", d.sym(), t.str()));
      shape.push_back(*n);
    }
    owned_.push_back(std::make_unique<HostTensor>(t.dtype(), std::move(shape)));
    return &owned_.back()->view;
  }

  // Frees the buffer of an intermediate value once its last use has run, so that the peak
  // memory of a run is the live set, not the sum of all intermediates.
  void releaseUse(const Value* v) {
    auto it = remaining_uses_.find(v);
    if (it == remaining_uses_.end()) it = remaining_uses_.emplace(v, v->uses().size()).first;
    if (--it->second == 0) release(v);
  }
  void release(const Value* v) {
    auto owner = owner_.find(v);
    if (owner == owner_.end()) return;  // a source: the caller's tensor
    owned_[owner->second].reset();
    owner_.erase(owner);
    env_.erase(v);
  }

  Status bindSource(const Op& op) {
    const std::string name = op.strAttr("name");
    const TensorType& t = op.result()->type();
    auto it = tensors_.find(name);
    if (it == tensors_.end())
      return located(op, fmt::format("no tensor named '{}' for '{}'", name, op.name()));
    const TensorView& v = it->second.view;
    bool fits = v.dtype == t.dtype() && v.rank() == t.rank();
    for (int64_t i = 0; fits && i < t.rank(); ++i) {
      auto n = t.dim(i).evaluate(symbols_);
      if (!n) return located(op, fmt::format("symbol '{}' of {} is not bound", t.dim(i).sym(), t.str()));
      const int64_t have = v.shape[static_cast<size_t>(i)];
      fits = t.dim(i).isBounded() ? have <= *n : have == *n;
    }
    if (!fits)
      return located(op, fmt::format("'{}' is {}{} but '{}' declares {}", name, dtypeName(v.dtype),
                                     kernels::shapeString(v.shape), op.name(), t.str()));
    env_[op.result()] = &it->second.view;
    return Status::ok();
  }

  // Runs the ops of a block; the operands of its terminator come back in `terminator_operands`.
  Status runBlock(const Block& block, std::vector<const TensorView*>& terminator_operands) {
    for (const auto& op_ptr : block.ops()) {
      const Op& op = *op_ptr;
      const OpDef* def = op.def();
      if (!def) return located(op, fmt::format("unknown op '{}'", op.name()));
      std::vector<const TensorView*> operands;
      for (Value* v : op.operands()) {
        auto it = env_.find(v);
        if (it == env_.end())
          return located(op, fmt::format("'{}' uses a value that was never computed", op.name()));
        operands.push_back(it->second);
      }
      if (def->has(kTerminator)) {
        terminator_operands = std::move(operands);
        return Status::ok();
      }
      if (def->has(kSource)) {
        KILN_RETURN_IF_ERROR(bindSource(op));
        continue;
      }
      std::vector<TensorView*> results;
      for (Value* r : op.results()) {
        auto buf = allocate(op, r->type());
        if (!buf) return buf.status();
        results.push_back(*buf);
        env_[r] = *buf;
        owner_[r] = owned_.size() - 1;
      }
      if (def->cpu) {
        CpuContext ctx;
        ctx.symbols = &symbols_;
        ctx.ranks = options_.ranks;
        Status s = def->cpu(op, operands, results, ctx);
        if (!s) return located(op, s);
      } else if (!op.regions().empty() && !op.regions().front()->empty()) {
        KILN_RETURN_IF_ERROR(runRegion(op, operands, results));
      } else {
        return located(op, fmt::format("'{}' has no CPU reference implementation", op.name()));
      }
      for (Value* v : op.operands()) releaseUse(v);
      for (Value* r : op.results())
        if (!r->hasUses()) release(r);
    }
    return Status::ok();
  }

  // A fused group: block arguments are the op's operands, kiln.yield gives its results.
  Status runRegion(const Op& op, const std::vector<const TensorView*>& operands,
                   const std::vector<TensorView*>& results) {
    const Block& body = op.regions().front()->front();
    if (body.numArguments() != operands.size())
      return located(op, fmt::format("'{}' region takes {} arguments for {} operands", op.name(),
                                     body.numArguments(), operands.size()));
    for (unsigned i = 0; i < body.numArguments(); ++i) env_[body.argument(i)] = operands[i];
    std::vector<const TensorView*> yielded;
    KILN_RETURN_IF_ERROR(runBlock(body, yielded));
    if (yielded.size() != results.size())
      return located(op, fmt::format("'{}' region yields {} values for {} results", op.name(), yielded.size(),
                                     results.size()));
    for (size_t i = 0; i < results.size(); ++i) {
      Status s = kernels::setResultShape(op, *results[i], yielded[i]->shape);
      if (!s) return located(op, s);
      std::memcpy(results[i]->data, yielded[i]->data, static_cast<size_t>(yielded[i]->bytes()));
    }
    return Status::ok();
  }

  const Function& f_;
  std::map<std::string, HostTensor>& tensors_;
  const SymbolBindings& symbols_;
  InterpretOptions options_;
  std::unordered_map<const Value*, const TensorView*> env_;
  std::vector<std::unique_ptr<HostTensor>> owned_;
  std::unordered_map<const Value*, size_t> owner_;  // value -> its buffer in owned_
  std::unordered_map<const Value*, size_t> remaining_uses_;
};

}  // namespace

Expected<std::vector<HostTensor>> interpretInPlace(const Function& f,
                                                   std::map<std::string, HostTensor>& tensors,
                                                   const SymbolBindings& symbols,
                                                   const InterpretOptions& options) {
  return Interpreter(f, tensors, symbols, options).run();
}

Expected<std::vector<HostTensor>> interpret(
    const Function& f, const std::map<std::string, HostTensor>& inputs_and_params_by_name,
    const SymbolBindings& symbols, const InterpretOptions& options) {
  std::map<std::string, HostTensor> copies = inputs_and_params_by_name;
  return interpretInPlace(f, copies, symbols, options);
}

}  // namespace kiln::ir
