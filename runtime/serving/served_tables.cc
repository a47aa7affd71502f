#include "runtime/serving/served_tables.h"

#include <algorithm>
#include <map>
#include <set>

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
  std::vector<ServedTable> out;
  for (const ir::Op* p : params) {
    const ir::TensorType& t = p->result()->type();
    if (t.dtype() != ir::DType::f32 || t.rank() != 2 || !t.dim(0).isStatic() || !t.dim(1).isStatic()) continue;
    std::vector<ir::Use> uses;
    leafUses(p->result(), uses);
    if (uses.empty()) continue;
    ServedTable table{p->strAttr("name"), t.dim(0).size(), t.dim(1).size(), {}};
    bool servable = true;
    for (const ir::Use& u : uses) {
      const ir::Op* lookup = u.user;
      const ir::Op* ids = lookup->is(ir::OpCode::EmbeddingBag) && u.operand_index == 0
                              ? producer(lookup->operand(1))
                              : nullptr;
      if (!isSparseInput(ids)) {
        servable = false;
        break;
      }
      // The ids must feed this table's lookups alone: they are rewritten per batch.
      std::vector<ir::Use> id_uses;
      leafUses(ids->result(), id_uses);
      for (const ir::Use& iu : id_uses)
        if (!iu.user->is(ir::OpCode::EmbeddingBag) || iu.operand_index != 1 ||
            producer(iu.user->operand(0)) != p)
          servable = false;
      const std::string name = ids->strAttr("name");
      if (std::find(table.id_inputs.begin(), table.id_inputs.end(), name) == table.id_inputs.end())
        table.id_inputs.push_back(name);
    }
    if (servable) out.push_back(std::move(table));
  }
  return out;
}

Expected<GatheredRows> gatherRows(const std::vector<ServedTable>& tables, const data::Batch& batch,
                                  const RowSource& source) {
  GatheredRows g;
  g.rows.resize(tables.size());
  g.ids.resize(tables.size());
  for (size_t t = 0; t < tables.size(); ++t) {
    const ServedTable& table = tables[t];
    std::vector<const ir::HostTensor*> inputs;
    for (const std::string& name : table.id_inputs) {
      const ir::HostTensor* in = batch.find(name);
      if (!in) return Status::errorf("the batch has no input '{}' (the ids of table '{}')", name, table.name);
      const ir::TensorView& v = in->view;
      if (v.dtype != ir::DType::i32 && v.dtype != ir::DType::i64)
        return Status::errorf("input '{}' holds {} ids; it must be i32 or i64", name, ir::dtypeName(v.dtype));
      const int64_t per_sample = v.rank() == 2 ? v.shape[1] : 0;
      for (int64_t i = 0, n = v.numel(); i < n; ++i) {
        const int64_t id = v.dtype == ir::DType::i32 ? v.as<int32_t>()[i] : v.as<int64_t>()[i];
        if (id < 0 || id >= table.rows) {
          if (per_sample > 0)
            return Status::errorf("input '{}': id {} of sample {} is out of range [0, {}) of table '{}'", name, id,
                                  i / per_sample, table.rows, table.name);
          return Status::errorf("input '{}': id {} (position {}) is out of range [0, {}) of table '{}'", name, id, i,
                                table.rows, table.name);
        }
        g.ids[t].push_back(id);
      }
      inputs.push_back(in);
    }
    std::vector<int64_t>& ids = g.ids[t];
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    g.rows[t].reset(ir::DType::f32, {static_cast<int64_t>(ids.size()), table.dim});
    if (!ids.empty()) KILN_RETURN_IF_ERROR(source(t, ids, g.rows[t].view.as<float>()));
    for (size_t k = 0; k < inputs.size(); ++k) {
      const ir::TensorView& v = inputs[k]->view;
      ir::HostTensor remapped(v.dtype, v.shape);
      for (int64_t i = 0, n = v.numel(); i < n; ++i) {
        const int64_t id = v.dtype == ir::DType::i32 ? v.as<int32_t>()[i] : v.as<int64_t>()[i];
        const auto at = static_cast<int64_t>(std::lower_bound(ids.begin(), ids.end(), id) - ids.begin());
        if (v.dtype == ir::DType::i32)
          remapped.view.as<int32_t>()[i] = static_cast<int32_t>(at);
        else
          remapped.view.as<int64_t>()[i] = at;
      }
      g.remapped_inputs.emplace_back(table.id_inputs[k], std::move(remapped));
    }
  }
  return g;
}

}  // namespace kiln::serving
