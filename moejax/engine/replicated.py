"""One engine, replicated over the processes of a multi-process server.

Every process holds the same LLMEngine (scheduler, block tables, sequences) and must make the same
calls to it in the same order: each step is a collective over the whole mesh, and the engine is a
deterministic function of its calls (request seeds included). Process 0 alone takes requests (the
HTTP front end). ``LeaderEngine`` is its engine: each call that changes the engine (add_request,
abort) is applied at once and queued; ``step`` sends the queue and the step to the other processes
(moejax/parallel/step_channel.py) before running it. ``follow`` is the other processes' loop: it
replays each message's calls, checks that its engine is in process 0's state, then steps. Sampled tokens reach every process (the step's outputs
are read with a collective, ModelRunner ``to_host``), so every engine appends the same tokens and
finishes the same sequences without being told.
"""

from __future__ import annotations

import dataclasses
import traceback

from moejax.engine.llm_engine import LLMEngine
from moejax.parallel.step_channel import StepChannel


class LeaderEngine:
    """Process 0's engine: an LLMEngine whose changes are forwarded to the other processes. Everything
    else (scheduler, blocks, stats, balancer, ...) reads through to the engine."""

    def __init__(self, engine: LLMEngine, channel: StepChannel):
        self._engine, self._channel = engine, channel
        self._calls: list[tuple] = []  # since the last step

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, prompt_ids, params, request_id=None, after=None):
        """``after``: an earlier sequence of the same prompt (n > 1, best_of), as LLMEngine's: the prompt is
        prefilled once and shared through the prefix cache, in every process (the followers hold it too)."""
        seq = self._engine.add_request(prompt_ids, params, request_id, after=after)  # a ValueError sends nothing
        # The seed the engine drew goes with it: the followers' sequences sample the same tokens.
        self._calls.append(("add", list(prompt_ids), dataclasses.replace(params, seed=seq.seed), request_id,
                            seq.seq_id, None if after is None else after.seq_id))
        return seq

    def abort(self, seq) -> None:
        self._engine.abort(seq)
        self._calls.append(("abort", seq.seq_id))

    def step(self):
        self._flush(("step", state_digest(self._engine)))
        return self._engine.step()

    def stop_followers(self) -> None:
        """The followers leave ``follow`` (the server is stopping)."""
        self._flush(("stop",))

    def _flush(self, last: tuple) -> None:
        calls, self._calls = self._calls + [last], []
        self._channel.send(calls)


def state_digest(engine: LLMEngine) -> tuple:
    """What a follower's engine must agree on before a step (a few numbers, cheap to compare): queue
    lengths, tokens, each sequence's rank and blocks, free blocks, held samples. A follower that differs raises
    instead of joining the step's collectives with other inputs (garbage, or a hang)."""
    sch = engine.scheduler
    queues = (sch.waiting, sch.prefilling, sch.running)
    return (tuple(len(q) for q in queues), sum(len(s) for q in queues for s in q),
            tuple((s.dp_rank, len(s.block_table), s.num_cached_tokens) for s in [*sch.prefilling, *sch.running]),
            engine.blocks.num_free, engine.num_held)


def follow(engine: LLMEngine, channel: StepChannel) -> None:
    """A process other than 0: replays process 0's engine calls until it says stop."""
    seqs = {}  # process 0's seq_id -> this engine's Sequence
    while True:
        for call in channel.receive():
            op = call[0]
            if op == "add":
                _, prompt_ids, params, request_id, leader_id, after_id = call
                # ``after`` gone here (finished, dropped below) is finished there too: neither engine holds it back
                after = None if after_id is None else seqs.get(after_id)
                seqs[leader_id] = engine.add_request(prompt_ids, params, request_id, after=after)
            elif op == "abort":
                seq = seqs.pop(call[1], None)
                if seq is not None:
                    engine.abort(seq)
            elif op == "step":
                if call[1] != state_digest(engine):
                    raise RuntimeError(f"this process's engine differs from process 0's before a step ({call[1]} "
                                       f"there, {state_digest(engine)} here): every process must make the same "
                                       "engine calls in the same order")
                try:
                    engine.step()
                except Exception:  # noqa: BLE001 - process 0's step raised too: its aborts follow
                    traceback.print_exc()
                engine.pop_failed()
                for k in [k for k, s in seqs.items() if s.is_finished]:
                    del seqs[k]
            elif op == "stop":
                return
            else:
                raise RuntimeError(f"unknown engine call {op!r} from process 0")
