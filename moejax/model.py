"""``moejax.load`` / ``moejax.save`` and the Model they return."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from moejax import compilation
from moejax.config import EngineConfig
from moejax.engine_args import LOAD_FORMATS, EngineArgs, with_settings
from moejax.engine.llm_engine import LLMEngine
from moejax.engine.model_runner import ModelRunner
from jax.sharding import NamedSharding

from moejax.eplb.balancer import ExpertLoadBalancer, initial_placements, routing_tree
from moejax.json_file import load_json_file
from moejax.kernels.common import KernelScopedModule
from moejax.layers.fp8_policy import Fp8Policy
from moejax.models.registry import abstract_params, build_module, family_for, family_of, parse_model_config
from moejax.parallel import processes
from moejax.parallel.sharding import make_mesh, param_logical_axes, put_replicated, spec
from moejax.tiny.presets import PRESETS
from moejax.tiny.tokenizer import temp_tokenizer_dir
from moejax.weights.param_tree import flatten, unflatten
from moejax.tokenizer import Tokenizer
from moejax.weights.fp8 import ReblockStats
from moejax.weights.loader import load_hf_params
from moejax.weights.safetensors_io import list_checkpoint_files
from moejax.weights.orbax_io import restore_params, save_params
from moejax.weights.random_params import random_device_params

MARKER = "moejax.json"  # present in directories written by moejax.save
# The saved pytree's layout. 2: DeepSeek MLA's q_a_proj and kv_a_proj_with_mqa saved as one qkv_a_proj.
# (A DeepSeek MTP layer adds its leaves under layers_<num_hidden_layers>; the marker's
# num_nextn_predict_layers says whether they were saved: saves from before MTP was loaded hold none.)
FORMAT_VERSION = 2
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ParamPlacer:
    """Puts parameter leaves on their devices as they are loaded: routed experts into their physical
    slots (EPLB: contiguous, plus replicas in the redundant slots), then sharded by the rules table
    (moejax/parallel/sharding.py) over the layout's mesh, or onto the default device. Each process
    transfers only the shards of its own devices (``jax.make_array_from_callback``), and the loader
    converts only the experts those shards hold (``experts_needed``)."""

    def __init__(self, config: EngineConfig):
        self.placements = initial_placements(config.model, config.num_ranks, config.num_redundant_experts)
        self.mesh = make_mesh(config.num_ranks) if config.parallel is not None else None
        self._slots = ({path: p.logical_of_slot for path, p in self.placements.items()}
                       if config.num_redundant_experts else {})
        # The ranks whose devices are this process's (all of them in a one-process job).
        self._local_ranks = (None if self.mesh is None or jax.process_count() == 1 else
                             [r for r, d in enumerate(self.mesh.devices.flat) if d.process_index == jax.process_index()])

    def experts_needed(self, module: tuple[str, ...]) -> set[int] | None:
        """The logical experts of an experts module that this process's slots hold; None: all of them."""
        p = self.placements.get(module)
        if p is None or self._local_ranks is None:
            return None
        per_rank = p.num_slots // p.num_ranks
        slots = np.concatenate([np.arange(r * per_rank, (r + 1) * per_rank) for r in self._local_ranks])
        return set(p.logical_of_slot[slots].tolist())

    def restore_shardings(self, abstract):
        """Where orbax should restore a saved (logical-order) pytree straight to: each leaf's own sharding,
        so each process reads only its own shards; None (restore to host memory, then place) when there
        is no mesh, or when redundant slots make the slot order differ from the saved logical order."""
        if self.mesh is None or self._slots:
            return None
        return unflatten({path: NamedSharding(self.mesh, spec(*param_logical_axes(path))) for path in flatten(abstract)})

    def __call__(self, path: tuple[str, ...], arr):
        src = self._slots.get(path[:-1])  # every leaf of an experts module has the slot axis first
        if self.mesh is None:
            return jax.device_put(arr if src is None else np.asarray(arr)[src])
        shape = np.shape(arr) if src is None else (len(src), *np.shape(arr)[1:])
        sharding = NamedSharding(self.mesh, spec(*param_logical_axes(path)))
        if isinstance(arr, jax.Array) and src is None:  # restored in place (restore_shardings): kept as it is
            return jax.device_put(arr, sharding)

        def shard(index):  # the part of the (slot-ordered) leaf one of this process's devices holds
            if src is None:
                return np.asarray(arr[index])
            return np.asarray(arr[src[index[0]]][(slice(None), *index[1:])])
        return jax.make_array_from_callback(shape, sharding, shard)

    def tree(self, params):
        return unflatten({path: self(path, a) for path, a in flatten(params).items()})


class Model:
    """A loaded model: its EngineConfig, parameters on device, tokenizer, and (lazily) an engine.
    ``params`` are already placed by ``placer`` (``ParamPlacer.tree`` for a whole pytree).
    ``tokenizer_dir``: where the tokenizer's files are (``save`` copies them; default ``source_dir``).
    ``fp8_reblock_error``: None, or the error of re-blocking an FP8 checkpoint whose blocks are not
    128x128 to the kernels' 128x128 on load, against the checkpoint's own weights
    (moejax/weights/fp8.py ``ReblockStats.summary``: ``rel_frobenius`` and ``rel_max_abs``, maxima
    over the matrices, the blocks, the matrix count); kept by ``save``/``load``."""

    def __init__(self, config: EngineConfig, hf_config: dict, params, tokenizer: Tokenizer, source_dir: str,
                 placer: ParamPlacer, tokenizer_dir: str | None = None, fp8_reblock_error: dict | None = None):
        self.config, self.hf_config = config, hf_config
        self.fp8_reblock_error = fp8_reblock_error
        self.tokenizer, self.source_dir = tokenizer, source_dir
        self.tokenizer_dir = source_dir if tokenizer_dir is None else tokenizer_dir
        self.params, self.placements, self.mesh = params, placer.placements, placer.mesh
        self.routing = put_replicated(routing_tree(self.placements, 1 + config.num_redundant_experts), self.mesh)
        # Pallas or XLA kernels, picked at trace time (moejax/kernels/).
        self.module = KernelScopedModule(build_module(config.model, config.dtype, config.expert_parallel, config.fp8),
                                         config.kernels, config.fuse_shared_experts, settings=config.args)
        self._engine = None

    # Short names for what callers read most.
    dtype = property(lambda self: self.config.dtype)
    max_model_len = property(lambda self: self.config.scheduler.max_model_len)
    block_size = property(lambda self: self.config.cache.block_size)

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            with self.module.scope():  # the runner plans its buckets from the kernels these settings choose
                runner = ModelRunner(self.config, self.module, self.params, self.routing, self.mesh)
            balancer = ExpertLoadBalancer(self.config, runner, self.placements)
            cfg_eos = self.config.model.eos_token_ids
            eos = cfg_eos or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
            self._engine = LLMEngine(self.config, runner, self.tokenizer, eos, balancer)
        return self._engine

    def score(self, token_ids) -> np.ndarray:
        """Full-vocabulary logits of each prompt: float32 array [B, T, V]. Prompts must have equal length."""
        arr = _as_token_matrix(token_ids, self.config.model.vocab_size)
        if arr.shape[1] > self.max_model_len:
            raise ValueError(f"token_ids has length {arr.shape[1]} > max_model_len {self.max_model_len}")
        return self.engine.runner.score(arr)


def _as_token_matrix(token_ids, vocab_size: int) -> np.ndarray:
    try:
        arr = np.asarray(token_ids)
    except ValueError as e:
        raise ValueError(f"token_ids must be a rectangular [B, T] array of token ids: {e}") from None
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.size == 0 or arr.dtype == object:
        raise ValueError("token_ids must be a non-empty [B, T] array of token ids (all prompts of equal length)")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"token_ids must lie in [0, {vocab_size})")
    return arr.astype(np.int32)


def random_weights_model(config: EngineConfig, hf_config: dict, *, seed: int = 0, params=None,
                         source_dir: str | None = None, tokenizer_dir: str | None = None) -> Model:
    """A Model of random weights made on the device, each device making only its own shards
    (``random_device_params``). ``params``: already made weights to reuse (random_device_params of the
    same model, dtype and FP8 policy). ``tokenizer_dir``: default, the tiny byte-level tokenizer
    (moejax/tiny/tokenizer.py: 260 tokens, whatever the model's vocabulary; ids it lacks decode to
    nothing). ``source_dir``: the name the model goes by (default ``tokenizer_dir``)."""
    placer = ParamPlacer(config)
    if params is None:
        abstract = abstract_params(config.model, config.dtype, config.fp8)
        params = random_device_params(abstract, seed, shardings=placer.restore_shardings(abstract))
    tokenizer_dir = temp_tokenizer_dir() if tokenizer_dir is None else tokenizer_dir
    return Model(config, hf_config, placer.tree(params), Tokenizer(tokenizer_dir), source_dir or tokenizer_dir, placer,
                 tokenizer_dir=tokenizer_dir)


def random_model(hf_config: dict, dtype: str = "bfloat16", parallel: str | None = None, seed: int = 0,
                 params=None, **engine_kw) -> Model:
    """A Model of random weights made on the device from a config dict (``random_weights_model``), for
    benchmarks at real shapes where writing and reading a checkpoint would dominate. ``engine_kw``: the
    EngineConfig.create arguments (max_model_len, default 4096, max_num_seqs, kernels, weight_dtype="fp8", ...)."""
    config = EngineConfig.create(parse_model_config(hf_config), dtype=dtype, parallel=parallel,
                                 **{"max_model_len": 4096, **engine_kw})
    return random_weights_model(config, hf_config, seed=seed, params=params)


def _check_load_format(load_format) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")


def _dummy_config(path) -> dict:
    """load_format="dummy": the config.json contents of a directory holding one, or of a preset name."""
    if isinstance(path, str) and os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ValueError(f"path {path!r} has no config.json (load_format='dummy' takes a directory holding a "
                             f"config.json, or a preset: {', '.join(sorted(PRESETS))})")
        return load_json_file(cfg_path, "config.json")
    if isinstance(path, str) and path in PRESETS:
        return copy.deepcopy(PRESETS[path])
    raise ValueError(f"path {path!r} is neither a preset nor a directory holding a config.json (load_format='dummy'); "
                     f"presets: {', '.join(sorted(PRESETS))}")


def tokenizer_source(path: str, load_format: str = "auto") -> str:
    """The directory of the tokenizer files a model loaded from ``path`` uses: ``path`` itself, except
    with load_format="dummy" where ``path`` has no tokenizer.json (a preset name, a directory holding
    only config.json): the tiny byte-level tokenizer's (written to a new temporary directory)."""
    _check_load_format(load_format)
    if load_format == "dummy" and not os.path.exists(os.path.join(path, "tokenizer.json")):
        return temp_tokenizer_dir()
    return path


@with_settings
def load(path: str, *, progress: bool = True, **settings) -> Model:
    """Loads an HF checkpoint directory of a registered family (DeepSeek-V2/V3, Step3), or one
    written by ``moejax.save``; ``progress``: a progress bar while the weights load.

    ``settings``: the engine's settings, declared in moejax/engine_args.py (``EngineArgs``; listed
    below with their defaults), the same as ``moejax serve``'s flags. An unknown keyword is a
    ValueError naming it; each value is checked by the declaration, then against the model by
    ``EngineConfig.create`` (moejax/config.py), a ValueError naming the setting that is wrong.

    ``load_format="dummy"``: RANDOM weights made on the device at the model's real shapes, for
    benchmarks and tests without the checkpoint; ``path`` is then a directory holding a config.json
    (its tokenizer files used if present) or a preset name (moejax/tiny/presets.py); without tokenizer
    files the tiny byte-level tokenizer is used (260 tokens: prompts of token ids reach the whole
    vocabulary). Every other setting applies as with a checkpoint.
    ``parallel``: without it the model runs on one device; max_num_seqs and num_kv_blocks are per
    data-parallel rank.
    """
    args = EngineArgs.create(**settings)
    compilation.enable_persistent_cache(args.compilation_cache_dir)
    model = _load(path, args, progress)
    if args.precompile:
        model.engine.precompile(progress)
    return model


def _load(path, args: EngineArgs, progress: bool) -> Model:
    _check_load_format(args.load_format)
    if args.load_format == "dummy":
        hf_config = _dummy_config(path)
    elif not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"path {path!r} is not a directory")
    if processes.initialize_from_env() and args.parallel is None:  # a job of python -m moejax.launch: joined
        raise ValueError(f"parallel: this is one of {processes.count()} processes; name a layout whose mesh spans "
                         "them (e.g. dp8-ep8), or run one process")
    if args.load_format == "auto":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ValueError(f"{path} has no config.json")
        hf_config = load_json_file(cfg_path, "config.json")
        if not os.path.exists(os.path.join(path, MARKER)):
            hf_config = _fit_to_checkpoint(path, hf_config)
    config = EngineConfig.create(parse_model_config(hf_config), args)
    if args.load_format == "dummy":
        return random_weights_model(config, hf_config, source_dir=path, tokenizer_dir=tokenizer_source(path, "dummy"))
    dtype = config.dtype
    placer = ParamPlacer(config)
    marker = os.path.join(path, MARKER)
    reblock, reblock_error = ReblockStats(), None
    if os.path.exists(marker):
        saved = load_json_file(marker, "moejax save marker")
        if saved.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{marker} has format_version {saved.get('format_version')!r}, this moejax reads "
                             f"{FORMAT_VERSION}: save it again from its HF checkpoint")
        saved_mtp, mtp = saved.get("num_nextn_predict_layers", 0), getattr(config.model, "num_nextn_predict_layers", 0)
        if saved_mtp != mtp:
            raise ValueError(f"{path} holds the weights of {saved_mtp} multi-token-prediction layer(s) but its "
                             f"config.json has num_nextn_predict_layers {mtp} (saved before moejax loaded the MTP "
                             "layer?): save it again from its HF checkpoint")
        saved_fp8 = Fp8Policy.create(saved.get("fp8_layers", []), (128, 128), config.fp8.variant)
        if saved_fp8.kinds != config.fp8.kinds:
            raise ValueError(f"{path} was saved with FP8 layers {sorted(saved_fp8.kinds)}; load it with the same "
                             f"weight_dtype/fp8_layers (this load asks for {sorted(config.fp8.kinds)})")
        abstract = abstract_params(config.model, saved["dtype"], saved_fp8)
        params = restore_params(path, abstract, placer.restore_shardings(abstract))
        if saved["dtype"] != dtype:  # the router stays float32 and FP8 stays FP8 whatever the model dtype
            params = jax.tree.map(lambda a, t: a.astype(t.dtype), params,
                                  abstract_params(config.model, dtype, config.fp8))
        params = placer.tree(params)
        reblock_error = saved.get("fp8_reblock_error")  # what re-blocking cost when it was saved
    else:
        params = load_hf_params(path, config.model, family_of(config.model),
                                abstract_params(config.model, dtype, config.fp8), progress, config.fp8.block,
                                place=placer, experts_needed=placer.experts_needed, reblock=reblock)
        reblock_error = reblock.summary()
    return Model(config, hf_config, params, Tokenizer(path), path, placer, fp8_reblock_error=reblock_error)


def _fit_to_checkpoint(path: str, hf_config):
    """config.json contents fitted to what the checkpoint holds (the family's ``fit_config``: DeepSeek
    loads without an MTP layer the checkpoint lacks altogether), saying so on stderr and as a warning."""
    if not isinstance(hf_config, dict):
        return hf_config  # parse_model_config refuses it
    try:
        family = family_for(hf_config.get("model_type"))
    except ValueError:
        return hf_config  # parse_model_config names the model_type
    try:
        names = list_checkpoint_files(path)
    except ValueError:
        return hf_config  # the loader says what is wrong with the files
    hf_config, message = family.fit_config(hf_config, names)
    if message:
        print(f"moejax: {message}", file=sys.stderr, flush=True)
        warnings.warn(message, UserWarning, stacklevel=3)
    return hf_config


def _logical_params(model: Model):
    """The parameters with routed experts in logical order (one copy each): what ``load`` expects,
    whatever EPLB has moved or replicated since."""
    params, placements = model.params, model.placements
    if model._engine is not None:
        params, placements = model._engine.runner.params, model._engine.balancer.placements
    flat = flatten(params)
    for module, p in placements.items():
        first = put_replicated(p.slots_of_expert()[:, 0].astype(np.int32), model.mesh)
        for path in [k for k in flat if k[:-1] == module]:
            flat[path] = jnp.take(flat[path], first, axis=0)
    return unflatten(flat)


def save(model: Model, directory: str) -> None:
    """Writes converted weights (orbax), config.json and the tokenizer; ``load`` reads it back. Across
    processes every process calls it (each writes its own shards; several hosts need a shared
    directory) and process 0 writes the other files."""
    os.makedirs(directory, exist_ok=True)
    save_params(_logical_params(model), directory)
    if processes.is_leader():
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(model.hf_config, f, indent=2)
        for fn in _TOKENIZER_FILES:
            src = os.path.join(model.tokenizer_dir, fn)
            if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(os.path.join(directory, fn)):
                shutil.copy(src, os.path.join(directory, fn))
        with open(os.path.join(directory, MARKER), "w") as f:
            json.dump({"format_version": FORMAT_VERSION, "dtype": model.dtype,
                       "fp8_layers": sorted(model.config.fp8.kinds),
                       "num_nextn_predict_layers": getattr(model.config.model, "num_nextn_predict_layers", 0),
                       "fp8_reblock_error": model.fp8_reblock_error}, f)
    processes.barrier("moejax.save")  # no process returns (and may load it) before the files are written
