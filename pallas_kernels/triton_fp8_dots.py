"""FP8 x FP8 dots on Hopper's warpgroup MMA (wgmma) from Pallas-Triton.

jax's Pallas-Triton lowering builds ``tt.dot`` without ``maxNumImpreciseAcc`` (0). For an
fp8 x fp8 -> f32 dot, Triton's Hopper lowering then refuses wgmma and emits Ampere-style
``mma.sync`` (benchmarks/2026-12-05c/fp8_probe: mma_v2 in the W8A8 kernels' LLVM, mma_v3 with the
attribute set). Triton's own frontend sets 2**30 for FP8 dots on sm_90 (``parse_options``:
``max_num_imprecise_acc_default``), i.e. accumulate the whole dot in the tensor core's FP8 accumulator.
Our FP8 kernels make one dot per 128-deep K step (one scale block) and add it, scaled, into an f32
accumulator themselves (DeepGEMM's promotion interval), so the tensor core only ever sums 128 products:
the same numerics as Triton's default and vLLM's/SGLang's block-FP8 kernels.

Measured on an H100 (same run, fp8_probe.txt): the W8A8 fused MoE at 128 rows an expert 2169 -> 1469 us
(bf16 kernel 1489 us); block_scaled_matmul W8A8 at M=2048, N=K=7168 1051 -> 656 us.

``install()`` wraps the lowering's ``tt_dialect.dot`` once per process so FP8-operand dots get the
attribute (other dots unchanged). ``set_fast_accumulation(False)`` (the engine setting
``fp8_fast_accum``: ``moejax serve --no-fp8-fast-accum``, moejax/engine_args.py) leaves the dots of the
kernels lowered after it alone. ``MOEJAX_FP8_FAST_ACC=0`` is the fallback: the process's choice until an
engine sets its own, and the setting's default. A jax whose lowering has no such hook is left alone with a warning: the
kernels stay correct, only slower.
"""

from __future__ import annotations

import os
import warnings

try:  # jax's Pallas-Triton lowering: private, its layout may change between releases
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering
except ImportError as e:  # pragma: no cover
    ir = lowering = None
    _import_error = e

FAST_ACC = 1 << 30  # Triton's sm_90 default for FP8 dots
ENV = "MOEJAX_FP8_FAST_ACC"
_installed: bool | None = None
# Read as each kernel is lowered: a choice of the process (the engine sets it while its step is traced,
# moejax/kernels/common.py KernelScopedModule; lowering follows the trace, possibly in another thread).
_fast = os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off")
DEFAULT = _fast  # the environment's choice: the fp8_fast_accum setting's default


def set_fast_accumulation(on: bool) -> bool:
    """Whether FP8 dots lowered from now on take fast accumulation; returns the previous choice."""
    global _fast
    previous, _fast = _fast, bool(on)
    return previous


def _is_fp8(value) -> bool:
    try:
        return str(ir.RankedTensorType(value.type).element_type).lower().startswith("f8")
    except Exception:  # not a ranked tensor: leave the dot as it is
        return False


def install() -> bool:
    """Makes Pallas-Triton's FP8 dots use fast (tensor-core) accumulation (while ``set_fast_accumulation``
    leaves it on, the default); True when the hook is in place."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        if lowering is None:
            raise _import_error
        dialect = lowering.tt_dialect
        orig = dialect.dot
    except (ImportError, AttributeError) as e:  # pragma: no cover - another jax layout
        warnings.warn(f"FP8 Pallas dots keep Triton's precise accumulation (no wgmma on Hopper): {e!r}")
        _installed = False
        return False

    def dot(a, b, c, *args, max_num_imprecise_acc=None, **kwargs):
        if max_num_imprecise_acc is None and _fast and _is_fp8(a) and _is_fp8(b):
            max_num_imprecise_acc = FAST_ACC
        return orig(a, b, c, *args, max_num_imprecise_acc=max_num_imprecise_acc, **kwargs)

    dot.__wrapped__ = orig
    dialect.dot = dot
    _installed = True
    return True
