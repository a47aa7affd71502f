#include "runtime/comm/communicator.h"

#include <cstring>

#include "ir/tensor_view.h"

namespace kiln::comm {

std::string_view dataTypeName(DataType t) {
  switch (t) {
    case DataType::f32:
      return "f32";
    case DataType::f16:
      return "f16";
    case DataType::bf16:
      return "bf16";
    case DataType::f64:
      return "f64";
    case DataType::i32:
      return "i32";
    case DataType::i64:
      return "i64";
    case DataType::u8:
      return "u8";
  }
  return "?";
}

size_t dataTypeBytes(DataType t) {
  switch (t) {
    case DataType::f32:
    case DataType::i32:
      return 4;
    case DataType::f16:
    case DataType::bf16:
      return 2;
    case DataType::f64:
    case DataType::i64:
      return 8;
    case DataType::u8:
      return 1;
  }
  return 1;
}

Expected<DataType> fromIrDType(ir::DType t) {
  switch (t) {
    case ir::DType::f32:
      return DataType::f32;
    case ir::DType::f16:
      return DataType::f16;
    case ir::DType::bf16:
      return DataType::bf16;
    case ir::DType::f64:
      return DataType::f64;
    case ir::DType::i32:
      return DataType::i32;
    case ir::DType::i64:
      return DataType::i64;
    case ir::DType::i1:
      return DataType::u8;
    default:
      break;
  }
  return Status::errorf("collectives do not take {} tensors", ir::dtypeName(t));
}

std::string_view collectiveName(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce:
      return "all_reduce";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::ReduceScatterV:
      return "reduce_scatter_v";
    case CollectiveKind::AllGatherV:
      return "all_gather_v";
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::AllToAll:
      return "all_to_all";
    case CollectiveKind::AllToAllV:
      return "all_to_all_v";
    case CollectiveKind::Broadcast:
      return "broadcast";
    case CollectiveKind::Barrier:
      return "barrier";
  }
  return "?";
}

std::string formatDuration(std::chrono::milliseconds d) {
  int64_t ms = d.count();
  if (ms < 1000) return fmt::format("{} ms", ms);
  if (ms % 1000 == 0) return fmt::format("{} s", ms / 1000);
  return fmt::format("{:.1f} s", static_cast<double>(ms) / 1000.0);
}

namespace {

class FailedRequest final : public RequestState {
 public:
  explicit FailedRequest(Status s) : status_(std::move(s)) {}
  Expected<bool> test() override { return status_; }
  Status wait() override { return status_; }

 private:
  Status status_;
};

}  // namespace

Request Request::failed(Status s) { return Request(std::make_shared<FailedRequest>(std::move(s))); }

Status waitAll(std::vector<Request>& requests) {
  Status first;
  for (Request& r : requests) {
    Status s = r.wait();
    if (!s && first) first = std::move(s);
  }
  return first;
}

Expected<std::vector<size_t>> Communicator::exchangeCounts(const std::vector<size_t>& send_counts) {
  if (memorySpace() != MemorySpace::Host)
    return Status::errorf("exchangeCounts needs host buffers; the {} backend works on device memory",
                          backendName());
  KILN_RETURN_IF_ERROR(checkCounts(send_counts, size(), "send_counts"));
  std::vector<int64_t> out(send_counts.begin(), send_counts.end()), in(send_counts.size());
  KILN_RETURN_IF_ERROR(allToAllSync(out.data(), in.data(), 1, DataType::i64));
  std::vector<size_t> result;
  result.reserve(in.size());
  for (int64_t c : in) {
    if (c < 0) return Status::errorf("exchangeCounts: a peer announced a negative count ({})", c);
    result.push_back(static_cast<size_t>(c));
  }
  return result;
}

std::string operationName(CollectiveKind k, uint64_t seq, int rank) {
  return fmt::format("{} #{} on rank {}", collectiveName(k), seq, rank);
}

Status checkCounts(const std::vector<size_t>& counts, int size, const char* what) {
  if (counts.size() != static_cast<size_t>(size))
    return Status::errorf("{} has {} entries for a group of {} ranks", what, counts.size(), size);
  return Status::ok();
}

Status checkRoot(int root, int size) {
  if (root < 0 || root >= size)
    return Status::errorf("broadcast root {} is not a rank of a group of {}", root, size);
  return Status::ok();
}

// --- Host arithmetic.

uint16_t floatToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN stays NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to infinity
  if (abs >= 0x38800000u) {                       // a normal f16 (2^-14 and up)
    uint32_t exp = (abs >> 23) - 127 + 15, mant = abs & 0x7fffffu;
    uint32_t h = (exp << 10) | (mant >> 13), rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // to nearest even; may carry into exp
    return static_cast<uint16_t>(sign | h);
  }
  // Subnormal: the result is round(value / 2^-24).
  uint32_t e = abs >> 23;
  uint32_t shift = 126 - e;
  if (e == 0 || shift > 24) return sign;
  uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float f16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  if (exp == 31)
    u = sign | 0x7f800000u | (mant << 13);
  else
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

DataType accumulatorType(DataType t) {
  return (t == DataType::f16 || t == DataType::bf16) ? DataType::f32 : t;
}

namespace {

template <typename Acc, typename Src, typename Load>
void accumulateAs(const void* src, void* acc, size_t n, bool first, Load load) {
  const Src* s = static_cast<const Src*>(src);
  Acc* a = static_cast<Acc*>(acc);
  if (first)
    for (size_t i = 0; i < n; ++i) a[i] = load(s[i]);
  else
    for (size_t i = 0; i < n; ++i) a[i] = static_cast<Acc>(a[i] + load(s[i]));
}

}  // namespace

void accumulate(DataType t, const void* src, void* acc, size_t n, bool first) {
  auto same = [](auto v) { return v; };
  switch (t) {
    case DataType::f32:
      return accumulateAs<float, float>(src, acc, n, first, same);
    case DataType::f64:
      return accumulateAs<double, double>(src, acc, n, first, same);
    case DataType::i32:
      return accumulateAs<int32_t, int32_t>(src, acc, n, first, same);
    case DataType::i64:
      return accumulateAs<int64_t, int64_t>(src, acc, n, first, same);
    case DataType::u8:
      return accumulateAs<uint8_t, uint8_t>(src, acc, n, first, same);
    case DataType::f16:
      return accumulateAs<float, uint16_t>(src, acc, n, first, f16ToFloat);
    case DataType::bf16:
      return accumulateAs<float, uint16_t>(src, acc, n, first, ir::bf16ToFloat);
  }
}

void storeAccumulator(DataType t, const void* acc, void* dst, size_t n) {
  if (t == DataType::f16 || t == DataType::bf16) {
    const float* a = static_cast<const float*>(acc);
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = t == DataType::f16 ? floatToF16(a[i]) : ir::floatToBf16(a[i]);
    return;
  }
  if (acc != dst) std::memcpy(dst, acc, n * dataTypeBytes(t));
}

}  // namespace kiln::comm
