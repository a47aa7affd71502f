#include "tests/ops/op_test_util.h"

#include <cmath>

namespace kiln::ir::testing {

HostTensor tensor(DType t, std::vector<int64_t> shape, const std::vector<double>& v) {
  HostTensor h(t, std::move(shape));
  EXPECT_EQ(static_cast<int64_t>(v.size()), h.numel()) << "literal has the wrong number of values";
  for (size_t i = 0; i < v.size() && static_cast<int64_t>(i) < h.numel(); ++i) {
    switch (t) {
      case DType::f32:
        h.as<float>()[i] = static_cast<float>(v[i]);
        break;
      case DType::f64:
        h.as<double>()[i] = v[i];
        break;
      case DType::bf16:
        h.as<uint16_t>()[i] = floatToBf16(static_cast<float>(v[i]));
        break;
      case DType::i32:
        h.as<int32_t>()[i] = static_cast<int32_t>(v[i]);
        break;
      case DType::i64:
        h.as<int64_t>()[i] = static_cast<int64_t>(v[i]);
        break;
      case DType::i1:
        h.as<uint8_t>()[i] = v[i] != 0;
        break;
      default:
        ADD_FAILURE() << "no literal support for " << dtypeName(t);
    }
  }
  return h;
}

std::vector<double> values(const HostTensor& h) {
  std::vector<double> out;
  for (int64_t i = 0; i < h.numel(); ++i) {
    switch (h.view.dtype) {
      case DType::f32:
        out.push_back(h.as<float>()[i]);
        break;
      case DType::f64:
        out.push_back(h.as<double>()[i]);
        break;
      case DType::bf16:
        out.push_back(bf16ToFloat(h.as<uint16_t>()[i]));
        break;
      case DType::i32:
        out.push_back(h.as<int32_t>()[i]);
        break;
      case DType::i64:
        out.push_back(static_cast<double>(h.as<int64_t>()[i]));
        break;
      case DType::i1:
        out.push_back(h.as<uint8_t>()[i]);
        break;
      default:
        ADD_FAILURE() << "no value support for " << dtypeName(h.view.dtype);
    }
  }
  return out;
}

TensorType typeOf(const HostTensor& t) {
  Shape s;
  for (int64_t d : t.view.shape) s.push_back(Dim::fixed(d));
  return TensorType(t.view.dtype, std::move(s));
}

Expected<std::vector<HostTensor>> run(const OpCall& call) {
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  std::vector<Value*> operands;
  std::map<std::string, HostTensor> inputs;
  for (size_t i = 0; i < call.operands.size(); ++i) {
    std::string name = "x" + std::to_string(i);
    TensorType t = i < call.operand_types.size() ? call.operand_types[i] : typeOf(call.operands[i]);
    auto in = b.createWithTypes("kiln.input", {}, {t}, {{"name", Attribute(name)}});
    if (!in) return in.status();
    operands.push_back((*in)->result());
    inputs[name] = call.operands[i];
  }
  auto op = call.result_types.empty() ? b.create(call.name, operands, call.attrs)
                                      : b.createWithTypes(call.name, operands, call.result_types, call.attrs);
  if (!op) return op.status();
  std::vector<TensorType> result_types;
  for (Value* r : (*op)->results()) result_types.push_back(r->type());
  auto ret = b.createWithTypes("func.return", (*op)->results(), {});
  if (!ret) return ret.status();
  f.setResultTypes(result_types);
  KILN_RETURN_IF_ERROR(verify(f));
  return interpret(f, inputs, call.symbols);
}

HostTensor runOk(const OpCall& call) {
  auto r = run(call);
  if (!r) {
    ADD_FAILURE() << call.name << ": " << r.status().str();
    return HostTensor();
  }
  EXPECT_EQ(r->size(), 1u);
  return r->empty() ? HostTensor() : (*r)[0];
}

void expectTensor(const HostTensor& t, const std::vector<int64_t>& shape, const std::vector<double>& want,
                  double tol) {
  EXPECT_EQ(t.view.shape, shape);
  std::vector<double> got = values(t);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * (1 + std::abs(want[i]))) << "at element " << i;
}

}  // namespace kiln::ir::testing
