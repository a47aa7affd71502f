// A tensor in host memory as the CPU kernels see it: element type, concrete shape and a
// pointer to dense row-major data it does not own.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "ir/types.h"

namespace kiln::ir {

struct TensorView {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  void* data = nullptr;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t bytes() const { return numel() * dtypeBytes(dtype); }
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// An owning host tensor (tests, parameters, data batches).
struct HostTensor {
  TensorView view;
  std::vector<unsigned char> storage;  // empty for an external tensor
  std::shared_ptr<const void> keep_alive;

  HostTensor() = default;
  HostTensor(DType t, std::vector<int64_t> shape) { reset(t, std::move(shape)); }
  void reset(DType t, std::vector<int64_t> shape) {
    view.dtype = t;
    view.shape = std::move(shape);
    storage.assign(static_cast<size_t>(view.numel() * dtypeBytes(t)), 0);
    keep_alive.reset();
    view.data = storage.data();
  }
  // A tensor over memory another object owns (a compiled model's mapped weights), which
  // `keep_alive` keeps valid. Writable when that memory is (a private mapping is). Copies of it
  // own their bytes.
  static HostTensor external(DType t, std::vector<int64_t> shape, void* data,
                             std::shared_ptr<const void> keep_alive) {
    HostTensor h;
    h.view = TensorView{t, std::move(shape), data};
    h.keep_alive = std::move(keep_alive);
    return h;
  }
  bool isExternal() const { return keep_alive != nullptr; }
  HostTensor(const HostTensor& o) { *this = o; }
  HostTensor& operator=(const HostTensor& o) {
    if (this == &o) return *this;
    if (o.isExternal()) {
      const auto* p = static_cast<const unsigned char*>(o.view.data);
      storage.assign(p, p + o.view.bytes());
    } else {
      storage = o.storage;
    }
    keep_alive.reset();
    view = o.view;
    view.data = storage.data();
    return *this;
  }
  HostTensor(HostTensor&&) = default;
  HostTensor& operator=(HostTensor&&) = default;

  template <typename T>
  T* as() {
    return view.as<T>();
  }
  template <typename T>
  const T* as() const {
    return view.as<T>();
  }
  int64_t numel() const { return view.numel(); }
};

// bf16 and f16 conversions (round to nearest even), for bf16 storage with f32 compute.
inline uint16_t floatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16ToFloat(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace kiln::ir
