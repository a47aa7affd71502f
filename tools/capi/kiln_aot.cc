// The C API of libNAME.so (kiln_aot.h): each handle is a driver::Session opened from the payload
// appended to this very library, as the runner (tools/kiln_runner.cc) opens its own.
#include "tools/capi/kiln_aot.h"

#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "passes/lr_schedule.h"
#include "runtime/checkpoint.h"
#include "runtime/data/sample.h"
#include "runtime/payload.h"
#include "driver/compiled_model.h"
#include "driver/evaluator.h"
#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

thread_local std::string last_error;

kiln_status failWith(kiln_status code, std::string message) {
  last_error = std::move(message);
  return code;
}
kiln_status failWith(kiln_status code, const Status& s) { return failWith(code, s.str()); }

std::optional<kiln_dtype> cDType(ir::DType t) {
  switch (t) {
    case ir::DType::f32:
      return KILN_F32;
    case ir::DType::f64:
      return KILN_F64;
    case ir::DType::bf16:
      return KILN_BF16;
    case ir::DType::f16:
      return KILN_F16;
    case ir::DType::i32:
      return KILN_I32;
    case ir::DType::i64:
      return KILN_I64;
    default:
      return std::nullopt;
  }
}

kiln_role cRole(data::InputRole r) {
  switch (r) {
    case data::InputRole::Dense:
      return KILN_ROLE_DENSE;
    case data::InputRole::Label:
      return KILN_ROLE_LABEL;
    case data::InputRole::Sparse:
      return KILN_ROLE_SPARSE;
    case data::InputRole::Lengths:
      return KILN_ROLE_LENGTHS;
    case data::InputRole::Weights:
      return KILN_ROLE_WEIGHTS;
    case data::InputRole::Tokens:
      return KILN_ROLE_TOKENS;
    case data::InputRole::Targets:
      return KILN_ROLE_TARGETS;
  }
  return KILN_ROLE_DENSE;
}

}  // namespace
}  // namespace kiln::cli

struct kiln_model {
  // kMagic while the handle is live, 0 once kiln_destroy took it: a second line of defence behind
  // the registry (a live handle whose memory the caller overwrote is caught too).
  static constexpr uint64_t kMagic = 0x6b696c6e2d616f74;  // "kiln-aot"
  uint64_t magic = kMagic;
  // A kiln_predict, kiln_train_step or kiln_save is running; guarded by the registry's mutex.
  bool busy = false;
  std::shared_ptr<const kiln::driver::CompiledModel> compiled;
  std::unique_ptr<kiln::driver::Session> session;
  std::vector<kiln_input_info> inputs;  // of @forward, the names pointing into the spec
  int64_t output_size = 0;
  int64_t steps = 0;  // kiln_train_step calls so far
  kiln::ir::AttrDict lr_schedule;
  kiln::data::Batch batch;  // reused across calls
};

namespace kiln::cli {
namespace {

// The first element of a floating-point tensor that is a NaN or an infinity (all exponent bits
// set, in each format), or -1.
int64_t firstNonFinite(const ir::TensorView& v) {
  const int64_t n = v.numel();
  auto scan = [n](const auto* p, auto exponent) -> int64_t {
    for (int64_t k = 0; k < n; ++k) {
      auto bits = p[k];
      if ((bits & exponent) == exponent) return k;
    }
    return -1;
  };
  switch (v.dtype) {
    case ir::DType::f32:
      return scan(static_cast<const uint32_t*>(v.data), uint32_t{0x7f800000});
    case ir::DType::f64:
      return scan(static_cast<const uint64_t*>(v.data), uint64_t{0x7ff0000000000000});
    case ir::DType::bf16:
      return scan(static_cast<const uint16_t*>(v.data), uint16_t{0x7f80});
    case ir::DType::f16:
      return scan(static_cast<const uint16_t*>(v.data), uint16_t{0x7c00});
    default:
      return -1;
  }
}

// Every input's tensor for `n` samples, copied from the caller's buffers in declaration order.
// A missing buffer is an error unless `may_skip` says the input is not read (a label, predicting).
kiln_status fillBatch(kiln_model& m, const data::BatchSpec& spec, int64_t n, const void* const* buffers,
                      bool skip_labels) {
  if (n < 1 || n > m.compiled->max_batch)
    return failWith(KILN_INVALID_ARGUMENT, fmt::format("batch {} is outside 1..{} (kiln compile --max-batch)",
                                                       n, m.compiled->max_batch));
  if (!buffers) return failWith(KILN_INVALID_ARGUMENT, "inputs is NULL");
  data::allocateBatch(spec, n, m.batch);
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const data::InputSpec& in = spec.inputs[i];
    // Inputs are numbered as @forward declares them; training may read them in another order.
    size_t at = m.inputs.size();
    for (size_t j = 0; j < m.inputs.size(); ++j)
      if (in.name == m.inputs[j].name) at = j;
    ir::HostTensor& t = m.batch.tensors[i];
    const bool label = in.role == data::InputRole::Label;
    if (at == m.inputs.size() || !buffers[at]) {
      if (label && skip_labels) {
        std::memset(t.view.data, 0, static_cast<size_t>(t.view.bytes()));
        continue;
      }
      return failWith(KILN_INVALID_ARGUMENT, at == m.inputs.size()
                                                 ? fmt::format("@forward has no input '{}'", in.name)
                                                 : fmt::format("input {} ('{}') is NULL", at, in.name));
    }
    std::memcpy(t.view.data, buffers[at], static_cast<size_t>(t.view.bytes()));
    // A NaN or an infinity gives a NaN or a plausible-looking score, never an error of its own:
    // refused here, as the data readers refuse them in files (a label only where it is read).
    if (label && skip_labels) continue;
    if (const int64_t k = firstNonFinite(t.view); k >= 0) {
      const int64_t per_sample = std::max<int64_t>(t.view.numel() / n, 1);
      return failWith(KILN_INVALID_ARGUMENT,
                      fmt::format("input {} ('{}'): value {} of sample {} is not finite (NaN or infinity)", at,
                                  in.name, k % per_sample, k / per_sample));
    }
  }
  return KILN_OK;
}

// Every live handle. A handle is checked here before it is dereferenced, so a destroyed one, a
// second kiln_destroy or a pointer that never was a handle is an error code, not a read of freed
// memory. What this cannot catch (kiln_aot.h says it): a stale pointer whose address a later
// kiln_create reused names that new handle.
std::mutex registry_mutex;
std::unordered_set<const kiln_model*>& registry() {
  // Never destroyed: a handle may be destroyed from an atexit handler, after static destructors.
  static auto* live = new std::unordered_set<const kiln_model*>;
  return *live;
}

kiln_status notAHandle(const kiln_model* m) {
  return failWith(KILN_INVALID_ARGUMENT,
                  m ? fmt::format("{} is not a live kiln_model handle (destroyed already, or never made by "
                                  "kiln_create)",
                                  static_cast<const void*>(m))
                    : std::string("model is NULL"));
}

// The handle if it is live (caller holds registry_mutex), else nullptr with the error set.
const kiln_model* liveLocked(const kiln_model* m) {
  if (!m || !registry().count(m) || m->magic != kiln_model::kMagic) {
    notAHandle(m);
    return nullptr;
  }
  return m;
}

// Reads of what a handle fixed at creation (its name, inputs, sizes): under the registry's lock,
// so kiln_destroy cannot free the handle meanwhile; they may run while a call uses the handle.
template <typename T, typename F>
T readHandle(const kiln_model* m, T fallback, F&& read) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  last_error.clear();
  return liveLocked(m) ? read(*m) : fallback;
}

// A call that uses the handle's session holds it for its whole run: a second call on the same
// handle from another thread meanwhile is refused (the session is not re-entrant), and so is
// kiln_destroy. Released by ~Use.
class Use {
 public:
  explicit Use(kiln_model* m) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (!liveLocked(m)) return;
    if (m->busy) {
      status_ = failWith(KILN_INVALID_ARGUMENT,
                         "another call is using this handle (calls on one handle must not overlap: use one "
                         "handle per thread)");
      return;
    }
    m->busy = true;
    model_ = m;
    status_ = KILN_OK;
  }
  ~Use() {
    if (!model_) return;
    std::lock_guard<std::mutex> lock(registry_mutex);
    model_->busy = false;
  }
  Use(const Use&) = delete;
  Use& operator=(const Use&) = delete;
  kiln_status status() const { return status_; }

 private:
  kiln_model* model_ = nullptr;
  kiln_status status_ = KILN_INVALID_ARGUMENT;
};

kiln_status create(const kiln_options& o, kiln_model** out) {
  // As the CLI's --threads: a negative count or 100000 threads is a mistake, not a request.
  if (o.threads < 0 || o.threads > 1024)
    return failWith(KILN_INVALID_ARGUMENT,
                    fmt::format("threads must be in [0, 1024] (0 = 1), got {}", o.threads));
  auto self = runtime::sharedObjectPathOf(reinterpret_cast<const void*>(&kiln_create));
  if (!self) return failWith(KILN_BAD_PAYLOAD, self.status());
  // Each handle maps the payload on its own: the embedded weights are a private, copy-on-write
  // mapping, which a handle that trains writes in place.
  auto payload = runtime::Payload::open(*self);
  if (!payload) return failWith(KILN_BAD_PAYLOAD, payload.status());
  auto compiled = driver::loadCompiledModel(std::make_shared<const runtime::Payload>(payload.take()));
  if (!compiled) return failWith(KILN_BAD_PAYLOAD, compiled.status());
  auto m = std::make_unique<kiln_model>();
  m->compiled = compiled.take();
  const driver::CompiledModel& c = *m->compiled;

  driver::SessionOptions so;
  so.model_path = *self;
  so.batch = c.max_batch;
  so.threads = o.threads > 0 ? o.threads : 1;
  so.seed = o.seed;
  so.training = c.has("train");
  so.device = o.device ? o.device : "cpu";
  if (so.device != "cpu" && so.device != "cuda")
    return failWith(KILN_INVALID_ARGUMENT,
                    fmt::format("device must be \"cpu\" or \"cuda\", got \"{}\"", so.device));
  if (o.weights) so.checkpoint_path = o.weights;
  std::ostringstream diag;
  auto session = driver::Session::fromCompiled(m->compiled, so, diag);
  if (!session) return failWith(KILN_UNSUPPORTED, session.status());
  m->session = session.take();
  if (o.weights) {
    if (!std::filesystem::exists(o.weights))
      return failWith(KILN_IO_ERROR, fmt::format("no such checkpoint '{}'", o.weights));
    if (Status s = driver::loadCheckpointInto(*m->session, o.weights); !s) return failWith(KILN_IO_ERROR, s);
  }

  const data::BatchSpec& spec = m->session->forwardSpec();
  data::Batch one;
  data::allocateBatch(spec, 1, one);
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const data::InputSpec& in = spec.inputs[i];
    auto dtype = cDType(in.type.dtype());
    if (!dtype)
      return failWith(KILN_UNSUPPORTED, fmt::format("input '{}' is {}, which the C API does not carry",
                                                    in.name, ir::dtypeName(in.type.dtype())));
    m->inputs.push_back({in.name.c_str(), *dtype, cRole(in.role), one.tensors[i].numel(), in.feature,
                         in.role == data::InputRole::Sparse ? in.rows : 0});
  }
  if (m->session->hasTrainBlock())
    if (const ir::Attribute* a = driver::trainValue(m->session->trainConfig(), "lr_schedule"); a && a->isDict())
      m->lr_schedule = a->asDict();
  // The prediction's width, from one forward pass on a zero sample (ids 0 are in every table).
  if (c.has("predict") || c.has("eval")) {
    std::vector<const void*> none(m->inputs.size(), nullptr);
    std::vector<std::vector<uint8_t>> zeros;
    for (size_t i = 0; i < m->inputs.size(); ++i) {
      zeros.emplace_back(static_cast<size_t>(one.tensors[i].view.bytes()), 0);
      none[i] = zeros.back().data();
    }
    if (kiln_status st = fillBatch(*m, spec, 1, none.data(), true); st != KILN_OK) return st;
    auto probe = m->session->forward(m->batch);
    if (!probe) return failWith(KILN_RUNTIME_ERROR, probe.status());
    m->output_size = static_cast<int64_t>(probe->logits.size() + probe->prediction.size());
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().insert(m.get());
  *out = m.release();
  return KILN_OK;
}

template <typename F>
kiln_status guarded(F&& f) {
  try {
    last_error.clear();
    return f();
  } catch (...) {
    return failWith(KILN_RUNTIME_ERROR, uncaughtExceptionMessage(std::current_exception()));
  }
}

}  // namespace
}  // namespace kiln::cli

using namespace kiln;
using namespace kiln::cli;

extern "C" {

void kiln_options_init(kiln_options* options) {
  if (options) *options = kiln_options{nullptr, nullptr, 1, 0};
}

kiln_status kiln_create(const kiln_options* options, kiln_model** out) {
  return guarded([&] {
    if (!out) return failWith(KILN_INVALID_ARGUMENT, "out is NULL");
    *out = nullptr;
    kiln_options defaults;
    kiln_options_init(&defaults);
    return create(options ? *options : defaults, out);
  });
}

kiln_status kiln_destroy(kiln_model* model) {
  last_error.clear();
  if (!model) return KILN_OK;  // as free(NULL)
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (!liveLocked(model)) return KILN_INVALID_ARGUMENT;
    if (model->busy)
      return failWith(KILN_INVALID_ARGUMENT, "another call is using this handle: it was not destroyed");
    registry().erase(model);
    model->magic = 0;
  }
  return guarded([&] {
    delete model;
    return KILN_OK;
  });
}

const char* kiln_last_error(void) { return last_error.c_str(); }

const char* kiln_status_name(kiln_status status) {
  switch (status) {
    case KILN_OK:
      return "KILN_OK";
    case KILN_INVALID_ARGUMENT:
      return "KILN_INVALID_ARGUMENT";
    case KILN_BAD_PAYLOAD:
      return "KILN_BAD_PAYLOAD";
    case KILN_IO_ERROR:
      return "KILN_IO_ERROR";
    case KILN_UNSUPPORTED:
      return "KILN_UNSUPPORTED";
    case KILN_RUNTIME_ERROR:
      return "KILN_RUNTIME_ERROR";
  }
  return "KILN_UNKNOWN_STATUS";
}

const char* kiln_model_name(const kiln_model* model) {
  return readHandle(model, "", [](const kiln_model& m) { return m.compiled->name.c_str(); });
}
int64_t kiln_max_batch(const kiln_model* model) {
  return readHandle(model, int64_t{0}, [](const kiln_model& m) { return m.compiled->max_batch; });
}
int kiln_num_inputs(const kiln_model* model) {
  return readHandle(model, 0, [](const kiln_model& m) { return static_cast<int>(m.inputs.size()); });
}
int64_t kiln_output_size(const kiln_model* model) {
  return readHandle(model, int64_t{0}, [](const kiln_model& m) { return m.output_size; });
}

kiln_status kiln_input(const kiln_model* model, int index, kiln_input_info* out) {
  return readHandle(model, KILN_INVALID_ARGUMENT, [&](const kiln_model& m) {
    if (!out) return failWith(KILN_INVALID_ARGUMENT, "out is NULL");
    if (index < 0 || index >= static_cast<int>(m.inputs.size()))
      return failWith(KILN_INVALID_ARGUMENT,
                      fmt::format("input {} is outside 0..{}", index, static_cast<int>(m.inputs.size()) - 1));
    *out = m.inputs[static_cast<size_t>(index)];
    return KILN_OK;
  });
}

kiln_status kiln_predict(kiln_model* model, int64_t batch, const void* const* inputs, float* out) {
  return guarded([&] {
    Use use(model);
    if (use.status() != KILN_OK) return use.status();
    if (!out) return failWith(KILN_INVALID_ARGUMENT, "out is NULL");
    if (!model->compiled->has("predict") && !model->compiled->has("eval"))
      return failWith(KILN_UNSUPPORTED, "this model was compiled without predict (kiln compile --functions)");
    if (kiln_status st = fillBatch(*model, model->session->forwardSpec(), batch, inputs, true); st != KILN_OK)
      return st;
    auto result = model->session->forward(model->batch);
    if (!result) return failWith(KILN_RUNTIME_ERROR, result.status());
    const std::vector<float>& values = result->logits.empty() ? result->prediction : result->logits;
    if (static_cast<int64_t>(values.size()) != batch * model->output_size)
      return failWith(KILN_RUNTIME_ERROR, fmt::format("the prediction has {} values, not {} per sample",
                                                      values.size(), model->output_size));
    std::memcpy(out, values.data(), values.size() * sizeof(float));
    return KILN_OK;
  });
}

kiln_status kiln_train_step(kiln_model* model, int64_t batch, const void* const* inputs, float* loss) {
  return guarded([&] {
    Use use(model);
    if (use.status() != KILN_OK) return use.status();
    if (!model->compiled->has("train"))
      return failWith(KILN_UNSUPPORTED, "this model was compiled without train (kiln compile --functions)");
    if (kiln_status st = fillBatch(*model, model->session->trainSpec(), batch, inputs, false); st != KILN_OK)
      return st;
    const int64_t step = model->steps + 1;
    auto result =
        model->session->trainStep(model->batch, passes::learningRateFactor(model->lr_schedule, step), step);
    if (!result) return failWith(KILN_RUNTIME_ERROR, result.status());
    model->steps = step;
    if (loss) *loss = static_cast<float>(result->loss);
    return KILN_OK;
  });
}

kiln_status kiln_save(kiln_model* model, const char* dir) {
  return guarded([&] {
    Use use(model);
    if (use.status() != KILN_OK) return use.status();
    if (!dir) return failWith(KILN_INVALID_ARGUMENT, "dir is NULL");
    if (Status s = runtime::prepareCheckpointDir(dir); !s) return failWith(KILN_IO_ERROR, s);
    driver::Session& s = *model->session;
    std::vector<std::pair<std::string, ir::TensorView>> tensors;
    for (const std::string& name : s.checkpointNames())
      tensors.emplace_back(name, s.params().find(name)->view);
    const std::map<std::string, std::string> meta{{"step", std::to_string(model->steps)},
                                                  {"format", "kiln-checkpoint-2"}};
    const std::string file = (std::filesystem::path(dir) / "checkpoint.safetensors").string();
    if (Status st = runtime::saveCheckpoint(file, tensors, meta); !st) return failWith(KILN_IO_ERROR, st);
    return KILN_OK;
  });
}

}  // extern "C"
