// The counter-based random numbers of Kiln's random ops (ir/ops/random.cc): no generator state,
// each number a pure function of its coordinates, so a training step's draws depend only on
// (run seed, step, op salt, element index). Resuming at step s redraws step s's numbers.
#pragma once

#include <cstdint>

namespace kiln::ir {

// The splitmix64 finalizer (Steele, Lea, Flood 2014): a bijective 64-bit mix.
uint64_t splitMix64(uint64_t z);
// The stream of one op at one step of a run.
uint64_t randomStream(uint64_t seed, int64_t step, int64_t salt);
// Element `index` of a stream, uniform in [0, 1) with 53 random bits.
double uniformAt(uint64_t stream, int64_t index);
// Whether dropout with probability p keeps element `index`: uniformAt(stream, index) >= p.
bool dropoutKeeps(uint64_t stream, int64_t index, double p);

// Hashed id crosses (kiln.hash_cross): the running hash starts at hashCrossStart(salt) and takes
// each feature's id by h = hashMix(h, id); the crossed id is crossBucket(h, buckets), in
// [0, buckets). The CUDA lowering computes the same numbers with the kernel function HashMix.
uint64_t hashCrossStart(int64_t salt);
uint64_t hashMix(uint64_t h, int64_t id);
int64_t crossBucket(uint64_t h, int64_t buckets);

}  // namespace kiln::ir
