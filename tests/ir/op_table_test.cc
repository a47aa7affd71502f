// The op list (ir/ops/ops.def) and the op table agree, and code outside the table compares ops
// by opcode: no op's name is spelled as a string literal outside ir/ops/, the printer and the
// parser (issue 11: a misspelled name is then a compile error, not a silent mismatch).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "ir/op_def.h"

namespace kiln::ir {
namespace {

TEST(OpTable, EveryOpcodeHasItsDefinition) {
  for (size_t i = 1; i < kNumOpCodes; ++i) {
    const auto code = static_cast<OpCode>(i);
    const OpDef* def = OpRegistry::get().lookup(code);
    ASSERT_NE(def, nullptr) << opName(code) << " is listed in ops.def but has no OpDef";
    EXPECT_EQ(def->name, opName(code));
    EXPECT_EQ(def->opcode, code);
    EXPECT_EQ(opCodeOf(def->name), code);
  }
  EXPECT_EQ(opCodeOf("kiln.no_such_op"), OpCode::Unknown);
}

TEST(OpTable, EveryDefinitionHasAnOpcode) {
  for (const OpDef* def : OpRegistry::get().all()) {
    if (def->name.rfind("test.", 0) == 0) continue;  // ops registered by the tests themselves
    EXPECT_NE(def->opcode, OpCode::Unknown) << def->name << " is registered but not listed in ir/ops/ops.def";
  }
}

TEST(OpTable, OpsKnowTheirOpcode) {
  auto op = Op::create(OpCode::Relu, {}, {});
  EXPECT_EQ(op->name(), "kiln.relu");
  EXPECT_TRUE(op->is(OpCode::Relu));
  EXPECT_TRUE(op->isAnyOf(OpCode::Gelu, OpCode::Relu));
  EXPECT_FALSE(op->isAnyOf(OpCode::Gelu, OpCode::Silu));
  EXPECT_EQ(Op::create("test.unknown", {}, {})->opcode(), OpCode::Unknown);
}

TEST(OpTable, ElementwiseOpsCarryTheirScalarFunction) {
  for (const ScalarFnInfo& f : scalarFns()) {
    if (!f.isOp()) continue;
    const OpDef* def = OpRegistry::get().lookup(opCodeOf(f.fn));
    ASSERT_NE(def, nullptr) << f.spelling;
    EXPECT_EQ(def->name, "kiln." + std::string(f.spelling));
    ASSERT_TRUE(def->scalar_fn.has_value()) << def->name;
    EXPECT_EQ(*def->scalar_fn, f.fn);
    EXPECT_TRUE(def->has(kElementwise)) << def->name;
  }
}

// Source files whose string literals are checked, and the ones allowed to spell op names.
bool allowedToSpellOpNames(const std::string& rel) {
  return rel.rfind("ir/ops/", 0) == 0 || rel.rfind("ir/printer.", 0) == 0 || rel.rfind("ir/parser.", 0) == 0;
}

// The text of a C++ file without its comments (string literals kept).
std::string withoutComments(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '"') {  // a string literal: copied whole, escapes included
      size_t j = i + 1;
      while (j < s.size() && s[j] != '"' && s[j] != '\n') j += s[j] == '\\' ? 2 : 1;
      out.append(s, i, j - i + 1);
      i = j;
    } else if (s.compare(i, 2, "//") == 0) {
      while (i < s.size() && s[i] != '\n') ++i;
      out += '\n';
    } else if (s.compare(i, 2, "/*") == 0) {
      size_t end = s.find("*/", i + 2);
      for (size_t k = i; k < std::min(end, s.size()); ++k)
        if (s[k] == '\n') out += '\n';
      i = end == std::string::npos ? s.size() : end + 1;
    } else {
      out += s[i];
    }
  }
  return out;
}

TEST(OpNames, NoOpNameLiteralOutsideTheOpTable) {
  namespace fs = std::filesystem;
  std::set<std::string> names;
  for (const OpDef* def : OpRegistry::get().all())
    if (def->name.rfind("test.", 0) != 0) names.insert(def->name);
  const fs::path root = KILN_SOURCE_DIR;
  std::vector<std::string> hits;
  size_t files = 0;
  const std::regex literal("\"((?:kiln|func)\\.[a-z_0-9]+)\"");
  for (const char* dir : {"ir", "frontend", "passes", "codegen", "runtime", "tools", "bench"}) {
    for (const auto& entry : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".cc" && ext != ".h")) continue;
      const std::string rel = fs::relative(entry.path(), root).generic_string();
      if (allowedToSpellOpNames(rel)) continue;
      ++files;
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      std::istringstream lines(withoutComments(text.str()));
      std::string line;
      for (int n = 1; std::getline(lines, line); ++n)
        for (std::sregex_iterator m(line.begin(), line.end(), literal), end; m != end; ++m)
          if (names.count((*m)[1].str())) hits.push_back(fmt::format("{}:{}: {}", rel, n, (*m)[0].str()));
    }
  }
  EXPECT_GT(files, 50u) << "the scan found too few source files under " << root;
  std::string list;
  for (const std::string& h : hits) list += "\n  " + h;
  EXPECT_EQ(hits.size(), 0u) << "compare ops by OpCode (op.is(OpCode::X)), not by name:" << list;
}

}  // namespace
}  // namespace kiln::ir
