#include "runtime/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

namespace kiln::runtime {

double rocAuc(std::span<const float> scores, std::span<const float> labels) {
  const size_t n = std::min(scores.size(), labels.size());
  // NaN scores rank lowest (and keep the sort's ordering strict).
  std::vector<float> key(scores.begin(), scores.begin() + static_cast<std::ptrdiff_t>(n));
  for (float& k : key)
    if (std::isnan(k)) k = -std::numeric_limits<float>::infinity();
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return key[a] < key[b]; });
  // Sum of the (average, for ties) ranks of the positives: U = R+ - P(P+1)/2.
  double rank_sum = 0;
  uint64_t pos = 0;
  for (size_t i = 0; i < n;) {
    size_t j = i;
    uint64_t tie_pos = 0;
    while (j < n && key[order[j]] == key[order[i]]) tie_pos += labels[order[j++]] > 0.5f;
    double avg_rank = 0.5 * static_cast<double>(i + 1 + j);  // ranks i+1 .. j
    rank_sum += avg_rank * static_cast<double>(tie_pos);
    pos += tie_pos;
    i = j;
  }
  const uint64_t neg = n - pos;
  if (pos == 0 || neg == 0) return std::numeric_limits<double>::quiet_NaN();
  double u = rank_sum - 0.5 * static_cast<double>(pos) * static_cast<double>(pos + 1);
  return u / (static_cast<double>(pos) * static_cast<double>(neg));
}

double accuracy(std::span<const float> scores, std::span<const float> labels, float threshold) {
  const size_t n = std::min(scores.size(), labels.size());
  if (n == 0) return std::numeric_limits<double>::quiet_NaN();
  size_t right = 0;
  for (size_t i = 0; i < n; ++i) right += (scores[i] >= threshold) == (labels[i] > 0.5f);
  return static_cast<double>(right) / static_cast<double>(n);
}

void AucAccumulator::add(std::span<const float> scores, std::span<const float> labels) {
  scores_.insert(scores_.end(), scores.begin(), scores.end());
  labels_.insert(labels_.end(), labels.begin(), labels.end());
}

void AucAccumulator::clear() {
  scores_.clear();
  labels_.clear();
}

namespace {

// A metric as JSON: a whole number as an integer (2000, not nlohmann's 2000.0, as metrics lines
// have always been written), anything else as a double (non-finite ones become null).
json::Json metric(double x) {
  constexpr double kExactInts = 9007199254740992.0;  // 2^53: every integer below is a double
  if (std::isfinite(x) && std::trunc(x) == x && std::fabs(x) < kExactInts) return static_cast<int64_t>(x);
  return x;
}

}  // namespace

json::Json MetricsRecord::toJson() const {
  json::Json v = {{"step", step}, {"loss", metric(loss)}, {"samples_per_s", metric(samples_per_s)}};
  if (auc) v["auc"] = metric(*auc);
  if (eval_loss) v["eval_loss"] = metric(*eval_loss);
  if (accuracy) v["accuracy"] = metric(*accuracy);
  if (lr) v["lr"] = metric(*lr);
  if (extra.is_object())
    for (const auto& [k, x] : extra.items()) v[k] = x;
  return v;
}

MetricsWriter::~MetricsWriter() {
  if (fp_) std::fclose(fp_);
}

Expected<std::unique_ptr<MetricsWriter>> MetricsWriter::open(const std::string& path, bool append) {
  std::unique_ptr<MetricsWriter> w(new MetricsWriter());
  w->path_ = path;
  w->fp_ = std::fopen(path.c_str(), append ? "ab" : "wb");
  if (!w->fp_) return Status::errorf("cannot open metrics file '{}': {}", path, std::strerror(errno));
  return w;
}

Status MetricsWriter::write(const MetricsRecord& r) { return write(r.toJson()); }

Status MetricsWriter::write(const json::Json& line) {
  auto dumped = json::dump(line);
  if (!dumped) return Status::errorf("metrics file '{}': {}", path_, dumped.status().message());
  std::string text = dumped.take() + '\n';
  if (std::fwrite(text.data(), 1, text.size(), fp_) != text.size() || std::fflush(fp_) != 0)
    return Status::errorf("cannot write metrics file '{}': {}", path_, std::strerror(errno));
  return Status::ok();
}

}  // namespace kiln::runtime
