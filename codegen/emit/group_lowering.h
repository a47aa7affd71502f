// What every emitter of codegen/emit/ shares while it lowers one group: the group's buffers, the
// kernel under construction and its buffer binding, the expressions of values at coordinates
// (valueAt: a pointwise producer in the group is computed inline through its expression rule in
// the EmitterRegistry, anything else is loaded from its buffer), the jagged bags' offsets and the
// group's embedding error flag. An emitter (pointwise.cc, reduction.cc, ...) builds kernels with
// these and finishes them into the LoweredGroup; emitter_registry.h says which emitter runs.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "codegen/kernel_lowering.h"

namespace kiln::codegen::emit {

// "'kiln.add' at file:3:5": how errors name an op.
std::string opLabel(const ir::Op& op);
// A value's readable name: its name hint, the `name` of its op, or "<op>#<result>".
std::string valueName(const ir::Value* v);
// "add" for kiln.add.
std::string shortOpName(const ir::Op& op);
int64_t product(const std::vector<int64_t>& s);
int64_t nextPow2(int64_t v);

// One kernel under construction: the kernel, the group buffer of each of its buffers, and the
// expressions already built for (value, coordinates).
struct KernelBuilder {
  Kernel k;
  std::vector<int> args;             // kernel buffer -> group buffer
  std::map<int, int> kernel_buffer;  // group buffer -> kernel buffer
  std::map<std::pair<const ir::Value*, std::vector<int>>, int> memo;

  ExprGraph& g() { return k.exprs; }
  // The coordinates of the kernel's space (a Row kernel's outer space), in order.
  std::vector<int> spaceCoords();

  // The set-up every kernel starts with. A Row kernel always has an outer element: an empty
  // outer space becomes {1} (coordinate 0 unused).
  static KernelBuilder pointwise(std::string name, std::vector<int64_t> space);
  static KernelBuilder row(std::string name, std::vector<int64_t> space, std::vector<int64_t> row_space);
  static KernelBuilder ofKind(std::string name, KernelKind kind);
};

// A Row kernel reducing one axis of x: the outer space is x's other dims, the row that axis.
struct AxisRow {
  std::vector<int> coords;  // per dim of x, in x's order
  std::vector<int> outer;   // the outer coordinates
};

// The ids of one bag op: [B, H] (fixed hotness) or [N] with lengths [B] (jagged).
struct BagIds {
  const ir::Value* ids = nullptr;
  const ir::Value* lengths = nullptr;
  int64_t batch = 0, hotness = 0, num_ids = 0;
};

class GroupLowering {
 public:
  // Pointer parameters one kernel may take: 3.5 KB of the 4 KB every CUDA device accepts (CUDA
  // 12.1 raised it to 32 KB on Volta and later). Kernels with per-table parameters (the lookups,
  // the lengths' scans) are cut into several launches past it.
  static constexpr size_t kMaxKernelParams = 448;

  // `sms`: the SMs of the GPU the kernels' grids and a fold's pieces are sized for (gridSms).
  GroupLowering(const std::vector<const ir::Op*>& ops, const ir::SymbolBindings& symbols, int sms);

  const std::vector<const ir::Op*>& ops() const { return out_.ops; }
  bool inGroup(const ir::Op* op) const { return in_group_.count(op) > 0; }
  LoweredGroup take() { return std::move(out_); }
  int sms() const { return sms_; }
  // The GEMM of the group (cuBLASLt runs it; the group has no kernels).
  void setGemm(const ir::Op& matmul, const GemmCall& call);

  Expected<std::vector<int64_t>> shapeOf(const ir::Value* v) const;

  // ---- Buffers ----
  // The group buffer of (the outer value of) `inner`, created on first use.
  int groupBuffer(const ir::Value* inner, bool written);
  // A temporary of the group (no IR value), always written.
  int tempBuffer(std::string name, DType dtype, int64_t elements);
  // An address table of the group (GroupBuffer::words), read-only to the kernels.
  int addressTable(std::string name, std::vector<AddressWord> words);
  // The kernel buffer of a group buffer in kernel `kb`, added on first use.
  int bind(KernelBuilder& kb, int group_buffer, bool written);
  int bindValue(KernelBuilder& kb, const ir::Value* v, bool written) {
    return bind(kb, groupBuffer(v, written), written);
  }
  // Validates the kernel and appends it (with its buffer binding) to the group, its grid sized
  // for the group's SMs.
  Status finish(KernelBuilder& kb);
  // Appends a Source kernel written with its buffers declared (moe_kernels.cc, embedding_sort.cc),
  // binding parameter i to group_buffers[i]: each must hold what the kernel declares (its dtype,
  // at least its elements). An error starts with `context` (the op it lowers).
  Status addSourceKernel(Kernel k, const std::vector<int>& group_buffers, const std::string& context);

  // ---- Expressions ----
  // Whether v is computed inline by the group's kernels (a pointwise op of the group).
  bool computedInGroup(const ir::Value* v) const;
  // A leaf: a splat constant inline, everything else loaded from its buffer at `offset`.
  Expected<int> load(KernelBuilder& kb, const ir::Value* v, int offset);
  // The expression for v at `coords` (node ids, one per dim of v), memoized per kernel.
  Expected<int> valueAt(KernelBuilder& kb, const ir::Value* v, const std::vector<int>& coords);
  // Operand i of `op` at the coordinates of op's result, numpy-broadcast: trailing dims align,
  // size-1 dims read coordinate 0.
  Expected<int> operandAt(KernelBuilder& kb, const ir::Op& op, unsigned i, const std::vector<int>& coords);
  // Values defined in the group that something outside it reads (or nothing reads at all).
  std::vector<const ir::Value*> liveOuts() const;

  // ---- Row kernels ----
  // Sets k's spaces with `axis` of a value of shape xs as the row.
  static AxisRow axisRow(Kernel& k, const std::vector<int64_t>& xs, int64_t axis);
  // The Max, then Sum phases of a numerically stable softmax over the row of `v`: returns
  // exp(v - max); the max is rowValue(0), the sum rowValue(1).
  static int expShiftedRow(Kernel& k, int v);

  // ---- Embeddings ----
  Expected<BagIds> bagIds(const ir::Op& op, const ir::Value* ids, const ir::Value* lengths);
  // The ids of an embedding_bag: (table, ids[, weights]) or (table, ids, lengths[, weights]).
  Expected<BagIds> bagIdsOf(const ir::Op& bag);
  static const ir::Value* bagWeights(const ir::Op& bag);
  // ONE BagOffsets kernel (more past kMaxKernelParams) scanning the lengths of every jagged bag of
  // `bags` not scanned yet in this group (bags sharing lengths share offsets); runs before the
  // kernels reading them.
  Status scanLengths(const std::vector<BagIds>& bags);
  // The group temporary holding the offsets of jagged `lengths` (scanLengths made it).
  int offsetsOf(const ir::Value* lengths) const { return offsets_of_.at(lengths); }
  // Sets a table's ids (and, for jagged bags, offsets and count) in kernel `kb`.
  void bindIds(KernelBuilder& kb, EmbeddingTable& t, const BagIds& b);
  // The group's i32[2] error flag, shared by all its kernels.
  int errorFlag();
  // Numbers what the kernel being built (the next one finished) checks: its index in
  // error_subjects is what the kernel writes as the flag's `table`, alike in every kernel.
  int errorSubject(std::string name, int64_t bound);

 private:
  Expected<int> computeValueAt(KernelBuilder& kb, const ir::Value* v, const std::vector<int>& coords);

  const ir::SymbolBindings& symbols_;
  int sms_;
  std::set<const ir::Op*> in_group_;
  LoweredGroup out_;
  std::map<const ir::Value*, int> value_buffer_;
  std::map<const ir::Value*, int> offsets_of_;  // jagged lengths -> the temp holding their offsets
  int error_flag_ = -1;
};

}  // namespace kiln::codegen::emit
