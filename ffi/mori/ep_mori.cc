// The MoRI implementation of the dispatch/combine contract (ffi/ep_contract.h) on ROCm: MoRI's
// intra-node kernels (amd-mori, mori/ops/dispatch_combine/launch.hpp, its C++ API) move the tokens
// over P2P; two small kernels of ours (layout_kernels.hip) convert between MoRI's buffers and the
// contract's layout. Host C++: MoRI's headers are meant to compile as plain C++ here.
//
// Buffers (docs/ffi.md says the same):
// - dispatch reads x, weights, scales and slots straight from XLA's buffers (MoRI's senders copy
//   from any device pointer), no copy in;
// - dispatch results are written by the *peers* into MoRI's symmetric buffers: XLA's outputs are
//   not symmetric memory, so MoRI's API cannot target them, and LaunchUnpackDispatch copies each
//   row once into XLA's outputs, fused with the layout conversion (global slot -> local expert
//   index, other ranks' weights zeroed, counts, empty rows);
// - combine runs MoRI's "_nop2p" kernel (useExternalInpBuffer): each rank pushes its rows from
//   XLA's y straight into the owners' staging buffers, no local copy in;
// - combine's sum lands in MoRI's buffer (LaunchCombine passes no output pointer), and
//   LaunchWidenCombineOutput copies it once into XLA's float32 output.
//
// MoRI's shmem state is one PE per process (amd-mori 1.0.0: ShmemStatesSingleton), so this runs
// one process per GPU, the PE being the process (moejax/parallel/ffi_library.py initialises it
// and refuses a process with several GPUs). Only the IntraNode kernels are wired (one node).
#include <hip/hip_runtime_api.h>
#include <hip/library_types.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "../ep_contract.h"
#include "layout_kernels.h"
#include "mori/ops/dispatch_combine/dispatch_combine.hpp"
#include "mori/ops/dispatch_combine/launch.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace moejax_ffi {
namespace {

namespace moe = mori::moe;

// The token dtypes MoRI's kernels are instantiated for (launch.cpp's dtype_suffix).
std::optional<hipDataType> MoriType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return HIP_R_32F;
    case ffi::DataType::BF16: return HIP_R_16BF;
    case ffi::DataType::F8E4M3FN: return HIP_R_8F_E4M3;
    case ffi::DataType::F8E4M3FNUZ: return HIP_R_8F_E4M3_FNUZ;
    default: return std::nullopt;
  }
}

// One MoRI handle per dispatch shape: its symmetric buffers are sized for T tokens per rank, and
// MoRI's "source token" ids (src rank * maxNumInpTokenPerRank + token) then equal the contract's.
using HandleKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;  // R, T, H, S, E, k

std::mutex handles_mu;
std::map<HandleKey, std::unique_ptr<moe::EpDispatchCombineHandle>>& Handles() {
  static auto* handles = new std::map<HandleKey, std::unique_ptr<moe::EpDispatchCombineHandle>>();
  return *handles;
}

HandleKey KeyOf(const DispatchShape& s) {
  return {s.n_ranks, s.tokens, s.hidden, s.scale_dim, s.experts_per_rank, s.topk};
}

// MoRI must move the tokens as they are (the contract: FP8 tokens arrive as FP8 with their scales,
// bf16 as bf16). The pinned amd-mori 1.0.0 (pyproject.toml's rocm extra; 1.1.1-1.2.4 likewise) says
// so with quantType; MoRI's sources before quantType (ROCm/mori b68a9846, for one) have
// enableInternalFp8Quant instead. Each is set only where the headers declare it: either compiles.
template <typename Config>
void SetNoMoriQuantisation(Config& c) {
  if constexpr (requires { c.quantType; }) c.quantType = std::remove_cvref_t<decltype(c.quantType)>::None;
  // Off: it defaults to true where it exists, and MoRI must not cast our tokens to FP8 itself.
  if constexpr (requires { c.enableInternalFp8Quant; }) c.enableInternalFp8Quant = false;
}

// Creates the handle (collective symmetric allocations: every PE initialises the same programs in
// the same order) and loads MoRI's kernels: host work that must not happen while XLA captures a
// command buffer, hence in the initialize stage.
ffi::Error EnsureHandle(const DispatchShape& s) {
  if (s.topk > MAX_EXPERTS_PER_TOKEN)
    return ffi::Error::InvalidArgument("moejax_ep_dispatch (MoRI): top-k " + std::to_string(s.topk) +
                                       " exceeds MoRI's MAX_EXPERTS_PER_TOKEN " + std::to_string(MAX_EXPERTS_PER_TOKEN));
  const int pes = mori::shmem::ShmemNPes();
  if (pes != s.n_ranks)
    return ffi::Error::InvalidArgument("moejax_ep_dispatch (MoRI): MoRI has " + std::to_string(pes) +
                                       " PEs (one per process) but the expert-parallel axis has " +
                                       std::to_string(s.n_ranks) + " ranks");
  std::lock_guard<std::mutex> g(handles_mu);
  auto& h = Handles()[KeyOf(s)];
  if (h) return ffi::Error::Success();
  moe::EpDispatchCombineConfig c;
  c.rank = mori::shmem::ShmemMyPe();
  c.worldSize = pes;
  c.hiddenDim = static_cast<int>(s.hidden);
  c.scaleDim = static_cast<int>(s.scale_dim);
  c.scaleTypeSize = sizeof(float);
  c.maxTokenTypeSize = sizeof(float);  // the widest token: float32 dispatch or combine
  c.maxNumInpTokenPerRank = static_cast<int>(s.tokens);
  c.numExpertPerRank = static_cast<int>(s.experts_per_rank);
  c.numExpertPerToken = static_cast<int>(s.topk);
  c.warpNumPerBlock = 8;  // mori.ops.EpDispatchCombineConfig's defaults
  c.blockNum = 80;
  c.useExternalInpBuffer = true;  // combine pushes from XLA's y: the "_nop2p" kernel
  c.kernelType = moe::KernelType::IntraNode;
  c.gpuPerNode = pes;
  SetNoMoriQuantisation(c);  // quantType None / enableInternalFp8Quant false: tokens unchanged
  try {
    auto& registry = moe::KernelRegistry::Instance();
    if (!registry.IsLoaded()) registry.AutoLoad();
    h = std::make_unique<moe::EpDispatchCombineHandle>(c);
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("moejax_ep_dispatch (MoRI): ") + e.what());
  }
  return ffi::Error::Success();
}

moe::EpDispatchCombineHandle* FindHandle(const HandleKey& key) {
  std::lock_guard<std::mutex> g(handles_mu);
  auto it = Handles().find(key);
  return it == Handles().end() ? nullptr : it->second.get();
}

// The handle a combine of [R*T, H] rows belongs to: the one its dispatch used (MoRI keeps the
// dispatch's routing maps in it).
moe::EpDispatchCombineHandle* FindHandleForCombine(int64_t R, int64_t T, int64_t H, std::string* why) {
  std::lock_guard<std::mutex> g(handles_mu);
  moe::EpDispatchCombineHandle* found = nullptr;
  for (auto& [key, h] : Handles()) {
    if (std::get<0>(key) != R || std::get<1>(key) != T || std::get<2>(key) != H) continue;
    if (found) {
      *why = "two dispatch configurations share [R*T, H]; combine cannot tell which it follows";
      return nullptr;
    }
    found = h.get();
  }
  if (!found) *why = "no dispatch of this shape ran before it";
  return found;
}

ffi::Error HipError(const char* op, hipError_t e) {
  return e == hipSuccess ? ffi::Error::Success()
                         : ffi::Error(ffi::ErrorCode::kInternal, std::string(op) + " (MoRI): " + hipGetErrorString(e));
}

ffi::ErrorOr<DispatchShape> CheckedShape(ffi::AnyBuffer x, ffi::AnyBuffer slots, ffi::AnyBuffer weights,
                                         ffi::AnyBuffer scales, ffi::AnyBuffer recv_x, ffi::AnyBuffer recv_ids,
                                         ffi::AnyBuffer recv_w, ffi::AnyBuffer recv_scales, ffi::AnyBuffer recv_src,
                                         ffi::AnyBuffer counts, int64_t n_ranks, int64_t experts_per_rank) {
  if (!MoriType(x.element_type()))
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        "moejax_ep_dispatch (MoRI): tokens must be float32, bfloat16 or float8_e4m3fn(uz), MoRI's kernel types"));
  return CheckDispatch("moejax_ep_dispatch (MoRI)", x, slots, weights, scales, recv_x, recv_ids, recv_w,
                       recv_scales, recv_src, counts, n_ranks, experts_per_rank);
}

ffi::Error DispatchInitialize(ffi::AnyBuffer x, ffi::AnyBuffer slots, ffi::AnyBuffer weights, ffi::AnyBuffer scales,
                              ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_ids,
                              ffi::Result<ffi::AnyBuffer> recv_w, ffi::Result<ffi::AnyBuffer> recv_scales,
                              ffi::Result<ffi::AnyBuffer> recv_src, ffi::Result<ffi::AnyBuffer> counts,
                              ffi::Result<ffi::AnyBuffer>, int64_t n_ranks, int64_t experts_per_rank, int64_t, int64_t) {
  auto s = CheckedShape(x, slots, weights, scales, *recv_x, *recv_ids, *recv_w, *recv_scales, *recv_src, *counts,
                        n_ranks, experts_per_rank);
  if (s.has_error()) return s.error();
  return EnsureHandle(s.value());
}

// The rank operand is not read: MoRI's rank is its PE (this process), which the mesh's
// expert-parallel axis order must match (moejax/parallel/ffi_library.py checks the processes).
ffi::Error DispatchExecute(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer slots, ffi::AnyBuffer weights,
                           ffi::AnyBuffer scales, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> recv_x,
                           ffi::Result<ffi::AnyBuffer> recv_ids, ffi::Result<ffi::AnyBuffer> recv_w,
                           ffi::Result<ffi::AnyBuffer> recv_scales, ffi::Result<ffi::AnyBuffer> recv_src,
                           ffi::Result<ffi::AnyBuffer> counts, ffi::Result<ffi::AnyBuffer> num_recv, int64_t n_ranks,
                           int64_t experts_per_rank, int64_t, int64_t) {
  auto shape = CheckedShape(x, slots, weights, scales, *recv_x, *recv_ids, *recv_w, *recv_scales, *recv_src, *counts,
                            n_ranks, experts_per_rank);
  if (shape.has_error()) return shape.error();
  const DispatchShape s = shape.value();
  moe::EpDispatchCombineHandle* h = FindHandle(KeyOf(s));
  if (!h) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "moejax_ep_dispatch (MoRI): no handle; the initialize stage did not run");
  if (auto e = HipError("moejax_ep_dispatch", hipMemsetAsync(counts->untyped_data(), 0, counts->size_bytes(), stream)); e.failure())
    return e;
  try {
    moe::LaunchDispatch(*h, x.untyped_data(), weights.untyped_data(), s.scale_dim ? scales.untyped_data() : nullptr,
                        slots.untyped_data(), s.tokens, *MoriType(x.element_type()), -1, -1, -1, stream,
                        static_cast<int>(s.hidden));
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("moejax_ep_dispatch (MoRI): ") + e.what());
  }
  UnpackArgs a{static_cast<const uint8_t*>(h->shmemDispatchOutTokMemObj->localPtr),
               static_cast<const float*>(h->shmemDispatchOutWeightsMemObj->localPtr),
               static_cast<const int32_t*>(h->shmemOutIndicesMemObj->localPtr),
               s.scale_dim ? static_cast<const float*>(h->shmemOutScalesMemObj->localPtr) : nullptr,
               static_cast<const int32_t*>(h->dispTokIdToSrcTokIdMemObj->localPtr),
               h->totalRecvTokenNum,
               static_cast<uint8_t*>(recv_x->untyped_data()),
               recv_ids->reinterpret_data<int32_t>(),
               recv_w->reinterpret_data<float>(),
               recv_scales->reinterpret_data<float>(),
               recv_src->reinterpret_data<int32_t>(),
               counts->reinterpret_data<int32_t>(),
               num_recv->reinterpret_data<int32_t>(),
               s.capacity(),
               static_cast<int64_t>(s.hidden * ffi::ByteWidth(x.element_type())),
               s.topk,
               s.scale_dim,
               s.experts_per_rank,
               h->config.rank};
  return HipError("moejax_ep_dispatch", LaunchUnpackDispatch(a, stream));
}

struct CombineShape {
  int64_t tokens, hidden, n_ranks;
};

ffi::ErrorOr<CombineShape> CheckCombine(ffi::AnyBuffer y, ffi::AnyBuffer recv_src, ffi::AnyBuffer out, int64_t n_ranks) {
  const auto yd = y.dimensions(), od = out.dimensions();
  auto bad = [](const std::string& why) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument("moejax_ep_combine (MoRI): " + why));
  };
  if (y.element_type() != ffi::DataType::F32 && y.element_type() != ffi::DataType::BF16)
    return bad("y must be float32 or bfloat16 (MoRI's combine kernel types)");
  if (od.size() != 2 || yd.size() != 2 || yd[0] != n_ranks * od[0] || yd[1] != od[1])
    return bad("y must be [R*T, H] for out [T, H], got y " + Dims(yd) + ", out " + Dims(od));
  if (recv_src.dimensions().size() != 1 || recv_src.dimensions()[0] != yd[0]) return bad("recv_src must be [R*T]");
  return CombineShape{od[0], od[1], n_ranks};
}

ffi::Error CombineInitialize(ffi::AnyBuffer y, ffi::AnyBuffer recv_src, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                             int64_t n_ranks, int64_t, int64_t) {
  auto s = CheckCombine(y, recv_src, *out, n_ranks);
  if (s.has_error()) return s.error();
  std::string why;
  if (!FindHandleForCombine(s->n_ranks, s->tokens, s->hidden, &why))
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "moejax_ep_combine (MoRI): " + why);
  return ffi::Error::Success();
}

// recv_src is not read: MoRI's combine follows the routing maps its dispatch kept in the handle.
ffi::Error CombineExecute(hipStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer recv_src, ffi::AnyBuffer,
                          ffi::Result<ffi::AnyBuffer> out, int64_t n_ranks, int64_t, int64_t) {
  auto shape = CheckCombine(y, recv_src, *out, n_ranks);
  if (shape.has_error()) return shape.error();
  const CombineShape s = shape.value();
  std::string why;
  moe::EpDispatchCombineHandle* h = FindHandleForCombine(s.n_ranks, s.tokens, s.hidden, &why);
  if (!h) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "moejax_ep_combine (MoRI): " + why);
  const bool f32 = y.element_type() == ffi::DataType::F32;
  try {
    // no weights (the receiver applied them), no indices (the kernel uses the dispatch's maps)
    moe::LaunchCombine(*h, y.untyped_data(), nullptr, nullptr, s.tokens, f32 ? HIP_R_32F : HIP_R_16BF, -1, -1, -1,
                       /*use_external_inp_buf=*/1, stream, static_cast<int>(s.hidden));
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("moejax_ep_combine (MoRI): ") + e.what());
  }
  return HipError("moejax_ep_combine", LaunchWidenCombineOutput(h->shmemCombineOutTokMemObj->localPtr, !f32,
                                                                 out->reinterpret_data<float>(),
                                                                 s.tokens * s.hidden, stream));
}

}  // namespace
}  // namespace moejax_ffi

namespace ffi = xla::ffi;

#define MOEJAX_DISPATCH_SIGNATURE                                                                   \
  .Arg<ffi::AnyBuffer>()        /* x */                                                             \
      .Arg<ffi::AnyBuffer>()    /* slots */                                                         \
      .Arg<ffi::AnyBuffer>()    /* weights */                                                       \
      .Arg<ffi::AnyBuffer>()    /* scales */                                                        \
      .Arg<ffi::AnyBuffer>()    /* rank */                                                          \
      .Ret<ffi::AnyBuffer>()    /* recv_x */                                                        \
      .Ret<ffi::AnyBuffer>()    /* recv_ids */                                                      \
      .Ret<ffi::AnyBuffer>()    /* recv_w */                                                        \
      .Ret<ffi::AnyBuffer>()    /* recv_scales */                                                   \
      .Ret<ffi::AnyBuffer>()    /* recv_src */                                                      \
      .Ret<ffi::AnyBuffer>()    /* expert_counts */                                                 \
      .Ret<ffi::AnyBuffer>()    /* num_recv */                                                      \
      .Attr<int64_t>("n_ranks")                                                                     \
      .Attr<int64_t>("experts_per_rank")                                                            \
      .Attr<int64_t>("op_id")                                                                       \
      .Attr<int64_t>("timeout_ms")

#define MOEJAX_COMBINE_SIGNATURE                                                                    \
  .Arg<ffi::AnyBuffer>()        /* y */                                                             \
      .Arg<ffi::AnyBuffer>()    /* recv_src */                                                      \
      .Arg<ffi::AnyBuffer>()    /* rank */                                                          \
      .Ret<ffi::AnyBuffer>()    /* out */                                                           \
      .Attr<int64_t>("n_ranks")                                                                     \
      .Attr<int64_t>("op_id")                                                                       \
      .Attr<int64_t>("timeout_ms")

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxEpDispatchMoriInitialize, moejax_ffi::DispatchInitialize,
                              ffi::Ffi::BindInitialize() MOEJAX_DISPATCH_SIGNATURE);
// Command-buffer compatible: execute only enqueues kernels and an async memset on XLA's stream;
// MoRI keeps its counters and barrier flags on the device and resets them in its kernels, and the
// host-side work (handle, kernel loading) is done in the initialize stage, so a captured graph
// replays correctly as long as every PE replays it.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxEpDispatchMori, moejax_ffi::DispatchExecute,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<hipStream_t>>() MOEJAX_DISPATCH_SIGNATURE,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxEpCombineMoriInitialize, moejax_ffi::CombineInitialize,
                              ffi::Ffi::BindInitialize() MOEJAX_COMBINE_SIGNATURE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxEpCombineMori, moejax_ffi::CombineExecute,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<hipStream_t>>() MOEJAX_COMBINE_SIGNATURE,
                              {ffi::Traits::kCmdBufferCompatible});

// Called by moejax/parallel/ffi_library.py (ctypes) before any handler runs: MoRI's shmem, one PE
// per process, bootstrapped from a unique id that rank 0 makes and JAX's distributed store shares.
// Each returns 0, or -1 with the reason in `error` (a buffer of `error_len` bytes).
namespace {
int Report(const std::string& why, char* error, int error_len) {
  if (error_len > 0) {
    std::snprintf(error, static_cast<size_t>(error_len), "%s", why.c_str());
  }
  return -1;
}
}  // namespace

extern "C" int MoejaxMoriUniqueIdBytes() { return MORI_SHMEM_UNIQUE_ID_BYTES; }

extern "C" int MoejaxMoriUniqueId(uint8_t* out, char* error, int error_len) {
  try {
    mori::shmem::mori_shmem_uniqueid_t uid;
    if (mori::shmem::ShmemGetUniqueId(&uid) != 0) return Report("ShmemGetUniqueId failed", error, error_len);
    std::copy(uid.begin(), uid.end(), out);
    return 0;
  } catch (const std::exception& e) {
    return Report(e.what(), error, error_len);
  }
}

extern "C" int MoejaxMoriInit(int device, int rank, int nranks, const uint8_t* uid_bytes, char* error, int error_len) {
  try {
    if (hipSetDevice(device) != hipSuccess) return Report("hipSetDevice(" + std::to_string(device) + ") failed", error, error_len);
    mori::shmem::mori_shmem_uniqueid_t uid;
    std::copy(uid_bytes, uid_bytes + uid.size(), uid.begin());
    mori::shmem::mori_shmem_init_attr_t attr;
    if (mori::shmem::ShmemSetAttrUniqueIdArgs(rank, nranks, &uid, &attr) != 0 ||
        mori::shmem::ShmemInitAttr(mori::shmem::MORI_SHMEM_INIT_WITH_UNIQUEID, &attr) != 0)
      return Report("MoRI shmem initialisation failed", error, error_len);
    return 0;
  } catch (const std::exception& e) {
    return Report(e.what(), error, error_len);
  }
}
