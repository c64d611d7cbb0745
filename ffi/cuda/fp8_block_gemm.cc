// Block-scaled FP8 GEMM through cuBLASLt (CUDA 12.9+ on Hopper): y[M, N] = (x[M, K] * x_scale) @ (w[N, K] *
// w_scale)^T in bf16, DeepSeek-V3's scheme: w e4m3fn with one f32 scale per 128 x 128 block (HF's
// weight_scale_inv), x e4m3fn with one f32 scale per token per 128 channels. cuBLASLt's Hopper kernels keep
// the tensor cores fed while the scales are applied (what the Triton and Pallas GEMMs could not: they reach
// half the FP8 rate at M = 512, benchmarks/2026-12-06c), docs/ffi.md.
//
// cuBLAS is column-major: y^T[N, M] = op(A) op(B) with A = w read as [K, N] (transposed: the FP8 "TN" form)
// and B = x read as [K, M]. Scale modes: A 128 x 128 blocks, read from HF's [ceil(N/128), K/128] row-major;
// B 128-element vectors along K, read M-major ([K/128, M] row-major: measured on an H100, the other three
// layouts give wrong products). Both scale tensors' leading dimension is read in fours (16 bytes): the caller
// pads M to fours and the weight scales' K/128 to fours (unpadded, K = 256 gave wrong products,
// benchmarks/2026-12-06c; PyTorch's scaled_mm pads the same way).
//
// Command-buffer compatible (XLA captures the call into the step's CUDA graph; without the trait every call
// split the graph, the suspect of decode's stalls, BENCHMARKS.md 2026-12-06c): so the workspace is one
// buffer a device kept for the process, not XLA scratch, and nothing here synchronises.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLAS's recommendation for Hopper

std::mutex mu;
std::map<int, cublasLtHandle_t> handles;  // one a device, kept for the process
std::map<int, void*> workspaces;           // one a device: XLA issues a device's calls in order on its stream
std::map<std::tuple<int, int64_t, int64_t, int64_t>, cublasLtMatmulAlgo_t> algos;

ffi::Error LtError(const char* what, cublasStatus_t s) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("moejax_fp8_block_gemm: ") + what + ": " +
                                                    cublasLtGetStatusString(s));
}

#define LT(expr)                                          \
  do {                                                    \
    cublasStatus_t s_ = (expr);                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) return LtError(#expr, s_); \
  } while (0)

struct Descriptors {  // released on every path out
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

ffi::Error Fp8BlockGemm(cudaStream_t stream, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::F32> x_scale, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> w_scale,
                        ffi::ResultBuffer<ffi::BF16> y) {
  if (x.element_type() != ffi::DataType::F8E4M3FN || w.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("moejax_fp8_block_gemm: x and w must be float8_e4m3fn");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("moejax_fp8_block_gemm: x [M, K], w [N, K] and y [M, N] disagree");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (K % 128 || N % 16)
    return ffi::Error::InvalidArgument("moejax_fp8_block_gemm: K must be a multiple of 128 and N of 16, got K=" +
                                       std::to_string(K) + ", N=" + std::to_string(N));
  const int64_t KB = K / 128, NB = (N + 127) / 128, KB4 = (KB + 3) / 4 * 4;
  if (M % 4)
    return ffi::Error::InvalidArgument("moejax_fp8_block_gemm: M must be a multiple of 4 (the activation scales' "
                                       "leading dimension), got M=" + std::to_string(M));
  if (x_scale.element_count() != static_cast<size_t>(M * KB) ||
      w_scale.element_count() != static_cast<size_t>(NB * KB4))
    return ffi::Error::InvalidArgument("moejax_fp8_block_gemm: x_scale must hold K/128 x M and w_scale "
                                       "ceil(N/128) x K/128 rounded up to 4 float32 values");
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return ffi::Error::Internal("moejax_fp8_block_gemm: cudaGetDevice failed");
  cublasLtHandle_t handle;
  void* workspace = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = handles.find(dev);
    if (it == handles.end()) {
      LT(cublasLtCreate(&handle));
      handles[dev] = handle;
    } else {
      handle = it->second;
    }
    auto wt = workspaces.find(dev);
    if (wt == workspaces.end()) {
      // The first call may come while XLA captures a graph: allocate outside the capture's rules.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      cudaThreadExchangeStreamCaptureMode(&mode);
      cudaError_t e = cudaMalloc(&workspace, kWorkspaceBytes);
      cudaThreadExchangeStreamCaptureMode(&mode);
      if (e != cudaSuccess)
        return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                          std::string("moejax_fp8_block_gemm: workspace: ") + cudaGetErrorString(e));
      workspaces[dev] = workspace;
    } else {
      workspace = wt->second;
    }
  }
  Descriptors ds;
  LT(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const void* sa = w_scale.untyped_data();
  const void* sb = x_scale.untyped_data();
  LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
  LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
  LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  LT(cublasLtMatrixLayoutCreate(&ds.a, CUDA_R_8F_E4M3, K, N, K));
  LT(cublasLtMatrixLayoutCreate(&ds.b, CUDA_R_8F_E4M3, K, M, K));
  LT(cublasLtMatrixLayoutCreate(&ds.d, CUDA_R_16BF, N, M, N));
  cublasLtMatmulAlgo_t algo;
  const auto key = std::make_tuple(dev, M, N, K);
  bool have = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = algos.find(key);
    if (it != algos.end()) {
      algo = it->second;
      have = true;
    }
  }
  if (!have) {  // the heuristic's first choice, once a shape (it costs host time every step otherwise)
    LT(cublasLtMatmulPreferenceCreate(&ds.pref));
    LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes,
                                            sizeof(kWorkspaceBytes)));
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(handle, ds.op, ds.a, ds.b, ds.d, ds.d, ds.pref, 1, &result, &found));
    if (found == 0)
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "moejax_fp8_block_gemm: cuBLASLt has no block-scaled FP8 algorithm here (needs cuBLAS "
                        "12.9+ on compute capability 9.0)");
    algo = result.algo;
    std::lock_guard<std::mutex> lock(mu);
    algos[key] = algo;
  }
  const float alpha = 1.0f, beta = 0.0f;
  LT(cublasLtMatmul(handle, ds.op, &alpha, w.untyped_data(), ds.a, x.untyped_data(), ds.b, &beta,
                    y->untyped_data(), ds.d, y->untyped_data(), ds.d, &algo, workspace, kWorkspaceBytes, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxFp8BlockGemm, Fp8BlockGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>(),
                              {ffi::Traits::kCmdBufferCompatible});
