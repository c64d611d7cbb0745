// The two conversions between MoRI's buffers and the contract's layout (ffi/ep_contract.h), as
// HIP kernels behind plain C++ launchers, so ep_mori.cc stays host C++ (MoRI's CXX API).
#pragma once

#include <hip/hip_runtime_api.h>

#include <cstdint>

namespace moejax_ffi {

// MoRI's dispatch results (its symmetric buffers, rows in arrival order) -> the contract's outputs
// in XLA's buffers: rows copied once, global slots -> local expert indices (-1 elsewhere), other
// ranks' weights zeroed, per-expert counts (zeroed by the caller), rows past MoRI's count emptied.
struct UnpackArgs {
  const uint8_t* tokens;  // [rows, row_bytes]
  const float* weights;   // [rows, topk]
  const int32_t* slots;   // [rows, topk] global slots, as sent
  const float* scales;    // [rows, scale_dim] or null
  const int32_t* src;     // [rows] src rank * T + token
  const int32_t* total;   // rows MoRI received (device)
  uint8_t* out_x;
  int32_t* out_ids;
  float* out_w;
  float* out_scales;
  int32_t* out_src;
  int32_t* counts;
  int32_t* num_recv;
  int64_t rows, row_bytes, topk, scale_dim, experts_per_rank, rank;
};

hipError_t LaunchUnpackDispatch(const UnpackArgs& args, hipStream_t stream);

// MoRI's combine sum (float32 or bfloat16, [n]) -> XLA's float32 output.
hipError_t LaunchWidenCombineOutput(const void* sum, bool bfloat16, float* out, int64_t n, hipStream_t stream);

}  // namespace moejax_ffi
