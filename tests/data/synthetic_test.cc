#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <unordered_map>

#include "runtime/data/batch_reader.h"
#include "runtime/data/synthetic.h"
#include "runtime/metrics.h"
#include "test_util.h"

namespace kiln::data {
namespace {

BatchSpec mixedSpec() {
  std::vector<int> hot(kNumSparse, 1);
  hot[2] = 3;
  std::vector<int64_t> rows(kNumSparse, 5000);
  rows[0] = 40000000;  // a huge table: sampling must not depend on its size
  rows[1] = 2;
  return *fromInputs(testing::criteoInputs(hot, rows));
}

TEST(Synthetic, DeterministicAndIndependentOfBatching) {
  BatchSpec spec = mixedSpec();
  SyntheticGenerator g1(spec, {.seed = 7}), g2(spec, {.seed = 7}), other(spec, {.seed = 8});
  Batch a, b, c, d;
  g1.generate(100, 64, a);
  g2.generate(100, 64, b);
  other.generate(100, 64, c);
  for (size_t k = 0; k < a.tensors.size(); ++k) EXPECT_EQ(a.tensors[k].storage, b.tensors[k].storage);
  EXPECT_NE(a.find("dense")->storage, c.find("dense")->storage);
  // Samples 100..163 are the same whether drawn as one batch or as part of a larger one.
  g1.generate(90, 100, d);
  const auto& ids = a.find("cats.2")->storage;
  const auto& ids_big = d.find("cats.2")->storage;
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), ids_big.begin() + 10 * 3 * 8));
  EXPECT_TRUE(std::equal(a.find("label")->storage.begin(), a.find("label")->storage.end(),
                         d.find("label")->storage.begin() + 10 * 4));
}

TEST(Synthetic, IdsFollowAPowerLawWithinRange) {
  BatchSpec spec = mixedSpec();
  SyntheticGenerator g(spec, {.seed = 3});
  Batch b;
  const int64_t n = 50000;
  g.generate(0, n, b);
  std::map<int64_t, int64_t> freq;
  const int64_t* ids = b.find("cats.5")->as<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(ids[i] >= 0 && ids[i] < 5000);
    ++freq[ids[i]];
  }
  std::vector<int64_t> counts;
  for (auto& [id, c] : freq) counts.push_back(c);
  std::sort(counts.rbegin(), counts.rend());
  // Uniform draws would give each row about 10; the head of a power law gets far more, and
  // the top ten rows outweigh the thousand least common ones seen.
  EXPECT_GT(counts[0], 100 * 10);
  EXPECT_GT(counts[0], 1.5 * counts[3]);
  int64_t top10 = 0;
  for (int i = 0; i < 10; ++i) top10 += counts[static_cast<size_t>(i)];
  EXPECT_GT(top10, n / 5);
  for (int64_t i = 0; i < n; ++i) ASSERT_LT(b.find("cats.0")->as<int64_t>()[i], 40000000);
  for (int64_t i = 0; i < n; ++i) ASSERT_LT(b.find("cats.1")->as<int64_t>()[i], 2);
}

TEST(Synthetic, LabelIsLearnableOnTheHeldOutStream) {
  BatchSpec spec = mixedSpec();
  const int64_t n_train = 200000, n_eval = 40000;
  SyntheticGenerator train(spec, {.seed = 11, .stream = 0}), eval(spec, {.seed = 11, .stream = 1});
  Batch tb, eb;
  std::vector<float> eval_logits;
  train.generate(0, n_train, tb);
  eval.generate(0, n_eval, eb, &eval_logits);
  EXPECT_NE(tb.find("cats.3")->as<int64_t>()[0] * 1000 + tb.find("cats.4")->as<int64_t>()[0],
            eb.find("cats.3")->as<int64_t>()[0] * 1000 + eb.find("cats.4")->as<int64_t>()[0]);
  std::span<const float> labels(eb.find("label")->as<float>(), static_cast<size_t>(n_eval));
  double ctr = 0;
  for (float l : labels) ctr += l;
  ctr /= n_eval;
  EXPECT_GT(ctr, 0.1);
  EXPECT_LT(ctr, 0.6);
  // The hidden model itself.
  double best = runtime::rocAuc(eval_logits, labels);
  EXPECT_GT(best, 0.8);
  // A naive count-based predictor fitted on the training stream: per (feature, row) smoothed
  // log-odds of a click, summed over features.
  std::unordered_map<uint64_t, std::pair<double, double>> stats;  // (feature, row) -> clicks, views
  stats.reserve(1 << 18);
  auto key = [](int f, int64_t row) { return (static_cast<uint64_t>(f) << 40) | static_cast<uint64_t>(row); };
  const float* tl = tb.find("label")->as<float>();
  for (int f = 0; f < kNumSparse; ++f) {
    const ir::HostTensor& t = *tb.find("cats." + std::to_string(f));
    int64_t h = t.view.shape[1];
    for (int64_t i = 0; i < n_train; ++i)
      for (int64_t k = 0; k < h; ++k) {
        auto& s = stats[key(f, t.as<int64_t>()[i * h + k])];
        s.first += tl[i];
        s.second += 1;
      }
  }
  double prior = 0;
  for (int64_t i = 0; i < n_train; ++i) prior += tl[i];
  prior /= n_train;
  std::vector<float> naive(static_cast<size_t>(n_eval), 0.0f);
  for (int f = 0; f < kNumSparse; ++f) {
    const ir::HostTensor& t = *eb.find("cats." + std::to_string(f));
    int64_t h = t.view.shape[1];
    for (int64_t i = 0; i < n_eval; ++i)
      for (int64_t k = 0; k < h; ++k) {
        auto it = stats.find(key(f, t.as<int64_t>()[i * h + k]));
        double clicks = it == stats.end() ? 0 : it->second.first, views = it == stats.end() ? 0 : it->second.second;
        double p = (clicks + 10 * prior) / (views + 10);
        naive[static_cast<size_t>(i)] += static_cast<float>(std::log(p / (1 - p)) / static_cast<double>(h));
      }
  }
  double naive_auc = runtime::rocAuc(naive, labels);
  EXPECT_GT(naive_auc, 0.6);
  EXPECT_LT(naive_auc, best);
}

TEST(Synthetic, VariableLengthWithWeights) {
  ir::Dim ids_dim = ir::Dim::bounded(ir::Dim::symbol("B", 5));
  auto spec = fromInputs({
      {{{"name", "label"}, {"role", "label"}}, testing::tt(ir::DType::f32, {testing::B()})},
      {{{"name", "c"}, {"role", "sparse"}, {"feature", 4}, {"rows", 300}, {"max_hotness", 5}}, testing::tt(ir::DType::i32, {ids_dim})},
      {{{"name", "c.len"}, {"role", "lengths"}, {"feature", 4}}, testing::tt(ir::DType::i32, {testing::B()})},
      {{{"name", "c.w"}, {"role", "weights"}, {"feature", 4}}, testing::tt(ir::DType::f32, {ids_dim})},
  });
  ASSERT_TRUE(spec.isOk()) << spec.status().str();
  SyntheticGenerator g(*spec, {.seed = 1});
  Batch b;
  g.generate(0, 1000, b);
  const int32_t* len = b.find("c.len")->as<int32_t>();
  int64_t total = 0;
  std::vector<int> seen(6, 0);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(len[i] >= 1 && len[i] <= 5);
    ++seen[static_cast<size_t>(len[i])];
    total += len[i];
  }
  for (int l = 1; l <= 5; ++l) EXPECT_GT(seen[static_cast<size_t>(l)], 100);
  EXPECT_EQ(b.find("c")->view.shape, (std::vector<int64_t>{total}));
  EXPECT_EQ(b.find("c.w")->view.shape, (std::vector<int64_t>{total}));
  for (int64_t k = 0; k < total; ++k) {
    ASSERT_TRUE(b.find("c")->as<int32_t>()[k] >= 0 && b.find("c")->as<int32_t>()[k] < 300);
    ASSERT_TRUE(b.find("c.w")->as<float>()[k] >= 0.5f && b.find("c.w")->as<float>()[k] <= 1.5f);
  }
}

TEST(Synthetic, ReaderEpochsAndResume) {
  BatchSpec spec = testing::criteoSpec();
  DataOptions opts{.paths = {"synthetic"}, .batch_size = 30, .epochs = 2, .synthetic = {.seed = 5}, .synthetic_samples = 100};
  auto r = openBatchReader(spec, opts);
  ASSERT_TRUE(r.isOk());
  std::vector<Batch> batches;
  Batch b;
  while (*(*r)->next(b)) batches.push_back(b);
  // 200 samples in batches of 30; the fourth crosses into the second epoch.
  ASSERT_EQ(batches.size(), 7u);
  EXPECT_EQ(batches[3].size, 30);
  EXPECT_EQ(batches[6].size, 20);
  // Samples 90..99 then 0..19: the batch joins the end of epoch 0 and the start of epoch 1.
  SyntheticGenerator g(spec, opts.synthetic);
  Batch tail, head;
  g.generate(90, 10, tail);
  g.generate(0, 20, head);
  const auto& dense = batches[3].find("dense")->storage;
  EXPECT_TRUE(std::equal(tail.find("dense")->storage.begin(), tail.find("dense")->storage.end(), dense.begin()));
  EXPECT_TRUE(std::equal(head.find("dense")->storage.begin(), head.find("dense")->storage.end(), dense.begin() + 10 * 13 * 4));
  // Resume after batch 2 reproduces batches 3.. exactly.
  auto resumed = openBatchReader(spec, opts);
  ASSERT_TRUE((*resumed)->seek(batches[2].end).isOk());
  for (size_t i = 3; i < batches.size(); ++i) {
    ASSERT_TRUE(*(*resumed)->next(b));
    for (size_t k = 0; k < b.tensors.size(); ++k) ASSERT_EQ(b.tensors[k].storage, batches[i].tensors[k].storage);
  }
  EXPECT_FALSE(*(*resumed)->next(b));
}

}  // namespace
}  // namespace kiln::data
