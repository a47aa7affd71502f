// Op identities: one enumerator per op of ir/ops/ops.def. An Op knows its opcode through its
// op-table entry (Op::opcode()); code that asks what an op is compares opcodes, so a misspelled
// op is a compile error, not a silent mismatch at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kiln::ir {

enum class OpCode : uint16_t {
  Unknown,  // an op the table does not list (a test's own op, or a parse of an unknown name)
#define KILN_OP(Name, name) Name,
#include "ir/ops/ops.def"
};

// The number of opcodes, Unknown included.
inline constexpr size_t kNumOpCodes = 1
#define KILN_OP(Name, name) +1
#include "ir/ops/ops.def"
    ;

// "kiln.matmul" for OpCode::Matmul; "" for Unknown.
std::string_view opName(OpCode code);
// The opcode of an op name; Unknown for a name ops.def does not list.
OpCode opCodeOf(std::string_view name);

}  // namespace kiln::ir
