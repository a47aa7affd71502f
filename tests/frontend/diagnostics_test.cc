// Golden diagnostics: every tests/frontend/errors/*.kiln must fail with exactly the text of its
// .expected file (paths relative to the source tree), and the engine's rendering itself.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "frontend/frontend.h"

namespace kiln::frontend {
namespace {

TEST(Diagnostics, CaretUnderTheColumn) {
  DiagnosticEngine d;
  d.addSource("f.kiln", "line one\n  x = y + z\n");
  d.error(Location{"f.kiln", 2, 7}, "cannot add f32[B,256] and f32[B,128]");
  EXPECT_EQ(d.str(), "f.kiln:2:7: error: cannot add f32[B,256] and f32[B,128]\n  x = y + z\n      ^\n");
  d.warning(Location{"f.kiln", 1, 1}, "w");
  EXPECT_EQ(d.warningCount(), 1);
  EXPECT_EQ(d.errorCount(), 1);
}

TEST(Diagnostics, GoldenErrorFiles) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(KILN_SOURCE_DIR) / "tests/frontend/errors";
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".kiln") continue;
    ++files;
    std::string rel = "tests/frontend/errors/" + entry.path().filename().string();
    std::ifstream in(entry.path());
    std::stringstream ss;
    ss << in.rdbuf();
    DiagnosticEngine d;
    auto m = compileModelSource(rel, ss.str(), {}, d);
    EXPECT_FALSE(m.isOk()) << rel;
    EXPECT_GE(d.errorCount(), 1) << rel;
    for (const auto& diag : d.diagnostics())
      if (diag.severity == Severity::Error) {
        EXPECT_TRUE(diag.loc.known()) << rel << ": " << diag.message;
      }
    fs::path expected_path = entry.path();
    expected_path.replace_extension(".expected");
    std::ifstream ex(expected_path);
    ASSERT_TRUE(ex) << "missing " << expected_path;
    std::stringstream es;
    es << ex.rdbuf();
    EXPECT_EQ(d.str(), es.str()) << rel;
  }
  EXPECT_GE(files, 20);
}

}  // namespace
}  // namespace kiln::frontend
