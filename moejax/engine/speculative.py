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
   (greedy: argmax == draft). A sequence gains n + 1 tokens, n the accepted drafts. A structured output's
   row j samples under its grammar's mask after d_1..d_j (the host advances the matcher over the drafts:
   moejax/structured_output.py), so a draft the grammar rejects is never accepted.
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
first k tokens.

With async scheduling the engine dispatches step N+1 before it reads step N (``dispatch`` / ``read``, as
the runner's plain decode): a sequence still in flight is fed on the device (``_step_inputs``, inside the
verify program) from N's draft program's feed (its last accepted token and drafts, its accepted count),
and counts R = k + 1 tokens pending (the most N gains) until read, so the scheduler reserves blocks for
both steps. The others (after a prefill, a preemption, a step held back) are fed from the host's tokens
and drafts (``drafts``: k ints a sequence, kept when read), so batches may be reordered freely and tests
can inject drafts (``draft_override``, which ``overlaps`` then refuses).
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
from moejax.structured_output import peek_drafts


@dataclasses.dataclass
class SpecStepOutput:
    """Per sequence (in the step's order): its accepted drafts then the correction or bonus token."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list]  # per token: None, or the (token id, logprob) best, descending
    num_drafts: int = 0  # sequences that had drafts verified
    num_draft_tokens: int = 0
    accepted_per_pos: np.ndarray | None = None  # [k]: drafts accepted at each position


@dataclasses.dataclass
class SpecStep:
    """A dispatched speculative step: its outputs stay on the device until ``SpecDecoder.read``."""
    seqs: list[Sequence]
    ranks: list[list[Sequence]]
    sampled: tuple  # the sampler's outputs over the verify's rows [N, B x R] (engine/model_runner.py)
    drafts: object  # [N, B, k]: each sequence's next drafts
    accepted: object  # [N, B]: drafts accepted
    valid: object  # [N, B]: drafts verified
    feed: tuple  # (next tokens [N, Bmax, R], accepted [N, Bmax]): what the next step's verify reads
    index: dict[int, tuple[int, int]]  # seq_id -> (rank, row)


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

    def _verify_rank(self, params, routing, cache, prev_tokens, prev_n, rows, host_tokens, base, host_nd,
                     block_tables, capacity):
        """The step's inputs built here (``_step_inputs``), then the decode body over B x (k+1) rows; also returns
        the hidden states the MTP layer takes and the inputs the sampler and the draft program take."""
        r = self.runner
        tokens, positions, slots, lens, valid = self._step_inputs(prev_tokens, prev_n, rows, host_tokens, base,
                                                                  host_nd, block_tables, capacity)
        model = r.bound_model(params, routing)
        flat = lambda a: a.reshape(-1)  # noqa: E731
        batch = ForwardBatch.decode(flat(positions), flat(slots), jnp.repeat(block_tables, self.R, axis=0),
                                    flat(lens), r.block_size)
        (h, cache), counts, dispatched = model(flat(tokens), batch, cache, method="decode", counted=True)
        return cache, model(h, method="logits"), counts, dispatched, h, flat(positions) + 1, tokens, positions, valid

    def _step_inputs(self, prev_tokens, prev_n, rows, host_tokens, base, host_nd, tables, capacity):
        """A verify's rows [B, R] from the step before's device outputs where it is still in flight (no host
        round trip): rows [B] >= 0 index prev_tokens [Bmax, R] (its last accepted token, then its next drafts)
        and prev_n [Bmax] (its accepted drafts), the sequence's last token then at host position base + n + 1;
        rows < 0 take the host's host_tokens [B, R] at base [B] (len - 1), host_nd [B] of its drafts usable.
        Drafts are cut to the blocks held (capacity [B]) and to leave the sequence within max_model_len."""
        r, R, k = self.runner, self.R, self.k
        pend = rows >= 0
        at = jnp.maximum(rows, 0)
        P = base + jnp.where(pend, prev_n[at] + 1, 0)
        tok = jnp.where(pend[:, None], prev_tokens[at], host_tokens)
        n_len = P + 1
        nv = jnp.clip(jnp.minimum(jnp.where(pend, k, host_nd), jnp.minimum(capacity - n_len,
                                                                             r.max_model_len - n_len - 1)), 0, k)
        j = jnp.arange(R)[None, :]
        live = j <= nv[:, None]  # t_P and the drafts verified
        positions = P[:, None] + j
        lens = P[:, None] + jnp.minimum(j, nv[:, None]) + 1
        slots = jnp.where(live, self._slot(tables, positions, capacity), r.num_slots)
        return jnp.where(live, tok, 0), positions, slots, lens, nv

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
        accepted [B], and both again as the next step's feed [Bmax, R] and [Bmax])."""
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
        # The next step's feed (``_step_inputs``): last accepted token and drafts, accepted count, padded to the
        # largest decode batch so that one verify program per bucket reads it whatever batch it came from.
        pad = r.buckets.max_decode_batch
        nxt = jnp.concatenate([x[jnp.arange(B), n][:, None], drafts], axis=1)
        return (cache, drafts, n, jnp.zeros((pad, R), jnp.int32).at[:B].set(nxt),
                jnp.zeros((pad,), jnp.int32).at[:B].set(n))

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

    def overlaps(self, seq: Sequence) -> bool:
        """Whether a step of ``seq`` may be dispatched while its previous one is in flight (its inputs then built
        on the device): not while its min_tokens masks the stop tokens, a count the sampler's controls take
        from the host's tokens."""
        return seq.params.min_tokens <= seq.num_output_tokens and self.draft_override is None

    def dispatch(self, seqs: list[Sequence], prev: "SpecStep | None" = None) -> "SpecStep":
        """Launches one speculative step of every sequence without waiting for it: verify its drafts, accept,
        draft the next ones. A sequence whose step before is still in flight (``prev``) is fed from that step's
        device outputs (``_step_inputs``); the others from the host's tokens and drafts."""
        r = self.runner
        ranks, per_rank = r.by_rank(seqs)
        N, B, R, k, bs = r.num_ranks, r.buckets.decode_batch(per_rank), self.R, self.k, r.block_size
        W = r.buckets.decode_width(max(len(s.block_table) for s in seqs))
        host_tokens, rows = np.zeros((N, B, R), np.int32), np.full((N, B), -1, np.int32)
        base, nd, cap = (np.zeros((N, B), np.int32) for _ in range(3))
        tables = np.zeros((N, B, W), np.int32)
        for q, rs in enumerate(ranks):
            for i, s in enumerate(rs):
                if s.num_pending_tokens:
                    if prev is None or s.seq_id not in prev.index or s.num_pending_tokens > R or not self.overlaps(s):
                        raise RuntimeError(f"sequence {s.seq_id}: its pending tokens are not in the step in flight")
                    rows[q, i] = prev.index[s.seq_id][1]
                else:
                    d = self._drafts_of(s)[:k]
                    host_tokens[q, i, 0], host_tokens[q, i, 1:1 + len(d)], nd[q, i] = s.token_ids[-1], d, len(d)
                base[q, i], cap[q, i] = len(s) - 1, len(s.block_table) * bs
                tables[q, i, :len(s.block_table)] = s.block_table
        if prev is not None and (rows >= 0).any():
            feed = prev.feed
        else:  # nothing in flight: the same program on zeros
            feed = r.rank_arrays(r.buckets.max_decode_batch, R), r.rank_arrays(r.buckets.max_decode_batch)
        logits, counts, dispatched, h, sample_pos, vtokens, positions, valid = r.run_step(
            self._verify, *feed, rows, host_tokens, base, nd, tables, cap)
        r.record_stats(counts, dispatched)
        # Constrained rows' masks follow their drafts: those read to the host first (structured_output.py)
        peek_drafts(seqs, prev, lambda s: self._drafts_of(s)[:k])
        sampled = r.sample_logits(logits, ranks, B, sample_pos, rows_per_seq=R)
        drafts, accepted, *nxt = r.run_step(self._draft, h, sampled[0], vtokens, valid, positions, tables, cap)
        for s in seqs:
            s.num_pending_tokens += R  # at most: the step gains 1 to R tokens, known when read
        index = {s.seq_id: (q, i) for q, rs in enumerate(ranks) for i, s in enumerate(rs)}
        return SpecStep(list(seqs), ranks, sampled, drafts, accepted, valid, tuple(nxt), index)

    def read(self, step: "SpecStep") -> SpecStepOutput:
        """Waits for a dispatched step and returns each sequence's accepted drafts and one more token, in
        ``step.seqs`` order (one device-to-host copy); their latents are now cached."""
        k, R = self.k, self.R
        want_top = any(s.params.top_logprobs for s in step.seqs)
        sampled = step.sampled
        host = to_host((sampled[0], sampled[1], step.drafts, step.accepted, step.valid)
                       + ((sampled[2], sampled[3]) if want_top else ()))
        toks, lps, drafts, accepted, valid = (np.asarray(a) for a in host[:5])
        out = SpecStepOutput([], [], [], accepted_per_pos=np.zeros(k, np.int64))
        for s in step.seqs:
            q, i = step.index[s.seq_id]
            n, at = int(accepted[q, i]), i * R
            out.tokens.append(toks[q, at:at + n + 1].astype(np.int64).tolist())
            out.logprobs.append(lps[q, at:at + n + 1].astype(np.float64).tolist())
            t = s.params.top_logprobs
            out.top_logprobs.append([list(zip(host[6][q, at + x, :t].tolist(), host[5][q, at + x, :t].tolist()))
                                     if t else None for x in range(n + 1)])
            s.num_pending_tokens -= R
            if s.block_table:  # not freed since it was dispatched (finished, aborted or preempted)
                s.num_cached_tokens = len(s) + n  # t_P and the accepted drafts: their latents are cached
                self.drafts[s] = drafts[q, i]
            out.num_drafts += int(valid[q, i] > 0)
            out.num_draft_tokens += int(valid[q, i])
            out.accepted_per_pos[:n] += 1
        return out

    def decode(self, seqs: list[Sequence]) -> SpecStepOutput:
        """One speculative step run and read at once (async scheduling off)."""
        return self.read(self.dispatch(seqs))

    # ----- start-up compilation ---------------------------------------------------
    def decode_programs(self) -> list:
        """The verify program at every decode bucket (rows B x (k+1)): every decode step is a verify, so the
        runner's decode program never runs."""
        r, R, i32 = self.runner, self.R, self.runner.rank_arrays
        pad = r.buckets.max_decode_batch
        return [r.step_program(f"spec_verify B={B} W={W}", self._verify, i32(pad, R), i32(pad), i32(B), i32(B, R),
                               i32(B), i32(B), i32(B, W), i32(B), sample_rows=B * R)
                for B, W in r.buckets.decode_shapes()]

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
