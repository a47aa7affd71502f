/* Predictions per second through the C API of `kiln compile --emit lib` (bench/aot_cpu.sh builds
 * it against the model's NAME.h, named model.h there). Random valid inputs for every input the
 * model declares (dense values in [0, 5), ids uniform in each table's rows, one id per slot).
 *
 *   aot_capi_bench BATCH SECONDS THREADS
 * prints: batch <B> calls <n> seconds <s> predictions_per_s <p> us_per_call <u> */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "model.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: aot_capi_bench BATCH SECONDS THREADS\n");
    return 2;
  }
  const int64_t batch = atoll(argv[1]);
  const double seconds = atof(argv[2]);
  kiln_options o;
  kiln_options_init(&o);
  o.threads = atoi(argv[3]);
  kiln_model* m = NULL;
  if (kiln_create(&o, &m) != KILN_OK) {
    fprintf(stderr, "kiln_create: %s\n", kiln_last_error());
    return 1;
  }
  const int n = kiln_num_inputs(m);
  void** inputs = calloc((size_t)n, sizeof(void*));
  uint64_t s = 1;
  for (int i = 0; i < n; ++i) {
    kiln_input_info info;
    kiln_input(m, i, &info);
    const int64_t count = batch * info.per_sample;
    const size_t elem = info.dtype == KILN_I64 || info.dtype == KILN_F64 ? 8 : 4;
    inputs[i] = calloc((size_t)count, elem);
    for (int64_t k = 0; k < count; ++k) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const uint64_t r = s >> 33;
      if (info.role == KILN_ROLE_SPARSE && info.dtype == KILN_I64)
        ((int64_t*)inputs[i])[k] = (int64_t)(r % (uint64_t)info.rows);
      else if (info.role == KILN_ROLE_SPARSE && info.dtype == KILN_I32)
        ((int32_t*)inputs[i])[k] = (int32_t)(r % (uint64_t)info.rows);
      else if (info.dtype == KILN_F32)
        ((float*)inputs[i])[k] = (float)(r % 5000) / 1000.0f;
    }
  }
  float* out = calloc((size_t)(batch * kiln_output_size(m)), sizeof(float));
  for (int w = 0; w < 3; ++w)
    if (kiln_predict(m, batch, (const void* const*)inputs, out) != KILN_OK) {
      fprintf(stderr, "kiln_predict: %s\n", kiln_last_error());
      return 1;
    }
  int64_t calls = 0;
  const double start = now();
  double elapsed = 0;
  do {
    kiln_predict(m, batch, (const void* const*)inputs, out);
    ++calls;
    elapsed = now() - start;
  } while (elapsed < seconds);
  printf("batch %lld calls %lld seconds %.3f predictions_per_s %.0f us_per_call %.1f\n", (long long)batch,
         (long long)calls, elapsed, (double)(calls * batch) / elapsed, elapsed / (double)calls * 1e6);
  for (int i = 0; i < n; ++i) free(inputs[i]);
  free(inputs);
  free(out);
  kiln_destroy(m);
  return 0;
}
