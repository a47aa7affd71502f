#include "runtime/stop_signals.h"

#include <fmt/format.h>
#include <limits.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <iterator>

namespace kiln::runtime {
namespace {

static_assert(std::atomic<int>::is_always_lock_free, "the handler reads these atomics");

constexpr int kStopSignals[] = {SIGINT, SIGTERM};
constexpr int kSlots = 16;

// A registered temporary file: state 0 is free, 1 being filled, 2 holds a path.
struct Slot {
  std::atomic<int> state{0};
  char path[PATH_MAX];
};
Slot g_slots[kSlots];
std::atomic<int> g_signal{0};
struct sigaction g_previous[std::size(kStopSignals)];
bool g_installed[std::size(kStopSignals)];

extern "C" void onStopSignal(int signal) {
  int none = 0;
  if (g_signal.compare_exchange_strong(none, signal)) return;  // the first: polled by the loop
  // The second: what is half written goes, then the signal's default action ends the process
  // (unlink, signal and raise are async-signal-safe).
  for (Slot& s : g_slots)
    if (s.state.load() == 2) ::unlink(s.path);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

}  // namespace

StopSignals::StopSignals() {
  g_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = onStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // reads and writes the first signal interrupts carry on
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    // A signal the process was started ignoring (SIGINT of a shell's background job, nohup)
    // stays ignored.
    g_installed[i] = ::sigaction(kStopSignals[i], nullptr, &g_previous[i]) == 0 &&
                     g_previous[i].sa_handler != SIG_IGN &&
                     ::sigaction(kStopSignals[i], &sa, nullptr) == 0;
  }
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    if (g_installed[i]) ::sigaction(kStopSignals[i], &g_previous[i], nullptr);
}

int stopSignal() { return g_signal.load(); }

std::string signalName(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return fmt::format("signal {}", signal);
  }
}

PendingTempFile::PendingTempFile(const std::string& path) {
  if (path.size() >= PATH_MAX) return;
  for (int i = 0; i < kSlots; ++i) {
    int free = 0;
    if (!g_slots[i].state.compare_exchange_strong(free, 1)) continue;
    std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
    g_slots[i].state.store(2);
    slot_ = i;
    return;
  }
}

PendingTempFile::~PendingTempFile() {
  if (slot_ >= 0) g_slots[slot_].state.store(0);
}

}  // namespace kiln::runtime
