// `kiln serve MODEL.kiln --checkpoint CKPT [--store DIR] [--watch DIR]`: an inference server
// (docs/serving.md). `kiln store import CKPT DIR --model MODEL.kiln`: fills a persistent
// embedding store from a checkpoint.
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <thread>

#include "driver/compiled_model.h"
#include "driver/evaluator.h"
#include "runtime/checkpoint.h"
#include "runtime/serving/rocksdb_store.h"
#include "tools/cli.h"
#include "driver/model_server.h"
#include "tools/session_flags.h"
#include "tools/serve_http.h"

namespace kiln::cli {
namespace {

// The write end of the pipe the stop signals are reported to.
int g_stop_pipe = -1;

void onStopSignal(int sig) {
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!::write(g_stop_pipe, &b, 1);
}

// Rows read from a checkpoint at once while filling a store.
constexpr int64_t kImportChunkRows = 1 << 16;

int64_t checkpointStep(const runtime::CheckpointHeader& h) {
  auto it = h.metadata.find("step");
  return it == h.metadata.end() ? 0 : std::atoll(it->second.c_str());
}

// Copies table `t`'s rows from the checkpoint to `sink`, a chunk at a time.
Status streamTable(const std::string& path, const runtime::CheckpointHeader& h, const serving::ServedTable& t,
                   const std::function<Status(int64_t first, int64_t count, const float* rows)>& sink) {
  const runtime::CheckpointEntry* e = h.find(t.name);
  if (!e) return Status::errorf("the checkpoint '{}' has no table '{}'", path, t.name);
  if (e->dtype != ir::DType::f32 || e->shape != std::vector<int64_t>{t.rows, t.dim})
    return Status::errorf("table '{}' is {}[{}] in the checkpoint but f32[{}, {}] in the model", t.name,
                          ir::dtypeName(e->dtype), fmt::join(e->shape, ", "), t.rows, t.dim);
  std::vector<float> chunk;
  for (int64_t first = 0; first < t.rows; first += kImportChunkRows) {
    const int64_t count = std::min(kImportChunkRows, t.rows - first);
    chunk.resize(static_cast<size_t>(count * t.dim));
    const uint64_t row_bytes = static_cast<uint64_t>(t.dim) * sizeof(float);
    KILN_RETURN_IF_ERROR(
        runtime::readCheckpointBytes(path, e->file_offset + static_cast<uint64_t>(first) * row_bytes,
                                     static_cast<uint64_t>(count) * row_bytes, chunk.data(), t.name));
    KILN_RETURN_IF_ERROR(sink(first, count, chunk.data()));
  }
  return Status::ok();
}

// Loads the session's own parameters (all but the served tables) from the checkpoint.
Status loadDense(driver::Session& s, const std::string& path, const runtime::CheckpointHeader& h) {
  for (const std::string& name : s.checkpointNames()) {
    const runtime::CheckpointEntry* e = h.find(name);
    if (!e) return Status::errorf("the checkpoint '{}' has no parameter '{}'", path, name);
    ir::HostTensor* t = s.params().find(name);
    if (e->dtype != t->view.dtype || e->shape != t->view.shape)
      return Status::errorf("parameter '{}' is {}[{}] in the checkpoint but {}[{}] in the model", name,
                            ir::dtypeName(e->dtype), fmt::join(e->shape, ", "), ir::dtypeName(t->view.dtype),
                            fmt::join(t->view.shape, ", "));
    KILN_RETURN_IF_ERROR(runtime::readCheckpointBytes(path, e->file_offset, e->bytes, t->view.data, name));
  }
  return Status::ok();
}

std::vector<serving::TableInfo> tableInfos(const std::vector<serving::ServedTable>& tables) {
  std::vector<serving::TableInfo> out;
  for (const serving::ServedTable& t : tables) out.push_back({t.name, t.rows, t.dim});
  return out;
}

bool parseSizes(const std::string& text, std::vector<int64_t>& out) {
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end || v < 1) return false;
    out.push_back(v);
  }
  std::sort(out.begin(), out.end());
  return !out.empty();
}

// Opens a forward-only session whose served tables a store holds.
Expected<std::unique_ptr<driver::Session>> openServingSession(const ModelSource& model, driver::SessionOptions so) {
  so.training = false;
  so.external_tables = true;
  return model.open(so, std::cerr);
}

}  // namespace

int runServe(const ModelSource& model, const std::vector<std::string>& args) {
  ArgParser p("serve", model.synopsis("serve") + " --checkpoint CKPT [flags]",
              "Serves a trained model over HTTP: the Open Inference Protocol (KServe v2) with dynamic\n"
              "batching, its embedding tables in a cache over host memory over an optional RocksDB store,\n"
              "and updates published by `kiln train --publish` applied while serving (docs/serving.md).\n"
              "SIGTERM or SIGINT stops taking requests, answers those in flight and exits 0.");
  model.addModelArgument(p);
  p.addOption("checkpoint", "CKPT",
              "the checkpoint to serve (a directory written by kiln train, or a .safetensors file)");
  p.addOption("host", "ADDR", "the address to listen on", "127.0.0.1");
  p.addOption("port", "N", "the port to listen on (0: any free port; the bound one is printed)", "8000");
  p.addOption("max-batch", "N", "most samples per computed batch (and per request)", "256");
  p.addOption("max-queue-delay-us", "US", "longest a request waits for others to batch with", "1000");
  p.addOption("preferred-batch-sizes", "LIST",
              "batch sizes to dispatch at once when reached (e.g. 64,128,256)");
  p.addOption("instances", "N", "executors sharing the queue (each with --threads threads)", "1");
  p.addOption("request-timeout-ms", "MS", "a request not scheduled within this time gets 504", "10000");
  p.addOption("max-request-bytes", "N", "larger request bodies (once de-chunked and inflated) get 413", "16777216");
  p.addOption("http-threads", "N", "requests read and answered at once", "16");
  p.addOption("max-connections", "N", "connections open at once; more get 503", "256");
  p.addOption("idle-timeout-ms", "MS", "a connection with no request arriving for this long is closed", "5000");
  p.addOption("header-timeout-ms", "MS", "a request's line and headers must arrive within this (408)", "5000");
  p.addOption("body-timeout-ms", "MS", "a request's body must arrive within this after its headers (408)",
              "10000");
  p.addOption("cache-fraction", "F", "rows of each table in the cache tier, as a fraction of its rows", "1");
  p.addOption("host-fraction", "H", "rows of each table in the host tier (with --store; without, all)", "1");
  p.addOption("store", "DIR", "the persistent tier: a RocksDB store filled by kiln store import");
  p.addOption("eviction", "lru|lfu", "which row a full tier drops", "lru");
  p.addOption("watch", "DIR", "apply the update files kiln train --publish writes to DIR");
  p.addOption("poll-ms", "MS", "how often --watch looks for updates", "200");
  addModelFlags(p, model);
  int code;
  if (!p.parse(args, &code)) return code;
  // A compiled model with embedded weights (./NAME serve) needs no checkpoint.
  if (!p.has("checkpoint") && !model.embeddedWeights()) return p.usageError("--checkpoint CKPT is required");
  auto intOpt = [&](const char* name, int64_t lo, int64_t hi, int64_t& out) {
    auto v = p.getInt(name);
    if (!v) return false;
    if (*v < lo || *v > hi) {
      p.usageError(fmt::format("--{} must be in [{}, {}], got {}", name, lo, hi, *v));
      return false;
    }
    out = *v;
    return true;
  };
  driver::ServeOptions so;
  so.on_update = [](const std::string& line) { std::fprintf(stderr, "kiln serve: %s\n", line.c_str()); };
  HttpOptions ho;
  int64_t port = 0, instances = 1, max_bytes = 0, http_threads = 16, max_connections = 256, idle_ms = 0,
          header_ms = 0, body_ms = 0;
  if (!intOpt("port", 0, 65535, port) || !intOpt("max-batch", 1, 1 << 20, so.max_batch) ||
      !intOpt("max-queue-delay-us", 0, 60000000, so.max_queue_delay_us) ||
      !intOpt("instances", 1, 256, instances) ||
      !intOpt("request-timeout-ms", 1, 3600000, so.request_timeout_ms) ||
      !intOpt("max-request-bytes", 1024, int64_t{1} << 32, max_bytes) ||
      !intOpt("http-threads", 2, 1024, http_threads) || !intOpt("max-connections", 1, 65536, max_connections) ||
      !intOpt("idle-timeout-ms", 1, 3600000, idle_ms) || !intOpt("header-timeout-ms", 1, 3600000, header_ms) ||
      !intOpt("body-timeout-ms", 1, 3600000, body_ms) || !intOpt("poll-ms", 1, 3600000, so.poll_ms))
    return kExitUsage;
  if (p.has("preferred-batch-sizes") && !parseSizes(p.get("preferred-batch-sizes"), so.preferred_batch_sizes))
    return p.usageError("--preferred-batch-sizes must be a list of positive sizes such as 64,128,256");
  for (int64_t s : so.preferred_batch_sizes)
    if (s > so.max_batch)
      return p.usageError(fmt::format("preferred batch size {} is over --max-batch {}", s, so.max_batch));
  serving::StoreOptions store_options;
  auto cache = p.getDouble("cache-fraction");
  auto host = p.getDouble("host-fraction");
  if (!cache || !host) return kExitUsage;
  if (!(*cache >= 0 && *cache <= 1) || !(*host > 0 && *host <= 1))
    return p.usageError("--cache-fraction must be in [0, 1] and --host-fraction in (0, 1]");
  store_options.cache_fraction = *cache;
  store_options.host_fraction = *host;
  const std::string eviction = p.get("eviction");
  if (eviction != "lru" && eviction != "lfu")
    return p.usageError(fmt::format("--eviction must be lru or lfu, got '{}'", eviction));
  store_options.policy = eviction == "lfu" ? serving::EvictionPolicy::Lfu : serving::EvictionPolicy::Lru;
  const std::string store_dir = p.get("store");
  if (store_dir.empty() && *host != 1)
    return p.usageError("--host-fraction below 1 needs --store DIR (the rows must live somewhere)");
  so.watch_dir = p.get("watch");
  if (!so.watch_dir.empty() && !std::filesystem::is_directory(so.watch_dir))
    return p.usageError(fmt::format("--watch: no such directory '{}'", so.watch_dir));
  ho.host = p.get("host");
  ho.port = static_cast<int>(port);
  ho.max_request_bytes = max_bytes;
  ho.threads = static_cast<int>(http_threads);
  ho.max_connections = static_cast<int>(max_connections);
  ho.idle_timeout_ms = static_cast<int>(idle_ms);
  ho.header_timeout_ms = static_cast<int>(header_ms);
  ho.body_timeout_ms = static_cast<int>(body_ms);
#ifdef KILN_VERSION
  ho.version = KILN_VERSION;
#endif

  driver::SessionOptions session_options;
  if (!model.readModelArgument(p, session_options, &code)) return code;
  session_options.batch = so.max_batch;
  if (!readModelFlags(p, model, session_options, &code)) return code;
  auto fail = [](const Status& st) {
    printError("serve", st);
    return kExitError;
  };
  // The weights: a checkpoint file read piece by piece, or the executable's embedded ones.
  const bool from_checkpoint = p.has("checkpoint");
  std::string ckpt_path;
  runtime::CheckpointHeader header;
  int64_t step = 0;
  if (from_checkpoint) {
    auto path = driver::checkpointFile(p.get("checkpoint"));
    if (!path) return fail(path.status());
    ckpt_path = *path;
    auto h = runtime::readCheckpointHeader(ckpt_path);
    if (!h) return fail(h.status());
    header = h.take();
    step = checkpointStep(header);
  } else {
    const driver::CompiledModel& c = *model.compiled();
    auto weights = runtime::viewCheckpoint(c.weights, "the embedded weights", c.payload);
    if (!weights) return fail(weights.status());
    auto it = weights->metadata.find("step");
    step = it == weights->metadata.end() ? 0 : std::atoll(it->second.c_str());
  }

  std::vector<std::unique_ptr<driver::Session>> sessions;
  for (int64_t i = 0; i < instances; ++i) {
    auto s = openServingSession(model, session_options);
    if (!s) return fail(s.status());
    if (from_checkpoint)
      if (Status st = loadDense(**s, ckpt_path, header); !st) return fail(st);
    sessions.push_back(s.take());
  }
  driver::Session& first = *sessions[0];
  if (first.forwardSpec().readsTokens())
    return fail(Status::error("a language model (a token input) has no per-sample score to serve"));
  const std::vector<serving::ServedTable>& tables = first.servedTables();
  std::unique_ptr<serving::EmbeddingStore> store;
  if (store_dir.empty()) {
    auto s = serving::EmbeddingStore::inMemory(tableInfos(tables), store_options);
    if (!s) return fail(s.status());
    store = s.take();
    for (size_t t = 0; t < tables.size(); ++t) {
      auto sink = [&](int64_t first_id, int64_t count, const float* rows) {
        return store->loadRows(static_cast<int>(t), first_id, count, rows);
      };
      Status st = Status::ok();
      if (from_checkpoint) {
        st = streamTable(ckpt_path, header, tables[t], sink);
      } else if (const ir::HostTensor* whole = first.params().find(tables[t].name)) {
        st = sink(0, tables[t].rows, whole->view.as<float>());  // the embedded weights, in place
      } else {
        st = Status::errorf("the embedded weights have no table '{}'", tables[t].name);
      }
      if (!st) return fail(st);
    }
    if (Status st = store->setVersion(step); !st) return fail(st);
  } else {
    auto rocks = serving::RocksDbStore::open(store_dir);
    if (!rocks) return fail(rocks.status());
    if (!(*rocks)->complete())
      return fail(Status::errorf(
          "the store '{}' is incomplete: the kiln store import that made it did not finish (it was "
          "interrupted or failed), so rows are missing; remove the directory and import again",
          store_dir));
    if ((*rocks)->version() != step)
      return fail(Status::errorf(
          "the store '{}' holds version {} but the weights are of step {}: serve the checkpoint "
          "of the store's step, or import this one (kiln store import)",
          store_dir, (*rocks)->version(), step));
    auto s = serving::EmbeddingStore::overStore(rocks.take(), store_options);
    if (!s) return fail(s.status());
    store = s.take();
  }
  auto server = driver::ModelServer::create(std::move(sessions), std::move(store), so);
  if (!server) return fail(server.status());

  // SIGTERM and SIGINT write their number to a pipe (whichever thread they land on: OpenBLAS
  // starts threads of its own before main); one thread reads it and stops the server.
  int fds[2];
  if (::pipe(fds) != 0) return fail(Status::errorf("pipe: {}", std::strerror(errno)));
  g_stop_pipe = fds[1];
  struct sigaction sa {};
  sa.sa_handler = onStopSignal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  InferenceHttpServer http(**server, ho);
  auto bound = http.bind();
  if (!bound) return fail(bound.status());
  std::fprintf(stderr, "kiln serve: %s version %lld (%zu served tables, %lld instance(s)) on http://%s:%d\n",
               (*server)->modelName().c_str(), static_cast<long long>(step), tables.size(),
               static_cast<long long>(instances), ho.host.c_str(), *bound);
  std::printf("listening on %s:%d\n", ho.host.c_str(), *bound);
  std::fflush(stdout);
  std::thread waiter([&] {
    unsigned char sig = 0;
    while (::read(fds[0], &sig, 1) < 0 && errno == EINTR) {
    }
    if (sig == 0) return;  // the server stopped by itself
    std::fprintf(stderr, "kiln serve: %s: draining\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    (*server)->drain();
    http.stop();  // no new connections; those open finish the request they are in
  });
  http.run();
  // run() returned: every accepted request was answered. Wake the waiter if no signal came.
  const unsigned char none = 0;
  (void)!::write(fds[1], &none, 1);
  waiter.join();
  std::fprintf(stderr, "kiln serve: stopped\n");
  return kExitOk;
}

int runStore(const ModelSource& model, const std::vector<std::string>& args) {
  ArgParser p(
      "store", "kiln store import CKPT DIR --model MODEL.kiln [--set ...]",
      "Fills a persistent embedding store (RocksDB) with the served tables of MODEL from a\n"
      "checkpoint, for kiln serve --store DIR. The store records the checkpoint's step as its version.");
  p.setPositionals("import CKPT DIR", 3, 3,
                   "the action, the checkpoint and the store directory (must not hold a store)");
  p.addOption("model", "MODEL.kiln", "the model whose tables to import");
  addModelFlags(p, model);
  int code;
  if (!p.parse(args, &code)) return code;
  if (p.positionals()[0] != "import")
    return p.usageError(fmt::format("unknown action '{}' (expected import)", p.positionals()[0]));
  if (!p.has("model"))
    return p.usageError("--model MODEL.kiln is required (it says which tensors are tables)");
  driver::SessionOptions so;
  so.model_path = p.get("model");
  if (!std::filesystem::exists(so.model_path))
    return p.usageError(fmt::format("no such model file '{}'", so.model_path));
  so.batch = 1;
  if (!readModelFlags(p, model, so, &code)) return code;
  auto fail = [](const Status& st) {
    printError("store", st);
    return kExitError;
  };
  auto ckpt_path = driver::checkpointFile(p.positionals()[1]);
  if (!ckpt_path) return fail(ckpt_path.status());
  auto header = runtime::readCheckpointHeader(*ckpt_path);
  if (!header) return fail(header.status());
  auto session = openServingSession(model, so);
  if (!session) return fail(session.status());
  const auto& tables = (*session)->servedTables();
  auto store = serving::RocksDbStore::create(p.positionals()[2], tableInfos(tables));
  if (!store) return fail(store.status());
  int64_t rows = 0;
  std::vector<int64_t> ids;
  for (size_t t = 0; t < tables.size(); ++t) {
    Status st =
        streamTable(*ckpt_path, *header, tables[t], [&](int64_t first_id, int64_t count, const float* data) {
          ids.resize(static_cast<size_t>(count));
          for (int64_t i = 0; i < count; ++i) ids[static_cast<size_t>(i)] = first_id + i;
          rows += count;
          return (*store)->putRows(static_cast<int>(t), ids, data);
        });
    if (!st) return fail(st);
  }
  // Only now is the store complete: until this write it says it is being imported.
  if (Status st = (*store)->finishImport(checkpointStep(*header)); !st) return fail(st);
  std::printf("imported %zu tables, %lld rows, version %lld into %s\n", tables.size(),
              static_cast<long long>(rows), static_cast<long long>(checkpointStep(*header)),
              p.positionals()[2].c_str());
  return kExitOk;
}

}  // namespace kiln::cli
