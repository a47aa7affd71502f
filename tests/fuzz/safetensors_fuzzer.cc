// libFuzzer harness for safetensors checkpoints: the bytes as a checkpoint file through the
// checks `kiln train --resume` and `kiln eval --checkpoint` run (runtime::parseCheckpoint, the
// validation of loadCheckpoint). Any input must end in a checkpoint or an error naming the file,
// never a crash, a hang or a leak; a checkpoint that loads must save and load back the same.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "runtime/checkpoint.h"

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  auto ckpt = runtime::parseCheckpoint(std::string_view(reinterpret_cast<const char*>(data), size),
                                       "fuzz.safetensors");
  if (!ckpt) {
    (void)ckpt.status().str();
    return 0;
  }
  std::vector<std::pair<std::string, ir::TensorView>> views;
  for (const auto& [name, t] : ckpt->tensors) {
    check(t.storage.size() == static_cast<size_t>(t.view.bytes()), "a tensor's storage holds its shape");
    views.emplace_back(name, t.view);
  }
  // tmpfs: the round trip costs no disk I/O.
  static const std::string path = "/dev/shm/kiln-safetensors-fuzz-" + std::to_string(::getpid());
  Status saved = runtime::saveCheckpoint(path, views, ckpt->metadata);
  check(saved.isOk(), "a checkpoint that loads can be saved again");
  auto again = runtime::loadCheckpoint(path);
  std::remove(path.c_str());
  check(again.isOk(), "a saved checkpoint loads");
  check(again->metadata == ckpt->metadata && again->tensors.size() == ckpt->tensors.size(),
        "the round trip keeps the header");
  for (size_t i = 0; i < ckpt->tensors.size(); ++i) {
    const auto& [name, t] = ckpt->tensors[i];
    const ir::HostTensor* u = again->find(name);
    check(u && u->view.dtype == t.view.dtype && u->view.shape == t.view.shape && u->storage == t.storage,
          "the round trip keeps every tensor");
  }
  return 0;
}
