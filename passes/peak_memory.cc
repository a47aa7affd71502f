#include "passes/peak_memory.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "ir/op_def.h"

namespace kiln::passes {
namespace {

constexpr int64_t kAlignment = 64;

int64_t alignUp(int64_t v) { return (v + kAlignment - 1) / kAlignment * kAlignment; }

struct Step {
  const ir::Op* op;
  std::vector<int> operands, results;  // buffer ids
};

struct Buffer {
  ir::TensorType type;
  int64_t bytes = 0;
  bool arena = true;
  bool returned = false;
};

// Instructions and buffers as the CPU lowering makes them.
class Flattener {
 public:
  explicit Flattener(const ir::SymbolBindings& s) : symbols_(s) {}

  Status block(const ir::Block& b) {
    for (const auto& op : b.ops()) KILN_RETURN_IF_ERROR(lower(*op));
    return Status::ok();
  }

  std::vector<Step> steps;
  std::vector<Buffer> buffers;

 private:
  Expected<int> newBuffer(const ir::Op& op, const ir::TensorType& t, bool arena) {
    auto bytes = t.bytes(symbols_);
    if (!bytes)
      return Status::error(fmt::format("'{}': a symbol of {} is not bound (set it, e.g. --batch)", op.name(), t.str()),
                           op.location());
    buffers.push_back({t, *bytes, arena, false});
    return static_cast<int>(buffers.size()) - 1;
  }

  Status lower(const ir::Op& op) {
    if (op.name() == "kiln.input" || op.name() == "kiln.parameter") {
      auto& by_name = op.name() == "kiln.input" ? inputs_ : params_;
      std::string name = op.strAttr("name");
      if (!by_name.count(name)) {
        auto id = newBuffer(op, op.result()->type(), false);
        if (!id) return id.status();
        by_name[name] = *id;
      }
      buffer_of_[op.result()] = by_name[name];
      return Status::ok();
    }
    if (op.name() == "func.return") {
      for (const ir::Value* v : op.operands())
        if (buffer_of_.count(v)) buffers[static_cast<size_t>(buffer_of_.at(v))].returned = true;
      return Status::ok();
    }
    if (op.name() == "kiln.fused" && !op.regions().empty() && !op.regions().front()->empty()) {
      const ir::Block& body = op.regions().front()->front();
      for (unsigned i = 0; i < body.numArguments() && i < op.numOperands(); ++i)
        if (buffer_of_.count(op.operand(i))) buffer_of_[body.argument(i)] = buffer_of_.at(op.operand(i));
      for (const auto& inner : body.ops()) {
        if (inner->name() == "kiln.yield") {
          for (unsigned i = 0; i < inner->numOperands() && i < op.numResults(); ++i)
            if (buffer_of_.count(inner->operand(i))) buffer_of_[op.result(i)] = buffer_of_.at(inner->operand(i));
          continue;
        }
        KILN_RETURN_IF_ERROR(lower(*inner));
      }
      return Status::ok();
    }
    Step s{&op, {}, {}};
    for (const ir::Value* v : op.operands()) {
      // A function argument (IR tests; models take none) lives outside the arena like an input.
      if (!buffer_of_.count(v)) {
        auto id = newBuffer(op, v->type(), false);
        if (!id) return id.status();
        buffer_of_[v] = *id;
      }
      s.operands.push_back(buffer_of_.at(v));
    }
    for (const ir::Value* r : op.results()) {
      auto id = newBuffer(op, r->type(), true);
      if (!id) return id.status();
      s.results.push_back(*id);
      buffer_of_[r] = *id;
    }
    steps.push_back(std::move(s));
    return Status::ok();
  }

  const ir::SymbolBindings& symbols_;
  std::unordered_map<const ir::Value*, int> buffer_of_;
  std::map<std::string, int> inputs_, params_;
};

bool mayUpdateInPlace(const ir::Op& op) {
  if (op.name() == "kiln.reshape") return true;
  return op.hasTrait(ir::kElementwise) && !op.hasTrait(ir::kSideEffect);
}

// Best-fit free list over one arena that grows at the top.
class Arena {
 public:
  int64_t allocate(int64_t size) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second >= size && (best == free_.end() || it->second < best->second)) best = it;
    if (best != free_.end()) {
      int64_t off = best->first, left = best->second - size;
      free_.erase(best);
      if (left > 0) free_[off + size] = left;
      return off;
    }
    int64_t off = top_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) {
        off = last->first;
        free_.erase(last);
      }
    }
    top_ = off + size;
    return off;
  }
  void release(int64_t off, int64_t size) {
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + size == next->first) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += size;
        return;
      }
    }
    free_[off] = size;
  }

 private:
  std::map<int64_t, int64_t> free_;
  int64_t top_ = 0;
};

}  // namespace

Expected<int64_t> estimatePeakBytes(const ir::Function& f, const ir::SymbolBindings& symbols) {
  if (f.body().empty()) return int64_t{0};
  Flattener fl(symbols);
  KILN_RETURN_IF_ERROR(fl.block(f.entry()));
  const int n = static_cast<int>(fl.steps.size());
  const size_t nbuf = fl.buffers.size();
  std::vector<int> first(nbuf, -1), last(nbuf, -1);
  for (int t = 0; t < n; ++t) {
    for (int id : fl.steps[static_cast<size_t>(t)].results)
      if (first[static_cast<size_t>(id)] < 0) first[static_cast<size_t>(id)] = t;
    for (int id : fl.steps[static_cast<size_t>(t)].operands)
      last[static_cast<size_t>(id)] = std::max(last[static_cast<size_t>(id)], t);
  }
  for (size_t b = 0; b < nbuf; ++b) {
    if (!fl.buffers[b].arena) first[b] = 0;
    if (fl.buffers[b].arena && fl.buffers[b].returned) last[b] = n;
    last[b] = std::max(last[b], first[b]);
  }
  Arena arena;
  std::vector<int64_t> offset(nbuf, -1), block(nbuf, 0);
  std::vector<bool> holds(nbuf, false);
  int64_t peak = 0;
  for (int t = 0; t < n; ++t) {
    const Step& s = fl.steps[static_cast<size_t>(t)];
    std::vector<int> donated;
    for (int r : s.results) {
      const Buffer& res = fl.buffers[static_cast<size_t>(r)];
      if (offset[static_cast<size_t>(r)] >= 0) continue;
      int64_t size = alignUp(res.bytes);
      if (mayUpdateInPlace(*s.op)) {
        for (int o : s.operands) {
          const Buffer& src = fl.buffers[static_cast<size_t>(o)];
          bool same = s.op->name() == "kiln.reshape" ? src.bytes == res.bytes
                                                     : src.type.withSharding(std::nullopt) == res.type.withSharding(std::nullopt);
          if (!src.arena || !holds[static_cast<size_t>(o)] || last[static_cast<size_t>(o)] != t || !same) continue;
          if (std::find(donated.begin(), donated.end(), o) != donated.end()) continue;
          offset[static_cast<size_t>(r)] = offset[static_cast<size_t>(o)];
          block[static_cast<size_t>(r)] = block[static_cast<size_t>(o)];
          holds[static_cast<size_t>(o)] = false;
          holds[static_cast<size_t>(r)] = true;
          donated.push_back(o);
          break;
        }
      }
      if (offset[static_cast<size_t>(r)] < 0) {
        offset[static_cast<size_t>(r)] = size == 0 ? 0 : arena.allocate(size);
        block[static_cast<size_t>(r)] = size;
        holds[static_cast<size_t>(r)] = size > 0;
      }
      peak = std::max(peak, offset[static_cast<size_t>(r)] + res.bytes);
    }
    auto release = [&](int id) {
      size_t u = static_cast<size_t>(id);
      if (holds[u] && last[u] == t) {
        arena.release(offset[u], block[u]);
        holds[u] = false;
      }
    };
    for (int o : s.operands) release(o);
    for (int r : s.results) release(r);
  }
  return peak;
}

}  // namespace kiln::passes
