#include "codegen/cuda_program.h"

#include <fmt/format.h>

#include <map>
#include <set>

#include "codegen/kernel_lowering.h"
#include "codegen/memory_planner.h"
#include "codegen/stream_builder.h"
#include "ir/precision.h"

namespace kiln::codegen {

namespace {

int64_t product(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shapeStr(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

}  // namespace

const char* epilogueName(Epilogue e) {
  switch (e) {
    case Epilogue::None:
      return "none";
    case Epilogue::Bias:
      return "bias";
    case Epilogue::Relu:
      return "relu";
    case Epilogue::BiasRelu:
      return "bias+relu";
    case Epilogue::Gelu:
      return "gelu";
    case Epilogue::BiasGelu:
      return "bias+gelu";
    case Epilogue::BiasGradA:
      return "bgrad(A)";
    case Epilogue::BiasGradB:
      return "bgrad(B)";
    case Epilogue::ReluAux:
      return "relu+mask";
    case Epilogue::BiasReluAux:
      return "bias+relu+mask";
    case Epilogue::DRelu:
      return "drelu";
    case Epilogue::DGelu:
      return "dgelu";
  }
  return "?";
}

std::string GemmShape::str() const {
  return fmt::format("gemm {}x{}x{}{} {}{}{}{}{} -> {} epilogue {}", m, n, k,
                     batch > 1 ? fmt::format(" batch {}", batch) : "", ir::dtypeName(a_type), tf32 ? " tf32" : "",
                     transpose_a ? " (A^T)" : "", transpose_b ? " (B^T)" : "", residual ? " + C" : "",
                     ir::dtypeName(c_type), epilogueName(epilogue));
}

Expected<GemmShape> gemmShapeOf(const ir::Op& op, const ir::SymbolBindings& symbols) {
  auto sa = concreteShape(op.operand(0)->type(), symbols);
  auto sb = concreteShape(op.operand(1)->type(), symbols);
  auto sc = concreteShape(op.result()->type(), symbols);
  if (!sa || !sb || !sc)
    return Status::errorf("kiln.matmul at {}: shapes are not concrete", op.location().str());
  if (sa->size() < 2 || sb->size() < 2 || sc->size() < 2)
    return Status::errorf("kiln.matmul at {}: the CUDA backend needs operands of rank >= 2",
                          op.location().str());
  GemmShape g;
  g.transpose_a = op.boolAttr("transpose_a");
  g.transpose_b = op.boolAttr("transpose_b");
  g.m = (*sc)[sc->size() - 2];
  g.n = sc->back();
  g.k = g.transpose_a ? (*sa)[sa->size() - 2] : sa->back();
  g.a_type = op.operand(0)->type().dtype();
  g.b_type = op.operand(1)->type().dtype();
  g.c_type = op.result()->type().dtype();
  g.tf32 = ir::allowsTf32(op);
  auto batchOf = [](const std::vector<int64_t>& s) { return product({s.begin(), s.end() - 2}); };
  int64_t ba = batchOf(*sa), bb = batchOf(*sb), bc = batchOf(*sc);
  if (ba == bc && bb == bc) {
    g.batch = bc;
  } else if (bb == 1 && ba == bc && !g.transpose_a) {
    g.m *= bc;  // [batch, M, K] x [K, N]: one [batch*M, K] x [K, N] product
  } else {
    return Status::errorf(
        "kiln.matmul at {}: broadcast batch dims {} x {} are not supported on the CUDA backend",
        op.location().str(), shapeStr(*sa), shapeStr(*sb));
  }
  return g;
}

std::vector<int64_t> CudaProgram::AddressTable::at(const std::vector<uint64_t>& address) const {
  GroupBuffer table;
  table.words = words;
  return addressTableWords(table, address);
}

Expected<CudaProgram> buildCudaProgram(const ir::Function& f, const std::vector<LoweredGroup>& groups,
                                       const ir::SymbolBindings& symbols, int64_t alignment) {
  CudaProgram out;
  Program& p = out.program;
  p.function = f.name();
  p.symbols = symbols;
  std::map<const ir::Value*, int> value_buffer;
  std::set<const ir::Value*> returned;
  const ir::Op* ret = f.returnOp();
  if (ret)
    for (const ir::Value* v : ret->operands()) returned.insert(v);
  // The ReLU outputs whose buffers also carry the bit mask their GEMM writes (RELU_AUX), for a
  // DRELU epilogue of the backward to read.
  std::set<const ir::Value*> masked;
  for (const LoweredGroup& g : groups)
    if (g.gemm && g.gemm_call.writes_relu_mask)
      masked.insert(g.buffers[static_cast<size_t>(g.gemm_call.c)].value);
  auto addBuffer = [&](BufferKind kind, std::string name, ir::TensorType type, std::vector<int64_t> shape,
                       ir::DType dtype) {
    Buffer b;
    b.id = static_cast<int>(p.buffers.size());
    b.kind = kind;
    b.name = std::move(name);
    b.type = std::move(type);
    b.bytes = product(shape) * ir::dtypeBytes(dtype);
    p.buffers.push_back(std::move(b));
    out.shapes.push_back(std::move(shape));
    return static_cast<int>(p.buffers.size() - 1);
  };
  auto bufferOf = [&](const ir::Value* v) -> Expected<int> {
    auto it = value_buffer.find(v);
    if (it != value_buffer.end()) return it->second;
    KILN_ASSIGN_OR_RETURN(auto shape, concreteShape(v->type(), symbols));
    const ir::Op* def = v->definingOp();
    if (!def)
      return Status::errorf("cuda executor: @{} has a block argument; expected kiln.input ops", f.name());
    BufferKind kind = returned.count(v) ? BufferKind::Output : BufferKind::Temp;
    std::string name = v->nameHint();
    if (def->is(ir::OpCode::Input)) {
      kind = BufferKind::Input;
      name = def->strAttr("name");
    } else if (def->is(ir::OpCode::Parameter)) {
      kind = BufferKind::Parameter;
      name = def->strAttr("name");
    } else if (def->is(ir::OpCode::Constant)) {
      kind = BufferKind::Parameter;  // outside the arena, uploaded once
    }
    int id = addBuffer(kind, name, v->type(), shape, v->type().dtype());
    if (masked.count(v)) {
      if (kind != BufferKind::Temp && kind != BufferKind::Output)
        return Status::errorf("cuda executor: {} carries a ReLU mask but is not computed", name);
      Buffer& b = p.buffers[static_cast<size_t>(id)];
      b.bytes = reluMaskOffset(b.bytes) + reluMaskBytes(product({shape.begin(), shape.end() - 1}), shape.back());
    }
    if (def->is(ir::OpCode::Constant)) out.constants.push_back({id, def});
    if (kind == BufferKind::Input) out.inputs.push_back(id);
    value_buffer[v] = id;
    return id;
  };

  StreamBuilder sp;
  std::set<int> streams = {0};
  for (const LoweredGroup& g : groups) {
    if (g.stream < 0 || g.stream > 1024)
      return Status::errorf("cuda executor: stream {} is not a stream number", g.stream);
    streams.insert(g.stream);
  }
  const bool forked = streams.size() > 1;
  const int fork = forked ? sp.marker(0) : -1;
  std::set<int> started;
  out.group_buffers.resize(groups.size());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const LoweredGroup& g = groups[gi];
    Instruction in;
    in.op = g.gemm ? std::string(ir::opName(ir::OpCode::Matmul)) : "cuda.group";
    in.attrs["group"] = ir::Attribute(static_cast<int64_t>(gi));
    std::vector<int> written_in_place;
    for (const GroupBuffer& gb : g.buffers) {
      int id;
      if (gb.value) {
        KILN_ASSIGN_OR_RETURN(auto b, bufferOf(gb.value));
        id = b;
        (gb.defined ? in.results : in.operands).push_back(id);
        // Written without being defined here: state updated in place (optimizer updates).
        if (gb.written && !gb.defined) written_in_place.push_back(id);
      } else if (!gb.words.empty()) {
        // Outside the arena: written once, read by every step.
        id = addBuffer(BufferKind::Parameter, gb.name, ir::TensorType(), {gb.elements}, gb.dtype);
        in.operands.push_back(id);
      } else if (gb.name == "embedding_errors") {
        // Outside the arena: it must survive the step to be checked.
        id = addBuffer(BufferKind::Parameter, gb.name, ir::TensorType(), {gb.elements}, gb.dtype);
        out.error_flags.push_back(id);
      } else {
        id = addBuffer(BufferKind::Temp, gb.name, ir::TensorType(), {gb.elements}, gb.dtype);
        in.results.push_back(id);
      }
      out.group_buffers[gi].push_back(id);
    }
    for (size_t b = 0; b < g.buffers.size(); ++b) {
      if (g.buffers[b].words.empty()) continue;
      CudaProgram::AddressTable t{out.group_buffers[gi][b], g.buffers[b].words};
      for (AddressWord& w : t.words)
        if (w.buffer >= 0) w.buffer = out.group_buffers[gi][static_cast<size_t>(w.buffer)];
      out.address_tables.push_back(std::move(t));
    }
    // The first launch of another stream waits for stream 0's fork.
    if (forked && g.stream != 0 && started.insert(g.stream).second) sp.wait(g.stream, fork);
    sp.launch(g.stream, std::move(in), written_in_place);
  }
  // The join: stream 0 ends after every other stream's last launch.
  for (const auto& [stream, at] : sp.lastLaunch())
    if (stream != 0) sp.wait(0, at);
  sp.assembleInto(p);
  if (ret)
    for (const ir::Value* v : ret->operands()) {
      KILN_ASSIGN_OR_RETURN(auto b, bufferOf(v));
      p.results.push_back(b);
    }
  KILN_RETURN_IF_ERROR(planMemory(p, {.alignment = alignment, .in_place = false}));

  // The steps of each group, their arguments as program buffers.
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const LoweredGroup& g = groups[gi];
    const std::vector<int>& gb = out.group_buffers[gi];
    out.group_steps.push_back({out.steps.size(), 0});
    if (g.gemm) {
      KILN_ASSIGN_OR_RETURN(auto shape, gemmShapeOf(*g.gemm, symbols));
      // The epilogue the lowering accepted: bias, activation and the output's type.
      const GemmCall& call = g.gemm_call;
      shape.c_type = g.buffers[static_cast<size_t>(call.c)].dtype;
      const bool bias = call.bias >= 0;
      if (bias) shape.bias_type = g.buffers[static_cast<size_t>(call.bias)].dtype;
      if (call.bias_gradient_of)
        shape.epilogue = call.bias_gradient_of == 'a' ? Epilogue::BiasGradA : Epilogue::BiasGradB;
      else if (call.activation_grad == "relu")
        shape.epilogue = Epilogue::DRelu;
      else if (call.activation_grad == "gelu")
        shape.epilogue = Epilogue::DGelu;
      else if (call.writes_relu_mask)
        shape.epilogue = bias ? Epilogue::BiasReluAux : Epilogue::ReluAux;
      else
        shape.epilogue = call.activation == "relu"   ? (bias ? Epilogue::BiasRelu : Epilogue::Relu)
                         : call.activation == "gelu" ? (bias ? Epilogue::BiasGelu : Epilogue::Gelu)
                                                     : (bias ? Epilogue::Bias : Epilogue::None);
      shape.residual = call.residual >= 0;
      CudaStep s;
      s.group = static_cast<int>(gi);
      s.name = fmt::format("{} at {}", shape.str(), g.gemm->location().str());
      // The aux buffer: the output's own for the mask it writes, the ReLU output whose mask the
      // DRELU reads (which some forward GEMM must have written), or the GELU input.
      const int aux = epilogueWritesReluMask(shape.epilogue) ? call.c : call.aux;
      if (epilogueHasAux(shape.epilogue)) {
        if (aux < 0) return Status::errorf("cuda executor: {} has no aux buffer", s.name);
        if (shape.batch != 1) return Status::errorf("cuda executor: {}: a batched GEMM with an aux buffer", s.name);
        const ir::Value* v = g.buffers[static_cast<size_t>(aux)].value;
        if (shape.epilogue == Epilogue::DRelu && !masked.count(v))
          return Status::errorf("cuda executor: {} reads the ReLU mask of {}, which no GEMM writes", s.name,
                                v ? v->nameHint() : "a temporary");
        if (shape.epilogue != Epilogue::DGelu) {
          const std::vector<int64_t>& dims = out.shapes[static_cast<size_t>(gb[static_cast<size_t>(aux)])];
          s.aux_offset = reluMaskOffset(product(dims) * ir::dtypeBytes(v->type().dtype()));
        }
      }
      if (shape.residual) {
        if (shape.batch != 1) return Status::errorf("cuda executor: {}: a batched GEMM adding C", s.name);
        if (epilogueWritesBiasGradient(shape.epilogue) || shape.epilogue == Epilogue::DRelu ||
            shape.epilogue == Epilogue::DGelu)
          return Status::errorf("cuda executor: {}: C is added only before a forward epilogue", s.name);
      }
      s.gemm = shape;
      for (int a : {call.a, call.b, call.c, call.bias, epilogueHasAux(shape.epilogue) ? aux : -1, call.residual})
        s.args.push_back(a < 0 ? -1 : gb[static_cast<size_t>(a)]);
      out.steps.push_back(std::move(s));
    }
    for (size_t ki = 0; ki < g.kernels.size(); ++ki) {
      CudaStep s;
      s.group = static_cast<int>(gi);
      s.kernel = static_cast<int>(ki);
      emitKernel(g.kernels[ki], &s.name);
      s.launch = launchConfig(g.kernels[ki]);
      for (int a : g.args[ki]) s.args.push_back(gb[static_cast<size_t>(a)]);
      out.steps.push_back(std::move(s));
    }
    out.group_steps.back().second = out.steps.size();
  }
  return out;
}

}  // namespace kiln::codegen
