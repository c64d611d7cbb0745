"""Every engine setting, declared once: ``EngineArgs`` (vLLM's ``EngineArgs``).

A setting is one field below: its name, type, default, choices, help, its check and the layer that
uses it (``layer``). Everything else is derived from this declaration:

- ``moejax.load(path, **settings)``: its keywords (``load``'s signature and docstring are built from
  the fields), an unknown keyword a ValueError naming it, a bad value a ValueError naming the field;
- ``EngineConfig`` (moejax/config.py): ``EngineConfig.create(model, **settings)`` checks them
  against the model and keeps them (``config.args``; ``config.<setting>`` reads one);
- the command lines: ``add_cli_args(parser)`` / ``from_cli_args(namespace)`` for ``moejax serve``
  (moejax/server/cli.py), scripts/generate.py and the benchmark scripts that build an engine;
- the argv of a worker process (disaggregation): ``to_argv()``, so that
  ``from_cli_args(parser.parse_args(args.to_argv())) == args``.

Adding a setting is one field here plus its use (where its layer reads ``config.<name>``).
The flags are vLLM's spellings where moejax has the equivalent (``--max-num-seqs``,
``--max-model-len``, ``--kv-cache-dtype``, ``--gpu-memory-utilization``, ``--load-format``, ...).

``layer`` names who reads a setting: "model" (EngineConfig: dtype, FP8 policy, layout), "cache"
(CacheConfig), "scheduler" (SchedulerConfig), "kernels" (the rules of moejax/kernels/<operation>.py,
through the step's trace) or "load" (moejax.load itself). The declaration checks each value on its own;
``EngineConfig.create`` then checks what depends on the model (max_model_len's range, an FP8 cache
for the family, the layout's expert count, the MTP layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
from typing import Any, Callable

from moejax.kernels.common import (KERNEL_MODES, MFA_KERNELS, MLA_KERNELS, MOE_KERNELS, SHARED_FUSION, W8A8_DENSE_KERNELS,
                                    W8A8_KERNELS)
from moejax.layers.fp8_policy import VARIANTS, Fp8Policy
from moejax.kernels.kv_quant import KV_CACHE_DTYPES
from moejax import scheduling_spec as _policy
from pallas_kernels import triton_fp8_dots

DTYPES = ("bfloat16", "float32")
WEIGHT_DTYPES = ("auto", "fp8", "bf16")
# auto: the checkpoint's weights; dummy: random weights of its shapes, made on the device (vLLM's --load-format dummy).
LOAD_FORMATS = ("auto", "dummy")
LAYERS = ("model", "cache", "scheduler", "kernels", "load")
# The disaggregated handoff an engine takes part in (vLLM's kv_transfer_config kv_role: kv_producer = prefill,
# kv_consumer = decode, kv_both = both): which cache-row programs it builds (engine/kv_handoff.py).
KV_ROLES = ("none", "prefill", "decode", "both")


# ----------------------------------------------------------------------------- checks
# Each takes (name, value) and returns the value as kept, or raises a ValueError naming the setting.

def positive_int(name, v):
    if not _is_int(v) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


def positive_int_or_none(name, v):
    if v is not None and (not _is_int(v) or v < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
    return v


def non_negative_int(name, v):
    if not _is_int(v) or v < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return v


def boolean(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be True or False, got {v!r}")
    return v


def fraction(name, v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:  # NaN fails the comparison too
        raise ValueError(f"{name} must be a number in (0, 1], got {v!r}")
    return float(v)


def path_or_none(name, v):
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{name} must be a path, 'off' or None, got {v!r}")
    return v


def layout_spec(name, v):
    """A layout name or path (ParallelConfig.load), a ParallelConfig, or None; EngineConfig.create loads it."""
    if v is not None and not isinstance(v, str) and not hasattr(v, "num_ranks"):
        raise ValueError(f"{name} must be a layout name, a path or a ParallelConfig, got {v!r}")
    return v


def fp8_layer_list(name, v):
    """"default", a comma list, or an iterable of layer types (kept as a tuple): Fp8Policy's check."""
    if not isinstance(v, str):
        try:
            v = tuple(v)
        except TypeError:
            raise ValueError(f"{name} must be 'default', a comma list or a list of layer types, got {v!r}") from None
    Fp8Policy.create(v)  # a ValueError naming fp8_layers and the known types
    return v


def policy_spec(name, v):
    return _policy.canonical(v)  # a ValueError naming scheduling_policy and the options


def json_object_or_none(name, v):
    """None or a dict (vLLM's speculative_config); its fields are checked by EngineConfig.create."""
    if v is not None and not isinstance(v, dict) and not hasattr(v, "num_speculative_tokens"):
        raise ValueError(f"{name} must be a dict like {{\"method\": \"mtp\", \"num_speculative_tokens\": 1}} "
                         f"or None, got {v!r}")
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json(text: str):
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    return value


def setting(default, help: str, *, layer: str, choices: tuple | None = None, check: Callable | None = None,
            parse: Callable[[str], Any] = str, metavar: str | None = None):
    """A field of EngineArgs: ``parse`` turns a command-line string into the value (bools are
    --x / --no-x flags), ``check(name, value)`` returns it as kept or raises a ValueError naming it."""
    assert layer in LAYERS, layer
    meta = dict(help=help, layer=layer, choices=choices, check=check, parse=parse, metavar=metavar)
    # A dict value (speculative_config) is not hashable: such a field is left out of the hash.
    return dataclasses.field(default=default, metadata=meta, hash=not (default is None and parse is _json))


def switch(default: bool, help: str, layer: str):
    """A boolean setting: --x / --no-x on the command line, True or False in Python."""
    return setting(default, help, layer=layer, check=boolean)


def choice(default: str, help: str, choices: tuple, layer: str):
    """A setting of fixed choices (argparse's choices on the command line)."""
    return setting(default, help, layer=layer, choices=choices)


def kernel_choice(help: str, choices: tuple, rule: str):
    """A kernels setting whose "auto" (the default) leaves the choice to ``rule``, in moejax/kernels/."""
    return choice("auto", f"{help} (moejax/kernels/{rule})", choices, "kernels")


# ----------------------------------------------------------------------------- the declaration

@dataclasses.dataclass(frozen=True)
class EngineArgs:
    # --- the model and its weights
    dtype: str = choice("bfloat16", "the model dtype (activations; bf16 weights)", DTYPES, "model")
    load_format: str = choice(
        "auto", "auto: the checkpoint's weights; dummy: RANDOM weights made on the device at the model's shapes "
        "(vLLM's --load-format dummy): the model is then a directory holding a config.json or a preset name "
        "(deepseek-v3, deepseek-v2-lite, step3, v3-tiny, ...; moejax/tiny/presets.py), with the tiny byte-level "
        "tokenizer where it has no tokenizer files", LOAD_FORMATS, "load")
    weight_dtype: str = choice(
        "auto", "auto: an FP8 checkpoint stays FP8 on the device (blocks other than 128x128 re-blocked on load); "
        "fp8: also quantise a bf16 checkpoint to 128x128 blocks (vllm --quantization fp8); bf16: dequantise",
        WEIGHT_DTYPES, "model")
    fp8_layers: str | tuple[str, ...] = setting(
        "default", "the layer types that run FP8 when weights are FP8: default (experts, shared experts, dense "
        "MLPs, attention projections), or a comma list of experts, shared_experts, dense_mlp, attention, "
        "lm_head (moejax/layers/fp8_policy.py)", layer="model", check=fp8_layer_list)
    fp8_variant: str = choice(
        "auto", "auto: per GEMM from its rows on CUDA (W8A8 for expert GEMMs from MOE_FP8_THRESHOLDS rows an "
        "expert, moejax/kernels/moe_fp8.py: pick_variant; for dense GEMMs from DENSE_W8A8_ROWS rows, "
        "moejax/kernels/fp8_gemm.py: pick_variant), w8a16 (weights converted in the kernel) or w8a8 "
        "(activations quantised too, FP8 dots)", VARIANTS, "model")
    parallel: Any = setting(
        None, "the parallel layout: dp{N}-ep{N} (DP attention + EP experts over N devices, e.g. dp8-ep8), a "
        "layout shipped in configs/ (e.g. dp8-ep8-eplb) or a path to a .yaml; none: one device",
        layer="model", check=layout_spec, metavar="LAYOUT")
    speculative_config: dict | None = setting(
        None, "speculative decoding, as vLLM's: '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}' (the "
        "checkpoint's MTP layer drafts k tokens a step, the model verifies them in one step: the same greedy "
        "tokens, the same sampled distribution; moejax/engine/speculative.py)",
        layer="model", check=json_object_or_none, parse=_json, metavar="JSON")
    # --- the KV cache
    block_size: int = setting(16, "tokens per KV cache block", layer="cache", check=positive_int, parse=int)
    num_kv_blocks: int | None = setting(
        None, "KV cache blocks per data-parallel rank (default: max-num-seqs x max-model-len, within the memory "
        "that --gpu-memory-utilization leaves)", layer="cache", check=positive_int_or_none, parse=int)
    kv_cache_dtype: str = choice("auto", "auto: the model dtype; fp8: e4m3 rows with a per-row scale (DeepSeek "
                                 "MLA only)", KV_CACHE_DTYPES, "cache")
    enable_prefix_caching: bool = switch(
        True, "reuse the KV blocks of a prompt's longest cached prefix (vLLM's automatic prefix caching)", "cache")
    gpu_memory_utilization: float = setting(
        0.9, "(0, 1]: without --num-kv-blocks, the share of the device's memory (weights, cache, a reserve for "
        "the step) the cache is sized to fill; on CPU the cache is 2 GiB at most", layer="cache", check=fraction,
        parse=float)
    # --- the scheduler
    max_model_len: int | None = setting(
        None, "prompt + output tokens of one sequence (default: the model's max_position_embeddings, at most 4096)",
        layer="scheduler", check=positive_int_or_none, parse=int)
    max_num_seqs: int = setting(256, "sequences a step, per data-parallel rank", layer="scheduler",
                                check=positive_int, parse=int)
    max_prefill_tokens: int = setting(8192, "prompt tokens of one prefill step; longer prompts are prefilled in "
                                      "chunks", layer="scheduler", check=positive_int, parse=int)
    max_preemptions: int = setting(
        16, "a sequence preempted more often than this is finished with an error (the server answers 503) "
        "instead of being recomputed again", layer="scheduler", check=non_negative_int, parse=int)
    async_scheduling: bool = switch(
        True, "build decode step t+1 while step t runs, reading t's tokens one step late (vLLM's async "
        "scheduling; the same tokens as without it: moejax/engine/llm_engine.py)", "scheduler")
    scheduling_policy: str = setting(
        _policy.DEFAULT, "when a prefill step may run while sequences decode: prefill-first (whenever a "
        "prompt waits and fits: throughput), interleave:N (at most N prefill steps in a row, then a decode "
        "step), token-budget:T (at most T prompt tokens between two decode steps); docs/serving.md",
        layer="scheduler", check=policy_spec)
    # --- kernels (the rules of moejax/kernels/<operation>.py read them while the step is traced)
    kernels: str = choice("auto", "auto: the Pallas/Triton kernels on GPU where the shapes suit them, XLA on "
                          "CPU; pallas: the kernels everywhere (CPU: the interpreter); xla: XLA only",
                          KERNEL_MODES, "kernels")
    fuse_shared_experts: str = kernel_choice(
        "auto: the shared experts inside the routed-expert kernel where the Pallas fused MoE runs; on; off",
        SHARED_FUSION, "moe.py: fuse_shared_experts")
    moe_kernel: str = kernel_choice(
        "the bf16 routed experts' kernel on a GPU: pallas (fused_moe, the default) or triton (fused_moe_triton "
        "through jax-triton)", MOE_KERNELS, "moe.py: moe_kernel")
    w8a8_kernel: str = kernel_choice(
        "the W8A8 expert GEMMs' kernels: triton where jax-triton is installed (the default), or pallas "
        "(fused_moe_fp8)", W8A8_KERNELS, "moe_fp8.py: w8a8_kernel")
    w8a8_dense_kernel: str = kernel_choice(
        "the W8A8 dense projections' kernel from DENSE_W8A8_ROWS rows: pallas, triton, or cublaslt (any row "
        "count)", W8A8_DENSE_KERNELS, "fp8_gemm.py: dense_w8a8_kernel")
    mla_kernel: str = kernel_choice(
        "MLA decode's kernel on a GPU: mgpu (Mosaic GPU; 64-head multiples over a bf16 cache on Hopper, the default "
        "there), triton (64+ heads over an FP8 cache on CUDA, the default there) or pallas",
        MLA_KERNELS, "mla_decode.py: mla_kernel")
    mfa_kernel: str = kernel_choice(
        "Step3 MFA decode's kernel on a GPU: pallas (the default) or mgpu (Mosaic GPU on Hopper: 64-head multiples "
        "over a bf16 cache, not yet measured)", MFA_KERNELS, "mfa_decode.py: mfa_kernel")
    fp8_fast_accum: bool = switch(
        triton_fp8_dots.DEFAULT, "FP8 x FP8 dots of the Pallas kernels on Hopper's wgmma (Triton's own FP8 default; "
        "pallas_kernels/triton_fp8_dots.py); --no-fp8-fast-accum keeps Triton-lowering's precise "
        "accumulation (mma.sync); default: on unless $MOEJAX_FP8_FAST_ACC is 0. A lowering choice of the "
        "process: the setting of the engine traced last", "kernels")
    # --- moejax.load itself
    precompile: bool = switch(
        False, "compile every program the engine can run for this configuration (decode, prefill and sampling "
        "buckets: moejax/engine/buckets.py) at load, so no later call compiles", "load")
    compilation_cache_dir: str | None = setting(
        None, "JAX's persistent compilation cache, so a restart loads its programs (default: "
        "$MOEJAX_COMPILATION_CACHE_DIR, else ~/.cache/moejax/jax on a GPU, off on CPU; 'off' disables it: "
        "moejax/compilation.py)", layer="load", check=path_or_none, metavar="DIR")
    executable_cache_dir: str = setting(
        "env", "where the precompiled set's executables are kept, so a restart neither traces nor compiles them "
        "(moejax/executable_cache.py): a folder; 'env' (the default): $MOEJAX_EXECUTABLE_CACHE_DIR, else off; "
        "'auto' (moejax serve's default): $MOEJAX_EXECUTABLE_CACHE_DIR, else $XDG_CACHE_HOME/moejax/executables "
        "(~/.cache/moejax/executables); 'off' disables it", layer="load", check=path_or_none, metavar="DIR")
    kv_role: str = choice(
        "none", "the prefill/decode disaggregation handoff this engine takes part in, as vLLM's kv_transfer_config "
        "kv_role (kv_producer, kv_consumer, kv_both): none (a plain server: no cache-row export/import programs "
        "built), prefill (exports a prefilled sequence's cache rows), decode (imports them), both; a handoff "
        "the role lacks is refused, never compiled (engine/kv_handoff.py). moejax serve --role sets it",
        KV_ROLES, "load")
    print_programs: bool = switch(
        False, "print every precompiled program at start-up: its bucket and why it exists "
        "(moejax/engine/precompile.py)", "load")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            choices, check = f.metadata["choices"], f.metadata["check"]
            if choices is not None and v not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {v!r}")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, v))

    # ------------------------------------------------------------------ from keywords
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def create(cls, args: "EngineArgs | None" = None, **settings) -> "EngineArgs":
        """EngineArgs from keywords (onto ``args`` when given); an unknown keyword is a ValueError naming it."""
        unknown = [k for k in settings if k not in cls.names()]
        if unknown:
            near = difflib.get_close_matches(unknown[0], cls.names(), n=1)
            raise ValueError(f"unknown setting {unknown[0]!r}{f' (did you mean {near[0]!r}?)' if near else ''}; "
                             f"the settings are moejax/engine_args.py's EngineArgs fields: {', '.join(cls.names())}")
        return dataclasses.replace(args, **settings) if args is not None else cls(**settings)

    def replace(self, **settings) -> "EngineArgs":
        return type(self).create(self, **settings)

    def kwargs(self) -> dict:
        """The settings as ``moejax.load`` keywords (every one of them)."""
        return {name: getattr(self, name) for name in self.names()}

    def layer(self, layer: str) -> dict:
        """The settings a layer reads ("cache", "scheduler", ...), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["layer"] == layer}

    # ------------------------------------------------------------------ command lines
    @classmethod
    def add_cli_args(cls, parser, *, defaults: dict | None = None, only=None, exclude=()) -> None:
        """One flag per setting (``--max-num-seqs``), its default, choices and help from the declaration;
        ``defaults``: this command's own defaults (e.g. ``moejax serve`` precompiles); ``only`` / ``exclude``:
        names of the settings to offer (a benchmark that sweeps a setting declares its own flag for it)."""
        defaults = dict(defaults or {})
        bad = sorted(set(defaults) - set(cls.names()))
        assert not bad, f"defaults for undeclared settings {bad}"
        group = parser.add_argument_group("engine settings (moejax/engine_args.py; moejax.load's keywords)")
        for f in dataclasses.fields(cls):
            if (only is not None and f.name not in only) or f.name in exclude:
                continue
            m, default = f.metadata, defaults.get(f.name, f.default)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=m["help"])
                continue
            group.add_argument(flag, type=_cli_type(f), default=default, choices=m["choices"], help=m["help"],
                               metavar=m["metavar"])

    @classmethod
    def from_cli_args(cls, namespace, *, exclude=(), **settings) -> "EngineArgs":
        """EngineArgs from a parsed command line (the settings it has flags for, but ``exclude``: those a
        benchmark's own flags of the same name sweep; others keep their default), with ``settings`` on top."""
        given = {n: getattr(namespace, n) for n in cls.names() if hasattr(namespace, n) and n not in exclude}
        return cls.create(**{**given, **settings})

    def to_argv(self) -> list[str]:
        """The flags that give these settings back (``from_cli_args(parse(to_argv()))`` equals them), every
        setting spelled out, so a parser with other defaults (``moejax serve``'s) reads the same."""
        argv = []
        for f in dataclasses.fields(self):
            v, flag = getattr(self, f.name), "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                argv.append(flag if v else "--no-" + flag[2:])
            elif v is None:
                continue  # every optional setting's default is None
            elif f.metadata["parse"] is _json:
                argv += [flag, json.dumps(v if isinstance(v, dict) else dataclasses.asdict(v))]
            elif f.name == "fp8_layers" and not isinstance(v, str):
                argv += [flag, ",".join(v)]
            elif not isinstance(v, (str, int, float)):
                raise ValueError(f"{f.name}: {v!r} has no command-line form (give a layout name or path)")
            else:
                argv += [flag, str(v)]
        return argv

    # ------------------------------------------------------------------ documentation
    @classmethod
    def doc(cls) -> str:
        """One line a setting: name, default, choices, help (appended to ``moejax.load``'s docstring)."""
        lines = []
        for f in dataclasses.fields(cls):
            choices = f" ({' | '.join(map(str, f.metadata['choices']))})" if f.metadata["choices"] else ""
            lines.append(f"    ``{f.name}`` = {f.default!r}{choices}: {f.metadata['help']}.")
        return "\n".join(lines)


def _cli_type(f: dataclasses.Field):
    """A flag's argparse type: the field's parse then its check; a bad value is a usage error naming the flag."""
    parse, check = f.metadata["parse"], f.metadata["check"]

    def convert(text: str):
        try:
            v = parse(text)
            return check(f.name, v) if check is not None else v
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = f.name  # argparse names the type in its "invalid <type> value" message
    return convert


def with_settings(fn, *, keep=("path", "progress")):
    """``fn(path, *, progress, **settings)`` given a signature and docstring with every setting as a
    keyword-only parameter and its default (``inspect.signature``, ``help()``); ``keep``: fn's own."""
    own = [p for name, p in inspect.signature(fn).parameters.items() if name in keep]
    params = own + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
                    for f in dataclasses.fields(EngineArgs)]
    fn.__signature__ = inspect.Signature(params, return_annotation=inspect.signature(fn).return_annotation)
    fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n\n    Settings (moejax/engine_args.py):\n" + EngineArgs.doc() + "\n"
    return fn
