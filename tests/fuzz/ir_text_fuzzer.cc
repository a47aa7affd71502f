// libFuzzer harness for the IR text parser (ir/parser.h), as `kiln opt --split-input-file` reads
// a file: each `// -----` chunk on its own. A chunk must parse into verified IR or give a located
// error (rendered with its caret), never a crash, a hang or a leak. IR that parses must print,
// the printed text must parse again, and printing that gives the same text.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "ir/diagnostic.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"

namespace {

void check(bool ok, const char* what, const std::string& detail = "") {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant violated: %s\n%s\n", what, detail.c_str());
    std::abort();
  }
}

void parseChunk(std::string_view text) {
  using namespace kiln;
  auto m = ir::parseModule(text, "fuzz.mlir");
  if (!m) {
    (void)formatDiagnostic(m.status(), text);
    return;
  }
  Status verified = ir::verify(**m);
  check(verified.isOk(), "parsed IR verifies", verified.isOk() ? "" : verified.str());
  std::string printed = ir::printModule(**m);
  auto again = ir::parseModule(printed, "printed.mlir");
  check(again.isOk(), "printed IR parses again", again ? "" : again.status().str() + "\n" + printed);
  std::string reprinted = ir::printModule(**again);
  check(reprinted == printed, "printing reparsed IR gives the same text", printed + "\n----\n" + reprinted);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  // Split on lines starting with `// -----`, as `kiln opt --split-input-file` does.
  size_t chunk = 0, line = 0;
  while (line <= text.size()) {
    size_t eol = text.find('\n', line);
    size_t next = eol == std::string_view::npos ? text.size() + 1 : eol + 1;
    if (text.substr(line, 8) == "// -----") {
      parseChunk(text.substr(chunk, line - chunk));
      chunk = std::min(next, text.size());
    }
    line = next;
  }
  parseChunk(text.substr(chunk));
  return 0;
}
