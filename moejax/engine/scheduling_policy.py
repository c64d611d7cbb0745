"""When a prefill step may run while sequences are decoding: the scheduler's one policy choice
(``scheduling_policy``: moejax.load, ``scripts/serve.py --scheduling-policy``; docs/serving.md).

Prefill and decode never share a step, so every prefill step run while sequences decode stalls
each of their streams for that step. A policy bounds the stall between two decode steps:

- ``prefill-first`` (the default; throughput): a prefill step runs whenever a prompt waits and fits
  (sequence slots, KV blocks), until the batch is full.
- ``interleave:N`` (N >= 1): at most N prefill steps in a row while sequences decode; then one
  decode step.
- ``token-budget:T`` (T >= 1): while sequences decode, the prefill steps between two decode steps
  compute at most T prompt tokens (a prompt's tokens found in the prefix cache are not computed and
  do not count). A step takes the prompts that fit in what is left of T, in queue order; the first
  prefill step after a decode step always takes its first prompt, so a prompt (or chunk) longer than
  T runs, alone, as one step between two decode steps (chunked by ``max_prefill_tokens`` as under
  every policy, never by T).

Under every policy: a prefill step that leaves a prompt part-way (chunked by ``max_prefill_tokens``)
is followed by a decode step when sequences are decoding, so a long prompt does not stall running
streams for its whole prefill. With nothing decoding, a prefill step always runs (nobody waits for
a token); it still counts towards the bound of the decode steps that follow it.

The counts (prefill steps, their prompt tokens) run from the last decode step the scheduler chose
and restart at each one. ``SchedulingPolicy`` holds them: one instance per Scheduler.
"""

from __future__ import annotations

from moejax.scheduling_spec import DEFAULT, INTERLEAVE, TOKEN_BUDGET, canonical, parse


class SchedulingPolicy:
    """One scheduler's policy and its counts since the last decode step."""

    def __init__(self, spec: str = DEFAULT):
        self.kind, self.limit = parse(spec)
        self.spec = canonical(spec)
        self.prefill_steps = 0  # prefill steps since the last decode step
        self.prefill_tokens = 0  # prompt tokens they computed
        self.yield_to_decode = False  # the last prefill step left a prompt part-way

    def __repr__(self) -> str:
        return f"SchedulingPolicy({self.spec!r})"

    def prefill_may_run(self, decoding: bool) -> bool:
        """Whether a prefill step may be built now (``decoding``: sequences are in the decode queue)."""
        if not decoding:
            return True
        if self.yield_to_decode:  # a chunked prompt yields one step to the running streams
            return False
        if self.kind == INTERLEAVE:
            return self.prefill_steps < self.limit
        if self.kind == TOKEN_BUDGET:
            return self.prefill_tokens < self.limit
        return True

    def admits(self, decoding: bool, step_tokens: int, chunk: int) -> bool:
        """Whether a prompt chunk of ``chunk`` tokens to compute may join a prefill step that has
        ``step_tokens`` already (0: it would be the step's first), prefill_may_run permitting."""
        if not decoding or self.kind != TOKEN_BUDGET:
            return True
        if self.prefill_steps == 0 and step_tokens == 0:  # the first after a decode step: always
            return True
        return self.prefill_tokens + step_tokens + chunk <= self.limit

    def prefilled(self, step_tokens: int, left_part_way: bool) -> None:
        """A prefill step was scheduled: ``step_tokens`` computed; whether it left a prompt part-way."""
        self.prefill_steps += 1
        self.prefill_tokens += step_tokens
        self.yield_to_decode = left_part_way

    def decoded(self) -> None:
        """The scheduler went to the decode queue (a decode step, or nothing to run)."""
        self.prefill_steps = self.prefill_tokens = 0
        self.yield_to_decode = False
