"""A step's host arrays from its sequences, and its samples back to the sequences (the runner's host side).

Every array has a leading rank axis [N, ...]: row i of rank r is the i-th of that rank's sequences
(``StepArrays.by_rank``); rows past a rank's own are padding, and a padding token is written to slot
``num_slots`` (out of range: the step drops the write). The compiled steps that take these arrays are
moejax/engine/model_runner.py's; the shapes (B, T, S, widths) come from moejax/engine/buckets.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from moejax.engine import prompt_logprobs
from moejax.engine.sequence import Sequence
from moejax.parallel.processes import to_host


@dataclasses.dataclass
class StepOutput:
    """What a step sampled for each of its sequences, in their order."""
    tokens: np.ndarray  # [n] token ids
    logprobs: np.ndarray  # [n] logprob of each token under the raw distribution
    top_logprobs: list  # [n]: None, or the sequence's top_logprobs best (token id, logprob), descending


@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Builds the host inputs of a step over a cache of ``num_ranks`` ranks, ``block_size`` slots a block
    and ``num_slots`` slots a rank."""
    num_ranks: int
    block_size: int
    num_slots: int

    def by_rank(self, seqs: list[Sequence]) -> tuple[list[list[Sequence]], int]:
        """``seqs`` split by their DP rank (each rank's in their order), and the most on one rank."""
        ranks = [[] for _ in range(self.num_ranks)]
        for s in seqs:
            ranks[s.dp_rank].append(s)
        return ranks, max(len(r) for r in ranks)

    def slots(self, block_table, pos) -> np.ndarray:
        """Cache slots of the token positions ``pos`` (any shape) of a sequence with ``block_table``
        (a list, or a [n, blocks] array with ``pos`` [n]: one row per sequence)."""
        pos = np.asarray(pos)
        table = np.asarray(block_table, np.int64)
        block = table[pos // self.block_size] if table.ndim == 1 else table[np.arange(len(pos)), pos // self.block_size]
        return block * self.block_size + pos % self.block_size

    def sampling(self, ranks: list[list[Sequence]], B: int):
        """Each row's temperature, top_p, top_k and seed [N, B] (padding rows: greedy, seed 0)."""
        N = self.num_ranks
        temp, top_p = np.zeros((N, B), np.float32), np.ones((N, B), np.float32)
        top_k, seeds = np.zeros((N, B), np.int32), np.zeros((N, B), np.uint32)
        for r, seqs in enumerate(ranks):  # one row of each array per rank, not one scalar per sequence
            k = len(seqs)
            temp[r, :k] = [s.params.temperature for s in seqs]
            top_p[r, :k] = [s.params.top_p for s in seqs]
            top_k[r, :k] = [s.params.top_k for s in seqs]
            seeds[r, :k] = [s.seed & 0xFFFFFFFF for s in seqs]
        return temp, top_p, top_k, seeds

    def packed(self, ranks: list[list[Sequence]], B: int, T: int):
        """Each rank's whole prompts back to back: tokens, positions, slots [N, T] and cu_seqlens
        [N, B + 1] (prompts past the rank's own are empty; tokens past its last prompt are padding)."""
        N = self.num_ranks
        tokens, positions = np.zeros((N, T), np.int32), np.zeros((N, T), np.int32)
        slots = np.full((N, T), self.num_slots, np.int32)
        cu = np.zeros((N, B + 1), np.int32)
        for r, rs in enumerate(ranks):
            off = 0
            for i, s in enumerate(rs):
                n = s.num_new_tokens
                tokens[r, off:off + n] = s.token_ids[:n]
                positions[r, off:off + n] = np.arange(n)
                slots[r, off:off + n] = self.slots(s.block_table, np.arange(n))
                off += n
                cu[r, i + 1] = off
            cu[r, len(rs) + 1:] = off
        return tokens, positions, cu, slots

    def paged(self, ranks: list[list[Sequence]], B: int, S: int, width: int):
        """Chunks after a cached context, padded to [N, B, S]: tokens, positions, chunk and context
        lengths, slots, block tables [N, B, width] (the longest width: the attention walks only the live
        context)."""
        N = self.num_ranks
        tokens = np.zeros((N, B, S), np.int32)
        positions = np.zeros((N, B, S), np.int32)
        lens, ctx = np.zeros((N, B), np.int32), np.zeros((N, B), np.int32)
        slots = np.full((N, B, S), self.num_slots, np.int32)
        tables = np.zeros((N, B, width), np.int32)
        for r, rs in enumerate(ranks):
            for i, s in enumerate(rs):
                a, n = s.num_cached_tokens, s.num_new_tokens
                tokens[r, i, :n] = s.token_ids[a:a + n]
                positions[r, i, :n] = np.arange(a, a + n)
                lens[r, i], ctx[r, i] = n, a + n
                slots[r, i, :n] = self.slots(s.block_table, np.arange(a, a + n))
                tables[r, i, :len(s.block_table)] = s.block_table
        return tokens, positions, lens, ctx, slots, tables

    def decode(self, ranks: list[list[Sequence]], B: int, width: int, prev_index: dict | None):
        """One token for each sequence, [N, B] (tables [N, B, width]): tokens (0 where a token is pending),
        rows (where a pending token sits in the step in flight's output, ``prev_index`` seq_id -> (rank,
        row); -1 elsewhere), positions, slots, block tables, lengths; and this step's seq_id -> (rank, row)."""
        N = self.num_ranks
        # Built with whole-array NumPy from one pass of list comprehensions: a Python loop setting
        # each row's fields cost ~6 ms a step at 1024 sequences (issue 18's host profile).
        flat = [s for rs in ranks for s in rs]
        n = len(flat)
        r_of = np.repeat(np.arange(N), [len(rs) for rs in ranks])
        i_of = np.concatenate([np.arange(len(rs)) for rs in ranks])
        pending = np.array([s.num_pending_tokens for s in flat], np.int32)
        pos = np.array([len(s) for s in flat], np.int32) - 1 + pending
        nbl = np.array([len(s.block_table) for s in flat], np.int64)
        table = np.zeros((n, width), np.int32)
        table[np.repeat(np.arange(n), nbl), np.arange(nbl.sum()) - np.repeat(np.cumsum(nbl) - nbl, nbl)] = \
            np.fromiter(itertools.chain.from_iterable(s.block_table for s in flat), np.int32, int(nbl.sum()))
        tokens, positions, lens = (np.zeros((N, B), np.int32) for _ in range(3))
        rows = np.full((N, B), -1, np.int32)
        slots = np.full((N, B), self.num_slots, np.int32)
        tables = np.zeros((N, B, width), np.int32)
        tokens[r_of, i_of] = [0 if s.num_pending_tokens else s.token_ids[-1] for s in flat]
        if pending.any():
            for s in flat:
                if s.num_pending_tokens and (prev_index is None or s.seq_id not in prev_index
                                             or s.num_pending_tokens > 1):
                    raise RuntimeError(f"sequence {s.seq_id}: its pending token is not in the step in flight")
            rows[r_of, i_of] = [prev_index[s.seq_id][1] if s.num_pending_tokens else -1 for s in flat]
        positions[r_of, i_of], lens[r_of, i_of] = pos, pos + 1
        slots[r_of, i_of] = self.slots(table, pos)
        tables[r_of, i_of] = table
        index = dict(zip([s.seq_id for s in flat], zip(r_of.tolist(), i_of.tolist())))
        return tokens, rows, positions, slots, tables, lens, index


def prompt_logprob_plan(ranks, args, paged: bool) -> prompt_logprobs.Plan:
    """The prompt-logprob inputs of a prefill over ``args`` (packed: rows at cu_seqlens; paged: [B, S] flat)."""
    if paged:
        B, S = args[0].shape[1:]
        return prompt_logprobs.plan(ranks, [[i * S for i in range(len(rs))] for rs in ranks], B * S)
    cu = args[2]
    return prompt_logprobs.plan(ranks, [cu[r, :len(rs)].tolist() for r, rs in enumerate(ranks)],
                                args[0].shape[1])


def gather(where: dict[int, tuple[int, int]], sampled, seqs: list[Sequence]) -> StepOutput:
    """The step's samples of ``seqs`` (at ``where[seq_id]`` = (rank, row)) on the host, in one
    device-to-host copy; the top logprobs are copied only when one of them asks for some
    (N x B x 20 values a step otherwise)."""
    toks, lps, top_lps, top_ids = sampled[:4]
    if any(s.params.top_logprobs for s in seqs):
        toks, lps, top_lps, top_ids = to_host((toks, lps, top_lps, top_ids))
    else:
        toks, lps = to_host((toks, lps))
    at = np.array([where[s.seq_id] for s in seqs], np.int64).reshape(-1, 2)
    out = StepOutput(np.asarray(toks)[at[:, 0], at[:, 1]].astype(np.int64),
                     np.asarray(lps)[at[:, 0], at[:, 1]].astype(np.float64), [None] * len(seqs))
    for j, s in enumerate(seqs):
        n = s.params.top_logprobs
        if n:
            r, i = at[j]
            out.top_logprobs[j] = list(zip(top_ids[r, i, :n].tolist(), top_lps[r, i, :n].tolist()))
    return out
