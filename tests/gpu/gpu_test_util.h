// What every `gpu` test shares: skipping cleanly on a machine without a GPU.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "runtime/cuda/cuda_driver.h"

// Skips the current test when no usable GPU is present, saying why.
#define SKIP_WITHOUT_GPU()                                             \
  do {                                                                 \
    std::string why;                                                   \
    if (!kiln::cuda::cudaAvailable(&why)) GTEST_SKIP() << "no GPU: " << why; \
  } while (0)
