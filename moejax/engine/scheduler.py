"""Chooses each step: a prefill batch (prompt chunks), or a decode step over the
running queue. Prefill and decode never share a batch.

Prefill steps are bounded by ``max_prefill_tokens``: a prompt longer than what is
left of the budget is prefilled in chunks over several steps (each chunk attends to
its own tokens and to the latents already in the paged cache). New prompts wait for the
next step rather than being cut when others are in the batch already; one alone is cut to
the budget.

Whether a prefill step may run while sequences decode is the scheduling policy's choice
(moejax/engine/scheduling_policy.py: prefill-first, interleave:N, token-budget:T), and so is
the rule that a chunk leaving its prompt part-way is followed by one decode step of the
running sequences. ``prefill_ready`` asks the policy exactly as ``schedule`` does.

Admission is bounded by free KV blocks (all of a prompt's blocks are taken at
admission, sharing those of its longest cached prefix: block_manager.py). When a
running sequence cannot get a block for its next token, the most recently admitted
one is preempted (its blocks freed, the sequence put back at the front of the
waiting queue with the tokens it has generated, to be recomputed), so nothing
accepted is lost. A sequence preempted more than ``max_preemptions`` times is finished
with finish_reason "error" instead (kept in ``failed`` until the engine reports it), so a
cache too small for the load cannot keep one request from ever finishing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from moejax.engine.block_manager import BlockManager
from moejax.engine.scheduling_policy import DEFAULT, SchedulingPolicy
from moejax.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_prefill_tokens: int,
                 max_preemptions: int = 16, max_model_len: int | None = None, scheduling_policy: str = DEFAULT,
                 lookahead: int = 0, overlaps: Callable[[Sequence], bool] = lambda seq: True):
        """lookahead: tokens a decode step writes past the sequence's next one (speculative drafts), given
        blocks when free ones are left (engine/speculative.py caps the drafts to what the blocks hold), past
        its tokens in flight too. overlaps(seq): whether a step of seq may be scheduled while its step before
        is in flight (async scheduling; the proposer's rule, engine/proposer.py)."""
        self.blocks = block_manager
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_preemptions = max_preemptions
        self.failed: list[Sequence] = []  # finished with an error (preempted too often), not yet reported
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet wholly in the cache
        self.running: list[Sequence] = []  # decoding
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache (vLLM's metric)
        self.prefix_cache_hits = 0  # ... of which found there
        self.policy = SchedulingPolicy(scheduling_policy)  # when a prefill may run while sequences decode
        self.lookahead = lookahead
        self.overlaps = overlaps

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self) -> tuple[str, list[Sequence]]:
        """Returns ("prefill", seqs), ("decode", seqs) or ("idle", []). A prefill
        sequence's ``num_new_tokens`` is the chunk this step computes, from ``num_cached_tokens``."""
        decoding = bool(self.running)
        if self.policy.prefill_may_run(decoding):
            batch = self._schedule_prefill(decoding)
            if batch:
                self.policy.prefilled(sum(s.num_new_tokens for s in batch),
                                      any(s.num_cached_tokens + s.num_new_tokens < len(s) for s in batch))
                return "prefill", batch
        self.policy.decoded()

        decode: list[Sequence] = []
        kept: list[Sequence] = []  # running, in their order: the decode batch and those held back
        while self.running:
            seq = self.running.pop(0)
            if seq.num_pending_tokens and (seq.ends_by_length(self.max_model_len) or not self.overlaps(seq)):
                # Its tokens in flight may end it (nothing more to compute), or its next step needs them on the
                # host: scheduled again once they are read (async scheduling).
                kept.append(seq)
                continue
            while not self.blocks.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.blocks.append(seq)
                decode.append(seq)
                kept.append(seq)
        self.running = kept
        for seq in decode if self.lookahead else ():  # after every sequence has its next token's block
            self.blocks.reserve(seq, min(len(seq) + seq.num_pending_tokens + self.lookahead, self.max_model_len))
        return ("decode", list(decode)) if decode else ("idle", [])  # a copy: finishing edits running

    def prefill_ready(self) -> bool:
        """Whether schedule() would now return a prefill (it changes nothing). With async scheduling the
        engine reads the decode step in flight first: a prefill may admit a preempted sequence, whose
        tokens must all be on the host."""
        decoding = bool(self.running)
        if not self.policy.prefill_may_run(decoding):
            return False
        chunk = self._first_chunk()  # schedule()'s prefill batch is empty exactly when its first is refused
        return chunk is not None and self.policy.admits(decoding, 0, chunk)

    def _first_chunk(self) -> int | None:
        """The tokens the first sequence of a prefill step built now would compute (as _schedule_prefill
        cuts it); None when no sequence could be admitted (no slot or no blocks)."""
        if self.prefilling:
            seq = self.prefilling[0]
            return min(len(seq) - seq.num_cached_tokens, self.max_prefill_tokens)
        if not self.waiting or not self.has_slot():
            return None
        cached = self.blocks.cached_tokens(self.waiting[0])
        return None if cached is None else min(len(self.waiting[0]) - cached, self.max_prefill_tokens)

    def _schedule_prefill(self, decoding: bool) -> list[Sequence]:
        budget = self.max_prefill_tokens
        batch: list[Sequence] = []
        for seq in self.prefilling:  # prompts part-way through go first
            if budget == 0:
                break
            chunk = min(len(seq) - seq.num_cached_tokens, budget)
            if not self.policy.admits(decoding, self.max_prefill_tokens - budget, chunk):
                return batch  # nothing admitted ahead of it
            seq.num_new_tokens = chunk
            budget -= chunk
            batch.append(seq)
        while self.waiting and budget > 0 and self.has_slot():
            seq = self.waiting[0]
            if batch and len(seq) > budget:  # the whole prompt, or wait for the next step
                break
            cached = self.blocks.cached_tokens(seq)
            if cached is None:  # no blocks for it now
                break
            if not self.policy.admits(decoding, self.max_prefill_tokens - budget, min(len(seq) - cached, budget)):
                break
            self.waiting.popleft()
            self._allocate(seq)
            seq.status = Status.RUNNING
            seq.num_new_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_new_tokens
            self.prefilling.append(seq)
            batch.append(seq)
        return batch

    def has_slot(self) -> bool:
        """Whether one more sequence may be admitted (prefilling and decoding ones count)."""
        return len(self.running) + len(self.prefilling) < self.max_num_seqs

    def _allocate(self, seq: Sequence) -> int:
        """Blocks for ``seq`` (its longest cached prefix shared), counted in the prefix-cache metrics; the hit."""
        hit = self.blocks.allocate(seq)
        self.prefix_cache_queries += len(seq)
        self.prefix_cache_hits += hit
        return hit

    def can_admit_prefilled(self, seq: Sequence) -> bool:
        """Whether a sequence another engine prefilled (engine/kv_handoff.py) has a slot and blocks here now."""
        return self.has_slot() and self.blocks.can_allocate(seq)

    def admit_prefilled(self, seq: Sequence, fill: Callable[[int], None]) -> None:
        """Admits a sequence another engine prefilled straight to the decode queue: blocks for every token
        (allocated and counted as a prefill's admission), then ``fill(hit)`` writes its rows after the
        cached prefix of ``hit`` tokens and sets what is cached; if ``fill`` raises, nothing of it is left."""
        hit = self._allocate(seq)
        try:
            fill(hit)
        except Exception:
            self.blocks.deallocate(seq)
            raise
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.blocks.cache_computed(seq)  # its full prompt blocks become prefix-cache hits here too

    def prefilled(self, done: list[Sequence]) -> None:
        """After a prefill step, before their sampled tokens are appended: the sequences whose
        prompt is now wholly cached join the decode queue; the rest continue next prefill step."""
        ids = {s.seq_id for s in done}
        self.prefilling = [s for s in self.prefilling if s.seq_id not in ids]
        self.running.extend(done)

    def preempt(self, seq: Sequence) -> None:
        """Frees the sequence's blocks and queues it first for recomputation, or, past the bound,
        finishes it with an error."""
        self.blocks.deallocate(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.num_preemptions > self.max_preemptions:
            seq.finish_reason = "error"
            seq.error = (f"the request was given up after {seq.num_preemptions} preemption(s) (max_preemptions="
                         f"{self.max_preemptions}): the KV cache is too small for this load")
            self.finish(seq)
            self.failed.append(seq)
            return
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.blocks.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq in self.waiting:  # preempted while its last token was in flight, then that token ended it
            self.waiting.remove(seq)

    def abort(self, seq: Sequence) -> None:
        seq.finish_reason = seq.finish_reason or "abort"
        self.finish(seq)
