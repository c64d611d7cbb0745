"""Owns the device state (parameters, expert placement, paged latent cache) and the compiled steps.

Shapes are padded to buckets (moejax/engine/buckets.py: every rule, and why the set is small) so
the compiled programs are reused, and the whole set is compiled before serving (``precompile``):
no request compiles anything. A prefill of whole prompts (nothing cached) packs each rank's
prompts back to back in one token stream with cumulative offsets (``cu_seqlens``; no padding to
the longest prompt); a chunked or prefix-cached prefill pads to (chunks, chunk length). A batch
that fits no bucket runs as several steps. Each step computes the logits of the rows to sample;
a separate small program per (rows, SampleMode) samples them, so sampling variants do not
multiply the whole-model programs. The cache is donated to every step, so XLA updates it in place.

Across several processes (moejax/parallel/processes.py) every process builds the same host arrays
(the same schedule) and passes them to the same jitted step: jit transfers each process's rank
rows to its own devices. Outputs are read through ``to_host``, a collective every process joins.

Every per-step array has a leading rank axis [N, ...]. Without a mesh N = 1 and
the step runs as a plain jit; with one, the same per-rank step runs under
``jax.shard_map`` (each device: its own requests and cache; experts reached
through the MoE dispatch backend's collectives).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from moejax.kernels import decode_tables
from moejax.kernels.common import pow2
from moejax.config import EngineConfig
from moejax.executable_cache import PrecompiledFunction
from moejax.engine.precompile import build as build_precompiled
from moejax.engine import prompt_logprobs
from moejax.engine.kv_handoff import check_role, role_does
from moejax.engine.buckets import Buckets, powers_of_two, token_bucket
from moejax.engine.sequence import Sequence
from moejax.engine.proposer import Proposer
from moejax.engine.sample_controls import ControlState, history_bytes
from moejax.engine.speculative import SpecDecoder
from moejax.engine.step_arrays import StepArrays, StepOutput, gather, prompt_logprob_plan
from moejax.layers.forward_batch import ForwardBatch
from moejax.kernels.kv_quant import cache_array_dtype
from moejax.layers.sampler import SampleMode, read_history, record, sample
from moejax.parallel.processes import agree_min, to_host
from moejax.parallel.sharding import RANK, REPLICATED, param_specs
from moejax.structured_output import peek_pending


def packed_bucket(n: int) -> int:
    """Tokens of a packed prefill stream of n (buckets.token_bucket)."""
    return token_bucket(n)


STEP_RESERVE_BYTES = 2 << 30  # device memory left for the step's activations and compiled programs
HOST_CACHE_BYTES = 2 << 30  # the cache's size where the device reports no memory limit (CPU)


def default_num_blocks(config: EngineConfig) -> int:
    """KV blocks per rank: all of max_num_seqs at max_model_len, capped by device memory: what is left of
    gpu_memory_utilization x the device's memory after what is in use (the weights) and a reserve."""
    cfg, cache, sched = config.model, config.cache, config.scheduler
    row_bytes = (decode_tables.cache_row_dim(cfg, cache.kv_cache_dtype, config.kernels)
                 * cache_array_dtype(cache.kv_cache_dtype, config.dtype, config.kernels).itemsize)
    per_block = config.num_cache_layers * cache.block_size * row_bytes
    per_seq = -(-sched.max_model_len // cache.block_size)
    want = sched.max_num_seqs * per_seq
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        # the sampling controls' History (rows: Buckets.max_decode_batch) is allocated after the cache
        budget = (int(cache.gpu_memory_utilization * stats["bytes_limit"]) - stats.get("bytes_in_use", 0)
                  - STEP_RESERVE_BYTES - history_bytes(pow2(sched.max_num_seqs), cfg.vocab_size))
    else:
        budget = HOST_CACHE_BYTES  # host memory: keep the cache modest
    # Every process must size its cache the same (the engine is the same everywhere): the smallest.
    n = agree_min(min(want, max(budget // per_block, 0)))
    if n < per_seq:
        raise ValueError(f"not enough memory for one sequence of max_model_len={sched.max_model_len}: lower "
                         f"max_model_len, raise gpu_memory_utilization (now {cache.gpu_memory_utilization}) or "
                         "pass num_kv_blocks")
    return int(n)


@dataclasses.dataclass
class DecodeStep:
    """A dispatched decode step: its outputs stay on the device until ``read``."""
    seqs: list[Sequence]
    # sample()'s outputs on the device: tokens [N, B] (row i of rank r: the i-th of that rank's
    # sequences), their logprobs [N, B], the top logprobs and their token ids [N, B, K], and the
    # tokens padded to the largest decode batch [N, max B] (what the next step's feed reads)
    sampled: tuple
    index: dict[int, tuple[int, int]]  # seq_id -> (rank, row)

    @property
    def toks(self) -> jax.Array:
        return self.sampled[4]


def _feed(prev, rows, host):
    """Decode input tokens [N, B]: row i takes prev[r, rows[r, i]] (the token the step before sampled
    for that sequence, never read by the host) where rows >= 0, else the host's token."""
    return jnp.where(rows >= 0, jnp.take_along_axis(prev, jnp.maximum(rows, 0), axis=1), host)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the precompiled set: a jitted function and the arguments (abstract or host zeros of
    the right shapes) it will be called with, or a function that makes them when first needed (a sampler's:
    its logits' shape is its step's output, known once the step is traced); ``sample_rows``: a model step's
    logits rows (the sampler's)."""
    label: str
    fn: object
    make_args: object
    sample_rows: int | None = None

    @functools.cached_property
    def args(self) -> tuple:
        return self.make_args() if callable(self.make_args) else self.make_args

    def out_info(self):
        """The outputs' shapes and dtypes (a trace, which ``lower`` then reuses: jit caches it)."""
        return self.fn.eval_shape(*self.args)

    def lower(self):
        return self.fn.lower(*self.args)


class ModelRunner:
    def __init__(self, config: EngineConfig, module, params, routing, mesh=None):
        """module: the Flax model (kernel-scoped); params/routing on device (sharded over ``mesh``)."""
        cfg = config.model
        self.config = config
        self.module, self.params, self.routing, self.cfg, self.mesh = module, params, routing, cfg, mesh
        self.num_ranks = config.num_ranks
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks or default_num_blocks(config)  # per rank
        self.max_model_len, self.max_num_seqs = config.scheduler.max_model_len, config.scheduler.max_num_seqs
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.num_slots = self.num_blocks * self.block_size
        self.arrays = StepArrays(self.num_ranks, self.block_size, self.num_slots)  # a step's host inputs
        kv_dtype = cache_array_dtype(config.cache.kv_cache_dtype, config.dtype, config.kernels)
        # FP8 rows carry their scale (kernels/kv_quant.py).
        # With speculative decoding the MTP layer has a cache layer of its own (index num_hidden_layers).
        shape = (self.num_ranks, config.num_cache_layers, self.num_slots,
                 decode_tables.cache_row_dim(cfg, config.cache.kv_cache_dtype, config.kernels))
        if mesh is None:
            self.cache = jnp.zeros(shape, kv_dtype)
        else:
            self.cache = jax.jit(lambda: jnp.zeros(shape, kv_dtype), out_shardings=NamedSharding(mesh, RANK))()
        # How many times each step was traced (= compiled): tests assert on it.
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self.last_expert_counts = self.last_dispatched = None
        self.last_prefill_tokens = 0  # tokens per rank the last prefill step computed, padding included
        cache_dtype = cache_array_dtype(config.cache.kv_cache_dtype, config.dtype, config.kernels)
        self.buckets = Buckets(self.max_num_seqs, config.scheduler.max_prefill_tokens, self.max_blocks_per_seq,
                               decode_tables.decode_reads_whole_table(cfg, cache_dtype, config.kernels),
                               self.max_model_len, compile_bound=jax.local_devices()[0].platform == "cpu")
        self._prefill = self.compile_step(self._prefill_rank, "prefill")
        self._prefill_paged = self.compile_step(self._prefill_paged_rank, "prefill_paged")
        self._decode = self.compile_step(self._decode_rank, "decode")
        self._score = self.compile_step(self._score_rank, "score", with_cache=False)
        self._sample = self._compile_sample()
        self.controls = ControlState(self)  # the controls variant's inputs and history rows (sample_controls.py)
        self._sample_history_load = self.controls.load  # a runner attribute: the executable set finds it
        # Decode input tokens live here whether the host or the step in flight (feed) gives them: one
        # sharding, so the decode step is one program for both.
        self._tok_sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                              else NamedSharding(mesh, RANK))

        def feed(prev, rows, host):
            self.trace_counts["feed"] += 1
            return _feed(prev, rows, host)
        self._feed = PrecompiledFunction(jax.jit(feed, out_shardings=self._tok_sharding, **self._one_device()), "feed")
        self.precompiled = False

        def export(cache, rank, slots):
            self.trace_counts["export_rows"] += 1
            return cache[rank][:, slots]  # [L, P, D]

        def import_(cache, rank, slots, rows):
            self.trace_counts["import_rows"] += 1
            # Padding slots are num_slots (out of range): dropped, as a step's padding writes are.
            # (rank, :, slots): the two advanced indices are apart, so the update is laid out [P, L, D].
            return cache.at[rank, :, slots].set(jnp.swapaxes(rows, 0, 1).astype(cache.dtype), mode="drop")

        # Handoff of a prefilled sequence between engines (kv_handoff.py): not donated on export (the
        # cache lives on), donated on import (updated in place, as by a step).
        self._export = PrecompiledFunction(jax.jit(export, **self._one_device()), "export_rows")
        self._import = PrecompiledFunction(
            jax.jit(import_, donate_argnums=(0,), **self._one_device()) if mesh is None else
            jax.jit(import_, donate_argnums=(0,), out_shardings=NamedSharding(mesh, RANK)), "import_rows")
        # The runner's one seam for draft tokens (engine/proposer.py); speculative decoding (engine/speculative.py)
        # registers its programs and prefill bodies (which also write the MTP layer's rows) through it.
        self.proposer: Proposer = SpecDecoder(self, config.num_speculative_tokens) if config.speculative else Proposer()

    # ----- the step API a proposer uses ---------------------------------------
    def bound_model(self, params, routing):
        """The model inside a step body, bound to its parameters and routing: ``model(*args, method=...)``;
        with ``counted=True`` (out, expert counts, dispatched): the MoE statistics the step records."""
        return functools.partial(self._call_model, self._vars(params, routing))

    def _call_model(self, v, *args, method: str, counted: bool = False):
        return self._apply_counted(v, *args, method=method) if counted else self.module.apply(v, *args, method=method)

    def set_prefill_bodies(self, packed, paged) -> None:
        """Per-rank bodies in place of the runner's packed and paged prefill (same inputs, then the proposer's
        ``prefill_inputs``, then the prompt-logprob inputs; same outputs, then its own, handed to
        ``after_prefill``, then ``prompt_logprobs``' outputs)."""
        self._prefill = self.compile_step(packed, "prefill")
        self._prefill_paged = self.compile_step(paged, "prefill_paged")

    def run_step(self, program, *args) -> list:
        """Runs a compiled step (``compile_step``) on the parameters, routing and cache (donated, updated in
        place) and ``args``; its outputs after the cache."""
        self.cache, *outs = program(self.params, self.routing, self.cache, *args)
        return outs

    def _vars(self, params, routing):
        return {"params": params, "routing": routing}

    def _apply_counted(self, v, tokens, batch: ForwardBatch, cache=None, *, method: str):
        """The model's prefill or decode (``method``) over one batch, also returning the MoE statistics sown
        in the step: tokens per logical expert [L_moe, E] and (token, expert) pairs computed here [L_moe]."""
        out, state = self.module.apply(v, tokens, batch, cache, method=method, mutable=["stats"])
        layers = state.get("stats", {})
        names = sorted(layers, key=lambda n: int(n.split("_")[1]))
        if not names:
            return out, jnp.zeros((0, self.cfg.n_routed_experts), jnp.int32), jnp.zeros((0,), jnp.int32)
        ex = [layers[n]["mlp"]["experts"] for n in names]
        # One value per MoE call: two in a layer run as two micro-batches (dual-batch overlap).
        return (out, jnp.stack([sum(e["expert_counts"]) for e in ex]),
                jnp.stack([sum(e["dispatched"]) for e in ex]))

    # ----- per-rank compiled bodies ----------------------------------------
    def _prefill_rank(self, params, routing, cache, tokens, positions, cu_seqlens, slots, prompt_lp):
        """Whole prompts packed in one stream: tokens, positions, slots [T]; cu_seqlens [B + 1]."""
        v = self._vars(params, routing)
        batch = ForwardBatch.prefill(positions, slots=slots, cu_seqlens=cu_seqlens)
        (h, cache), counts, dispatched = self._apply_counted(v, tokens, batch, cache, method="prefill")
        last = h[jnp.maximum(cu_seqlens[1:] - 1, 0)]  # each prompt's last token
        return (cache, self.module.apply(v, last, method="logits"), counts, dispatched,
                self.prompt_logprobs(self.bound_model(params, routing), h, prompt_lp))

    def _prefill_paged_rank(self, params, routing, cache, tokens, positions, seq_lens, ctx_lens, slots, block_tables,
                            prompt_lp):
        B = tokens.shape[0]
        v = self._vars(params, routing)
        batch = ForwardBatch.prefill(positions, seq_lens, slots, block_tables, ctx_lens, self.block_size)
        (h, cache), counts, dispatched = self._apply_counted(v, tokens, batch, cache, method="prefill")
        last = h[jnp.arange(B), jnp.maximum(seq_lens - 1, 0)]
        return (cache, self.module.apply(v, last, method="logits"), counts, dispatched,
                self.prompt_logprobs(self.bound_model(params, routing), h, prompt_lp))

    @staticmethod
    def prompt_logprobs(model, h, inputs):
        """A prefill body's last output: the prompt rows' logprobs its ``inputs`` ask for (engine/prompt_logprobs.py;
        no work when none asks). ``model``: bound_model's; ``h``: the stream's hidden states."""
        return prompt_logprobs.compute(lambda x: model(x, method="logits"), h, inputs)

    def _decode_rank(self, params, routing, cache, tokens, positions, slots, block_tables, seq_lens):
        v = self._vars(params, routing)
        batch = ForwardBatch.decode(positions, slots, block_tables, jnp.maximum(seq_lens, 1), self.block_size)
        (h, cache), counts, dispatched = self._apply_counted(v, tokens, batch, cache, method="decode")
        return cache, self.module.apply(v, h, method="logits"), counts, dispatched

    def _score_rank(self, params, routing, tokens):
        B, S = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        v = self._vars(params, routing)
        batch = ForwardBatch.prefill(positions, jnp.full((B,), S, jnp.int32))
        (h, _), _, _ = self._apply_counted(v, tokens, batch, method="prefill")
        return (self.module.apply(v, h, method="logits"),)

    def compile_step(self, rank_fn, name: str, with_cache: bool = True):
        """jit (and, on a mesh, shard_map) a per-rank body over inputs with a leading rank axis."""
        def per_rank(params, routing, *args):
            self.trace_counts[name] += 1
            outs = rank_fn(params, routing, *jax.tree.map(lambda a: a[0], args))
            return jax.tree.map(lambda a: a[None], outs)

        if self.mesh is not None:
            mesh, specs = self.mesh, param_specs(self.params)

            def fn(params, routing, *args):
                return jax.shard_map(per_rank, mesh=mesh, in_specs=(specs, REPLICATED, *([RANK] * len(args))),
                                     out_specs=RANK, check_vma=False)(params, routing, *args)
        else:
            fn = per_rank
        # The program's own name in its HLO module ("jit_decode", ...): profiles (scripts/profile_step.py,
        # XProf) tell the step's programs apart by it, where all were "jit_per_rank" before.
        fn.__name__ = fn.__qualname__ = re.sub(r"\W", "_", name)
        return PrecompiledFunction(jax.jit(fn, donate_argnums=(2,) if with_cache else (), **self._one_device()), name)

    def _one_device(self) -> dict:
        """On one device every argument is pinned to it: jit would otherwise key its programs on whether
        an input is a committed array or host memory, and a precompiled program would be built again."""
        return {"in_shardings": SingleDeviceSharding(jax.local_devices()[0])} if self.mesh is None else {}

    def _compile_sample(self):
        """The sampler over a step's logits [N, B, V] (each rank its own rows), one compiled variant per
        SampleMode (static ``mode``, the seventh argument: layers/sampler.py says why it is not decided on the
        device); the controls variant's SampleControls and History after it (None in the others), the
        History donated and returned with the sampled tokens counted."""
        pad = self.buckets.max_decode_batch

        def per_rank(logits, temp, top_p, top_k, seeds, positions, controls, history, *, mode):
            self.trace_counts["sample"] += 1
            args = (logits[0], temp[0], top_p[0], top_k[0], seeds[0], positions[0])
            if mode.controls:
                controls, history = (jax.tree.map(lambda a: a[0], t) for t in (controls, history))
                row, recent = read_history(history, controls.rows)
                out = sample(*args, mode=mode, controls=controls, history_row=row, recent=recent)
                history = jax.tree.map(lambda a: a[None], record(history, controls.rows, out[0]))
            else:
                out = sample(*args, mode=mode)
            # The tokens again, padded to the largest decode batch: the next decode step's input gather
            # (feed) then takes one shape whatever the batch it came from.
            # (A speculative verify's rows may outnumber it: that feed is never used.)
            fed = jnp.zeros((pad,), jnp.int32).at[:min(out[0].shape[0], pad)].set(out[0][:pad])
            return jax.tree.map(lambda a: a[None], (*out, fed)), history

        def fn(logits, temp, top_p, top_k, seeds, positions, mode, controls, history):
            body = functools.partial(per_rank, mode=mode)
            if self.mesh is not None:
                body = jax.shard_map(body, mesh=self.mesh, in_specs=RANK, out_specs=RANK, check_vma=False)
            return body(logits, temp, top_p, top_k, seeds, positions, controls, history)
        fn.__name__ = fn.__qualname__ = "sample"
        # ``mode`` is positional (jit takes no keywords with in_shardings).
        return PrecompiledFunction(jax.jit(fn, static_argnums=(6,), donate_argnums=(8,), **self._one_device()),
                                   "sample", (6,))

    # ----- start-up compilation ---------------------------------------------
    def abstract(self, shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
        """A device input as jit will see it: on one device its sharding is left unspecified (as jit treats
        a committed single-device array), on a mesh it is the array's own (default: split over the ranks)."""
        if self.mesh is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or NamedSharding(self.mesh, RANK))

    def rank_arrays(self, *shape) -> np.ndarray:
        """A host int32 input [N, *shape] of a step (zeros): what precompile lowers a program with."""
        return np.zeros((self.num_ranks, *shape), np.int32)

    def step_program(self, label: str, fn, *args, sample_rows: int | None = None) -> Program:
        """A model step of the precompiled set: ``fn`` (from ``compile_step``) on the step's fixed inputs
        (parameters, routing, cache) and ``args``."""
        return Program(label, fn, (self.params, self.routing, self.cache, *args), sample_rows)

    def precompile_programs(self) -> list[Program]:
        """Every program this configuration can run, each with the (abstract) arguments it is called with,
        in compile order: the model steps (buckets.py: the decode, packed-prefill and paged-prefill shapes;
        a proposer's in place of the decode), the sampler per (rows, SampleMode), the decode input gather,
        the proposer's own programs, the cache-row export/import of disaggregation's kv_role per rows bucket. Only
        traced (the outputs' shapes), nothing compiled: ``precompile`` compiles them, and its total is this
        list's length."""
        N, i32 = self.num_ranks, self.rank_arrays
        own_decode = self.proposer.own_decode
        decode = ([self.step_program(f"decode B={B} W={W}", self._decode, self.abstract((N, B), jnp.int32),
                                     i32(B), i32(B), i32(B, W), i32(B), sample_rows=B)
                   for B, W in self.buckets.decode_shapes()] if own_decode else self.proposer.decode_programs())
        extra = self.proposer.prefill_input_shapes
        lp = functools.partial(prompt_logprobs.abstract_inputs, self)  # none asked
        prefill = [self.step_program(f"prefill T={T} B={B}", self._prefill, i32(T), i32(T), i32(B + 1), i32(T),
                                     *extra(T), lp(T), sample_rows=B) for T, B in self.buckets.packed_shapes()]
        paged = [self.step_program(f"prefill_paged B={B} S={S}", self._prefill_paged, i32(B, S), i32(B, S), i32(B),
                                   i32(B), i32(B, S), i32(B, self.buckets.max_width), *extra(B, S),
                                   lp(B * S), sample_rows=B)
                 for B, S in self.buckets.paged_shapes()]
        steps = decode + prefill + paged
        # The sampler takes each step's logits: one program per (rows, mode), rows shared between steps. Its
        # arguments are made when first needed: by then precompile has lowered the step (the logits' shape from
        # that trace, which jit keeps), so no step is traced here, before the first compile can start.
        first = {}
        for p in steps:
            first.setdefault(p.sample_rows, p)

        def sampler_args(step, rows, m):
            info = step.out_info()[1]
            return (self.abstract(info.shape, info.dtype), *self.arrays.sampling([[]] * N, rows), i32(rows), m,
                    *self.controls.abstract(m, rows))
        sample = [Program(f"sample rows={rows} {m}", self._sample, functools.partial(sampler_args, step, rows, m))
                  for rows, step in first.items() for m in self.buckets.sample_modes()]
        prev = self.abstract((N, self.buckets.max_decode_batch), jnp.int32)
        feed = [Program(f"feed B={B}", self._feed, (prev, i32(B), i32(B)))
                for B in sorted({b for b, _ in self.buckets.decode_shapes()})] if own_decode else []
        own = self.proposer.programs_after(decode, prefill)
        return steps + sample + [Program(*p) for p in self.controls.programs()] + feed + own + self._row_programs()

    def _row_programs(self) -> list[Program]:
        """The cache-row export (a prefill side) and import (a decode side) of each rows bucket, as the
        engine's kv_role has them (kv_handoff.check_role refuses the others): none without disaggregation."""
        role, rows = self.config.args.kv_role, []
        for P in powers_of_two(pow2(self.max_model_len, 16), 16):
            slots = np.zeros(P, np.int32)
            if role_does(role, "export"):
                rows.append(Program(f"export_rows P={P}", self._export, (self.cache, np.int32(0), slots)))
            if role_does(role, "import"):
                sds = self.abstract((self.cache.shape[1], P, self.row_dim), self.cache.dtype,
                                    NamedSharding(self.mesh, REPLICATED) if self.mesh is not None else None)
                rows.append(Program(f"import_rows P={P}", self._import, (self.cache, np.int32(0), slots, sds)))
        return rows

    def precompile(self, progress: bool = True, threads: int | None = None) -> dict:
        """Loads or compiles every program of ``precompile_programs``, so no request compiles anything
        (moejax/engine/precompile.py). Returns {"programs", "seconds"} (and "loaded" when the executable
        cache held the whole set); logs one line a program."""
        out = build_precompiled(self, progress, threads)
        self.precompiled = True
        return out

    # ----- host-side batching (step_arrays.py) ------------------------------
    def by_rank(self, seqs: list[Sequence]) -> tuple[list[list[Sequence]], int]:
        return self.arrays.by_rank(seqs)

    def sample_logits(self, logits, ranks: list[list[Sequence]], B: int, positions, rows_per_seq: int = 1):
        """The sampler over a step's logits [N, B x rows_per_seq, V] of ``ranks``' sequences (each row at its
        own position of ``positions``, with its sequence's parameters); sample()'s outputs on the device."""
        arrays = self.arrays.sampling(ranks, B)
        if rows_per_seq > 1:
            arrays = [np.repeat(a, rows_per_seq, axis=1) for a in arrays]
        mode = self.buckets.sample_mode(SampleMode.of(s.params for rs in ranks for s in rs))
        sampled, history = self._sample(logits, *arrays, positions, mode,
                                        *self.controls.inputs(mode, ranks, B, rows_per_seq))
        self.controls.keep(history)
        return sampled

    def slots(self, block_table, pos) -> np.ndarray:
        """Cache slots of the token positions ``pos`` of a sequence with ``block_table`` (StepArrays.slots)."""
        return self.arrays.slots(block_table, pos)

    def prefill(self, seqs: list[Sequence]) -> StepOutput:
        """Runs each sequence's scheduled chunk (``num_new_tokens`` from ``num_cached_tokens``),
        writes its latents to the cache and samples a next token from its last position; the
        token means something only for a sequence whose prompt the chunk completes.

        A batch of whole prompts with nothing cached takes the one-shot program over a packed
        stream (each prompt attends to its own latents); otherwise chunks attend to their context
        read from the paged cache (a prefix-cache hit or earlier chunks): layers/prefill_attention.py."""
        for s in seqs:
            a, n = s.num_cached_tokens, s.num_new_tokens
            if n < 1 or a + n > len(s):
                raise RuntimeError(f"bad prefill chunk [{a}, {a + n}) of a {len(s)}-token sequence")
        paged = any(s.num_cached_tokens for s in seqs)
        if paged:
            groups = self.buckets.split_paged([(s.dp_rank, s.num_new_tokens) for s in seqs])
        else:
            groups = self.buckets.split_packed([s.dp_rank for s in seqs])
        got = {}
        for group in groups:
            part = [seqs[i] for i in group]
            out = self._prefill_group(part, paged)
            for j, s in enumerate(part):
                got[s.seq_id] = (out.tokens[j], out.logprobs[j], out.top_logprobs[j])
        out = StepOutput(np.array([got[s.seq_id][0] for s in seqs], np.int64),
                         np.array([got[s.seq_id][1] for s in seqs], np.float64), [got[s.seq_id][2] for s in seqs])
        for s in seqs:
            s.num_cached_tokens += s.num_new_tokens
            s.num_new_tokens = 0
        return out

    def _prefill_group(self, seqs: list[Sequence], paged: bool) -> StepOutput:
        """One prefill program over ``seqs`` (they fit one bucket: buckets.split_*), then the sampler."""
        ranks, per_rank = self.by_rank(seqs)
        if paged:
            S = self.buckets.paged_len(max(s.num_new_tokens for s in seqs))
            B = self.buckets.paged(per_rank, S)
            args = self.arrays.paged(ranks, B, S, self.buckets.max_width)
            self.last_prefill_tokens = B * S
            positions = args[3]  # each chunk's context length: its sampled token's position
        else:
            T, B = self.buckets.packed(max(sum(s.num_new_tokens for s in rs) for rs in ranks))
            args = self.arrays.packed(ranks, B, T)
            self.last_prefill_tokens = T
            positions = np.diff(args[2], axis=1)  # each prompt's length
        lp_plan = prompt_logprob_plan(ranks, args, paged)
        logits, counts, dispatched, *more, prompt_lp = self.run_step(
            self._prefill_paged if paged else self._prefill, *args, *self.proposer.prefill_inputs(ranks, args, paged),
            lp_plan.inputs)
        self.record_stats(counts, dispatched)
        sampled = self.sample_logits(logits, ranks, B, positions)
        where = {s.seq_id: (r, i) for r, rs in enumerate(ranks) for i, s in enumerate(rs)}
        out = gather(where, sampled, seqs)
        prompt_logprobs.collect(lp_plan, prompt_lp)
        self.proposer.after_prefill(ranks, B, more, sampled[0])
        return out

    def decode(self, seqs: list[Sequence]) -> StepOutput:
        """One token for each sequence; its last token is the one being fed (synchronous: read at once)."""
        return self.read(self.dispatch_decode(seqs))

    def dispatch_decode(self, seqs: list[Sequence], prev: DecodeStep | None = None) -> DecodeStep:
        """Launches one decode step without waiting for it (JAX dispatch is asynchronous). A sequence
        with a token pending from ``prev`` (the step still in flight) is fed that token on the device,
        at the position after it; positions, slots and block tables are the host's, since each step
        grows a sequence by exactly one token."""
        ranks, per_rank = self.by_rank(seqs)
        B = self.buckets.decode_batch(per_rank)
        nb = self.buckets.decode_width(max(len(s.block_table) for s in seqs))
        tokens, rows, positions, slots, tables, lens, index = self.arrays.decode(
            ranks, B, nb, prev.index if prev is not None else None)
        flat = [s for rs in ranks for s in rs]
        if (rows >= 0).any():
            tokens = self._feed(prev.toks, rows, tokens)
        else:  # committed as the fed tokens are: one program for both
            tokens = jax.device_put(tokens, self._tok_sharding)
        logits, counts, dispatched = self.run_step(self._decode, tokens, positions, slots, tables, lens)
        self.record_stats(counts, dispatched)
        peek_pending(flat, prev)  # constrained rows' tokens in flight, for their masks (read while the step runs)
        sampled = self.sample_logits(logits, ranks, B, lens)
        for s in seqs:
            s.num_pending_tokens += 1
        return DecodeStep(list(seqs), sampled, index)

    def read(self, step: DecodeStep) -> StepOutput:
        """Waits for a dispatched decode step and returns its samples in ``step.seqs`` order (the
        step's one device-to-host copy). The fed tokens' latents are now cached."""
        out = gather(step.index, step.sampled, step.seqs)
        for s in step.seqs:
            s.num_pending_tokens -= 1
            if s.block_table:  # not freed since it was dispatched (finished, aborted or preempted)
                s.num_cached_tokens = len(s)  # up to the token this step fed
        return out

    # ----- moving a sequence's cache rows between engines (prefill/decode disaggregation) ----
    @staticmethod
    def rows_bucket(n: int) -> int:
        """Rows moved for n tokens: a power of two (16 at least), so export/import compile once per bucket."""
        return pow2(n, 16)

    @property
    def row_dtype(self):
        return self.cache.dtype

    @property
    def row_dim(self) -> int:
        return self.cache.shape[-1]

    def export_rows(self, slots, rank: int = 0) -> jax.Array:
        """The cache rows of ``slots`` on ``rank``, every layer: [layers, rows_bucket(len(slots)), row_dim]
        in the cache's dtype (FP8 rows with their scale byte); rows past len(slots) are padding. ValueError
        naming kv_role on an engine that does not export (nothing compiled)."""
        check_role(self.config, "export")
        n = len(slots)
        padded = np.zeros(self.rows_bucket(n), np.int32)
        padded[:n] = slots
        return self._export(self.cache, np.int32(rank), padded)

    def import_rows(self, slots, rows: jax.Array, rank: int = 0) -> None:
        """Writes ``rows`` [layers, P >= len(slots), row_dim] (export_rows' layout) into ``slots`` on ``rank``;
        ValueError naming kv_role on an engine that does not import (nothing compiled)."""
        check_role(self.config, "import")
        n = len(slots)
        L, P, D = rows.shape
        if L != self.cache.shape[1] or D != self.row_dim or P < n:
            raise ValueError(f"rows of shape {tuple(rows.shape)} do not fit this cache: {self.cache.shape[1]} "
                             f"layers x >= {n} rows x {self.row_dim} values expected")
        padded = np.full(P, self.num_slots, np.int32)
        padded[:n] = slots
        if self.mesh is not None:  # pulled onto one device: every rank's device sees them
            rows = jax.device_put(rows, NamedSharding(self.mesh, REPLICATED))
        self.cache = self._import(self.cache, np.int32(rank), padded, rows)

    def record_stats(self, counts, dispatched):
        """Keeps the last step's expert statistics, on the device: the balancer reads them in batches,
        so no step waits on a device-to-host copy for them."""
        self.last_expert_counts = counts  # [ranks, L_moe, E]: tokens of each source rank
        self.last_dispatched = dispatched  # [ranks, L_moe], measured in the dispatch

    def set_routing(self, params, routing):
        """Swaps in permuted expert weights and their placement tables (same shapes: no recompilation)."""
        self.params, self.routing = params, routing

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        """Logits [B, T, V]; on a mesh the prompts are split over the ranks (padded to a multiple)."""
        B = token_ids.shape[0]
        per = -(-B // self.num_ranks)
        padded = np.zeros((self.num_ranks * per, token_ids.shape[1]), np.int32)
        padded[:B] = token_ids
        (logits,) = self._score(self.params, self.routing, padded.reshape(self.num_ranks, per, -1))
        return np.asarray(to_host(logits)).reshape(self.num_ranks * per, *logits.shape[2:])[:B]
