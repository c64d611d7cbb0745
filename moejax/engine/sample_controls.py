"""The host side of the sampling controls (layers/sampler.py applies them): a request's controls checked
and laid out once when it is added (``prepare``), each step's ``SampleControls`` arrays for a batch,
and the device rows of token history that penalties and multi-token bad words read.

History on the device, not built per step: a step's history arrays would need a static width, the
longest context (max_model_len tokens a row, every step), and with async scheduling the token a
step samples is still on the device when the next is dispatched. So the runner keeps one row a
sequence of ``History`` (a [S, V] count array, S = the largest decode batch: allocated only when a
request first uses it), the controls variant counts each token it samples in the same program, and
the host only keeps, per row, which sequence holds it and how many output tokens it has counted. A
row that does not match its sequence (new, preempted and recomputed, taken by another, or left by a
dropped step) is rebuilt from the host's tokens (``load_history``, LOAD_CHUNK tokens a call), which
are then complete: the sequence has no token in flight.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from moejax.executable_cache import PrecompiledFunction
from moejax.layers.sampler import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MASK_BITS, RECENT, History,
                                   SampleControls, load_history, mask_words)
from moejax.parallel.sharding import RANK

LOAD_CHUNK = 1024  # tokens of a history row rebuilt in one call (one compiled shape)
HISTORY_DTYPE = jnp.int32


def history_shapes(num_ranks: int, rows: int, vocab_size: int) -> tuple:
    """The History's arrays: counts [N, rows, V] and the recent tokens [N, rows, RECENT]."""
    return (num_ranks, rows, vocab_size), (num_ranks, rows, RECENT)


def history_bytes(rows: int, vocab_size: int) -> int:
    """One rank's History in device bytes (``rows``: the largest decode batch). The KV cache's memory plan
    leaves them free: the History is allocated when a request first uses a control that needs it, after
    the cache has taken what it was given."""
    return sum(int(np.prod(s[1:])) for s in history_shapes(1, rows, vocab_size)) * jnp.dtype(HISTORY_DTYPE).itemsize


@dataclasses.dataclass(frozen=True)
class RequestControls:
    """A request's controls as the sampler takes them, built once (``prepare``)."""
    mask: np.ndarray | None  # int32 [mask_words(V)]: allowed_token_ids (None: every token)
    stop_ids: np.ndarray  # int32: masked while the output is shorter than min_tokens (EOS and stop_token_ids)
    min_tokens: int
    bias_ids: np.ndarray  # int32 [n]
    bias: np.ndarray  # float32 [n]
    bad_words: np.ndarray  # int32 [k, MAX_BAD_WORD_TOKENS], right-aligned, -1 before each
    presence: float
    frequency: float
    repetition: float
    min_p: float
    needs_history: bool  # a history row on the device: penalties, or a bad word of several tokens


def pack_mask(token_ids, vocab_size: int) -> np.ndarray:
    """The vocabulary mask row (layers/sampler.py's layout) allowing exactly ``token_ids``."""
    bits = np.zeros(mask_words(vocab_size) * MASK_BITS, bool)
    bits[np.asarray(token_ids, np.int64)] = True
    return np.packbits(bits.reshape(-1, MASK_BITS), axis=1, bitorder="little").view("<i4")[:, 0].copy()


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenisation of bad_words (SamplingParams.update_from_tokenizer): each word as it is, then with a
    leading space when that gives a different first token and as many tokens (the word in mid-text)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [w for w in out if w]


def prepare(params, tokenizer, vocab_size: int, eos_token_ids, speculative: bool = False) -> RequestControls | None:
    """The request's controls (None: it uses none), its token ids checked against the vocabulary; a
    ValueError naming the field for what the sampler cannot take."""
    if not params.uses_controls:
        return None

    def check_ids(name, ids):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")

    mask = None
    if params.allowed_token_ids is not None:
        check_ids("allowed_token_ids", params.allowed_token_ids)
        mask = pack_mask(params.allowed_token_ids, vocab_size)
    bias = params.logit_bias or {}
    check_ids("logit_bias", list(bias))
    words = bad_words_token_ids(params.bad_words, tokenizer) if params.bad_words else []
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: {len(words)} token sequences (each word tokenised with and without a "
                         f"leading space); at most {MAX_BAD_WORDS} are taken")
    if any(len(w) > MAX_BAD_WORD_TOKENS for w in words):
        raise ValueError(f"bad_words: a word of more than {MAX_BAD_WORD_TOKENS} tokens; each may have at most "
                         f"{MAX_BAD_WORD_TOKENS}")
    for w in words:
        check_ids("bad_words", w)
    bad = np.full((len(words), MAX_BAD_WORD_TOKENS), -1, np.int32)
    for i, w in enumerate(words):
        bad[i, MAX_BAD_WORD_TOKENS - len(w):] = w
    stop = sorted({int(t) for t in eos_token_ids} | set(params.stop_token_ids)) if params.min_tokens else []
    rc = RequestControls(mask, np.asarray([t for t in stop if t < vocab_size], np.int32), params.min_tokens,
                         np.asarray(list(bias), np.int32), np.asarray(list(bias.values()), np.float32), bad,
                         params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p,
                         bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                              or (bad[:, -2] >= 0).any()))
    if speculative and rc.needs_history:
        name = "bad_words" if not (rc.presence or rc.frequency or rc.repetition != 1.0) else (
            "presence_penalty" if rc.presence else "frequency_penalty" if rc.frequency else "repetition_penalty")
        raise ValueError(f"{name}: penalties and bad words of several tokens are not supported with "
                         "speculative decoding (they depend on the draft tokens)")
    return rc


class HistoryRows:
    """Which sequence holds each history row of each rank, and how many of its output tokens the row has
    counted (the host's view of the device's History)."""

    def __init__(self, num_ranks: int, num_rows: int):
        self.holder: list[dict[int, object]] = [{} for _ in range(num_ranks)]  # row -> Sequence
        self.counted: list[dict[int, int]] = [{} for _ in range(num_ranks)]  # row -> output tokens counted
        self.row_of: dict[int, tuple[int, int]] = {}  # seq_id -> (rank, row)
        self.num_rows = num_rows

    def row(self, seq, rank: int, busy: set[int]) -> tuple[int, bool]:
        """``seq``'s row on ``rank`` and whether it must be rebuilt; ``busy``: rows this batch uses."""
        n = seq.num_output_tokens + seq.num_pending_tokens
        got = self.row_of.get(seq.seq_id)
        if got is not None and got[0] == rank and self.holder[rank].get(got[1]) is seq:
            r = got[1]
            if self.counted[rank][r] == n:
                return r, False
        else:
            r = self._free(rank, busy)
            self.holder[rank][r] = seq
            self.row_of[seq.seq_id] = (rank, r)
        if seq.num_pending_tokens:
            raise RuntimeError(f"sequence {seq.seq_id}: its history row must be rebuilt with a token in flight")
        self.counted[rank][r] = n
        return r, True

    def _free(self, rank: int, busy: set[int]) -> int:
        held = self.holder[rank]
        for r in range(self.num_rows):
            if r not in held:
                return r
        # A finished sequence's row first, else one of a sequence outside this batch with no token in
        # flight (it is rebuilt if it comes back).
        for r, s in held.items():
            if r not in busy and s.is_finished:
                return self._release(rank, r)
        for r, s in held.items():
            if r not in busy and not s.num_pending_tokens:
                return self._release(rank, r)
        raise RuntimeError(f"no free history row on rank {rank} ({self.num_rows} rows)")

    def _release(self, rank: int, r: int) -> int:
        s = self.holder[rank].pop(r)
        self.counted[rank].pop(r, None)
        self.row_of.pop(s.seq_id, None)
        return r

    def sampled(self, rank: int, r: int) -> None:
        """The dispatched step counts one more token in row ``r``."""
        self.counted[rank][r] += 1


def step_arrays(ranks, B: int, vocab_size: int, rows: HistoryRows, real, rows_per_seq: int = 1):
    """The batch's SampleControls as host arrays [N, B x rows_per_seq, ...] and the history rows to rebuild
    [(rank, row, seq)]. ``real(seq)``: whether its sample is kept (a prefill chunk that does not end its
    prompt samples nothing); only those rows read and count history. With rows_per_seq R > 1 (a
    speculative verify) row j of a sequence is its output's (n + j)-th token (min_tokens), after its first j
    drafts (a grammar's row: SequenceGrammar.mask_rows); none reads history (``prepare`` refuses what would)."""
    N, R = len(ranks), rows_per_seq
    BR = B * R
    # The wide arrays start as shared read-only neutral ones (a 4 MB mask a step at 256 rows of DeepSeek's
    # vocabulary), copied only when a row of the batch writes one.
    neutral = _neutral(N, BR, vocab_size)
    own: dict[str, np.ndarray] = {}

    def writable(name: str) -> np.ndarray:
        if name not in own:
            own[name] = neutral[name].copy()
        return own[name]
    presence, frequency, min_p = (np.zeros((N, BR), np.float32) for _ in range(3))
    repetition = np.ones((N, BR), np.float32)
    hist = np.full((N, BR), -1, np.int32)
    rebuild = []
    for q, seqs in enumerate(ranks):
        # Whole-array assignments for what every row has (a Python loop setting each row's fields cost
        # ~17 us a row: 4.4 ms a step at 256 rows); loops only over the rows that use each rarer control.
        got = [(i, s, s.controls) for i, s in enumerate(seqs) if s.controls is not None]
        missing = [s for s in seqs if s.controls is None and s.params.uses_controls]
        if missing:
            raise RuntimeError(f"sequence {missing[0].seq_id} uses sampling controls but was not prepared "
                               "(LLMEngine.add_request prepares them)")
        if not got:
            continue
        at = (np.array([i for i, _, _ in got])[:, None] * R + np.arange(R)).ravel()
        for arr, name in ((presence, "presence"), (frequency, "frequency"), (repetition, "repetition"),
                          (min_p, "min_p")):
            arr[q, at] = np.repeat(np.array([getattr(c, name) for _, _, c in got], np.float32), R)
        busy = {rows.row_of[s.seq_id][1] for s in seqs if s.seq_id in rows.row_of
                and rows.row_of[s.seq_id][0] == q}
        for i, s, c in got:
            rs = slice(i * R, (i + 1) * R)
            if c.mask is not None:
                writable("mask")[q, rs] = c.mask
            if s.grammar is not None:  # structured outputs: what the grammar allows next (moejax/structured_output.py)
                writable("mask")[q, rs] &= s.grammar.mask_rows(s.output_ids, R)
            if c.min_tokens:
                n = s.num_output_tokens + s.num_pending_tokens + np.arange(R)
                for j in np.nonzero(n < c.min_tokens)[0]:
                    row = writable("mask")[q, i * R + j]
                    np.bitwise_and.at(row, c.stop_ids // MASK_BITS, ~(1 << (c.stop_ids % MASK_BITS)).astype(np.int32))
            k = len(c.bias_ids)
            if k:
                writable("bias_ids")[q, rs, :k], writable("bias")[q, rs, :k] = c.bias_ids, c.bias
            if len(c.bad_words):
                writable("bad_words")[q, rs, :len(c.bad_words)] = c.bad_words
            if c.needs_history and real(s):
                r, fresh = rows.row(s, q, busy)
                busy.add(r)
                hist[q, i * R] = r
                if fresh:
                    rebuild.append((q, r, s))
                rows.sampled(q, r)
    wide = {**neutral, **own}
    return SampleControls(wide["mask"], wide["bias_ids"], wide["bias"], wide["bad_words"], presence, frequency,
                          repetition, min_p, hist), rebuild


@functools.lru_cache(maxsize=64)
def _neutral(N: int, rows: int, vocab_size: int) -> dict[str, np.ndarray]:
    """The wide SampleControls arrays with every control off (read-only; one set per batch shape)."""
    out = {"mask": np.full((N, rows, mask_words(vocab_size)), -1, np.int32),
           "bias_ids": np.full((N, rows, MAX_LOGIT_BIAS), vocab_size, np.int32),
           "bias": np.zeros((N, rows, MAX_LOGIT_BIAS), np.float32),
           "bad_words": np.full((N, rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)}
    for a in out.values():
        a.flags.writeable = False
    return out


def load_chunks(seq, vocab_size: int):
    """The calls that rebuild ``seq``'s history row: (first, prompt [LOAD_CHUNK], output [LOAD_CHUNK], recent
    [RECENT]) with unused places V."""
    prompt = np.asarray(seq.token_ids[:seq.num_prompt_tokens], np.int32)
    output = np.asarray(seq.output_ids, np.int32)
    recent = np.full(RECENT, -1, np.int32)
    tail = output[-RECENT:] if RECENT else output[:0]
    recent[RECENT - len(tail):] = tail
    n = max(1, -(-max(len(prompt), len(output)) // LOAD_CHUNK))
    for k in range(n):
        p = np.full(LOAD_CHUNK, vocab_size, np.int32)
        o = np.full(LOAD_CHUNK, vocab_size, np.int32)
        part_p, part_o = prompt[k * LOAD_CHUNK:(k + 1) * LOAD_CHUNK], output[k * LOAD_CHUNK:(k + 1) * LOAD_CHUNK]
        p[:len(part_p)], o[:len(part_o)] = part_p, part_o
        yield k == 0, p, o, recent


def _kept(seq) -> bool:
    """Whether the token sampled for ``seq`` now is kept: not for a prefill chunk short of its prompt's end."""
    return not (seq.num_new_tokens and seq.num_cached_tokens + seq.num_new_tokens < len(seq))


class ControlState:
    """The runner's side of the controls variant: each batch's SampleControls, the History on the device
    (allocated at first use) and the program that rebuilds one of its rows (``load``)."""

    def __init__(self, runner):
        self.runner = runner
        self.vocab = runner.cfg.vocab_size
        self.rows = HistoryRows(runner.num_ranks, runner.buckets.max_decode_batch)
        self.history: History | None = None

        def per_rank(history, row, first, prompt, output, recent):
            runner.trace_counts["sample_history_load"] += 1
            h = jax.tree.map(lambda a: a[0], history)
            h = load_history(h, row[0], first[0] > 0, prompt[0], output[0], recent[0])
            return jax.tree.map(lambda a: a[None], h)

        body = per_rank
        if runner.mesh is not None:
            body = jax.shard_map(per_rank, mesh=runner.mesh, in_specs=RANK, out_specs=RANK, check_vma=False)
        self.load = PrecompiledFunction(jax.jit(body, donate_argnums=(0,), **runner._one_device()),
                                        "sample_history_load")

    def _shapes(self):
        return history_shapes(self.runner.num_ranks, self.rows.num_rows, self.vocab)

    def _abstract_history(self) -> History:
        return History(*(self.runner.abstract(s, HISTORY_DTYPE) for s in self._shapes()))

    def abstract(self, mode, rows: int) -> tuple:
        """The controls and History arguments of the sampler in ``mode`` over ``rows`` rows (precompile's)."""
        if not mode.controls:
            return None, None
        controls, _ = step_arrays([[]] * self.runner.num_ranks, rows, self.vocab, self.rows, _kept)
        return controls, self._abstract_history()

    def programs(self) -> list[tuple]:
        """(label, function, arguments) of the history-row rebuild (precompile's)."""
        i32 = self.runner.rank_arrays
        return [("sample history-load", self.load,
                 (self._abstract_history(), i32(), i32(), i32(LOAD_CHUNK), i32(LOAD_CHUNK), i32(RECENT)))]

    def inputs(self, mode, ranks, B: int, rows_per_seq: int = 1) -> tuple:
        """The sampler's controls and History arguments for a batch (None, None unless ``mode.controls``); the
        History, rows rebuilt, is donated to the sampler: ``keep`` takes it back."""
        if not mode.controls:
            return None, None
        controls, rebuild = step_arrays(ranks, B, self.vocab, self.rows, _kept, rows_per_seq)
        if self.history is None:  # zeros sent from the host: jnp.zeros would compile inside a request
            r = self.runner
            where = NamedSharding(r.mesh, RANK) if r.mesh is not None else jax.local_devices()[0]
            self.history = History(*(jax.device_put(np.zeros(s, HISTORY_DTYPE), where) for s in self._shapes()))
        N = self.runner.num_ranks
        for q, r, seq in rebuild:
            for first, prompt, output, recent in load_chunks(seq, self.vocab):
                row = np.full(N, -1, np.int32)
                row[q] = r
                args = (np.full(N, first, np.int32), np.tile(prompt, (N, 1)), np.tile(output, (N, 1)),
                        np.tile(recent, (N, 1)))
                self.history = self.load(self.history, row, *args)
        history, self.history = self.history, None
        return controls, history

    def keep(self, history) -> None:
        """The History the sampler returned (None from a variant without controls: unchanged)."""
        if history is not None:
            self.history = history
