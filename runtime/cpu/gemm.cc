#include "runtime/cpu/gemm.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "ir/tensor_view.h"
#include "runtime/cpu/cpu_features.h"
#include "runtime/memory.h"

namespace kiln::runtime::cpu {
namespace {

using dnnl::memory;

dnnl::engine& cpuEngine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

int64_t packedLd(const GemmDesc& d, char which) {
  switch (which) {
    case 'a': return d.lda ? d.lda : (d.ta ? d.m : d.k);
    case 'b': return d.ldb ? d.ldb : (d.tb ? d.k : d.n);
    default: return d.ldc ? d.ldc : d.n;
  }
}

memory::data_type dnnlType(ir::DType t) {
  return t == ir::DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
}

struct DescHash {
  size_t operator()(const GemmDesc& d) const {
    size_t h = 0;
    auto mix = [&](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    for (int64_t v : {d.m, d.n, d.k, d.lda, d.ldb, d.ldc}) mix(static_cast<uint64_t>(v));
    mix(static_cast<uint64_t>(d.ta) | static_cast<uint64_t>(d.tb) << 1 | static_cast<uint64_t>(d.bias) << 2 |
        static_cast<uint64_t>(d.residual) << 3 | static_cast<uint64_t>(d.act) << 4 |
        static_cast<uint64_t>(d.a) << 8 | static_cast<uint64_t>(d.b) << 16 | static_cast<uint64_t>(d.c) << 24 |
        static_cast<uint64_t>(d.accumulate) << 32);
    return h;
  }
};

// One desc's primitive: built once, then run by any thread (its scratchpad is the caller's).
struct Primitive {
  dnnl::matmul matmul;
  memory::desc a, b, c, bias, residual, scratchpad;
  std::string impl;
  // bf16 that oneDNN computes only by its reference loops here: run as f32 over widened copies
  // (`f32` is then the desc of that product).
  bool widened = false;
  std::shared_ptr<const Primitive> f32;
};

// oneDNN picks blockings from the thread count when a primitive is created and runs it on that
// many OpenMP threads: one, always (gemm.h says why), on whichever thread calls.
void singleThreaded() {
  if (omp_get_max_threads() != 1) omp_set_num_threads(1);
}

Expected<std::shared_ptr<const Primitive>> createPrimitive(const GemmDesc& d);

void warnOnce(const std::string& what) {
  static std::mutex mu;
  static std::vector<std::string> said;
  std::lock_guard<std::mutex> lock(mu);
  if (std::find(said.begin(), said.end(), what) != said.end()) return;
  said.push_back(what);
  std::fprintf(stderr, "warning: %s\n", what.c_str());
}

Expected<std::shared_ptr<const Primitive>> createOnednn(const GemmDesc& d) {
  const memory::dim m = d.m, n = d.n, k = d.k;
  const memory::dim lda = packedLd(d, 'a'), ldb = packedLd(d, 'b'), ldc = packedLd(d, 'c');
  auto p = std::make_shared<Primitive>();
  p->a = memory::desc({m, k}, dnnlType(d.a), d.ta ? memory::dims{1, lda} : memory::dims{lda, 1});
  p->b = memory::desc({k, n}, dnnlType(d.b), d.tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
  p->c = memory::desc({m, n}, dnnlType(d.c), memory::dims{ldc, 1});
  if (d.bias) p->bias = memory::desc({1, n}, dnnlType(d.c), memory::dims{n, 1});
  if (d.residual) p->residual = memory::desc({m, n}, dnnlType(d.c), memory::dims{ldc, 1});
  dnnl::post_ops ops;
  if (d.accumulate) ops.append_sum(1.0f);
  switch (d.act) {
    case GemmActivation::none: break;
    case GemmActivation::relu: ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f); break;
    case GemmActivation::gelu_tanh: ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_gelu_tanh, 0.0f, 0.0f); break;
    case GemmActivation::silu: ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_swish, 1.0f, 0.0f); break;
  }
  if (d.residual) ops.append_binary(dnnl::algorithm::binary_add, p->residual);
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  try {
    singleThreaded();
    dnnl::matmul::desc md = d.bias ? dnnl::matmul::desc(p->a, p->b, p->bias, p->c) : dnnl::matmul::desc(p->a, p->b, p->c);
    dnnl::matmul::primitive_desc pd(md, attr, cpuEngine());
    p->impl = pd.impl_info_str();
    p->scratchpad = pd.scratchpad_desc();
    p->matmul = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_out_of_memory)
      return Status::errorf("oneDNN matmul {}x{}x{} {}x{}->{}: {} ({})", d.m, d.n, d.k, ir::dtypeName(d.a),
                            ir::dtypeName(d.b), ir::dtypeName(d.c), e.what(), outOfMemoryNote());
    return Status::errorf("oneDNN has no matmul for {}x{}x{} {}x{}->{}: {}", d.m, d.n, d.k, ir::dtypeName(d.a),
                          ir::dtypeName(d.b), ir::dtypeName(d.c), e.what());
  }
  return std::shared_ptr<const Primitive>(std::move(p));
}

Expected<std::shared_ptr<const Primitive>> createPrimitive(const GemmDesc& d) {
  Expected<std::shared_ptr<const Primitive>> made = createOnednn(d);
  if (made && (*made)->impl.find("ref") == std::string::npos) return made;
  // bf16 that oneDNN computes here only by its reference loops, or not at all (oneDNN 2.6 on an
  // AVX2 CPU has no bf16 matmul with post-ops): the f32 product of widened copies gives the
  // same values, bf16's inputs being exact in f32.
  if (d.a == ir::DType::bf16) {
    GemmDesc f = d;
    f.a = f.b = f.c = ir::DType::f32;
    f.lda = f.ldb = f.ldc = 0;  // the widened copies are packed
    KILN_ASSIGN_OR_RETURN(auto inner, createPrimitive(f));
    auto w = std::make_shared<Primitive>();
    w->widened = true;
    w->impl = "f32-widened (" + inner->impl + ")";
    w->f32 = std::move(inner);
    warnOnce(fmt::format("oneDNN has no fast bf16 GEMM on this CPU ({}): bf16 products run in f32 over "
                         "widened copies (correct, without bf16's speed)",
                         hostCpu().summary()));
    return std::shared_ptr<const Primitive>(std::move(w));
  }
  if (!made) return made.status();
  warnOnce(fmt::format("oneDNN runs {} GEMMs by its reference loops on this CPU ({}): expect them to be slow",
                       ir::dtypeName(d.a), hostCpu().summary()));
  return made;
}

class PrimitiveCache {
 public:
  Expected<std::shared_ptr<const Primitive>> get(const GemmDesc& d) {
    {
      std::shared_lock<std::shared_mutex> lock(mu_);
      auto it = cache_.find(d);
      if (it != cache_.end()) return it->second;
    }
    KILN_ASSIGN_OR_RETURN(auto p, createPrimitive(d));
    std::unique_lock<std::shared_mutex> lock(mu_);
    return cache_.emplace(d, std::move(p)).first->second;
  }

 private:
  std::shared_mutex mu_;
  std::unordered_map<GemmDesc, std::shared_ptr<const Primitive>, DescHash> cache_;
};

PrimitiveCache& cache() {
  static PrimitiveCache c;
  return c;
}

// The calling thread's scratch memory, grown as needed: primitives run on any thread.
void* threadScratch(size_t which, size_t bytes) {
  thread_local std::vector<std::unique_ptr<uint8_t[], decltype(&std::free)>> buffers;
  thread_local std::vector<size_t> sizes;
  if (buffers.size() <= which) {
    while (buffers.size() <= which) buffers.emplace_back(nullptr, &std::free);
    sizes.resize(which + 1, 0);
  }
  if (sizes[which] < bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    buffers[which].reset(static_cast<uint8_t*>(std::aligned_alloc(64, rounded)));
    sizes[which] = buffers[which] ? rounded : 0;
  }
  return buffers[which].get();
}

float activate(GemmActivation act, float v) {
  switch (act) {
    case GemmActivation::none: return v;
    case GemmActivation::relu: return v > 0 ? v : 0;
    case GemmActivation::gelu_tanh:
      return 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case GemmActivation::silu: return v / (1.0f + std::exp(-v));
  }
  return v;
}

float loadAs(ir::DType t, const void* p, int64_t i) {
  return t == ir::DType::bf16 ? ir::bf16ToFloat(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
void storeAs(ir::DType t, void* p, int64_t i, float v) {
  if (t == ir::DType::bf16)
    static_cast<uint16_t*>(p)[i] = ir::floatToBf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

// k = 0: the product is zero, and C is the epilogue over zeros.
void emptyProduct(const GemmDesc& d, const GemmOperands& x) {
  const int64_t ldc = packedLd(d, 'c');
  for (int64_t i = 0; i < d.m; ++i)
    for (int64_t j = 0; j < d.n; ++j) {
      float v = d.bias ? loadAs(d.c, x.bias, j) : 0.0f;
      if (d.accumulate) v += loadAs(d.c, x.c, i * ldc + j);
      v = activate(d.act, v);
      if (d.residual) v += loadAs(d.c, x.residual, i * ldc + j);
      storeAs(d.c, x.c, i * ldc + j, v);
    }
}

void execute(const Primitive& p, const GemmDesc& d, const GemmOperands& x) {
  dnnl::engine& eng = cpuEngine();
  thread_local dnnl::stream stream(cpuEngine());
  std::unordered_map<int, memory> args;
  args.emplace(DNNL_ARG_SRC, memory(p.a, eng, const_cast<void*>(x.a)));
  args.emplace(DNNL_ARG_WEIGHTS, memory(p.b, eng, const_cast<void*>(x.b)));
  args.emplace(DNNL_ARG_DST, memory(p.c, eng, x.c));
  if (d.bias) args.emplace(DNNL_ARG_BIAS, memory(p.bias, eng, const_cast<void*>(x.bias)));
  if (d.residual)
    args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(int{d.accumulate} + int{d.act != GemmActivation::none}) |
                     DNNL_ARG_SRC_1,
                 memory(p.residual, eng, const_cast<void*>(x.residual)));
  if (const size_t bytes = p.scratchpad.get_size())
    args.emplace(DNNL_ARG_SCRATCHPAD, memory(p.scratchpad, eng, threadScratch(0, bytes)));
  singleThreaded();
  p.matmul.execute(stream, args);
  stream.wait();
}

// A bf16 desc through its f32 product: A, B (and the epilogue's operands) widened into packed
// f32 copies, C rounded once.
void executeWidened(const Primitive& p, const GemmDesc& d, const GemmOperands& x) {
  const int64_t lda = packedLd(d, 'a'), ldb = packedLd(d, 'b'), ldc = packedLd(d, 'c');
  auto widen = [](ir::DType t, const void* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = loadAs(t, src, r * ld + c);
  };
  const int64_t a_rows = d.ta ? d.k : d.m, a_cols = d.ta ? d.m : d.k;
  const int64_t b_rows = d.tb ? d.n : d.k, b_cols = d.tb ? d.k : d.n;
  float* a = static_cast<float*>(threadScratch(1, static_cast<size_t>(d.m * d.k) * sizeof(float)));
  float* b = static_cast<float*>(threadScratch(2, static_cast<size_t>(d.k * d.n) * sizeof(float)));
  float* c = static_cast<float*>(threadScratch(3, static_cast<size_t>(d.m * d.n) * sizeof(float)));
  widen(d.a, x.a, a_rows, a_cols, lda, a);
  widen(d.b, x.b, b_rows, b_cols, ldb, b);
  if (d.accumulate) widen(d.c, x.c, d.m, d.n, ldc, c);
  GemmOperands f{a, b, c, nullptr, nullptr};
  std::vector<float> bias, residual;
  if (d.bias) {
    bias.resize(static_cast<size_t>(d.n));
    widen(d.c, x.bias, 1, d.n, d.n, bias.data());
    f.bias = bias.data();
  }
  if (d.residual) {
    residual.resize(static_cast<size_t>(d.m * d.n));
    widen(d.c, x.residual, d.m, d.n, ldc, residual.data());
    f.residual = residual.data();
  }
  GemmDesc fd = d;
  fd.a = fd.b = fd.c = ir::DType::f32;
  fd.lda = fd.ldb = fd.ldc = 0;
  execute(*p.f32, fd, f);
  for (int64_t i = 0; i < d.m; ++i)
    for (int64_t j = 0; j < d.n; ++j) storeAs(d.c, x.c, i * ldc + j, c[i * d.n + j]);
}

bool floatType(ir::DType t) { return t == ir::DType::f32 || t == ir::DType::bf16; }

const char* isaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::sse41: return "sse41";
    default: return "unknown";
  }
}

const char* isaLevelOf(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::avx512_core_amx: return "amx";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512-bf16";
    case dnnl::cpu_isa::avx512_core_vnni:
    case dnnl::cpu_isa::avx512_core: return "avx512";
    case dnnl::cpu_isa::avx2_vnni:
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx:
    case dnnl::cpu_isa::sse41: return "sse4.2";
    default: return "generic";
  }
}

Status runWhole(const GemmDesc& d, const GemmOperands& x) {
  KILN_ASSIGN_OR_RETURN(auto p, cache().get(d));
  try {
    if (p->widened)
      executeWidened(*p, d, x);
    else
      execute(*p, d, x);
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_out_of_memory)
      return Status::errorf("oneDNN matmul {}x{}x{}: {} ({})", d.m, d.n, d.k, e.what(), outOfMemoryNote());
    return Status::errorf("oneDNN matmul {}x{}x{}: {}", d.m, d.n, d.k, e.what());
  }
  return Status::ok();
}

// Below this many flops a product runs on one thread: waking the pool costs more than it saves.
constexpr double kSplitFlops = 4e6;
// Blocks of rows or columns are multiples of this (the kernels' register tiles).
constexpr int64_t kBlockAlign = 16;

}  // namespace

Status gemm(const GemmDesc& d, const GemmOperands& x, ThreadPool* pool) {
  if (!floatType(d.a) || d.a != d.b || !floatType(d.c))
    return Status::errorf("no CPU GEMM for {} x {} -> {}", ir::dtypeName(d.a), ir::dtypeName(d.b),
                          ir::dtypeName(d.c));
  if (d.m <= 0 || d.n <= 0) return Status::ok();
  if (d.k <= 0) {
    emptyProduct(d, x);
    return Status::ok();
  }
  // The strides stay the whole product's in every block.
  GemmDesc whole = d;
  whole.lda = packedLd(d, 'a');
  whole.ldb = packedLd(d, 'b');
  whole.ldc = packedLd(d, 'c');
  const int threads = pool ? pool->numThreads() : 1;
  const bool by_rows = d.m >= d.n;
  const int64_t extent = by_rows ? d.m : d.n;
  const int64_t block = (extent + threads - 1) / threads;
  const int64_t aligned = (block + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
  const int64_t parts = (extent + aligned - 1) / aligned;
  if (threads == 1 || parts < 2 || 2.0 * d.m * d.n * d.k < kSplitFlops) return runWhole(whole, x);

  const int64_t ea = ir::dtypeBytes(d.a), ec = ir::dtypeBytes(d.c);
  auto offset = [](const void* p, int64_t bytes) { return static_cast<const char*>(p) + bytes; };
  std::mutex mu;
  Status first = Status::ok();
  pool->parallelFor(parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t part = p0; part < p1; ++part) {
      const int64_t lo = part * aligned, len = std::min(aligned, extent - lo);
      GemmDesc sub = whole;
      GemmOperands sx = x;
      if (by_rows) {  // rows lo.. of op(A), C and the residual
        sub.m = len;
        sx.a = offset(x.a, (d.ta ? lo : lo * whole.lda) * ea);
        sx.c = const_cast<char*>(offset(x.c, lo * whole.ldc * ec));
        if (d.residual) sx.residual = offset(x.residual, lo * whole.ldc * ec);
      } else {  // columns lo.. of op(B), C, the bias and the residual
        sub.n = len;
        sx.b = offset(x.b, (d.tb ? lo * whole.ldb : lo) * ea);
        sx.c = const_cast<char*>(offset(x.c, lo * ec));
        if (d.bias) sx.bias = offset(x.bias, lo * ec);
        if (d.residual) sx.residual = offset(x.residual, lo * ec);
      }
      if (Status s = runWhole(sub, sx); !s.isOk()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.isOk()) first = s;
      }
    }
  });
  return first;
}

void gemmF64(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const double* a, const double* b, double* c) {
  std::fill(c, c + m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t kk = 0; kk < k; ++kk) {
      const double av = ta ? a[kk * m + i] : a[i * k + kk];
      double* row = c + i * n;
      if (tb)
        for (int64_t j = 0; j < n; ++j) row[j] += av * b[j * k + kk];
      else
        for (int64_t j = 0; j < n; ++j) row[j] += av * b[kk * n + j];
    }
}

OnednnIsa onednnIsa() {
  const dnnl_version_t* v = dnnl_version();
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  return {fmt::format("{}.{}.{}", v->major, v->minor, v->patch), isaName(isa), isaLevelOf(isa)};
}

std::string gemmImplementation() {
  const OnednnIsa isa = onednnIsa();
  return fmt::format("onednn {} ({})", isa.version, isa.name);
}

Expected<std::string> gemmKernelName(const GemmDesc& d) {
  KILN_ASSIGN_OR_RETURN(auto p, cache().get(d));
  return p->impl;
}

}  // namespace kiln::runtime::cpu
