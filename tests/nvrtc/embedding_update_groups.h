// Fused `embedding_update` groups of many tables for the embedding backward's tests (the
// NVRTC compile test and tests/simt/simt_embedding_backward_test), and a plain-loop reference of
// what the sorted backward accumulates.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {

// One embedding_bag_update of a group.
struct UpdateTable {
  int64_t rows, dim;
  DType ids_type;
  int64_t hotness;    // 0: jagged
  int64_t num_ids;    // jagged: the ids buffer's size
  int64_t id_range;   // ids drawn from [0, id_range)
  bool weighted, mean;
  std::string optimizer;
};

// A fused embedding_update group over `tables`, each reading its columns of one [batch, sum of
// dims] gradient.
OpCase updateGroup(const std::string& name, int64_t batch, const std::vector<UpdateTable>& tables) {
  CaseBuilder b(name);
  int64_t width = 0;
  for (const UpdateTable& t : tables) width += t.dim;
  Value* grad = b.input("grad", DType::f32, S({batch, width}));
  Value* lr = b.input("lr", DType::f32, {}, Fill::Positive);
  Value* step = b.input("step", DType::f32, {}, Fill::Ids, 4);
  int64_t at = 0;
  for (size_t i = 0; i < tables.size(); ++i) {
    const UpdateTable& t = tables[i];
    const std::string n = std::to_string(i);
    Value* table = b.param("tables." + n, DType::f32, S({t.rows, t.dim}));
    std::vector<Value*> operands = {table};
    if (t.hotness > 0) {
      operands.push_back(b.input("cats." + n, t.ids_type, S({batch, t.hotness}), Fill::Ids, t.id_range));
      if (t.weighted) operands.push_back(b.input("w." + n, DType::f32, S({batch, t.hotness})));
    } else {
      operands.push_back(b.input("cats." + n, t.ids_type, S({t.num_ids}), Fill::Ids, t.id_range));
      operands.push_back(b.input("cats." + n + ".lengths", DType::i32, S({batch}), Fill::Lengths, t.num_ids));
      if (t.weighted) operands.push_back(b.input("w." + n, DType::f32, S({t.num_ids})));
    }
    operands.push_back(b.op("kiln.slice", {grad},
                            {{"axis", Attribute(int64_t{1})}, {"start", Attribute(at)}, {"limit", Attribute(at + t.dim)}})
                           ->result());
    at += t.dim;
    if (t.optimizer == "rowwise_adagrad")
      operands.push_back(b.param("state." + n, DType::f32, S({t.rows}), Fill::Positive));
    else if (t.optimizer == "adagrad")
      operands.push_back(b.param("state." + n, DType::f32, S({t.rows, t.dim}), Fill::Positive));
    operands.push_back(lr);
    operands.push_back(step);
    AttrDict attrs = {{"optimizer", Attribute(t.optimizer)}, {"lr", Attribute(0.1)}};
    if (t.weighted) attrs["weighted"] = Attribute(true);
    if (t.mean) attrs["mode"] = Attribute("mean");
    b.op("kiln.embedding_bag_update", operands, attrs);
  }
  b.tol(1e-4);
  return b.take();
}

// The summed gradient rows of each table's distinct ids, in id order, from plain loops over
// the case's inputs: each occurrence's gradient row times its weight (and 1/bag size for a
// mean), added in position order.
struct TableSums {
  std::vector<int64_t> ids;
  std::vector<std::vector<float>> rows;
};
inline std::vector<TableSums> referenceSums(const OpCase& c, const CaseRun& run, const std::vector<UpdateTable>& tables) {
  std::vector<TableSums> out;
  const ir::HostTensor* grad = nullptr;
  for (const auto& [v, t] : run.inputs)
    if (v->definingOp()->strAttr("name") == "grad") grad = &t;
  const int64_t width = grad->view.shape[1], batch = grad->view.shape[0];
  auto input = [&](const std::string& name) -> const ir::HostTensor* {
    for (const auto& [v, t] : run.inputs)
      if (v->definingOp()->strAttr("name", "") == name) return &t;
    return nullptr;
  };
  int64_t col = 0;
  for (size_t i = 0; i < tables.size(); ++i) {
    const UpdateTable& t = tables[i];
    const std::string n = std::to_string(i);
    const ir::HostTensor* ids = input("cats." + n);
    const ir::HostTensor* lengths = input("cats." + n + ".lengths");
    const ir::HostTensor* w = input("w." + n);
    std::map<int64_t, std::vector<float>> sums;
    int64_t p = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t size = lengths ? static_cast<int64_t>(readAsDouble(lengths->view, b)) : t.hotness;
      for (int64_t j = 0; j < size; ++j, ++p) {
        const int64_t id = static_cast<int64_t>(readAsDouble(ids->view, p));
        const float scale = t.mean && size > 0 ? 1.0f / static_cast<float>(size) : 1.0f;
        const float k = (w ? w->view.as<float>()[p] : 1.0f) * scale;
        std::vector<float>& row = sums[id];
        row.resize(static_cast<size_t>(t.dim), 0.0f);
        for (int64_t d = 0; d < t.dim; ++d) row[static_cast<size_t>(d)] += k * grad->view.as<float>()[b * width + col + d];
      }
    }
    col += t.dim;
    TableSums ts;
    for (auto& [id, row] : sums) {
      ts.ids.push_back(id);
      ts.rows.push_back(row);
    }
    out.push_back(std::move(ts));
  }
  return out;
}

}  // namespace kiln::testing
