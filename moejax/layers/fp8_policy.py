"""Which GEMMs run with FP8 block-scaled weights: one policy per engine, by layer type.

``Fp8Policy.kinds`` names the layer types whose weights stay FP8 on the device (e4m3fn, one
float32 scale per 128x128 block: HF's ``weight_scale_inv``): "experts" (routed), "shared_experts"
(DeepSeek's shared experts, Step3's share_expert), "dense_mlp" (the dense layers' MLP),
"attention" (the attention projections, except MLA's kv_b_proj, which the absorbed decode
folds into the query and the output and therefore keeps in the model dtype, as vLLM and SGLang
do) and "lm_head". ``variant``: "w8a16" (weights converted in the kernel, bf16 dots), "w8a8"
(activations quantised per token per 128 channels, FP8 dots) or "auto" (the default: per GEMM, from
its rows, moejax/kernels/moe_fp8.pick_variant).
"""

from __future__ import annotations

import dataclasses

FP8_KINDS = ("experts", "shared_experts", "dense_mlp", "attention", "lm_head")
# Every kind a DeepSeek-V3 FP8 checkpoint stores in FP8 (its lm_head is bf16).
DEFAULT_FP8_KINDS = ("experts", "shared_experts", "dense_mlp", "attention")
VARIANTS = ("auto", "w8a16", "w8a8")  # "auto": moejax/kernels/moe_fp8.pick_variant picks per GEMM


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """How one Linear / expert stack stores and multiplies its FP8 weights."""
    block: tuple[int, int] = (128, 128)
    variant: str = "auto"


@dataclasses.dataclass(frozen=True)
class Fp8Policy:
    kinds: frozenset[str] = frozenset()
    block: tuple[int, int] = (128, 128)
    variant: str = "auto"

    def scheme(self, kind: str) -> Fp8Scheme | None:
        """The FP8 scheme of a layer type, or None when it keeps the model dtype."""
        return Fp8Scheme(self.block, self.variant) if kind in self.kinds else None

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)

    @classmethod
    def create(cls, kinds, block=(128, 128), variant: str = "auto") -> "Fp8Policy":
        """``kinds``: an iterable of FP8_KINDS or a comma-separated string ("default" = DEFAULT_FP8_KINDS)."""
        if isinstance(kinds, str):
            kinds = DEFAULT_FP8_KINDS if kinds == "default" else [k.strip() for k in kinds.split(",") if k.strip()]
        kinds = frozenset(kinds)
        unknown = sorted(kinds - set(FP8_KINDS))
        if unknown:
            raise ValueError(f"fp8_layers: unknown layer type(s) {unknown}; choose from {list(FP8_KINDS)}")
        if variant not in VARIANTS:
            raise ValueError(f"fp8_variant must be one of {VARIANTS}, got {variant!r}")
        block = tuple(int(b) for b in block)
        if len(block) != 2 or min(block) <= 0:
            raise ValueError(f"fp8 block must be [rows, cols] of positive integers, got {block!r}")
        if block != (128, 128) and kinds:
            raise ValueError(f"FP8 kernels take 128x128 weight blocks; this checkpoint has {list(block)}")
        return cls(kinds, block, variant)


NO_FP8 = Fp8Policy()
