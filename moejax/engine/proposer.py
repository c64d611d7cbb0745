"""What a proposer of draft tokens plugs into the runner (moejax/engine/model_runner.py), and the runner's
default: no drafts.

The runner calls its proposer at fixed points only (its one seam): the extra host inputs of a prefill
program (``prefill_inputs``, their shapes for start-up compilation ``prefill_input_shapes``), after a
prefill step (``after_prefill``), and when enumerating the precompiled set (``decode_programs`` in place of
its own decode step when ``own_decode`` is false, ``programs_after``). A proposer registers its own prefill
bodies and programs through the runner's public step API (``compile_step``, ``set_prefill_bodies``,
``run_step``, ``step_program``); the engine runs its decode step (``dispatch`` then ``read``, overlapped
under async scheduling as the runner's own; ``decode`` both at once), asking ``overlaps`` which sequences
may be scheduled with a step in flight. Drafts move with a
disaggregated handoff through ``export_drafts`` / ``import_drafts`` (engine/kv_handoff.py).
engine/speculative.py's SpecDecoder is the one proposer with drafts.
"""

from __future__ import annotations

from moejax.engine.sequence import Sequence


class Proposer:
    """No drafts: the runner's own decode step, nothing beside its prefill."""
    own_decode = True  # the runner's decode program (and its input gather) run; False: ``decode_programs``'

    def prefill_inputs(self, ranks: list[list[Sequence]], arrays: tuple, paged: bool) -> tuple:
        """Host arrays a prefill program takes after the runner's ``arrays`` (packed or paged layout)."""
        return ()

    def prefill_input_shapes(self, *shape: int) -> tuple:
        """Those arrays for a prefill bucket of ``shape`` (per rank), for start-up compilation."""
        return ()

    def after_prefill(self, ranks: list[list[Sequence]], B: int, outputs: list, sampled: object) -> None:
        """After a prefill program (before the runner advances num_cached_tokens): ``outputs`` are the
        program's outputs past (logits, counts, dispatched); ``sampled`` the sampler's token ids [N, B]."""

    def decode_programs(self) -> list:
        """The decode step's programs when ``own_decode`` is false (with their sampler rows)."""
        return []

    def programs_after(self, decode: list, prefill: list) -> list:
        """The proposer's own programs, given the decode and prefill step programs (their output types)."""
        return []

    def overlaps(self, seq: Sequence) -> bool:
        """Whether a decode step of ``seq`` may be dispatched while its step before is in flight."""
        return True

    def export_drafts(self, seq: Sequence) -> list[int]:
        """The drafts ``seq`` carries to another engine."""
        return []

    def import_drafts(self, seq: Sequence, drafts: list[int]) -> None:
        """Takes drafts another engine made for ``seq``; without speculation they are dropped."""

