"""Chooses each step: a prefill batch from the waiting queue, or a decode step over
the running queue. Prefill and decode never share a batch.

Admission is bounded by free KV blocks; when a running sequence cannot get a
block for its next token, the most recently admitted one is preempted (its
blocks freed, the sequence put back at the front of the waiting queue with the
tokens it has generated, to be recomputed), so nothing accepted is lost.
"""

from __future__ import annotations

from collections import deque

from moejax.engine.block_manager import BlockManager
from moejax.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_prefill_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[str, list[Sequence]]:
        """Returns ("prefill", seqs), ("decode", seqs) or ("idle", [])."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if batch and tokens + len(seq) > self.max_prefill_tokens:
                break
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            batch.append(seq)
            tokens += len(seq)
        if batch:
            return "prefill", batch

        decode: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            while not self.blocks.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.blocks.append(seq)
                decode.append(seq)
        self.running = decode
        return ("decode", list(decode)) if decode else ("idle", [])  # a copy: finishing edits running

    def admitted(self, seqs: list[Sequence]) -> None:
        """Prefilled sequences join the decode queue (unless they already finished)."""
        self.running.extend(s for s in seqs if not s.is_finished)

    def preempt(self, seq: Sequence) -> None:
        self.blocks.deallocate(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.blocks.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self.finish(seq)
