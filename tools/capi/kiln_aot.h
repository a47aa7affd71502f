/* The C API of a model compiled ahead of time: `kiln compile MODEL.kiln -o NAME --emit lib` writes
 * libNAME.so (this API, the Kiln runtime and the model's payload) and NAME.h (this header and the
 * model's own constants). docs/aot.md has a complete example.
 *
 * A handle (kiln_model) owns one session of the model: its parameters, the executors of each batch
 * size it has seen, its own copy of the embedded weights. Calls on one handle must not overlap;
 * separate handles may be used from separate threads at the same time.
 *
 * Handles are checked: the library keeps a registry of live handles and looks a pointer up there
 * before it touches it, so a destroyed handle (a second kiln_destroy, a call after it) or a pointer
 * kiln_create never returned is KILN_INVALID_ARGUMENT, as is a kiln_predict, kiln_train_step,
 * kiln_save or kiln_destroy on a handle another thread's call is using at that moment (the calls
 * are refused, not queued: use one handle per thread). The accessors (kiln_model_name,
 * kiln_max_batch, kiln_num_inputs, kiln_output_size) then return "" or 0 and set the message.
 * What cannot be caught: a stale pointer whose address a later kiln_create happened to reuse names
 * that new handle, and calls through it act on that handle; a live handle whose memory the caller
 * overwrote is caught only where the overwrite reached its check word.
 *
 * Every call that can fail returns a kiln_status; KILN_OK is 0. kiln_last_error() then gives the
 * message of the calling thread's last failure ("" when there was none), valid until that
 * thread's next call into this library.
 *
 * Inputs are the model's declared inputs (`input dense: f32[B, 13]`), in declaration order, as
 * kiln_input() describes them: each a caller-owned, row-major buffer of `batch * per_sample`
 * elements of its dtype. A variable-length sparse input holds each sample's ids packed one after
 * another (per_sample is then its max_hotness: the buffer is sized for the bound) with the counts in
 * its lengths input. A floating-point input holding a NaN or an infinity is KILN_INVALID_ARGUMENT
 * (the message names the input, the sample and the value's place in it). */
#ifndef KILN_AOT_H_
#define KILN_AOT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KILN_AOT_EXPORT __attribute__((visibility("default")))
#else
#define KILN_AOT_EXPORT
#endif

/* 2: kiln_destroy returns a kiln_status; handles are checked; options.threads is checked. */
#define KILN_AOT_API_VERSION 2

typedef enum kiln_status {
  KILN_OK = 0,
  KILN_INVALID_ARGUMENT = 1, /* a null pointer, an index or batch out of range, a bad option */
  KILN_BAD_PAYLOAD = 2,      /* the library's payload is damaged, foreign or of another version */
  KILN_IO_ERROR = 3,         /* a weights file that cannot be read, a directory that cannot be written */
  KILN_UNSUPPORTED = 4,      /* a function compiled out (--functions), a device not in the payload */
  KILN_RUNTIME_ERROR = 5     /* the run failed: an id out of range, out of memory, a GPU error */
} kiln_status;

typedef enum kiln_dtype {
  KILN_F32 = 0,
  KILN_F64 = 1,
  KILN_BF16 = 2,
  KILN_F16 = 3,
  KILN_I32 = 4,
  KILN_I64 = 5
} kiln_dtype;

/* What an input carries (the `role` of its declaration). */
typedef enum kiln_role {
  KILN_ROLE_DENSE = 0,
  KILN_ROLE_LABEL = 1, /* read by training and evaluation; kiln_predict ignores it (may be NULL) */
  KILN_ROLE_SPARSE = 2,
  KILN_ROLE_LENGTHS = 3,
  KILN_ROLE_WEIGHTS = 4,
  KILN_ROLE_TOKENS = 5,
  KILN_ROLE_TARGETS = 6
} kiln_role;

typedef struct kiln_model kiln_model;

typedef struct kiln_options {
  /* A checkpoint to load: a directory holding checkpoint.safetensors, or the file. NULL: the
   * embedded weights when the library has them, else parameters initialised from `seed`. */
  const char* weights;
  /* "cpu", "cuda" or NULL (the default: cpu). */
  const char* device;
  int threads;   /* CPU threads of this handle's executors, 0 to 1024; 0 = 1 */
  uint64_t seed; /* parameter initialisation when nothing is loaded */
} kiln_options;

typedef struct kiln_input_info {
  const char* name; /* owned by the handle */
  kiln_dtype dtype;
  kiln_role role;
  int64_t per_sample; /* elements per sample */
  int feature;  /* sparse, lengths, weights: the Criteo categorical feature read (0..25); -1 otherwise */
  int64_t rows; /* sparse: the rows of its table (ids lie in [0, rows)); 0 otherwise */
} kiln_input_info;

/* Fills `options` with the defaults. */
KILN_AOT_EXPORT void kiln_options_init(kiln_options* options);

/* Opens a handle on the model this library holds. `options` may be NULL (the defaults). */
KILN_AOT_EXPORT kiln_status kiln_create(const kiln_options* options, kiln_model** out);
/* Frees the handle; NULL is KILN_OK (as free(NULL)). A handle already destroyed, or one a call on
 * another thread is using, is KILN_INVALID_ARGUMENT and nothing is freed. */
KILN_AOT_EXPORT kiln_status kiln_destroy(kiln_model* model);

/* The calling thread's last error message, or "". */
KILN_AOT_EXPORT const char* kiln_last_error(void);
/* "KILN_OK", "KILN_INVALID_ARGUMENT", ... */
KILN_AOT_EXPORT const char* kiln_status_name(kiln_status status);

KILN_AOT_EXPORT const char* kiln_model_name(const kiln_model* model);
/* The largest batch any call takes (kiln compile --max-batch). */
KILN_AOT_EXPORT int64_t kiln_max_batch(const kiln_model* model);
KILN_AOT_EXPORT int kiln_num_inputs(const kiln_model* model);
KILN_AOT_EXPORT kiln_status kiln_input(const kiln_model* model, int index, kiln_input_info* out);
/* Values per sample kiln_predict writes (1 for a click model's logit). */
KILN_AOT_EXPORT int64_t kiln_output_size(const kiln_model* model);

/* The forward pass on `batch` samples (1 to kiln_max_batch): `inputs[i]` is input i's buffer;
 * writes batch * kiln_output_size() floats to `out`: the model's prediction output as it is (a
 * click model's logits, before the sigmoid). */
KILN_AOT_EXPORT kiln_status kiln_predict(kiln_model* model, int64_t batch, const void* const* inputs,
                                         float* out);

/* One optimizer step on `batch` samples, labels included; `loss` (may be NULL) receives the
 * step's loss. Steps are numbered from 1 per handle (the learning-rate schedule follows them). */
KILN_AOT_EXPORT kiln_status kiln_train_step(kiln_model* model, int64_t batch, const void* const* inputs,
                                            float* loss);

/* Writes DIR/checkpoint.safetensors (temporary file, then rename), which kiln and ./NAME load. */
KILN_AOT_EXPORT kiln_status kiln_save(kiln_model* model, const char* dir);

#ifdef __cplusplus
}
#endif

#endif /* KILN_AOT_H_ */
