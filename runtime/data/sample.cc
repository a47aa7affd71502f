#include "runtime/data/sample.h"

namespace kiln::data {

namespace {

std::vector<int64_t> concreteShape(const InputSpec& in, int64_t n) {
  switch (in.role) {
    case InputRole::Dense: return {n, in.dense_count};
    case InputRole::Label:
      return in.type.rank() == 2 ? std::vector<int64_t>{n, in.label_count} : std::vector<int64_t>{n};
    case InputRole::Lengths: return {n};
    case InputRole::Sparse:
      return in.variableLength() ? std::vector<int64_t>{n * in.max_hotness} : std::vector<int64_t>{n, in.hotness};
    case InputRole::Weights:
      // Shaped like the ids: rank 1 for variable length, [n, H] otherwise.
      if (in.type.rank() == 1) return {n * in.type.dim(0).upperBound().factor()};
      return {n, in.type.dim(1).size()};
    case InputRole::Tokens:
    case InputRole::Targets:
      return {n, in.seq_len};
  }
  return {};
}

template <typename T>
void writeIds(const InputSpec& in, const RawSample* s, int64_t n, T* out, int32_t* lengths) {
  if (in.variableLength()) {
    for (int64_t i = 0; i < n; ++i) {
      bool missing = (s[i].missing >> in.feature) & 1u;
      out[i] = static_cast<T>(missing ? kMissingRow : mapId(s[i].cats[in.feature], in.id_map, in.rows));
      lengths[i] = 1;
    }
    return;
  }
  const int h = in.hotness;
  for (int64_t i = 0; i < n; ++i) {
    bool missing = (s[i].missing >> in.feature) & 1u;
    uint64_t raw = s[i].cats[in.feature];
    for (int k = 0; k < h; ++k)
      out[i * h + k] = static_cast<T>(missing ? kMissingRow : mapId(expandValue(raw, k), in.id_map, in.rows));
  }
}

}  // namespace

void allocateBatch(const BatchSpec& spec, int64_t n, Batch& batch) {
  batch.size = n;
  batch.names.resize(spec.inputs.size());
  batch.tensors.resize(spec.inputs.size());
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const InputSpec& in = spec.inputs[i];
    batch.names[i] = in.name;
    std::vector<int64_t> shape = concreteShape(in, n);
    ir::HostTensor& t = batch.tensors[i];
    // Reuse storage across batches when the shape is unchanged (the common case).
    if (t.view.dtype != in.type.dtype() || t.view.shape != shape || t.storage.size() != static_cast<size_t>(t.view.bytes()))
      t.reset(in.type.dtype(), std::move(shape));
  }
}

void assembleBatch(const BatchSpec& spec, const RawSample* s, int64_t n, Batch& batch) {
  allocateBatch(spec, n, batch);
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const InputSpec& in = spec.inputs[i];
    ir::HostTensor& t = batch.tensors[i];
    switch (in.role) {
      case InputRole::Dense: {
        float* d = t.as<float>();
        for (int64_t r = 0; r < n; ++r)
          for (int j = 0; j < in.dense_count; ++j) d[r * in.dense_count + j] = s[r].dense[j];
        break;
      }
      case InputRole::Label: {
        float* d = t.as<float>();
        for (int64_t r = 0; r < n; ++r) d[r] = s[r].label;
        break;
      }
      case InputRole::Sparse: {
        int32_t* lengths = nullptr;
        if (in.variableLength()) {
          ir::HostTensor& lt = batch.tensors[static_cast<size_t>(in.lengths_input)];
          lt.reset(ir::DType::i32, {n});
          lengths = lt.as<int32_t>();
          t.reset(in.type.dtype(), {n});  // one id per sample
        }
        if (in.type.dtype() == ir::DType::i64)
          writeIds(in, s, n, t.as<int64_t>(), lengths);
        else
          writeIds(in, s, n, t.as<int32_t>(), lengths);
        break;
      }
      case InputRole::Lengths: break;  // written with the ids
      case InputRole::Weights: break;  // below, once the ids are sized
      case InputRole::Tokens:
      case InputRole::Targets:
        break;  // token streams fill these (token_source.h), not Criteo samples
    }
  }
  fillUnitWeights(spec, batch);
}

void fillUnitWeights(const BatchSpec& spec, Batch& batch) {
  for (const InputSpec& ids : spec.inputs) {
    if (ids.role != InputRole::Sparse || ids.weights_input < 0) continue;
    const int ids_index = spec.indexOf(ids.name);
    ir::HostTensor& t = batch.tensors[static_cast<size_t>(ids.weights_input)];
    t.reset(ir::DType::f32, batch.tensors[static_cast<size_t>(ids_index)].view.shape);
    float* w = t.as<float>();
    for (int64_t k = 0; k < t.numel(); ++k) w[k] = 1.0f;
  }
}

}  // namespace kiln::data
