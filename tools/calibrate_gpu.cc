#include "tools/calibrate_gpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <random>
#include <set>

#include "ir/builder.h"
#include "ir/target.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/cuda/cuda_executor.h"
#include "runtime/parameter_store.h"

namespace kiln::cli {
namespace {

using ir::Attribute;
using ir::Dim;
using ir::DType;
using ir::TensorType;

// A one-op function under construction: its inputs, a parameter, the op, the return.
struct Probe {
  ir::Module module;
  ir::Function* f = nullptr;
  ir::Builder b;

  explicit Probe(const std::string& name) {
    f = &module.addFunction(name);
    f->body().addBlock();
    b.setInsertionPointToEnd(f->entry());
  }
  Expected<ir::Value*> input(const std::string& name, TensorType t) {
    KILN_ASSIGN_OR_RETURN(
        ir::Op * in, b.createWithTypes(ir::OpCode::Input, {}, {std::move(t)}, {{"name", Attribute(name)}}));
    return in->result();
  }
  Expected<ir::Value*> parameter(const std::string& name, TensorType t) {
    KILN_ASSIGN_OR_RETURN(ir::Op * p, b.createWithTypes(ir::OpCode::Parameter, {}, {std::move(t)},
                                                        {{"name", Attribute(name)},
                                                         {"init", Attribute("zeros")},
                                                         {"trainable", Attribute(false)}}));
    return p->result();
  }
  Status returns(ir::Value* v) {
    KILN_ASSIGN_OR_RETURN(ir::Op * ret, b.createWithTypes(ir::OpCode::Return, {v}, {}));
    (void)ret;
    f->setResultTypes({v->type()});
    return Status::ok();
  }
};

struct Profiled {
  double ms = 0;     // the kernels' device time, summed over the launches of one run
  double flops = 0;  // the GEMMs' flops of one run
};

// The best of `repeats` profiles (after one run that compiles and warms up) of the probe's
// function, its parameters uploaded to `session` first. A parameter the session holds already
// (one row size's table, read by every pooling factor; the probes never write one) is neither
// made on the host nor uploaded again.
Expected<Profiled> profileBest(Probe& p, const std::shared_ptr<cuda::CudaSession>& session,
                               const runtime::cpu::Batch& batch, int repeats) {
  std::set<std::string, std::less<>> held;
  for (const ir::Op* op : p.f->entry().opList())
    if (op->is(ir::OpCode::Parameter) && session->hasParameter(op->strAttr("name")))
      held.insert(op->strAttr("name"));
  runtime::ParameterStore store;
  KILN_RETURN_IF_ERROR(store.initializeFrom(p.module, /*run_seed=*/1, {}, nullptr, true, &held));
  KILN_RETURN_IF_ERROR(session->uploadParameters(store));
  cuda::CudaExecutorOptions eo;
  eo.use_graph = false;
  KILN_ASSIGN_OR_RETURN(auto ex, cuda::CudaExecutor::create(*p.f, {}, session, eo));
  KILN_ASSIGN_OR_RETURN(auto warm, ex->run(batch));
  (void)warm;
  Profiled best;
  for (int rep = 0; rep < std::max(1, repeats); ++rep) {
    KILN_ASSIGN_OR_RETURN(auto timings, ex->profile(batch));
    Profiled run;
    for (const cuda::CudaExecutor::Timing& t : timings) {
      run.ms += t.ms;
      run.flops += t.flops;
    }
    if (run.ms > 0 && (best.ms == 0 || run.ms < best.ms)) best = run;
  }
  if (!(best.ms > 0)) return Status::errorf("'{}' took no measurable device time", p.f->name());
  return best;
}

// Rows of 16 KiB summed, one row a block: every SM streams its share of the parameter.
Expected<double> readRate(const std::shared_ptr<cuda::CudaSession>& session, int64_t bytes, int repeats) {
  const int64_t cols = 4096, rows = std::max<int64_t>(1, bytes / (4 * cols));
  Probe p("calibrate_memory");
  KILN_ASSIGN_OR_RETURN(
      ir::Value * x,
      p.parameter("calibrate.memory", TensorType(DType::f32, {Dim::fixed(rows), Dim::fixed(cols)})));
  KILN_ASSIGN_OR_RETURN(
      ir::Value * sum,
      p.b.createValue(ir::OpCode::Reduce, {x}, {{"kind", Attribute("sum")}, {"axes", Attribute::ints({1})}}));
  KILN_RETURN_IF_ERROR(p.returns(sum));
  KILN_ASSIGN_OR_RETURN(Profiled r, profileBest(p, session, {}, repeats));
  return static_cast<double>(rows * cols) * 4 / (r.ms * 1e-3);
}

// Rows' bytes a second of embedding_bag over a `table_bytes` table of `row_bytes` rows, `pooling`
// uniformly random ids a bag, about `bytes_per_call` of rows gathered a call.
Expected<double> lookupRate(const std::shared_ptr<cuda::CudaSession>& session, int64_t table_bytes,
                            int64_t row_bytes, int64_t pooling, int64_t bytes_per_call, int repeats,
                            std::mt19937_64& rng) {
  const int64_t dim = row_bytes / 4, rows = table_bytes / row_bytes;
  const int64_t batch = std::max<int64_t>(1, bytes_per_call / (pooling * row_bytes));
  Probe p(fmt::format("calibrate_lookup_{}_{}", row_bytes, pooling));
  // One table per row size (the session keeps each parameter by name).
  KILN_ASSIGN_OR_RETURN(ir::Value * table,
                        p.parameter(fmt::format("calibrate.table_{}", row_bytes),
                                    TensorType(DType::f32, {Dim::fixed(rows), Dim::fixed(dim)})));
  KILN_ASSIGN_OR_RETURN(ir::Value * ids,
                        p.input("ids", TensorType(DType::i64, {Dim::fixed(batch), Dim::fixed(pooling)})));
  KILN_ASSIGN_OR_RETURN(ir::Value * pooled,
                        p.b.createValue(ir::OpCode::EmbeddingBag, {table, ids},
                                        {{"mode", Attribute("sum")}, {"table", Attribute("calibrate")}}));
  KILN_RETURN_IF_ERROR(p.returns(pooled));
  ir::HostTensor host_ids(DType::i64, {batch, pooling});
  for (int64_t i = 0; i < host_ids.view.numel(); ++i)
    host_ids.as<int64_t>()[i] = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows));
  KILN_ASSIGN_OR_RETURN(Profiled r, profileBest(p, session, {{"ids", host_ids.view}}, repeats));
  return static_cast<double>(batch * pooling * row_bytes) / (r.ms * 1e-3);
}

Expected<double> gemmRate(const std::shared_ptr<cuda::CudaSession>& session, int64_t n, DType t,
                          int repeats) {
  Probe p(fmt::format("calibrate_gemm_{}", ir::dtypeName(t)));
  const TensorType square(t, {Dim::fixed(n), Dim::fixed(n)});
  KILN_ASSIGN_OR_RETURN(ir::Value * a, p.input("a", square));
  KILN_ASSIGN_OR_RETURN(ir::Value * b, p.input("b", square));
  KILN_ASSIGN_OR_RETURN(ir::Value * c, p.b.createValue(ir::OpCode::Matmul, {a, b}));
  KILN_RETURN_IF_ERROR(p.returns(c));
  ir::HostTensor ha(t, {n, n}), hb(t, {n, n});
  for (ir::HostTensor* h : {&ha, &hb})
    for (int64_t i = 0; i < h->view.numel(); ++i) {
      if (t == DType::bf16)
        h->as<uint16_t>()[i] = ir::floatToBf16(0.5f);
      else
        h->as<float>()[i] = 0.5f;
    }
  KILN_ASSIGN_OR_RETURN(Profiled r, profileBest(p, session, {{"a", ha.view}, {"b", hb.view}}, repeats));
  const double flops =
      r.flops > 0 ? r.flops : 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  return flops / (r.ms * 1e-3);
}

}  // namespace

Expected<GpuCalibration> calibrateGpu(const GpuCalibrationOptions& o) {
  std::string why;
  if (!cuda::cudaAvailable(&why)) return Status::errorf("no CUDA GPU to calibrate: {}", why);
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  KILN_ASSIGN_OR_RETURN(std::shared_ptr<cuda::CudaSession> session, cuda::CudaSession::create());
  GpuCalibration c;
  c.device = session->deviceName();
  c.target = gpuTargetForDevice(c.device).name;
  say(fmt::format("measuring GPU memory on {}: reduce(sum) of a {} MiB f32 parameter, best of {}...",
                  c.device, o.memory_bytes >> 20, o.repeats));
  KILN_ASSIGN_OR_RETURN(c.read_bytes_per_s, readRate(session, o.memory_bytes, o.repeats));
  say(fmt::format(
      "measuring GPU lookups: embedding_bag over a {} MiB f32 table, uniformly random ids, {} row sizes x "
      "{} pooling factors...",
      o.table_bytes >> 20, o.row_bytes.size(), o.pooling.size()));
  std::mt19937_64 rng(20240531);
  for (int64_t rb : o.row_bytes) {
    std::vector<double> row;
    for (int64_t pl : o.pooling) {
      KILN_ASSIGN_OR_RETURN(
          double rate, lookupRate(session, o.table_bytes, rb, pl, o.lookup_bytes_per_call, o.repeats, rng));
      row.push_back(rate);
    }
    c.lookup_bytes_per_s.push_back(std::move(row));
  }
  say(fmt::format("measuring GPU GEMMs: matmul {0}x{0}x{0} (cuBLASLt), f32 and bf16...", o.gemm_n));
  KILN_ASSIGN_OR_RETURN(c.gemm_f32_flops_per_s, gemmRate(session, o.gemm_n, DType::f32, o.repeats));
  KILN_ASSIGN_OR_RETURN(c.gemm_bf16_flops_per_s, gemmRate(session, o.gemm_n, DType::bf16, o.repeats));
  return c;
}

}  // namespace kiln::cli
