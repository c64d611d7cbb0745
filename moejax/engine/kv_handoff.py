"""Moving a prefilled sequence from one engine to another (prefill/decode disaggregation).

``take_prefilled`` takes a sequence whose prompt is in its engine's cache and whose first token is
sampled out of that engine: its cache rows (positions 0 .. len - 2, every layer; the last token's
latents are written by the decode step that feeds it) are gathered, its blocks freed (its full
blocks stay in the prefix cache for later prompts). ``add_prefilled`` puts it into another engine:
blocks are allocated there (its own block size: rows are per token, so block sizes may differ),
the rows scattered into them, and the sequence joins the decode queue as if that engine had
prefilled it. Its sampling state moves with it (seed, parameters, tokens, logprobs); a sampled
token is a function of (seed, position, logits), so seeded sampling continues exactly as in one
engine.

The decode side is prefix-cache aware: blocks of the prompt's longest cached prefix there are
shared, and only the rows after it are written.

Both engines must store rows alike: the same row width and kind (FP8 rows carry their scale byte,
kernels/kv_quant.py); a bf16 cache held in float32 on CPU takes bf16 rows (the values are bf16).

Speculative decoding (engine/speculative.py): an engine with ``speculative_config`` has one more cache
layer, the MTP layer's (index num_hidden_layers), whose rows of a prompt only its own prefill writes;
``export_rows`` moves every cache layer, so a speculative prefill side's rows include them, and the
first drafts it made after the prefill (host ints) travel as ``PrefilledRequest.drafts``. The rule:

- prefill with speculation -> decode with speculation: the MTP rows and drafts are used (any k: drafts
  are cut to the decode side's k, fewer are verified as fewer; none: the first step verifies no draft);
- prefill with speculation -> decode without: the MTP rows are dropped (the decoder layers' rows and
  the first token are the non-speculative prefill's);
- prefill without speculation -> decode with speculation: refused (ValueError naming
  speculative_config, in ``check_fits``, before any block is taken): the decode side's MTP layer would
  attend to rows nobody wrote.

Outputs are the non-speculative engine's in every allowed case (speculation changes the steps, never
the tokens: engine/speculative.py).

The engine setting ``kv_role`` (moejax/engine_args.py) says which side an engine is: prefill exports,
decode imports, both does both, none (a plain server) neither. Only its side's programs are precompiled
(ModelRunner.precompile_programs), so a handoff the role lacks is refused (``check_role``: ValueError
naming kv_role) instead of compiling inside a request.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from moejax.engine import sample_controls
from moejax.engine.sampling_params import SamplingParams
from moejax.engine.sequence import Sequence, Status
from moejax.structured_output import sequence_grammar


EXPORTING, IMPORTING = ("prefill", "both"), ("decode", "both")  # kv_role values of each side


def role_does(role: str, direction: str) -> bool:
    """Whether kv_role ``role`` "export"s (a prefill side) or "import"s (a decode side) cache rows."""
    return role in (EXPORTING if direction == "export" else IMPORTING)


def check_role(config, direction: str) -> None:
    """ValueError naming kv_role unless the engine of ``config`` does ``direction`` ("export" / "import"):
    its programs were not built for this role, and a request compiles nothing."""
    role = config.args.kv_role
    if not role_does(role, direction):
        side = "prefill" if direction == "export" else "decode"
        raise ValueError(f"this engine's kv_role is {role!r}: it does not {direction} KV cache rows (no {direction} "
                         f"program was built); start it with kv_role {side!r} or 'both' (moejax serve --role {side} "
                         f"or --kv-role)")


@dataclasses.dataclass
class PrefilledRequest:
    """A sequence between two engines: its tokens (prompt + sampled), sampling state and cache rows."""
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    request_id: object
    logprobs: list[float]
    top_logprobs: list
    num_rows: int  # tokens whose latents ``rows`` holds: positions 0 .. num_rows - 1
    rows: jax.Array | None  # [layers, P >= num_rows, row_dim] (ModelRunner.export_rows); None in metadata
    # A speculative prefill side's first drafts (after_prefill), host ints; empty without speculation.
    drafts: list[int] = dataclasses.field(default_factory=list)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def meta(self) -> dict:
        """Everything but the rows, JSON-able (the control channel); the rows' shape and dtype included."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("rows", "params")}
        d["params"] = dataclasses.asdict(self.params)
        d["top_logprobs"] = [None if t is None else [list(p) for p in t] for t in self.top_logprobs]
        if self.rows is not None:
            d["row_shape"], d["row_dtype"] = list(self.rows.shape), str(self.rows.dtype)
        return d

    @classmethod
    def from_meta(cls, d: dict, rows: jax.Array | None = None) -> PrefilledRequest:
        """The inverse of ``meta`` (rows pulled separately); ValueError naming the field on bad input."""
        try:
            params = SamplingParams(**d["params"])
            req = cls([int(t) for t in d["token_ids"]], int(d["num_prompt_tokens"]), params, int(d["seed"]),
                      d.get("request_id"), [float(x) for x in d["logprobs"]],
                      [None if t is None else [(int(i), float(lp)) for i, lp in t] for t in d["top_logprobs"]],
                      int(d["num_rows"]), rows, [int(t) for t in d.get("drafts") or []])
        except KeyError as e:
            raise ValueError(f"prefilled request metadata lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad prefilled request metadata: {e}") from None
        if not 0 < req.num_prompt_tokens < len(req.token_ids) or req.num_rows != len(req.token_ids) - 1:
            raise ValueError(f"num_prompt_tokens {req.num_prompt_tokens} / num_rows {req.num_rows} do not fit "
                             f"{len(req.token_ids)} token_ids")
        return req


def take_prefilled(engine, seq: Sequence) -> PrefilledRequest:
    """Takes ``seq`` (prefilled, its first token sampled, not finished) out of ``engine`` with its rows.
    Engine thread only; the sequence is left finished in this engine (finish_reason "handoff")."""
    prefilled = seq.num_cached_tokens >= len(seq) - 1 and seq.num_output_tokens >= 1
    if seq.is_finished or seq.status != Status.RUNNING or not prefilled:
        raise ValueError(f"sequence {seq.seq_id} is not a prefilled running sequence (status {seq.status.value}, "
                         f"{seq.num_output_tokens} output tokens)")
    if seq.num_pending_tokens:
        raise ValueError(f"sequence {seq.seq_id} has a decode step in flight")
    check_role(engine.config, "export")
    n = len(seq) - 1
    runner = engine.runner
    rows = runner.export_rows(runner.slots(seq.block_table, np.arange(n)), seq.dp_rank)
    rows.block_until_ready()  # read before the freed blocks can be written again by a later step
    req = PrefilledRequest(list(seq.token_ids), seq.num_prompt_tokens, seq.params, seq.seed, seq.request_id,
                           list(seq.logprobs), list(seq.top_logprobs), n, rows, runner.proposer.export_drafts(seq))
    seq.finish_reason = "handoff"
    engine.scheduler.finish(seq)  # blocks freed; its full blocks stay prefix-cache hits
    return req


def can_add(engine, req: PrefilledRequest) -> bool:
    """Whether ``engine`` has a sequence slot and blocks for the request now."""
    return engine.scheduler.can_admit_prefilled(Sequence(req.token_ids, req.params, req.seed))


def check_fits(engine, req: PrefilledRequest) -> None:
    """ValueError unless ``req`` can ever be added to ``engine``: rows of its cache's kind and width, a length
    within max_model_len and the cache."""
    runner = engine.runner
    check_role(engine.config, "import")
    if req.rows is None:
        raise ValueError("the prefilled request has no rows")
    if len(req.token_ids) >= engine.max_model_len:
        raise ValueError(f"the request has {len(req.token_ids)} tokens; max_model_len is {engine.max_model_len}")
    if engine.blocks.blocks_needed(len(req.token_ids) + 1) > engine.blocks.blocks_per_rank:
        raise ValueError(f"the request has {len(req.token_ids)} tokens, more than the KV cache can hold")
    if req.rows.ndim != 3:
        raise ValueError(f"rows of shape {tuple(req.rows.shape)}: [layers, rows, row_dim] expected")
    layers, want = req.rows.shape[0], runner.cache.shape[1]
    decoder = engine.config.model.num_hidden_layers
    with_mtp = getattr(engine.config.model, "num_cache_layers", decoder)  # a speculative prefill side's layers
    if layers < want and layers == decoder:
        raise ValueError(f"this engine decodes with speculative_config {_spec(engine)} and needs the MTP layer's "
                         f"cache rows, which the prefill side did not write ({layers} cache layers, {want} "
                         "expected): run the prefill side with speculative_config too, or this side without it")
    if layers != want and not (want == decoder and layers == with_mtp):
        raise ValueError(f"rows of {layers} cache layers do not fit this engine's cache of {want} layers "
                         "(another model?)")
    if req.rows.shape[1] < req.num_rows:
        raise ValueError(f"{req.rows.shape[1]} rows for {req.num_rows} tokens")
    fp8 = runner.row_dtype == jax.numpy.float8_e4m3fn
    if (req.rows.dtype == jax.numpy.float8_e4m3fn) != fp8 or req.rows.shape[-1] != runner.row_dim:
        raise ValueError(f"rows of dtype {req.rows.dtype} x {req.rows.shape[-1]} do not fit this engine's cache "
                         f"({runner.row_dtype} x {runner.row_dim}): both sides need the same kv_cache_dtype")


def _spec(engine) -> str:
    spec = engine.config.speculative
    return "None" if spec is None else (f'{{"method": "{spec.method}", '
                                        f'"num_speculative_tokens": {spec.num_speculative_tokens}}}')


def add_prefilled(engine, req: PrefilledRequest) -> Sequence:
    """Adds ``req`` to ``engine``'s decode queue, its rows written into newly allocated blocks (after the
    longest prefix cached there). Engine thread only. ValueError if it cannot fit this engine (check_fits);
    RuntimeError("no room") when there are no free blocks or slots now (can_add)."""
    runner = engine.runner
    check_fits(engine, req)
    if not can_add(engine, req):
        raise RuntimeError("no room: no free KV blocks or sequence slots on this engine now")
    seq = Sequence(req.token_ids, req.params, req.seed, req.request_id)
    seq.num_prompt_tokens = req.num_prompt_tokens
    seq.controls = sample_controls.prepare(req.params, engine.tokenizer, runner.cfg.vocab_size, engine.eos_token_ids,
                                           speculative=not engine.proposer.own_decode)  # as add_request's
    seq.grammar = sequence_grammar(req.params, engine.tokenizer, runner.cfg.vocab_size,
                                   engine.eos_token_ids)  # it catches up on the first token
    seq.logprobs, seq.top_logprobs = list(req.logprobs), list(req.top_logprobs)

    def fill(hit: int) -> None:  # blocks for every token (the last one's row comes with its decode step)
        if hit < req.num_rows:
            slots = runner.slots(seq.block_table, np.arange(req.num_rows))
            slots[:hit] = runner.num_slots  # the cached prefix's rows are there already: dropped, not rewritten
            rows = req.rows
            if rows.shape[0] > runner.cache.shape[1]:  # a speculative prefill side's MTP rows: not used here
                rows = rows[:runner.cache.shape[1]]
            runner.import_rows(slots, rows, seq.dp_rank)
        seq.num_cached_tokens = req.num_rows
        # The prefill side's first drafts (the decode step caps them to its k and the sequence's blocks).
        # Without them the first step verifies no draft: the non-speculative step.
        runner.proposer.import_drafts(seq, req.drafts)

    engine.scheduler.admit_prefilled(seq, fill)
    return seq
