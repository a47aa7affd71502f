// Pooled embedding lookup, threaded over samples: each thread owns whole output rows, so no
// two threads write the same memory. f32 or bf16 tables, f32 accumulation, i32 or i64 ids.
#include <algorithm>
#include <atomic>
#include <mutex>

#include <fmt/format.h>

#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

inline int64_t loadId(const ir::TensorView& v, int64_t i) {
  return v.dtype == ir::DType::i32 ? v.as<int32_t>()[i] : v.as<int64_t>()[i];
}

Status runEmbeddingBag(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                       const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  const ir::TensorView& table = *in[0];
  const ir::TensorView& ids = *in[1];
  const int64_t rows = table.shape[0], dim = table.shape[1];
  const bool jagged = ids.rank() == 1;
  const ir::TensorView* weights = nullptr;
  std::vector<int64_t> offsets;  // bag b holds ids [offsets[b], offsets[b + 1])
  int64_t batch;
  std::string table_name = op.strAttr("table");
  std::string what = table_name.empty() ? "'kiln.embedding_bag'" : fmt::format("'kiln.embedding_bag' (table \"{}\")", table_name);
  if (jagged) {
    const ir::TensorView& lengths = *in[2];
    if (in.size() > 3) weights = in[3];
    batch = lengths.shape[0];
    offsets.resize(static_cast<size_t>(batch) + 1, 0);
    for (int64_t b = 0; b < batch; ++b) {
      int64_t len = loadId(lengths, b);
      if (len < 0) return Status::errorf("{}: sample {} has negative length {}", what, b, len);
      offsets[static_cast<size_t>(b) + 1] = offsets[static_cast<size_t>(b)] + len;
    }
    if (offsets.back() != ids.shape[0])
      return Status::errorf("{}: lengths sum to {} but there are {} ids", what, offsets.back(), ids.shape[0]);
  } else {
    if (in.size() > 2) weights = in[2];
    batch = ids.shape[0];
  }
  const int64_t hot = jagged ? 0 : ids.shape[1];
  const bool mean = op.strAttr("mode", "sum") == "mean";
  ir::TensorView& y = *out[0];
  y.shape = {batch, dim};

  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;
  ctx.pool->parallelFor(batch, std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1)), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(static_cast<size_t>(dim));
    for (int64_t b = b0; b < b1 && !failed.load(std::memory_order_relaxed); ++b) {
      int64_t begin = jagged ? offsets[static_cast<size_t>(b)] : b * hot;
      int64_t end = jagged ? offsets[static_cast<size_t>(b) + 1] : begin + hot;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = begin; p < end; ++p) {
        int64_t id = loadId(ids, p);
        if (id < 0 || id >= rows) {
          std::lock_guard<std::mutex> lock(mu);
          if (!failed.exchange(true))
            error = fmt::format("{}: id {} of sample {} is out of range [0, {})", what, id, b, rows);
          return;
        }
        float w = weights ? loadF(weights->data, weights->dtype, p) : 1.0f;
        const int64_t row = id * dim;
        if (table.dtype == ir::DType::f32) {
          const float* t = table.as<float>() + row;
          for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] += w * t[d];
        } else {
          const uint16_t* t = table.as<uint16_t>() + row;
          for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] += w * ir::bf16ToFloat(t[d]);
        }
      }
      float scale = mean && end > begin ? 1.0f / static_cast<float>(end - begin) : 1.0f;
      for (int64_t d = 0; d < dim; ++d) storeF(y.data, y.dtype, b * dim + d, acc[static_cast<size_t>(d)] * scale);
    }
  });
  if (failed) return Status::error(error);
  return Status::ok();
}

bool supportsEmbeddingBag(const ir::Op& op) {
  ir::DType t = op.operand(0)->type().dtype();
  if (!isF32OrBf16(t) || op.result()->type().dtype() != t) return false;
  ir::DType id = op.operand(1)->type().dtype();
  if (id != ir::DType::i32 && id != ir::DType::i64) return false;
  if (op.operand(1)->type().rank() == 1) {
    ir::DType len = op.operand(2)->type().dtype();
    if (len != ir::DType::i32 && len != ir::DType::i64) return false;
  }
  bool has_weights = op.numOperands() == (op.operand(1)->type().rank() == 1 ? 4u : 3u);
  return !has_weights || isF32OrBf16(op.operand(op.numOperands() - 1)->type().dtype());
}

}  // namespace

void registerEmbeddingKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::EmbeddingBag, {"embedding_bag", runEmbeddingBag, supportsEmbeddingBag});
}

}  // namespace kiln::runtime::cpu
