// Runs kernel IR on the CPU, one logical thread at a time, with the arithmetic the generated
// CUDA does (f32 compute for f32/bf16 storage, bf16 stores rounded to nearest even, lazily
// evaluated selects, the same hash-table algorithm for embedding gradients). It is the oracle
// that makes the GPU code's math testable on machines without a GPU, and a slow fallback.
#pragma once

#include <vector>

#include "codegen/kernel_ir.h"
#include "codegen/kernel_lowering.h"
#include "ir/status.h"

namespace kiln::codegen {

// buffers[i] points at host memory for k.buffers[i] (k.buffers[i].elements elements of its
// dtype). An out-of-range embedding id sets the kernel's error flag, as on the GPU.
Status interpret(const Kernel& k, const std::vector<void*>& buffers);

// Runs every kernel of a lowered group in order; group_buffers[i] holds g.buffers[i]. Reports
// an embedding id out of range (the error flag) as an error naming the table.
Status interpretGroup(const LoweredGroup& g, const std::vector<void*>& group_buffers);

}  // namespace kiln::codegen
