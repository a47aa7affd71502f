// The Program: what codegen hands to a runtime. A list of buffers (their types at the bound
// symbol values, their bytes and, for the ones in the arena, their offsets) and, per stream, an
// ordered list of instructions over those buffers. It knows nothing of the IR graph: an
// instruction names its op and carries the op's attributes and types, so a runtime can run it
// (or a later AOT executable can embed it) without the module it came from.
//
// Printable (`kiln dump FILE --stage=program`) and serializable to bytes and back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/attribute.h"
#include "ir/status.h"
#include "ir/types.h"

namespace kiln::codegen {

// What a buffer holds. Inputs and parameters live outside the arena (in the batch and in the
// parameter store); temporaries and outputs live in the arena.
enum class BufferKind : uint8_t { Input, Parameter, Temp, Output };
std::string_view bufferKindName(BufferKind k);

struct Buffer {
  int id = 0;
  BufferKind kind = BufferKind::Temp;
  std::string name;         // the input or parameter name; a readable hint for temporaries
  ir::TensorType type;      // with symbols; bytes are at the bound values
  int64_t bytes = 0;        // size at the bound symbol values (bounded dims at their bound)
  int64_t offset = -1;      // arena offset, -1 outside the arena or before planning
  // Live range over the global instruction order (set by the memory planner): first is the
  // instruction that writes it, last the last that reads it (outputs: the end of the program).
  int first_use = -1, last_use = -1;
  // The buffer whose storage this one writes over (an in-place update), -1 if none.
  int in_place_of = -1;

  bool inArena() const { return kind == BufferKind::Temp || kind == BufferKind::Output; }
};

enum class InstrKind : uint8_t {
  Launch,       // runs one op's computation: operands -> results
  RecordEvent,  // marks `event` done once everything before it on this stream is
  WaitEvent,    // holds this stream until `event` is recorded
  HostStep,     // a step the host runs between kernels, named by `op`
};
std::string_view instrKindName(InstrKind k);

struct Instruction {
  InstrKind kind = InstrKind::Launch;
  // Position in the program's global order: a valid topological order over every stream,
  // which a runtime that runs streams one after another (the CPU) follows.
  int seq = 0;
  std::string op;  // "kiln.matmul" (Launch), a step name (HostStep)
  ir::AttrDict attrs;
  std::vector<int> operands, results;  // buffer ids
  int event = -1;                      // RecordEvent / WaitEvent
};

struct Stream {
  int id = 0;
  std::vector<Instruction> instrs;
};

struct Program {
  std::string function;           // "forward", "train_step"
  ir::SymbolBindings symbols;     // bound before lowering
  std::vector<Buffer> buffers;    // indexed by id
  std::vector<Stream> streams;    // stream 0 first
  std::vector<int> results;       // buffer ids, in the function's result order
  int num_events = 0;
  bool planned = false;           // offsets assigned by the memory planner
  int64_t peak_bytes = 0;         // arena high-water mark of the plan
  int64_t arena_bytes = 0;        // peak rounded up to the arena alignment

  int numInstructions() const;
  // Every instruction in global order (seq), as pointers into the streams.
  std::vector<const Instruction*> ordered() const;
  std::vector<Instruction*> ordered();

  // Human-readable form, one instruction per line.
  std::string str() const;
  // A stable binary encoding (little-endian, versioned) and its inverse.
  std::vector<uint8_t> serialize() const;
  static Expected<Program> deserialize(const uint8_t* data, size_t size);
};

// Rebinds a planned program's symbols (an ahead-of-time Program planned at the largest batch,
// run at a smaller one): every buffer must fit in the bytes the plan gave it, so the arena layout
// stays valid. The shapes the executor derives follow the new values.
Status rebindProgram(Program& p, const ir::SymbolBindings& symbols);

// Structural checks: buffer ids in range, events recorded before they are waited on, every
// buffer read after it is written.
Status validate(const Program& p);

}  // namespace kiln::codegen
