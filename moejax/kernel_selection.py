"""The one place that picks a kernel (Pallas or XLA) and its block sizes.

``select_moe``, ``select_mla``, ``select_mfa`` and ``select_prefill`` decide from static shapes, dtypes and the
platform (no online profiling, no autotuning at run time); the XLA
implementation is the fallback everywhere and the default on CPU.

The mode ("auto" | "pallas" | "xla") comes from ``moejax.load(kernels=...)``
and is read at trace time from a context variable: ``Model`` wraps its Flax
module in ``KernelScopedModule``, whose ``apply`` sets the mode while the step
is traced. "auto" = Pallas on GPU (CUDA or ROCm) where the shapes suit the
Triton kernels, else XLA. "pallas" forces the kernels everywhere; on CPU they
run in the Pallas interpreter (slow: tests only). ``MOEJAX_PALLAS_INTERPRET=1``
forces the interpreter on GPU as well (debugging).

The kernel overrides are engine settings (moejax/engine_args.py: ``moe_kernel``, ``w8a8_kernel``,
``w8a8_dense_kernel``, ``mla_kernel``; ``moejax serve --moe-kernel ...``), carried in EngineConfig and
read the same way: ``KernelScopedModule`` sets the engine's settings (``kernel_settings``) while the
step is traced, and each rule below reads its setting (``_override``). A setting left at "auto" falls
back to its environment variable (``MOEJAX_MOE_KERNEL``, ``MOEJAX_W8A8_KERNEL``,
``MOEJAX_W8A8_DENSE_KERNEL``, ``MOEJAX_MLA_KERNEL``: for kernel tests and measuring scripts that call
these functions without an engine), then to the rule.

Block sizes below are the fastest of ``scripts/bench_kernels.py --sweep`` on
an H200 (BENCHMARKS.md; raw sweeps in benchmarks/). On ROCm they are the same
shapes with a shallower pipeline (not run: no AMD GPU here).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.block_scaled_matmul import block_scaled_matmul
from pallas_kernels.fused_moe import fused_moe
from pallas_kernels.fused_moe_fp8 import fused_moe_fp8
from pallas_kernels import compat, cublaslt_fp8_gemm, jax_triton_compat, triton_fp8_dots
from pallas_kernels.triton_block_fp8 import act_quant_triton, block_fp8_matmul, fused_moe_block_fp8, fused_moe_triton
from pallas_kernels.triton_mla_decode import triton_mla_decode
from pallas_kernels.paged_decode_attention import paged_decode_attention

KERNEL_MODES = ("auto", "pallas", "xla")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("moejax_kernels", default="auto")
# The engine's settings (an EngineArgs, or anything with its kernel fields) while its step is traced.
_SETTINGS: contextvars.ContextVar[Any] = contextvars.ContextVar("moejax_kernel_settings", default=None)


def check_mode(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    return mode


@contextlib.contextmanager
def kernel_mode(mode: str):
    """Kernels used by everything traced inside the block."""
    token = _MODE.set(check_mode(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def current_mode() -> str:
    return _MODE.get()


@contextlib.contextmanager
def kernel_settings(settings):
    """The engine's kernel settings (moe_kernel, w8a8_kernel, ...; moejax/engine_args.py) for everything
    traced inside the block; None: none (each override then reads its environment variable)."""
    token = _SETTINGS.set(settings)
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def _override(name: str, env: str, choices: tuple[str, ...]) -> str:
    """A kernel override: the engine's setting ``name`` where it is not "auto", else ``$env``, else "auto"."""
    want = getattr(_SETTINGS.get(), name, "auto")
    if want not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {want!r}")
    if want == "auto":
        want = os.environ.get(env, "auto")
        if want not in choices:
            raise ValueError(f"{env} must be one of {choices}, got {want!r}")
    return want


class KernelScopedModule:
    """A Flax module whose ``apply`` traces under ``kernel_mode(mode)``,
    ``shared_expert_fusion(fuse_shared)`` and ``kernel_settings(settings)`` (the engine's EngineArgs:
    its kernel overrides; its ``fp8_fast_accum`` set for the lowering that follows); everything else
    delegates."""

    def __init__(self, module, mode: str, fuse_shared: str = "auto", settings=None):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "kernels", check_mode(mode))
        object.__setattr__(self, "fuse_shared", fuse_shared)
        object.__setattr__(self, "settings", settings)

    @contextlib.contextmanager
    def scope(self):
        """What ``apply`` traces under: this engine's kernel choices."""
        if self.settings is not None:  # a lowering choice of the process (pallas_kernels/triton_fp8_dots.py)
            triton_fp8_dots.set_fast_accumulation(self.settings.fp8_fast_accum)
        with kernel_mode(self.kernels), shared_expert_fusion(self.fuse_shared), kernel_settings(self.settings):
            yield

    def apply(self, *args, **kwargs):
        with self.scope():
            return self._module.apply(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)

    def __repr__(self):
        return f"KernelScopedModule({self._module!r}, kernels={self.kernels!r})"


@functools.lru_cache(maxsize=None)
def platform() -> str:
    """'cuda', 'rocm' or 'cpu' (anything else counts as 'cpu': no Triton); pallas_kernels.compat's rule."""
    return compat.platform()


@functools.lru_cache(maxsize=None)
def num_compute_units() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except Exception:  # pragma: no cover
        return 132


def _want_pallas(mode: str | None) -> tuple[bool, bool]:
    """(use Pallas if the shapes allow, forced)."""
    mode = check_mode(mode or current_mode())
    if mode == "xla":
        return False, False
    if mode == "pallas":
        return True, True
    return platform() != "cpu", False


def _triton_dim(n: int) -> bool:
    """A dim the decode kernels take as one Triton block: a power of two, at least 16 (dot minimum)."""
    return n >= 16 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class Choice:
    impl: str  # "pallas" or "xla"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: str = ""


# --------------------------------------------------------------------- fused MoE
def select_moe(num_rows: int, num_experts: int, hidden: int, inter: int, dtype, mode: str | None = None) -> Choice:
    """Routed-expert MLP over ``num_rows`` sorted rows: Pallas ``fused_moe`` or XLA ``ragged_dot``."""
    use, forced = _want_pallas(mode)
    if not use:
        return Choice("xla", reason="mode or platform")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return Choice("xla", reason=f"dtype {jnp.dtype(dtype)}")
    if not forced and (hidden < 16 or inter < 16):
        return Choice("xla", reason="dims below the Triton dot minimum (16)")
    rocm = platform() == "rocm"
    per_expert = num_rows / max(num_experts, 1)
    # Best of the H200 sweep (benchmarks/2026-12-02b/kernels_moe_sweep.txt, DeepSeek-V3 EP8 share).
    if per_expert <= 16:  # decode: weight streaming; 128-wide tiles read 256 B runs of each weight row
        p = dict(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=64, num_warps=4, num_stages=3)
    elif per_expert <= 64:
        p = dict(block_m=32, block_n=64, block_k=128, block_n_down=64, block_k_down=64, num_warps=4, num_stages=3)
    elif per_expert <= 256:
        p = dict(block_m=128, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=8, num_stages=3)
    else:  # prefill: FLOP-bound, biggest tiles that fit shared memory
        p = dict(block_m=128, block_n=128, block_k=64, block_n_down=256, block_k_down=64, num_warps=8, num_stages=3)
    if rocm:
        p["num_stages"] = 2
    # Never tiles wider than the (power-of-two-rounded) dims themselves.
    cap = lambda b, d: max(16, min(b, 1 << max(d - 1, 1).bit_length()))
    p["block_n"], p["block_n_down"] = cap(p["block_n"], inter), cap(p["block_n_down"], hidden)
    p["block_k"], p["block_k_down"] = cap(p["block_k"], hidden), cap(p["block_k_down"], inter)
    return Choice("pallas", p, "forced" if forced else "gpu")


def grouped_mlp(x_sorted, group_sizes, w_gate, w_up, w_down, shared=(), mode: str | None = None):
    """Routed expert MLP (plus ``shared`` = (gate, up, down) shared experts in HF's layout, the groups
    after the routed ones) through the selected kernel; None when the XLA path should run."""
    N, H = x_sorted.shape
    I = w_gate.shape[2]
    c = select_moe(N, group_sizes.shape[0], H, I, x_sorted.dtype, mode)
    if c.impl != "pallas":
        return None
    if not shared and moe_kernel() == "triton":
        return fused_moe_triton(x_sorted, group_sizes, w_gate, w_up, w_down,
                                **triton_moe_bf16_params(N, group_sizes.shape[0]))
    return fused_moe(x_sorted, group_sizes, w_gate, w_up, w_down, *shared, **c.params)


MOE_KERNELS = ("auto", "pallas", "triton")
MOE_KERNEL_ENV = "MOEJAX_MOE_KERNEL"


def moe_kernel() -> str:
    """Which kernel runs the bf16 routed experts on a GPU where ``select_moe`` picks a kernel: "pallas"
    (``fused_moe``, which also takes the shared experts as extra groups) or "triton" (the Triton-language
    ``fused_moe_triton`` through jax-triton; the shared experts then run beside it).
    The ``moe_kernel`` setting (or ``MOEJAX_MOE_KERNEL``) ``pallas|triton`` forces one ("triton" without
    jax-triton raises at the first call,
    naming the install). "auto" is Pallas: the Triton kernel measured level with it (H100, V3 EP8-rank share,
    best tiles 1,164 / 1,373 / 4,125 us vs 1,104 / 1,411 / 3,884 us at 16 / 128 / 512 rows an expert; the
    step within noise; benchmarks/2026-12-06c/h100/rG)."""
    want = _override("moe_kernel", MOE_KERNEL_ENV, MOE_KERNELS)
    if want != "auto":
        return want
    return "pallas"


SHARED_FUSION = ("auto", "on", "off")
_FUSE_SHARED: contextvars.ContextVar[str] = contextvars.ContextVar("moejax_fuse_shared", default="auto")


@contextlib.contextmanager
def shared_expert_fusion(setting: str):
    """Shared experts inside the routed-expert kernel ("on"), beside it as their own MLP ("off"), or
    "auto": fused where the fused MoE runs as the Pallas kernel (one launch streams every expert
    weight), separate on the XLA path (its fused form copies the shared weights each step). Read at
    trace time, like ``kernel_mode``; for measuring the fusion."""
    if setting not in SHARED_FUSION:
        raise ValueError(f"shared_expert_fusion must be one of {SHARED_FUSION}, got {setting!r}")
    token = _FUSE_SHARED.set(setting)
    try:
        yield
    finally:
        _FUSE_SHARED.reset(token)


def fuse_shared_experts(num_experts: int, hidden: int, inter: int, dtype, mode: str | None = None) -> bool:
    """Whether the bf16 routed experts take the shared experts as extra groups (``shared_expert_fusion``)."""
    setting = _FUSE_SHARED.get()
    if setting != "auto":
        return setting == "on"
    return select_moe(num_experts, num_experts, hidden, inter, dtype, mode).impl == "pallas" and moe_kernel() == "pallas"


# ------------------------------------------------------------------ block-FP8 weights
def _fp8_weight_format(weight_dtype, variant: str) -> tuple[str | None, str]:
    """How the FP8 kernels read these weights here (fp8_utils.WEIGHT_FORMATS), or (None, why not)."""
    dt = jnp.dtype(weight_dtype)
    fn, fnuz = dt == jnp.dtype(jnp.float8_e4m3fn), dt in (jnp.dtype(jnp.float8_e4m3fnuz), jnp.dtype(jnp.uint8))
    if not (fn or fnuz):
        return None, f"weight dtype {dt}"
    if platform() == "rocm" or fnuz:  # no FP8 type through Pallas-Triton there: integer decode, W8A16
        if variant == "w8a8":
            return None, "w8a8 needs e4m3fn dots (Pallas-Triton has no fnuz casts)"
        return ("e4m3fnuz_bits" if fnuz else "e4m3fn_bits"), ""
    try:
        cc = float(getattr(jax.devices()[0], "compute_capability", "9.0"))
    except Exception:  # pragma: no cover
        cc = 9.0
    if cc >= 8.9 or platform() == "cpu":
        return "e4m3fn", ""
    return (None, "w8a8 needs compute capability 8.9+") if variant == "w8a8" else ("e4m3fn_bits", "")


# Rows an expert from which W8A8 experts beat W8A16, and from which FP8 expert weights are instead
# dequantised in the step for the bf16 kernel ("bf16 where it wins"), per W8A8 kernel family
# (``w8a8_kernel``). Pallas (fused_moe_fp8): H100, V3 EP8-rank expert share (32 experts, 7168 -> 2048),
# 128 rows an expert W8A8 1469 us vs W8A16 1844 us (bf16 kernel 1489 us), 16 rows 844 vs 821 us (a tie:
# weight reads bound it) (benchmarks/2026-12-05c/h100/fp8_probe.txt); 64 rows 1338 vs the bf16 kernel's
# 1821 us (benchmarks/2026-12-05d/h100/call1/fp8_tiles.txt); its tiles fall behind the bf16 kernel's at
# prefill sizes (8 x 2048 prompts = 4096 rows an expert: FP8 prefill 0.65x bf16, benchmarks/2026-12-05d/
# h100/call1/prefill_fp8.txt), while dequantising costs one pass over the weights (~1.7 ms a layer on the
# H100 against ~5 ms of bf16 expert GEMM at 1024 rows an expert).
# Triton (triton_block_fp8.fused_moe_block_fp8, H100, same shapes, benchmarks/2026-12-06/h100/call2/
# kern.txt): 16 rows 683 us vs W8A16 767 and the bf16 kernel 1133; 64 rows 784 vs the Pallas W8A8 862 and
# bf16 1464; 128 rows 999 vs 1310 / 1412; 512 rows 2980 vs 4169 / 3900 (1.31x bf16): W8A8 from 16 rows
# an expert, and no dequantised-bf16 range (the Triton kernel gains on bf16 as rows grow).
MOE_FP8_THRESHOLDS = {"pallas": (64, 1024), "triton": (16, None)}  # family: (W8A8 from, bf16 from or None)
W8A8_MIN_ROWS_PER_EXPERT, BF16_MIN_ROWS_PER_EXPERT = MOE_FP8_THRESHOLDS["pallas"]  # (the Pallas family's)
# Rows of a dense FP8 projection for which "auto" runs the W8A8 kernel (128 x 128 x 128 tiles, 8 warps)
# instead of XLA's dequantise-then-dot, whose weight pass (fp8 read, bf16 written and read again) cost
# ~1.7 ms of a 4-layer V3 EP8-rank step at 512 x 2048 (the FP8 profile's convert fusions): that step
# 14.79 ms with XLA's dense path, 13.46 ms with the W8A8 kernel (H200, benchmarks/2026-12-05d/h200/
# new2048.txt, w8a8dense.txt); kernel alone at 7168 x 7168, M 256-512: 155-188 us against 383-901 us for
# XLA's bf16 dot (H100 sweep, noisy). Above 2048 rows (prefill) the weight pass is amortised and
# cuBLAS's bf16 GEMM at ~750 TFLOP/s is not beaten by these tiles (M 2048: 875 vs 898 us): XLA there.
DENSE_W8A8_ROWS = (256, 2048)


def fp8_variant(variant: str, rows: int, groups: int, weight_dtype) -> str:
    """The FP8 scheme a GEMM runs: ``variant`` as given unless "auto". "auto" on CUDA, for grouped expert
    GEMMs: W8A16 below the W8A8 kernel family's threshold in rows an expert (MOE_FP8_THRESHOLDS; weight-read
    bound), W8A8 from there (FP8 dots on the tensor cores), "bf16" (weights dequantised in the step, the bf16
    kernel) from the family's bf16 threshold, where it has one; dense projections: W8A8 for DENSE_W8A8_ROWS
    rows, W8A16 otherwise (the Pallas kernel up to 64 rows, XLA's dequantise-then-dot above). ROCm: expert
    GEMMs as CUDA's Triton family where jax-triton is installed (fnuz dots in the Triton language), W8A16
    elsewhere and for dense projections (Pallas-Triton takes no fnuz dot); CPU: W8A16."""
    if variant != "auto":
        return variant
    plat = platform()
    if plat == "rocm" and groups > 1 and triton_fp8_type(weight_dtype) is not None and w8a8_kernel() == "triton":
        family = "triton"  # (not run: no AMD GPU here; the kernel compiles for gfx942, tests/test_triton_fp8.py)
    elif plat == "cuda" and _fp8_weight_format(weight_dtype, "w8a8")[0] is not None:
        if groups <= 1:
            return "w8a8" if dense_w8a8_kernel(rows) else "w8a16"
        family = w8a8_kernel()
    else:
        return "w8a16"
    per_expert = rows / groups
    w8a8_from, bf16_from = MOE_FP8_THRESHOLDS[family]
    if bf16_from is not None and per_expert >= bf16_from:
        return "bf16"
    return "w8a8" if per_expert >= w8a8_from else "w8a16"


def triton_fp8_type(weight_dtype, weight_format: str | None = None):
    """The FP8 type the Triton W8A8 kernels read these weights as here, or None: e4m3fn on CUDA with FP8
    dots (compute capability 8.9+), e4m3fnuz on ROCm (fnuz weights, or their uint8 bytes)."""
    dt, plat = jnp.dtype(weight_dtype), platform()
    if plat == "cuda" and dt == jnp.dtype(jnp.float8_e4m3fn) and weight_format in (None, "e4m3fn"):
        return jnp.float8_e4m3fn if _fp8_weight_format(dt, "w8a8")[0] == "e4m3fn" else None
    if plat == "rocm" and weight_format in (None, "e4m3fnuz_bits") and \
            dt in (jnp.dtype(jnp.float8_e4m3fnuz), jnp.dtype(jnp.uint8)):
        return jnp.float8_e4m3fnuz
    return None


def select_moe_fp8(num_rows: int, num_experts: int, hidden: int, inter: int, dtype, weight_dtype,
                   variant: str = "w8a16", mode: str | None = None) -> Choice:
    """Routed-expert MLP with 128x128 block-FP8 weights: Pallas ``fused_moe_fp8`` (params carry
    ``variant`` and ``weight_format``; the weights in HF's [E, out, in] layout) or the XLA
    dequantise-then-ragged_dot path. Tiles: the bf16 kernel's (select_moe) with K steps inside one
    scale block; w8a8 takes 128-wide gate/up column tiles (h is requantised in the kernel's epilogue)
    and K steps of 128. At decode (<= 16 rows an expert) W8A16 takes 64-wide gate/up tiles, 128-wide
    down tiles and 8 warps: 656 vs 988 us for the bf16 kernel's tiles at the V3 EP8 share, 8 rows an
    expert (H200, benchmarks/2026-12-03f/moe_layouts.txt)."""
    base = select_moe(num_rows, num_experts, hidden, inter, dtype, mode)
    if base.impl != "pallas":
        return base
    fmt, why = _fp8_weight_format(weight_dtype, variant)
    if fmt is None:
        return Choice("xla", reason=why)
    p = dict(base.params, variant=variant, weight_format=fmt)
    p["block_k"], p["block_k_down"] = min(p["block_k"], 128), min(p["block_k_down"], 128)
    if variant == "w8a16" and num_rows / max(num_experts, 1) <= 16 and platform() != "rocm":
        p["block_n"], p["block_n_down"], p["num_warps"] = min(p["block_n"], 64), max(p["block_n_down"], 128), 8
        p["block_n_down"] = min(p["block_n_down"], max(16, 1 << max(hidden - 1, 1).bit_length()))
    if variant == "w8a8" and inter >= 128 and hidden >= 128:
        # 128 x 128 down tiles: 64 rows an expert 1338 vs 1494 us, 128 rows 1735 vs 1891 us (H100,
        # benchmarks/2026-12-05d/h100/call1/fp8_tiles.txt); 8 warps for 128-row tiles (4: 3372 us).
        p["block_n"], p["block_k"], p["block_n_down"], p["block_k_down"] = 128, 128, 128, 128
        p["num_warps"] = 8 if p["block_m"] >= 128 else 4
    return Choice("pallas", p, base.reason)


def _XLA_ABOVE_64():
    """H200 (benchmarks/2026-12-03d/kernels_fp8.txt): above 64 rows XLA's dequantise-then-dot beat the
    block-scaled kernel at 7 of 8 V3 projection shapes (M = 256, 1024; e.g. o_proj 381 vs 477 us at
    256), at 64 rows the kernel won 3 of 4 (o_proj 181 vs 320 us). ROCm not measured: kernel kept."""


def select_fp8_linear(m: int, n: int, k: int, dtype, weight_dtype, variant: str = "w8a16",
                      mode: str | None = None) -> Choice:
    """y = x[m, k] @ (W[n, k] * scale)^T: Pallas ``block_scaled_matmul`` or XLA dequantise-then-dot.
    On CUDA the kernel runs up to 64 rows, and W8A8 for DENSE_W8A8_ROWS rows; XLA elsewhere. Decode
    (m <= 64): one row tile, 128-deep K steps, K split until the programs about fill the GPU (the f32
    partials kept under the weight bytes); larger m: 128 x 128 x 128 tiles, 8 warps (the H100 sweep's
    best, benchmarks/2026-12-05d/h100/call1/fp8_tiles.txt)."""
    use, forced = _want_pallas(mode)
    if not use:
        return Choice("xla", reason="mode or platform")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return Choice("xla", reason=f"dtype {jnp.dtype(dtype)}")
    fmt, why = _fp8_weight_format(weight_dtype, variant)
    if fmt is None:
        return Choice("xla", reason=why)
    if not forced and (n < 16 or k < 16):
        return Choice("xla", reason="dims below the Triton dot minimum (16)")
    w8a8_rows = variant == "w8a8" and DENSE_W8A8_ROWS[0] <= m <= DENSE_W8A8_ROWS[1]
    if not forced and m > 64 and platform() == "cuda" and not w8a8_rows:
        return Choice("xla", reason=_XLA_ABOVE_64.__doc__)
    cap = lambda b, d: max(16, min(b, 1 << max(d - 1, 1).bit_length()))
    if m <= 64:
        bm = max(16, 1 << max(m - 1, 0).bit_length())  # a power of two (Triton blocks), >= 16 (dot minimum)
        p = dict(block_m=bm, block_n=cap(64 if n < 2048 else 128, n), block_k=128, num_warps=4, num_stages=3)
    else:
        # 128 x 128 x 128, 8 warps: the best of the H100 W8A8 sweep at M 256-512 (V3 o_proj-sized 7168 x
        # 7168: 188 us vs 394 us with 64-row tiles; benchmarks/2026-12-05d/h100/call1/fp8_tiles.txt).
        p = dict(block_m=128, block_n=cap(128, n), block_k=128, num_warps=8, num_stages=3)
    programs = -(-m // p["block_m"]) * -(-n // p["block_n"])
    m_pad = -(-m // p["block_m"]) * p["block_m"]
    p["num_splits"] = max(1, min(-(-num_compute_units() // programs), k // (4 * m_pad), -(-k // 128) // 2))
    if platform() == "rocm":
        p["num_stages"] = 2
    return Choice("pallas", dict(p, variant=variant, weight_format=fmt), "forced" if forced else "gpu")


W8A8_KERNELS = ("auto", "triton", "pallas")
W8A8_KERNEL_ENV = "MOEJAX_W8A8_KERNEL"


def w8a8_kernel() -> str:
    """Which kernels run the W8A8 (fp8 x fp8) expert GEMMs on a GPU: "triton" (triton_block_fp8's fused MoE,
    the Triton language through jax-triton: vLLM's block-FP8 design) where jax-triton is installed, else
    "pallas" (fused_moe_fp8). Dense W8A8 projections have their own rule (``dense_w8a8_kernel``): the
    Triton dense GEMM measured level with the Pallas one or slower (no split K for few column tiles; H100,
    kv_a at M=128: 113 vs 82 us, o_proj at M=2048: 818 vs 794 us, benchmarks/2026-12-06/h100/call2/kern.txt).
    The ``w8a8_kernel`` setting (or ``MOEJAX_W8A8_KERNEL``) ``pallas|triton`` forces one (measuring;
    "triton" without jax-triton raises at the
    first call, naming the install)."""
    want = _override("w8a8_kernel", W8A8_KERNEL_ENV, W8A8_KERNELS)
    if want != "auto":
        return want
    return "triton" if platform() in ("cuda", "rocm") and jax_triton_compat.available()[0] else "pallas"


def triton_moe_params(num_rows: int, num_experts: int) -> dict:
    """Tiles of the Triton W8A8 fused MoE (pallas_kernels/triton_block_fp8.py), the best of the H100 sweep
    at the V3 EP8-rank share (benchmarks/2026-12-06/h100/call2/kern.txt): up to 16 rows an expert one
    16-row tile (the weights stream once; 683 us at 16 rows), above it 64-row tiles, 8 warps, 4 stages
    (128 rows 999 us vs 1139 with 4 warps / 3 stages; 512 rows 2980 vs 3660; 128-row tiles 3775+).
    ROCm: 2 stages, as the Pallas kernels there (not run: no AMD GPU here)."""
    if num_rows / max(num_experts, 1) <= 16:
        p = dict(block_m=16, block_n_down=128, num_warps=8, num_stages=3)
    else:
        p = dict(block_m=64, block_n_down=128, num_warps=8, num_stages=4)
    if platform() == "rocm":
        p["num_stages"] = 2
    return p


def triton_moe_bf16_params(num_rows: int, num_experts: int) -> dict:
    """Tiles of the Triton-language bf16 fused MoE (triton_block_fp8.fused_moe_triton): up to 16 rows an
    expert one 16-row tile and 128-deep K steps (the weights stream once), above it 64-row tiles on 8 warps,
    as the W8A8 kernel's sweep found. ROCm: 2 stages."""
    if num_rows / max(num_experts, 1) <= 16:
        p = dict(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=64, num_warps=4, num_stages=4)
    else:
        p = dict(block_m=64, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=8, num_stages=4)
    if platform() == "rocm":
        p["num_stages"] = 2
    return p


def triton_gemm_params(m: int, n: int, k: int) -> dict:
    """Tiles of the Triton W8A8 dense GEMM (benchmarks only: ``w8a8_kernel`` says why the model keeps
    Pallas): 64 x 128 x 128, 4 warps, grouped launch (the best of the torch-Triton probe at M 128-2048,
    N = K = 7168 on an H100, benchmarks/2026-12-05c/h100/fp8_probe; the jax-triton sweep agrees)."""
    bm = max(16, min(64, 1 << max(m - 1, 0).bit_length()))
    return dict(block_m=bm, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)


def grouped_mlp_fp8(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, variant: str = "w8a16",
                    mode: str | None = None, weight_format: str | None = None):
    """Block-FP8 routed-expert MLP through the selected kernel (W8A8: the Triton fused MoE where
    ``w8a8_kernel`` says so, else Pallas ``fused_moe_fp8``); None when XLA should run."""
    N, H = x_sorted.shape
    E, I, _ = w_gate.shape  # [E, out, in] (HF's layout)
    fp8 = triton_fp8_type(w_gate.dtype, weight_format) if variant == "w8a8" else None
    if fp8 is not None and _want_pallas(mode)[0] and w8a8_kernel() == "triton":
        ws = [jax.lax.bitcast_convert_type(w, fp8) if jnp.dtype(w.dtype) == jnp.dtype(jnp.uint8) else w
              for w in (w_gate, w_up, w_down)]  # uint8: the bytes of fnuz weights (ROCm)
        return fused_moe_block_fp8(x_sorted, group_sizes, ws[0], s_gate, ws[1], s_up, ws[2], s_down,
                                   **triton_moe_params(N, E))
    c = select_moe_fp8(N, E, H, I, x_sorted.dtype, w_gate.dtype, variant, mode)
    if c.impl != "pallas":
        return None
    p = dict(c.params, weight_layout="nk", **({"weight_format": weight_format} if weight_format else {}))
    return fused_moe_fp8(x_sorted, group_sizes, w_gate, s_gate, w_up, s_up, w_down, s_down, **p)


def fp8_linear(x2, w, scale, variant: str = "w8a16", out_dtype=None, mode: str | None = None,
               weight_format: str | None = None):
    """x2 [M, K] @ (w [N, K] * scale)^T through the selected Pallas kernel; None when XLA should run."""
    M, K = x2.shape
    out_dtype = jnp.dtype(out_dtype or x2.dtype)
    kernel = dense_w8a8_kernel(M) if variant == "w8a8" and _want_pallas(mode)[0] else None
    if (kernel == "cublaslt" and jnp.dtype(w.dtype) == jnp.dtype(jnp.float8_e4m3fn)
            and not cublaslt_fp8_gemm.check(*w.shape)):
        quant = act_quant_triton if jax_triton_compat.available()[0] else None
        return cublaslt_fp8_gemm.cublaslt_fp8_matmul(x2, w, scale, out_dtype=out_dtype, quant=quant)
    c = select_fp8_linear(M, w.shape[0], K, x2.dtype, w.dtype, variant, mode)
    if c.impl != "pallas":
        return None
    fp8 = triton_fp8_type(w.dtype, weight_format) if c.params["variant"] == "w8a8" else None
    if fp8 is not None and kernel == "triton":
        w = jax.lax.bitcast_convert_type(w, fp8) if jnp.dtype(w.dtype) == jnp.dtype(jnp.uint8) else w
        return block_fp8_matmul(x2, w, scale, out_dtype=out_dtype, **triton_gemm_params(M, w.shape[0], K))
    p = dict(c.params, **({"weight_format": weight_format} if weight_format else {}))
    return block_scaled_matmul(x2, w, scale, out_dtype=out_dtype, **p)


W8A8_DENSE_KERNEL_ENV = "MOEJAX_W8A8_DENSE_KERNEL"
W8A8_DENSE_KERNELS = ("auto", "pallas", "triton", "cublaslt")


def dense_w8a8_kernel(rows: int) -> str | None:
    """Which kernel runs a W8A8 dense projection of ``rows`` rows on CUDA, or None (W8A16: the Pallas kernel
    up to 64 rows, XLA's dequantise-then-dot above): DENSE_W8A8_ROWS on the Pallas kernel; above them
    (prefill) cuBLASLt's block-scaled FP8 GEMM where its library is built. The ``w8a8_dense_kernel``
    setting (or ``MOEJAX_W8A8_DENSE_KERNEL``) forces a family for every row count from DENSE_W8A8_ROWS[0]:
    "pallas" / "triton" (triton_block_fp8's
    GEMM) within the range, "cublaslt" with no upper bound (without the library it raises at the first
    call, naming the build).

    Measured (H100, benchmarks/2026-12-06c/h100): cuBLASLt's GEMM beats cuBLAS's bf16 one at o_proj
    16384 -> 7168 by 1.45x / 1.37x / 1.55x at M 512 / 2048 / 16384 and the Pallas W8A8 kernel at every
    V3 projection at M 512 (rI/gemm.txt); FP8 prefill 8 x 2048 171.7 -> 142.4 ms with it (1.22x bf16,
    rJ/prefill.txt). In the decode step its device time is lower (ops 11.8 vs 12.6 ms a step at 512 x
    2048, rJ/prof.txt) and 256 x 2048 went 7.5 -> 6.9 ms, but the step's wall time at 512 x 2048 was
    16.1 and 17.8 ms in two of three runs (p90 22-27 ms: stalls between ops, not understood) against the
    Pallas kernel's 12.5-12.7 ms: decode keeps Pallas until that is explained."""
    want = _override("w8a8_dense_kernel", W8A8_DENSE_KERNEL_ENV, W8A8_DENSE_KERNELS)
    lo, hi = DENSE_W8A8_ROWS
    if rows < lo:
        return None
    if want == "cublaslt":
        return want
    if rows <= hi:
        return "pallas" if want == "auto" else want
    if want == "auto" and platform() == "cuda" and cublaslt_fp8_gemm.available()[0]:
        return "cublaslt"
    return None


# ------------------------------------------------------------------ MLA decode
def select_mla(batch: int, heads: int, latent: int, rope: int, max_len: int, block_size: int, cache_dtype,
               mode: str | None = None, rows: int = 1) -> Choice:
    """Absorbed MLA decode over the paged cache: Pallas ``paged_decode_attention`` or the XLA gather path.
    ``rows`` > 1 (query rows a sequence, the speculative verify's k + 1): the Triton kernel, which reads
    the context once for all of them, where it runs; else "rows" is not in the choice's params and the
    caller gives every row its own block table (each row then reads the context)."""
    use, forced = _want_pallas(mode)
    if not use:
        return Choice("xla", reason="mode or platform")
    if not forced and not (_triton_dim(latent) and _triton_dim(rope) and heads >= 1):
        return Choice("xla", reason="latent / rope dims not powers of two >= 16 (Triton blocks)")
    fp8 = _fp8(cache_dtype)
    if rows > 1 and (forced or fp8) and mla_kernel(heads, latent, rope, cache_dtype, rows) == "triton":
        return Choice("triton", dict(_triton_mla_params(batch, heads * rows, max_len, fp8), rows=rows),
                      "forced" if forced else "gpu")
    if mla_kernel(heads, latent, rope, cache_dtype) == "triton":
        return Choice("triton", _triton_mla_params(batch, heads, max_len, fp8), "forced" if forced else "gpu")
    if not forced and _slow_fp8(heads, cache_dtype):
        return Choice("xla", reason=_slow_fp8.__doc__)
    p = _paged_decode_params(batch, heads, max_len, block_size, cache_dtype)
    return Choice("pallas", p, "forced" if forced else "gpu")


MLA_KERNEL_ENV = "MOEJAX_MLA_KERNEL"
MLA_KERNELS = ("auto", "pallas", "triton")


def mla_kernel(heads: int, latent: int, rope: int, cache_dtype, rows: int = 1) -> str:
    """Which kernel runs MLA decode on a GPU: "triton" (triton_mla_decode, the Triton language through
    jax-triton: programs of 64 (query row, head) pairs on wgmma with pipelined cache tiles, up to 216 KB of
    shared memory, so NVIDIA Hopper only) over an FP8 cache on CUDA where jax-triton is installed, else
    "pallas" (paged_decode_attention, or XLA where that is slower). H100, x 2048 context
    (benchmarks/2026-12-06e/h100/r1/mla*.txt): FP8 cache, 128 heads x 512: Triton 1.91 ms, XLA 3.73,
    Pallas' page tile 6.74; 16 heads x 256: Triton 0.46 ms, Pallas 0.57; bf16 cache, 128 heads: Triton
    0.60 / 1.31 ms at 197 / 512 sequences, Pallas' gather tile 0.58 / 1.34; 16 heads: Pallas 0.32, Triton
    0.34: bf16 stays on Pallas. ROCm's 64 KB of LDS cannot hold the Triton kernel's tiles.
    Several query rows a sequence (``rows`` > 1, the verify) over an FP8 cache: the rows together in the
    Triton kernel (it reads a sequence's context once for all its rows; below 64 heads 1.5-2.1x the
    per-row kernels, at 128 heads 0.96-1.0x, benchmarks/2026-12-06d/h100/r1/rows.txt).
    The ``mla_kernel`` setting (or ``MOEJAX_MLA_KERNEL``) ``pallas|triton`` forces one (measuring)."""
    want = _override("mla_kernel", MLA_KERNEL_ENV, MLA_KERNELS)
    if want != "auto":
        return want
    ok = platform() == "cuda" and _fp8(cache_dtype) and _triton_dim(latent) and _triton_dim(rope)
    return "triton" if ok and jax_triton_compat.available()[0] else "pallas"


def _triton_mla_params(batch: int, heads: int, max_len: int, fp8: bool = False) -> dict:
    """Tiling of triton_mla_decode: 64 (query row, head) pairs a program (one wgmma M tile, two warpgroups
    splitting the [64, 512] accumulator; fewer heads: the next power of two from 16, 4 warps); context
    splits until the programs fill the GPU, each split >= 256 tokens. Tokens a step and stages from the
    H100 sweep (benchmarks/2026-12-06e/h100/r1/mla*.txt): 64 tokens; an FP8 cache at 64 heads one stage
    (its rows widened in registers: 1.91 vs 2.03 ms with two, 128 heads x 512 x 2048), below 64 heads 32
    tokens in two stages (0.46 vs 0.49 ms, 16 heads x 256); bf16 three stages (1.31 vs 1.47 ms with two)."""
    block_h = 64 if heads >= 64 else max(16, 1 << (heads - 1).bit_length())  # heads: query rows x heads
    programs = batch * -(-heads // block_h)
    num_splits = max(1, min(max(1, max_len // 256), -(-num_compute_units() // max(programs, 1)), 16))
    block_n, stages = (64, 1) if fp8 and block_h >= 64 else (32, 2) if fp8 else (64, 3)
    return dict(block_h=block_h, block_n=block_n, num_splits=num_splits, num_warps=8 if block_h >= 64 else 4,
                num_stages=stages)


def _fp8(cache_dtype) -> bool:
    return jnp.dtype(cache_dtype).itemsize == 1


def _slow_fp8(heads: int, cache_dtype) -> bool:
    """FP8 cache with 64+ heads: the page tile measured 0.42-0.53x the XLA path (H200, 128 heads)."""
    return _fp8(cache_dtype) and heads >= 64


def _paged_decode_params(batch: int, heads: int, max_len: int, block_size: int, cache_dtype) -> dict:
    """Tiling of the paged decode kernel (``paged_decode_attention``), for MLA and MFA alike.

    bf16 cache (H200 sweep, BENCHMARKS.md, benchmarks/2026-12-03b/): the gather tile, 64 tokens
    across four pages in one dot. Nsight Compute showed the whole-page tile bound by shared memory
    traffic: its [16 tokens x C] score dot let the warps re-read the same key tile, and one program
    per 16 heads re-read each page. 32-head blocks (64 with 128 heads spills) halve the page reads;
    16 heads take 16-head blocks (Triton dots need M >= 16; the CPU interpreter takes any), and so
    do batches too small for half a 32-head program per SM (then with 32-token tiles).
    FP8 cache: the whole-page tile, one or two pages a step (its select-after-load keeps the tile in
    registers, where 64 tokens would spill): 1.6-2.1x XLA at 16 heads; with 64+ heads "auto" keeps
    XLA (``_slow_fp8``). ROCm: 32 tokens and one pipeline stage (64 KB of LDS; not run: no AMD GPU
    here). The context is split until the programs fill the GPU."""
    rocm, cpu = platform() == "rocm", platform() == "cpu"
    fp8 = _fp8(cache_dtype)
    block_h = 16 if heads >= 16 or not cpu else 1 << max(heads - 1, 0).bit_length()
    block_t = 32 if rocm else 64
    if heads >= 32 and not fp8 and not rocm:
        # 32-head blocks once they give half a program per SM (context splits fill the rest: MFA batch
        # 64, 128 programs x 2 splits: 253 us vs 375-414 with 16 x 32 tiles); fewer sequences take
        # more, smaller programs (MFA batch 32: 232 us vs 324 with 32 x 64 tiles).
        if 2 * batch * -(-heads // 32) >= num_compute_units():
            block_h = 32
        else:
            block_t = 32
    programs = batch * -(-heads // block_h)
    max_splits = max(1, max_len // 256)  # a split should cover >= 256 tokens
    num_splits = max(1, min(max_splits, -(-num_compute_units() // max(programs, 1)), 16))
    if fp8:
        pages = 1 if rocm or heads >= 64 else 2
        return dict(tile="pages", block_h=block_h, block_t=pages * block_size, num_splits=num_splits,
                    num_warps=4, num_stages=1 if rocm else 2)
    return dict(tile="gather", block_h=block_h, block_t=block_t, num_splits=num_splits, num_warps=4,
                num_stages=1 if rocm else (3 if block_h >= 32 else 2))


def mla_attention(q_latent, q_rope, cache, block_tables, seq_lens, block_size: int, scale: float,
                  layer: int | None = None, mode: str | None = None, out_dtype=None):
    """MLA decode through the selected kernel; None when the XLA path should run. q_latent [B, Q, H, C]
    (Q query rows a sequence, seq_lens [B, Q]) runs only where a kernel takes the rows together: else
    None, and the caller runs each row on its own."""
    rows = q_latent.ndim == 4
    B, H, C = q_latent.shape[0], q_latent.shape[-2], q_latent.shape[-1]
    Q = q_latent.shape[1] if rows else 1
    c = select_mla(B, H, C, q_rope.shape[-1], block_tables.shape[1] * block_size, block_size, cache.dtype, mode,
                   rows=Q)
    if rows and "rows" not in c.params:
        return None
    if c.impl == "triton":
        params = {k: v for k, v in c.params.items() if k != "rows"}
        return triton_mla_decode(q_latent, q_rope, cache, block_tables, seq_lens, block_size=block_size,
                                 scale=float(scale), layer=layer, out_dtype=out_dtype, **params)
    if c.impl != "pallas":
        return None
    return paged_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, block_size=block_size,
                             scale=float(scale), layer=layer, out_dtype=out_dtype, **c.params)


# ------------------------------------------------------------------ MFA decode (Step3)
def select_mfa(batch: int, heads: int, head_dim: int, groups: int, max_len: int, block_size: int, cache_dtype,
               mode: str | None = None) -> Choice:
    """Step3 MFA decode (all query heads against one K/V head) over the paged [k | v] cache: the
    MLA kernel ``paged_decode_attention`` with no rope part and values at column ``head_dim``, tiled as
    MLA is (``_paged_decode_params``: the gather tile for bf16 caches), or the XLA gather path."""
    use, forced = _want_pallas(mode)
    if not use:
        return Choice("xla", reason="mode or platform")
    if groups != 1:
        return Choice("xla", reason="the kernel reads one K/V head per row; grouped K/V heads use XLA")
    if not forced and not _triton_dim(head_dim):
        return Choice("xla", reason="head_dim not a power of two >= 16 (Triton blocks)")
    if not forced and _slow_fp8(heads, cache_dtype):
        return Choice("xla", reason=_slow_fp8.__doc__)
    # H200, Step3 shapes (64 heads x 256, context 4096; BENCHMARKS.md, benchmarks/2026-12-03b/kernels_mfa_gather_sweep.txt):
    # the gather tile with 32-head blocks, 1.77x the XLA path at batch 256.
    p = _paged_decode_params(batch, heads, max_len, block_size, cache_dtype)
    return Choice("pallas", p, "forced" if forced else "gpu")


def mfa_attention(q, cache, block_tables, seq_lens, block_size: int, scale: float, groups: int,
                  layer: int | None = None, mode: str | None = None, out_dtype=None):
    """MFA decode through the selected kernel; None when the XLA path should run."""
    B, H, D = q.shape
    c = select_mfa(B, H, D, groups, block_tables.shape[1] * block_size, block_size, cache.dtype, mode)
    if c.impl != "pallas":
        return None
    return paged_decode_attention(q, None, cache, block_tables, seq_lens, block_size=block_size, scale=float(scale),
                             layer=layer, v_offset=D, out_dtype=out_dtype, **c.params)


# ------------------------------------------------------------------ prefill attention (MLA and MFA)
def _pow2_at_most(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n, 1).bit_length() - 1)


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 1).bit_length())


def select_prefill(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int, qk_dim: int, rope_dim: int,
                   v_dim: int, dtype, mode: str | None = None) -> Choice:
    """Causal prefill attention (layers/prefill_attention.py): the Pallas flash kernel
    (``flash_prefill_attention``) or the XLA blocked path; both are memory-bounded.

    Pallas on GPU when the dims are Triton blocks: ``qk_dim`` (MLA: the 128-dim nope part;
    the 64-dim rope part is a second dot), ``rope_dim`` (0: none) and ``v_dim`` powers of two
    >= 16. ``block_q`` counts query rows (tokens x the heads sharing one K/V head).
    XLA params: query chunk ``block_q`` (tokens) and key block ``block_k``, sized so one chunk's
    float32 scores [batch, heads, block_q, block_k] stay near 256 MB on a GPU (16 MB on CPU)."""
    use, forced = _want_pallas(mode)
    pallas_ok = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    dims_ok = _triton_dim(qk_dim) and _triton_dim(v_dim) and (rope_dim == 0 or _triton_dim(rope_dim))
    if use and pallas_ok and (forced or dims_ok):
        rocm = platform() == "rocm"
        group = heads // max(kv_heads, 1)
        rows = q_len * group
        # H200, attention alone at 1 x 8192 (scripts/bench_prefill.py --sweep, 18 tilings each):
        # MLA (128 heads, 128 + 64 rope, v 128) 128 x 64 tiles, 8 warps, 3 stages: 6.55 ms, 71% of the
        # matmul floor, 9.5x the XLA blocked path; Step3 MFA (64 heads x 256 on one K/V head) 128 x 64,
        # 8 warps, 2 stages: 4.77 ms, 78%, 6.0x (3 stages, or 128-key tiles, exceed shared memory).
        if max(qk_dim + rope_dim, v_dim) <= 192:
            p = dict(block_q=128, block_k=64, num_warps=8, num_stages=3)
        else:
            p = dict(block_q=128, block_k=64, num_warps=8, num_stages=2)
        if rocm:  # 64 KB of LDS: shallower pipeline, narrower key tiles (not run: no AMD GPU here)
            p.update(block_k=32, num_stages=1)
        p["block_q"] = min(p["block_q"], _pow2_at_least(rows))
        p["block_k"] = min(p["block_k"], _pow2_at_least(kv_len))
        return Choice("pallas", p, "forced" if forced else "gpu")
    budget = (16 << 20) if platform() == "cpu" else (256 << 20)
    block_k = min(512, _pow2_at_least(kv_len))
    block_q = _pow2_at_most(budget // max(1, 4 * batch * heads * block_k))
    block_q = max(16, min(block_q, 1024, _pow2_at_least(q_len)))
    why = "mode or platform" if not use else (f"dtype {jnp.dtype(dtype)}" if not pallas_ok else
                                              "dims not powers of two >= 16 (Triton blocks)")
    return Choice("xla", dict(block_q=block_q, block_k=block_k), why)


def prefill_segment(batch: int, heads: int, max_len: int, block_size: int) -> int:
    """Keys per segment of chunked prefill over the paged cache (layers/prefill_attention.py):
    one segment's gathered rows are expanded to [batch, segment, heads, k + v]; 4096 tokens is
    256 MB per sequence for DeepSeek-V3 (128 heads x 256 bf16 values) and one segment holds most
    contexts whole. Wide batches take shorter segments, so the expanded keys stay within about eight
    such sequences (2 GB at 128 heads): a chunk batch of 256 with 4096-token segments asked XLA for
    8 GB (out of memory beside the KV cache on an H100)."""
    seg = max(block_size, (4096 * 128) // max(heads, 1))
    seg = min(seg, (8 * 4096 * 128) // max(heads * batch, 1))
    seg = min(seg, -(-max_len // block_size) * block_size)
    return max(block_size, seg // block_size * block_size)


# ------------------------------------------------------------------ decode shapes
def decode_reads_whole_table(cfg, cache_dtype, mode: str) -> bool:
    """Whether decode attention's cost grows with the block-table width (the XLA gather path reads
    every column) rather than each sequence's live tiles only (the Pallas kernel): the engine then
    keeps several table widths (moejax/engine/buckets.py), else only the longest."""
    probe_len = 1 << 12  # the choice does not depend on the length (only the kernel's tiling does)
    if hasattr(cfg, "kv_lora_rank"):  # MLA
        c = select_mla(1, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, probe_len, 16,
                       cache_dtype, mode)
    else:  # MFA
        c = select_mfa(1, cfg.num_attention_heads, cfg.head_dim, cfg.num_attention_groups, probe_len, 16,
                       cache_dtype, mode)
    return c.impl == "xla"
