#include "runtime/cuda/cublaslt.h"

#include <fmt/format.h>

#ifdef KILN_HAVE_CUDA_HEADERS
#include <cublasLt.h>
#endif

namespace kiln::cuda {

using codegen::Epilogue;
using codegen::GemmShape;

ColumnMajorGemm toColumnMajor(const GemmShape& s) {
  // A row-major [r, c] buffer is a column-major [c, r] matrix with leading dimension c; the
  // transpose flags carry over unchanged.
  ColumnMajorGemm g;
  g.m = s.n;
  g.n = s.m;
  g.k = s.k;
  g.trans_first = s.transpose_b;
  g.trans_second = s.transpose_a;
  int64_t b_rows = s.transpose_b ? s.n : s.k, b_cols = s.transpose_b ? s.k : s.n;  // our B as stored
  int64_t a_rows = s.transpose_a ? s.k : s.m, a_cols = s.transpose_a ? s.m : s.k;  // our A as stored
  g.rows_first = b_cols;
  g.cols_first = b_rows;
  g.ld_first = b_cols;
  g.rows_second = a_cols;
  g.cols_second = a_rows;
  g.ld_second = a_cols;
  g.ld_c = s.n;
  return g;
}

#ifdef KILN_HAVE_CUDA_HEADERS

struct CublasLt::Api {
  decltype(&::cublasLtCreate) create = nullptr;
  decltype(&::cublasLtDestroy) destroy = nullptr;
  decltype(&::cublasLtGetVersion) getVersion = nullptr;
  decltype(&::cublasLtGetStatusString) statusString = nullptr;
  decltype(&::cublasLtMatmulDescCreate) descCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) descDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) descSet = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) layoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) layoutDestroy = nullptr;
  decltype(&::cublasLtMatrixLayoutSetAttribute) layoutSet = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) prefCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) prefDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) prefSet = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&::cublasLtMatmul) matmul = nullptr;
};

// Descriptors and the chosen algorithm of one problem, reused for every call with its shape.
struct CublasLt::Plan {
  const Api* api = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (desc) api->descDestroy(desc);
    for (auto l : {a, b, c})
      if (l) api->layoutDestroy(l);
  }
};

namespace {

Expected<cudaDataType_t> dataType(ir::DType t) {
  switch (t) {
    case ir::DType::f32: return CUDA_R_32F;
    case ir::DType::bf16: return CUDA_R_16BF;
    case ir::DType::f16: return CUDA_R_16F;
    default: return Status::errorf("cuBLASLt GEMMs take f32, bf16 or f16, not {}", ir::dtypeName(t));
  }
}

cublasLtEpilogue_t epilogueOf(Epilogue e) {
  switch (e) {
    case Epilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::Relu: return CUBLASLT_EPILOGUE_RELU;
    case Epilogue::BiasRelu: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case Epilogue::Gelu: return CUBLASLT_EPILOGUE_GELU;
    case Epilogue::BiasGelu: return CUBLASLT_EPILOGUE_GELU_BIAS;
    // cuBLASLt's A is our B (toColumnMajor): the gradient of our A is its BGRADB.
    case Epilogue::BiasGradA:
      return CUBLASLT_EPILOGUE_BGRADB;
    case Epilogue::BiasGradB:
      return CUBLASLT_EPILOGUE_BGRADA;
    case Epilogue::ReluAux: return CUBLASLT_EPILOGUE_RELU_AUX;
    case Epilogue::BiasReluAux: return CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
    case Epilogue::DRelu: return CUBLASLT_EPILOGUE_DRELU;
    case Epilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// The bias pointer: read by a bias epilogue, written by a bias-gradient one.
bool hasBias(Epilogue e) { return codegen::epilogueReadsBias(e) || codegen::epilogueWritesBiasGradient(e); }

}  // namespace

Expected<std::unique_ptr<CublasLt>> CublasLt::create(CudaDriver* drv, size_t workspace_bytes) {
  auto lib = DynamicLibrary::open({"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}, cudaLibraryDirs());
  if (!lib) return Status::errorf("cannot run GEMMs on the GPU: cuBLASLt {}", lib.status().message());
  std::unique_ptr<CublasLt> c(new CublasLt());
  c->drv_ = drv;
  c->lib_ = lib.take();
  c->api_ = std::make_unique<Api>();
  Api& a = *c->api_;
  std::string missing;
  auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(c->lib_.symbol(name));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  bind(a.create, "cublasLtCreate");
  bind(a.destroy, "cublasLtDestroy");
  bind(a.getVersion, "cublasLtGetVersion");
  bind(a.statusString, "cublasLtGetStatusString");
  bind(a.descCreate, "cublasLtMatmulDescCreate");
  bind(a.descDestroy, "cublasLtMatmulDescDestroy");
  bind(a.descSet, "cublasLtMatmulDescSetAttribute");
  bind(a.layoutCreate, "cublasLtMatrixLayoutCreate");
  bind(a.layoutDestroy, "cublasLtMatrixLayoutDestroy");
  bind(a.layoutSet, "cublasLtMatrixLayoutSetAttribute");
  bind(a.prefCreate, "cublasLtMatmulPreferenceCreate");
  bind(a.prefDestroy, "cublasLtMatmulPreferenceDestroy");
  bind(a.prefSet, "cublasLtMatmulPreferenceSetAttribute");
  bind(a.heuristic, "cublasLtMatmulAlgoGetHeuristic");
  bind(a.matmul, "cublasLtMatmul");
  if (!missing.empty()) return Status::errorf("{} lacks {}", c->lib_.path(), missing);
  c->version_ = a.getVersion();
  cublasLtHandle_t h = nullptr;
  cublasStatus_t st = a.create(&h);
  if (st != CUBLAS_STATUS_SUCCESS) return Status::errorf("cublasLtCreate: {}", a.statusString(st));
  c->handle_ = h;
  auto ws = DeviceBuffer::allocate(drv, workspace_bytes, "the cuBLASLt workspace");
  if (!ws) return ws.status();
  c->workspace_ = ws.take();
  return c;
}

CublasLt::~CublasLt() {
  algos_.clear();
  if (handle_) api_->destroy(static_cast<cublasLtHandle_t>(handle_));
}

Expected<CublasLt::Plan*> CublasLt::plan(const GemmShape& s) {
  auto it = algos_.find(s.key());
  if (it != algos_.end()) return it->second.get();
  const Api& a = *api_;
  auto fail = [&](cublasStatus_t st, const char* call) {
    return Status::errorf("{} for {}: {}", call, s.str(), a.statusString(st));
  };
  auto at = dataType(s.a_type), bt = dataType(s.b_type), ct = dataType(s.c_type), biast = dataType(s.bias_type);
  if (!at || !bt || !ct || !biast) return Status::errorf("{}: unsupported element types", s.str());
  auto p = std::make_unique<Plan>();
  p->api = &a;
  // TF32 where the precision allows it for f32 inputs (ir/precision.h); f32 accumulation either way.
  const cublasComputeType_t compute = s.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublasStatus_t st = a.descCreate(&p->desc, compute, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS) return fail(st, "cublasLtMatmulDescCreate");
  ColumnMajorGemm g = toColumnMajor(s);
  cublasOperation_t ta = g.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtEpilogue_t epi = epilogueOf(s.epilogue);
  cudaDataType_t bias_type = *biast;
  // A rejected attribute is reported where it happens, not later as "no algorithm".
  if ((st = a.descSet(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))) != CUBLAS_STATUS_SUCCESS ||
      (st = a.descSet(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))) != CUBLAS_STATUS_SUCCESS ||
      (st = a.descSet(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi))) != CUBLAS_STATUS_SUCCESS ||
      (hasBias(s.epilogue) &&
       (st = a.descSet(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type))) !=
           CUBLAS_STATUS_SUCCESS))
    return fail(st, "cublasLtMatmulDescSetAttribute");
  // The aux buffer's leading dimension, along cuBLASLt's rows (our N): in bits for the ReLU mask
  // (a multiple of 128), in elements for the GELU input (our row stride).
  if (codegen::epilogueHasAux(s.epilogue)) {
    int64_t aux_ld = s.epilogue == Epilogue::DGelu ? s.n : codegen::reluMaskLd(s.n);
    if ((st = a.descSet(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld))) !=
        CUBLAS_STATUS_SUCCESS)
      return fail(st, "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)");
  }
  auto layout = [&](cublasLtMatrixLayout_t* l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld) {
    cublasStatus_t r = a.layoutCreate(l, t, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld);
    if (r == CUBLAS_STATUS_SUCCESS && s.batch > 1) {
      int32_t count = static_cast<int32_t>(s.batch);
      int64_t stride = rows * cols;
      r = a.layoutSet(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count));
      if (r == CUBLAS_STATUS_SUCCESS)
        r = a.layoutSet(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride));
    }
    return r;
  };
  if ((st = layout(&p->a, *bt, g.rows_first, g.cols_first, g.ld_first)) != CUBLAS_STATUS_SUCCESS ||
      (st = layout(&p->b, *at, g.rows_second, g.cols_second, g.ld_second)) != CUBLAS_STATUS_SUCCESS ||
      (st = layout(&p->c, *ct, g.m, g.n, g.ld_c)) != CUBLAS_STATUS_SUCCESS)
    return fail(st, "cublasLtMatrixLayoutCreate");
  cublasLtMatmulPreference_t pref = nullptr;
  if ((st = a.prefCreate(&pref)) != CUBLAS_STATUS_SUCCESS) return fail(st, "cublasLtMatmulPreferenceCreate");
  uint64_t ws = workspace_.bytes();
  if ((st = a.prefSet(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws))) != CUBLAS_STATUS_SUCCESS) {
    a.prefDestroy(pref);
    return fail(st, "cublasLtMatmulPreferenceSetAttribute");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  st = a.heuristic(static_cast<cublasLtHandle_t>(handle_), p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
  a.prefDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return fail(st, "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) return Status::errorf("cuBLASLt has no algorithm for {}", s.str());
  p->algo = result.algo;
  Plan* raw = p.get();
  algos_[s.key()] = std::move(p);
  return raw;
}

Status CublasLt::matmul(const GemmShape& s, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, CUdeviceptr bias,
                        CUdeviceptr aux, CUdeviceptr residual, CUstream stream) {
  if (hasBias(s.epilogue) && bias == 0)
    return Status::errorf("{}: the epilogue needs a bias {}", s.str(),
                          codegen::epilogueWritesBiasGradient(s.epilogue) ? "gradient buffer" : "");
  if (codegen::epilogueHasAux(s.epilogue) && aux == 0)
    return Status::errorf("{}: the epilogue needs an aux buffer", s.str());
  if (s.residual && residual == 0) return Status::errorf("{}: the matrix C to add is missing", s.str());
  auto p = plan(s);
  if (!p) return p.status();
  const Api& api = *api_;
  if (hasBias(s.epilogue)) {
    void* bias_ptr = reinterpret_cast<void*>(bias);
    api.descSet((*p)->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr));
  }
  if (codegen::epilogueHasAux(s.epilogue)) {
    void* aux_ptr = reinterpret_cast<void*>(aux);
    api.descSet((*p)->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr, sizeof(aux_ptr));
  }
  // D = alpha op(A) op(B) + beta C: C is the residual (beta = 1), laid out as D, or D itself
  // with beta = 0 (then never read).
  float alpha = 1.0f, beta = s.residual ? 1.0f : 0.0f;
  const CUdeviceptr c_in = s.residual ? residual : c;
  cublasStatus_t st = api.matmul(static_cast<cublasLtHandle_t>(handle_), (*p)->desc, &alpha,
                                 reinterpret_cast<const void*>(b), (*p)->a, reinterpret_cast<const void*>(a), (*p)->b,
                                 &beta, reinterpret_cast<const void*>(c_in), (*p)->c, reinterpret_cast<void*>(c), (*p)->c,
                                 &(*p)->algo, reinterpret_cast<void*>(workspace_.ptr()), workspace_.bytes(),
                                 reinterpret_cast<cudaStream_t>(stream));
  if (st != CUBLAS_STATUS_SUCCESS) return Status::errorf("cublasLtMatmul for {}: {}", s.str(), api.statusString(st));
  return Status::ok();
}

#endif

}  // namespace kiln::cuda
