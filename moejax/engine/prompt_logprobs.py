"""Prompt logprobs (vLLM's ``prompt_logprobs``; the completions' ``echo`` with ``logprobs``, which lm-eval's
loglikelihood requests use): for each prompt row, the logprob of the next prompt token, its rank and, when
asked, the top 20, from the prefill program's own hidden states.

The prefill program takes four more inputs a rank (``abstract_inputs``): the stream rows that want them,
compacted to the front (rows), each row's next prompt token (targets), how many (count) and whether any
of them asks for the top 20 (top). Its loop runs ceil(count / BLOCK) times over BLOCK rows (the lm_head
of those rows only, a log-softmax, the target's logprob and rank, the top 20 under a cond), so a prefill
that no request asks of runs no iteration and its compiled program count is unchanged. The host side
(``plan``) builds the inputs of a step and ``collect`` appends each sequence's rows (``PromptLogprob``).

A sequence that asks takes no prefix-cache hit (engine/block_manager.py): a cached prefix has no hidden
states to give its logprobs (vLLM's rule too). Rows already collected (a preempted sequence prefilled
again) are not asked twice.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.layers.sampler import MAX_TOP_LOGPROBS
from moejax.parallel.processes import to_host

BLOCK = 128  # rows of one loop iteration: one [BLOCK, vocab] logits block live at a time


class PromptLogprob(NamedTuple):
    """Prompt token t (t >= 1) under the prefix before it."""
    logprob: float
    rank: int  # 1 + the tokens more likely than it (vLLM's)
    top: list  # the params' prompt_logprobs most likely (token id, logprob), descending


def capacity(rows: int) -> int:
    """Rows of the inputs and outputs for a stream of ``rows`` token rows (a multiple of BLOCK)."""
    return -(-rows // BLOCK) * BLOCK


def abstract_inputs(runner, rows: int) -> tuple:
    """The four inputs of a prefill program over ``rows`` stream rows (host zeros [N, ...]: none asked)."""
    c = capacity(rows)
    return runner.rank_arrays(c), runner.rank_arrays(c), runner.rank_arrays(), runner.rank_arrays()


def compute(logits_fn, h, inputs):
    """In the prefill program (one rank): h [..., hidden] the stream's hidden states (before the final
    norm, as ``logits_fn`` takes them); returns logprob [C], rank [C], top logprobs [C, 20], top ids [C, 20]
    of the first ``count`` compacted rows (zeros after)."""
    rows, targets, count, top = inputs
    h = h.reshape(-1, h.shape[-1])
    C, K = rows.shape[0], MAX_TOP_LOGPROBS

    def block(i, out):
        lp, rank, top_lp, top_ids = out
        at = i * BLOCK
        r = jax.lax.dynamic_slice(rows, (at,), (BLOCK,))
        t = jax.lax.dynamic_slice(targets, (at,), (BLOCK,))
        lsm = jax.nn.log_softmax(logits_fn(h[r]).astype(jnp.float32), axis=-1)
        x = jnp.take_along_axis(lsm, t[:, None], axis=1)[:, 0]
        k = jnp.sum(lsm > x[:, None], axis=1, dtype=jnp.int32) + 1
        tl, ti = jax.lax.cond(top > 0, lambda: tuple(jax.lax.top_k(lsm, K)),
                              lambda: (jnp.zeros((BLOCK, K), jnp.float32), jnp.zeros((BLOCK, K), jnp.int32)))
        return (jax.lax.dynamic_update_slice(lp, x, (at,)), jax.lax.dynamic_update_slice(rank, k, (at,)),
                jax.lax.dynamic_update_slice(top_lp, tl, (at, 0)),
                jax.lax.dynamic_update_slice(top_ids, ti.astype(jnp.int32), (at, 0)))

    init = (jnp.zeros((C,), jnp.float32), jnp.zeros((C,), jnp.int32), jnp.zeros((C, K), jnp.float32),
            jnp.zeros((C, K), jnp.int32))
    return jax.lax.fori_loop(0, (count + BLOCK - 1) // BLOCK, block, init)


@dataclasses.dataclass
class Plan:
    """One prefill step's prompt-logprob inputs and where each asking sequence's rows come back."""
    inputs: tuple  # rows [N, C], targets [N, C], count [N], top [N]
    takes: list  # (seq, rank, first compacted row, rows)

    @property
    def wanted(self) -> bool:
        return bool(self.takes)


def plan(ranks, starts, rows: int) -> Plan:
    """``ranks``: each rank's sequences in the step; ``starts[r][i]``: the stream row of sequence i's first
    chunk row (its chunk covers positions [num_cached_tokens, + num_new_tokens)); ``rows``: the stream's rows."""
    N, c = len(ranks), capacity(rows)
    rows_, targets = np.zeros((N, c), np.int32), np.zeros((N, c), np.int32)
    count, top = np.zeros((N,), np.int32), np.zeros((N,), np.int32)
    takes = []
    for r, seqs in enumerate(ranks):
        for i, s in enumerate(seqs):
            k = s.params.prompt_logprobs
            if k is None:
                continue
            a, n = s.num_cached_tokens, s.num_new_tokens
            # row p gives token p + 1's logprob: prompt tokens only, those not collected yet
            lo, hi = max(a, len(s.prompt_logprobs)), min(a + n, s.num_prompt_tokens - 1)
            if hi <= lo:
                continue
            j, m = int(count[r]), hi - lo
            rows_[r, j:j + m] = starts[r][i] + np.arange(lo - a, hi - a)
            targets[r, j:j + m] = s.token_ids[lo + 1:hi + 1]
            count[r] += m
            top[r] |= k > 0
            takes.append((s, r, j, m))
    return Plan((rows_, targets, count, top), takes)


def collect(p: Plan, outputs) -> None:
    """Appends each asking sequence's rows of a step's outputs (one device-to-host copy, the top 20 only
    when asked)."""
    if not p.takes:
        return
    lp, rank, top_lp, top_ids = outputs
    if any(s.params.prompt_logprobs for s, *_ in p.takes):
        lp, rank, top_lp, top_ids = (np.asarray(a) for a in to_host((lp, rank, top_lp, top_ids)))
    else:
        lp, rank = (np.asarray(a) for a in to_host((lp, rank)))
    for s, r, j, m in p.takes:
        k = s.params.prompt_logprobs
        for q in range(j, j + m):
            alts = list(zip(top_ids[r, q, :k].tolist(), top_lp[r, q, :k].tolist())) if k else []
            s.prompt_logprobs.append(PromptLogprob(float(lp[r, q]), int(rank[r, q]), alts))
