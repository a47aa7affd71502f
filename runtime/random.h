// Deterministic, counter-based random numbers for parameter initialization. Element i of a
// tensor draws from splitmix64(key + i * golden), so values depend only on (seed, name, i):
// never on op order, thread count or how the work is split.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kiln::runtime {

// FNV-1a, 64 bits: parameter names here, the binary data header's checksum, the first block of a
// data file that resume compares (runtime/run_inputs.h).
inline uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// FNV-1a of the name, mixed with the run's seed.
inline uint64_t parameterSeed(uint64_t run_seed, std::string_view name) {
  return splitmix64(splitmix64(run_seed) ^ fnv1a64(name.data(), name.size()));
}

class CounterRng {
 public:
  explicit CounterRng(uint64_t key) : key_(key) {}
  uint64_t bits(uint64_t counter) const { return splitmix64(key_ ^ (counter * 0xd1342543de82ef95ull)); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform(uint64_t counter) const { return static_cast<double>(bits(counter) >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller over counters 2i and 2i+1.
  double normal(uint64_t i) const {
    double u1 = 1.0 - uniform(2 * i);  // (0, 1]: log is finite
    double u2 = uniform(2 * i + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t key_;
};

}  // namespace kiln::runtime
