#include "frontend/frontend.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "frontend/model_lowering.h"
#include "frontend/parser.h"

namespace kiln::frontend {
namespace {

Expected<std::string> readFile(const std::string& path) {
  std::error_code ec;
  // Only regular files: an import of /dev/zero or a FIFO must not hang the compiler.
  if (!std::filesystem::is_regular_file(path, ec)) return Status::error(fmt::format("'{}' is not a readable file", path));
  if (std::filesystem::file_size(path, ec) > (64u << 20)) return Status::error(fmt::format("'{}' is larger than 64 MiB", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(fmt::format("cannot open '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every file of a compilation: the main one and everything it imports, transitively.
struct Sources {
  std::vector<std::unique_ptr<ast::File>> files;
  std::set<std::string> seen;  // canonical paths
};

void loadImports(const ast::File& file, Sources& src, DiagnosticEngine& diags, int depth) {
  namespace fs = std::filesystem;
  for (const ast::Import& imp : file.imports) {
    fs::path p = fs::path(file.path).parent_path() / imp.path;
    std::error_code ec;
    fs::path canon = fs::weakly_canonical(p, ec);
    std::string key = ec ? p.string() : canon.string();
    if (!src.seen.insert(key).second) continue;  // already loaded (or an import cycle)
    if (depth > 32) {
      diags.error(imp.loc, "imports nest too deeply");
      continue;
    }
    auto text = readFile(p.string());
    if (!text) {
      diags.error(imp.loc, fmt::format("cannot import \"{}\": {}", imp.path, text.status().message()));
      continue;
    }
    auto f = parseFile(p.string(), *text, diags);
    ast::File* raw = f.get();
    src.files.push_back(std::move(f));
    loadImports(*raw, src, diags, depth + 1);
  }
}

}  // namespace

Status addOverride(const std::string& flag, ParamOverrides& overrides) {
  size_t eq = flag.find('=');
  if (eq == std::string::npos || eq == 0)
    return Status::error(fmt::format("--set needs name=value, got '{}'", flag));
  overrides[flag.substr(0, eq)] = flag.substr(eq + 1);
  return Status::ok();
}

Expected<std::unique_ptr<ast::File>> parseModelFile(const std::string& path, DiagnosticEngine& diags) {
  auto text = readFile(path);
  if (!text) {
    diags.error(Location{path, 0, 0}, text.status().message());
    return text.status();
  }
  auto f = parseFile(path, *text, diags);
  if (diags.hasErrors()) return Status::error(fmt::format("{} error(s) in '{}'", diags.errorCount(), path));
  return f;
}

Expected<std::unique_ptr<ir::Module>> compileModelSource(const std::string& path, std::string_view text,
                                                         const ParamOverrides& overrides, DiagnosticEngine& diags) {
  Sources src;
  std::error_code ec;
  src.seen.insert(std::filesystem::weakly_canonical(path, ec).string());
  src.files.push_back(parseFile(path, text, diags));
  const ast::File& main = *src.files.front();
  loadImports(main, src, diags, 0);

  // Functions of every file share one namespace.
  std::map<std::string, const ast::FnDecl*> fns;
  for (const auto& f : src.files)
    for (const auto& fn : f->fns) {
      auto [it, inserted] = fns.insert({fn->name, fn.get()});
      if (!inserted) {
        diags.error(fn->loc, fmt::format("function '{}' is defined twice", fn->name));
        diags.note(it->second->loc, "the first definition is here");
      } else if (findBuiltin(fn->name)) {
        diags.warning(fn->loc, fmt::format("function '{}' hides the builtin of the same name", fn->name));
      }
    }
  if (main.models.size() > 1) diags.error(main.models[1]->loc, "a file defines one model");
  if (main.models.empty() && !diags.hasErrors()) diags.error(Location{path, 0, 0}, "no model in this file");

  std::unique_ptr<ir::Module> m;
  // Lower even after syntax errors in other statements: the parser dropped only the broken
  // ones, and semantic errors in the rest are worth reporting in the same run.
  if (!main.models.empty()) m = ModelLowering(diags, fns, overrides).run(*main.models.front());
  if (diags.hasErrors() || !m)
    return Status::error(fmt::format("{} error(s) in '{}'", std::max(diags.errorCount(), 1), path));
  return m;
}

Expected<std::unique_ptr<ir::Module>> compileModelFile(const std::string& path, const ParamOverrides& overrides,
                                                       DiagnosticEngine& diags) {
  auto text = readFile(path);
  if (!text) {
    diags.error(Location{path, 0, 0}, text.status().message());
    return text.status();
  }
  return compileModelSource(path, *text, overrides, diags);
}

}  // namespace kiln::frontend
