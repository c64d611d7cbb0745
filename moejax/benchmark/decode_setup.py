"""The decode batch the decode benchmarks measure, built once here: random weights at a named shape,
a full batch at a concurrency and input length (prefilled, or admitted with a random cache), the
step's floors from the model's own parameter shapes, and the compiled programs one engine step
calls (scripts/bench_decode.py times them, scripts/profile_step.py profiles them)."""

from __future__ import annotations

import gc
import json

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import EngineConfig
from moejax.engine_args import EngineArgs
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.sequence import Status
from moejax.layers.fp8_policy import NO_FP8
from moejax.kernels.kv_quant import is_fp8_cache, quantize_rows
from moejax.models.registry import abstract_params, parse_model_config
from moejax.parallel.config import ParallelConfig
from moejax.tiny.presets import preset, with_layers
from moejax.model import random_model
from moejax.weights.random_params import random_device_params
from moejax.weights.param_tree import flatten, is_stacked_expert

_PARAMS: dict = {}  # weights generated once per process, shared by the runs

# The engine settings the decode benchmarks set themselves: swept by their own flags (--parallel, --kernels,
# --weight-dtype are comma lists, one run each; --kv-dtype; --loop), sized from the point (the batch's
# lengths and blocks), or moejax.load's alone. Every other setting is a flag from its declaration
# (moejax/engine_args.py: --dtype, --fp8-variant, --moe-kernel, --mla-kernel, --max-prefill-tokens, ...).
OWN_SETTINGS = ("parallel", "kernels", "weight_dtype", "fp8_layers", "kv_cache_dtype", "max_model_len",
                "max_num_seqs", "num_kv_blocks", "block_size", "async_scheduling", "speculative_config",
                "load_format", "precompile", "compilation_cache_dir")


def add_engine_flags(ap) -> None:
    """The engine settings' flags a decode benchmark takes (all but OWN_SETTINGS)."""
    EngineArgs.add_cli_args(ap, exclude=OWN_SETTINGS)


def engine_settings(a) -> dict:
    """The engine settings of a benchmark's parsed command line (all but OWN_SETTINGS: their defaults where
    ``a`` lacks a flag), as random_model / EngineConfig.create keywords."""
    args = EngineArgs.from_cli_args(a, exclude=OWN_SETTINGS)
    return {k: v for k, v in args.kwargs().items() if k not in OWN_SETTINGS}

# The engine's jitted programs one decode step may call (ModelRunner attributes): the step, the
# sampler over its logits, and the on-device gather of the previous step's tokens (async scheduling).
STEP_PROGRAMS = {"decode": "_decode", "sample": "_sample", "feed": "_feed"}
# A speculative step's programs instead (the proposer's attributes, engine/speculative.py).
PROPOSER_PROGRAMS = {"spec_verify": "_verify", "spec_draft": "_draft", "spec_draft_first": "_draft_first"}


def bench_hf_config(name: str, layers: int | None = None, sets=(), **fields) -> dict:
    """The HF config a benchmark runs: the named preset with ``fields``, its layer count overridden
    (``layers``, first layer dense) and ``sets`` ("KEY=JSON" strings, the scripts' --set) applied."""
    hf = dict(preset(name), **fields)
    if layers:
        hf = with_layers(hf, layers)
    for kv in sets:
        k, v = kv.split("=", 1)
        hf[k] = json.loads(v)
    return hf


def step_floor(cfg, batch, ctx, kv_itemsize=2, ranks=1, fp8=NO_FP8):
    """Bytes and FLOPs of one decode step, from the model's own parameter shapes (any family).

    Bytes: every weight (at these batch sizes every expert is touched) plus the batch's KV
    cache. FLOPs: 2 per active weight per token (routed experts scaled by top-k / E; the
    embedding is a lookup) plus attention, 2 x 2 x heads x cache row per cached token.
    With ``ranks`` > 1 (DP attention + EP experts over a mesh) the bytes are the node's: each
    rank reads its own copy of the non-expert weights; divide by ranks x one card's rate. Weight
    bytes are the leaves' own (``fp8``: FP8 layers count 1 byte a weight plus their scales)."""
    weights = active = 0
    for path, leaf in flatten(abstract_params(cfg, "bfloat16", fp8)).items():
        n = int(np.prod(leaf.shape))
        weights += (n if is_stacked_expert(path) else ranks * n) * np.dtype(leaf.dtype).itemsize
        if is_stacked_expert(path):
            active += n * cfg.num_experts_per_tok // cfg.n_routed_experts
        elif path[0] != "embed_tokens":
            active += n
    L = cfg.num_hidden_layers
    kv = L * batch * ctx * cfg.kv_cache_dim
    flops = 2 * batch * active + 4 * L * batch * ctx * cfg.num_attention_heads * cfg.kv_cache_dim
    return weights + kv_itemsize * kv, flops


def weight_kw(wd: str) -> dict:
    """A --weight-dtype item as EngineConfig arguments: "bf16", "fp8" (the default FP8 layer policy) or
    "fp8:<kinds joined by +>", e.g. "fp8:experts+shared_experts" (the others bf16)."""
    fmt, _, kinds = wd.partition(":")
    if fmt not in ("bf16", "fp8") or (kinds and fmt != "fp8"):
        raise SystemExit(f"--weight-dtype: {wd!r} is not bf16, fp8 or fp8:<layer types joined by +>")
    return dict(weight_dtype=fmt, **({"fp8_layers": kinds.replace("+", ",")} if kinds else {}))


def fill_without_prefill(eng, seed: int = 0) -> None:
    """Admits every waiting sequence as if prefilled: its blocks allocated, its prompt positions
    marked cached, one token appended, and the whole cache written with random rows (values of
    the scale a normalised latent has). Decode then does exactly the work it does after a real
    prefill of that length; only the cached values differ."""
    sch, rng = eng.scheduler, np.random.default_rng(seed)
    while sch.waiting:
        seq = sch.waiting.popleft()
        if not eng.blocks.can_allocate(seq):
            raise SystemExit("the KV cache cannot hold the batch")
        eng.blocks.allocate(seq)
        seq.status = Status.RUNNING
        seq.num_cached_tokens = len(seq)
        seq.token_ids.append(int(rng.integers(2, eng.runner.cfg.vocab_size)))
        sch.running.append(seq)
    runner = eng.runner
    kv_dim = runner.cfg.kv_cache_dim
    fp8 = is_fp8_cache(runner.cache)

    def fill(cache, key):
        def layer(i, c):
            v = jax.random.normal(jax.random.fold_in(key, i), (c.shape[0], c.shape[2], kv_dim), jnp.float32)
            rows = quantize_rows(v, c.shape[-1]) if fp8 else v.astype(c.dtype)
            return jax.lax.dynamic_update_slice_in_dim(c, rows[:, None], i, axis=1)
        return jax.lax.fori_loop(0, cache.shape[1], layer, cache)

    sharding = getattr(runner.cache, "sharding", None)
    runner.cache = jax.jit(fill, donate_argnums=0, out_shardings=sharding)(runner.cache, jax.random.key(seed))
    runner.cache.block_until_ready()


def build_decode_batch(hf, parallel, kernels, a, weight_dtype="bf16", async_scheduling=True, speculative_config=None):
    """The engine at the point, its batch admitted and prefilled (``a.fill``: "prefill" runs the real
    prefill, "random" fills the cache without it), ready for decode steps. ``a`` carries dtype,
    fp8_variant, kv_dtype ("bf16" / "fp8"), concurrency (over the node), input_len, output_len, fill.
    Weights are generated once per weight format and reused; every other engine setting from ``a``
    (``engine_settings``); ``speculative_config`` as moejax.load's (``hf`` then needs its MTP layer).
    Returns (model, engine, sequences)."""
    if weight_dtype not in _PARAMS:
        _PARAMS.clear()  # one weight format's weights on the device at a time
        gc.collect()
        cfg = parse_model_config(hf)
        fp8 = EngineConfig.create(cfg, **weight_kw(weight_dtype)).fp8
        _PARAMS[weight_dtype] = random_device_params(abstract_params(cfg, a.dtype, fp8))
    ranks = 1 if parallel == "none" else ParallelConfig.load(parallel).num_ranks
    per_rank = -(-a.concurrency // ranks)  # --concurrency is over the node; sizes below are per rank
    spare = per_rank * (speculative_config or {}).get("num_speculative_tokens", 0)  # the drafts' rows
    m = random_model(hf, parallel=None if parallel == "none" else parallel, kernels=kernels,
                     params=_PARAMS[weight_dtype], **weight_kw(weight_dtype), **engine_settings(a),
                     kv_cache_dtype={"bf16": "auto", "fp8": "fp8"}[a.kv_dtype],
                     max_model_len=a.input_len + a.output_len + 16, max_num_seqs=per_rank,
                     num_kv_blocks=per_rank * (-(-(a.input_len + a.output_len + 16) // 16)) + spare,
                     async_scheduling=async_scheduling, speculative_config=speculative_config)
    eng = m.engine
    rng = np.random.default_rng(0)
    seqs = [eng.add_request(rng.integers(2, m.config.model.vocab_size, size=a.input_len).tolist(),
                            SamplingParams(max_new_tokens=a.output_len, ignore_eos=True)) for _ in range(a.concurrency)]
    if a.fill == "random":
        fill_without_prefill(eng)
    while eng.scheduler.waiting or eng.scheduler.prefilling:  # prefill everything (not timed)
        eng.step()
    return m, eng, seqs


def capture_step_programs(eng) -> list[tuple[str, object, tuple, dict]]:
    """Runs one more engine step and returns every compiled program it called, in call order:
    (name in STEP_PROGRAMS, the jitted function, the arguments, the keywords). ``fn.lower(*args,
    **kw).compile()`` then gives the program that ran (from JAX's cache: nothing is built again)."""
    calls = []
    owners = [(eng.runner, STEP_PROGRAMS)]
    if not eng.runner.proposer.own_decode:  # speculative: the proposer's programs too
        owners.append((eng.runner.proposer, PROPOSER_PROGRAMS))
    real = {name: getattr(o, attr) for o, table in owners for name, attr in table.items()}

    def capture(name):
        def call(*args, **kw):
            calls.append((name, real[name], args, kw))
            return real[name](*args, **kw)
        return call

    for o, table in owners:
        for name, attr in table.items():
            setattr(o, attr, capture(name))
    try:
        eng.step()
    finally:
        for o, table in owners:
            for name, attr in table.items():
                setattr(o, attr, real[name])
    return calls


def capture_decode_args(eng):
    """Runs one more engine step and returns (the jitted decode step, the arguments it was called with,
    its static keywords: the batch's sampling mode)."""
    r = eng.runner
    real, got = r._decode, {}

    def capture(*args, **kw):
        got["args"], got["kw"] = args, kw
        return real(*args, **kw)

    r._decode = capture
    try:
        eng.step()
    finally:
        r._decode = real
    return real, got["args"], got["kw"]
