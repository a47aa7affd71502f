#include "ir/builder.h"
#include "runtime/data/sample.h"
#include "test_util.h"

namespace kiln::data {
namespace {

using testing::B;
using testing::criteoInputs;
using testing::tt;

TEST(BatchSpec, CriteoLayout) {
  std::vector<int> hot(kNumSparse, 1);
  hot[3] = 4;
  auto spec = fromInputs(criteoInputs(hot, std::vector<int64_t>(kNumSparse, 77)));
  ASSERT_TRUE(spec.isOk()) << spec.status().str();
  ASSERT_EQ(spec->inputs.size(), 2u + kNumSparse);
  EXPECT_EQ(spec->inputs[0].role, InputRole::Dense);
  EXPECT_EQ(spec->inputs[0].dense_count, 13);
  EXPECT_EQ(spec->labelIndex(), 1);
  const InputSpec* c3 = spec->find("cats.3");
  ASSERT_NE(c3, nullptr);
  EXPECT_EQ(c3->feature, 3);
  EXPECT_EQ(c3->hotness, 4);
  EXPECT_EQ(c3->rows, 77);
  EXPECT_EQ(c3->id_map, IdMap::Hash);
  EXPECT_EQ(spec->find("cats.4")->id_map, IdMap::Modulo);
}

TEST(BatchSpec, FromFunctionSkipsTrainerScalarsAndLinksLengths) {
  ir::Module m;
  ir::Function& fn = m.addFunction("train_step");
  ir::Builder b(fn.entry());
  auto input = [&](ir::AttrDict attrs, ir::TensorType t) {
    auto op = b.createWithTypes("kiln.input", {}, {t}, std::move(attrs));
    ASSERT_TRUE(op.isOk()) << op.status().str();
  };
  ir::Dim ids_dim = ir::Dim::bounded(ir::Dim::symbol("B", 8));
  input({{"name", "dense"}, {"role", "dense"}}, tt(ir::DType::f32, {B(), ir::Dim::fixed(5)}));
  input({{"name", "lr"}, {"role", "lr"}}, tt(ir::DType::f32, {}));
  input({{"name", "cats.2"}, {"role", "sparse"}, {"feature", 2}, {"rows", 100}, {"max_hotness", 8}, {"id_map", "hash"}},
        tt(ir::DType::i64, {ids_dim}));
  input({{"name", "cats.2.lengths"}, {"role", "lengths"}, {"feature", 2}}, tt(ir::DType::i32, {B()}));
  input({{"name", "cats.2.weights"}, {"role", "weights"}, {"feature", 2}}, tt(ir::DType::f32, {ids_dim}));
  input({{"name", "step"}, {"role", "step"}}, tt(ir::DType::f32, {}));
  auto spec = fromFunction(fn);
  ASSERT_TRUE(spec.isOk()) << spec.status().str();
  ASSERT_EQ(spec->inputs.size(), 4u);
  const InputSpec& ids = spec->inputs[1];
  EXPECT_TRUE(ids.variableLength());
  EXPECT_EQ(ids.max_hotness, 8);
  EXPECT_EQ(spec->inputs[static_cast<size_t>(ids.lengths_input)].name, "cats.2.lengths");
  EXPECT_EQ(spec->inputs[static_cast<size_t>(ids.weights_input)].name, "cats.2.weights");
  EXPECT_EQ(spec->labelIndex(), -1);
}

struct BadSpec {
  ir::AttrDict attrs;
  ir::TensorType type;
  std::string message;
};

TEST(BatchSpec, ErrorsNameTheInput) {
  const ir::TensorType ids = tt(ir::DType::i64, {B(), ir::Dim::fixed(2)});
  std::vector<BadSpec> cases = {
      {{{"name", "c"}, {"role", "sparse"}, {"feature", 1}, {"hotness", 2}},
       ids,
       "input 'c': missing integer attribute 'rows'"},
      {{{"name", "c"}, {"role", "sparse"}, {"feature", 1}, {"rows", 0}},
       ids,
       "input 'c': rows must be positive"},
      {{{"name", "c"}, {"role", "sparse"}, {"feature", int64_t{1} << 20}, {"rows", 5}},
       ids,
       "input 'c': feature 1048576 is outside [0, 2^20)"},
      {{{"name", "c"}, {"role", "sparse"}, {"feature", 1}, {"rows", 5}, {"id_map", "mod"}},
       ids,
       "id_map must be"},
      {{{"name", "c"}, {"role", "sparse"}, {"feature", 1}, {"rows", 5}, {"hotness", 3}},
       ids,
       "hotness 3 does not match"},
      {{{"name", "c"}, {"role", "sparse"}, {"feature", 1}, {"rows", 5}, {"max_hotness", 4}},
       tt(ir::DType::i64, {ir::Dim::bounded(ir::Dim::symbol("B", 4))}),
       "need a lengths input"},
      {{{"name", "d"}, {"role", "dense"}},
       tt(ir::DType::f32, {B(), ir::Dim::fixed(0)}),
       "input 'd': dense features must be"},
      {{{"name", "l"}, {"role", "label"}}, tt(ir::DType::i32, {B()}), "input 'l': a label must be f32"},
      {{{"name", "x"}, {"role", "pixels"}}, ids, "input 'x': unknown role 'pixels'"},
      {{{"name", "w"}, {"role", "weights"}, {"feature", 9}},
       tt(ir::DType::f32, {B(), ir::Dim::fixed(2)}),
       "input 'w': no sparse input reads feature 9"},
  };
  for (const BadSpec& c : cases) {
    auto spec = fromInputs({{c.attrs, c.type}});
    ASSERT_FALSE(spec.isOk()) << c.message;
    EXPECT_NE(spec.status().message().find(c.message), std::string::npos) << spec.status().message();
  }
}

TEST(Assemble, MapsExpandsAndMarksMissing) {
  std::vector<int> hot(kNumSparse, 1);
  hot[0] = 3;
  hot[1] = 2;
  auto spec = fromInputs(criteoInputs(hot, std::vector<int64_t>(kNumSparse, 1000)));
  ASSERT_TRUE(spec.isOk());
  RawSample s[2];
  for (int f = 0; f < kNumSparse; ++f) s[0].cats[f] = 0x68fd1e64 + static_cast<uint64_t>(f);
  s[0].label = 1;
  s[0].dense[12] = 2.5f;
  s[1].missing = (1u << 0) | (1u << 5);
  s[1].cats[1] = 123456;
  Batch batch;
  assembleBatch(*spec, s, 2, batch);
  EXPECT_EQ(batch.size, 2);
  const int64_t* c0 = batch.find("cats.0")->as<int64_t>();
  // Feature 0 takes the modulo: value k = 0 is the raw value, k > 0 hashes (raw, k).
  EXPECT_EQ(c0[0], static_cast<int64_t>(0x68fd1e64ull % 1000));
  EXPECT_EQ(c0[1], static_cast<int64_t>(expandValue(0x68fd1e64, 1) % 1000));
  EXPECT_NE(c0[1], c0[2]);
  // A missing value becomes the reserved row in every slot.
  EXPECT_EQ(c0[3], kMissingRow);
  EXPECT_EQ(c0[5], kMissingRow);
  EXPECT_EQ(batch.find("cats.5")->as<int64_t>()[1], kMissingRow);
  // Feature 1 hashes: independently, splitmix64's finalizer of 123456, modulo 1000.
  uint64_t x = 123456;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  EXPECT_EQ(batch.find("cats.1")->as<int64_t>()[2], static_cast<int64_t>(x % 1000));
  EXPECT_EQ(batch.find("label")->as<float>()[0], 1.0f);
  EXPECT_EQ(batch.find("dense")->as<float>()[12], 2.5f);
  EXPECT_EQ(batch.find("dense")->view.shape, (std::vector<int64_t>{2, 13}));
  for (int f = 0; f < kNumSparse; ++f)
    for (int64_t k = 0; k < batch.find("cats." + std::to_string(f))->numel(); ++k) {
      int64_t id = batch.find("cats." + std::to_string(f))->as<int64_t>()[k];
      EXPECT_TRUE(id >= 0 && id < 1000);
    }
}

TEST(StreamPosition, RoundTripsAndRejectsGarbage) {
  StreamPosition p{.epoch = 2, .file = 1, .offset = 4096, .line = 17, .sample = 120};
  auto q = StreamPosition::parse(p.str());
  ASSERT_TRUE(q.isOk()) << q.status().str();
  EXPECT_EQ(*q, p);
  EXPECT_FALSE(StreamPosition::parse("epoch=1,file=x").isOk());
  EXPECT_FALSE(StreamPosition::parse("").isOk());
  EXPECT_FALSE(StreamPosition::parse(p.str() + ",more=1").isOk());
}

}  // namespace
}  // namespace kiln::data
