"""The engine's configuration: one object, validated in one place, passed down.

``EngineConfig`` holds the model's config (the family's dataclass, from config.json)
and the choices of the run: dtype, KV cache, scheduler limits, parallel layout and
kernels, like vLLM's VllmConfig. ``EngineConfig.create`` checks every argument and
raises a ValueError naming the one that is wrong; ``Model``, ``ModelRunner``,
``LLMEngine`` and the EPLB balancer all read this object instead of long argument lists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from moejax.engine import scheduling_policy as _policy
from moejax.kernel_selection import KERNEL_MODES, SHARED_FUSION
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.layers.kv_quant import KV_CACHE_DTYPES
from moejax.models.deepseek import require_mtp
from moejax.models.registry import family_of
from moejax.parallel import ffi_library
from moejax.parallel.config import ParallelConfig
from moejax.parallel.dispatch import ExpertParallel
from moejax.parallel.sharding import AXIS

DTYPES = ("bfloat16", "float32")
WEIGHT_DTYPES = ("auto", "fp8", "bf16")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # per data-parallel rank; None = fit max_num_seqs x max_model_len in memory
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8" (e4m3 rows with a per-row scale)
    enable_prefix_caching: bool = True  # reuse the cached blocks of a prompt's longest cached prefix
    # With num_blocks None on a device that reports its memory: the fraction of it this engine may fill
    # (weights, cache and a reserve for the step's buffers), as vLLM's --gpu-memory-utilization.
    gpu_memory_utilization: float = 0.9


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int  # prompt + output tokens of one sequence
    max_num_seqs: int = 256  # per data-parallel rank
    max_prefill_tokens: int = 8192  # prompt tokens of one prefill step (longer prompts go in chunks)
    # A sequence preempted more often than this is finished with an error instead of being recomputed
    # again (a cache too small for the load could otherwise keep a request from ever finishing).
    max_preemptions: int = 16
    # Build decode step t+1 while step t runs, reading t's tokens one step late. On by default since
    # 2026-12-05: the synchronous loop left the GPU idle for 32% of a 512 x 2048 V3-rank step (host
    # work between steps, benchmarks/2026-12-05d/); speculative steps run synchronously either way.
    async_scheduling: bool = True
    # When a prefill step may run while sequences decode (moejax/engine/scheduling_policy.py): "prefill-first"
    # (throughput), "interleave:N" or "token-budget:T" (bound the stall of running streams).
    scheduling_policy: str = _policy.DEFAULT


SPEC_METHODS = ("mtp", "deepseek_mtp")  # vLLM's names of the MTP drafter ("deepseek_mtp": its older alias)
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``speculative_config``: the model's own MTP layer drafts
    ``num_speculative_tokens`` tokens a step, the target verifies them (moejax/engine/speculative.py)."""
    method: str = "mtp"
    num_speculative_tokens: int = 1

    @classmethod
    def parse(cls, value, model) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or vLLM's dict {"method": "mtp", "num_speculative_tokens": k}; a
        ValueError names the field that is wrong; a model without an MTP layer gets require_mtp's error."""
        if value is None or isinstance(value, cls):
            spec = value
        else:
            if not isinstance(value, dict):
                raise ValueError(f"speculative_config must be a dict like {{\"method\": \"mtp\", "
                                 f"\"num_speculative_tokens\": 1}} or None, got {value!r}")
            unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
            if unknown:
                raise ValueError(f"speculative_config.{unknown[0]}: unknown field (known: method, "
                                 "num_speculative_tokens)")
            method = value.get("method", "mtp")
            if method not in SPEC_METHODS:
                raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS} (the model's own "
                                 f"multi-token-prediction layer), got {method!r}")
            k = value.get("num_speculative_tokens")
            if not _positive_int(k) or k > MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                                 f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
            spec = cls("mtp", k)
        if spec is not None:
            require_mtp(model)
        return spec


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: Any  # the family's config dataclass (DeepseekConfig, Step3Config, ...)
    scheduler: SchedulerConfig
    cache: CacheConfig = CacheConfig()
    dtype: str = "bfloat16"
    parallel: ParallelConfig | None = None  # None: one device, no mesh
    kernels: str = "auto"  # "auto" | "pallas" | "xla" (moejax/kernel_selection.py)
    fp8: Fp8Policy = NO_FP8  # which layer types keep FP8 block-scaled weights
    fuse_shared_experts: str = "auto"  # "auto" | "on" | "off" (kernel_selection.shared_expert_fusion)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def num_cache_layers(self) -> int:
        """KV-cache layers the runner allocates: the decoder layers', plus the MTP layer's with speculation."""
        return self.model.num_cache_layers if self.speculative else self.model.num_hidden_layers

    @classmethod
    def create(cls, model, *, dtype: str = "bfloat16", parallel: str | ParallelConfig | None = None,
               max_model_len: int | None = None, max_num_seqs: int = 256, block_size: int = 16,
               num_kv_blocks: int | None = None, max_prefill_tokens: int = 8192, kv_cache_dtype: str = "auto",
               kernels: str = "auto", weight_dtype: str = "auto", fp8_layers="default",
               fp8_variant: str = "auto", enable_prefix_caching: bool = True,
               gpu_memory_utilization: float = 0.9, max_preemptions: int = 16,
               fuse_shared_experts: str = "auto", async_scheduling: bool = True,
               scheduling_policy: str = _policy.DEFAULT, speculative_config=None) -> "EngineConfig":
        """Validates every choice against the model; ``parallel`` is a layout name, a path, or a ParallelConfig.

        ``weight_dtype``: "auto" keeps what the checkpoint has (FP8 layers stay FP8; blocks other than
        128x128 are re-blocked to 128x128 on load, with a warning giving the measured error), "fp8" also
        quantises a bf16 checkpoint to 128x128 blocks on load, "bf16" dequantises (the model dtype).
        ``fp8_layers``: the layer types that run FP8 when weights are FP8 (moejax/layers/fp8_policy.py;
        "default" or a comma list). ``fp8_variant``: "auto" (on CUDA, W8A8 for expert GEMMs from
        kernel_selection.MOE_FP8_THRESHOLDS rows an expert, W8A16 elsewhere), "w8a16" or "w8a8".
        ``gpu_memory_utilization`` (0, 1]: the share of device memory the cache is sized to fill when
        ``num_kv_blocks`` is None. ``max_preemptions``: how often a sequence may be preempted before
        it is finished with an error. ``scheduling_policy``: "prefill-first", "interleave:N" or
        "token-budget:T" (moejax/engine/scheduling_policy.py). ``speculative_config``: None or vLLM's
        {"method": "mtp", "num_speculative_tokens": k} (SpeculativeConfig)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
        if fuse_shared_experts not in SHARED_FUSION:
            raise ValueError(f"fuse_shared_experts must be one of {SHARED_FUSION}, got {fuse_shared_experts!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        family = family_of(model)
        if kv_cache_dtype == "fp8" and not family.fp8_kv_cache:
            raise ValueError(f"kv_cache_dtype='fp8' is not implemented for the {family.name} family "
                             "(DeepSeek MLA caches only)")
        for name, v in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_prefill_tokens", max_prefill_tokens)):
            if not _positive_int(v):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {async_scheduling!r}")
        scheduling_policy = _policy.canonical(scheduling_policy)  # ValueError naming it and the options
        if num_kv_blocks is not None and not _positive_int(num_kv_blocks):
            raise ValueError(f"num_kv_blocks must be a positive integer or None, got {num_kv_blocks!r}")
        if (not isinstance(gpu_memory_utilization, (int, float)) or isinstance(gpu_memory_utilization, bool)
                or not 0 < gpu_memory_utilization <= 1):  # NaN fails the comparison too
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gpu_memory_utilization!r}")
        if not isinstance(max_preemptions, int) or isinstance(max_preemptions, bool) or max_preemptions < 0:
            raise ValueError(f"max_preemptions must be a non-negative integer, got {max_preemptions!r}")
        if max_model_len is None:
            max_model_len = min(model.max_position_embeddings, 4096)
        if not _positive_int(max_model_len) or not 2 <= max_model_len <= model.max_position_embeddings:
            raise ValueError(f"max_model_len must be an integer in [2, {model.max_position_embeddings}], "
                             f"got {max_model_len!r}")
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        # "auto" keeps any FP8 checkpoint FP8. The kernels take 128x128 blocks only: other blocks are
        # re-blocked to 128x128 on load, the error measured and reported (moejax/weights/loader.py).
        fp8_on = weight_dtype == "fp8" or (weight_dtype == "auto" and model.fp8_block_size is not None)
        fp8 = Fp8Policy.create(fp8_layers, (128, 128), fp8_variant)  # checked even when unused
        if not fp8_on:
            fp8 = Fp8Policy(frozenset(), fp8.block, fp8.variant)
        if isinstance(parallel, str):
            parallel = ParallelConfig.load(parallel)
        if parallel is not None:
            if not isinstance(parallel, ParallelConfig):
                raise ValueError(f"parallel must be a layout name, a path or a ParallelConfig, got {parallel!r}")
            if model.n_routed_experts % parallel.num_ranks:
                raise ValueError(f"parallel {parallel.name!r}: n_routed_experts={model.n_routed_experts} is not "
                                 f"divisible by expert_parallel_size={parallel.expert_parallel_size}")
            if parallel.moe_backend == "ragged" and jax.default_backend() == "cpu":
                raise ValueError("moe_backend 'ragged' needs jax.lax.ragged_all_to_all, which XLA:CPU does not "
                                 "implement; use 'a2a' or 'replicated' on CPU")
            if parallel.moe_backend == "ffi":
                try:  # only this backend loads the extension
                    ffi_library.require()
                except ffi_library.FfiUnavailable as e:
                    raise ValueError(str(e)) from None
        speculative = SpeculativeConfig.parse(speculative_config, model)
        return cls(model=model, dtype=dtype, parallel=parallel, kernels=kernels, fp8=fp8,
                   fuse_shared_experts=fuse_shared_experts, speculative=speculative,
                   scheduler=SchedulerConfig(max_model_len, max_num_seqs, max_prefill_tokens, max_preemptions,
                                             async_scheduling, scheduling_policy),
                   cache=CacheConfig(block_size, num_kv_blocks, kv_cache_dtype, enable_prefix_caching,
                                     float(gpu_memory_utilization)))

    @property
    def num_ranks(self) -> int:
        return self.parallel.num_ranks if self.parallel else 1

    @property
    def num_redundant_experts(self) -> int:
        return self.parallel.num_redundant_experts if self.parallel else 0

    @property
    def expert_parallel(self) -> ExpertParallel:
        """How the model's MoE layers reach their experts under this layout."""
        if self.parallel is None:
            return ExpertParallel()
        p = self.parallel
        return ExpertParallel(p.moe_backend, AXIS, p.num_ranks, self.num_redundant_experts, p.dbo,
                              p.dbo_decode_min_tokens, p.dbo_prefill_min_tokens)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
