#include "ir/opcode.h"

#include <array>
#include <map>

namespace kiln::ir {
namespace {

constexpr std::array kNames = {
    std::string_view(),
#define KILN_OP(Name, name) std::string_view(name),
#include "ir/ops/ops.def"
};

}  // namespace

std::string_view opName(OpCode code) { return kNames[static_cast<size_t>(code)]; }

OpCode opCodeOf(std::string_view name) {
  static const std::map<std::string_view, OpCode> by_name = [] {
    std::map<std::string_view, OpCode> m;
    for (size_t i = 1; i < kNames.size(); ++i) m.emplace(kNames[i], static_cast<OpCode>(i));
    return m;
  }();
  auto it = by_name.find(name);
  return it == by_name.end() ? OpCode::Unknown : it->second;
}

}  // namespace kiln::ir
