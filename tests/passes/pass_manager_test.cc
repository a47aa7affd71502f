// The PassManager: pipelines by name, disabling, ordering rules, the verifier between passes,
// printing, dumping and timing.
#include "passes/pass_manager.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "ir/builder.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "passes/pipeline.h"

namespace kiln::passes {
namespace {

constexpr const char* kInput =
    "func.func @f(%x: !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32> {\n"
    "  %a = \"kiln.relu\"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>\n"
    "  %b = \"kiln.relu\"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>\n"
    "  %dead = \"kiln.exp\"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>\n"
    "  %s = \"kiln.add\"(%a, %b) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>\n"
    "  return %s : !kiln.tensor<Bx4xf32>\n"
    "}\n";

std::unique_ptr<ir::Module> input() {
  auto m = ir::parseModule(kInput, "in.mlir");
  EXPECT_TRUE(m.isOk()) << m.status().str();
  return m.take();
}

// A pass made up for a test: a name and what it does to the module.
class LambdaPass : public Pass {
 public:
  LambdaPass(std::string name, std::function<Expected<bool>(ir::Module&)> fn)
      : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return "test pass"; }
  Expected<bool> run(ir::Module& m) override { return fn_(m); }

 private:
  std::string name_;
  std::function<Expected<bool>(ir::Module&)> fn_;
};

std::unique_ptr<Pass> noop(std::string name, std::vector<std::string>* trace = nullptr) {
  return std::make_unique<LambdaPass>(name, [name, trace](ir::Module&) -> Expected<bool> {
    if (trace) trace->push_back(name);
    return false;
  });
}

TEST(PassManager, RegistryListsEveryPassOnce) {
  std::set<std::string_view> names;
  for (const PassInfo& p : registeredPasses()) {
    EXPECT_TRUE(names.insert(p.name).second) << "twice: " << p.name;
    EXPECT_FALSE(p.description.empty()) << p.name;
    auto pass = createPass(p.name);
    ASSERT_NE(pass, nullptr) << p.name;
    EXPECT_EQ(pass->name(), p.name);  // the class's name is the passes.def name
    EXPECT_EQ(pass->description(), p.description);
  }
  for (std::string_view core : {"canonicalize", "cse", "dce", "shape-inference"})
    EXPECT_TRUE(names.count(core)) << core;
  EXPECT_EQ(createPass("no-such-pass"), nullptr);
}

TEST(PassManager, RunsAPipelineByName) {
  auto m = input();
  PassManager pm;
  ASSERT_TRUE(pm.addPipeline("cse, dce").isOk());
  EXPECT_EQ(pm.pipeline(), (std::vector<std::string>{"cse", "dce"}));
  auto changed = pm.run(*m);
  ASSERT_TRUE(changed.isOk()) << changed.status().str();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(m->lookup("f")->numOps(), 3u);  // relu, add, return
  // Running again changes nothing.
  auto again = pm.run(*m);
  ASSERT_TRUE(again.isOk());
  EXPECT_FALSE(*again);
}

TEST(PassManager, UnknownPassNamesAreErrors) {
  PassManager pm;
  Status s = pm.addPipeline("cse,typo");
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("unknown pass 'typo'; known passes: shape-inference, canonicalize, cse, dce"),
            std::string::npos)
      << s.message();
  EXPECT_FALSE(pm.addPipeline("cse,,dce").isOk());
  PassManager pm2;
  pm2.options().disabled.insert("nope");
  EXPECT_NE(pm2.build().message().find("--disable-pass: unknown pass 'nope'"), std::string::npos);
}

TEST(PassManager, DisabledPassesDoNotRun) {
  std::vector<std::string> trace;
  PassManager pm;
  pm.addPass(noop("a", &trace));
  pm.addPass(noop("b", &trace));
  pm.addPass(noop("a", &trace));
  pm.options().disabled.insert("a");
  auto m = input();
  ASSERT_TRUE(pm.run(*m).isOk());
  EXPECT_EQ(trace, (std::vector<std::string>{"b"}));
}

TEST(PassManager, OrderingRulesAreCheckedWhenBuilt) {
  PassManager pm;
  pm.requireBefore("first", "then", "then undoes first");
  pm.addPass(noop("then"));
  pm.addPass(noop("first"));
  Status s = pm.build();
  ASSERT_FALSE(s.isOk());
  EXPECT_EQ(s.message(),
            "pass 'first' (position 2) must not run after 'then' (position 1): then undoes first");
  auto m = input();
  EXPECT_FALSE(pm.run(*m).isOk());
  // Disabling either pass lifts the rule.
  pm.options().disabled.insert("first");
  EXPECT_TRUE(pm.build().isOk());
  // The right order is fine, and so is a pipeline with only one of the two.
  PassManager ok;
  ok.requireBefore("first", "then");
  ok.addPass(noop("first"));
  ok.addPass(noop("then"));
  EXPECT_TRUE(ok.build().isOk());
}

TEST(PassManager, PassesDefOrderingsApplyByDefault) {
  // passes.def says cse must not run after remat.
  bool found = false;
  for (const PassOrdering& o : registeredOrderings()) found |= (o.first == "cse" && o.then == "remat");
  ASSERT_TRUE(found);
  PassManager pm;
  pm.addPass(noop("remat"));
  ASSERT_TRUE(pm.addPass("cse").isOk());
  Status s = pm.build();
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("pass 'cse' (position 2) must not run after 'remat' (position 1)"),
            std::string::npos);
}

TEST(PassManager, VerifierNamesThePassThatBrokeTheIR) {
  PassManager pm;
  ASSERT_TRUE(pm.addPass("cse").isOk());
  pm.addPass(std::make_unique<LambdaPass>("breaker", [](ir::Module& m) -> Expected<bool> {
    // Gives the add a result type its operands cannot produce.
    ir::Op* add = nullptr;
    m.lookup("f")->walk([&](ir::Op& op) { add = op.name() == "kiln.add" ? &op : add; });
    add->result()->setType(add->result()->type().withDType(ir::DType::f16));
    return true;
  }));
  ASSERT_TRUE(pm.addPass("dce").isOk());
  auto m = input();
  auto r = pm.run(*m);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().str(),
            "in.mlir:5:3: error: pass 'breaker' produced invalid IR: in @f: 'kiln.add' result #0 has type "
            "!kiln.tensor<Bx4xf16> but its operands give !kiln.tensor<Bx4xf32>");
}

TEST(PassManager, PassErrorsNameThePass) {
  PassManager pm;
  pm.addPass(std::make_unique<LambdaPass>("failing", [](ir::Module&) -> Expected<bool> {
    return Status::error("cannot do it", Location{"in.mlir", 2, 3});
  }));
  auto m = input();
  auto r = pm.run(*m);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().str(), "in.mlir:2:3: error: in pass 'failing': cannot do it");
}

TEST(PassManager, InvalidInputIsReportedBeforeAnyPass) {
  std::vector<std::string> trace;
  PassManager pm;
  pm.addPass(noop("a", &trace));
  ir::Module m;
  m.addFunction("f");  // no return
  auto r = pm.run(m);
  ASSERT_FALSE(r.isOk());
  EXPECT_NE(r.status().message().find("the input IR is invalid"), std::string::npos);
  EXPECT_TRUE(trace.empty());
}

TEST(PassManager, PrintsAfterChosenPasses) {
  std::ostringstream log;
  PassManager pm;
  ASSERT_TRUE(pm.addPipeline("cse,dce").isOk());
  pm.options().print_ir_after.insert("cse");
  pm.options().log = &log;
  auto m = input();
  ASSERT_TRUE(pm.run(*m).isOk());
  std::string text = log.str();
  EXPECT_EQ(text.find("// -----// IR Dump After cse //----- //\nmodule {\n"), 0u) << text;
  EXPECT_EQ(text.find("IR Dump After dce"), std::string::npos);
  EXPECT_NE(text.find("%dead"), std::string::npos);  // dce had not run yet

  std::ostringstream all;
  PassManager pm2;
  ASSERT_TRUE(pm2.addPipeline("cse,dce").isOk());
  pm2.options().print_ir_after_all = true;
  pm2.options().log = &all;
  auto m2 = input();
  ASSERT_TRUE(pm2.run(*m2).isOk());
  EXPECT_LT(all.str().find("IR Dump After cse"), all.str().find("IR Dump After dce"));
}

TEST(PassManager, DumpsEveryStageInOrder) {
  std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "kiln_dump_test";
  std::filesystem::remove_all(dir);
  PassManager pm;
  ASSERT_TRUE(pm.addPipeline("cse,dce,cse").isOk());
  pm.options().dump_dir = dir.string();
  auto m = input();
  ASSERT_TRUE(pm.run(*m).isOk());
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files,
            (std::vector<std::string>{"0000.input.mlir", "0001.cse.mlir", "0002.dce.mlir", "0003.cse.mlir"}));
  auto read = [&](const std::string& name) {
    std::ifstream in(dir / name);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  // Each file is the module after that pass, and parses back.
  EXPECT_NE(read("0000.input.mlir").find("%b = \"kiln.relu\""), std::string::npos);
  EXPECT_EQ(read("0001.cse.mlir").find("%b = \"kiln.relu\""), std::string::npos);
  EXPECT_NE(read("0001.cse.mlir").find("%dead"), std::string::npos);
  EXPECT_EQ(read("0002.dce.mlir").find("%dead"), std::string::npos);
  EXPECT_EQ(read("0003.cse.mlir"), ir::printModule(*m));
  EXPECT_TRUE(ir::parseModule(read("0002.dce.mlir")).isOk());
  std::filesystem::remove_all(dir);
}

TEST(PassManager, TimingTableListsEachPass) {
  std::ostringstream log;
  PassManager pm;
  ASSERT_TRUE(pm.addPipeline("cse,dce").isOk());
  pm.options().timing = true;
  pm.options().log = &log;
  auto m = input();
  ASSERT_TRUE(pm.run(*m).isOk());
  std::string t = log.str();
  size_t cse = t.find("yes      cse"), dce = t.find("yes      dce"), total = t.find("Total");
  EXPECT_NE(t.find("Pass execution timing report"), std::string::npos) << t;
  ASSERT_NE(cse, std::string::npos) << t;
  ASSERT_NE(dce, std::string::npos) << t;
  EXPECT_LT(cse, dce);
  EXPECT_LT(dce, total);
}

// The pipeline text in MLIR's syntax: comma-separated names, options in braces.
TEST(PipelineText, ParsesNamesAndOptions) {
  EXPECT_TRUE(parsePipeline("")->empty());
  EXPECT_TRUE(parsePipeline("  ")->empty());
  auto p = parsePipeline("remat{budget=60%},fusion");
  ASSERT_TRUE(p) << p.status().message();
  ASSERT_EQ(p->size(), 2u);
  EXPECT_EQ((*p)[0].name, "remat");
  EXPECT_EQ((*p)[0].options.get("budget"), "60%");
  EXPECT_EQ((*p)[0].column, 1u);
  EXPECT_EQ((*p)[1].name, "fusion");
  EXPECT_TRUE((*p)[1].options.empty());
  EXPECT_EQ((*p)[1].column, 19u);
  // Spaces around names, braces and options; a value keeps its commas (a list) unless quoted
  // text holds spaces or braces.
  auto q = parsePipeline(" cse , p{ a=1  b='x y' c=\"q}\" list=1,2,3 } ,dce ");
  ASSERT_TRUE(q) << q.status().message();
  ASSERT_EQ(q->size(), 3u);
  const PassOptions& o = (*q)[1].options;
  EXPECT_EQ(o.entries().size(), 4u);
  EXPECT_EQ(o.get("a"), "1");
  EXPECT_EQ(o.get("b"), "x y");
  EXPECT_EQ(o.get("c"), "q}");
  EXPECT_EQ(o.get("list"), "1,2,3");
  EXPECT_EQ((*q)[2].name, "dce");
  // An entry prints as it parses.
  EXPECT_EQ((*q)[1].str(), "p{a=1 b='x y' c='q}' list=1,2,3}");
  auto again = parsePipeline((*q)[1].str());
  ASSERT_TRUE(again);
  EXPECT_EQ((*again)[0].options.entries(), o.entries());
  EXPECT_EQ((*q)[0].str(), "cse");
}

TEST(PipelineText, MalformedTextPointsAtTheColumn) {
  auto error = [](std::string_view text) {
    auto p = parsePipeline(text);
    return p ? std::string("(parsed)") : p.status().message();
  };
  EXPECT_EQ(error("cse,,dce"), "malformed pipeline at column 5: expected a pass name\n  cse,,dce\n      ^");
  auto starts = [&](std::string_view text, std::string_view prefix) {
    std::string m = error(text);
    EXPECT_EQ(m.rfind(prefix, 0), 0u) << "'" << text << "': " << m;
  };
  starts("cse,", "malformed pipeline at column 5: expected a pass name at the end");
  starts(",cse", "malformed pipeline at column 1: expected a pass name");
  starts("cse dce", "malformed pipeline at column 5: expected ',' between passes after 'cse'");
  starts("remat{budget=60%", "malformed pipeline at column 6: the options of 'remat' have no closing '}'");
  starts("remat{budget}", "malformed pipeline at column 13: expected '=' after option 'budget'");
  starts("remat{budget=}", "malformed pipeline at column 14: expected a value for option 'budget'");
  starts("remat{=60%}",
         "malformed pipeline at column 7: expected an option name or '}' in the options of 'remat'");
  starts("remat{budget=1 budget=2}",
         "malformed pipeline at column 16: option 'budget' of 'remat' is given twice");
  starts("remat{budget='60%}", "malformed pipeline at column 14: the value of 'budget' has no closing '");
  starts("remat{budget=60%}}", "malformed pipeline at column 18: expected ',' between passes after 'remat'");
  starts("cse;dce", "malformed pipeline at column 4: expected ',' between passes after 'cse'");
}

TEST(PipelineText, OptionsAreCheckedAgainstPassesDef) {
  const PassInfo* remat = findPass("remat");
  ASSERT_NE(remat, nullptr);
  ASSERT_EQ(remat->options.size(), 1u);
  EXPECT_EQ(remat->options[0].name, "budget");
  EXPECT_EQ(remat->options[0].default_value, "");
  EXPECT_FALSE(remat->options[0].description.empty());
  PassManager pm;
  EXPECT_TRUE(pm.addPipeline("cse,remat{budget=60%},remat{budget=123456},remat").isOk());
  EXPECT_EQ(pm.pipeline(), (std::vector<std::string>{"cse", "remat", "remat", "remat"}));
  EXPECT_EQ(pm.addPipeline("remat{budgt=60%}").message(),
            "pass 'remat' has no option 'budgt'; its options: budget");
  EXPECT_EQ(pm.addPipeline("cse{x=1}").message(), "pass 'cse' takes no options (given 'x')");
  EXPECT_EQ(pm.addPipeline("remat{budget=60pc}").message(),
            "pass 'remat': option 'budget': expected bytes or a percentage such as 60%, got '60pc'");
  EXPECT_NE(pm.addPipeline("remat{budget=60%},typo").message().find("unknown pass 'typo'"),
            std::string::npos);
  auto made = createPass("remat", PassContext{}, {});
  ASSERT_TRUE(made) << made.status().message();
  EXPECT_EQ((*made)->name(), "remat");
}

TEST(PipelineText, PassesAreBuiltForTheManagersTarget) {
  EXPECT_EQ(PassManager().context().target.name, "cpu");
  PassManager pm({.target = h200Target()});
  EXPECT_EQ(pm.context().target.name, "h200");
}

TEST(PipelineText, TheDefaultPipelineCarriesTheMemoryBudget) {
  EXPECT_EQ(defaultPipeline(false), "canonicalize,cse,dce");
  EXPECT_EQ(defaultPipeline(true),
            "canonicalize,cse,dce,mixed-precision,autodiff,canonicalize,cse,dce,remat,fusion,schedule");
  EXPECT_EQ(
      defaultPipeline(true, "60%"),
      "canonicalize,cse,dce,mixed-precision,autodiff,canonicalize,cse,dce,remat{budget=60%},fusion,schedule");
  EXPECT_EQ(pipelineUpTo(true, "fusion", "1000"),
            "canonicalize,cse,dce,mixed-precision,autodiff,canonicalize,cse,dce,remat{budget=1000}");
  PassManager pm;
  EXPECT_TRUE(pm.addPipeline(defaultPipeline(true, "60%")).isOk());
}

}  // namespace
}  // namespace kiln::passes
