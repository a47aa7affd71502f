// `kiln calibrate [-o FILE]`: measures the rates of the machine it runs on and writes them as a
// cost table (passes/cost_table.h, kiln-costs-1) for `kiln plan --costs FILE`:
//
//   memory      a copy of large buffers on --threads threads, the best of several repeats, bytes
//               counted as read plus written; on a CPU the device's memory is the host's;
//   lookups     the runtime's CPU embedding_bag kernel itself (runtime/cpu/kernels), f32 rows,
//               uniformly random ids over a table much larger than the last-level cache, by row
//               bytes and pooling factor, as a fraction of the copy rate;
//   compute     the runtime's f32 matmul (BLAS) at 1024^3, an f32 multiply in the caches, and one
//               call of a one-element kernel: the rates `kiln plan --simulate` plays steps with;
//   all_to_all  --ranks in-process ranks (runtime/comm/local_group.h), or the MPI processes when
//               mpirun started more than one, by bytes per peer: the median of several repeats.
//
// The link between machines cannot be measured on one: it keeps the built-in cpu table's figures,
// and `source` says so. `--device cuda` measures GPU 0 instead (tools/calibrate_gpu.h) over the
// built-in table of its target.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

#include "ir/builder.h"
#include "passes/cost_table.h"
#include "runtime/comm/local_group.h"
#include "runtime/comm/mpi_communicator.h"
#include "runtime/cpu/kernels/kernels.h"
#include "runtime/cpu/thread_pool.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/memory.h"
#include "tools/calibrate_gpu.h"
#include "tools/cli.h"


namespace kiln::cli {
namespace {

constexpr int64_t kKiB = 1024, kMiB = 1024 * 1024;
// The lookup grid: the axes of the built-in tables' lookup_efficiency.
const std::vector<int64_t> kRowBytes = {32, 64, 128, 256, 512, 1024};
const std::vector<int64_t> kPooling = {1, 4, 16, 64, 256};

using Clock = std::chrono::steady_clock;
double secondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void progress(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::string bytesLabel(int64_t b) { return runtime::formatBytes(static_cast<uint64_t>(b)); }
std::string gbps(double bytes_per_s) { return fmt::format("{:.2f} GB/s", bytes_per_s / 1e9); }
std::string duration(double s) {
  return s < 1e-3 ? fmt::format("{:.1f} us", s * 1e6) : fmt::format("{:.3f} ms", s * 1e3);
}

// `v` to `digits` significant digits: the written table reads as measured, not as noise.
double significant(double v, int digits) {
  if (!(v > 0) || !std::isfinite(v)) return v;
  double scale = std::pow(10.0, digits - 1 - static_cast<int>(std::floor(std::log10(v))));
  return std::round(v * scale) / scale;
}

// A fraction of a rate, clamped into (0, 1] as the format requires, to 4 decimals.
double efficiency(double fraction) {
  if (!std::isfinite(fraction)) fraction = 1;
  return std::clamp(std::round(fraction * 1e4) / 1e4, 1e-4, 1.0);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A buffer of `bytes` whose pages the pool's threads touch first (so that on a NUMA machine
// each thread's part lives near it), filled with `fill`.
std::unique_ptr<char[]> touchedBuffer(runtime::ThreadPool& pool, int64_t bytes, int fill) {
  std::unique_ptr<char[]> p(new char[static_cast<size_t>(bytes)]);
  char* base = p.get();
  pool.parallelFor(bytes / kMiB, 1, [&](int64_t b0, int64_t b1) {
    std::memset(base + b0 * kMiB, fill, static_cast<size_t>((b1 - b0) * kMiB));
  });
  return p;
}

struct Options {
  bool quick = false;
  int threads = 1;
  int ranks = 2;
};

// --- Memory: the best of several threaded copies, counted as bytes read plus bytes written.
double measureCopy(runtime::ThreadPool& pool, int64_t bytes, int repeats) {
  auto src = touchedBuffer(pool, bytes, 1);
  auto dst = touchedBuffer(pool, bytes, 2);
  const char* s = src.get();
  char* d = dst.get();
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = Clock::now();
    pool.parallelFor(bytes / kMiB, 1, [&](int64_t b0, int64_t b1) {
      std::memcpy(d + b0 * kMiB, s + b0 * kMiB, static_cast<size_t>((b1 - b0) * kMiB));
    });
    double t = secondsSince(t0);
    if (t > 0 && (best == 0 || t < best)) best = t;
  }
  return best > 0 ? 2.0 * static_cast<double>(bytes) / best : 0;
}

// --- Lookups: the runtime's embedding_bag kernel on one op of the grid's shape.
struct LookupOp {
  std::unique_ptr<ir::Module> module;
  ir::Op* op = nullptr;
};

Expected<LookupOp> buildLookupOp(int64_t rows, int64_t dim, int64_t batch, int64_t pooling) {
  LookupOp o;
  o.module = std::make_unique<ir::Module>();
  ir::Function& f = o.module->addFunction("calibrate_lookup");
  ir::Builder b(f.entry());
  auto input = [&](const char* name, ir::DType t, int64_t d0, int64_t d1) -> Expected<ir::Value*> {
    ir::TensorType type(t, {ir::Dim::fixed(d0), ir::Dim::fixed(d1)});
    KILN_ASSIGN_OR_RETURN(ir::Op * in, b.createWithTypes(ir::OpCode::Input, {}, {type}, {{"name", ir::Attribute(name)}}));
    return in->result();
  };
  KILN_ASSIGN_OR_RETURN(ir::Value * table, input("table", ir::DType::f32, rows, dim));
  KILN_ASSIGN_OR_RETURN(ir::Value * ids, input("ids", ir::DType::i64, batch, pooling));
  KILN_ASSIGN_OR_RETURN(o.op, b.create(ir::OpCode::EmbeddingBag, {table, ids}, {{"mode", ir::Attribute("sum")}}));
  return o;
}

// --- Compute: the runtime's own kernels on shapes where each is bound by its arithmetic.
struct ComputeResult {
  double gemm_flops_per_s = 0;    // f32 matmul (BLAS), 2 m n k flops a call
  double vector_flops_per_s = 0;  // an f32 multiply over a cache-resident tensor, 1 flop an element
  double launch_s = 0;            // one call of a one-element kernel
};

// The best of `repeats` timed repeats (after one untimed warm-up) of `calls` runs of `kernel`,
// in seconds a call.
Expected<double> bestCallSeconds(runtime::ThreadPool& pool, const runtime::cpu::FastKernel& kernel,
                                 const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                                 const std::vector<ir::TensorView*>& res, int repeats, int calls) {
  ir::SymbolBindings symbols;
  runtime::cpu::KernelContext ctx;
  ctx.pool = &pool;
  ctx.symbols = &symbols;
  double best = 0;
  for (int rep = 0; rep <= repeats; ++rep) {
    auto t0 = Clock::now();
    for (int c = 0; c < calls; ++c) KILN_RETURN_IF_ERROR(kernel.run(op, in, res, ctx));
    const double t = secondsSince(t0) / calls;
    if (rep > 0 && t > 0 && (best == 0 || t < best)) best = t;
  }
  return best;
}

// The best time of `repeats` calls (after one untimed) of the kernel of a `code` op over inputs of
// `shapes` (f32, filled with small values), on `pool`.
Expected<double> timeKernel(runtime::ThreadPool& pool, ir::OpCode code, const std::vector<std::vector<int64_t>>& shapes,
                            int repeats, int calls_per_repeat) {
  ir::Module m;
  ir::Function& f = m.addFunction("calibrate_compute");
  ir::Builder b(f.entry());
  std::vector<ir::Value*> operands;
  std::vector<std::vector<float>> data;
  std::vector<ir::TensorView> views;
  views.reserve(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    std::vector<ir::Dim> dims;
    int64_t n = 1;
    for (int64_t d : shapes[i]) {
      dims.push_back(ir::Dim::fixed(d));
      n *= d;
    }
    ir::TensorType type(ir::DType::f32, dims);
    KILN_ASSIGN_OR_RETURN(ir::Op * in, b.createWithTypes(ir::OpCode::Input, {}, {type},
                                                         {{"name", ir::Attribute("x" + std::to_string(i))}}));
    operands.push_back(in->result());
    data.emplace_back(static_cast<size_t>(n), 0.5f);
    views.push_back(ir::TensorView{ir::DType::f32, shapes[i], data.back().data()});
  }
  KILN_ASSIGN_OR_RETURN(ir::Op * op, b.create(code, operands));
  const runtime::cpu::FastKernel* kernel = runtime::cpu::findFastKernel(*op);
  if (!kernel) return Status::errorf("the CPU runtime has no kernel for {}", ir::opName(code));
  std::vector<int64_t> out_shape;
  for (const ir::Dim& d : op->result()->type().shape()) out_shape.push_back(d.size());
  int64_t out_n = 1;
  for (int64_t d : out_shape) out_n *= d;
  std::vector<float> out(static_cast<size_t>(out_n));
  ir::TensorView ov{ir::DType::f32, out_shape, out.data()};
  std::vector<const ir::TensorView*> in;
  for (const auto& v : views) in.push_back(&v);
  return bestCallSeconds(pool, *kernel, *op, in, {&ov}, repeats, calls_per_repeat);
}

Expected<ComputeResult> measureCompute(runtime::ThreadPool& pool, int threads, bool quick) {
  ComputeResult r;

  const int64_t n = quick ? 512 : 1024;
  KILN_ASSIGN_OR_RETURN(double gemm, timeKernel(pool, ir::OpCode::Matmul, {{n, n}, {n, n}}, quick ? 2 : 3, 1));
  r.gemm_flops_per_s = 2.0 * static_cast<double>(n * n * n) / gemm;
  const int64_t elems = 64 * 1024;  // 256 KiB a tensor: in the caches
  KILN_ASSIGN_OR_RETURN(double mul, timeKernel(pool, ir::OpCode::Mul, {{elems}, {elems}}, 3, quick ? 50 : 200));
  r.vector_flops_per_s = static_cast<double>(elems) / mul;
  KILN_ASSIGN_OR_RETURN(r.launch_s, timeKernel(pool, ir::OpCode::Mul, {{1}, {1}}, 3, quick ? 1000 : 10000));
  return r;
}

struct LookupResult {
  std::vector<std::vector<double>> bytes_per_s;  // [row_bytes][pooling], rows gathered a second
};

Expected<LookupResult> measureLookups(runtime::ThreadPool& pool, int64_t table_bytes, int64_t bytes_per_call,
                                      int repeats) {
  // One table's memory serves every row size: rows = table_bytes / row_bytes.
  auto table_mem = touchedBuffer(pool, table_bytes, 0);
  LookupResult r;
  std::mt19937_64 rng(20240531);
  for (int64_t row_bytes : kRowBytes) {
    const int64_t dim = row_bytes / 4, rows = table_bytes / row_bytes;
    const int64_t ids_per_call = bytes_per_call / row_bytes;
    std::vector<int64_t> ids(static_cast<size_t>(ids_per_call));
    std::uniform_int_distribution<int64_t> pick(0, rows - 1);
    for (auto& id : ids) id = pick(rng);
    std::vector<double> row_rates;
    for (int64_t pooling : kPooling) {
      const int64_t batch = std::max<int64_t>(1, ids_per_call / pooling);
      KILN_ASSIGN_OR_RETURN(LookupOp o, buildLookupOp(rows, dim, batch, pooling));
      const runtime::cpu::FastKernel* kernel = runtime::cpu::findFastKernel(*o.op);
      if (!kernel) return Status::error("the CPU runtime has no embedding_bag kernel for f32 rows and i64 ids");
      std::vector<float> out(static_cast<size_t>(batch * dim));
      ir::TensorView tv{ir::DType::f32, {rows, dim}, table_mem.get()};
      ir::TensorView iv{ir::DType::i64, {batch, pooling}, ids.data()};
      ir::TensorView ov{ir::DType::f32, {batch, dim}, out.data()};
      KILN_ASSIGN_OR_RETURN(double best, bestCallSeconds(pool, *kernel, *o.op, {&tv, &iv}, {&ov}, repeats, 1));
      const double gathered = static_cast<double>(batch * pooling * row_bytes);
      row_rates.push_back(best > 0 ? gathered / best : 0);
    }
    r.bytes_per_s.push_back(std::move(row_rates));
  }
  return r;
}

// --- all_to_all: every rank times each collective; a repeat takes the slowest rank's time.
struct A2aResult {
  std::vector<int64_t> sizes;       // bytes per peer
  std::vector<double> seconds;      // the median over repeats of the slowest rank's time
  int ranks = 0;
};

// Runs on every rank (a thread of a LocalGroup, or an MPI process). times[s * repeats + r] is
// this rank's r-th repeat of size s; every rank ends with all ranks' times (an allGather).
Status timeAllToAll(comm::Communicator& c, const std::vector<int64_t>& sizes, int repeats,
                    std::vector<double>* all_times) {
  const int n = c.size();
  std::vector<double> mine;
  for (int64_t size : sizes) {
    std::vector<unsigned char> send(static_cast<size_t>(size * n), static_cast<unsigned char>(c.rank() + 1));
    std::vector<unsigned char> recv(static_cast<size_t>(size * n), 0);
    for (int w = 0; w < 2; ++w)  // warm up: pages touched, the peers' paths taken once
      KILN_RETURN_IF_ERROR(c.allToAllSync(send.data(), recv.data(), static_cast<size_t>(size), comm::DataType::u8));
    for (int r = 0; r < repeats; ++r) {
      KILN_RETURN_IF_ERROR(c.barrier());
      auto t0 = Clock::now();
      KILN_RETURN_IF_ERROR(c.allToAllSync(send.data(), recv.data(), static_cast<size_t>(size), comm::DataType::u8));
      mine.push_back(secondsSince(t0));
    }
    // What arrived from peer p is p's bytes: a check that the collective moved the data.
    for (int p = 0; p < n; ++p)
      if (recv[static_cast<size_t>(p * size + size - 1)] != static_cast<unsigned char>(p + 1))
        return Status::errorf("all_to_all of {} a peer: rank {} received wrong bytes from rank {}", size, c.rank(), p);
  }
  all_times->assign(mine.size() * static_cast<size_t>(n), 0);
  return c.allGatherSync(mine.data(), all_times->data(), mine.size(), comm::DataType::f64);
}

A2aResult summarizeAllToAll(const std::vector<int64_t>& sizes, int repeats, int ranks,
                            const std::vector<double>& all_times) {
  A2aResult r;
  r.sizes = sizes;
  r.ranks = ranks;
  const size_t per_rank = sizes.size() * static_cast<size_t>(repeats);
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<double> slowest;
    for (int rep = 0; rep < repeats; ++rep) {
      double t = 0;
      for (int k = 0; k < ranks; ++k)
        t = std::max(t, all_times[static_cast<size_t>(k) * per_rank + s * static_cast<size_t>(repeats) +
                                  static_cast<size_t>(rep)]);
      slowest.push_back(t);
    }
    r.seconds.push_back(median(slowest));
  }
  return r;
}

std::string hostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

std::string utcNow() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The table's lookup efficiencies, a row per row size.
void printLookupEfficiency(const passes::CostTable& t, double memory_rate) {
  std::printf("\nlookup efficiency (fraction of %s; rows: row bytes, columns: pooling)\n", gbps(memory_rate).c_str());
  std::string header = fmt::format("{:>9}", "row bytes");
  for (int64_t pl : kPooling) header += fmt::format("  {:>6}", pl);
  std::printf("%s\n", header.c_str());
  for (size_t i = 0; i < kRowBytes.size(); ++i) {
    std::string line = fmt::format("{:>9}", kRowBytes[i]);
    for (double e : t.lookup_efficiency.z[i]) line += fmt::format("  {:>6.3f}", e);
    std::printf("%s\n", line.c_str());
  }
}

// The table checked by reading it back, then (with -o) written to a temporary file and renamed
// into place.
int writeTable(const passes::CostTable& t, const std::string& out_path) {
  const std::string text = passes::writeCostTable(t);
  auto back = passes::parseCostTable(text, out_path.empty() ? "<calibrated table>" : out_path);
  if (!back) {
    printError("calibrate", back.status());
    return kExitError;
  }
  if (out_path.empty()) {
    std::printf("\nnothing written (pass -o FILE to write the cost table)\n");
    return kExitOk;
  }
  const std::string tmp = out_path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f.good()) {
      std::remove(tmp.c_str());
      std::fprintf(stderr, "kiln calibrate: error: cannot write '%s'\n", tmp.c_str());
      return kExitError;
    }
  }
  if (std::rename(tmp.c_str(), out_path.c_str()) != 0) {
    std::fprintf(stderr, "kiln calibrate: error: cannot rename '%s' to '%s': %s\n", tmp.c_str(), out_path.c_str(),
                 std::strerror(errno));
    std::remove(tmp.c_str());
    return kExitError;
  }
  std::printf("\nwrote %s (target \"%s\")\n", out_path.c_str(), t.target.c_str());
  return kExitOk;
}

// --device cuda: GPU 0 measured (tools/calibrate_gpu.h) over the built-in table of its target.
int calibrateCuda(const Options& o, std::string name, const std::string& out_path) {
  GpuCalibrationOptions go;
  go.memory_bytes = (o.quick ? 256 : 1024) * kMiB;
  go.table_bytes = (o.quick ? 256 : 1024) * kMiB;
  go.lookup_bytes_per_call = (o.quick ? 32 : 256) * kMiB;
  go.gemm_n = o.quick ? 4096 : 8192;
  go.repeats = o.quick ? 2 : 5;
  go.row_bytes = kRowBytes;
  go.pooling = kPooling;
  go.progress = progress;
  auto c = calibrateGpu(go);
  if (!c) {
    printError("calibrate", c.status());
    return kExitError;
  }
  auto base = passes::builtinCostTable(c->target);
  if (!base) {
    printError("calibrate", base.status());
    return kExitError;
  }
  passes::CostTable t = *base;
  t.target = name.empty() ? c->target + "-calibrated" : std::move(name);
  t.device_bytes_per_s = significant(c->read_bytes_per_s, 4);
  t.gemm_flops_per_s = {significant(c->gemm_f32_flops_per_s, 4), significant(c->gemm_bf16_flops_per_s, 4)};
  t.lookup_efficiency.x.assign(kRowBytes.begin(), kRowBytes.end());
  t.lookup_efficiency.y.assign(kPooling.begin(), kPooling.end());
  t.lookup_efficiency.z.clear();
  for (const auto& row : c->lookup_bytes_per_s) {
    std::vector<double> z;
    for (double rate : row) z.push_back(efficiency(rate / c->read_bytes_per_s));
    t.lookup_efficiency.z.push_back(std::move(z));
  }
  t.source = fmt::format(
      "kiln calibrate --device cuda on {} ({}), {}{}. memory: kiln.reduce(sum) of the 16 KiB rows of a {} f32 "
      "parameter on the GPU, bytes read a second, best of {} profiles. lookup_efficiency: the CUDA embedding_bag "
      "kernel over a {} f32 table, uniformly random ids, {} gathered a call, over the memory rate. "
      "gemm_flops_per_s: kiln.matmul "
      "(cuBLASLt) at {}^3, f32 and bf16. Links, pcie, launch_s, vector rates and all_to_all_efficiency: the built-in "
      "{} table's (one GPU measures no peers).",
      c->device, hostName(), utcNow(), o.quick ? ", --quick" : "", bytesLabel(go.memory_bytes), go.repeats,
      bytesLabel(go.table_bytes), bytesLabel(go.lookup_bytes_per_call), go.gemm_n, c->target);
  std::printf("\ngpu: %s (target %s)\n", c->device.c_str(), c->target.c_str());
  std::printf("memory: %s (reduce(sum), bytes read)\n", gbps(t.device_bytes_per_s).c_str());
  std::printf("gemm: f32 %.1f TFLOP/s, bf16 %.1f TFLOP/s\n", t.gemm_flops_per_s.f32 / 1e12,
              t.gemm_flops_per_s.bf16 / 1e12);
  printLookupEfficiency(t, t.device_bytes_per_s);
  std::printf("\nlinks, pcie, launch and all_to_all: the built-in %s table's (not measured on one GPU)\n",
              c->target.c_str());
  return writeTable(t, out_path);
}

}  // namespace

int runCalibrate(const std::vector<std::string>& raw_args) {
  ArgParser p("calibrate",
              "kiln calibrate [-o FILE] [--quick] [--threads T] [--ranks N] [--name NAME] [--device cpu|cuda]",
              "Measures the rates of this machine and writes them as a cost table (kiln-costs-1) for\n"
              "`kiln plan --costs FILE`: the memory bandwidth (a threaded copy of large buffers), the\n"
              "efficiency of the CPU embedding_bag kernel by row bytes and pooling factor (uniformly\n"
              "random ids over a table much larger than the cache), and all_to_all between in-process\n"
              "ranks (or the MPI processes, under mpirun) by message size. The link between machines\n"
              "cannot be measured on one: it keeps the built-in cpu table's figures. Prints a summary;\n"
              "writes the table only with -o / --output. With --device cuda: GPU 0's memory rate, its\n"
              "embedding_bag kernel's efficiency and its GEMM rates; links keep the target's figures.");
  p.addOption("output", "FILE", "write the cost table to FILE (also -o FILE)");
  p.addFlag("quick", "smaller buffers, fewer repeats and messages up to 4 MiB (a few seconds)");
  p.addOption("threads", "T", "threads of the memory and lookup measurements (default: all cores)");
  p.addOption("ranks", "N", "in-process ranks of the all_to_all measurement (under mpirun: its processes)", "2");
  p.addOption("name", "NAME", "the table's target name (default: cpu-calibrated, or the GPU's target and -calibrated)");
  p.addOption("device", "D", "cpu (the default), or cuda: GPU 0's memory, lookups and GEMMs (one process)", "cpu");
  std::vector<std::string> args = expandOutputShorthand(raw_args);
  int code;
  if (!p.parse(args, &code)) return code;

  Options o;
  o.quick = p.flag("quick");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.threads = cores;
  if (p.has("threads")) {
    auto t = p.getInt("threads");
    if (!t) return kExitUsage;
    if (*t < 1 || *t > 4096) return p.usageError(fmt::format("--threads must lie in [1, 4096], got {}", *t));
    o.threads = static_cast<int>(*t);
  }
  auto ranks = p.getInt("ranks");
  if (!ranks) return kExitUsage;
  if (*ranks < 2 || *ranks > 256)
    return p.usageError(fmt::format("--ranks must lie in [2, 256] (all_to_all needs peers), got {}", *ranks));
  o.ranks = static_cast<int>(*ranks);
  const std::string device = p.get("device");
  if (device != "cpu" && device != "cuda")
    return p.usageError(fmt::format("--device must be cpu or cuda, got '{}'", device));
  if (p.has("name") && p.get("name").empty()) return p.usageError("--name must not be empty");
  std::string out_path = p.has("output") ? p.get("output") : "";
  if (!out_path.empty()) {
    std::filesystem::path dir = std::filesystem::path(out_path).parent_path();
    std::error_code ec;
    if (!dir.empty() && !std::filesystem::is_directory(dir, ec))
      return p.usageError(fmt::format("cannot write '{}': no folder '{}'", out_path, dir.string()));
  }

  // mpirun started this process with peers: all_to_all runs between the MPI processes.
  auto world = comm::mpiWorldIfLaunched();
  if (!world) {
    printError("calibrate", world.status());
    return kExitError;
  }
  std::unique_ptr<comm::Communicator> mpi = world.take();
  if (mpi) {
    if (mpi->size() < 2) {
      mpi.reset();  // one process: in-process ranks as without mpirun
    } else {
      if (p.has("ranks") && o.ranks != mpi->size())
        return p.usageError(
            fmt::format("--ranks {} disagrees with mpirun's {} processes", o.ranks, mpi->size()));
      o.ranks = mpi->size();
    }
  }
  const bool lead = !mpi || mpi->rank() == 0;
  if (device == "cuda") {
    if (mpi) return p.usageError("--device cuda calibrates one GPU from one process: run it without mpirun");
    return calibrateCuda(o, p.has("name") ? p.get("name") : "", out_path);
  }
  const std::string name = p.has("name") ? p.get("name") : "cpu-calibrated";

  // The sizes of one run (docs/distributed.md, "Calibrating a machine").
  const int64_t copy_bytes = (o.quick ? 64 : 256) * kMiB;
  const int copy_repeats = o.quick ? 3 : 5;
  const int64_t table_bytes = (o.quick ? 128 : 512) * kMiB;
  const int64_t lookup_bytes_per_call = (o.quick ? 8 : 32) * kMiB;
  const int lookup_repeats = o.quick ? 2 : 3;
  std::vector<int64_t> a2a_sizes = {1 * kKiB, 4 * kKiB, 64 * kKiB, 1 * kMiB, (o.quick ? 4 : 16) * kMiB};
  const int a2a_repeats = o.quick ? 7 : 15;

  std::string gpu_why;
  const bool gpu = lead && cuda::cudaAvailable(&gpu_why);

  // all_to_all first under MPI (every process takes part; then only rank 0 goes on).
  A2aResult a2a;
  auto measureA2a = [&]() -> Status {
    if (lead)
      progress(fmt::format("measuring all_to_all between {} {} ({} to {} a peer, median of {})...", o.ranks,
                           mpi ? "MPI processes" : "in-process ranks", bytesLabel(a2a_sizes.front()),
                           bytesLabel(a2a_sizes.back()), a2a_repeats));
    std::vector<double> times;
    if (mpi) {
      KILN_RETURN_IF_ERROR(timeAllToAll(*mpi, a2a_sizes, a2a_repeats, &times));
    } else {
      comm::LocalGroup group(o.ranks);
      std::vector<std::vector<double>> per_rank(static_cast<size_t>(o.ranks));
      KILN_RETURN_IF_ERROR(group.run([&](comm::Communicator& c) {
        return timeAllToAll(c, a2a_sizes, a2a_repeats, &per_rank[static_cast<size_t>(c.rank())]);
      }));
      times = per_rank[0];
    }
    a2a = summarizeAllToAll(a2a_sizes, a2a_repeats, o.ranks, times);
    return Status::ok();
  };
  if (mpi) {
    if (Status s = measureA2a(); !s) {
      printError("calibrate", s);
      mpi->abort(s.message());
      return kExitError;
    }
    if (!lead) return kExitOk;
  }

  if (gpu) progress("note: a CUDA GPU is present; this table is the CPU's (--device cuda calibrates the GPU)");
  auto made = runtime::ThreadPool::create(o.threads);
  if (!made) {
    printError("calibrate", made.status());
    return kExitError;
  }
  runtime::ThreadPool& pool = **made;
  progress(fmt::format("measuring memory: copy of {} on {} thread{}, best of {}...", bytesLabel(copy_bytes),
                       o.threads, o.threads == 1 ? "" : "s", copy_repeats));
  const double copy_rate = significant(measureCopy(pool, copy_bytes, copy_repeats), 4);
  if (!(copy_rate > 0)) {
    std::fprintf(stderr, "kiln calibrate: error: the memory copy took no measurable time\n");
    return kExitError;
  }
  progress(fmt::format("measuring lookups: embedding_bag kernel over a {} f32 table, uniformly random ids, "
                       "{} row sizes x {} pooling factors...",
                       bytesLabel(table_bytes), kRowBytes.size(), kPooling.size()));
  auto lookups = measureLookups(pool, table_bytes, lookup_bytes_per_call, lookup_repeats);
  if (!lookups) {
    printError("calibrate", lookups.status());
    return kExitError;
  }
  progress(fmt::format("measuring compute: f32 matmul {0}x{0}x{0} (BLAS), an f32 multiply in the caches, "
                       "a one-element kernel's call...",
                       o.quick ? 512 : 1024));
  auto compute = measureCompute(pool, o.threads, o.quick);
  if (!compute) {
    printError("calibrate", compute.status());
    return kExitError;
  }
  if (!mpi) {
    if (Status s = measureA2a(); !s) {
      printError("calibrate", s);
      return kExitError;
    }
  }

  // The table.
  passes::CostTable t;
  auto cpu = passes::builtinCostTable("cpu");
  if (!cpu) {
    printError("calibrate", cpu.status());
    return kExitError;
  }
  t.target = name;
  t.device_bytes_per_s = copy_rate;
  t.host_bytes_per_s = copy_rate;  // a CPU's device memory is the host's
  t.pcie_bytes_per_s = 0;          // no GPU measured: no host-to-device link
  t.inter_node = cpu->inter_node;
  t.gemm_flops_per_s = {significant(compute->gemm_flops_per_s, 4), significant(compute->gemm_flops_per_s, 4)};
  t.vector_flops_per_s = {significant(compute->vector_flops_per_s, 4), significant(compute->vector_flops_per_s, 4)};
  t.launch_s = significant(compute->launch_s, 3);
  t.lookup_efficiency.x.assign(kRowBytes.begin(), kRowBytes.end());
  t.lookup_efficiency.y.assign(kPooling.begin(), kPooling.end());
  for (const auto& row : lookups->bytes_per_s) {
    std::vector<double> z;
    for (double rate : row) z.push_back(efficiency(rate / copy_rate));
    t.lookup_efficiency.z.push_back(std::move(z));
  }
  std::vector<double> a2a_rates;
  double link_rate = 0;
  for (size_t s = 0; s < a2a.sizes.size(); ++s) {
    // What one rank sends its peers (its own segment stays home).
    double sent = static_cast<double>(a2a.sizes[s]) * (a2a.ranks - 1);
    a2a_rates.push_back(a2a.seconds[s] > 0 ? sent / a2a.seconds[s] : 0);
    link_rate = std::max(link_rate, a2a_rates.back());
  }
  if (!(link_rate > 0)) {
    std::fprintf(stderr, "kiln calibrate: error: the all_to_all measurement took no measurable time\n");
    return kExitError;
  }
  t.intra_node.bytes_per_s = significant(link_rate, 4);
  t.intra_node.latency_s = significant(a2a.seconds.front(), 3);
  for (size_t s = 0; s < a2a.sizes.size(); ++s) {
    t.a2a_efficiency.x.push_back(static_cast<double>(a2a.sizes[s]));
    t.a2a_efficiency.y.push_back(efficiency(a2a_rates[s] / link_rate));
  }
  std::string flags = fmt::format("--threads {} --ranks {}{}", o.threads, o.ranks, o.quick ? " --quick" : "");
  t.source = fmt::format(
      "kiln calibrate on {} ({} cores), {}, flags: {}. memory: the best of {} copies of {} on {} threads, bytes "
      "read plus written (host = device on a CPU; pcie 0: no GPU measured). lookup_efficiency: the CPU "
      "embedding_bag kernel, f32 rows, uniformly random ids over a {} table, {} gathered a call, best of {}, "
      "over the copy rate. intra_node and all_to_all_efficiency: all_to_all between {} {}, the median of {} "
      "repeats (the slowest rank's time), bytes one rank sends its peers a second; latency_s is the {} "
      "message's time. compute: the BLAS f32 matmul at {}^3, an f32 multiply of 64Ki elements in the caches, and a "
      "one-element kernel's call, best of several, on {} threads. inter_node: not measurable on one machine, the "
      "built-in cpu table's figures.{}",
      hostName(), cores, utcNow(), flags, copy_repeats, bytesLabel(copy_bytes), o.threads, bytesLabel(table_bytes),
      bytesLabel(lookup_bytes_per_call), lookup_repeats, o.ranks, mpi ? "MPI processes" : "in-process ranks",
      a2a_repeats, bytesLabel(a2a_sizes.front()), o.quick ? 512 : 1024, o.threads,
      gpu ? " A CUDA GPU was present: this table is the CPU's (kiln calibrate --device cuda measures the GPU)." : "");

  // The summary.
  std::printf("\nmemory: %s (copy, read + written; device = host on a CPU; pcie: none)\n", gbps(copy_rate).c_str());
  std::printf("compute: f32 matmul %.1f GFLOP/s, vector %.2f GFLOP/s, one kernel call %s (bf16 matmuls widen to "
              "f32 on a CPU: the same rate)\n",
              t.gemm_flops_per_s.f32 / 1e9, t.vector_flops_per_s.f32 / 1e9, duration(t.launch_s).c_str());
  printLookupEfficiency(t, copy_rate);
  std::printf("\nall_to_all (%d %s)\n", o.ranks, mpi ? "MPI processes" : "in-process ranks");
  std::printf("%s\n", fmt::format("{:>10}  {:>10}  {:>12}  {:>10}", "bytes/peer", "time", "rate/rank", "efficiency")
                          .c_str());
  for (size_t s = 0; s < a2a.sizes.size(); ++s)
    std::printf("%s\n", fmt::format("{:>10}  {:>10}  {:>12}  {:>10.3f}", bytesLabel(a2a.sizes[s]),
                                    duration(a2a.seconds[s]), gbps(a2a_rates[s]), t.a2a_efficiency.y[s])
                            .c_str());
  std::printf("\nlinks: intra_node %s a rank, latency %s (measured); inter_node %s, latency %s (the built-in cpu "
              "table's: not measured)\n",
              gbps(t.intra_node.bytes_per_s).c_str(), duration(t.intra_node.latency_s).c_str(),
              gbps(t.inter_node.bytes_per_s).c_str(), duration(t.inter_node.latency_s).c_str());
  if (gpu) std::printf("gpu: present; this table is the CPU's (--device cuda calibrates the GPU)\n");

  return writeTable(t, out_path);
}

}  // namespace kiln::cli
