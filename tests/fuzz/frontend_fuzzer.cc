// libFuzzer harness for the frontend: lexer, parser, and the evaluator that checks and lowers
// a model. Any input must end in diagnostics or a module, never a crash, a hang or a leak.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "frontend/frontend.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::frontend::DiagnosticEngine diags;  // collects, prints nothing
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = kiln::frontend::compileModelSource("fuzz.kiln", text, {}, diags);
  // Formatting every diagnostic exercises the caret rendering on arbitrary lines and columns.
  (void)diags.str();
  return 0;
}
