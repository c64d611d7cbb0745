#include "layout_kernels.h"

#include <hip/hip_bfloat16.h>
#include <hip/hip_runtime.h>

#include <algorithm>

namespace moejax_ffi {
namespace {

// One block per row (grid-stride).
__global__ void UnpackDispatch(UnpackArgs a) {
  const int32_t n = *a.total;
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.num_recv = n;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const bool live = row < n;
    uint8_t* dst = a.out_x + row * a.row_bytes;
    const uint8_t* src = a.tokens + row * a.row_bytes;
    if (a.row_bytes % 16 == 0) {  // XLA's and MoRI's buffers are 256-byte aligned
      for (int64_t i = threadIdx.x; i < a.row_bytes / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(dst)[i] = live ? reinterpret_cast<const uint4*>(src)[i] : uint4{0, 0, 0, 0};
    } else {
      for (int64_t i = threadIdx.x; i < a.row_bytes; i += blockDim.x) dst[i] = live ? src[i] : 0;
    }
    for (int64_t j = threadIdx.x; j < a.topk; j += blockDim.x) {
      const int32_t slot = live ? a.slots[row * a.topk + j] : -1;
      // a slot -1 (padding) reached rank 0 (MoRI's destPe = -1 / E = 0) and is local nowhere
      const bool here = slot >= 0 && slot / a.experts_per_rank == a.rank;
      const int32_t local = here ? static_cast<int32_t>(slot % a.experts_per_rank) : -1;
      a.out_ids[row * a.topk + j] = local;
      a.out_w[row * a.topk + j] = here ? a.weights[row * a.topk + j] : 0.0f;
      if (here) atomicAdd(a.counts + local, 1);
    }
    for (int64_t j = threadIdx.x; j < a.scale_dim; j += blockDim.x)
      a.out_scales[row * a.scale_dim + j] = live ? a.scales[row * a.scale_dim + j] : 0.0f;
    if (threadIdx.x == 0) a.out_src[row] = live ? a.src[row] : -1;
  }
}

template <typename T>
__global__ void WidenCombineOutput(const T* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = static_cast<float>(in[i]);
}

}  // namespace

hipError_t LaunchUnpackDispatch(const UnpackArgs& args, hipStream_t stream) {
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(args.rows, 1024)));
  hipLaunchKernelGGL(UnpackDispatch, dim3(grid), dim3(256), 0, stream, args);
  return hipGetLastError();
}

hipError_t LaunchWidenCombineOutput(const void* sum, bool bfloat16, float* out, int64_t n, hipStream_t stream) {
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 4096)));
  if (bfloat16)
    hipLaunchKernelGGL(WidenCombineOutput<hip_bfloat16>, dim3(grid), dim3(256), 0, stream,
                       static_cast<const hip_bfloat16*>(sum), out, n);
  else
    hipLaunchKernelGGL(WidenCombineOutput<float>, dim3(grid), dim3(256), 0, stream, static_cast<const float*>(sum), out, n);
  return hipGetLastError();
}

}  // namespace moejax_ffi
