"""One step's batch as the model's layers read it (sglang-jax's ForwardBatch, nano-vllm's Context): the
token positions, the cache slots they write, and the form of attention the step runs, one object
passed from the causal LM through each decoder layer to attention in place of a chain of positional
arguments. A JAX pytree: the arrays are its leaves; ``mode`` and ``block_size`` are static (they pick
the program).

The forms (``mode``):

- "dense": prompts [B, S] that attend to themselves (``seq_lens`` [B] real tokens of each);
- "paged": a chunk of a longer prompt, the last ``seq_lens[b]`` positions of a context of ``ctx_lens[b]``
  tokens whose earlier rows are in the cache (``block_tables`` [B, nb], ``block_size``);
- "packed": whole prompts back to back in one stream [T] (``cu_seqlens`` [B + 1]; padding after
  cu_seqlens[B] writes to an out-of-range slot);
- "decode": one new token a row [B] (already counted in ``seq_lens``), reading the paged cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

MODES = ("dense", "paged", "packed", "decode")


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    mode: str
    positions: Any
    slots: Any = None  # cache slot of each token (None: no cache)
    seq_lens: Any = None
    block_tables: Any = None
    ctx_lens: Any = None  # paged: the context each chunk ends (defaults to seq_lens)
    cu_seqlens: Any = None
    block_size: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        needs = {"dense": ("seq_lens",), "paged": ("seq_lens", "block_tables", "block_size", "slots"),
                 "packed": ("cu_seqlens",), "decode": ("seq_lens", "block_tables", "block_size", "slots")}
        missing = [n for n in needs[self.mode] if getattr(self, n) is None]
        if missing:
            raise ValueError(f"a {self.mode} batch needs {', '.join(missing)}")
        if self.mode == "paged" and self.ctx_lens is None:
            object.__setattr__(self, "ctx_lens", self.seq_lens)

    @classmethod
    def prefill(cls, positions, seq_lens=None, slots=None, block_tables=None, ctx_lens=None,
                block_size: int | None = None, cu_seqlens=None) -> "ForwardBatch":
        """The prefill form its arguments name: packed with ``cu_seqlens``, paged with ``block_tables``
        (the two do not combine), dense otherwise."""
        if cu_seqlens is not None and block_tables is not None:
            raise ValueError("cu_seqlens (packed prefill) and block_tables (chunks over the paged cache) do not "
                             "combine")
        mode = "packed" if cu_seqlens is not None else "dense" if block_tables is None else "paged"
        return cls(mode, positions, slots, seq_lens, block_tables, ctx_lens, cu_seqlens, block_size)

    @classmethod
    def decode(cls, positions, slots, block_tables, seq_lens, block_size: int) -> "ForwardBatch":
        return cls("decode", positions, slots, seq_lens, block_tables, None, None, block_size)

    def replace(self, **fields) -> "ForwardBatch":
        return dataclasses.replace(self, **fields)

    def real_tokens(self, cache, n_tokens: int):
        """Which tokens are real (padding is not routed to experts): a packed stream's first cu_seqlens[-1];
        otherwise those whose slot is in the cache (padding writes out of range); None: all."""
        if self.mode == "packed":
            return jnp.arange(n_tokens) < self.cu_seqlens[-1]
        return None if cache is None else self.slots < cache.shape[1]


jax.tree_util.register_dataclass(
    ForwardBatch, data_fields=["positions", "slots", "seq_lens", "block_tables", "ctx_lens", "cu_seqlens"],
    meta_fields=["mode", "block_size"])
