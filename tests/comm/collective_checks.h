// Checks of every collective on one rank of any host Communicator (in-process threads or MPI
// processes). Each rank's inputs are a function of (rank, element, salt), so every rank can
// regenerate all ranks' inputs and compute the expected result with plain loops, independent
// of the backend. Values are small integers so every backend's sum order gives exact results.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ir/tensor_view.h"
#include "runtime/comm/communicator.h"

namespace kiln::comm::testing {

inline int64_t inputValue(int rank, size_t i, int salt) {
  return static_cast<int64_t>((static_cast<size_t>(rank) * 131 + i * 17 + static_cast<size_t>(salt) * 7) %
                              23) -
         11;
}

// Storage of one element type, written and read as int64 (exact for the values above).
struct TypedBuffer {
  DataType type;
  std::vector<unsigned char> bytes;

  TypedBuffer(DataType t, size_t n) : type(t), bytes(n * dataTypeBytes(t) + 1, 0xAB) {}  // +1: never empty
  void* data() { return bytes.data(); }
  size_t size() const { return (bytes.size() - 1) / dataTypeBytes(type); }

  void set(size_t i, int64_t v) {
    unsigned char* p = bytes.data() + i * dataTypeBytes(type);
    switch (type) {
      case DataType::f32: {
        float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        break;
      }
      case DataType::f64: {
        double d = static_cast<double>(v);
        std::memcpy(p, &d, 8);
        break;
      }
      case DataType::i32: {
        int32_t x = static_cast<int32_t>(v);
        std::memcpy(p, &x, 4);
        break;
      }
      case DataType::i64:
        std::memcpy(p, &v, 8);
        break;
      case DataType::u8:
        *p = static_cast<uint8_t>(v);
        break;
      case DataType::f16: {
        uint16_t h = floatToF16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DataType::bf16: {
        uint16_t h = ir::floatToBf16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
    }
  }
  int64_t get(size_t i) const {
    const unsigned char* p = bytes.data() + i * dataTypeBytes(type);
    switch (type) {
      case DataType::f32: {
        float f;
        std::memcpy(&f, p, 4);
        return static_cast<int64_t>(f);
      }
      case DataType::f64: {
        double d;
        std::memcpy(&d, p, 8);
        return static_cast<int64_t>(d);
      }
      case DataType::i32: {
        int32_t x;
        std::memcpy(&x, p, 4);
        return x;
      }
      case DataType::i64: {
        int64_t x;
        std::memcpy(&x, p, 8);
        return x;
      }
      case DataType::u8:
        return *p;
      case DataType::f16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return static_cast<int64_t>(f16ToFloat(h));
      }
      case DataType::bf16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return static_cast<int64_t>(ir::bf16ToFloat(h));
      }
    }
    return 0;
  }
};

// Expected values wrap like the type does (u8 sums are modulo 256).
inline int64_t asType(DataType t, int64_t v) { return t == DataType::u8 ? static_cast<uint8_t>(v) : v; }

// Rank r's input of n elements.
inline TypedBuffer inputOf(DataType t, int rank, size_t n, int salt) {
  TypedBuffer b(t, n);
  for (size_t i = 0; i < n; ++i) b.set(i, inputValue(rank, i, salt));
  return b;
}

inline const std::vector<DataType>& allTypes() {
  static const std::vector<DataType> types = {DataType::f32, DataType::f16, DataType::bf16, DataType::f64,
                                              DataType::i32, DataType::i64, DataType::u8};
  return types;
}

inline void checkAllReduce(Communicator& c) {
  int n = c.size();
  for (DataType t : allTypes())
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}})
      for (bool in_place : {false, true}) {
        int salt = static_cast<int>(count) + static_cast<int>(t);
        TypedBuffer send = inputOf(t, c.rank(), count, salt), recv(t, count);
        TypedBuffer& out = in_place ? send : recv;
        ASSERT_TRUE(c.allReduceSync(send.data(), out.data(), count, t).isOk());
        for (size_t i = 0; i < count; ++i) {
          int64_t want = 0;
          for (int r = 0; r < n; ++r) want += inputValue(r, i, salt);
          ASSERT_EQ(out.get(i), asType(t, want))
              << dataTypeName(t) << " count " << count << " i " << i << " in place " << in_place;
        }
      }
}

// Segment sizes for the uneven forms: some ranks get none.
inline std::vector<size_t> unevenCounts(int n, int salt) {
  std::vector<size_t> counts;
  for (int p = 0; p < n; ++p) counts.push_back(static_cast<size_t>((p * 5 + salt) % 4));
  return counts;
}

inline void checkReduceScatter(Communicator& c) {
  int n = c.size();
  size_t me = static_cast<size_t>(c.rank());
  for (DataType t : {DataType::f32, DataType::bf16, DataType::i64}) {
    std::vector<std::vector<size_t>> cases = {std::vector<size_t>(static_cast<size_t>(n), 0),
                                              std::vector<size_t>(static_cast<size_t>(n), 3),
                                              unevenCounts(n, 1), unevenCounts(n, 2)};
    for (size_t k = 0; k < cases.size(); ++k) {
      const std::vector<size_t>& counts = cases[k];
      bool equal = k < 2;
      size_t total = 0, offset = 0;
      for (size_t p = 0; p < counts.size(); ++p) {
        if (p == me) offset = total;
        total += counts[p];
      }
      int salt = static_cast<int>(k);
      TypedBuffer send = inputOf(t, c.rank(), total, salt), recv(t, counts[me]);
      Status s = equal ? c.reduceScatterSync(send.data(), recv.data(), counts[0], t)
                       : c.reduceScatterV(send.data(), recv.data(), counts, t).wait();
      ASSERT_TRUE(s.isOk()) << s.message();
      for (size_t i = 0; i < counts[me]; ++i) {
        int64_t want = 0;
        for (int r = 0; r < n; ++r) want += inputValue(r, offset + i, salt);
        ASSERT_EQ(recv.get(i), want) << "case " << k << " i " << i;
      }
      // In place (NCCL's form): the result lands on this rank's segment of send.
      if (equal) {
        TypedBuffer inplace = inputOf(t, c.rank(), total, salt);
        void* mine = inplace.bytes.data() + offset * dataTypeBytes(t);
        ASSERT_TRUE(c.reduceScatterSync(inplace.data(), mine, counts[0], t).isOk());
        for (size_t i = 0; i < counts[me]; ++i) ASSERT_EQ(inplace.get(offset + i), recv.get(i));
      }
    }
  }
}

inline void checkAllGather(Communicator& c) {
  int n = c.size();
  size_t me = static_cast<size_t>(c.rank());
  for (DataType t : {DataType::f32, DataType::f16, DataType::i32, DataType::u8}) {
    std::vector<std::vector<size_t>> cases = {std::vector<size_t>(static_cast<size_t>(n), 0),
                                              std::vector<size_t>(static_cast<size_t>(n), 5),
                                              unevenCounts(n, 3)};
    for (size_t k = 0; k < cases.size(); ++k) {
      const std::vector<size_t>& counts = cases[k];
      bool equal = k < 2;
      size_t total = 0;
      for (size_t x : counts) total += x;
      int salt = 10 + static_cast<int>(k);
      TypedBuffer send = inputOf(t, c.rank(), counts[me], salt), recv(t, total);
      Status s = equal ? c.allGatherSync(send.data(), recv.data(), counts[0], t)
                       : c.allGatherV(send.data(), recv.data(), counts, t).wait();
      ASSERT_TRUE(s.isOk()) << s.message();
      size_t off = 0;
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < counts[static_cast<size_t>(r)]; ++i)
          ASSERT_EQ(recv.get(off++), asType(t, inputValue(r, i, salt))) << "case " << k;
    }
  }
}

// Elements rank p sends to rank q in the variable case: zero for some pairs, uneven elsewhere.
inline size_t splitCount(int p, int q, int salt) { return static_cast<size_t>((p * 3 + q * 2 + salt) % 4); }

inline void checkAllToAll(Communicator& c) {
  int n = c.size(), me = c.rank();
  for (DataType t : {DataType::f32, DataType::i64, DataType::bf16}) {
    for (size_t per_peer : {size_t{0}, size_t{1}, size_t{4}}) {
      int salt = 20 + static_cast<int>(per_peer);
      TypedBuffer send = inputOf(t, me, per_peer * static_cast<size_t>(n), salt),
                  recv(t, per_peer * static_cast<size_t>(n));
      ASSERT_TRUE(c.allToAllSync(send.data(), recv.data(), per_peer, t).isOk());
      for (int p = 0; p < n; ++p)
        for (size_t i = 0; i < per_peer; ++i)
          ASSERT_EQ(recv.get(static_cast<size_t>(p) * per_peer + i),
                    inputValue(p, static_cast<size_t>(me) * per_peer + i, salt));
    }
    for (int salt : {0, 1, 2}) {
      std::vector<size_t> send_counts, want_recv;
      size_t send_total = 0, recv_total = 0;
      for (int q = 0; q < n; ++q) {
        send_counts.push_back(splitCount(me, q, salt));
        send_total += send_counts.back();
        want_recv.push_back(splitCount(q, me, salt));
        recv_total += want_recv.back();
      }
      // The receiver learns its counts at run time, as the IR's variable all_to_all does.
      auto recv_counts = c.exchangeCounts(send_counts);
      ASSERT_TRUE(recv_counts) << recv_counts.status().message();
      ASSERT_EQ(*recv_counts, want_recv);
      size_t capacity = recv_total + 3;  // a bound larger than what arrives
      TypedBuffer send = inputOf(t, me, send_total, 30 + salt), recv(t, capacity);
      Status s = c.allToAllVSync(send.data(), send_counts, recv.data(), *recv_counts, capacity, t);
      ASSERT_TRUE(s.isOk()) << s.message();
      size_t off = 0;
      for (int p = 0; p < n; ++p) {
        size_t sender_off = 0;  // where p's segment for this rank starts in p's send
        for (int q = 0; q < me; ++q) sender_off += splitCount(p, q, salt);
        for (size_t i = 0; i < splitCount(p, me, salt); ++i)
          ASSERT_EQ(recv.get(off++), inputValue(p, sender_off + i, 30 + salt)) << "from " << p;
      }
    }
  }
}

inline void checkBroadcast(Communicator& c) {
  for (int root = 0; root < c.size(); ++root)
    for (size_t count : {size_t{0}, size_t{9}}) {
      TypedBuffer b =
          c.rank() == root ? inputOf(DataType::i32, root, count, 40) : TypedBuffer(DataType::i32, count);
      ASSERT_TRUE(c.broadcastSync(b.data(), count, DataType::i32, root).isOk());
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(b.get(i), inputValue(root, i, 40));
    }
  ASSERT_TRUE(c.barrier().isOk());
}

// Several collectives in flight at once, completed in reverse order of issue.
inline void checkOverlap(Communicator& c) {
  int n = c.size(), me = c.rank();
  size_t count = 257;
  TypedBuffer a = inputOf(DataType::f32, me, count, 50), a_out(DataType::f32, count);
  TypedBuffer g = inputOf(DataType::i64, me, count, 51), g_out(DataType::i64, count * static_cast<size_t>(n));
  TypedBuffer t = inputOf(DataType::f32, me, 2 * static_cast<size_t>(n), 52),
              t_out(DataType::f32, 2 * static_cast<size_t>(n));
  std::vector<Request> reqs;
  reqs.push_back(c.allReduce(a.data(), a_out.data(), count, DataType::f32));
  reqs.push_back(c.allGather(g.data(), g_out.data(), count, DataType::i64));
  reqs.push_back(c.allToAll(t.data(), t_out.data(), 2, DataType::f32));
  reqs.push_back(c.barrierAsync());
  for (size_t i = reqs.size(); i-- > 0;) ASSERT_TRUE(reqs[i].wait().isOk());
  auto done = reqs[0].test();
  ASSERT_TRUE(done && *done);
  for (size_t i = 0; i < count; ++i) {
    int64_t want = 0;
    for (int r = 0; r < n; ++r) want += inputValue(r, i, 50);
    ASSERT_EQ(a_out.get(i), want);
    for (int r = 0; r < n; ++r)
      ASSERT_EQ(g_out.get(static_cast<size_t>(r) * count + i), inputValue(r, i, 51));
  }
  for (int p = 0; p < n; ++p)
    for (size_t i = 0; i < 2; ++i)
      ASSERT_EQ(t_out.get(static_cast<size_t>(p) * 2 + i),
                inputValue(p, static_cast<size_t>(me) * 2 + i, 52));
}

inline void checkEverything(Communicator& c) {
  checkAllReduce(c);
  checkReduceScatter(c);
  checkAllGather(c);
  checkAllToAll(c);
  checkBroadcast(c);
  checkOverlap(c);
}

}  // namespace kiln::comm::testing
