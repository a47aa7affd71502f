// The values of the Kiln language while a model is evaluated. Everything except tensors is
// known at compile time (numbers, lists, functions, optimizer settings); a tensor is an SSA
// value of the IR being built. Sparse inputs and embedding collections are values too, so that
// `tables(cats)` reads like a call.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "frontend/ast.h"
#include "ir/ir.h"
#include "ir/types.h"

namespace kiln::frontend {

// One categorical feature's inputs: ids, lengths when variable-length, weights when weighted.
struct SparseFeature {
  std::string name;
  int64_t feature = 0;
  ir::Op* ids_op = nullptr;
  ir::Value* ids = nullptr;
  ir::Value* lengths = nullptr;
  ir::Value* weights = nullptr;
};

struct EmbeddingTable {
  std::string name;
  ir::Value* table = nullptr;
  int64_t rows = 0;
  int64_t dim = 0;
  std::string pool;
};

// Val's record entry is a named struct and its inline members are defined after the class:
// clang with libstdc++ cannot instantiate std::pair<std::string, Val> (nor Val's special
// members) while Val is still incomplete.
struct Val {
  enum class Kind { Error, None, Int, Float, Bool, Str, Word, List, Tensor, Dim, Func, Record, Sparse, Tables };
  struct Field;  // a record entry, defined below
  Kind kind = Kind::None;
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;                                // Str, Word, Func (builtin name), Record (kind)
  std::vector<Val> items;                       // List
  std::vector<Field> fields;                    // Record
  ir::Value* tensor = nullptr;
  // Tensor: a padded sequence [B, L, ...]'s lengths i32[B] (embeddings with pool = none, the
  // attention of a padded sequence): the consumers of docs/language.md's sequence builtins
  // mask the positions at and past them. Arithmetic on the tensor drops it; lengths(x) reads it.
  ir::Value* lengths = nullptr;
  ir::Dim dim;
  const ast::FnDecl* fn = nullptr;              // Func: a user function (else builtin `s`)
  std::vector<SparseFeature> sparse;
  std::vector<EmbeddingTable> tables;
  bool single = false;                          // Sparse/Tables picked by an integer index

  static Val error();
  static Val none();
  static Val integer(int64_t v);
  static Val number(double v);
  static Val boolean(bool v);
  static Val string(std::string v);
  static Val word(std::string v);
  static Val list(std::vector<Val> v);
  static Val ofTensor(ir::Value* t);
  static Val ofDim(ir::Dim d);
  static Val builtin(std::string name);
  static Val user(const ast::FnDecl* fn);

  bool isNumber() const { return kind == Kind::Int || kind == Kind::Float; }
  double asDouble() const { return kind == Kind::Int ? static_cast<double>(i) : f; }
  const Val* field(std::string_view name) const;

 private:
  static Val make(Kind k);
};

struct Val::Field {
  std::string name;
  Val value;
};

inline Val Val::error() { return make(Kind::Error); }
inline Val Val::none() { return make(Kind::None); }
inline Val Val::integer(int64_t v) {
  Val x = make(Kind::Int);
  x.i = v;
  return x;
}
inline Val Val::number(double v) {
  Val x = make(Kind::Float);
  x.f = v;
  return x;
}
inline Val Val::boolean(bool v) {
  Val x = make(Kind::Bool);
  x.b = v;
  return x;
}
inline Val Val::string(std::string v) {
  Val x = make(Kind::Str);
  x.s = std::move(v);
  return x;
}
inline Val Val::word(std::string v) {
  Val x = make(Kind::Word);
  x.s = std::move(v);
  return x;
}
inline Val Val::list(std::vector<Val> v) {
  Val x = make(Kind::List);
  x.items = std::move(v);
  return x;
}
inline Val Val::ofTensor(ir::Value* t) {
  Val x = make(Kind::Tensor);
  x.tensor = t;
  return x;
}
inline Val Val::ofDim(ir::Dim d) {
  Val x = make(Kind::Dim);
  x.dim = std::move(d);
  return x;
}
inline Val Val::builtin(std::string name) {
  Val x = make(Kind::Func);
  x.s = std::move(name);
  return x;
}
inline Val Val::user(const ast::FnDecl* fn) {
  Val x = make(Kind::Func);
  x.fn = fn;
  x.s = fn->name;
  return x;
}
inline const Val* Val::field(std::string_view name) const {
  for (const auto& [k, v] : fields)
    if (k == name) return &v;
  return nullptr;
}
inline Val Val::make(Kind k) {
  Val v;
  v.kind = k;
  return v;
}

// "int", "list", "tensor f32[B,13]", ... for diagnostics.
std::string describe(const Val& v);
// A tensor type as the language writes it: f32[B,256], i64[?(8*B)], f32[] for a scalar.
std::string typeStr(const ir::TensorType& t);

}  // namespace kiln::frontend
