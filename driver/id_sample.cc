#include "driver/id_sample.h"

#include <algorithm>

#include "ir/ops/kernel_util.h"
#include "runtime/data/batch_reader.h"

namespace kiln::driver {

Expected<std::vector<passes::IdSample>> sampleIds(const ir::Module& m, const std::vector<passes::TableInfo>& tables,
                                                  const std::vector<std::string>& paths, int64_t samples) {
  const ir::Function* fwd = m.lookup("forward");
  if (!fwd) return Status::error("--data: the model has no @forward to read the data's inputs from");
  KILN_ASSIGN_OR_RETURN(data::BatchSpec spec, data::fromFunction(*fwd));
  data::DataOptions o;
  o.paths = paths;
  o.batch_size = std::min<int64_t>(samples, 4096);
  o.synthetic_samples = samples;
  KILN_ASSIGN_OR_RETURN(auto reader, data::openBatchReader(spec, o));
  std::vector<passes::IdSample> out(tables.size());
  // Per table: its ids input and that input's lengths (-1: fixed hotness).
  std::vector<int> ids_of(tables.size(), -1), lengths_of(tables.size(), -1);
  for (size_t i = 0; i < tables.size(); ++i)
    if (tables[i].ids_inputs.size() == 1) {
      ids_of[i] = spec.indexOf(tables[i].ids_inputs[0]);
      if (ids_of[i] >= 0) lengths_of[i] = spec.inputs[static_cast<size_t>(ids_of[i])].lengths_input;
    }
  int64_t read = 0;
  data::Batch batch;
  while (read < samples) {
    KILN_ASSIGN_OR_RETURN(bool more, reader->next(batch));
    if (!more) break;
    const int64_t n = std::min(batch.size, samples - read);
    for (size_t i = 0; i < tables.size(); ++i) {
      if (ids_of[i] < 0) continue;
      const ir::TensorView& ids = batch.tensors[static_cast<size_t>(ids_of[i])].view;
      std::vector<int64_t> row;
      int64_t at = 0;
      for (int64_t s = 0; s < n; ++s) {
        int64_t len = ids.shape.size() == 2 ? ids.shape[1] : 1;
        if (lengths_of[i] >= 0)
          len = ir::kernels::loadIndex(batch.tensors[static_cast<size_t>(lengths_of[i])].view, s);
        row.clear();
        for (int64_t k = 0; k < len; ++k) row.push_back(ir::kernels::loadIndex(ids, at + k));
        at += len;
        out[i].addSample(row.data(), len);
      }
    }
    read += n;
  }
  if (read < 2) return Status::errorf("--data: {} sample(s) read; the frequencies need at least 2", read);
  return out;
}

}  // namespace kiln::driver
