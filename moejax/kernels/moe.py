"""Routed experts, bf16 (or f16 / f32) weights: x_sorted [N, H] rows grouped by expert through SwiGLU
experts [E, in, out]; the Pallas ``fused_moe``, the Triton-language ``fused_moe_triton`` or XLA's
``ragged_dot``. ``plan`` decides once from the shapes; ``run`` computes whichever path it names.

Measured: BENCHMARKS.md, "MoE and FP8 GEMM kernels" (tiles: the H200 sweep,
benchmarks/2026-12-02b/kernels_moe_sweep.txt; Pallas vs Triton: benchmarks/2026-12-06c/h100/rG).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels import common
from moejax.kernels.common import MOE_KERNEL_ENV, MOE_KERNELS, Plan, plan_reason, pow2, want_kernel
from pallas_kernels.fused_moe import fused_moe
from pallas_kernels.triton_block_fp8 import fused_moe_triton


# Pallas fused_moe tiles by rows an expert (up to the key; the last row: above): decode streams the
# weights (128-wide tiles read 256 B runs of each weight row); prefill is FLOP-bound (the biggest tiles
# that fit shared memory). ROCm: num_stages 2.
PALLAS_TILES = (
    (16, dict(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=64, num_warps=4, num_stages=3)),
    (32, dict(block_m=32, block_n=64, block_k=128, block_n_down=64, block_k_down=64, num_warps=4, num_stages=3)),
    # one 64-row tile an expert: 18% under the 32-row tile at 49 rows (benchmarks/2026-12-07c/h100/r4)
    (64, dict(block_m=64, block_n=128, block_k=64, block_n_down=64, block_k_down=64, num_warps=4, num_stages=3)),
    (256, dict(block_m=128, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=8, num_stages=3)),
    (None, dict(block_m=128, block_n=128, block_k=64, block_n_down=256, block_k_down=64, num_warps=8, num_stages=3)),
)
# Triton fused_moe_triton tiles (as the W8A8 kernel's sweep found): up to 16 rows an expert, above.
TRITON_TILES = (
    dict(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=64, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=8, num_stages=4),
)


def moe_kernel() -> str:
    """Which kernel runs the bf16 routed experts on a GPU where a kernel runs: "pallas" (``fused_moe``,
    which also takes the shared experts as extra groups) or "triton" (``fused_moe_triton`` through
    jax-triton; the shared experts then run beside it). The ``moe_kernel`` setting (or
    ``MOEJAX_MOE_KERNEL``) forces one ("triton" without jax-triton raises at the first call, naming the
    install). "auto" is Pallas: the Triton kernel measured level with it."""
    want = common.override("moe_kernel", MOE_KERNEL_ENV, MOE_KERNELS)
    return "pallas" if want == "auto" else want


def pallas_plan(num_rows: int, num_experts: int, hidden: int, inter: int, dtype, mode: str | None = None,
                tiles=PALLAS_TILES) -> Plan:
    """The Pallas ``fused_moe`` and its tiles (from ``tiles``), or XLA (the FP8 experts' plan starts from it
    too, with its own table)."""
    use, forced = want_kernel(mode)
    if not use:
        return Plan("xla", reason="mode or platform")
    if jnp.dtype(dtype) not in common.FLOAT_DTYPES:
        return Plan("xla", reason=f"dtype {jnp.dtype(dtype)}")
    if not forced and (hidden < 16 or inter < 16):
        return Plan("xla", reason="dims below the Triton dot minimum (16)")
    per_expert = num_rows / max(num_experts, 1)
    p = dict(next(t for upto, t in tiles if upto is None or per_expert <= upto))
    if common.platform() == "rocm":
        p["num_stages"] = 2
    cap = lambda b, d: max(16, min(b, pow2(d)))  # never tiles wider than the (power-of-two-rounded) dims
    p["block_n"], p["block_n_down"] = cap(p["block_n"], inter), cap(p["block_n_down"], hidden)
    p["block_k"], p["block_k_down"] = cap(p["block_k"], hidden), cap(p["block_k_down"], inter)
    return Plan("pallas", p, plan_reason(forced))


def triton_params(num_rows: int, num_experts: int) -> dict:
    p = dict(TRITON_TILES[0] if num_rows / max(num_experts, 1) <= 16 else TRITON_TILES[1])
    if common.platform() == "rocm":
        p["num_stages"] = 2
    return p


def plan(num_rows: int, num_experts: int, hidden: int, inter: int, dtype, mode: str | None = None,
         shared: bool = False) -> Plan:
    """"pallas" / "triton" (``moe_kernel``; with ``shared`` experts fused: Pallas) with its tiles, or "xla"."""
    p = pallas_plan(num_rows, num_experts, hidden, inter, dtype, mode)
    if p.path == "pallas" and not shared and moe_kernel() == "triton":
        return Plan("triton", triton_params(num_rows, num_experts), p.reason)
    return p


def fuse_shared_experts(num_experts: int, hidden: int, inter: int, dtype, mode: str | None = None) -> bool:
    """Whether the routed experts take the shared experts as extra groups: the ``shared_expert_fusion``
    setting, or "auto": where the Pallas kernel runs (one launch streams every expert weight), not on
    the XLA path (its fused form copies the shared weights each step)."""
    setting = common.shared_fusion_setting()
    if setting != "auto":
        return setting == "on"
    return plan(num_experts, num_experts, hidden, inter, dtype, mode).path == "pallas"


def run(x_sorted, group_sizes, w_gate, w_up, w_down, shared=(), mode: str | None = None):
    """x_sorted [N, H] rows grouped by expert -> [N, H] float32 (SiLU(x W_gate) * (x W_up)) W_down, the
    weights [E, in, out]; ``shared`` = (gate, up, down) shared experts in HF's [out, in] layout, width a
    multiple of the routed one, as groups after the routed ones (group_sizes [E + S])."""
    N, H = x_sorted.shape
    E, _, I = w_gate.shape
    pl = plan(N, E, H, I, x_sorted.dtype, mode, shared=bool(shared))
    if pl.path == "triton":
        return fused_moe_triton(x_sorted, group_sizes, w_gate, w_up, w_down, **pl.params)
    if pl.path == "pallas":
        return fused_moe(x_sorted, group_sizes, w_gate, w_up, w_down, *shared, **pl.params)
    if shared:
        return _xla_with_shared(x_sorted, group_sizes, w_gate, w_up, w_down, *shared)
    return xla(x_sorted, group_sizes, w_gate, w_up, w_down)


def xla(x_sorted, group_sizes, w_gate, w_up, w_down):
    f32 = jnp.float32
    g = jax.lax.ragged_dot(x_sorted, w_gate, group_sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(x_sorted, w_up, group_sizes, preferred_element_type=f32)
    h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
    return jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=f32)


def _xla_with_shared(x_sorted, group_sizes, w_gate, w_up, w_down, s_gate, s_up, s_down):
    """The XLA form of the fused layout: the routed groups through ragged_dot over the routed stack, the
    shared groups through ragged_dot over [zeros, shared experts] (the zero group spans the routed rows),
    so the same sorted rows and combine run as with the kernel. Builds the shared stack each call: a
    copy of the shared weights (the fallback path; ``shared_expert_fusion("auto")`` keeps XLA unfused)."""
    f32, E, I = jnp.float32, w_gate.shape[0], w_gate.shape[2]
    S = s_gate.shape[0] // I
    N, H = x_sorted.shape
    gs_routed = group_sizes[:E]
    n_routed = gs_routed.sum()
    gs_shared = jnp.concatenate([n_routed[None], group_sizes[E:]])
    row = jnp.arange(N)
    is_shared = ((row >= n_routed) & (row < group_sizes.sum()))[:, None]

    def stack(a):  # [S*I, H] (HF [out, in]) -> [1 + S, H, I] ([in, out]), a zero expert first
        a = jnp.swapaxes(a.reshape(S, I, H), 1, 2)
        return jnp.concatenate([jnp.zeros_like(a[:1]), a])

    def both(x, routed, shared_stack):
        r = jax.lax.ragged_dot(x, routed, gs_routed, preferred_element_type=f32)
        s = jax.lax.ragged_dot(x, shared_stack, gs_shared, preferred_element_type=f32)
        return jnp.where(is_shared, s, r)

    g = both(x_sorted, w_gate, stack(s_gate))
    u = both(x_sorted, w_up, stack(s_up))
    h = (jax.nn.silu(g) * u).astype(x_sorted.dtype)
    down = jnp.transpose(s_down.reshape(H, S, I), (1, 2, 0))  # [H, S*I] -> [S, I, H]
    return both(h, w_down, jnp.concatenate([jnp.zeros_like(down[:1]), down]))
