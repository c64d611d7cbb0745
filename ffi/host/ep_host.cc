// The host (CPU) implementation of the dispatch/combine contract (ep_contract.h): the contract's
// reference, run in CI on N host devices. Each rank's handler meets its peers in a Rendezvous,
// then pulls what is addressed to it straight from their XLA-owned input buffers into its own
// XLA-owned outputs: no staging copy, one pass over the data, as MoRI's intra-node kernels do
// over P2P. Rows are ordered by (source rank, source token), so results are deterministic.
#include <chrono>
#include <cstring>

#include "../ep_contract.h"
#include "rendezvous.h"

namespace moejax_ffi {
namespace {

constexpr int kDispatch = 0, kCombine = 1;

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = mant;
    do { ++e; m <<= 1; } while (!(m & 0x400));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Adds `n` values of a y row (f32, bf16 or f16) into `acc`.
void AccumulateRow(ffi::DataType type, const void* row, int64_t n, float* acc) {
  if (type == ffi::DataType::F32) {
    const float* p = static_cast<const float*>(row);
    for (int64_t i = 0; i < n; ++i) acc[i] += p[i];
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(row);
    if (type == ffi::DataType::BF16)
      for (int64_t i = 0; i < n; ++i) acc[i] += BFloat16ToFloat(p[i]);
    else
      for (int64_t i = 0; i < n; ++i) acc[i] += HalfToFloat(p[i]);
  }
}

ffi::Error Fail(const std::string& why) { return ffi::Error(ffi::ErrorCode::kInternal, why); }

ffi::Error DispatchHost(ffi::RunId run, ffi::AnyBuffer x, ffi::AnyBuffer slots, ffi::AnyBuffer weights,
                        ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> rank_buf, ffi::Result<ffi::AnyBuffer> recv_x,
                        ffi::Result<ffi::AnyBuffer> recv_ids, ffi::Result<ffi::AnyBuffer> recv_w,
                        ffi::Result<ffi::AnyBuffer> recv_scales, ffi::Result<ffi::AnyBuffer> recv_src,
                        ffi::Result<ffi::AnyBuffer> expert_counts, ffi::Result<ffi::Buffer<ffi::S32>> num_recv,
                        int64_t n_ranks, int64_t experts_per_rank, int64_t op_id, int64_t timeout_ms) {
  auto shape = CheckDispatch("moejax_ep_dispatch", x, slots, weights, scales, *recv_x, *recv_ids, *recv_w,
                             *recv_scales, *recv_src, *expert_counts, n_ranks, experts_per_rank);
  if (shape.has_error()) return shape.error();
  const DispatchShape s = shape.value();
  if (slots.element_type() != ffi::DataType::S32 || weights.element_type() != ffi::DataType::F32 ||
      scales.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("moejax_ep_dispatch: slots must be int32, weights and scales float32");
  const int rank = rank_buf.typed_data()[0];
  const size_t row_bytes = s.hidden * ffi::ByteWidth(x.element_type());
  Published mine{{x.untyped_data(), slots.untyped_data(), weights.untyped_data(), scales.untyped_data()},
                 {s.tokens, s.hidden, s.topk, s.scale_dim, s.experts_per_rank, static_cast<int64_t>(x.element_type())}};

  char* out_x = static_cast<char*>(recv_x->untyped_data());
  int32_t* out_ids = recv_ids->reinterpret_data<int32_t>();
  float* out_w = recv_w->reinterpret_data<float>();
  float* out_scales = recv_scales->reinterpret_data<float>();
  int32_t* out_src = recv_src->reinterpret_data<int32_t>();
  int32_t* counts = expert_counts->reinterpret_data<int32_t>();
  std::string bad_slot;
  auto pull = [&](const std::vector<Published>& peers) {
    const int64_t E = s.experts_per_rank, k = s.topk, S = s.scale_dim, n_slots = s.n_ranks * E;
    std::fill(counts, counts + E, 0);
    int64_t row = 0;
    for (int64_t src = 0; src < s.n_ranks; ++src) {
      const char* px = static_cast<const char*>(peers[src].buffers[0]);
      const int32_t* ps = static_cast<const int32_t*>(peers[src].buffers[1]);
      const float* pw = static_cast<const float*>(peers[src].buffers[2]);
      const float* pscale = static_cast<const float*>(peers[src].buffers[3]);
      for (int64_t t = 0; t < s.tokens; ++t) {
        bool mine_too = false;
        for (int64_t j = 0; j < k; ++j) {
          const int32_t slot = ps[t * k + j];
          if (slot < -1 || slot >= n_slots) {
            bad_slot = "slot " + std::to_string(slot) + " of rank " + std::to_string(src) + " token " +
                       std::to_string(t) + " outside [-1, " + std::to_string(n_slots) + ")";
            return;
          }
          mine_too |= slot >= 0 && slot / E == rank;
        }
        if (!mine_too) continue;
        std::memcpy(out_x + row * row_bytes, px + t * row_bytes, row_bytes);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t slot = ps[t * k + j];
          const bool here = slot >= 0 && slot / E == rank;
          out_ids[row * k + j] = here ? slot % E : -1;
          out_w[row * k + j] = here ? pw[t * k + j] : 0.0f;
          if (here) ++counts[slot % E];
        }
        if (S) std::memcpy(out_scales + row * S, pscale + t * S, S * sizeof(float));
        out_src[row] = static_cast<int32_t>(src * s.tokens + t);
        ++row;
      }
    }
    num_recv->typed_data()[0] = static_cast<int32_t>(row);
    const int64_t cap = s.capacity();  // the unused rows, as the contract fixes them
    std::memset(out_x + row * row_bytes, 0, (cap - row) * row_bytes);
    std::fill(out_ids + row * k, out_ids + cap * k, -1);
    std::fill(out_w + row * k, out_w + cap * k, 0.0f);
    std::fill(out_scales + row * S, out_scales + cap * S, 0.0f);
    std::fill(out_src + row, out_src + cap, -1);
  };
  std::string err = Rendezvous::Run({run.run_id, op_id, kDispatch}, rank, static_cast<int>(n_ranks), std::move(mine),
                                    std::chrono::milliseconds(timeout_ms), pull);
  if (!err.empty()) return Fail(err);
  if (!bad_slot.empty()) return ffi::Error::InvalidArgument("moejax_ep_dispatch: " + bad_slot);
  return ffi::Error::Success();
}

ffi::Error CombineHost(ffi::RunId run, ffi::AnyBuffer y, ffi::AnyBuffer recv_src, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t n_ranks, int64_t op_id, int64_t timeout_ms) {
  const auto yd = y.dimensions(), od = out->dimensions();
  const ffi::DataType type = y.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("moejax_ep_combine: y must be float32, bfloat16 or float16");
  if (od.size() != 2 || yd.size() != 2 || yd[0] != n_ranks * od[0] || yd[1] != od[1])
    return ffi::Error::InvalidArgument("moejax_ep_combine: y must be [R*T, H] for out [T, H], got y " + Dims(yd) +
                                       ", out " + Dims(od) + ", R " + std::to_string(n_ranks));
  if (recv_src.element_type() != ffi::DataType::S32 || recv_src.dimensions().size() != 1 ||
      recv_src.dimensions()[0] != yd[0])
    return ffi::Error::InvalidArgument("moejax_ep_combine: recv_src must be int32 [R*T]");
  const int64_t T = od[0], H = od[1], cap = yd[0];
  const int rank = rank_buf.typed_data()[0];
  const size_t row_bytes = H * ffi::ByteWidth(type);
  Published mine{{y.untyped_data(), recv_src.untyped_data()}, {T, H, static_cast<int64_t>(type)}};
  float* o = out->typed_data();
  auto pull = [&](const std::vector<Published>& peers) {
    std::fill(o, o + T * H, 0.0f);
    for (int64_t r = 0; r < n_ranks; ++r) {  // rank order: the a2a backend's summation order
      const char* py = static_cast<const char*>(peers[r].buffers[0]);
      const int32_t* psrc = static_cast<const int32_t*>(peers[r].buffers[1]);
      for (int64_t row = 0; row < cap && psrc[row] >= 0; ++row)
        if (psrc[row] / T == rank) AccumulateRow(type, py + row * row_bytes, H, o + (psrc[row] % T) * H);
    }
  };
  std::string err = Rendezvous::Run({run.run_id, op_id, kCombine}, rank, static_cast<int>(n_ranks), std::move(mine),
                                    std::chrono::milliseconds(timeout_ms), pull);
  if (!err.empty()) return Fail(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moejax_ffi

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxEpDispatchHost, moejax_ffi::DispatchHost,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::AnyBuffer>()          // slots
                                  .Arg<ffi::AnyBuffer>()          // weights
                                  .Arg<ffi::AnyBuffer>()          // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rank
                                  .Ret<ffi::AnyBuffer>()          // recv_x
                                  .Ret<ffi::AnyBuffer>()          // recv_ids
                                  .Ret<ffi::AnyBuffer>()          // recv_w
                                  .Ret<ffi::AnyBuffer>()          // recv_scales
                                  .Ret<ffi::AnyBuffer>()          // recv_src
                                  .Ret<ffi::AnyBuffer>()          // expert_counts
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_recv
                                  .Attr<int64_t>("n_ranks")
                                  .Attr<int64_t>("experts_per_rank")
                                  .Attr<int64_t>("op_id")
                                  .Attr<int64_t>("timeout_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxEpCombineHost, moejax_ffi::CombineHost,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()          // y
                                  .Arg<ffi::AnyBuffer>()          // recv_src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rank
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<int64_t>("n_ranks")
                                  .Attr<int64_t>("op_id")
                                  .Attr<int64_t>("timeout_ms"));
