"""A bounded log of engine steps, so tests (and /metrics) can check that a prefill
never shares a step with decodes.

Each entry records the step kind and, for every sequence that got a token, which
queue it came from *before* the step: the waiting or prefilling queues (prompts not
wholly in the cache yet) or the running (decode) queue. A step is "pure" when every sequence of a prefill step came from
the waiting queue and every sequence of a decode step from the running queue.
"""

from __future__ import annotations

import collections
import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class StepRecord:
    kind: str  # "prefill" | "decode"
    seq_ids: tuple[int, ...]
    from_waiting: int  # of seq_ids, how many were in the waiting queue before the step
    from_running: int  # ... and how many in the running queue
    num_tokens: int  # tokens computed: prompt chunks (recomputed tokens included) for prefill, one per seq for decode
    duration: float
    time: float

    @property
    def is_pure(self) -> bool:
        n = len(self.seq_ids)
        if self.kind == "prefill":
            return self.from_waiting == n and self.from_running == 0
        return self.from_running == n and self.from_waiting == 0


class StepLog:
    def __init__(self, maxlen: int = 100_000):
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=maxlen)
        self.mixed_steps = 0  # never reset, even when old records fall off the deque

    def step(self, engine):
        """Runs engine.step() and records it. Returns what engine.step() returns."""
        sch = engine.scheduler
        waiting = {s.seq_id for s in [*sch.waiting, *sch.prefilling]}  # not yet decoding
        running = {s.seq_id for s in sch.running}
        prefilled = engine.stats.prefill_tokens
        t0 = time.perf_counter()
        kind, seqs = engine.step()
        dt = time.perf_counter() - t0
        if kind != "idle":
            ids = tuple(s.seq_id for s in seqs)
            ntok = engine.stats.prefill_tokens - prefilled if kind == "prefill" else len(seqs)
            rec = StepRecord(kind, ids, sum(i in waiting for i in ids), sum(i in running for i in ids),
                             ntok, dt, time.time())
            if not rec.is_pure:
                self.mixed_steps += 1
            self.records.append(rec)
        return kind, seqs

    def __len__(self):
        return len(self.records)

    def __iter__(self):
        return iter(list(self.records))
