#include "tests/simt/host_program.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "codegen/cuda_emitter.h"
#include "codegen/cuda_program.h"
#include "codegen/kernel_lowering.h"
#include "ir/op_def.h"
#include "runtime/cuda/cublaslt.h"
#include "tests/simt/host_module.h"

namespace kiln::simt {

namespace {

float load(const void* p, ir::DType t, int64_t i) {
  switch (t) {
    case ir::DType::bf16: return ir::bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case ir::DType::f64: return static_cast<float>(static_cast<const double*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

void store(void* p, ir::DType t, int64_t i, float v) {
  if (t == ir::DType::bf16)
    static_cast<uint16_t*>(p)[i] = ir::floatToBf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

// f32 sum of x[0, n) in eight running sums, as the dot products below.
float sum8(const float* x, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int l = 0; l < 8; ++l) part[l] += x[k + l];
  float acc = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; k < n; ++k) acc += x[k];
  return acc;
}

// cuBLASLt's CUBLAS_COMPUTE_32F_FAST_TF32 on an f32 input: rounded to TF32's 10-bit mantissa,
// to nearest with ties away from zero (PTX's cvt.rna.tf32.f32); infinities and NaNs pass.
float roundToTf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;
  u = (u + 0x1000u) & 0xffffe000u;  // half of the 13 dropped bits, then drop them
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace

void gemmAsCublasLt(const codegen::GemmShape& s, const void* a, const void* b, void* c, void* bias, void* aux,
                    const void* residual) {
  uint8_t* mask = static_cast<uint8_t*>(aux);
  const int64_t mask_ld = codegen::reluMaskLd(s.n);
  const cuda::ColumnMajorGemm g = cuda::toColumnMajor(s);
  // cuBLASLt's operands: its A is our B, its B our A. A layout is the matrix as stored; the
  // operation applies to it. Both are first packed as f32, op(A) by rows and op(B) by columns,
  // so each element of D is one contiguous dot product.
  const void* first = b;
  const void* second = a;
  const int64_t first_stride = g.rows_first * g.cols_first, second_stride = g.rows_second * g.cols_second;
  std::vector<float> rows(static_cast<size_t>(g.m * g.k)), cols(static_cast<size_t>(g.n * g.k));
  for (int64_t bt = 0; bt < s.batch; ++bt) {
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t k = 0; k < g.k; ++k)  // op(A)[i, k]
        rows[static_cast<size_t>(i * g.k + k)] =
            load(first, s.b_type, bt * first_stride + (g.trans_first ? k + i * g.ld_first : i + k * g.ld_first));
    for (int64_t j = 0; j < g.n; ++j)
      for (int64_t k = 0; k < g.k; ++k)  // op(B)[k, j]
        cols[static_cast<size_t>(j * g.k + k)] =
            load(second, s.a_type, bt * second_stride + (g.trans_second ? j + k * g.ld_second : k + j * g.ld_second));
    // The bias gradient folds an operand over k. Our A is cuBLASLt's B, so BiasGradA is its
    // BGRADB: each column of its op(B), s.m values; BiasGradB (BGRADA) each row of its op(A),
    // s.n values. It is taken before the TF32 rounding of the product's inputs (which values
    // cuBLASLt sums is not documented; the tests' tolerances cover either). Unbatched only
    // (codegen/emit/gemm.cc).
    if (s.epilogue == codegen::Epilogue::BiasGradA)
      for (int64_t j = 0; j < g.n; ++j) store(bias, s.bias_type, j, sum8(cols.data() + j * g.k, g.k));
    if (s.epilogue == codegen::Epilogue::BiasGradB)
      for (int64_t i = 0; i < g.m; ++i) store(bias, s.bias_type, i, sum8(rows.data() + i * g.k, g.k));
    if (s.tf32) {
      for (float& v : rows) v = roundToTf32(v);
      for (float& v : cols) v = roundToTf32(v);
    }
    for (int64_t j = 0; j < g.n; ++j)
      for (int64_t i = 0; i < g.m; ++i) {
        const float* x = rows.data() + i * g.k;
        const float* y = cols.data() + j * g.k;
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // f32 accumulation, eight running sums
        int64_t k = 0;
        for (; k + 8 <= g.k; k += 8)
          for (int l = 0; l < 8; ++l) part[l] += x[k + l] * y[k + l];
        float acc = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        for (; k < g.k; ++k) acc += x[k] * y[k];
        if (s.residual) acc += load(residual, s.c_type, bt * g.m * g.n + i + j * g.ld_c);  // beta = 1
        if (codegen::epilogueReadsBias(s.epilogue))
          acc += load(bias, s.bias_type, i);  // along cuBLASLt's rows
        if (codegen::epilogueAppliesRelu(s.epilogue)) acc = std::max(acc, 0.0f);
        const int64_t bit = bt * g.n * mask_ld + i + j * mask_ld;
        if (codegen::epilogueWritesReluMask(s.epilogue)) {
          const uint8_t b8 = static_cast<uint8_t>(1u << (bit % 8));
          mask[bit / 8] = static_cast<uint8_t>(acc > 0 ? mask[bit / 8] | b8 : mask[bit / 8] & ~b8);
        }
        if (s.epilogue == codegen::Epilogue::DRelu) acc *= ((mask[bit / 8] >> (bit % 8)) & 1) ? 1.0f : 0.0f;
        if (s.epilogue == codegen::Epilogue::DGelu)
          acc *= ir::scalar::GeluDerivative(load(aux, s.c_type, bt * g.m * g.n + i + j * g.ld_c));
        if (s.epilogue == codegen::Epilogue::Gelu || s.epilogue == codegen::Epilogue::BiasGelu)
          acc = 0.5f * acc * (1.0f + std::tanh(0.7978845608028654f * (acc + 0.044715f * acc * acc * acc)));
        store(c, s.c_type, bt * g.m * g.n + i + j * g.ld_c, acc);
      }
  }
}

namespace {

// The checks cuBLASLt makes of a problem's layouts (CUBLAS_STATUS_INVALID_VALUE otherwise).
Status checkLayouts(const codegen::GemmShape& s) {
  const cuda::ColumnMajorGemm g = cuda::toColumnMajor(s);
  auto check = [&](const char* which, bool trans, int64_t rows, int64_t cols, int64_t ld, int64_t op_rows,
                   int64_t op_cols) -> Status {
    int64_t want_rows = trans ? op_cols : op_rows, want_cols = trans ? op_rows : op_cols;
    if (rows != want_rows || cols != want_cols || ld < rows)
      return Status::errorf("{}: cuBLASLt's {} is laid out {}x{} (ld {}), its operation needs {}x{}", s.str(), which,
                            rows, cols, ld, want_rows, want_cols);
    return Status::ok();
  };
  KILN_RETURN_IF_ERROR(check("A", g.trans_first, g.rows_first, g.cols_first, g.ld_first, g.m, g.k));
  KILN_RETURN_IF_ERROR(check("B", g.trans_second, g.rows_second, g.cols_second, g.ld_second, g.k, g.n));
  if (g.ld_c < g.m) return Status::errorf("{}: ldc {} < m {}", s.str(), g.ld_c, g.m);
  return Status::ok();
}

}  // namespace

struct HostProgram::Impl {
  codegen::CudaProgram built;
  std::vector<codegen::LoweredGroup> groups;
  std::unique_ptr<HostModule> module;
  ir::SymbolBindings symbols;
  int kernels = 0, gemms = 0;
};

HostProgram::~HostProgram() = default;
int HostProgram::numKernels() const { return impl_->kernels; }
int HostProgram::numGemms() const { return impl_->gemms; }

Expected<std::unique_ptr<HostProgram>> HostProgram::create(const ir::Function& f, const ir::SymbolBindings& symbols) {
  std::unique_ptr<HostProgram> hp(new HostProgram());
  hp->impl_ = std::make_unique<Impl>();
  Impl& im = *hp->impl_;
  im.symbols = symbols;
  auto groups = codegen::lowerFunction(f, symbols);
  if (!groups) return groups.status();
  im.groups = groups.take();
  auto built = codegen::buildCudaProgram(f, im.groups, symbols);
  if (!built) return built.status();
  im.built = built.take();
  std::vector<const codegen::Kernel*> all;
  for (const codegen::LoweredGroup& g : im.groups)
    for (const codegen::Kernel& k : g.kernels) all.push_back(&k);
  auto module = HostModule::compile(codegen::emitModule(all));
  if (!module) return module.status();
  im.module = module.take();
  for (const codegen::CudaStep& s : im.built.steps) {
    if (s.isGemm()) {
      KILN_RETURN_IF_ERROR(checkLayouts(s.gemm));
      ++im.gemms;
    } else {
      ++im.kernels;
    }
  }
  return hp;
}

Expected<std::vector<ir::HostTensor>> HostProgram::run(const runtime::cpu::Batch& batch,
                                                       runtime::ParameterStore& params, uint64_t seed) {
  Impl& im = *impl_;
  const codegen::Program& p = im.built.program;
  std::set<int> flags(im.built.error_flags.begin(), im.built.error_flags.end());
  std::map<int, const ir::Op*> constants(im.built.constants.begin(), im.built.constants.end());
  std::set<int> inputs(im.built.inputs.begin(), im.built.inputs.end());
  std::set<int> address_tables;
  for (const codegen::CudaProgram::AddressTable& t : im.built.address_tables) address_tables.insert(t.buffer);

  // Memory: the arena (poisoned), then every buffer outside it in its own guarded buffer.
  auto arena = GuardedBuffer::allocate(static_cast<size_t>(std::max<int64_t>(p.arena_bytes, 256)), 256);
  if (!arena) return arena.status();
  std::memset(arena->data(), 0xFF, arena->bytes());
  std::vector<GuardedBuffer> owned(p.buffers.size());
  std::vector<char*> address(p.buffers.size(), nullptr);
  std::vector<std::pair<int, ir::HostTensor*>> param_of;
  for (const codegen::Buffer& b : p.buffers) {
    if (b.inArena()) {
      address[b.id] = static_cast<char*>(arena->data()) + b.offset;
      continue;
    }
    const size_t align = static_cast<size_t>(std::max<int64_t>(1, ir::dtypeBytes(b.type.dtype())));
    auto buf = GuardedBuffer::allocate(static_cast<size_t>(b.bytes), flags.count(b.id) ? 4 : align);
    if (!buf) return buf.status();
    owned[b.id] = buf.take();
    address[b.id] = static_cast<char*>(owned[b.id].data());
    const std::vector<int64_t>& shape = im.built.shapes[b.id];
    if (flags.count(b.id)) {
      std::memset(address[b.id], 0, static_cast<size_t>(b.bytes));
    } else if (address_tables.count(b.id)) {
      continue;  // written below, once every buffer is placed
    } else if (constants.count(b.id)) {
      const ir::Op* op = constants.at(b.id);
      ir::HostTensor t(op->result()->type().dtype(), shape);
      ir::CpuContext cc;
      cc.symbols = &im.symbols;
      KILN_RETURN_IF_ERROR(op->def()->cpu(*op, {}, {&t.view}, cc));
      std::memcpy(address[b.id], t.storage.data(), t.storage.size());
    } else if (inputs.count(b.id)) {
      auto it = batch.find(b.name);
      if (it == batch.end()) return Status::errorf("@{}: the batch has no input '{}'", p.function, b.name);
      const size_t bytes = static_cast<size_t>(it->second.numel() * ir::dtypeBytes(it->second.dtype));
      if (bytes > static_cast<size_t>(b.bytes))
        return Status::errorf("input '{}' holds {} bytes, the program {}", b.name, bytes, b.bytes);
      std::memset(address[b.id], 0xA5, static_cast<size_t>(b.bytes));
      std::memcpy(address[b.id], it->second.data, bytes);
    } else {
      ir::HostTensor* t = params.find(b.name);
      if (!t) return Status::errorf("parameter '{}' is not in the store", b.name);
      if (static_cast<int64_t>(t->storage.size()) != b.bytes)
        return Status::errorf("parameter '{}' is {} bytes, the program needs {}", b.name, t->storage.size(), b.bytes);
      std::memcpy(address[b.id], t->storage.data(), t->storage.size());
      param_of.push_back({b.id, t});
    }
  }

  std::vector<uint64_t> placed;
  for (char* a : address) placed.push_back(reinterpret_cast<uint64_t>(a));
  for (const codegen::CudaProgram::AddressTable& t : im.built.address_tables) {
    std::vector<int64_t> words = t.at(placed);
    std::memcpy(address[static_cast<size_t>(t.buffer)], words.data(), words.size() * sizeof(int64_t));
  }

  // One launch instruction: its group's steps.
  auto launch = [&](const codegen::Instruction& in) -> Status {
    const size_t group = static_cast<size_t>(in.attrs.find("group")->second.asInt());
    auto [begin, end] = im.built.group_steps[group];
    for (size_t i = begin; i < end; ++i) {
      const codegen::CudaStep& s = im.built.steps[i];
      std::vector<void*> args;
      for (int a : s.args) args.push_back(a < 0 ? nullptr : address[static_cast<size_t>(a)]);
      if (s.isGemm()) {
        // Each operand's buffer must hold the matrices cuBLASLt will touch.
        const codegen::GemmShape& g = s.gemm;
        const int64_t bias_elements = g.epilogue == codegen::Epilogue::BiasGradA   ? g.batch * g.m
                                      : g.epilogue == codegen::Epilogue::BiasGradB ? g.batch * g.n
                                                                                   : g.n;
        const int64_t elements[4] = {g.batch * g.m * g.k, g.batch * g.k * g.n, g.batch * g.m * g.n,
                                     bias_elements};
        const ir::DType types[4] = {g.a_type, g.b_type, g.c_type, g.bias_type};
        int64_t bytes[6];
        for (int o = 0; o < 4; ++o) bytes[o] = elements[o] * ir::dtypeBytes(types[o]);
        bytes[4] = g.epilogue == codegen::Epilogue::DGelu ? bytes[2]
                                                          : s.aux_offset + g.batch * codegen::reluMaskBytes(g.m, g.n);
        bytes[5] = bytes[2];  // the residual, laid out as C
        for (int o = 0; o < 6; ++o) {
          if (s.args[static_cast<size_t>(o)] < 0) continue;
          const codegen::Buffer& b = p.buffers[static_cast<size_t>(s.args[static_cast<size_t>(o)])];
          if (b.bytes < bytes[o])
            return Status::errorf("{}: operand {} ('{}') holds {} bytes, the GEMM touches {}", s.name,
                                  "ABCbaR"[o], b.name, b.bytes, bytes[o]);
        }
        void* aux = args[4] ? static_cast<char*>(args[4]) + s.aux_offset : nullptr;
        if (codegen::epilogueHasAux(g.epilogue) && !aux) return Status::errorf("{}: no aux buffer", s.name);
        if (g.residual && !args[5]) return Status::errorf("{}: no matrix to add", s.name);
        gemmAsCublasLt(g, args[0], args[1], args[2], args[3], aux, args[5]);
      } else {
        KILN_RETURN_IF_ERROR(im.module->launch(s.name, s.launch, args));
      }
    }
    return Status::ok();
  };

  // The streams, interleaved at random where the events allow.
  std::mt19937_64 rng(seed);
  std::vector<size_t> pc(p.streams.size(), 0);
  std::vector<bool> recorded(static_cast<size_t>(p.num_events), false);
  for (;;) {
    std::vector<size_t> ready;
    bool left = false;
    for (size_t s = 0; s < p.streams.size(); ++s) {
      if (pc[s] >= p.streams[s].instrs.size()) continue;
      left = true;
      const codegen::Instruction& in = p.streams[s].instrs[pc[s]];
      if (in.kind != codegen::InstrKind::WaitEvent || recorded[static_cast<size_t>(in.event)]) ready.push_back(s);
    }
    if (!left) break;
    if (ready.empty()) return Status::errorf("@{}: every stream waits for an event nobody records", p.function);
    const size_t s = ready[std::uniform_int_distribution<size_t>(0, ready.size() - 1)(rng)];
    const codegen::Instruction& in = p.streams[s].instrs[pc[s]++];
    switch (in.kind) {
      case codegen::InstrKind::Launch: KILN_RETURN_IF_ERROR(launch(in)); break;
      case codegen::InstrKind::RecordEvent: recorded[static_cast<size_t>(in.event)] = true; break;
      case codegen::InstrKind::WaitEvent: break;
      case codegen::InstrKind::HostStep: return Status::errorf("a CUDA program has no host steps ('{}')", in.op);
    }
  }

  for (int id : im.built.error_flags) {
    const int32_t* flag = reinterpret_cast<const int32_t*>(address[static_cast<size_t>(id)]);
    if (flag[0]) return Status::errorf("@{}: an embedding kernel flagged error {{{}, {}}}", p.function, flag[0], flag[1]);
  }
  for (auto& [id, t] : param_of) std::memcpy(t->storage.data(), address[static_cast<size_t>(id)], t->storage.size());
  std::vector<ir::HostTensor> out;
  for (int id : p.results) {
    ir::HostTensor t(p.buffers[static_cast<size_t>(id)].type.dtype(), im.built.shapes[static_cast<size_t>(id)]);
    std::memcpy(t.storage.data(), address[static_cast<size_t>(id)], t.storage.size());
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace kiln::simt
