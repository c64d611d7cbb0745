"""The engine's configuration: one object, validated in one place, passed down.

``EngineConfig`` holds the model's config (the family's dataclass, from config.json) and the run's
settings (``args``: moejax/engine_args.py's EngineArgs, where every setting is declared once), with the
views the engine's layers read: ``cache``, ``scheduler``, ``parallel``, ``fp8``, ``speculative``
(like vLLM's VllmConfig). ``EngineConfig.create`` checks the settings against the model and raises a
ValueError naming the one that is wrong; ``Model``, ``ModelRunner``, ``LLMEngine`` and the EPLB
balancer all read this object instead of long argument lists. ``config.<setting>`` reads any setting.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from moejax.engine_args import DTYPES, WEIGHT_DTYPES, EngineArgs  # noqa: F401  (DTYPES, WEIGHT_DTYPES: their old home)
from moejax.layers.fp8_policy import NO_FP8, Fp8Policy
from moejax.models.deepseek import require_mtp
from moejax.models.registry import family_of
from moejax.parallel import ffi_library
from moejax.parallel.config import ParallelConfig
from moejax.parallel.dispatch import ExpertParallel
from moejax.parallel.sharding import AXIS


# The settings each layer reads, by the declaration's names (EngineArgs fields of that ``layer``): filled
# from the declaration (``_view``), so their values and defaults are never spelled twice.
@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    num_kv_blocks: int | None  # per data-parallel rank; None = fit max_num_seqs x max_model_len in memory
    kv_cache_dtype: str  # "auto" (the model dtype) or "fp8" (e4m3 rows with a per-row scale)
    enable_prefix_caching: bool  # reuse the cached blocks of a prompt's longest cached prefix
    # With num_kv_blocks None on a device that reports its memory: the fraction of it this engine may fill
    # (weights, cache and a reserve for the step's buffers), as vLLM's --gpu-memory-utilization.
    gpu_memory_utilization: float

    @property
    def num_blocks(self) -> int | None:  # the runner's name for it
        return self.num_kv_blocks


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int  # prompt + output tokens of one sequence (resolved from the model when not given)
    max_num_seqs: int  # per data-parallel rank
    max_prefill_tokens: int  # prompt tokens of one prefill step (longer prompts go in chunks)
    # A sequence preempted more often than this is finished with an error instead of being recomputed
    # again (a cache too small for the load could otherwise keep a request from ever finishing).
    max_preemptions: int
    # Build decode step t+1 while step t runs, reading t's tokens one step late. On by default since
    # 2026-12-05: the synchronous loop left the GPU idle for 32% of a 512 x 2048 V3-rank step (host
    # work between steps, benchmarks/2026-12-05d/); speculative steps run synchronously either way.
    async_scheduling: bool
    # When a prefill step may run while sequences decode (moejax/engine/scheduling_policy.py): "prefill-first"
    # (throughput), "interleave:N" or "token-budget:T" (bound the stall of running streams).
    scheduling_policy: str


def _view(cls, args: EngineArgs):
    """A layer's view of the settings: ``cls``'s fields, each the setting of that name."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


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
    args: EngineArgs  # every setting (moejax/engine_args.py), max_model_len resolved against the model
    scheduler: SchedulerConfig
    cache: CacheConfig
    parallel: ParallelConfig | None = None  # None: one device, no mesh
    fp8: Fp8Policy = NO_FP8  # which layer types keep FP8 block-scaled weights
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __getattr__(self, name):
        """``config.<setting>``: any setting of ``args`` (dtype, kernels, moe_kernel, ...)."""
        args = self.__dict__.get("args")
        if args is None or name.startswith("_") or name not in args.names():
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(args, name)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def num_cache_layers(self) -> int:
        """KV-cache layers the runner allocates: the decoder layers', plus the MTP layer's with speculation."""
        return self.model.num_cache_layers if self.speculative else self.model.num_hidden_layers

    @classmethod
    def create(cls, model, args: EngineArgs | None = None, **settings) -> "EngineConfig":
        """The settings (``args``, with ``settings`` on top: moejax/engine_args.py's EngineArgs, which checks
        each value on its own) checked against ``model``; a ValueError names the setting that is wrong.
        ``parallel`` may also be a ParallelConfig. Checked here: an FP8 KV cache for the family,
        max_model_len in [2, max_position_embeddings] (default min(that, 4096)), the FP8 policy against
        the checkpoint (weight_dtype "auto" keeps an FP8 checkpoint FP8), the layout against the model
        and platform, speculative_config against the model's MTP layer (SpeculativeConfig)."""
        args = EngineArgs.create(args, **settings)
        family = family_of(model)
        if args.kv_cache_dtype == "fp8" and not family.fp8_kv_cache:
            raise ValueError(f"kv_cache_dtype='fp8' is not implemented for the {family.name} family "
                             "(DeepSeek MLA caches only)")
        max_model_len = args.max_model_len
        if max_model_len is None:
            max_model_len = min(model.max_position_embeddings, 4096)
        if not 2 <= max_model_len <= model.max_position_embeddings:
            raise ValueError(f"max_model_len must be an integer in [2, {model.max_position_embeddings}], "
                             f"got {max_model_len!r}")
        args = dataclasses.replace(args, max_model_len=max_model_len)
        # "auto" keeps any FP8 checkpoint FP8. The kernels take 128x128 blocks only: other blocks are
        # re-blocked to 128x128 on load, the error measured and reported (moejax/weights/loader.py).
        fp8_on = args.weight_dtype == "fp8" or (args.weight_dtype == "auto" and model.fp8_block_size is not None)
        fp8 = Fp8Policy.create(args.fp8_layers, (128, 128), args.fp8_variant)
        if not fp8_on:
            fp8 = Fp8Policy(frozenset(), fp8.block, fp8.variant)
        parallel = ParallelConfig.load(args.parallel) if isinstance(args.parallel, str) else args.parallel
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
        speculative = SpeculativeConfig.parse(args.speculative_config, model)
        return cls(model=model, args=args, scheduler=_view(SchedulerConfig, args), cache=_view(CacheConfig, args),
                   parallel=parallel, fp8=fp8, speculative=speculative)

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
