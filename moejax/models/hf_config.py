"""Checks every family's ``config.json`` parser shares.

A family keeps the fields that change its computation and refuses the rest by name: an
unknown field, or a known one with a value we cannot run, raises a ValueError naming it,
so a checkpoint we would silently mis-run is refused instead.
"""

from __future__ import annotations

from typing import Any


def bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json field {field!r}={value!r}: {why}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def refuse_unknown(d: dict[str, Any], known, model_type: str, prefix: str = "") -> None:
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"config.json has unknown or unsupported field(s) {[prefix + u for u in unknown]} "
                         f"for model_type {model_type!r}")


def require_positive_ints(d: dict[str, Any], fields, prefix: str = "") -> None:
    missing = [prefix + f for f in fields if d.get(f) is None]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {missing}")
    for f in fields:
        if not is_int(d[f]) or d[f] <= 0:
            raise bad(prefix + f, d[f], "must be a positive integer")


def refuse_flags(d: dict[str, Any], prefix: str = "") -> None:
    """Options no supported family uses: non-SiLU activations, biases, tied embeddings."""
    if d.get("hidden_act", "silu") != "silu":
        raise bad(prefix + "hidden_act", d["hidden_act"], "only 'silu' is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag, False):
            raise bad(prefix + flag, True, "biases are not supported")
    if d.get("tie_word_embeddings", False):
        raise bad(prefix + "tie_word_embeddings", True, "these checkpoints have a separate lm_head")


def fp8_block(qc: Any, field: str = "quantization_config") -> tuple[int, int] | None:
    """The [rows, cols] block of an FP8 e4m3 block-scaled checkpoint, or None without quantization."""
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise bad(field, qc, "only fp8 e4m3 block-scaled checkpoints are supported")
    bs = qc.get("weight_block_size")
    if not (isinstance(bs, list) and len(bs) == 2 and all(is_int(b) and b > 0 for b in bs)):
        raise bad(f"{field}.weight_block_size", bs, "must be [rows, cols]")
    return (bs[0], bs[1])


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
