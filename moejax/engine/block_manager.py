"""Allocates fixed-size KV-cache blocks to sequences (host-side bookkeeping)."""

from __future__ import annotations

from collections import deque

from moejax.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) <= len(self.free)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token the sequence has now (its prefill)."""
        assert not seq.block_table
        n = self.blocks_needed(len(seq))
        if n > len(self.free):
            raise RuntimeError("allocate() without can_allocate()")
        seq.block_table = [self.free.popleft() for _ in range(n)]

    def can_append(self, seq: Sequence) -> bool:
        """Room for the token the next decode step writes (at position len(seq) - 1)."""
        return self.blocks_needed(len(seq)) <= len(seq.block_table) or len(self.free) > 0

    def append(self, seq: Sequence) -> None:
        if self.blocks_needed(len(seq)) > len(seq.block_table):
            seq.block_table.append(self.free.popleft())

    def deallocate(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
