// The serving core of `kiln serve` (docs/serving.md), below the HTTP layer: a request queue with
// dynamic batching (Triton's meaning: requests merge up to --max-batch samples or until the
// oldest has waited --max-queue-delay-us, preferred sizes honoured), --instances executors that
// share the queue, each batch's embedding rows gathered from the tiered store, live updates
// applied between batches, and the Prometheus metrics.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "driver/session.h"
#include "runtime/data/batch.h"
#include "runtime/serving/embedding_store.h"
#include "runtime/serving/update_file.h"

namespace kiln::driver {

struct ServeOptions {
  int64_t max_batch = 256;
  int64_t max_queue_delay_us = 1000;
  std::vector<int64_t> preferred_batch_sizes;  // ascending
  int64_t request_timeout_ms = 10000;          // longest a request may wait in the queue
  int64_t max_queued_requests = 4096;          // more is refused (503) rather than queued
  std::string watch_dir;                       // --watch: apply the update files published here
  int64_t poll_ms = 200;
  // The watcher's news, a line each: the version now served, or why an update was not applied
  // (each different reason once). kiln serve prints them; none: they go unsaid.
  std::function<void(const std::string& line)> on_update;
};

// The ids of a variable-length feature and their weights lie flat in a batch, [ids of the batch],
// rather than one row per sample.
inline bool liesFlat(const data::InputSpec& in) {
  return (in.role == data::InputRole::Sparse && in.variableLength()) ||
         (in.role == data::InputRole::Weights && in.type.rank() == 1);
}

// A fixed-bucket histogram in Prometheus' form (cumulative counts, sum, count).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double v);
  // `name_bucket{le="..."} n` lines, then _sum and _count.
  std::string prometheus(const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

// What one request gets back: per sample, one score per task (the predicted probability, as
// `kiln predict` writes it), or an HTTP status and why.
struct InferOutcome {
  int status = 200;
  std::string error;
  std::vector<float> scores;  // samples * tasks
  int64_t version = 0;        // the model version that computed them
};

// The statistics extension of the protocol (Triton's meaning), since the server started: each
// request counted once, with its batch's durations; every version served counted together.
struct InferenceStats {
  struct Duration {
    uint64_t count = 0;
    uint64_t ns = 0;
    void add(std::chrono::nanoseconds d) {
      ++count;
      ns += static_cast<uint64_t>(std::max<int64_t>(d.count(), 0));
    }
  };
  struct Batch {
    Duration compute_input, compute_infer, compute_output;
  };
  uint64_t inference_count = 0;      // samples scored (padding not counted)
  uint64_t execution_count = 0;      // batches computed
  int64_t last_inference_ms = 0;     // since the epoch, of the last batch computed; 0: none yet
  Duration success, fail;            // infer requests answered 200 / otherwise, body read to answer
  Duration queue;                    // enqueued to the start of their batch
  Duration compute_input;            // merging the batch and gathering its embedding rows
  Duration compute_infer;            // the model's forward pass
  Duration compute_output;           // scores to each request
  std::map<int64_t, Batch> batches;  // by samples in the batch; count: batches of that size
};

class ModelServer {
 public:
  // `sessions`: one per instance, opened with SessionOptions::external_tables; `store` holds
  // their served tables.
  static Expected<std::unique_ptr<ModelServer>> create(std::vector<std::unique_ptr<Session>> sessions,
                                                       std::unique_ptr<serving::EmbeddingStore> store,
                                                       const ServeOptions& options);
  ~ModelServer();

  const std::string& modelName() const { return sessions_[0]->modelName(); }
  const data::BatchSpec& spec() const { return sessions_[0]->forwardSpec(); }
  size_t tasks() const { return tasks_; }
  int64_t version() const { return store_->version(); }
  const ServeOptions& options() const { return options_; }
  size_t instances() const { return sessions_.size(); }
  bool ready() const { return !draining_.load() && !stopping_.load(); }

  // Queues one request's samples (validated: every input of spec() but the label, at most
  // max_batch samples) and waits for its scores. `version` >= 0: the request names that version,
  // and scores computed at another (an update applied meanwhile) are refused with 404.
  InferOutcome infer(data::Batch samples, int64_t version = -1);

  // Applies the update files of the watched folder newer than the served version; returns how
  // many were applied. The watcher thread calls it every poll_ms; tests call it directly.
  Expected<int> applyPendingUpdates();

  // Counts an answered request (any status) and its latency.
  void noteRequest(int status, double seconds);
  // Counts an infer request of this model (its name and version resolved) as a success (200) or a
  // failure, for the statistics.
  void noteInference(bool success, std::chrono::nanoseconds took);
  std::string metricsText() const;
  InferenceStats inferenceStats() const;

  // Shutting down: readiness turns false (so load balancers move away) while requests are still
  // taken and answered; the HTTP layer stops accepting connections meanwhile.
  void drain() { draining_ = true; }

 private:
  struct Pending {
    data::Batch samples;
    std::chrono::steady_clock::time_point enqueued, deadline;
    std::promise<InferOutcome> done;
    int64_t version = -1;  // the one the request names, if any
  };
  ModelServer() = default;
  void instanceLoop(size_t instance);
  // Takes the requests of the next batch from the queue (the lock held), dropping expired ones.
  std::vector<std::unique_ptr<Pending>> nextBatch(std::unique_lock<std::mutex>& lock);
  void runBatch(Session& session, std::vector<std::unique_ptr<Pending>>& batch);
  void watchLoop();
  Status applyUpdate(const serving::ModelUpdate& u);

  ServeOptions options_;
  std::vector<std::unique_ptr<Session>> sessions_;
  std::unique_ptr<serving::EmbeddingStore> store_;
  std::vector<int> store_index_;  // per served table: its index in the store
  size_t tasks_ = 1;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::unique_ptr<Pending>> queue_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> stopping_{false};  // the destructor: no more requests, the queued ones answered
  bool instances_exit_ = false;        // under queue_mu_
  std::vector<std::thread> instances_;

  // Batches hold it shared from gathering rows to scores; an update holds it exclusively, so a
  // batch sees one version whole.
  mutable std::shared_mutex version_mu_;
  std::thread watcher_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;

  // Metrics.
  Histogram latency_{{0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5}};
  Histogram batch_size_{{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}};
  Histogram queue_delay_{{0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1}};
  mutable std::mutex metrics_mu_;
  std::map<int, uint64_t> requests_by_status_;
  std::atomic<uint64_t> samples_{0}, batches_{0}, updates_applied_{0}, update_errors_{0};
  std::atomic<double> update_lag_seconds_{0};
  std::string last_update_error_;
  mutable std::mutex stats_mu_;
  InferenceStats stats_;
};

}  // namespace kiln::driver
