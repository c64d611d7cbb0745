"""The ``scheduling_policy`` setting's spelling: its names, ``parse`` and ``canonical`` (the setting's check in
moejax/engine_args.py and the scheduler's policy, moejax/engine/scheduling_policy.py, which says what each does).
Below both, so the settings' declaration does not import the engine."""

from __future__ import annotations

PREFILL_FIRST = "prefill-first"
INTERLEAVE = "interleave"
TOKEN_BUDGET = "token-budget"
DEFAULT = PREFILL_FIRST
OPTIONS = (f"'{PREFILL_FIRST}' (prefill whenever a prompt waits and fits: throughput)",
           f"'{INTERLEAVE}:N' (N >= 1: at most N prefill steps in a row while sequences decode)",
           f"'{TOKEN_BUDGET}:T' (T >= 1: at most T prompt tokens prefilled between two decode steps)")


def parse(spec) -> tuple[str, int | None]:
    """(kind, limit) of a policy string; a ValueError naming ``scheduling_policy`` and the options."""
    if isinstance(spec, str):
        if spec == PREFILL_FIRST:
            return spec, None
        kind, sep, n = spec.partition(":")
        if sep and kind in (INTERLEAVE, TOKEN_BUDGET) and n.isascii() and n.isdigit() and int(n) >= 1:
            return kind, int(n)
    raise ValueError(f"scheduling_policy must be one of {', '.join(OPTIONS)}; got {spec!r}")


def canonical(spec) -> str:
    """The policy string as the config keeps it ("interleave:02" -> "interleave:2"); ValueError as parse."""
    kind, limit = parse(spec)
    return kind if limit is None else f"{kind}:{limit}"
