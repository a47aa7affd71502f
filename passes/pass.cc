#include "passes/pass.h"

#include <fmt/format.h>

#include <algorithm>

namespace kiln::passes {

void PassOptions::set(std::string name, std::string value) {
  for (auto& [k, v] : entries_)
    if (k == name) {
      v = std::move(value);
      return;
    }
  entries_.emplace_back(std::move(name), std::move(value));
}

bool PassOptions::has(std::string_view name) const {
  return std::any_of(entries_.begin(), entries_.end(), [&](const auto& e) { return e.first == name; });
}

const std::string& PassOptions::get(std::string_view name) const {
  static const std::string kUnset;
  for (const auto& [k, v] : entries_)
    if (k == name) return v;
  return kUnset;
}

// A value as the pipeline's text reads it back: quoted when it is empty or holds a space, a
// brace or a quote.
static std::string quoteOptionValue(const std::string& v) {
  bool plain = !v.empty() && v.find_first_of(" \t{}'\"") == std::string::npos;
  if (plain) return v;
  char quote = v.find('\'') == std::string::npos ? '\'' : '"';
  return fmt::format("{}{}{}", quote, v, quote);
}

std::string PassOptions::str() const {
  std::string out;
  for (const auto& [k, v] : entries_)
    out += fmt::format("{}{}={}", out.empty() ? "" : " ", k, quoteOptionValue(v));
  return out;
}

const std::vector<PassInfo>& registeredPasses() {
  static const std::vector<PassInfo> passes = [] {
    std::vector<PassInfo> list = {
#define KILN_PASS(NAME, CLASS, DESCRIPTION) {NAME, DESCRIPTION, &create##CLASS, {}},
#define KILN_PASS_OPTION(PASS, NAME, DEFAULT, DESCRIPTION)
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_OPTION
#undef KILN_PASS_ORDER
    };
    struct Declared {
      std::string_view pass;
      PassOptionInfo option;
    };
    const Declared options[] = {
#define KILN_PASS(NAME, CLASS, DESCRIPTION)
#define KILN_PASS_OPTION(PASS, NAME, DEFAULT, DESCRIPTION) {PASS, {NAME, DEFAULT, DESCRIPTION}},
#define KILN_PASS_ORDER(FIRST, THEN, REASON)
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_OPTION
#undef KILN_PASS_ORDER
    };
    for (const Declared& d : options) {
      auto it = std::find_if(list.begin(), list.end(), [&](const PassInfo& p) { return p.name == d.pass; });
      // An option of a pass passes.def does not list is a typo in passes.def itself.
      if (it != list.end()) it->options.push_back(d.option);
    }
    return list;
  }();
  return passes;
}

const std::vector<PassOrdering>& registeredOrderings() {
  static const std::vector<PassOrdering> orderings = {
#define KILN_PASS(NAME, CLASS, DESCRIPTION)
#define KILN_PASS_OPTION(PASS, NAME, DEFAULT, DESCRIPTION)
#define KILN_PASS_ORDER(FIRST, THEN, REASON) {FIRST, THEN, REASON},
#include "passes/passes.def"
#undef KILN_PASS
#undef KILN_PASS_OPTION
#undef KILN_PASS_ORDER
  };
  return orderings;
}

const PassInfo* findPass(std::string_view name) {
  for (const PassInfo& p : registeredPasses())
    if (p.name == name) return &p;
  return nullptr;
}

std::string knownPassNames() {
  std::string out;
  for (const PassInfo& p : registeredPasses()) out += fmt::format("{}{}", out.empty() ? "" : ", ", p.name);
  return out;
}

Expected<std::unique_ptr<Pass>> createPass(std::string_view name, const PassContext& context,
                                           const PassOptions& options) {
  const PassInfo* info = findPass(name);
  if (!info) return Status::errorf("unknown pass '{}'; known passes: {}", name, knownPassNames());
  PassOptions full;
  for (const auto& [key, value] : options.entries()) {
    bool declared = std::any_of(info->options.begin(), info->options.end(),
                                [&](const PassOptionInfo& o) { return o.name == key; });
    if (declared) continue;
    if (info->options.empty()) return Status::errorf("pass '{}' takes no options (given '{}')", name, key);
    std::string known;
    for (const PassOptionInfo& o : info->options)
      known += fmt::format("{}{}", known.empty() ? "" : ", ", o.name);
    return Status::errorf("pass '{}' has no option '{}'; its options: {}", name, key, known);
  }
  for (const PassOptionInfo& o : info->options)
    full.set(std::string(o.name), options.has(o.name) ? options.get(o.name) : std::string(o.default_value));
  auto pass = info->create(context, full);
  if (!pass) return Status::error(fmt::format("pass '{}': {}", name, pass.status().message()));
  return pass;
}

std::unique_ptr<Pass> createPass(std::string_view name) {
  auto pass = createPass(name, PassContext{});
  return pass ? pass.take() : nullptr;
}

}  // namespace kiln::passes
