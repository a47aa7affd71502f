// Workload R1 (../shared/bench/WORKLOADS.md) on one GPU: the DLRM-DCNv2 training step of
// models/dlrm_dcnv2.kiln at rows_cap 1000000, batch 16384, SGD. Prints one `KILN {json}` line:
// ms/step of the CUDA-graph step (inputs already on the host, copied per step as in training;
// `ms_per_step` with each batch staged during the step before, as the trainer does,
// `ms_per_step_serial` through run(), upload and step in series), and a per-kernel profile
// summed into GEMM time and FLOPs and embedding forward/backward time.
//
//   r1_bench [--model FILE] [--batch B] [--rows-cap N] [--steps N] [--precision bf16|f32]
//            [--disable-pass NAME]
//
// The model's train block is overridden to plain SGD (lr 0.01) for tables and MLPs, as R1 and
// the PyTorch peer specify, and to the given precision: bf16 (the default) stores GEMM inputs
// and outputs in bf16 with f32 accumulation, as the peer's bf16 autocast does; f32 runs FP32
// GEMMs. `--disable-pass fusion` measures the step without Kiln's fusion.
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <iostream>
#include <random>
#include <set>
#include <string>

#include <fmt/format.h>

#include "runtime/cuda/cuda_driver.h"
#include "runtime/cuda/cuda_executor.h"
#include "runtime/data/batch_reader.h"
#include "tools/session_flags.h"

using namespace kiln;

namespace {

int fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "r1_bench: %s: %s\n", what.c_str(), s.message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = std::string(KILN_SOURCE_DIR) + "/models/dlrm_dcnv2.kiln";
  int64_t batch = 16384, rows_cap = 1000000, steps = 20;
  std::string precision = "bf16";
  std::set<std::string, std::less<>> disabled;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model = v;
    else if (k == "--batch") batch = std::stoll(v);
    else if (k == "--rows-cap") rows_cap = std::stoll(v);
    else if (k == "--steps") steps = std::stoll(v);
    else if (k == "--disable-pass") disabled.insert(v);
    else if (k == "--precision" && (v == "bf16" || v == "f32")) precision = v;
    else {
      std::fprintf(stderr, "r1_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  std::string why;
  if (!cuda::cudaAvailable(&why)) {
    std::fprintf(stderr, "r1_bench: no GPU: %s\n", why.c_str());
    return 1;
  }

  // The model compiled and initialized on the host (the session itself stays on the CPU).
  driver::SessionOptions so;
  so.model_path = model;
  so.overrides["rows_cap"] = std::to_string(rows_cap);
  so.batch = batch;
  so.threads = 16;
  so.device = "cpu";
  so.pass_options.disabled = disabled;
  const ir::AttrDict sgd = {{"kind", ir::Attribute(std::string("sgd"))}, {"lr", ir::Attribute(0.01)}};
  so.train_overrides = {{"optimizer", ir::Attribute(sgd)},
                        {"embedding_optimizer", ir::Attribute(sgd)},
                        {"precision", ir::Attribute(precision)}};
  auto t0 = std::chrono::steady_clock::now();
  auto session = driver::Session::create(so, std::cerr);
  if (!session) return fail("compiling " + model, session.status());
  auto cs = cuda::CudaSession::create();
  if (!cs) return fail("CUDA", cs.status());
  Status up = (*cs)->uploadParameters((*session)->params());
  if (!up) return fail("uploading parameters", up);
  const ir::Function* ts = (*session)->module().lookup("train_step");
  if (!ts) return fail("model", Status::error("no @train_step"));
  auto ex = cuda::CudaExecutor::create(*ts, {{"B", batch}}, *cs);
  if (!ex) return fail("building the CUDA step", ex.status());
  double setup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Four batches: synthetic dense features and labels, ids uniform over each table (as R1 says).
  const data::BatchSpec& spec = (*session)->trainSpec();
  data::DataOptions opts;
  opts.paths = {"synthetic"};
  opts.batch_size = batch;
  opts.epochs = 0;
  auto reader = data::openBatchReader(spec, opts);
  if (!reader) return fail("data", reader.status());
  std::mt19937_64 rng(5);
  std::vector<data::Batch> batches(4);
  for (data::Batch& b : batches) {
    auto more = (*reader)->next(b);
    if (!more || !*more) return fail("data", more ? Status::error("no batch") : more.status());
    for (size_t i = 0; i < spec.inputs.size(); ++i) {
      const data::InputSpec& in = spec.inputs[i];
      if (in.role != data::InputRole::Sparse || in.rows <= 0) continue;
      ir::HostTensor* t = b.find(in.name);
      for (int64_t j = 0; j < t->numel(); ++j) {
        int64_t id = static_cast<int64_t>(rng() % static_cast<uint64_t>(in.rows));
        if (t->view.dtype == ir::DType::i64) t->as<int64_t>()[j] = id;
        else if (t->view.dtype == ir::DType::i32) t->as<int32_t>()[j] = static_cast<int32_t>(id);
      }
    }
  }
  float step = 1.0f;
  auto inputsOf = [&](const data::Batch& b) { return driver::StepInputs(b, {{"lr", 1.0f}, {"step", step}}); };

  double first_loss = 0, loss = 0;
  for (int i = 0; i < 3; ++i) {  // eager, capture, replay
    auto r = (*ex)->run(inputsOf(batches[static_cast<size_t>(i) % 4]).views());
    if (!r) return fail("warm-up step", r.status());
    loss = *(*r)[0].as<float>();
    if (i == 0) first_loss = loss;
    step += 1;
  }
  // In series: each step uploads its batch, runs, and returns its loss (run()).
  auto s0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    auto r = (*ex)->run(inputsOf(batches[static_cast<size_t>(i) % 4]).views());
    if (!r) return fail("step", r.status());
    loss = *(*r)[0].as<float>();
    step += 1;
  }
  const double serial_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() /
      static_cast<double>(steps);
  // The trainer's order (docs/runtime.md, "Feeding the GPU"): batch i+1 copied to pinned memory
  // and uploaded on the copy stream while step i runs; the host waits for step i's loss only.
  s0 = std::chrono::steady_clock::now();
  auto ticket = (*ex)->stage(inputsOf(batches[0]).views());
  if (!ticket) return fail("stage", ticket.status());
  for (int64_t i = 0; i < steps; ++i) {
    if (Status launched = (*ex)->launch(*ticket); !launched) return fail("launch", launched);
    Expected<cuda::CudaExecutor::Ticket> next = Status::error("the last step");
    if (i + 1 < steps) {
      step += 1;
      next = (*ex)->stage(inputsOf(batches[static_cast<size_t>(i + 1) % 4]).views());
      if (!next) return fail("stage", next.status());
    }
    auto r = (*ex)->collect(*ticket);
    if (!r) return fail("step", r.status());
    loss = *(*r)[0].as<float>();
    if (next) ticket = next;
  }
  step += 1;
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() /
              static_cast<double>(steps);

  auto prof = (*ex)->profile(inputsOf(batches[0]).views());
  if (!prof) return fail("profile", prof.status());
  double gemm_ms = 0, gemm_flops = 0, emb_fwd_ms = 0, emb_bwd_ms = 0, other_ms = 0;
  for (const auto& t : *prof) {
    if (t.gemm) {
      gemm_ms += t.ms;
      gemm_flops += t.flops;
    } else if (t.name.find("embedding_grad") != std::string::npos || t.name.find("embedding_update") != std::string::npos) {
      // The backward's kernels: clear, insert, combine (embedding_grad_*) and the row updates.
      emb_bwd_ms += t.ms;
    } else if (t.name.find("embedding") != std::string::npos) {
      emb_fwd_ms += t.ms;
    } else {
      other_ms += t.ms;
    }
  }
  // Embedding traffic (fp32 rows): forward reads B*214 rows of 128; backward reads and writes
  // them (WORKLOADS.md: about 5.4 GB per step in all at B=16384).
  int64_t lookups = 0, dim = 128;
  for (const data::InputSpec& in : spec.inputs)
    if (in.role == data::InputRole::Sparse) lookups += in.idsPerSample();
  double fwd_bytes = static_cast<double>(batch) * static_cast<double>(lookups) * static_cast<double>(dim) * 4;
  double bwd_bytes = 2 * fwd_bytes;
  std::printf(
      "KILN {\"ms_per_step\": %.3f, \"ms_per_step_serial\": %.3f, \"samples_per_s\": %.0f, \"kernels\": %d, "
      "\"gemms\": %d, \"graph\": %s, "
      "\"profile_ms\": {\"gemm\": %.3f, \"emb_fwd\": %.3f, \"emb_bwd\": %.3f, \"other\": %.3f}, "
      "\"gemm_tflops\": %.1f, \"emb_fwd_tbps\": %.3f, \"emb_bwd_tbps\": %.3f, \"loss_first\": %.5f, "
      "\"loss_last\": %.5f, "
      "\"setup_s\": %.1f, \"fusion\": %s, \"precision\": \"%s\", \"device\": \"%s\"}\n",
      ms, serial_ms, static_cast<double>(batch) / ms * 1e3, (*ex)->numKernels(), (*ex)->numGemms(),
      (*ex)->graphCaptured() ? "true" : "false", gemm_ms, emb_fwd_ms, emb_bwd_ms, other_ms,
      gemm_ms > 0 ? gemm_flops / (gemm_ms * 1e-3) / 1e12 : 0.0,
      emb_fwd_ms > 0 ? fwd_bytes / (emb_fwd_ms * 1e-3) / 1e12 : 0.0,
      emb_bwd_ms > 0 ? bwd_bytes / (emb_bwd_ms * 1e-3) / 1e12 : 0.0, first_loss, loss, setup_s,
      disabled.count("fusion") ? "false" : "true", precision.c_str(), (*cs)->deviceName().c_str());
  // The ten slowest launches, to see where the time goes.
  std::vector<cuda::CudaExecutor::Timing> top = *prof;
  std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
  for (size_t i = 0; i < std::min<size_t>(10, top.size()); ++i)
    std::fprintf(stderr, "  %8.3f ms  %s\n", top[i].ms, top[i].name.c_str());
  return 0;
}
