// The NCCL backend (label gpu). Loading fails with a clear message where libnccl is absent
// (that test runs everywhere); the collectives run on one GPU at N = 1, bootstrapped over a
// one-rank LocalGroup, and skip without a GPU or without libnccl.
#include <gtest/gtest.h>

#include <numeric>

#include "runtime/comm/local_group.h"
#include "runtime/comm/nccl_communicator.h"
#include "tests/gpu/gpu_test_util.h"

namespace kiln::comm {
namespace {

TEST(NcclComm, LoadingSaysWhatIsMissing) {
  // A library that is not there, as on a machine without NCCL.
  Status s = tryLoadNccl("/nonexistent/libnccl.so.2");
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("cannot use NCCL"), std::string::npos) << s.message();
#ifdef KILN_HAVE_CUDA_HEADERS
  EXPECT_NE(s.message().find("/nonexistent/libnccl.so.2"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("LD_LIBRARY_PATH"), std::string::npos) << s.message();
#endif
}

TEST(NcclComm, LoadsWhereInstalled) {
  int version = 0;
  Status s = loadNccl(&version);
  if (!s) GTEST_SKIP() << s.message();
  EXPECT_GE(version, 2700);
}

#ifdef KILN_HAVE_CUDA_HEADERS

class NcclOneGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    if (Status s = loadNccl(); !s) GTEST_SKIP() << s.message();
    auto ctx = cuda::CudaContext::create(0);
    ASSERT_TRUE(ctx) << ctx.status().message();
    ctx_ = ctx.take();
    auto comm = createNcclCommunicator(group_.comm(0), *ctx_);
    ASSERT_TRUE(comm) << comm.status().message();
    comm_ = comm.take();
  }

  // A device buffer holding `values`.
  cuda::DeviceBuffer upload(const std::vector<float>& values) {
    auto b = cuda::DeviceBuffer::allocate(ctx_->driver(), std::max<size_t>(4, values.size() * 4), "test");
    EXPECT_TRUE(b);
    if (!values.empty()) {
      EXPECT_TRUE(b->upload(values.data(), values.size() * 4).isOk());
    }
    return b.take();
  }
  std::vector<float> download(const cuda::DeviceBuffer& b, size_t n) {
    std::vector<float> out(n);
    if (n) {
      EXPECT_TRUE(b.download(out.data(), n * 4).isOk());
    }
    return out;
  }
  static void* ptr(const cuda::DeviceBuffer& b) { return reinterpret_cast<void*>(b.ptr()); }

  LocalGroup group_{1};
  std::unique_ptr<cuda::CudaContext> ctx_;
  std::unique_ptr<Communicator> comm_;
};

// With one rank every collective is a copy; what it checks is that each NCCL call sequence is
// right and completes on its event.
TEST_F(NcclOneGpu, EveryCollective) {
  std::vector<float> in(37);
  std::iota(in.begin(), in.end(), 1.0f);
  cuda::DeviceBuffer a = upload(in), b = upload(std::vector<float>(in.size(), 0));
  Communicator& c = *comm_;
  EXPECT_EQ(c.memorySpace(), MemorySpace::Device);
  auto check = [&](Request r, const char* what) {
    Status s = r.wait();
    ASSERT_TRUE(s.isOk()) << what << ": " << s.message();
    EXPECT_NE(r.cudaEvent(), nullptr);
    EXPECT_EQ(download(b, in.size()), in) << what;
    ASSERT_TRUE(b.upload(std::vector<float>(in.size(), 0).data(), in.size() * 4).isOk());
  };
  size_t n = in.size();
  check(c.allReduce(ptr(a), ptr(b), n, DataType::f32), "all_reduce");
  check(c.reduceScatter(ptr(a), ptr(b), n, DataType::f32), "reduce_scatter");
  check(c.reduceScatterV(ptr(a), ptr(b), {n}, DataType::f32), "reduce_scatter_v");
  check(c.allGather(ptr(a), ptr(b), n, DataType::f32), "all_gather");
  check(c.allGatherV(ptr(a), ptr(b), {n}, DataType::f32), "all_gather_v");
  check(c.allToAll(ptr(a), ptr(b), n, DataType::f32), "all_to_all");
  check(c.allToAllV(ptr(a), {n}, ptr(b), {n}, n, DataType::f32), "all_to_all_v");
  ASSERT_TRUE(c.broadcastSync(ptr(a), n, DataType::f32, 0).isOk());
  EXPECT_EQ(download(a, n), in);
  ASSERT_TRUE(c.barrier().isOk());
  // Several outstanding, waited in reverse.
  std::vector<Request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(c.allReduce(ptr(a), ptr(a), n, DataType::f32));
  for (size_t i = reqs.size(); i-- > 0;) ASSERT_TRUE(reqs[i].wait().isOk());
  EXPECT_EQ(download(a, n), in);
}

TEST_F(NcclOneGpu, AbortBreaksTheCommunicator) {
  comm_->abort("test");
  Status s = comm_->barrier();
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("rank 0 aborted: test"), std::string::npos) << s.message();
}

#endif

}  // namespace
}  // namespace kiln::comm
