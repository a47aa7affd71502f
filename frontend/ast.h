// The syntax tree of a .kiln file, as the parser builds it. Nodes own their children; every
// node carries the location of its first token for diagnostics.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::frontend::ast {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Arg {
  std::string name;  // empty for a positional argument
  ExprPtr value;
  Location loc;
};

// One position of `x[...]`: an index `i`, or a slice `a:b` with either end optional.
struct Subscript {
  bool is_slice = false;
  ExprPtr index;  // or the slice start
  ExprPtr stop;
  Location loc;
};

struct Expr {
  enum class Kind { Int, Float, Bool, String, Name, List, Range, Unary, Binary, Call, Index, Error };
  Kind kind;
  Location loc;
  int64_t int_value = 0;
  double float_value = 0;
  bool bool_value = false;
  std::string text;             // Name, String; the operator of Unary/Binary ("+", "and", ...)
  std::vector<ExprPtr> items;   // List elements; Range (lo, hi); Unary (x); Binary (a, b)
  ExprPtr callee;               // Call, Index: the called or indexed expression
  std::vector<Arg> args;        // Call
  std::vector<Subscript> subs;  // Index

  Expr(Kind k, Location l) : kind(k), loc(std::move(l)) {}
};

// `f32[B, 13]`, `ids[B, 26]`.
struct TypeExpr {
  std::string dtype;
  Location loc;
  std::vector<ExprPtr> dims;
};

// A modifier after an input's type: `hotness(hot)`, `weighted`, `id_map(hash)`.
struct Modifier {
  std::string name;
  Location loc;
  std::vector<Arg> args;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Block = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind { Assign, Dim, Param, Input, Output, For, If, Return, Train, Expr };
  Kind kind;
  Location loc;
  std::vector<std::string>
      names;  // Param/Input/For: one; Assign: one, or several to unpack a list; Dim/Output: several
  std::vector<Location> name_locs;
  ExprPtr value;                   // Assign/Param/Return/Expr value; For iterable; If condition
  TypeExpr type;                   // Input
  std::vector<Modifier> modifiers; // Input
  Block body;                      // For, If (then), Train
  Block else_body;                 // If

  Stmt(Kind k, Location l) : kind(k), loc(std::move(l)) {}
};

struct FnParam {
  std::string name;
  Location loc;
  ExprPtr default_value;  // may be null
};

struct FnDecl {
  std::string name;
  Location loc;
  std::vector<FnParam> params;
  Block body;
};

struct ModelDecl {
  std::string name;
  Location loc;
  Block body;
};

struct Import {
  std::string path;
  Location loc;
};

// One parsed file.
struct File {
  std::string path;
  std::vector<Import> imports;
  std::vector<std::unique_ptr<FnDecl>> fns;
  std::vector<std::unique_ptr<ModelDecl>> models;
};

// An S-expression rendering, for `kiln dump --stage=ast` and parser tests.
std::string printFile(const File& f);
std::string printExpr(const Expr& e);

}  // namespace kiln::frontend::ast
