// The kernel IR: what one GPU kernel computes, independent of how it is printed or run.
//
// A Kernel owns pointer parameters (buffers), an expression DAG of scalar computations, and one
// of a few iteration structures:
//   Pointwise  one logical thread per element of `space`; each evaluates its stores.
//   Row        for each element of the outer `space`, phases run over the `row_space`: a Reduce
//              phase folds an expression over the row (sum or max) into a row value that later
//              phases read; a Map phase stores per row element; then `stores` run once per outer
//              element. Reductions, softmax, losses and optimizer row updates are Row kernels.
//   ColumnReduce folds the leading `row_space` of a value for every element of its trailing
//              kept dims (a bias gradient [B, N] -> [N], a whole-tensor sum): a block's threads
//              take consecutive columns, so its reads are coalesced, and the rows are cut into
//              slabs, one per block, whose partials a second ColumnReduce folds in a fixed
//              order (no atomics: the same bits every run).
//   EmbeddingForward     pooled lookups of every table of a collection, in one launch.
//   BagOffsets           exclusive scan of jagged bags' lengths into offsets, one block per table.
//   Source               a body of CUDA C written by its emitter (codegen/emit/moe.cc: routing,
//                        dispatch, grouped GEMM), with its own launch shape: kernels whose
//                        structure (warp selections, scans, tensor-core tiles) no kind above has.
//                        Only the CUDA text runs them (simt on the host, NVRTC on a GPU); the
//                        interpreter refuses them.
//
// Shapes are concrete: a kernel is specialized to the symbol bindings of its run (as XLA
// specializes to static shapes), so index arithmetic is by constants. Floating-point values
// of bf16 storage are computed in f32 (loads widen, stores round to nearest even).
//
// The CUDA emitter (cuda_emitter.h) prints a Kernel as CUDA C++; the interpreter
// (kernel_interpreter.h) runs the same Kernel on the CPU, which is how its math is tested on
// machines without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ir/scalar_fn.h"
#include "ir/types.h"

namespace kiln {
struct Target;
}

namespace kiln::codegen {

using ir::DType;

// An expression node's operation. The scalar functions come first, numbered as ir::ScalarFn
// (ExprOp::Gelu is ScalarFn::Gelu): their meaning is their entry in ir/scalar_fn.def, which the
// interpreter evaluates and the CUDA emitter prints. Binary functions take two operands of one
// type; comparisons and logic give i1.
enum class ExprOp : uint8_t {
#define KILN_EACH(Name, arity) Name,
#include "ir/scalar_fn_each.def"
  // The kernel IR's own nodes.
  Const,      // ivalue (integer and i1 types) or fvalue (float types)
  Coord,      // coordinate `index` of the iteration space (i64); Row kernels number the outer
              // coordinates first, then the row coordinates
  RowValue,   // the result of Reduce phase `index` of a Row kernel
  Load,       // buffers[buffer][a], a: i64 element offset; bf16 widens to f32
  BagOf,      // i64: the jagged bag owning id position a (i64), given the i64 offsets
              // buffers[buffer] of `ivalue` bags (EmbeddingTable::offsets): the b in [0, ivalue)
              // with offsets[b] <= a < offsets[b + 1], found by binary search (empty bags are
              // skipped). A position at or past offsets[ivalue] (padding of a bounded ids buffer)
              // gives ivalue - 1: guard with a < offsets[ivalue] where that matters.
  RoundBf16,  // f32 rounded to the nearest bf16 (a cast to bf16 inside a fused chain)
  Select,     // a ? b : c; only the chosen branch is evaluated (a gather's or concat's loads are
              // guarded this way)
  Cast,       // a converted to `type`
};

constexpr ExprOp exprOpOf(ir::ScalarFn f) { return static_cast<ExprOp>(f); }
// The scalar function of a node, if it is one.
inline std::optional<ir::ScalarFn> scalarFnOf(ExprOp op) {
  if (op >= ExprOp::Const) return std::nullopt;
  return static_cast<ir::ScalarFn>(op);
}

const char* exprOpName(ExprOp op);
bool isUnary(ExprOp op);
bool isBinary(ExprOp op);
bool isComparison(ExprOp op);

struct Expr {
  ExprOp op = ExprOp::Const;
  DType type = DType::f32;  // compute type: f32, f64, i32, i64 or i1
  int32_t a = -1, b = -1, c = -1;
  int32_t buffer = -1;  // Load
  int32_t index = 0;    // Coord, RowValue
  int64_t ivalue = 0;   // Const of an integer or i1 type; BagOf: the number of bags
  double fvalue = 0;    // Const of a float type
  bool operator==(const Expr& o) const = default;
};

// The type arithmetic happens in for values stored as `t`.
DType computeType(DType t);

// A DAG of scalar expressions. Identical nodes are shared (hash-consing), so a value used twice
// is computed once; node ids increase along dependencies.
class ExprGraph {
 public:
  int add(const Expr& e);
  const Expr& operator[](int id) const { return nodes_[static_cast<size_t>(id)]; }
  size_t size() const { return nodes_.size(); }
  const std::vector<Expr>& nodes() const { return nodes_; }

  int constant(double v, DType t);
  int intConstant(int64_t v, DType t = DType::i64);
  int coord(int axis);
  int rowValue(int phase, DType t);
  int load(int buffer, DType storage, int offset);
  int bagOf(int offsets_buffer, int64_t batch, int position);
  int unary(ExprOp op, int x);
  int binary(ExprOp op, int x, int y);
  int select(int cond, int x, int y);
  int cast(int x, DType to);  // returns x itself when it already has type `to`
  DType typeOf(int id) const { return (*this)[id].type; }

 private:
  std::vector<Expr> nodes_;
  std::vector<std::vector<int>> buckets_;  // hash -> node ids
};

// One pointer parameter of a kernel.
struct KernelBuffer {
  std::string name;  // the IR value or state it holds, for comments and error messages
  DType dtype = DType::f32;
  int64_t elements = 0;  // elements the kernel may touch (the allocation's size)
  bool written = false;
};

// buffers[buffer][index] = value, when `guard` (an i1 node, -1 = always) holds. With
// `accumulate`, buffers[buffer][index] += value as one atomic read-modify-write (scatter-adds,
// where several logical threads may hit one element).
struct Store {
  int buffer = -1;
  int index = -1;
  int value = -1;
  int guard = -1;
  bool accumulate = false;
};

using ir::Combiner;  // Sum, Max: scalar_fn.def's KILN_COMBINER entries

struct Phase {
  enum class Kind : uint8_t { Reduce, Map } kind = Kind::Map;
  Combiner combiner = Combiner::Sum;  // Reduce
  int value = -1;                     // Reduce: the folded expression (f32 or f64)
  std::vector<Store> stores;          // Map
};

// One table of an embedding kernel. Buffer fields index Kernel::buffers.
struct EmbeddingTable {
  int weight = -1;   // [rows, dim], f32 or bf16
  int ids = -1;      // [batch, hotness], i32 or i64; jagged: [num_ids]
  int weights = -1;  // optional per-id weights, shaped like ids, f32
  int64_t rows = 0, dim = 0, hotness = 0;
  // Jagged bags (TorchRec's KeyedJaggedTensor layout): bag b owns ids [offsets[b], offsets[b+1]).
  // `offsets` is i64 [batch + 1], computed on the device from the i32/i64 `lengths` [batch] by a
  // BagOffsets kernel; hotness is 0 then. num_ids is the ids buffer's size (a bounded dim's
  // bound); a batch may use fewer, the rest is never read.
  int lengths = -1, offsets = -1;
  int64_t num_ids = 0;
  bool jagged() const { return offsets >= 0; }
  bool mean = false;
  // The pooled [batch, dim] output written at out[b * out_stride + out_offset + d], so one
  // output buffer can hold the concatenation of several tables.
  int out = -1;
  int64_t out_stride = 0, out_offset = 0;
  // What the kernel writes as `table` in the error flag: a group-wide number
  // (LoweredGroup::error_subjects), so kernels sharing one flag name the right table.
  int flag_index = -1;
};

enum class KernelKind : uint8_t {
  Pointwise,
  Row,
  ColumnReduce,
  EmbeddingForward,
  BagOffsets,
  Source
};
const char* kernelKindName(KernelKind k);

// The SMs grids are sized for when no GPU target is given: the default GPU target's
// (h200Target(), 132 SMs).
int defaultGridSms();
// The SMs grids are sized for on `target`: its SMs (Target::cores) on a GPU, else the default's.
int gridSms(const Target& target);
// One full wave: the blocks of `block` threads that `sms` SMs hold at once when threads are the
// limit (blocksPerSm without registers or shared memory: 2048 / block, at most 32, an SM).
int64_t waveBlocks(int sms, int block);

struct Kernel {
  std::string name;  // a readable stem ("add_relu"); the emitter appends a content hash
  KernelKind kind = KernelKind::Pointwise;
  std::vector<KernelBuffer> buffers;
  ExprGraph exprs;
  // ColumnReduce: `space` is [slabs, kept dims...] and `row_space` the folded dims (coordinates:
  // the slab, the kept dims, then the rows, as a Row kernel numbers them); slab s folds rows
  // [s * slab_rows, (s + 1) * slab_rows) of every column into the one Reduce phase's row value,
  // then runs `stores` once per (slab, column).
  std::vector<int64_t> space;      // Pointwise: the index space; Row: the outer space
  std::vector<int64_t> row_space;  // Row, ColumnReduce
  std::vector<Phase> phases;       // Row; ColumnReduce: one Reduce phase
  std::vector<Store> stores;       // Pointwise: per element; Row: per outer element
  int guard = -1;                  // Row: an outer element runs only where this holds
  // Embedding kernels.
  int64_t batch = 0;
  std::vector<EmbeddingTable> tables;
  // i32 [2]: {1, table} when an id is out of range; {2, table} when a jagged table's lengths
  // are negative or add up to more than its ids buffer holds (BagOffsets). `table` is the
  // table's flag_index, numbered across the group: the kernels of a group share one flag. The
  // first error wins. Embedding kernels and scans set it themselves; a Row kernel that checks
  // ids (an embedding weight gradient) stores {1, table} in its epilogue, guarded by a bad id
  // and a clear flag (every writer of one kernel writes the same two values).
  int error_flag = -1;
  // Source: the function body over the parameters b0, b1, ... (typed as `buffers`), launched
  // <<<grid, block>>>. Its shape constants are baked into the text, as the other kinds' are.
  std::string source;
  int64_t grid = 1;
  int block = 256;
  // Source: __launch_bounds__'s second argument when positive: blocks an SM must fit at once,
  // which caps the registers a thread may use at 64K / (block * min_blocks_per_sm).
  int min_blocks_per_sm = 0;
  // Pointwise, Row, ColumnReduce: the SMs of the GPU the grid is sized for (gridSms of the
  // lowering's target). launchConfig (cuda_emitter.h) stops their grids at a few full waves.
  int sms = defaultGridSms();

  int addBuffer(std::string name, DType dtype, int64_t elements, bool written = false);
  int64_t spaceSize() const;
  int64_t rowSize() const;
};

// How a ColumnReduce kernel's 256-thread block is laid out: `lanes` consecutive columns (the
// kept elements, up to 32: a warp reads 128 contiguous bytes of a row) by `groups` = 256 / lanes
// row groups; row group g folds rows g, g + groups, ... of its slab, then the groups' partials
// are combined as a tree (group g with g + half, half = groups / 2, ..., 1). The interpreter
// folds in this order too, so both give the bits the GPU gives.
struct ColumnTile {
  static constexpr int kThreads = 256;
  int lanes = 1, groups = kThreads;
  int64_t slabs = 1, columns = 1, strips = 1, slab_rows = 1;  // strips: ceil(columns / lanes)
};
ColumnTile columnTile(const Kernel& k);

// Checks a kernel's internal consistency (operand ids, types, coordinates in scope, buffer
// indices); the lowering and the tests call it. An error names the kernel.
Status validate(const Kernel& k);

// The flat element offset of `coords` (node ids) in a row-major shape, as an expression.
int rowMajorOffset(ExprGraph& g, const std::vector<int>& coords, const std::vector<int64_t>& shape);

}  // namespace kiln::codegen
