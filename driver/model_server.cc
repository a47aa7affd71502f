#include "driver/model_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "driver/evaluator.h"

namespace kiln::driver {

using Clock = std::chrono::steady_clock;

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[b];
  sum_ += v;
  ++count_;
}

std::string Histogram::prometheus(const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name,
                     count_);
  return out;
}

Expected<std::unique_ptr<ModelServer>> ModelServer::create(
    std::vector<std::unique_ptr<Session>> sessions, std::unique_ptr<serving::EmbeddingStore> store,
    const ServeOptions& options) {
  if (sessions.empty()) return Status::error("kiln serve needs at least one instance");
  std::unique_ptr<ModelServer> s(new ModelServer());
  s->options_ = options;
  s->sessions_ = std::move(sessions);
  s->store_ = std::move(store);
  s->tasks_ = std::max<size_t>(taskNames(s->spec()).size(), 1);
  for (const serving::ServedTable& t : s->sessions_[0]->servedTables()) {
    const int at = s->store_->tableIndex(t.name);
    if (at < 0) return Status::errorf("the embedding store has no table '{}'", t.name);
    const serving::TableInfo& info = s->store_->tables()[static_cast<size_t>(at)];
    if (info.rows != t.rows || info.dim != t.dim)
      return Status::errorf("table '{}' is [{}, {}] in the store but [{}, {}] in the model", t.name,
                            info.rows, info.dim, t.rows, t.dim);
    s->store_index_.push_back(at);
  }
  for (size_t i = 0; i < s->sessions_.size(); ++i)
    s->instances_.emplace_back([p = s.get(), i] { p->instanceLoop(i); });
  if (!options.watch_dir.empty()) s->watcher_ = std::thread([p = s.get()] { p->watchLoop(); });
  return s;
}

ModelServer::~ModelServer() {
  stopping_ = true;
  queue_cv_.notify_all();
  watch_cv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    instances_exit_ = true;
  }
  queue_cv_.notify_all();
  for (std::thread& t : instances_) t.join();
  { std::lock_guard<std::mutex> lock(watch_mu_); }
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

InferOutcome ModelServer::infer(data::Batch samples, int64_t version) {
  if (stopping_) return {503, "the server is shutting down", {}, 0};
  auto p = std::make_unique<Pending>();
  p->samples = std::move(samples);
  p->version = version;
  p->enqueued = Clock::now();
  p->deadline = p->enqueued + std::chrono::milliseconds(options_.request_timeout_ms);
  std::future<InferOutcome> done = p->done.get_future();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queued_requests)
      return {503, fmt::format("the queue is full ({} requests)", options_.max_queued_requests), {}, 0};
    queue_.push_back(std::move(p));
  }
  queue_cv_.notify_all();
  return done.get();
}

std::vector<std::unique_ptr<ModelServer::Pending>> ModelServer::nextBatch(
    std::unique_lock<std::mutex>& lock) {
  const auto delay = std::chrono::microseconds(options_.max_queue_delay_us);
  for (;;) {
    queue_cv_.wait(lock, [&] { return instances_exit_ || !queue_.empty(); });
    if (queue_.empty()) return {};
    const auto now = Clock::now();
    // Requests past their deadline are answered, not computed.
    for (auto it = queue_.begin(); it != queue_.end();) {
      if ((*it)->deadline <= now) {
        (*it)->done.set_value({504,
                               fmt::format("the request waited {} ms in the queue without being scheduled "
                                           "(--request-timeout-ms)",
                                           options_.request_timeout_ms),
                               {},
                               0});
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    if (queue_.empty()) continue;
    // The FIFO prefix that fits in one batch.
    int64_t fits = 0;
    size_t count = 0;
    for (; count < queue_.size(); ++count) {
      const int64_t n = queue_[count]->samples.size;
      if (fits + n > options_.max_batch) break;
      fits += n;
    }
    const bool full = count < queue_.size() || fits == options_.max_batch;
    const auto& preferred = options_.preferred_batch_sizes;
    const bool preferred_size = std::binary_search(preferred.begin(), preferred.end(), fits);
    const auto dispatch_at = queue_.front()->enqueued + delay;
    if (!(full || preferred_size || now >= dispatch_at || stopping_ || instances_exit_)) {
      queue_cv_.wait_until(lock, dispatch_at);
      continue;
    }
    // With preferred sizes, cut at the largest one a prefix reaches.
    size_t take = count;
    if (!preferred.empty()) {
      int64_t sum = 0;
      for (size_t k = 0; k < count; ++k) {
        sum += queue_[k]->samples.size;
        if (std::binary_search(preferred.begin(), preferred.end(), sum)) take = k + 1;
      }
    }
    std::vector<std::unique_ptr<Pending>> batch;
    for (size_t k = 0; k < take; ++k) {
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    return batch;
  }
}

void ModelServer::instanceLoop(size_t instance) {
  Session& session = *sessions_[instance];
  for (;;) {
    std::vector<std::unique_ptr<Pending>> batch;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      batch = nextBatch(lock);
    }
    if (batch.empty()) return;
    // Another instance may start forming the next batch while this one computes.
    queue_cv_.notify_all();
    runBatch(session, batch);
  }
}

void ModelServer::runBatch(Session& session, std::vector<std::unique_ptr<Pending>>& batch) {
  const auto started = Clock::now();
  // The requests' samples as one batch: every tensor concatenated along its first dim (variable-
  // length ids and weights are flat, their lengths one per sample, so this holds for them too).
  // The batch is padded to the next power of two (at most --max-batch) with empty samples (zero
  // features, id 0, no ids of a variable-length feature), so an instance runs a few batch sizes
  // and holds a few planned programs, not one per size. Each sample's score does not depend on
  // the others in its batch, padding included.
  const data::BatchSpec& spec = session.forwardSpec();
  data::Batch merged;
  const data::Batch& first = batch[0]->samples;
  merged.names = first.names;
  int64_t samples = 0;
  for (const auto& p : batch) samples += p->samples.size;
  int64_t padded = 1;
  while (padded < samples) padded *= 2;
  merged.size = std::max(samples, std::min(padded, options_.max_batch));
  for (size_t j = 0; j < first.tensors.size(); ++j) {
    const data::InputSpec& in = spec.inputs[j];
    std::vector<int64_t> shape = first.tensors[j].view.shape;
    shape[0] = 0;
    for (const auto& p : batch) shape[0] += p->samples.tensors[j].view.shape[0];
    if (!liesFlat(in)) shape[0] = merged.size;
    ir::HostTensor t(first.tensors[j].view.dtype, shape);
    auto* at = static_cast<uint8_t*>(t.view.data);
    for (const auto& p : batch) {
      const ir::TensorView& v = p->samples.tensors[j].view;
      if (v.bytes() > 0) std::memcpy(at, v.data, static_cast<size_t>(v.bytes()));
      at += v.bytes();
    }
    std::memset(at, 0, static_cast<size_t>(static_cast<uint8_t*>(t.view.data) + t.view.bytes() - at));
    merged.tensors.push_back(std::move(t));
  }
  for (const auto& p : batch)
    queue_delay_.observe(std::chrono::duration<double>(started - p->enqueued).count());
  batch_size_.observe(static_cast<double>(samples));

  Expected<StepOutputs> out = Status::error("not run");
  int64_t version = 0;
  auto inputs_done = started;
  {
    std::shared_lock<std::shared_mutex> lock(version_mu_);
    version = store_->version();
    auto rows = serving::gatherRows(session.servedTables(), merged,
                                    [&](size_t t, std::span<const int64_t> ids, float* dst) {
                                      return store_->lookup(store_index_[t], ids, dst);
                                    });
    inputs_done = Clock::now();
    out = rows ? session.forwardWithRows(merged, *rows) : Expected<StepOutputs>(rows.status());
  }
  const auto infer_done = Clock::now();
  const size_t expected = static_cast<size_t>(merged.size) * tasks_;
  if (out && out->logits.size() != expected)
    out = Status::errorf("the model gave {} scores for {} samples of {} task(s)", out->logits.size(),
                         merged.size, tasks_);
  ++batches_;
  samples_ += static_cast<uint64_t>(samples);
  std::vector<InferOutcome> outcomes(batch.size());
  size_t offset = 0;
  for (size_t k = 0; k < batch.size(); ++k) {
    const Pending& p = *batch[k];
    InferOutcome& o = outcomes[k];
    const size_t n = static_cast<size_t>(p.samples.size) * tasks_;
    if (!out) {
      o.status = 500;
      o.error = out.status().message();
    } else if (p.version >= 0 && p.version != version) {
      // The request named the version served when it arrived; an update came before its batch.
      o.status = 404;
      o.error =
          fmt::format("model '{}' version {} is no longer served: an update replaced it with version {}",
                      modelName(), p.version, version);
    } else {
      o.scores.resize(n);
      for (size_t i = 0; i < n; ++i) o.scores[i] = clickProbability(out->logits[offset + i]);
      o.version = version;
    }
    offset += n;
  }
  const auto output_done = Clock::now();
  if (out) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.execution_count;
    stats_.last_inference_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count();
    InferenceStats::Batch& b = stats_.batches[samples];
    b.compute_input.add(inputs_done - started);
    b.compute_infer.add(infer_done - inputs_done);
    b.compute_output.add(output_done - infer_done);
    for (size_t k = 0; k < batch.size(); ++k) {
      if (outcomes[k].status != 200) continue;
      stats_.inference_count += static_cast<uint64_t>(batch[k]->samples.size);
      stats_.queue.add(started - batch[k]->enqueued);
      stats_.compute_input.add(inputs_done - started);
      stats_.compute_infer.add(infer_done - inputs_done);
      stats_.compute_output.add(output_done - infer_done);
    }
  }
  for (size_t k = 0; k < batch.size(); ++k) batch[k]->done.set_value(std::move(outcomes[k]));
}

Status ModelServer::applyUpdate(const serving::ModelUpdate& u) {
  if (!u.model.empty() && u.model != modelName())
    return Status::errorf("the update is of model '{}', not '{}'", u.model, modelName());
  std::vector<serving::EmbeddingStore::RowUpdate> rows;
  for (const serving::TableRows& t : u.tables) {
    const int at = store_->tableIndex(t.table);
    if (at < 0) return Status::errorf("the update has rows of '{}', which the store does not hold", t.table);
    const serving::TableInfo& info = store_->tables()[static_cast<size_t>(at)];
    if (t.rows.view.shape[1] != info.dim)
      return Status::errorf("the update's rows of '{}' have dim {}, the store's {}", t.table,
                            t.rows.view.shape[1], info.dim);
    for (int64_t id : t.ids)
      if (id < 0 || id >= info.rows)
        return Status::errorf("the update's id {} of '{}' is out of range [0, {})", id, t.table, info.rows);
    serving::EmbeddingStore::RowUpdate r;
    r.table = at;
    r.ids = t.ids;
    r.rows.assign(t.rows.view.as<float>(), t.rows.view.as<float>() + t.rows.view.numel());
    rows.push_back(std::move(r));
  }
  for (const auto& [name, t] : u.dense)
    for (const auto& s : sessions_) {
      const ir::HostTensor* have = s->params().find(name);
      if (!have || have->view.dtype != t.view.dtype || have->view.shape != t.view.shape)
        return Status::errorf("the update's parameter '{}' is not one of the model's, or of another shape",
                              name);
    }
  std::unique_lock<std::shared_mutex> lock(version_mu_);
  KILN_RETURN_IF_ERROR(store_->apply(rows, u.version));
  for (const auto& [name, t] : u.dense)
    for (const auto& s : sessions_) {
      ir::HostTensor* have = s->params().find(name);
      std::memcpy(have->view.data, t.view.data, static_cast<size_t>(t.view.bytes()));
    }
  return Status::ok();
}

Expected<int> ModelServer::applyPendingUpdates() {
  KILN_ASSIGN_OR_RETURN(auto files, serving::listUpdates(options_.watch_dir));
  int applied = 0;
  for (const auto& [version, path] : files) {
    if (version <= store_->version()) continue;
    KILN_ASSIGN_OR_RETURN(auto u, serving::readUpdate(path));
    if (u.base > store_->version())
      return Status::errorf(
          "'{}' follows version {} but the server is at version {}: an update between them is "
          "missing",
          path, u.base, store_->version());
    if (Status st = applyUpdate(u); !st) return Status::errorf("'{}': {}", path, st.message());
    std::error_code ec;
    const auto written = std::filesystem::last_write_time(path, ec);
    if (!ec)
      update_lag_seconds_ =
          std::chrono::duration<double>(std::filesystem::file_time_type::clock::now() - written).count();
    ++updates_applied_;
    ++applied;
  }
  return applied;
}

void ModelServer::watchLoop() {
  std::string last_error;
  while (!stopping_) {
    auto applied = applyPendingUpdates();
    if (!applied) {
      ++update_errors_;
      std::lock_guard<std::mutex> lock(metrics_mu_);
      if (applied.status().message() != last_update_error_) {
        if (options_.on_update) options_.on_update("update not applied: " + applied.status().message());
        last_update_error_ = applied.status().message();
      }
    } else if (*applied > 0) {
      if (options_.on_update) options_.on_update(fmt::format("serving version {}", store_->version()));
    }
    std::unique_lock<std::mutex> lock(watch_mu_);
    watch_cv_.wait_for(lock, std::chrono::milliseconds(options_.poll_ms), [&] { return stopping_.load(); });
  }
}

void ModelServer::noteRequest(int status, double seconds) {
  latency_.observe(seconds);
  std::lock_guard<std::mutex> lock(metrics_mu_);
  ++requests_by_status_[status];
}

void ModelServer::noteInference(bool success, std::chrono::nanoseconds took) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  (success ? stats_.success : stats_.fail).add(took);
}

InferenceStats ModelServer::inferenceStats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

std::string ModelServer::metricsText() const {
  std::string out;
  {
    std::lock_guard<std::mutex> lock(metrics_mu_);
    out +=
        "# HELP kiln_requests_total Inference requests answered, by HTTP status.\n# TYPE kiln_requests_total "
        "counter\n";
    for (const auto& [status, n] : requests_by_status_)
      out += fmt::format("kiln_requests_total{{code=\"{}\"}} {}\n", status, n);
  }
  out += latency_.prometheus("kiln_request_duration_seconds",
                             "Inference request latency, from its body read to its answer.");
  out += batch_size_.prometheus("kiln_batch_size", "Samples per computed batch.");
  out += queue_delay_.prometheus("kiln_queue_delay_seconds", "Time requests waited in the queue.");
  out += fmt::format("# TYPE kiln_samples_total counter\nkiln_samples_total {}\n", samples_.load());
  out += fmt::format("# TYPE kiln_batches_total counter\nkiln_batches_total {}\n", batches_.load());
  const auto counters = store_->counters();
  const auto residency = store_->residency();
  out +=
      "# HELP kiln_embedding_lookups_total Rows asked of each tier.\n# TYPE kiln_embedding_lookups_total "
      "counter\n";
  std::string hits =
      "# HELP kiln_embedding_hits_total Rows a tier held.\n# TYPE kiln_embedding_hits_total counter\n";
  std::string rate =
      "# HELP kiln_embedding_hit_rate Hits over lookups of each tier, all tables.\n# TYPE "
      "kiln_embedding_hit_rate gauge\n";
  std::string resident =
      "# HELP kiln_embedding_resident_rows Rows held by a tier.\n# TYPE kiln_embedding_resident_rows gauge\n";
  uint64_t tier_lookups[3] = {0, 0, 0}, tier_hits[3] = {0, 0, 0};
  const char* tier_names[3] = {"cache", "host", "persistent"};
  for (size_t t = 0; t < counters.size(); ++t) {
    const std::string& table = store_->tables()[t].name;
    const serving::EmbeddingStore::TierCounters* tiers[3] = {&counters[t].cache, &counters[t].host,
                                                             &counters[t].persistent};
    for (int k = 0; k < 3; ++k) {
      out += fmt::format("kiln_embedding_lookups_total{{table=\"{}\",tier=\"{}\"}} {}\n", table,
                         tier_names[k], tiers[k]->lookups);
      hits += fmt::format("kiln_embedding_hits_total{{table=\"{}\",tier=\"{}\"}} {}\n", table, tier_names[k],
                          tiers[k]->hits);
      tier_lookups[k] += tiers[k]->lookups;
      tier_hits[k] += tiers[k]->hits;
    }
    resident += fmt::format("kiln_embedding_resident_rows{{table=\"{}\",tier=\"cache\"}} {}\n", table,
                            residency[t].cache_rows);
    resident += fmt::format("kiln_embedding_resident_rows{{table=\"{}\",tier=\"host\"}} {}\n", table,
                            residency[t].host_rows);
  }
  for (int k = 0; k < 3; ++k)
    rate += fmt::format(
        "kiln_embedding_hit_rate{{tier=\"{}\"}} {}\n", tier_names[k],
        tier_lookups[k] ? static_cast<double>(tier_hits[k]) / static_cast<double>(tier_lookups[k]) : 0.0);
  out += hits + rate + resident;
  out += fmt::format(
      "# HELP kiln_model_version The training step of the served weights.\n# TYPE kiln_model_version "
      "gauge\nkiln_model_version {}\n",
      store_->version());
  out += fmt::format(
      "# HELP kiln_update_lag_seconds From the last applied update's publication to its application.\n# TYPE "
      "kiln_update_lag_seconds gauge\nkiln_update_lag_seconds {}\n",
      update_lag_seconds_.load());
  out += fmt::format("# TYPE kiln_updates_applied_total counter\nkiln_updates_applied_total {}\n",
                     updates_applied_.load());
  out += fmt::format("# TYPE kiln_update_errors_total counter\nkiln_update_errors_total {}\n",
                     update_errors_.load());
  return out;
}

}  // namespace kiln::driver
