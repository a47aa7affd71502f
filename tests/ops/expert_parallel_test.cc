// The expert-parallel ops of docs/moe.md, "Expert parallelism" (moe_route_counts, moe_ep_split,
// moe_sort_chunks, moe_chunk_offsets): their CPU references against plain loops written here,
// and their run-time checks. moe_sort_chunks's gradient rule is checked by finite differences
// in gradient_check_test.cc.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <tuple>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

using A = Attribute;

Attribute i(int64_t v) { return Attribute(v); }

// (peers, local experts) or (ranks, ep) pairs to loop over.
using Pairs = std::vector<std::pair<int64_t, int64_t>>;

std::vector<double> randomValues(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = u(rng);
  return v;
}

// Chunk counts in [0, max], about a third of them 0 (empty chunks).
std::vector<double> randomCounts(int64_t n, int64_t max, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> pick(-max / 2, max);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& c : v) c = static_cast<double>(std::max<int64_t>(0, pick(rng)));
  return v;
}

TensorType boundedRows(DType t, int64_t bound, std::vector<int64_t> rest = {}) {
  Shape s = {Dim::bounded(Dim::fixed(bound))};
  for (int64_t d : rest) s.push_back(Dim::fixed(d));
  return TensorType(t, s);
}

// Expects `call` to fail at run time with a message naming its op and containing `what`.
void expectRunError(const OpCall& call, const std::string& what) {
  auto r = run(call);
  ASSERT_FALSE(r) << call.name << " accepted " << what;
  EXPECT_NE(r.status().message().find(call.name), std::string::npos) << r.status().str();
  EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().str();
}

// ---- moe_route_counts -------------------------------------------------------------------------

TEST(ExpertParallelCpu, RouteCountsCountEverySlotsExpert) {
  std::mt19937 rng(21);
  const int64_t n = 9, k = 3, e = 5;
  std::uniform_int_distribution<int64_t> pick(0, e - 2);  // expert 4 is never chosen
  std::vector<double> ids(static_cast<size_t>(n * k));
  for (double& id : ids) id = static_cast<double>(pick(rng));
  std::vector<double> want(static_cast<size_t>(e), 0.0);
  for (int64_t tok = 0; tok < n; ++tok)
    for (int64_t j = 0; j < k; ++j) want[static_cast<size_t>(ids[static_cast<size_t>(tok * k + j)])] += 1;
  HostTensor got = runOk({"kiln.moe_route_counts", {i32({n, k}, ids)}, {{"experts", i(e)}}});
  EXPECT_EQ(got.view.dtype, DType::i32);
  expectTensor(got, {e}, want, 0);
}

// ---- moe_ep_split -----------------------------------------------------------------------------

// Offsets of E experts rising from 0 with random gaps, some experts empty.
std::vector<double> randomOffsets(int64_t experts, std::mt19937& rng) {
  const std::vector<double> rows = randomCounts(experts, 6, rng);
  std::vector<double> offsets = {0};
  for (double r : rows) offsets.push_back(offsets.back() + r);
  return offsets;
}

// The contract's group rule, expert by expert: rank r's group is [g*ep, (g+1)*ep) with g = r / ep,
// and its member j owns experts [j*L, (j+1)*L); expert x's rows go to member x / L of r's group.
void expectEpSplit(int64_t ranks, int64_t ep, int64_t rank, const std::vector<double>& offsets) {
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1, local = experts / ep;
  std::vector<double> send(static_cast<size_t>(ranks), 0.0), chunks(static_cast<size_t>(ranks * local), 0.0);
  const int64_t group = rank / ep;
  for (int64_t x = 0; x < experts; ++x) {
    const double rows = offsets[static_cast<size_t>(x + 1)] - offsets[static_cast<size_t>(x)];
    const int64_t owner = group * ep + x / local;
    send[static_cast<size_t>(owner)] += rows;
    chunks[static_cast<size_t>(owner * local + x % local)] = rows;
  }
  auto got = run({"kiln.moe_ep_split",
                  {i32({experts + 1}, offsets)},
                  {{"ranks", i(ranks)}, {"ep", i(ep)}, {"rank", i(rank)}, {"experts", i(experts)}}});
  ASSERT_TRUE(got) << got.status().str();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_EQ((*got)[0].view.dtype, DType::i64);
  EXPECT_EQ((*got)[1].view.dtype, DType::i64);
  SCOPED_TRACE("ranks " + std::to_string(ranks) + ", ep " + std::to_string(ep) + ", rank " +
               std::to_string(rank));
  expectTensor((*got)[0], {ranks}, send, 0);
  expectTensor((*got)[1], {ranks * local}, chunks, 0);
}

TEST(ExpertParallelCpu, EpSplitSendsEachExpertBlockToItsOwnerInTheGroup) {
  std::mt19937 rng(22);
  const int64_t experts = 8;
  for (auto [ranks, ep] : Pairs{{4, 2}, {4, 4}, {2, 2}})
    for (int64_t rank = 0; rank < ranks; ++rank) expectEpSplit(ranks, ep, rank, randomOffsets(experts, rng));
}

TEST(ExpertParallelCpu, EpSplitGivesRanksOutsideTheGroupNothing) {
  // Rank 3 of 4 with ep = 2 is in group [2, 4): ranks 0 and 1 get nothing.
  auto got = run({"kiln.moe_ep_split",
                  {i32({5}, {0, 1, 3, 6, 10})},
                  {{"ranks", i(4)}, {"ep", i(2)}, {"rank", i(3)}, {"experts", i(4)}}});
  ASSERT_TRUE(got) << got.status().str();
  expectTensor((*got)[0], {4}, {0, 0, 3, 7}, 0);
  expectTensor((*got)[1], {8}, {0, 0, 0, 0, 1, 2, 3, 4}, 0);
}

// ---- moe_sort_chunks --------------------------------------------------------------------------

// Where each row goes, written as a stable sort: row t of the peer-major input belongs to chunk
// (p, e); the expert-major order sorts the rows by (e, p), keeping their order within a chunk.
// from[t] is a row's place in the peer-major order, to[t] its place in the expert-major one.
struct RowMoves {
  std::vector<int64_t> from, to;
};
RowMoves rowMoves(const std::vector<double>& counts, int64_t local) {
  const int64_t peers = static_cast<int64_t>(counts.size()) / local;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> rows;  // (e, p, peer-major place)
  for (int64_t p = 0; p < peers; ++p)
    for (int64_t e = 0; e < local; ++e)
      for (int64_t r = 0; r < static_cast<int64_t>(counts[static_cast<size_t>(p * local + e)]); ++r)
        rows.emplace_back(e, p, static_cast<int64_t>(rows.size()));
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return std::make_pair(std::get<0>(a), std::get<1>(a)) < std::make_pair(std::get<0>(b), std::get<1>(b));
  });
  RowMoves m;
  for (size_t t = 0; t < rows.size(); ++t) {
    m.from.push_back(std::get<2>(rows[t]));
    m.to.push_back(static_cast<int64_t>(t));
  }
  return m;
}

// Rows of `width` values (width 0: a rank-1 tensor) moved by `moves`, forward or back.
std::vector<double> moveRows(const std::vector<double>& x, int64_t width, const RowMoves& moves,
                             bool inverse) {
  const int64_t w = std::max<int64_t>(width, 1);
  std::vector<double> out(x.size(), 0.0);
  for (size_t t = 0; t < moves.from.size(); ++t) {
    const int64_t src = inverse ? moves.to[t] : moves.from[t], dst = inverse ? moves.from[t] : moves.to[t];
    for (int64_t c = 0; c < w; ++c)
      out[static_cast<size_t>(dst * w + c)] = x[static_cast<size_t>(src * w + c)];
  }
  return out;
}

OpCall sortCall(DType t, const std::vector<double>& x, int64_t rows, int64_t width, int64_t bound,
                const std::vector<double>& counts, int64_t local, bool inverse) {
  const std::vector<int64_t> shape = width ? std::vector<int64_t>{rows, width} : std::vector<int64_t>{rows};
  const std::vector<int64_t> rest = width ? std::vector<int64_t>{width} : std::vector<int64_t>{};
  const int64_t n = static_cast<int64_t>(counts.size());
  return {"kiln.moe_sort_chunks",
          {tensor(t, shape, x), i64({n}, counts)},
          {{"chunks", i(local)}, {"inverse", A(inverse)}},
          {boundedRows(t, bound, rest), TensorType(DType::i64, {Dim::fixed(n)})}};
}

// Both directions against the row moves, and the way back undoing the way there.
void expectSortChunks(DType t, int64_t peers, int64_t local, int64_t width, const std::vector<double>& counts,
                      std::mt19937& rng) {
  int64_t rows = 0;
  for (double c : counts) rows += static_cast<int64_t>(c);
  std::vector<double> x = randomValues(rows * std::max<int64_t>(width, 1), rng);
  if (t == DType::i32)
    for (double& v : x) v = std::round(v * 1000);
  // Values the element type holds exactly, so that the moved rows compare equal.
  for (double& v : x)
    v = t == DType::bf16 ? bf16ToFloat(floatToBf16(static_cast<float>(v))) : static_cast<float>(v);
  const std::vector<int64_t> shape = width ? std::vector<int64_t>{rows, width} : std::vector<int64_t>{rows};
  const RowMoves moves = rowMoves(counts, local);
  SCOPED_TRACE(std::string(dtypeName(t)) + ", " + std::to_string(peers) + " peers of " +
               std::to_string(local) + " chunks, " + std::to_string(rows) + " rows");
  HostTensor sorted = runOk(sortCall(t, x, rows, width, rows + 5, counts, local, false));
  EXPECT_EQ(sorted.view.dtype, t);
  expectTensor(sorted, shape, moveRows(x, width, moves, false), 0);
  HostTensor back = runOk(sortCall(t, values(sorted), rows, width, rows + 5, counts, local, true));
  expectTensor(back, shape, x, 0);
  // The inverse on its own, from an input that is not a forward's result.
  expectTensor(runOk(sortCall(t, x, rows, width, rows + 5, counts, local, true)), shape,
               moveRows(x, width, moves, true), 0);
}

TEST(ExpertParallelCpu, SortChunksMovesPeerMajorChunksIntoExpertMajorOrderAndBack) {
  std::mt19937 rng(23);
  for (DType t : {DType::f32, DType::i32, DType::bf16})
    for (auto [peers, local] : Pairs{{2, 3}, {4, 2}, {3, 1}, {1, 4}})
      for (int64_t width : {3, 0})
        expectSortChunks(t, peers, local, width, randomCounts(peers * local, 4, rng), rng);
}

TEST(ExpertParallelCpu, SortChunksOfNoRowsIsEmpty) {
  std::mt19937 rng(24);
  expectSortChunks(DType::f32, 2, 2, 3, {0, 0, 0, 0}, rng);
  expectSortChunks(DType::i32, 3, 1, 0, {0, 0, 0}, rng);
}

TEST(ExpertParallelCpu, SortChunksKeepsTheTrailingShape) {
  // Rows of [2, 2]: 2 peers of 2 chunks with 1, 0 | 2, 1 rows.
  std::vector<double> x(16);
  for (size_t v = 0; v < x.size(); ++v) x[v] = static_cast<double>(v);
  OpCall call{"kiln.moe_sort_chunks", {f32({4, 2, 2}, x), i64({4}, {1, 0, 2, 1})}, {{"chunks", i(2)}}};
  // Expert 0: peer 0's row 0, then peer 1's rows 1, 2; expert 1: peer 1's row 3.
  expectTensor(runOk(call), {4, 2, 2}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, 0);
  OpCall swapped{"kiln.moe_sort_chunks", {f32({4, 2, 2}, x), i64({4}, {0, 2, 1, 1})}, {{"chunks", i(2)}}};
  // Expert 0: peer 1's row 2; expert 1: peer 0's rows 0, 1, then peer 1's row 3.
  expectTensor(runOk(swapped), {4, 2, 2}, {8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15}, 0);
}

// ---- moe_chunk_offsets ------------------------------------------------------------------------

TEST(ExpertParallelCpu, ChunkOffsetsAddUpEachLocalExpertsChunksOverPeers) {
  std::mt19937 rng(25);
  for (auto [peers, local] : Pairs{{2, 3}, {4, 2}, {1, 1}, {3, 4}}) {
    const std::vector<double> counts = randomCounts(peers * local, 5, rng);
    std::vector<double> want = {0};
    for (int64_t e = 0; e < local; ++e) {
      double rows = 0;
      for (int64_t p = 0; p < peers; ++p) rows += counts[static_cast<size_t>(p * local + e)];
      want.push_back(want.back() + rows);
    }
    HostTensor got =
        runOk({"kiln.moe_chunk_offsets", {i64({peers * local}, counts)}, {{"chunks", i(local)}}});
    EXPECT_EQ(got.view.dtype, DType::i32);
    expectTensor(got, {local + 1}, want, 0);
  }
}

// ---- Run-time checks ---------------------------------------------------------------------------

TEST(ExpertParallelCpu, ExpertIdsOutsideTheExpertsAreErrors) {
  expectRunError({"kiln.moe_route_counts", {i32({2, 2}, {0, 3, 4, 1})}, {{"experts", i(4)}}},
                 "expert 4 at [1, 0] is out of range [0, 4)");
  expectRunError({"kiln.moe_route_counts", {i32({1, 2}, {0, -1})}, {{"experts", i(4)}}},
                 "expert -1 at [0, 1] is out of range [0, 4)");
}

TEST(ExpertParallelCpu, OffsetsThatDoNotRiseFromZeroAreErrors) {
  const AttrDict attrs = {{"ranks", i(2)}, {"ep", i(2)}, {"rank", i(0)}, {"experts", i(4)}};
  expectRunError({"kiln.moe_ep_split", {i32({5}, {1, 2, 3, 4, 5})}, attrs}, "offsets[0] = 1, want 0");
  expectRunError({"kiln.moe_ep_split", {i32({5}, {0, 2, 3, 1, 5})}, attrs}, "offsets decrease at expert 2");
}

TEST(ExpertParallelCpu, BadChunkCountsAreErrors) {
  const HostTensor x = f32({5, 2}, std::vector<double>(10, 1.0));
  expectRunError({"kiln.moe_sort_chunks", {x, i64({4}, {2, -2, 3, 2})}, {{"chunks", i(2)}}},
                 "chunk_counts[1] = -2 is negative");
  expectRunError({"kiln.moe_sort_chunks", {x, i64({4}, {1, 0, 2, 1})}, {{"chunks", i(2)}}},
                 "x has 5 rows but chunk_counts add up to 4");
  expectRunError(
      {"kiln.moe_sort_chunks", {x, i64({4}, {1, 4, 2, 1})}, {{"chunks", i(2)}, {"inverse", A(true)}}},
      "chunk_counts add up to more than the 5 rows of x");
  expectRunError({"kiln.moe_chunk_offsets", {i64({4}, {1, 0, -3, 1})}, {{"chunks", i(2)}}},
                 "chunk_counts[2] = -3 is negative");
  const double big = static_cast<double>(std::numeric_limits<int32_t>::max());
  expectRunError({"kiln.moe_chunk_offsets", {i64({4}, {1, big, 0, 0})}, {{"chunks", i(2)}}},
                 "the rows up to local expert 1 do not fit the i32 offsets");
}

// The interpreter allocates results at their bound; a caller that gives a smaller buffer than
// the rows gets an error, not a write past its end.
TEST(ExpertParallelCpu, MoreRowsThanTheResultHoldsIsAnError) {
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  auto x = b.createWithTypes("kiln.input", {}, {boundedRows(DType::f32, 8, {2})}, {{"name", A("x")}});
  auto counts =
      b.createWithTypes("kiln.input", {}, {TensorType(DType::i64, {Dim::fixed(2)})}, {{"name", A("c")}});
  ASSERT_TRUE(x && counts);
  auto op = b.create(OpCode::MoeSortChunks, {(*x)->result(), (*counts)->result()}, {{"chunks", i(1)}});
  ASSERT_TRUE(op) << op.status().str();
  HostTensor rows = f32({6, 2}, std::vector<double>(12, 1.0)), c = i64({2}, {4, 2}),
             result(DType::f32, {4, 2});
  Status s = (*op)->def()->cpu(**op, {&rows.view, &c.view}, {&result.view}, CpuContext{});
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("kiln.moe_sort_chunks"), std::string::npos) << s.str();
  EXPECT_NE(s.message().find("6 rows do not fit the result's bound of 4 rows"), std::string::npos) << s.str();
}

}  // namespace
}  // namespace kiln::ir::testing
