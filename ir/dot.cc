#include "ir/dot.h"

#include <fmt/format.h>

#include <sstream>
#include <unordered_map>

#include "ir/printer.h"

namespace kiln::ir {
namespace {

// A DOT double-quoted string: only '"' and '\' need escaping (and newlines).
std::string dotQuote(std::string_view s) {
  std::string out(1, '"');
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  out += '"';
  return out;
}

class DotWriter {
 public:
  DotWriter(const Function& f, std::ostream& os) : f_(f), os_(os), namer_(f) {}

  void write() {
    os_ << "digraph " << dotQuote(f_.name()) << " {\n";
    os_ << "  node [shape=box, fontname=\"monospace\"];\n";
    const Block& entry = f_.entry();
    for (Value* a : entry.arguments()) {
      std::string id = fmt::format("arg{}", a->index());
      ids_[a] = id;
      os_ << "  " << id
          << " [shape=ellipse, label=" << dotQuote(fmt::format("{}\n{}", namer_.name(a), a->type().str()))
          << "];\n";
    }
    nodes(entry, 1);
    for (const Edge& e : edges_)
      os_ << "  " << e.from << " -> " << e.to << " [label=" << dotQuote(e.label) << "];\n";
    os_ << "}\n";
  }

 private:
  struct Edge {
    std::string from, to, label;
  };

  void pad(int depth) {
    for (int i = 0; i < depth; ++i) os_ << "  ";
  }

  void nodes(const Block& b, int depth) {
    for (const auto& op_ptr : b.ops()) {
      const Op& op = *op_ptr;
      std::string id = fmt::format("op{}", next_id_++);
      std::string label = op.name();
      for (Value* r : op.results()) label += fmt::format("\n{}", r->type().str());
      if (op.regions().empty()) {
        pad(depth);
        os_ << id << " [label=" << dotQuote(label) << "];\n";
      } else {
        // The holder op is a node too, so that edges into and out of the group have an end.
        pad(depth);
        os_ << "subgraph cluster_" << id << " {\n";
        pad(depth + 1);
        os_ << "label=" << dotQuote(op.name()) << ";\n";
        pad(depth + 1);
        os_ << id << " [label=" << dotQuote(label) << ", style=bold];\n";
        for (const auto& r : op.regions())
          for (const auto& blk : r->blocks()) {
            for (Value* a : blk->arguments()) ids_[a] = id;
            nodes(*blk, depth + 1);
          }
        pad(depth);
        os_ << "}\n";
      }
      for (Value* v : op.operands()) {
        auto it = ids_.find(v);
        if (it != ids_.end()) edges_.push_back({it->second, id, namer_.name(v)});
      }
      for (Value* r : op.results()) ids_[r] = id;
    }
  }

  const Function& f_;
  std::ostream& os_;
  ValueNamer namer_;
  std::unordered_map<const Value*, std::string> ids_;
  std::vector<Edge> edges_;
  int next_id_ = 0;
};

}  // namespace

void functionToDot(const Function& f, std::ostream& os) { DotWriter(f, os).write(); }

std::string functionToDot(const Function& f) {
  std::ostringstream os;
  functionToDot(f, os);
  return os.str();
}

}  // namespace kiln::ir
