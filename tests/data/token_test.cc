// Token data for language models: the Markov chain's entropy rate against a hand-built tiny chain,
// the synthetic windows' determinism, and the token-file reader (dtypes, several files, resume,
// located errors).
#include <cmath>
#include <fstream>
#include <map>

#include "runtime/data/batch_reader.h"
#include "runtime/data/markov_tokens.h"
#include "runtime/data/token_source.h"
#include "test_util.h"

namespace kiln::data {
namespace {

using testing::B;
using testing::tt;

std::vector<std::pair<ir::AttrDict, ir::TensorType>> tokenInputs(int64_t t, int64_t vocab) {
  return {{{{"name", "tokens"}, {"role", "tokens"}, {"vocab", vocab}},
           tt(ir::DType::i32, {B(), ir::Dim::fixed(t)})},
          {{{"name", "targets"}, {"role", "targets"}}, tt(ir::DType::i32, {B(), ir::Dim::fixed(t)})}};
}

BatchSpec tokenSpec(int64_t t, int64_t vocab) {
  auto s = fromInputs(tokenInputs(t, vocab));
  EXPECT_TRUE(s.isOk()) << (s ? "" : s.status().str());
  return *s;
}

// Writes `ids` as little-endian ids of `bytes` bytes each.
std::string writeTokens(const testing::TempDir& dir, const std::string& name,
                        const std::vector<uint32_t>& ids, int bytes) {
  std::string raw;
  for (uint32_t id : ids)
    for (int b = 0; b < bytes; ++b) raw.push_back(static_cast<char>((id >> (8 * b)) & 0xff));
  return dir.write(name, raw);
}

std::vector<int32_t> readWindow(TokenSource& src) {
  std::vector<int32_t> w(static_cast<size_t>(src.windowLength()));
  auto got = src.next(w.data());
  EXPECT_TRUE(got.isOk()) << (got ? "" : got.status().str());
  if (!got || !*got) return {};
  return w;
}

TEST(MarkovChain, EntropyRateOfATinyChainMatchesAHandComputation) {
  MarkovChain chain(3, 11);
  // The transition matrix, entry by entry, and its rows' sums.
  double p[3][3];
  for (int s = 0; s < 3; ++s) {
    double row = 0;
    for (int t = 0; t < 3; ++t) row += p[s][t] = chain.probability(s, t);
    EXPECT_NEAR(row, 1.0, 1e-12);
  }
  // The stationary distribution solves pi P = pi, sum pi = 1: replace the third equation of
  // (P^T - I) pi = 0 by the sum, then Cramer's rule.
  double a[3][3], rhs[3] = {0, 0, 1};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) a[i][j] = p[j][i] - (i == j ? 1.0 : 0.0);
  for (int j = 0; j < 3; ++j) a[2][j] = 1.0;
  auto det = [](double m[3][3]) {
    return m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) -
           m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0]) +
           m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]);
  };
  const double d = det(a);
  double pi[3];
  for (int k = 0; k < 3; ++k) {
    double m[3][3];
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 3; ++j) m[i][j] = j == k ? rhs[i] : a[i][j];
    pi[k] = det(m) / d;
  }
  double rate = 0;
  for (int s = 0; s < 3; ++s)
    for (int t = 0; t < 3; ++t) rate -= pi[s] * p[s][t] * std::log(p[s][t]);
  for (int s = 0; s < 3; ++s) EXPECT_NEAR(chain.stationary()[static_cast<size_t>(s)], pi[s], 1e-10);
  EXPECT_NEAR(chain.entropyRate(), rate, 1e-10);
  EXPECT_GT(rate, 0.0);
  EXPECT_LT(rate, std::log(3.0));
}

TEST(MarkovChain, SamplesFollowItsProbabilities) {
  MarkovChain chain(3, 5);
  // Transition counts of one long walk against P, and the walk's visits against pi.
  MarkovWalk walk(chain, 9);
  const int n = 400000;
  double count[3][3] = {}, visits[3] = {};
  int32_t prev = walk.next();
  for (int i = 0; i < n; ++i) {
    int32_t next = walk.next();
    count[prev][next] += 1;
    visits[prev] += 1;
    prev = next;
  }
  for (int s = 0; s < 3; ++s) {
    EXPECT_NEAR(visits[s] / n, chain.stationary()[static_cast<size_t>(s)], 0.01);
    for (int t = 0; t < 3; ++t)
      EXPECT_NEAR(count[s][t] / visits[s], chain.probability(s, t), 0.01) << s << "->" << t;
  }
}

TEST(MarkovChain, EntropyRateOfALargeSparseChainMatchesTheMeanLogLoss) {
  // V = 2000: the mean of -log P(x' | x) along the windows tends to the entropy rate.
  const int64_t vocab = 2000, t = 64;
  auto chain = std::make_shared<const MarkovChain>(vocab, 3);
  auto src = openMarkovTokens(chain, 3, 0, t, 4000);
  double nll = 0;
  int64_t n = 0;
  for (int i = 0; i < 4000; ++i) {
    std::vector<int32_t> w = readWindow(*src);
    ASSERT_EQ(w.size(), static_cast<size_t>(t + 1));
    for (int64_t k = 0; k < t; ++k, ++n) nll -= std::log(chain->probability(w[k], w[k + 1]));
  }
  EXPECT_NEAR(nll / static_cast<double>(n), chain->entropyRate(), 0.02 * chain->entropyRate());
  // Peaked: far below the uniform model's log V.
  EXPECT_LT(chain->entropyRate(), 0.5 * std::log(static_cast<double>(vocab)));
}

TEST(MarkovTokens, WindowsArePureFunctionsOfSeedStreamAndIndex) {
  auto chain = std::make_shared<const MarkovChain>(50, 1);
  auto a = openMarkovTokens(chain, 1, 0, 16, 100), b = openMarkovTokens(chain, 1, 0, 16, 100);
  auto held_out = openMarkovTokens(chain, 1, 1, 16, 100);
  std::vector<std::vector<int32_t>> first;
  int same_as_held_out = 0;
  for (int i = 0; i < 20; ++i) {
    first.push_back(readWindow(*a));
    EXPECT_EQ(first.back(), readWindow(*b));
    same_as_held_out += first.back() == readWindow(*held_out);
  }
  EXPECT_EQ(same_as_held_out, 0);
  // Window 7 again, without the ones before it.
  auto c = openMarkovTokens(chain, 1, 0, 16, 100);
  ASSERT_TRUE(c->seek(StreamPosition{.sample = 7}).isOk());
  EXPECT_EQ(readWindow(*c), first[7]);
  EXPECT_EQ(c->position().sample, 8);
  // Another seed is another chain.
  MarkovChain other(50, 2);
  EXPECT_NE(other.entropyRate(), chain->entropyRate());
}

TEST(TokenBatch, TargetsAreTheTokensShiftedByOne) {
  BatchSpec spec = tokenSpec(5, 50);
  DataOptions opts{.paths = {"synthetic"}, .batch_size = 3};
  opts.synthetic.seed = 4;
  auto reader = openBatchReader(spec, opts);
  ASSERT_TRUE(reader.isOk()) << reader.status().str();
  ASSERT_TRUE((*reader)->entropyFloor().has_value());
  Batch batch;
  ASSERT_TRUE(*(*reader)->next(batch));
  ASSERT_EQ(batch.size, 3);
  const ir::HostTensor* tokens = batch.find("tokens");
  const ir::HostTensor* targets = batch.find("targets");
  ASSERT_TRUE(tokens && targets);
  EXPECT_EQ(tokens->view.shape, (std::vector<int64_t>{3, 5}));
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t k = 0; k + 1 < 5; ++k)
      EXPECT_EQ(targets->as<int32_t>()[r * 5 + k], tokens->as<int32_t>()[r * 5 + k + 1]);
  EXPECT_EQ(batch.end.sample, 3);
}

TEST(TokenBatch, RanksSliceTokenBatchesBySamples) {
  BatchSpec spec = tokenSpec(6, 30);
  auto reader = openBatchReader(spec, DataOptions{.paths = {"synthetic"}, .batch_size = 8});
  ASSERT_TRUE(reader.isOk());
  Batch batch;
  ASSERT_TRUE(*(*reader)->next(batch));
  auto share = sliceBatch(batch, spec, 4, 4);  // rank 1 of 2
  ASSERT_TRUE(share.isOk()) << share.status().str();
  EXPECT_EQ(share->size, 4);
  for (const char* name : {"tokens", "targets"}) {
    const ir::HostTensor* whole = batch.find(name);
    const ir::HostTensor* mine = share->find(name);
    ASSERT_TRUE(whole && mine);
    EXPECT_EQ(mine->view.shape, (std::vector<int64_t>{4, 6}));
    for (int64_t i = 0; i < 4 * 6; ++i) EXPECT_EQ(mine->as<int32_t>()[i], whole->as<int32_t>()[4 * 6 + i]);
  }
}

TEST(TokenSpec, BadTokenInputsAreNamedErrors) {
  auto no_tokens = fromInputs({tokenInputs(4, 10)[1]});
  ASSERT_FALSE(no_tokens.isOk());
  EXPECT_NE(no_tokens.status().message().find("input 'targets': next-token targets need a token input"),
            std::string::npos)
      << no_tokens.status().str();
  auto inputs = tokenInputs(4, 10);
  inputs[0].first.erase("vocab");
  auto no_vocab = fromInputs(inputs);
  ASSERT_FALSE(no_vocab.isOk());
  EXPECT_NE(no_vocab.status().message().find("missing integer attribute 'vocab'"), std::string::npos);
  inputs = tokenInputs(4, 10);
  inputs[1].second = tt(ir::DType::i32, {B(), ir::Dim::fixed(5)});
  auto mismatch = fromInputs(inputs);
  ASSERT_FALSE(mismatch.isOk());
  EXPECT_NE(mismatch.status().message().find("must be shaped like the tokens"), std::string::npos);
  inputs = tokenInputs(4, 10);
  inputs.push_back({{{"name", "dense"}, {"role", "dense"}}, tt(ir::DType::f32, {B(), ir::Dim::fixed(13)})});
  auto mixed = fromInputs(inputs);
  ASSERT_FALSE(mixed.isOk());
  EXPECT_NE(mixed.status().message().find("reads no dense input beside it"), std::string::npos);
  inputs = tokenInputs(4, 10);
  inputs[0].second = tt(ir::DType::f32, {B(), ir::Dim::fixed(4)});
  EXPECT_FALSE(fromInputs(inputs).isOk());
}

TEST(TokenFiles, DTypeByName) {
  EXPECT_EQ(*tokenDTypeFor("train.bin", ""), TokenDType::U16);
  EXPECT_EQ(*tokenDTypeFor("train.u32.bin", ""), TokenDType::U32);
  EXPECT_EQ(*tokenDTypeFor("train.u32", ""), TokenDType::U32);
  EXPECT_EQ(*tokenDTypeFor("train.bin", "u32"), TokenDType::U32);
  EXPECT_FALSE(tokenDTypeFor("train.tokens", "").isOk());
  EXPECT_FALSE(tokenDTypeFor("train.bin", "u8").isOk());
}

// 0, 1, 2, ... mod vocab: window k of length T + 1 starts at token k * T.
std::vector<uint32_t> ramp(int64_t n, uint32_t vocab, uint32_t offset = 0) {
  std::vector<uint32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[static_cast<size_t>(i)] = (static_cast<uint32_t>(i) * 7 + offset) % vocab;
  return ids;
}

void expectWindows(TokenSource& src, const std::vector<uint32_t>& ids, int64_t t) {
  const int64_t windows = (static_cast<int64_t>(ids.size()) - 1) / t;
  for (int64_t k = 0; k < windows; ++k) {
    std::vector<int32_t> w = readWindow(src);
    ASSERT_EQ(w.size(), static_cast<size_t>(t + 1)) << "window " << k;
    for (int64_t j = 0; j <= t; ++j)
      ASSERT_EQ(static_cast<uint32_t>(w[j]), ids[static_cast<size_t>(k * t + j)]);
  }
  std::vector<int32_t> rest(static_cast<size_t>(t + 1));
  auto end = src.next(rest.data());
  ASSERT_TRUE(end.isOk());
  EXPECT_FALSE(*end) << "a short last window is dropped";
}

TEST(TokenFiles, U16AndU32WindowsAtStrideT) {
  testing::TempDir dir;
  const std::vector<uint32_t> ids16 = ramp(1003, 60000), ids32 = ramp(1003, 100000, 70000);
  auto a = openTokenFiles({writeTokens(dir, "a.bin", ids16, 2)}, TokenDType::U16, 10, 60000);
  ASSERT_TRUE(a.isOk()) << a.status().str();
  expectWindows(**a, ids16, 10);
  auto b = openTokenFiles({writeTokens(dir, "b.u32", ids32, 4)}, TokenDType::U32, 10, 100000);
  ASSERT_TRUE(b.isOk()) << b.status().str();
  expectWindows(**b, ids32, 10);
}

TEST(TokenFiles, SeveralFilesReadAsOneStream) {
  testing::TempDir dir;
  const std::vector<uint32_t> ids = ramp(777, 500);
  // Split unevenly, with an empty file between: windows cross the files' ends.
  std::vector<std::string> files = {writeTokens(dir, "0.bin", {ids.begin(), ids.begin() + 5}, 2),
                                    writeTokens(dir, "1.bin", {}, 2),
                                    writeTokens(dir, "2.bin", {ids.begin() + 5, ids.begin() + 400}, 2),
                                    writeTokens(dir, "3.bin", {ids.begin() + 400, ids.end()}, 2)};
  auto src = openTokenFiles(files, TokenDType::U16, 16, 500);
  ASSERT_TRUE(src.isOk()) << src.status().str();
  expectWindows(**src, ids, 16);
}

TEST(TokenFiles, ResumingAtAPositionEqualsContinuing) {
  testing::TempDir dir;
  const std::vector<uint32_t> ids = ramp(5000, 1000);
  std::vector<std::string> files = {writeTokens(dir, "a.bin", {ids.begin(), ids.begin() + 1234}, 2),
                                    writeTokens(dir, "b.bin", {ids.begin() + 1234, ids.end()}, 2)};
  BatchSpec spec = tokenSpec(32, 1000);
  DataOptions opts{.paths = files, .batch_size = 7, .epochs = 3};
  auto straight = openBatchReader(spec, opts);
  ASSERT_TRUE(straight.isOk()) << straight.status().str();
  Batch batch;
  // 156 windows an epoch (4999 / 32): 25 batches cross into the second epoch.
  for (int i = 0; i < 25; ++i) ASSERT_TRUE(*(*straight)->next(batch));
  const StreamPosition at = (*straight)->position();
  EXPECT_EQ(at.epoch, 1);
  auto resumed = openBatchReader(spec, opts);
  ASSERT_TRUE(resumed.isOk());
  auto parsed = StreamPosition::parse(at.str());  // through the checkpoint's string
  ASSERT_TRUE(parsed.isOk());
  ASSERT_TRUE((*resumed)->seek(*parsed).isOk());
  int batches = 0;
  for (;; ++batches) {
    Batch a, b;
    auto more_a = (*straight)->next(a);
    auto more_b = (*resumed)->next(b);
    ASSERT_TRUE(more_a.isOk() && more_b.isOk());
    ASSERT_EQ(*more_a, *more_b);
    if (!*more_a) break;
    ASSERT_EQ(a.size, b.size);
    EXPECT_EQ(a.end, b.end);
    for (size_t k = 0; k < a.tensors.size(); ++k)
      ASSERT_EQ(a.tensors[k].storage, b.tensors[k].storage) << "batch " << batches << " tensor " << k;
  }
  EXPECT_GT(batches, 30);  // the rest of epoch 1 and all of epoch 2
  // The window after a seek to the first window's end is the second window.
  auto src = openTokenFiles(files, TokenDType::U16, 32, 1000);
  ASSERT_TRUE(src.isOk());
  readWindow(**src);
  const StreamPosition one = (*src)->position();
  EXPECT_EQ(one.offset, 32 * 2);
  std::vector<int32_t> second = readWindow(**src);
  ASSERT_TRUE((*src)->seek(one).isOk());
  EXPECT_EQ(readWindow(**src), second);
}

TEST(TokenFiles, ErrorsNameTheFileAndTheToken) {
  testing::TempDir dir;
  std::vector<uint32_t> ids = ramp(100, 10);
  ids[57] = 12;
  auto src = openTokenFiles({writeTokens(dir, "bad.bin", ids, 2)}, TokenDType::U16, 8, 10);
  ASSERT_TRUE(src.isOk());
  std::vector<int32_t> w(9);
  Status error = Status::ok();
  for (int i = 0; i < 20 && error.isOk(); ++i) {
    auto got = (*src)->next(w.data());
    if (!got) error = got.status();
  }
  ASSERT_FALSE(error.isOk());
  EXPECT_NE(error.message().find("bad.bin': token 57 (byte 114) is 12, not below the model's vocab 10"),
            std::string::npos)
      << error.str();

  // A u16 file of an odd size: its last token is cut.
  std::string path = writeTokens(dir, "cut.bin", ramp(10, 10), 2);
  std::ofstream(path, std::ios::binary | std::ios::app) << 'x';
  auto cut = openTokenFiles({path}, TokenDType::U16, 4, 10);
  ASSERT_FALSE(cut.isOk());
  EXPECT_NE(cut.status().message().find("cut.bin': truncated token file: 21 bytes"), std::string::npos)
      << cut.status().str();
  EXPECT_NE(cut.status().message().find("at byte 20"), std::string::npos);
  // The same bytes as u32: 21 is no multiple of 4 either.
  EXPECT_FALSE(openTokenFiles({path}, TokenDType::U32, 4, 10).isOk());

  // Too few tokens for one window.
  BatchSpec spec = tokenSpec(64, 10);
  auto reader = openBatchReader(spec, DataOptions{.paths = {writeTokens(dir, "short.bin", ramp(20, 10), 2)}});
  ASSERT_TRUE(reader.isOk());
  Batch batch;
  auto none = (*reader)->next(batch);
  ASSERT_FALSE(none.isOk());
  EXPECT_NE(none.status().message().find("holds no window of 65 tokens"), std::string::npos);
}

}  // namespace
}  // namespace kiln::data
