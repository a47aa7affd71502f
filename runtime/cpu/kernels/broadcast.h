// Numpy broadcasting over concrete shapes, as an iteration space: result dims of size 1 are
// dropped and adjacent dims that every operand walks the same way are merged, so the common
// cases ([B, N] + [N], [B, N] * [B, 1], same-shape) become a few long contiguous rows.
#pragma once

#include <cstdint>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ir/status.h"

namespace kiln::runtime::cpu {

inline Expected<std::vector<int64_t>> broadcastConcrete(const std::vector<const std::vector<int64_t>*>& shapes) {
  size_t rank = 0;
  for (const auto* s : shapes) rank = std::max(rank, s->size());
  std::vector<int64_t> out(rank, 1);
  for (const auto* s : shapes) {
    size_t pad = rank - s->size();
    for (size_t i = 0; i < s->size(); ++i) {
      int64_t d = (*s)[i], &o = out[pad + i];
      if (d == o || d == 1) continue;
      if (o != 1) return Status::errorf("shapes [{}] do not broadcast at run time", fmt::join(*s, ", "));
      o = d;
    }
  }
  return out;
}

class BroadcastIter {
 public:
  BroadcastIter(const std::vector<int64_t>& result, const std::vector<const std::vector<int64_t>*>& operands) {
    const size_t rank = result.size(), n = operands.size();
    // Contiguous strides of each operand in result coordinates (0 where it broadcasts).
    std::vector<std::vector<int64_t>> full(n, std::vector<int64_t>(rank, 0));
    for (size_t k = 0; k < n; ++k) {
      const auto& s = *operands[k];
      size_t pad = rank - s.size();
      int64_t stride = 1;
      for (size_t i = s.size(); i-- > 0;) {
        full[k][pad + i] = s[i] == 1 ? 0 : stride;
        stride *= s[i];
      }
    }
    strides_.assign(n, {});
    for (size_t i = 0; i < rank; ++i) {
      if (result[i] == 1) continue;
      bool merge = !dims_.empty();
      for (size_t k = 0; k < n && merge; ++k) merge = strides_[k].back() == full[k][i] * result[i];
      if (merge) {
        dims_.back() *= result[i];
        for (size_t k = 0; k < n; ++k) strides_[k].back() = full[k][i];
      } else {
        dims_.push_back(result[i]);
        for (size_t k = 0; k < n; ++k) strides_[k].push_back(full[k][i]);
      }
    }
    if (dims_.empty()) {  // a scalar
      dims_.push_back(1);
      for (auto& s : strides_) s.push_back(0);
    }
    for (int64_t d : result) numel_ *= d;
  }

  int64_t innerSize() const { return dims_.back(); }
  int64_t outerSize() const { return numel_ == 0 ? 0 : numel_ / dims_.back(); }
  int64_t innerStride(size_t operand) const { return strides_[operand].back(); }

  // Start offset of each operand for outer row r (rows in row-major order).
  void rowOffsets(int64_t r, std::vector<int64_t>& offs) const {
    std::fill(offs.begin(), offs.end(), 0);
    for (size_t i = dims_.size() - 1; i-- > 0;) {
      int64_t idx = r % dims_[i];
      r /= dims_[i];
      for (size_t k = 0; k < offs.size(); ++k) offs[k] += idx * strides_[k][i];
    }
  }

 private:
  std::vector<int64_t> dims_;
  std::vector<std::vector<int64_t>> strides_;
  int64_t numel_ = 1;
};

}  // namespace kiln::runtime::cpu
