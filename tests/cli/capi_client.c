/* A C client of `kiln compile --emit lib` (tests/cli/capi_test.py builds it against NAME.h and
 * libNAME.so). For a model of the Criteo layout with one id per feature (tests' tiny model), it
 * makes N samples, writes them as a Criteo TSV file (so that `kiln` reads the very same values)
 * and feeds them to the C API:
 *
 *   capi_client predict WEIGHTS|- DATA.tsv SCORES N BATCH ID_BOUND
 *     scores = sigmoid(kiln_predict) per sample, printed as kiln predict prints them; and the same
 *     predictions from two more handles on two threads at once, which must equal the first.
 *   capi_client train WEIGHTS|- DATA.tsv DIR N BATCH ID_BOUND SEED
 *     N / BATCH optimizer steps in order (seeded parameters unless WEIGHTS), then kiln_save(DIR).
 *   capi_client errors
 *     bad arguments are error codes with messages, never a crash.
 *   capi_client misuse
 *     threads out of range, a double kiln_destroy, calls after it, a pointer that is no handle and
 *     one handle shared by threads (destroyed meanwhile too): error codes, never a crash.
 *
 * WEIGHTS "-" means none (embedded weights, or parameters from the seed). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

#define CHECK(call)                                                                            \
  do {                                                                                         \
    kiln_status st_ = (call);                                                                  \
    if (st_ != KILN_OK) {                                                                      \
      fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, kiln_status_name(st_), \
              kiln_last_error());                                                              \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

enum { kDense = 13, kSparse = 26 };

typedef struct {
  int64_t n;
  float label[1 << 16];
  uint64_t dense_raw[1 << 16][kDense];
  uint64_t cat[1 << 16][kSparse];
} Samples;

static Samples samples;

static uint64_t next(uint64_t* s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

static void makeSamples(int64_t n, uint64_t id_bound, const char* tsv_path) {
  uint64_t s = 12345;
  FILE* f = fopen(tsv_path, "w");
  if (!f) {
    perror(tsv_path);
    exit(1);
  }
  samples.n = n;
  for (int64_t i = 0; i < n; ++i) {
    samples.label[i] = (float)(next(&s) % 2);
    fprintf(f, "%d", (int)samples.label[i]);
    for (int j = 0; j < kDense; ++j) {
      samples.dense_raw[i][j] = next(&s) % 1000;
      fprintf(f, "\t%llu", (unsigned long long)samples.dense_raw[i][j]);
    }
    for (int j = 0; j < kSparse; ++j) {
      samples.cat[i][j] = next(&s) % id_bound;
      fprintf(f, "\t%llx", (unsigned long long)samples.cat[i][j]);
    }
    fprintf(f, "\n");
  }
  fclose(f);
}

/* Every input of samples [first, first + n), as the model declares them. */
typedef struct {
  int count;
  void* buf[64];
} Inputs;

static void fillInputs(kiln_model* m, int64_t first, int64_t n, Inputs* in) {
  in->count = kiln_num_inputs(m);
  for (int i = 0; i < in->count; ++i) {
    kiln_input_info info;
    CHECK(kiln_input(m, i, &info));
    size_t elem = info.dtype == KILN_I64 || info.dtype == KILN_F64 ? 8 : 4;
    in->buf[i] = calloc((size_t)(n * info.per_sample), elem);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t k = first + r;
      for (int64_t c = 0; c < info.per_sample; ++c) {
        const int64_t at = r * info.per_sample + c;
        if (info.role == KILN_ROLE_DENSE && info.dtype == KILN_F32 && info.per_sample <= kDense) {
          ((float*)in->buf[i])[at] = (float)log1p((double)samples.dense_raw[k][c]);
        } else if (info.role == KILN_ROLE_LABEL && info.dtype == KILN_F32) {
          ((float*)in->buf[i])[at] = samples.label[k];
        } else if (info.role == KILN_ROLE_SPARSE && info.per_sample == 1 && info.feature >= 0 &&
                   info.feature < kSparse) {
          if (info.dtype == KILN_I64)
            ((int64_t*)in->buf[i])[at] = (int64_t)samples.cat[k][info.feature];
          else
            ((int32_t*)in->buf[i])[at] = (int32_t)samples.cat[k][info.feature];
        } else {
          fprintf(stderr, "input %s: a layout this client does not make\n", info.name);
          exit(1);
        }
      }
    }
  }
}

static void freeInputs(Inputs* in) {
  for (int i = 0; i < in->count; ++i) free(in->buf[i]);
}

static kiln_model* openModel(const char* weights) {
  kiln_options o;
  kiln_options_init(&o);
  if (strcmp(weights, "-") != 0) o.weights = weights;
  kiln_model* m = NULL;
  CHECK(kiln_create(&o, &m));
  return m;
}

typedef struct {
  const char* weights;
  int64_t batch;
  float* out; /* n * output_size */
  int failed;
} Job;

static void* predictAll(void* arg) {
  Job* job = (Job*)arg;
  kiln_model* m = openModel(job->weights);
  const int64_t width = kiln_output_size(m);
  for (int64_t first = 0; first < samples.n; first += job->batch) {
    const int64_t n = samples.n - first < job->batch ? samples.n - first : job->batch;
    Inputs in;
    fillInputs(m, first, n, &in);
    if (kiln_predict(m, n, (const void* const*)in.buf, job->out + first * width) != KILN_OK) {
      fprintf(stderr, "kiln_predict: %s\n", kiln_last_error());
      job->failed = 1;
    }
    freeInputs(&in);
  }
  kiln_destroy(m);
  return NULL;
}

static int predict(char** argv) {
  const char* weights = argv[2];
  const int64_t n = atoll(argv[5]), batch = atoll(argv[6]);
  makeSamples(n, (uint64_t)atoll(argv[7]), argv[3]);
  kiln_model* probe = openModel(weights);
  if (kiln_max_batch(probe) != MODEL_MAX_BATCH || kiln_num_inputs(probe) != MODEL_NUM_INPUTS) {
    fprintf(stderr, "the handle disagrees with model.h\n");
    return 1;
  }
  const int64_t width = kiln_output_size(probe);
  kiln_destroy(probe);
  if (width != 1) {
    fprintf(stderr, "expected one logit per sample, got %lld\n", (long long)width);
    return 1;
  }
  Job first = {weights, batch, calloc((size_t)n, sizeof(float)), 0};
  predictAll(&first);
  /* Two more handles at once, on two threads: the same predictions. */
  Job jobs[2] = {{weights, batch, calloc((size_t)n, sizeof(float)), 0},
                 {weights, batch, calloc((size_t)n, sizeof(float)), 0}};
  pthread_t threads[2];
  for (int t = 0; t < 2; ++t) pthread_create(&threads[t], NULL, predictAll, &jobs[t]);
  for (int t = 0; t < 2; ++t) pthread_join(threads[t], NULL);
  if (first.failed || jobs[0].failed || jobs[1].failed) return 1;
  for (int t = 0; t < 2; ++t)
    if (memcmp(first.out, jobs[t].out, (size_t)n * sizeof(float)) != 0) {
      fprintf(stderr, "thread %d's predictions differ from the first handle's\n", t);
      return 1;
    }
  FILE* f = fopen(argv[4], "w");
  for (int64_t i = 0; i < n; ++i) fprintf(f, "%.9g\n", (double)(1.0f / (1.0f + expf(-first.out[i]))));
  fclose(f);
  return 0;
}

static int train(char** argv) {
  const int64_t n = atoll(argv[5]), batch = atoll(argv[6]);
  makeSamples(n, (uint64_t)atoll(argv[7]), argv[3]);
  kiln_options o;
  kiln_options_init(&o);
  if (strcmp(argv[2], "-") != 0) o.weights = argv[2];
  o.seed = (uint64_t)atoll(argv[8]);
  kiln_model* m = NULL;
  CHECK(kiln_create(&o, &m));
  for (int64_t first = 0; first + batch <= n; first += batch) {
    Inputs in;
    fillInputs(m, first, batch, &in);
    float loss = 0;
    CHECK(kiln_train_step(m, batch, (const void* const*)in.buf, &loss));
    printf("step %lld loss %.9g\n", (long long)(first / batch + 1), (double)loss);
    freeInputs(&in);
  }
  CHECK(kiln_save(m, argv[4]));
  kiln_destroy(m);
  return 0;
}

static int expect(kiln_status got, kiln_status want, const char* what) {
  if (got != want) {
    fprintf(stderr, "%s: got %s, want %s\n", what, kiln_status_name(got), kiln_status_name(want));
    return 1;
  }
  if (want != KILN_OK && kiln_last_error()[0] == '\0') {
    fprintf(stderr, "%s: no message\n", what);
    return 1;
  }
  printf("%s: %s: %s\n", what, kiln_status_name(got), kiln_last_error());
  return 0;
}

static int errors(void) {
  int bad = 0;
  kiln_model* m = NULL;
  bad |= expect(kiln_create(NULL, NULL), KILN_INVALID_ARGUMENT, "create without out");
  kiln_options o;
  kiln_options_init(&o);
  o.weights = "/nonexistent/checkpoint";
  bad |= expect(kiln_create(&o, &m), KILN_IO_ERROR, "missing weights");
  o.weights = NULL;
  o.device = "tpu";
  bad |= expect(kiln_create(&o, &m), KILN_INVALID_ARGUMENT, "unknown device");
  m = openModel("-");
  makeSamples(4, 2, "/dev/null");
  Inputs in;
  fillInputs(m, 0, 4, &in);
  float out[MODEL_MAX_BATCH + 1];
  bad |= expect(kiln_predict(m, 0, (const void* const*)in.buf, out), KILN_INVALID_ARGUMENT, "batch 0");
  bad |= expect(kiln_predict(m, MODEL_MAX_BATCH + 1, (const void* const*)in.buf, out), KILN_INVALID_ARGUMENT,
                "batch over the max");
  bad |= expect(kiln_predict(m, 4, NULL, out), KILN_INVALID_ARGUMENT, "no inputs");
  kiln_input_info info;
  bad |= expect(kiln_input(m, MODEL_NUM_INPUTS, &info), KILN_INVALID_ARGUMENT, "input index out of range");
  /* A NaN or an infinity among the dense features is the caller's error, named; the label is not
   * read by kiln_predict, but kiln_train_step refuses a NaN there too. */
  for (int i = 0; i < in.count; ++i) {
    CHECK(kiln_input(m, i, &info));
    if (info.role != KILN_ROLE_DENSE || info.dtype != KILN_F32) continue;
    float* dense = (float*)in.buf[i];
    const float keep = dense[info.per_sample + 2];
    dense[info.per_sample + 2] = NAN;
    bad |= expect(kiln_predict(m, 4, (const void* const*)in.buf, out), KILN_INVALID_ARGUMENT, "NaN dense input");
    if (!strstr(kiln_last_error(), "sample 1")) {
      fprintf(stderr, "NaN dense input: the message does not name sample 1: %s\n", kiln_last_error());
      bad = 1;
    }
    dense[info.per_sample + 2] = INFINITY;
    bad |= expect(kiln_predict(m, 4, (const void* const*)in.buf, out), KILN_INVALID_ARGUMENT,
                  "infinite dense input");
    dense[info.per_sample + 2] = keep;
  }
  for (int i = 0; i < in.count; ++i) {
    CHECK(kiln_input(m, i, &info));
    if (info.role == KILN_ROLE_LABEL && info.dtype == KILN_F32) ((float*)in.buf[i])[3] = NAN;
  }
  bad |= expect(kiln_train_step(m, 4, (const void* const*)in.buf, NULL), KILN_INVALID_ARGUMENT, "NaN label");
  for (int i = 0; i < in.count; ++i) {
    CHECK(kiln_input(m, i, &info));
    if (info.role == KILN_ROLE_LABEL && info.dtype == KILN_F32) ((float*)in.buf[i])[3] = 0.0f;
  }
  /* An id out of its table's range is the runtime's error, named, not a crash. */
  for (int i = 0; i < in.count; ++i) {
    CHECK(kiln_input(m, i, &info));
    if (info.role == KILN_ROLE_SPARSE && info.dtype == KILN_I64) ((int64_t*)in.buf[i])[0] = 1000000000;
    if (info.role == KILN_ROLE_SPARSE && info.dtype == KILN_I32) ((int32_t*)in.buf[i])[0] = 1000000000;
  }
  bad |= expect(kiln_predict(m, 4, (const void* const*)in.buf, out), KILN_RUNTIME_ERROR, "id out of range");
  bad |= expect(kiln_save(m, "/proc/kiln-cannot-write-here"), KILN_IO_ERROR, "unwritable save");
  freeInputs(&in);
  kiln_destroy(m);
  return bad;
}

/* One handle shared by threads (misuse the library must survive): each call either runs or is
 * refused as overlapping another; what runs predicts what one thread alone predicts. With
 * `destroyer`, the main thread destroys the handle meanwhile: calls after that are refused as not
 * a live handle. */
typedef struct {
  kiln_model* m;
  const float* want; /* 4 logits */
  Inputs in;
  int calls, ran, overlapped, gone, wrong;
} Sharer;

static atomic_int share_ready, share_go, share_ran;

static void* share(void* arg) {
  Sharer* s = (Sharer*)arg;
  atomic_fetch_add(&share_ready, 1);
  while (!atomic_load(&share_go)) {
  }
  for (int k = 0; k < s->calls; ++k) {
    float out[4];
    const kiln_status st = kiln_predict(s->m, 4, (const void* const*)s->in.buf, out);
    if (st == KILN_OK) {
      ++s->ran;
      atomic_fetch_add(&share_ran, 1);
      if (memcmp(out, s->want, sizeof out) != 0) ++s->wrong;
    } else if (st == KILN_INVALID_ARGUMENT && strstr(kiln_last_error(), "another call is using")) {
      ++s->overlapped;
    } else if (st == KILN_INVALID_ARGUMENT && strstr(kiln_last_error(), "not a live kiln_model handle")) {
      ++s->gone;
    } else {
      fprintf(stderr, "shared handle: %s: %s\n", kiln_status_name(st), kiln_last_error());
      ++s->wrong;
    }
  }
  return NULL;
}

static int sharedHandle(int destroy) {
  kiln_model* m = openModel("-");
  float want[4];
  enum { kThreads = 4 };
  Sharer sharers[kThreads];
  pthread_t threads[kThreads];
  atomic_store(&share_ready, 0);
  atomic_store(&share_go, 0);
  atomic_store(&share_ran, 0);
  for (int t = 0; t < kThreads; ++t) {
    sharers[t] = (Sharer){m, want, {0, {NULL}}, 200, 0, 0, 0, 0};
    fillInputs(m, 0, 4, &sharers[t].in);
    pthread_create(&threads[t], NULL, share, &sharers[t]);
  }
  CHECK(kiln_predict(m, 4, (const void* const*)sharers[0].in.buf, want));
  /* All threads call at once, and the destroyer with them. */
  while (atomic_load(&share_ready) < kThreads) {
  }
  atomic_store(&share_go, 1);
  int destroy_refused = 0;
  if (destroy) {
    /* Once a call has run: refused while one runs; once it succeeds, the handle is gone for every
     * thread. */
    while (atomic_load(&share_ran) == 0) {
    }
    for (;;) {
      const kiln_status st = kiln_destroy(m);
      if (st == KILN_OK) break;
      if (st != KILN_INVALID_ARGUMENT || !strstr(kiln_last_error(), "another call is using")) {
        fprintf(stderr, "destroy during calls: %s: %s\n", kiln_status_name(st), kiln_last_error());
        return 1;
      }
      ++destroy_refused;
    }
  }
  int ran = 0, overlapped = 0, gone = 0, wrong = 0;
  for (int t = 0; t < kThreads; ++t) {
    pthread_join(threads[t], NULL);
    ran += sharers[t].ran;
    overlapped += sharers[t].overlapped;
    gone += sharers[t].gone;
    wrong += sharers[t].wrong;
    freeInputs(&sharers[t].in);
  }
  if (!destroy) CHECK(kiln_destroy(m));
  printf("%s: %d ran, %d refused as overlapping, %d refused as destroyed, %d destroys refused\n",
         destroy ? "shared handle destroyed meanwhile" : "shared handle", ran, overlapped, gone, destroy_refused);
  if (wrong || ran + overlapped + gone != kThreads * 200 || ran == 0 || (!destroy && gone != 0)) {
    fprintf(stderr, "shared handle: %d calls went wrong\n", wrong);
    return 1;
  }
  return 0;
}

static int misuse(void) {
  int bad = 0;
  kiln_options o;
  kiln_options_init(&o);
  kiln_model* m = NULL;
  /* As the CLI's --threads [1, 1024] (0 is the default, 1). */
  o.threads = -5;
  bad |= expect(kiln_create(&o, &m), KILN_INVALID_ARGUMENT, "threads out of range (-5)");
  o.threads = 100000;
  bad |= expect(kiln_create(&o, &m), KILN_INVALID_ARGUMENT, "threads out of range (100000)");
  if (m != NULL) {
    fprintf(stderr, "a refused kiln_create left a handle\n");
    bad = 1;
  }
  o.threads = 0;
  CHECK(kiln_create(&o, &m));
  makeSamples(4, 2, "/dev/null");
  Inputs in;
  fillInputs(m, 0, 4, &in);
  float out[4];
  bad |= expect(kiln_destroy(m), KILN_OK, "destroy");
  /* The handle's memory is freed: the library must recognise the pointer without reading it. */
  bad |= expect(kiln_destroy(m), KILN_INVALID_ARGUMENT, "double destroy");
  bad |= expect(kiln_predict(m, 4, (const void* const*)in.buf, out), KILN_INVALID_ARGUMENT,
                "use after destroy (predict)");
  bad |= expect(kiln_train_step(m, 4, (const void* const*)in.buf, NULL), KILN_INVALID_ARGUMENT,
                "use after destroy (train_step)");
  bad |= expect(kiln_save(m, "unused"), KILN_INVALID_ARGUMENT, "use after destroy (save)");
  kiln_input_info info;
  bad |= expect(kiln_input(m, 0, &info), KILN_INVALID_ARGUMENT, "use after destroy (input)");
  if (kiln_max_batch(m) != 0 || kiln_num_inputs(m) != 0 || kiln_output_size(m) != 0 ||
      strcmp(kiln_model_name(m), "") != 0 || !strstr(kiln_last_error(), "not a live")) {
    fprintf(stderr, "use after destroy: the accessors answered for a destroyed handle\n");
    bad = 1;
  } else {
    printf("use after destroy (accessors): 0 and \"\": %s\n", kiln_last_error());
  }
  /* A pointer kiln_create never returned. */
  bad |= expect(kiln_predict((kiln_model*)&o, 4, (const void* const*)in.buf, out), KILN_INVALID_ARGUMENT,
                "not a handle");
  bad |= expect(kiln_destroy(NULL), KILN_OK, "destroy NULL");
  freeInputs(&in);
  bad |= sharedHandle(0);
  bad |= sharedHandle(1);
  return bad;
}

int main(int argc, char** argv) {
  if (argc >= 8 && strcmp(argv[1], "predict") == 0) return predict(argv);
  if (argc >= 9 && strcmp(argv[1], "train") == 0) return train(argv);
  if (argc >= 2 && strcmp(argv[1], "errors") == 0) return errors();
  if (argc >= 2 && strcmp(argv[1], "misuse") == 0) return misuse();
  fprintf(stderr, "usage: capi_client predict|train|errors|misuse ...\n");
  return 2;
}
