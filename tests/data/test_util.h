// Shared helpers of the data tests: a Criteo model spec and temporary files.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "runtime/data/batch.h"

namespace kiln::data::testing {

inline ir::TensorType tt(ir::DType t, ir::Shape s) { return ir::TensorType(t, std::move(s)); }
inline ir::Dim B() { return ir::Dim::symbol("B"); }

// dense f32[Bx13], label f32[B], and 26 sparse features: feature f has `hot[f]` ids of table
// rows `rows[f]`; odd features hash, even ones take the modulo.
inline std::vector<std::pair<ir::AttrDict, ir::TensorType>> criteoInputs(const std::vector<int>& hot,
                                                                           const std::vector<int64_t>& rows) {
  std::vector<std::pair<ir::AttrDict, ir::TensorType>> in;
  in.push_back({{{"name", "dense"}, {"role", "dense"}}, tt(ir::DType::f32, {B(), ir::Dim::fixed(13)})});
  in.push_back({{{"name", "label"}, {"role", "label"}}, tt(ir::DType::f32, {B()})});
  for (int f = 0; f < kNumSparse; ++f)
    in.push_back({{{"name", "cats." + std::to_string(f)},
                   {"role", "sparse"},
                   {"feature", f},
                   {"rows", rows[static_cast<size_t>(f)]},
                   {"hotness", hot[static_cast<size_t>(f)]},
                   {"id_map", f % 2 ? "hash" : "modulo"}},
                  tt(ir::DType::i64, {B(), ir::Dim::fixed(hot[static_cast<size_t>(f)])})});
  return in;
}

inline BatchSpec criteoSpec(int hot = 1, int64_t rows = 1000) {
  auto s = fromInputs(criteoInputs(std::vector<int>(kNumSparse, hot), std::vector<int64_t>(kNumSparse, rows)));
  EXPECT_TRUE(s.isOk()) << (s ? "" : s.status().str());
  return *s;
}

// A fresh folder under the test's temporary directory, removed at the end.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("kiln_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string write(const std::string& name, const std::string& content) const {
    std::ofstream(file(name), std::ios::binary) << content;
    return file(name);
  }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::filesystem::path path_;
};

inline std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace kiln::data::testing
