#include "runtime/serving/served_tables.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "ir/ops/kernel_util.h"
#include "runtime/data/batch.h"

namespace kiln::serving {
namespace {

// The ops that read `v` in the end: a fused group's reads are those of its region's argument.
void leafUses(const ir::Value* v, std::vector<ir::Use>& out) {
  for (const ir::Use& u : v->uses()) {
    ir::Op* user = u.user;
    if (user->is(ir::OpCode::Fused) && !user->regions().empty() && !user->regions().front()->empty()) {
      ir::Block& body = user->regions().front()->front();
      if (u.operand_index < body.numArguments()) {
        leafUses(body.argument(u.operand_index), out);
        continue;
      }
    }
    out.push_back(u);
  }
}

// The op that defines `v`, looking through fused groups' region arguments to their operands.
const ir::Op* producer(const ir::Value* v) {
  while (v->isBlockArgument()) {
    const ir::Block* b = v->parentBlock();
    const ir::Op* group = b && b->parentRegion() ? b->parentRegion()->parentOp() : nullptr;
    if (!group || v->index() >= group->numOperands()) return nullptr;
    v = group->operand(v->index());
  }
  return v->definingOp();
}

bool isSparseInput(const ir::Op* op) {
  return op && op->is(ir::OpCode::Input) && op->strAttr("role") == "sparse";
}

}  // namespace

std::vector<ServedTable> findServedTables(const ir::Function& forward) {
  std::vector<const ir::Op*> params;
  const_cast<ir::Function&>(forward).walk([&](ir::Op& op) {
    if (op.is(ir::OpCode::Parameter)) params.push_back(&op);
  });
  // Candidates: f32 tables read only by lookups of sparse input ids.
  std::map<const ir::Op*, ServedTable> candidates;
  std::map<const ir::Op*, std::vector<const ir::Op*>> tables_of_input;
  for (const ir::Op* p : params) {
    const ir::TensorType& t = p->result()->type();
    if (t.dtype() != ir::DType::f32 || t.rank() != 2 || !t.dim(0).isStatic() || !t.dim(1).isStatic())
      continue;
    std::vector<ir::Use> uses;
    leafUses(p->result(), uses);
    ServedTable table{p->strAttr("name"), t.dim(0).size(), t.dim(1).size(), {}, -1};
    std::vector<const ir::Op*> inputs;
    bool servable = !uses.empty();
    for (const ir::Use& u : uses) {
      const ir::Op* ids = u.user->is(ir::OpCode::EmbeddingBag) && u.operand_index == 0
                              ? producer(u.user->operand(1))
                              : nullptr;
      if (!isSparseInput(ids)) {
        servable = false;
        break;
      }
      if (std::find(inputs.begin(), inputs.end(), ids) == inputs.end()) inputs.push_back(ids);
    }
    if (!servable) continue;
    for (const ir::Op* in : inputs) {
      table.id_inputs.push_back(in->strAttr("name"));
      tables_of_input[in].push_back(p);
    }
    candidates.emplace(p, std::move(table));
  }
  // An input's ids are rewritten per batch, so every op reading them must be a lookup in a served
  // table, and the tables reading one input share their distinct ids: a group. (Wide & Deep reads
  // each feature with a wide and a deep table.) One table that cannot be served keeps its group
  // in the session.
  std::map<const ir::Op*, const ir::Op*> parent;  // union-find over tables
  std::function<const ir::Op*(const ir::Op*)> root = [&](const ir::Op* t) {
    const ir::Op* p = parent.count(t) ? parent[t] : t;
    return p == t ? t : (parent[t] = root(p));
  };
  std::set<const ir::Op*> bad;  // roots of groups that cannot be served
  for (const auto& [input, tables] : tables_of_input) {
    for (const ir::Op* t : tables) {
      const ir::Op *a = root(tables[0]), *b = root(t);
      if (a != b) parent[b] = a;
    }
    std::vector<ir::Use> id_uses;
    leafUses(input->result(), id_uses);
    for (const ir::Use& u : id_uses) {
      const ir::Op* table = u.user->is(ir::OpCode::EmbeddingBag) && u.operand_index == 1
                                ? producer(u.user->operand(0))
                                : nullptr;
      if (!table || !candidates.count(table)) bad.insert(tables[0]);
    }
  }
  std::set<const ir::Op*> bad_roots;
  for (const ir::Op* t : bad) bad_roots.insert(root(t));
  std::map<const ir::Op*, int> group_of_root;
  std::vector<ServedTable> out;
  for (const ir::Op* p : params) {
    auto it = candidates.find(p);
    if (it == candidates.end() || bad_roots.count(root(p))) continue;
    auto [g, fresh] = group_of_root.emplace(root(p), static_cast<int>(group_of_root.size()));
    it->second.group = g->second;
    out.push_back(it->second);
  }
  return out;
}

Expected<GatheredRows> gatherRows(const std::vector<ServedTable>& tables, const data::Batch& batch,
                                  const RowSource& source) {
  GatheredRows g;
  g.rows.resize(tables.size());
  g.ids.resize(tables.size());
  int groups = 0;
  for (const ServedTable& t : tables) groups = std::max(groups, t.group + 1);
  for (int group = 0; group < groups; ++group) {
    // The group's inputs, each checked against the rows of a table that reads it.
    std::vector<std::pair<const std::string*, const ir::HostTensor*>> inputs;
    std::vector<int64_t> ids;
    for (const ServedTable& table : tables) {
      if (table.group != group) continue;
      for (const std::string& name : table.id_inputs) {
        bool seen = false;
        for (const auto& in : inputs) seen |= *in.first == name;
        if (seen) continue;
        const ir::HostTensor* in = batch.find(name);
        if (!in)
          return Status::errorf("the batch has no input '{}' (the ids of table '{}')", name, table.name);
        const ir::TensorView& v = in->view;
        if (v.dtype != ir::DType::i32 && v.dtype != ir::DType::i64)
          return Status::errorf("input '{}' holds {} ids; it must be i32 or i64", name,
                                ir::dtypeName(v.dtype));
        const int64_t per_sample = v.rank() == 2 ? v.shape[1] : 0;
        for (int64_t i = 0, n = v.numel(); i < n; ++i) {
          const int64_t id = ir::kernels::loadIndex(v, i);
          if (id < 0 || id >= table.rows) {
            if (per_sample > 0)
              return Status::errorf("input '{}': id {} of sample {} is out of range [0, {}) of table '{}'",
                                    name, id, i / per_sample, table.rows, table.name);
            return Status::errorf("input '{}': id {} (position {}) is out of range [0, {}) of table '{}'",
                                  name, id, i, table.rows, table.name);
          }
          ids.push_back(id);
        }
        inputs.emplace_back(&name, in);
      }
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (size_t t = 0; t < tables.size(); ++t) {
      if (tables[t].group != group) continue;
      for (int64_t id : ids)
        if (id >= tables[t].rows)
          return Status::errorf("table '{}' of {} rows shares ids up to {} with its group", tables[t].name,
                                tables[t].rows, id);
      g.ids[t] = ids;
      g.rows[t].reset(ir::DType::f32, {static_cast<int64_t>(ids.size()), tables[t].dim});
      if (!ids.empty()) KILN_RETURN_IF_ERROR(source(t, ids, g.rows[t].view.as<float>()));
    }
    for (const auto& [name, in] : inputs) {
      const ir::TensorView& v = in->view;
      ir::HostTensor remapped(v.dtype, v.shape);
      for (int64_t i = 0, n = v.numel(); i < n; ++i) {
        const int64_t id = ir::kernels::loadIndex(v, i);
        const auto at = static_cast<int64_t>(std::lower_bound(ids.begin(), ids.end(), id) - ids.begin());
        if (v.dtype == ir::DType::i32)
          remapped.view.as<int32_t>()[i] = static_cast<int32_t>(at);
        else
          remapped.view.as<int64_t>()[i] = at;
      }
      g.remapped_inputs.emplace_back(*name, std::move(remapped));
    }
  }
  return g;
}

}  // namespace kiln::serving
