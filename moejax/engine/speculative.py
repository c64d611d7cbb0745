"""Speculative decoding with the model's own multi-token-prediction (MTP) layer (issue 32), as vLLM's
``speculative_config={"method": "mtp", "num_speculative_tokens": k}``.

Each decode step of a sequence whose last token t_P sits at position P, with drafts d_1..d_k:

1. verify (one program, the decode program's body over B x (k+1) rows): the target runs the k+1 tokens
   [t_P, d_1, ..., d_k] at positions P..P+k as k+1 decode rows of one sequence, each row's seq_len its own
   position + 1 and all k+1 rows given the sequence's one block table (so the MLA kernel reads the context
   once for all of them: layers/paged_attention.query_rows). A layer writes every row's latent
   before any row attends (MLA.decode), so row j sees rows < j: causal among themselves, over the paged
   latent cache, with the absorbed decode attention (and its kernel), FP8 KV cache, DBO and the mesh as
   a decode step has them. It returns the logits and hidden states of every row.
2. accept (the runner's sampler over those rows, each at its own position's PRNG key): the draft is
   treated as deterministic (q = one-hot at the MTP's greedy token), so rejection sampling accepts d_j
   with probability p_j(d_j) and on rejection samples from p_j with d_j removed, renormalised. It is
   implemented as a coupling with the target's own draw: row j-1 samples x_j exactly as the
   non-speculative decode step would at that position (same seed, same key, same Gumbel-max), d_j is
   accepted iff x_j == d_j, and the first x_j that differs is the correction (after k accepted, x_{k+1}
   is the bonus token). P(accept) = p(d), and given a rejection x_j is distributed as p without d: the
   rejection-sampling rule, with output identical to the non-speculative engine's for the same seed
   (greedy: argmax == draft). A sequence gains n + 1 tokens, n the accepted drafts.
3. draft (one program: the MTP layer): rows P..P+n of the MTP layer's own cache layer (index
   num_hidden_layers) get (target hidden h_{P+j}, token x_{j+1}) as their input (mtp_hidden's pairing),
   and row n's output gives the next step's first draft (argmax of its shared head); drafts 2..k reuse
   the MTP layer autoregressively on its own hidden state (as vLLM and SGLang do).

Nothing a rejected position computed stays visible: rows past P+n are overwritten by later steps
before any row at or past them reads them (seq lens advance by accepted tokens only), the draft
program writes no MTP rows past P+n, prefix-cache blocks are registered only when every position in
them is accepted (num_cached_tokens), and stop strings, EOS and length limits are applied token by
token by the engine, truncating an accepted run. The blocks a step writes ahead (``lookahead``) are
taken by the scheduler only from free ones and are kept for the sequence's next tokens.

After a prefill the MTP layer's rows of the chunk are written in the same program (tokens shifted by
one; the last prompt row needs the sampled token), then ``after_prefill`` writes that row and drafts the
first k tokens. Drafts go through the host (k ints a sequence), so batches may be reordered freely and
tests can inject drafts (``draft_override``). Decode steps with speculation run synchronously (async
scheduling's overlap does not apply to them).
"""

from __future__ import annotations

import dataclasses
import weakref

import jax.numpy as jnp
import numpy as np

from moejax.engine.proposer import Proposer
from moejax.engine.sequence import Sequence
from moejax.layers.forward_batch import ForwardBatch
from moejax.parallel.processes import to_host


@dataclasses.dataclass
class SpecStepOutput:
    """Per sequence (in the step's order): its accepted drafts then the correction or bonus token."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list]  # per token: None, or the (token id, logprob) best, descending
    num_drafts: int = 0  # sequences that had drafts verified
    num_draft_tokens: int = 0
    accepted_per_pos: np.ndarray | None = None  # [k]: drafts accepted at each position


class SpecDecoder(Proposer):
    """The MTP proposer (engine/proposer.py): its programs and prefill bodies registered through the runner's
    step API; every decode step a verify (``decode``, run by the engine)."""
    own_decode = False

    def __init__(self, runner, k: int):
        self.runner, self.k, self.R = runner, k, k + 1
        self.drafts: weakref.WeakKeyDictionary[Sequence, np.ndarray] = weakref.WeakKeyDictionary()
        self.draft_override = None  # tests: fn(seq) -> k draft tokens, in place of the MTP's
        self._verify = runner.compile_step(self._verify_rank, "spec_verify")
        self._draft = runner.compile_step(self._draft_rank, "spec_draft")
        self._draft_first = runner.compile_step(self._draft_first_rank, "spec_draft_first")
        runner.set_prefill_bodies(self.packed_prefill_rank, self.paged_prefill_rank)

    # ----- per-rank compiled bodies ------------------------------------------
    def packed_prefill_rank(self, params, routing, cache, tokens, positions, cu_seqlens, slots, next_tokens,
                            mtp_slots, prompt_lp):
        """The runner's packed prefill, then the MTP layer's rows of the stream (next_tokens: each row's
        following token; mtp_slots drop a prompt's last row, whose following token is not sampled yet)."""
        r = self.runner
        model = r.bound_model(params, routing)
        batch = ForwardBatch.prefill(positions, slots=slots, cu_seqlens=cu_seqlens)
        (h, cache), counts, dispatched = model(tokens, batch, cache, method="prefill", counted=True)
        _, cache = model(next_tokens, h, batch.replace(slots=mtp_slots), cache, method="mtp_hidden")
        last = h[jnp.maximum(cu_seqlens[1:] - 1, 0)]
        return cache, model(last, method="logits"), counts, dispatched, last, r.prompt_logprobs(model, h, prompt_lp)

    def paged_prefill_rank(self, params, routing, cache, tokens, positions, seq_lens, ctx_lens, slots,
                           block_tables, next_tokens, mtp_slots, prompt_lp):
        r = self.runner
        model = r.bound_model(params, routing)
        batch = ForwardBatch.prefill(positions, seq_lens, slots, block_tables, ctx_lens, r.block_size)
        (h, cache), counts, dispatched = model(tokens, batch, cache, method="prefill", counted=True)
        _, cache = model(next_tokens, h, batch.replace(slots=mtp_slots), cache, method="mtp_hidden")
        last = h[jnp.arange(tokens.shape[0]), jnp.maximum(seq_lens - 1, 0)]
        return cache, model(last, method="logits"), counts, dispatched, last, r.prompt_logprobs(model, h, prompt_lp)

    def _verify_rank(self, params, routing, cache, tokens, positions, slots, block_tables, seq_lens):
        """The decode body over B x (k+1) rows, also returning the hidden states the MTP layer takes."""
        r = self.runner
        model = r.bound_model(params, routing)
        batch = ForwardBatch.decode(positions, slots, block_tables, jnp.maximum(seq_lens, 1), r.block_size)
        (h, cache), counts, dispatched = model(tokens, batch, cache, method="decode", counted=True)
        return cache, model(h, method="logits"), counts, dispatched, h

    def _slot(self, tables, pos, capacity):
        """Cache slots of positions pos [B, ...] through tables [B, W]; past the sequence's blocks: dropped."""
        bs, W = self.runner.block_size, tables.shape[1]
        flat = pos.reshape(pos.shape[0], -1)
        blk = jnp.take_along_axis(tables, jnp.clip(flat // bs, 0, W - 1), axis=1)
        slot = jnp.where(flat < capacity[:, None], blk * bs + flat % bs, self.runner.num_slots)
        return slot.reshape(pos.shape)

    def _chain(self, model, cache, m, pos, tables, capacity):
        """Drafts 1..k from the MTP hidden state m [B, H] of position pos [B] (what predicts pos + 2):
        the first from its head, the rest by running the MTP layer on its own output and draft."""
        r = self.runner
        d = jnp.argmax(model(m, method="mtp_logits"), axis=-1).astype(jnp.int32)
        out = [d]
        for i in range(1, self.k):
            p = pos + i
            lens = jnp.maximum(jnp.minimum(p + 1, capacity), 1)
            batch = ForwardBatch.decode(p, self._slot(tables, p, capacity), tables, lens, r.block_size)
            m, cache = model(d, m, batch, cache, method="mtp_decode")
            d = jnp.argmax(model(m, method="mtp_logits"), axis=-1).astype(jnp.int32)
            out.append(d)
        return jnp.stack(out, axis=1), cache

    def _draft_rank(self, params, routing, cache, h, sampled, vtokens, valid, positions, tables, capacity):
        """h [B*R, H] and sampled [B*R] (the verify's hidden states and the sampler's tokens), vtokens [B, R]
        (what was verified: t_P then the drafts), valid [B] (drafts that count), positions [B, R] = P + j,
        tables [B, W], capacity [B] (positions the blocks hold). Returns (cache, next drafts [B, k],
        accepted [B])."""
        r = self.runner
        model = r.bound_model(params, routing)
        B, R = vtokens.shape
        x = sampled.reshape(B, R)
        match = (x[:, :-1] == vtokens[:, 1:]) & (jnp.arange(R - 1)[None, :] < valid[:, None])
        n = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
        keep = jnp.arange(R)[None, :] <= n[:, None]  # rows P..P+n: accepted positions only
        slots = jnp.where(keep, self._slot(tables, positions, capacity), r.num_slots)
        lens = jnp.minimum(positions, positions[:, :1] + n[:, None]) + 1
        batch = ForwardBatch.decode(positions.reshape(-1), slots.reshape(-1), jnp.repeat(tables, R, axis=0),
                                    lens.reshape(-1), r.block_size)
        m, cache = model(x.reshape(-1), h, batch, cache, method="mtp_decode")
        m_n = m.reshape(B, R, -1)[jnp.arange(B), n]
        drafts, cache = self._chain(model, cache, m_n, positions[:, 0] + n + 1, tables, capacity)
        return cache, drafts, n

    def _draft_first_rank(self, params, routing, cache, last_h, sampled, positions, tables, capacity):
        """After a prefill: the MTP row of each prompt's last position (its hidden state last_h [B, H], the
        sampled token [B]) and the first drafts. Rows of capacity 0 (chunks that end no prompt) write nothing."""
        r = self.runner
        model = r.bound_model(params, routing)
        batch = ForwardBatch.decode(positions, self._slot(tables, positions, capacity), tables, positions + 1,
                                    r.block_size)
        m, cache = model(sampled, last_h, batch, cache, method="mtp_decode")
        drafts, cache = self._chain(model, cache, m, positions + 1, tables, capacity)
        return cache, drafts

    # ----- prefill --------------------------------------------------------------
    def mtp_rows(self, seq: Sequence, a: int, n: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A prefill chunk [a, a+n)'s MTP inputs: each row's following token and its MTP slot (the row of a
        sequence's last token is written by after_prefill, once its following token is sampled)."""
        nxt = np.zeros(n, np.int32)
        m = min(n, len(seq) - a - 1)
        nxt[:m] = seq.token_ids[a + 1:a + 1 + m]
        mslots = np.array(slots[:n], np.int32)
        if a + n >= len(seq):
            mslots[n - 1] = self.runner.num_slots
        return nxt, mslots

    def prefill_inputs(self, ranks, arrays, paged: bool) -> tuple:
        """The prefill's MTP inputs beside the runner's arrays: each row's following token and MTP slot."""
        return self._paged_inputs(ranks, arrays) if paged else self._packed_inputs(ranks, arrays)

    def _packed_inputs(self, ranks, arrays):
        """The packed prefill's MTP inputs [N, T] beside the runner's (tokens, positions, cu_seqlens, slots)."""
        tokens, _, cu, slots = arrays
        nxt, mslots = np.zeros_like(tokens), np.full_like(slots, self.runner.num_slots)
        for r, rs in enumerate(ranks):
            for i, s in enumerate(rs):
                o, n = cu[r, i], s.num_new_tokens
                nxt[r, o:o + n], mslots[r, o:o + n] = self.mtp_rows(s, 0, n, slots[r, o:o + n])
        return nxt, mslots

    def _paged_inputs(self, ranks, arrays):
        """The paged prefill's MTP inputs [N, B, S] beside the runner's arrays."""
        tokens, _, _, _, slots, _ = arrays
        nxt, mslots = np.zeros_like(tokens), np.full_like(slots, self.runner.num_slots)
        for r, rs in enumerate(ranks):
            for i, s in enumerate(rs):
                n = s.num_new_tokens
                nxt[r, i, :n], mslots[r, i, :n] = self.mtp_rows(s, s.num_cached_tokens, n, slots[r, i, :n])
        return nxt, mslots

    def after_prefill(self, ranks, B: int, outputs, sampled) -> None:
        """Drafts for the sequences whose prompt (all their tokens) this prefill completed (called before the
        runner advances num_cached_tokens); outputs: the prefill body's own, each prompt's last hidden state."""
        (last_h,) = outputs
        r = self.runner
        N, W = r.num_ranks, r.buckets.max_width
        pos, cap = np.zeros((N, B), np.int32), np.zeros((N, B), np.int32)
        tables = np.zeros((N, B, W), np.int32)
        done = []
        for k, rs in enumerate(ranks):
            for i, s in enumerate(rs):
                if s.num_cached_tokens + s.num_new_tokens >= len(s):
                    pos[k, i], cap[k, i] = len(s) - 1, len(s.block_table) * r.block_size
                    tables[k, i, :len(s.block_table)] = s.block_table
                    done.append((s, k, i))
        if not done:
            return
        (drafts,) = r.run_step(self._draft_first, last_h, sampled, pos, tables, cap)
        drafts = np.asarray(to_host(drafts))
        for s, k, i in done:
            self.drafts[s] = drafts[k, i]

    # ----- decode ---------------------------------------------------------------
    def export_drafts(self, seq: Sequence) -> list[int]:
        return [int(t) for t in self.drafts.get(seq, ())]

    def import_drafts(self, seq: Sequence, drafts: list[int]) -> None:
        """Another engine's first drafts for ``seq``: the first k, kept only if every one is a token id."""
        d = np.asarray(drafts[:self.k], np.int32)
        if len(d) and ((d >= 0) & (d < self.runner.cfg.vocab_size)).all():
            self.drafts[seq] = d

    def _drafts_of(self, seq: Sequence) -> np.ndarray:
        if self.draft_override is not None:
            return np.asarray(self.draft_override(seq), np.int32)[:self.k]
        return self.drafts.get(seq, np.zeros(0, np.int32))

    def decode(self, seqs: list[Sequence]) -> SpecStepOutput:
        """One speculative step of every sequence: verify its drafts, accept, draft the next ones."""
        r = self.runner
        ranks, per_rank = r.by_rank(seqs)
        N, B, R, k, bs = r.num_ranks, r.buckets.decode_batch(per_rank), self.R, self.k, r.block_size
        W = r.buckets.decode_width(max(len(s.block_table) for s in seqs))
        tokens, positions = np.zeros((N, B, R), np.int32), np.zeros((N, B, R), np.int32)
        lens, sample_pos = np.ones((N, B, R), np.int32), np.zeros((N, B, R), np.int32)
        slots = np.full((N, B, R), r.num_slots, np.int32)
        tables = np.zeros((N, B, W), np.int32)
        valid, cap = np.zeros((N, B), np.int32), np.zeros((N, B), np.int32)
        j = np.arange(R)
        for q, rs in enumerate(ranks):
            for i, s in enumerate(rs):
                if s.num_pending_tokens:
                    raise RuntimeError("speculative decoding steps run synchronously (no token in flight)")
                P, c = len(s) - 1, len(s.block_table) * bs
                d = self._drafts_of(s)
                # Drafts must fit the blocks the scheduler reserved and leave the sequence within max_model_len.
                nv = max(0, min(len(d), k, c - len(s), r.max_model_len - len(s) - 1))
                tokens[q, i, 0], tokens[q, i, 1:1 + nv] = s.token_ids[-1], d[:nv]
                positions[q, i], sample_pos[q, i] = P + j, P + j + 1
                lens[q, i] = P + np.minimum(j, nv) + 1
                slots[q, i, :nv + 1] = r.slots(s.block_table, P + j[:nv + 1])
                tables[q, i, :len(s.block_table)] = s.block_table
                valid[q, i], cap[q, i] = nv, c
        rows = lambda a: a.reshape(N, B * R)  # noqa: E731
        logits, counts, dispatched, h = r.run_step(self._verify, rows(tokens), rows(positions), rows(slots), tables,
                                                   rows(lens))
        r.record_stats(counts, dispatched)
        sampled = r.sample_logits(logits, ranks, B, rows(sample_pos), rows_per_seq=R)
        drafts, accepted = r.run_step(self._draft, h, sampled[0], tokens, valid, positions, tables, cap)
        want_top = any(s.params.top_logprobs for s in seqs)
        host = to_host((sampled[0], sampled[1], drafts, accepted) + ((sampled[2], sampled[3]) if want_top else ()))
        toks, lps, drafts, accepted = (np.asarray(a) for a in host[:4])
        out = SpecStepOutput([], [], [], accepted_per_pos=np.zeros(k, np.int64))
        for q, rs in enumerate(ranks):
            for i, s in enumerate(rs):
                n, at = int(accepted[q, i]), i * R
                out.tokens.append(toks[q, at:at + n + 1].astype(np.int64).tolist())
                out.logprobs.append(lps[q, at:at + n + 1].astype(np.float64).tolist())
                t = s.params.top_logprobs
                out.top_logprobs.append([list(zip(host[5][q, at + x, :t].tolist(), host[4][q, at + x, :t].tolist()))
                                         if t else None for x in range(n + 1)])
                s.num_cached_tokens = len(s) + n  # t_P and the accepted drafts: their latents are cached
                self.drafts[s] = drafts[q, i]
                out.num_drafts += int(valid[q, i] > 0)
                out.num_draft_tokens += int(valid[q, i])
                out.accepted_per_pos[:n] += 1
        # Sequences in rank order: back to the caller's order.
        order = {s.seq_id: x for x, s in enumerate(s for rs in ranks for s in rs)}
        perm = [order[s.seq_id] for s in seqs]
        out.tokens, out.logprobs, out.top_logprobs = ([lst[x] for x in perm] for lst in
                                                      (out.tokens, out.logprobs, out.top_logprobs))
        return out

    # ----- start-up compilation ---------------------------------------------------
    def decode_programs(self) -> list:
        """The verify program at every decode bucket (rows B x (k+1)): every decode step is a verify, so the
        runner's decode program never runs."""
        r, R, i32 = self.runner, self.R, self.runner.rank_arrays
        return [r.step_program(f"spec_verify B={B} W={W}", self._verify, i32(B * R), i32(B * R), i32(B * R),
                               i32(B, W), i32(B * R), sample_rows=B * R) for B, W in r.buckets.decode_shapes()]

    def prefill_input_shapes(self, *shape) -> tuple:
        """The MTP layer's inputs a prefill program takes beside the runner's (following tokens, slots)."""
        return (self.runner.rank_arrays(*shape),) * 2

    def programs_after(self, decode: list, prefill: list) -> list:
        """The draft programs: after each decode bucket's verify, and after each prefill batch (B rows of the
        packed and paged prefill shapes); they take the verify's and the prefill's hidden states (their last
        output: ``decode`` and ``prefill`` are those programs)."""
        r, R, i32 = self.runner, self.R, self.runner.rank_arrays
        N, H = r.num_ranks, r.cfg.hidden_size
        h_dtype, last_dtype = decode[0].out_info()[4].dtype, prefill[0].out_info()[4].dtype
        out = []
        for B, W in r.buckets.decode_shapes():
            out.append(r.step_program(f"spec_draft B={B} W={W}", self._draft, r.abstract((N, B * R, H), h_dtype),
                                      r.abstract((N, B * R), jnp.int32), i32(B, R), i32(B), i32(B, R), i32(B, W),
                                      i32(B)))
        for B in sorted({b for _, b in r.buckets.packed_shapes()} | {b for b, _ in r.buckets.paged_shapes()}):
            out.append(r.step_program(f"spec_draft_first B={B}", self._draft_first, r.abstract((N, B, H), last_dtype),
                                      r.abstract((N, B), jnp.int32), i32(B), i32(B, r.buckets.max_width), i32(B)))
        return out
