// The contract every expert dispatch/combine implementation (host, MoRI) satisfies; docs/ffi.md
// describes it in full. Per rank, inside jax.shard_map over the expert-parallel axis:
//
// dispatch(x [T, H], slots [T, k] int32, weights [T, k] f32, scales [T, S] f32, rank [] int32)
//   attrs n_ranks R, experts_per_rank E, op_id, timeout_ms
//   -> recv_x [R*T, H] (x's dtype), recv_ids [R*T, k] int32, recv_w [R*T, k] f32,
//      recv_scales [R*T, S] f32, recv_src [R*T] int32, expert_counts [E] int32, num_recv [] int32
//   slots: the physical expert slot of each choice (rank = slot / E), -1 = not sent (padding).
//   A token goes at most once to each rank owning one of its choices and takes one row
//   i < num_recv there (row order: the implementation's; host: by source rank, then token;
//   MoRI: arrival order), with recv_ids the local expert index (slot % E) of each of its
//   choices on this rank (-1 for the others), their weights (0 for the others), its
//   scales, and recv_src = source rank * T + source token. Rows >= num_recv: x 0, ids -1,
//   w 0, scales 0, src -1. R*T rows is the worst case (every token of every rank to this
//   one), so nothing is ever dropped. expert_counts: (token, expert) pairs per local expert.
//
// combine(y [R*T, H] f32/bf16/f16, recv_src [R*T] int32, rank [] int32)
//   attrs n_ranks R, op_id, timeout_ms -> out [T, H] f32
//   out[t] = the sum, over every rank's rows whose recv_src is rank * T + t, of y's row
//   (the receiver already applied the routing weights and summed its local experts: one
//   partial row per (token, rank) travels back, as in MoRI and the a2a backend).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace moejax_ffi {

namespace ffi = xla::ffi;

// The static sizes of one dispatch, as read from its buffers.
struct DispatchShape {
  int64_t tokens = 0, hidden = 0, topk = 0, scale_dim = 0, n_ranks = 0, experts_per_rank = 0;
  int64_t capacity() const { return n_ranks * tokens; }
};

inline std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Checks every operand and result against the contract; the error names what does not fit.
inline ffi::ErrorOr<DispatchShape> CheckDispatch(
    const char* op, ffi::AnyBuffer x, ffi::AnyBuffer slots, ffi::AnyBuffer weights, ffi::AnyBuffer scales,
    ffi::AnyBuffer recv_x, ffi::AnyBuffer recv_ids, ffi::AnyBuffer recv_w, ffi::AnyBuffer recv_scales,
    ffi::AnyBuffer recv_src, ffi::AnyBuffer expert_counts, int64_t n_ranks, int64_t experts_per_rank) {
  auto bad = [&](const std::string& what) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(std::string(op) + ": " + what));
  };
  if (x.dimensions().size() != 2) return bad("x must be [T, H], got " + Dims(x.dimensions()));
  DispatchShape s;
  s.tokens = x.dimensions()[0];
  s.hidden = x.dimensions()[1];
  s.n_ranks = n_ranks;
  s.experts_per_rank = experts_per_rank;
  if (n_ranks < 1 || experts_per_rank < 1) return bad("n_ranks and experts_per_rank must be >= 1");
  if (slots.dimensions().size() != 2 || slots.dimensions()[0] != s.tokens)
    return bad("slots must be [T, k] with T = " + std::to_string(s.tokens) + ", got " + Dims(slots.dimensions()));
  s.topk = slots.dimensions()[1];
  if (weights.dimensions().size() != 2 || weights.dimensions()[0] != s.tokens || weights.dimensions()[1] != s.topk)
    return bad("weights must have slots' shape, got " + Dims(weights.dimensions()));
  if (scales.dimensions().size() != 2 || scales.dimensions()[0] != s.tokens)
    return bad("scales must be [T, S] (S = 0: none), got " + Dims(scales.dimensions()));
  s.scale_dim = scales.dimensions()[1];
  const int64_t cap = s.capacity();
  auto want = [](ffi::AnyBuffer b, std::initializer_list<int64_t> dims) {
    auto d = b.dimensions();
    if (d.size() != dims.size()) return false;
    size_t i = 0;
    for (int64_t v : dims)
      if (d[i++] != v) return false;
    return true;
  };
  if (!want(recv_x, {cap, s.hidden}) || recv_x.element_type() != x.element_type())
    return bad("recv_x must be [R*T, H] = [" + std::to_string(cap) + ", " + std::to_string(s.hidden) +
               "] of x's dtype, got " + Dims(recv_x.dimensions()));
  if (!want(recv_ids, {cap, s.topk}) || !want(recv_w, {cap, s.topk}))
    return bad("recv_ids and recv_w must be [R*T, k]");
  if (!want(recv_scales, {cap, s.scale_dim})) return bad("recv_scales must be [R*T, S]");
  if (!want(recv_src, {cap})) return bad("recv_src must be [R*T]");
  if (!want(expert_counts, {experts_per_rank})) return bad("expert_counts must be [E]");
  const bool types_ok = recv_ids.element_type() == ffi::DataType::S32 && recv_w.element_type() == ffi::DataType::F32 &&
                        recv_scales.element_type() == ffi::DataType::F32 &&
                        recv_src.element_type() == ffi::DataType::S32 &&
                        expert_counts.element_type() == ffi::DataType::S32;
  if (!types_ok) return bad("recv_ids, recv_src and expert_counts must be int32, recv_w and recv_scales float32");
  return s;
}

}  // namespace moejax_ffi
