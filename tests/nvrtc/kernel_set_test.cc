// KernelSet (runtime/cuda/kernel_set.h): the serialized form round-trips, every damage is a clean
// error, merge drops what a set already holds, and select() picks a GPU's CUBIN, else PTX of an
// older virtual arch, else says what the set has. Needs neither NVRTC nor a GPU.
#include "runtime/cuda/kernel_set.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "runtime/cuda/ahead_compile.h"

namespace kiln::cuda {
namespace {

KernelImage image(std::string arch, std::vector<std::string> kernels, std::string bytes) {
  return KernelImage{std::move(arch), std::move(kernels), std::move(bytes)};
}

// Two programs (a, b | c) for sm_80 and sm_90, and one PTX of all three for compute_90. The
// bytes hold NULs and high bytes, as CUBINs do.
KernelSet sampleSet() {
  KernelSet s;
  s.images.push_back(image("sm_80", {"a", "b"},
                           std::string("\x7f"
                                       "ELF\0\x01\xff",
                                       7)));
  s.images.push_back(image("sm_80", {"c"}, "c80"));
  s.images.push_back(image("sm_90", {"a", "b"},
                           std::string("\x7f"
                                       "ELF\0\x02\xfe",
                                       7)));
  s.images.push_back(image("sm_90", {"c"}, "c90"));
  s.images.push_back(image("compute_90", {"a", "b", "c"}, ".version 9.0\n.target sm_90\n"));
  return s;
}

std::vector<std::string> archsOf(const std::vector<const KernelImage*>& images) {
  std::vector<std::string> out;
  for (const KernelImage* im : images) out.push_back(im->arch);
  return out;
}

TEST(KernelSet, RoundTrips) {
  const KernelSet s = sampleSet();
  const std::string bytes = s.serialize();
  EXPECT_EQ(bytes.substr(0, 8), "KILNKSET");
  auto back = KernelSet::deserialize(bytes, "test");
  ASSERT_TRUE(back) << back.status().message();
  ASSERT_EQ(back->images.size(), s.images.size());
  for (size_t i = 0; i < s.images.size(); ++i) {
    EXPECT_EQ(back->images[i].arch, s.images[i].arch);
    EXPECT_EQ(back->images[i].kernels, s.images[i].kernels);
    EXPECT_EQ(back->images[i].bytes, s.images[i].bytes);
  }
  EXPECT_EQ(back->serialize(), bytes);
  // An empty set too.
  auto empty = KernelSet::deserialize(KernelSet{}.serialize(), "test");
  ASSERT_TRUE(empty) << empty.status().message();
  EXPECT_TRUE(empty->images.empty());
}

TEST(KernelSet, EveryTruncationIsAnError) {
  const std::string bytes = sampleSet().serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = KernelSet::deserialize(std::string_view(bytes).substr(0, n), "payload.bin");
    ASSERT_FALSE(r) << "a prefix of " << n << " of " << bytes.size() << " bytes was accepted";
    EXPECT_EQ(r.status().message().rfind("payload.bin: ", 0), 0u) << r.status().message();
  }
  auto longer = KernelSet::deserialize(bytes + "x", "payload.bin");
  ASSERT_FALSE(longer);
  EXPECT_NE(longer.status().message().find("after its checksum"), std::string::npos)
      << longer.status().message();
}

TEST(KernelSet, FlippedMagicVersionAndBytesAreErrors) {
  const std::string bytes = sampleSet().serialize();
  std::string magic = bytes;
  magic[3] ^= 0x20;
  auto r = KernelSet::deserialize(magic, "x");
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("not a kernel set"), std::string::npos) << r.status().message();

  std::string version = bytes;
  version[8] = 2;
  r = KernelSet::deserialize(version, "x");
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("format version 2, this kiln reads version 1"), std::string::npos)
      << r.status().message();

  // Every single flipped bit anywhere is caught (a length, a name, an image's bytes, the sum).
  for (size_t i = 0; i < bytes.size(); ++i)
    for (int bit : {0, 7}) {
      std::string damaged = bytes;
      damaged[i] = static_cast<char>(damaged[i] ^ (1 << bit));
      ASSERT_FALSE(KernelSet::deserialize(damaged, "x")) << "byte " << i << " bit " << bit;
    }
}

TEST(KernelSet, HugeCountsAreTruncationNotAllocation) {
  std::string bytes = sampleSet().serialize();
  // The image count, then the first image's kernel count (after its 4-byte arch length and
  // "sm_80"), set to 2^32 - 1.
  for (size_t at : {size_t{12}, size_t{16 + 4 + 5}}) {
    std::string damaged = bytes;
    for (size_t i = 0; i < 4; ++i) damaged[at + i] = '\xff';
    auto r = KernelSet::deserialize(damaged, "x");
    ASSERT_FALSE(r);
    EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().message();
  }
}

TEST(KernelSet, ArchsAndNames) {
  const KernelSet s = sampleSet();
  EXPECT_EQ(s.archs(), (std::vector<std::string>{"sm_80", "sm_90", "compute_90"}));
  EXPECT_EQ(s.kernelNames(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(archNumber("sm_90"), 90);
  EXPECT_EQ(archNumber("sm_90a"), 90);
  EXPECT_EQ(archNumber("compute_100"), 100);
  EXPECT_EQ(archNumber("gfx90a"), -1);
  EXPECT_EQ(archNumber("sm_9"), -1);
}

TEST(KernelSet, MergeDropsWhatTheSetHolds) {
  KernelSet s = sampleSet();
  s.merge(sampleSet());
  EXPECT_EQ(s.images.size(), sampleSet().images.size());
  KernelSet other;
  other.images.push_back(image("sm_90", {"c", "d"}, "cd90"));  // d is new
  other.images.push_back(image("sm_80", {"c"}, "c80 again"));  // nothing new
  other.images.push_back(image("sm_100", {"a"}, "a100"));      // a new arch
  s.merge(std::move(other));
  ASSERT_EQ(s.images.size(), sampleSet().images.size() + 2);
  EXPECT_EQ(s.images[5].kernels, (std::vector<std::string>{"c", "d"}));
  EXPECT_EQ(s.images[6].arch, "sm_100");
  EXPECT_EQ(s.archs(), (std::vector<std::string>{"sm_80", "sm_90", "sm_100", "compute_90"}));
}

TEST(KernelSet, SelectsTheGpusCubin) {
  const KernelSet s = sampleSet();
  auto r = s.select("sm_90", {"a", "b", "c"});
  ASSERT_TRUE(r) << r.status().message();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0], &s.images[2]);
  EXPECT_EQ((*r)[1], &s.images[3]);
  // Only the images holding a wanted kernel.
  r = s.select("sm_80", {"c"});
  ASSERT_TRUE(r) << r.status().message();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0], &s.images[1]);
  r = s.select("sm_80", {});
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->empty());
}

TEST(KernelSet, NewerGpuFallsBackToPtx) {
  const KernelSet s = sampleSet();
  for (const char* gpu : {"sm_100", "sm_120", "sm_90a", "sm_89"}) {
    auto r = s.select(gpu, {"a", "c"});
    if (std::string(gpu) == "sm_89") {  // older than compute_90 and no sm_89 CUBIN
      EXPECT_FALSE(r) << gpu;
      continue;
    }
    ASSERT_TRUE(r) << gpu << ": " << r.status().message();
    EXPECT_EQ(archsOf(*r), (std::vector<std::string>{"compute_90"})) << gpu;
  }
  // The newest PTX not newer than the GPU.
  KernelSet two = sampleSet();
  two.images.push_back(image("compute_80", {"a", "b", "c"}, "ptx80"));
  two.images.push_back(image("compute_100", {"a", "b", "c"}, "ptx100"));
  auto r = two.select("sm_90a", {"a"});
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_EQ(archsOf(*r), (std::vector<std::string>{"compute_90"}));
  r = two.select("sm_86", {"a"});
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_EQ(archsOf(*r), (std::vector<std::string>{"compute_80"}));
  // A CUBIN missing a kernel the PTX holds: the PTX.
  KernelSet partial = sampleSet();
  partial.images.erase(partial.images.begin() + 3);  // sm_90's c
  r = partial.select("sm_90", {"a", "c"});
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_EQ(archsOf(*r), (std::vector<std::string>{"compute_90"}));
}

TEST(KernelSet, OlderGpuIsAnErrorNamingTheArchs) {
  const KernelSet s = sampleSet();
  auto r = s.select("sm_70", {"a"});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("(sm_70)"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("sm_80, sm_90, compute_90"), std::string::npos) << r.status().message();
  r = s.select("sm_90", {"a", "zz"});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("no 'zz'"), std::string::npos) << r.status().message();
  r = s.select("compute_90", {"a"});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("bad GPU architecture"), std::string::npos) << r.status().message();
}

TEST(NvrtcThreads, RequestedThenEnvironmentThenHardware) {
  EXPECT_EQ(nvrtcThreads(5), 5);
  const char* old = std::getenv("KILN_NVRTC_THREADS");
  const std::string saved = old ? old : "";
  setenv("KILN_NVRTC_THREADS", "3", 1);
  EXPECT_EQ(nvrtcThreads(0), 3);
  EXPECT_EQ(nvrtcThreads(2), 2);
  setenv("KILN_NVRTC_THREADS", "three", 1);
  EXPECT_GE(nvrtcThreads(0), 1);
  unsetenv("KILN_NVRTC_THREADS");
  EXPECT_GE(nvrtcThreads(0), 1);
  if (old) setenv("KILN_NVRTC_THREADS", saved.c_str(), 1);
}

}  // namespace
}  // namespace kiln::cuda
