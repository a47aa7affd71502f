#include "passes/plan_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>

#include "passes/auto_plan.h"

namespace kiln::passes {
namespace {

// A JSON value with the byte offset where it starts. nlohmann's parser keeps no positions, and
// every plan error must point at its entry, so plan files are read by this small parser.
struct Node {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  size_t offset = 0;
  bool b = false;
  double num = 0;
  bool integral = false;
  std::string str;
  std::vector<Node> items;                           // Array
  std::vector<std::pair<std::string, Node>> fields;  // Object, in file order
  const Node* field(std::string_view k) const {
    for (const auto& f : fields)
      if (f.first == k) return &f.second;
    return nullptr;
  }
};

class Parser {
 public:
  Parser(std::string_view text, std::string_view file) : text_(text), file_(file) {}

  // The line and column of a byte offset, by a binary search of the lines' starts (found once):
  // every table entry's location is taken, and a scan from the file's start for each made a plan
  // of 40000 entries take 90 s before it reported an error at its fifth.
  Location at(size_t offset) const {
    if (line_starts_.empty()) {
      line_starts_.push_back(0);
      for (size_t i = 0; i < text_.size(); ++i)
        if (text_[i] == '\n') line_starts_.push_back(i + 1);
    }
    offset = std::min(offset, text_.size());
    const auto line = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) - 1;
    return Location{std::string(file_), static_cast<int>(line - line_starts_.begin()) + 1,
                    static_cast<int>(offset - *line) + 1};
  }
  Status error(size_t offset, std::string msg) const { return Status::error(std::move(msg), at(offset)); }

  Expected<Node> document() {
    KILN_ASSIGN_OR_RETURN(Node n, value(0));
    skip();
    if (pos_ != text_.size()) return error(pos_, "malformed JSON: text after the plan's object");
    return n;
  }

 private:
  void skip() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool literal(std::string_view w) {
    if (text_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }

  Expected<Node> value(int depth) {
    skip();
    if (depth > 64) return error(pos_, "malformed JSON: nested too deeply");
    Node n;
    n.offset = pos_;
    if (pos_ >= text_.size()) return error(pos_, "malformed JSON: unexpected end of file");
    char c = text_[pos_];
    if (c == '{') {
      n.kind = Node::Kind::Object;
      ++pos_;
      skip();
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        return n;
      }
      for (;;) {
        skip();
        if (pos_ >= text_.size() || text_[pos_] != '"')
          return error(pos_, "malformed JSON: expected a field name");
        KILN_ASSIGN_OR_RETURN(std::string key, string());
        skip();
        if (pos_ >= text_.size() || text_[pos_] != ':') return error(pos_, "malformed JSON: expected ':'");
        ++pos_;
        KILN_ASSIGN_OR_RETURN(Node v, value(depth + 1));
        n.fields.emplace_back(std::move(key), std::move(v));
        skip();
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < text_.size() && text_[pos_] == '}') {
          ++pos_;
          return n;
        }
        return error(pos_, "malformed JSON: expected ',' or '}'");
      }
    }
    if (c == '[') {
      n.kind = Node::Kind::Array;
      ++pos_;
      skip();
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
        return n;
      }
      for (;;) {
        KILN_ASSIGN_OR_RETURN(Node v, value(depth + 1));
        n.items.push_back(std::move(v));
        skip();
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < text_.size() && text_[pos_] == ']') {
          ++pos_;
          return n;
        }
        return error(pos_, "malformed JSON: expected ',' or ']'");
      }
    }
    if (c == '"') {
      n.kind = Node::Kind::String;
      KILN_ASSIGN_OR_RETURN(n.str, string());
      return n;
    }
    if (literal("true")) {
      n.kind = Node::Kind::Bool;
      n.b = true;
      return n;
    }
    if (literal("false")) {
      n.kind = Node::Kind::Bool;
      return n;
    }
    if (literal("null")) return n;
    if (c == '-' || (c >= '0' && c <= '9')) {
      size_t b = pos_;
      if (text_[pos_] == '-') ++pos_;
      bool frac = false;
      while (pos_ < text_.size()) {
        char d = text_[pos_];
        if (d >= '0' && d <= '9') {
          ++pos_;
        } else if (d == '.' || d == 'e' || d == 'E' || d == '+' || d == '-') {
          frac = true;
          ++pos_;
        } else {
          break;
        }
      }
      std::string num(text_.substr(b, pos_ - b));
      char* end = nullptr;
      n.num = std::strtod(num.c_str(), &end);
      if (end != num.c_str() + num.size() || num == "-")
        return error(b, fmt::format("malformed JSON: bad number '{}'", num));
      n.kind = Node::Kind::Number;
      n.integral = !frac && std::fabs(n.num) < 9.0e15;
      return n;
    }
    return error(pos_, fmt::format("malformed JSON: unexpected '{}'", c));
  }

  // A string at pos_ (on its opening quote). Plan names are plain; escapes are decoded for the
  // ASCII range and a \u beyond it is kept as written.
  Expected<std::string> string() {
    size_t b = pos_++;
    std::string out;
    while (pos_ < text_.size()) {
      char c = text_[pos_++];
      if (c == '"') return out;
      if (c == '\n') break;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) break;
      char e = text_[pos_++];
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'u': {
          if (pos_ + 4 > text_.size()) return error(pos_ - 2, "malformed JSON: bad \\u escape");
          unsigned v =
              static_cast<unsigned>(std::strtoul(std::string(text_.substr(pos_, 4)).c_str(), nullptr, 16));
          if (v < 0x80)
            out += static_cast<char>(v);
          else
            out += "\\u" + std::string(text_.substr(pos_, 4));
          pos_ += 4;
          break;
        }
        default:
          out += e;
      }
    }
    return error(b, "malformed JSON: unterminated string");
  }

  std::string_view text_, file_;
  size_t pos_ = 0;
  mutable std::vector<size_t> line_starts_;  // the offset of each line's first byte
};

const char* kindName(Node::Kind k) {
  switch (k) {
    case Node::Kind::Null:
      return "null";
    case Node::Kind::Bool:
      return "a boolean";
    case Node::Kind::Number:
      return "a number";
    case Node::Kind::String:
      return "a string";
    case Node::Kind::Array:
      return "a list";
    case Node::Kind::Object:
      return "an object";
  }
  return "?";
}

Expected<int> intField(const Parser& p, const Node& n, std::string_view what) {
  if (n.kind != Node::Kind::Number || !n.integral)
    return p.error(n.offset, fmt::format("{} must be an integer, got {}", what, kindName(n.kind)));
  if (n.num < -1e9 || n.num > 1e9) return p.error(n.offset, fmt::format("{} is out of range", what));
  return static_cast<int>(n.num);
}

std::string quote(const std::string& s) { return nlohmann::json(s).dump(); }

// One "tables" entry: its table, sharding and ranks (in [0, nranks)). A plan's entry must list
// ranks for every type but data_parallel; a constraint's may leave them to the planner.
Expected<TablePlan> parseEntry(const Parser& p, const Node& e, int nranks, bool require_ranks) {
  if (e.kind != Node::Kind::Object)
    return p.error(e.offset, fmt::format("a table entry must be an object, got {}", kindName(e.kind)));
  TablePlan t;
  t.loc = p.at(e.offset);
  const Node* name = e.field("table");
  if (!name || name->kind != Node::Kind::String)
    return p.error(name ? name->offset : e.offset, "a table entry needs \"table\": the table's name");
  t.table = name->str;
  const Node* sharding = e.field("sharding");
  if (!sharding || sharding->kind != Node::Kind::String)
    return p.error(sharding ? sharding->offset : e.offset,
                   fmt::format("table '{}' needs \"sharding\": one of {}", t.table, shardingNames()));
  auto type = parseShardingType(sharding->str);
  if (!type)
    return p.error(sharding->offset,
                   fmt::format("table '{}': unknown sharding '{}' (use {})", t.table, sharding->str, shardingNames()));
  t.type = *type;
  if (const Node* rs = e.field("ranks")) {
    if (rs->kind != Node::Kind::Array)
      return p.error(rs->offset, fmt::format("table '{}': \"ranks\" must be a list of ranks", t.table));
    for (const Node& r : rs->items) {
      KILN_ASSIGN_OR_RETURN(int v, intField(p, r, "a rank"));
      if (v < 0 || v >= nranks)
        return p.error(r.offset, fmt::format("table '{}': rank {} is out of range [0, {})", t.table, v, nranks));
      t.ranks.push_back(v);
    }
  } else if (require_ranks && !t.kind().replicated()) {
    return p.error(e.offset, fmt::format("table '{}' needs \"ranks\" for {}", t.table, shardingName(t.type)));
  }
  // A hybrid table's replicated rows (completePlan checks them against the table), and what the
  // planner's sample said they cover (for the printed predictions only).
  if (const Node* hot = e.field("hot_rows")) {
    if (hot->kind != Node::Kind::Array)
      return p.error(hot->offset, fmt::format("table '{}': \"hot_rows\" must be a list of rows", t.table));
    for (const Node& r : hot->items) {
      if (r.kind != Node::Kind::Number || !r.integral || r.num < 0 || r.num > 9e15)
        return p.error(r.offset, fmt::format("table '{}': a hot row must be a non-negative integer", t.table));
      t.hot.ids.push_back(static_cast<int64_t>(r.num));
    }
    t.hot.rows = static_cast<int64_t>(t.hot.ids.size());
    const std::pair<const char*, double*> shares[] = {{"hot_id_share", &t.hot.id_share},
                                                      {"hot_sample_share", &t.hot.sample_share}};
    for (auto [key, share] : shares)
      if (const Node* n = e.field(key)) {
        if (n->kind != Node::Kind::Number || n->num < 0 || n->num > 1)
          return p.error(n->offset, fmt::format("table '{}': \"{}\" must be a number in [0, 1]", t.table, key));
        *share = n->num;
      }
  }
  // De-duplicated routing, and the distinct share of a rank's ids the planner's sample measured.
  if (const Node* d = e.field("dedup")) {
    if (d->kind != Node::Kind::Bool)
      return p.error(d->offset, fmt::format("table '{}': \"dedup\" must be true or false", t.table));
    t.dedup = d->b;
  }
  if (const Node* u = e.field("unique_share")) {
    if (u->kind != Node::Kind::Number || u->num <= 0 || u->num > 1)
      return p.error(u->offset, fmt::format("table '{}': \"unique_share\" must be a number in (0, 1]", t.table));
    t.unique_share = u->num;
  }
  return t;
}

}  // namespace

Expected<ShardPlan> readPlanJson(std::string_view text, std::string_view file, int expected_ranks) {
  Parser p(text, file);
  KILN_ASSIGN_OR_RETURN(Node root, p.document());
  if (root.kind != Node::Kind::Object) return p.error(root.offset, "a plan is a JSON object");
  const Node* format = root.field("format");
  if (!format) return p.error(root.offset, "the plan has no \"format\" (expected \"kiln-plan-1\")");
  if (format->kind != Node::Kind::String || format->str != "kiln-plan-1")
    return p.error(format->offset, "unknown plan format (expected \"kiln-plan-1\")");
  ShardPlan plan;
  const Node* ranks = root.field("ranks");
  if (!ranks) return p.error(root.offset, "the plan has no \"ranks\"");
  KILN_ASSIGN_OR_RETURN(plan.ranks, intField(p, *ranks, "\"ranks\""));
  if (plan.ranks < 1)
    return p.error(ranks->offset, fmt::format("\"ranks\" must be at least 1, got {}", plan.ranks));
  if (expected_ranks > 0 && plan.ranks != expected_ranks)
    return p.error(ranks->offset, fmt::format("the plan is for {} ranks but the run has {} (--ranks)",
                                              plan.ranks, expected_ranks));
  if (const Node* rpn = root.field("ranks_per_node")) {
    KILN_ASSIGN_OR_RETURN(plan.ranks_per_node, intField(p, *rpn, "\"ranks_per_node\""));
    if (plan.ranks_per_node < 0)
      return p.error(rpn->offset,
                     fmt::format("\"ranks_per_node\" must be 0 or positive, got {}", plan.ranks_per_node));
  }
  const Node* tables = root.field("tables");
  if (!tables) return p.error(root.offset, "the plan has no \"tables\"");
  if (tables->kind != Node::Kind::Array)
    return p.error(tables->offset, fmt::format("\"tables\" must be a list, got {}", kindName(tables->kind)));
  plan.loc = p.at(tables->offset);
  for (const Node& e : tables->items) {
    KILN_ASSIGN_OR_RETURN(TablePlan t, parseEntry(p, e, plan.ranks, /*require_ranks=*/true));
    plan.tables.push_back(std::move(t));
  }
  return plan;
}

Expected<ShardPlan> loadPlanJson(std::string_view text, std::string_view file,
                                 const std::vector<TableInfo>& tables, int expected_ranks) {
  KILN_ASSIGN_OR_RETURN(ShardPlan plan, readPlanJson(text, file, expected_ranks));
  KILN_RETURN_IF_ERROR(completePlan(plan, tables));
  return plan;
}

Expected<std::vector<PlanPin>> readPlanConstraints(std::string_view text, std::string_view file, int ranks) {
  Parser p(text, file);
  KILN_ASSIGN_OR_RETURN(Node root, p.document());
  if (root.kind != Node::Kind::Object) return p.error(root.offset, "a constraints file is a JSON object");
  const Node* format = root.field("format");
  if (!format || format->kind != Node::Kind::String || format->str != "kiln-constraints-1")
    return p.error(format ? format->offset : root.offset, "unknown constraints format (expected \"kiln-constraints-1\")");
  const Node* tables = root.field("tables");
  if (!tables || tables->kind != Node::Kind::Array)
    return p.error(tables ? tables->offset : root.offset, "the constraints need \"tables\": a list of pins");
  std::vector<PlanPin> pins;
  for (const Node& e : tables->items) {
    KILN_ASSIGN_OR_RETURN(TablePlan t, parseEntry(p, e, ranks, /*require_ranks=*/false));
    PlanPin pin;
    pin.table = t.table;
    pin.type = t.type;
    pin.ranks = t.ranks;
    std::sort(pin.ranks.begin(), pin.ranks.end());
    pin.loc = t.loc;
    pins.push_back(std::move(pin));
  }
  return pins;
}

std::string writePlanJson(const ShardPlan& plan, const PlanCosts* costs) {
  std::string out =
      fmt::format("{{\n  \"format\": \"kiln-plan-1\",\n  \"ranks\": {},\n  \"ranks_per_node\": {},\n",
                  plan.ranks, plan.ranks_per_node);
  out += "  \"tables\": [\n";
  for (size_t i = 0; i < plan.tables.size(); ++i) {
    const TablePlan& t = plan.tables[i];
    out += fmt::format("    {{\"table\": {}, \"sharding\": \"{}\", \"ranks\": [{}]", quote(t.table),
                       shardingName(t.type), fmt::join(t.ranks, ", "));
    const TableCost* c = costs && i < costs->tables.size() ? &costs->tables[i] : nullptr;
    if (c)
      out += fmt::format(
          ", \"bytes_per_rank\": {}, \"lookups_per_step\": {:.0f}, \"comm_bytes_per_step\": {:.0f}",
          c->bytes_per_rank, c->lookups_per_step, c->comm_bytes_per_step);
    if (!t.reason.empty()) out += fmt::format(", \"reason\": {}", quote(t.reason));
    if (!t.hot.ids.empty())
      out += fmt::format(", \"hot_id_share\": {:.4f}, \"hot_sample_share\": {:.4f}, \"hot_rows\": [{}]",
                         t.hot.id_share, t.hot.sample_share, fmt::join(t.hot.ids, ", "));
    if (t.dedup) out += fmt::format(", \"dedup\": true, \"unique_share\": {:.4f}", t.unique_share);
    out += i + 1 < plan.tables.size() ? "},\n" : "}\n";
  }
  out += "  ]";
  if (costs) {
    out += ",\n  \"per_rank\": [\n";
    for (size_t r = 0; r < costs->ranks.size(); ++r) {
      const RankCost& c = costs->ranks[r];
      out += fmt::format("    {{\"rank\": {}, \"memory_bytes\": {}, \"step_s\": {:.6g}}}{}\n", r,
                         c.memory_bytes, c.step_s, r + 1 < costs->ranks.size() ? "," : "");
    }
    out += "  ]";
  }
  out += "\n}\n";
  return out;
}

}  // namespace kiln::passes
