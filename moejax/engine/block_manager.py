"""Allocates fixed-size KV-cache blocks to sequences (host-side bookkeeping).

With data parallelism each rank (device) has its own cache and block pool; a
sequence is placed on one rank at admission (the one with the fewest sequences
that has room) and stays there. Block ids are local to the rank.
"""

from __future__ import annotations

from collections import deque

from moejax.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_ranks: int = 1, max_seqs_per_rank: int | None = None):
        """num_blocks is per rank."""
        if num_blocks < 1 or block_size < 1 or num_ranks < 1:
            raise ValueError("num_blocks, block_size and num_ranks must be positive")
        self.blocks_per_rank = num_blocks
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.max_seqs_per_rank = max_seqs_per_rank
        self.free: list[deque[int]] = [deque(range(num_blocks)) for _ in range(num_ranks)]
        self.seqs_on_rank = [0] * num_ranks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_rank * self.num_ranks

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def _rank_for(self, seq: Sequence) -> int | None:
        need = self.blocks_needed(len(seq))
        ok = [r for r in range(self.num_ranks) if need <= len(self.free[r])
              and (self.max_seqs_per_rank is None or self.seqs_on_rank[r] < self.max_seqs_per_rank)]
        return min(ok, key=lambda r: (self.seqs_on_rank[r], -len(self.free[r]))) if ok else None

    def can_allocate(self, seq: Sequence) -> bool:
        return self._rank_for(seq) is not None

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token the sequence has now (its prefill), on the chosen rank."""
        assert not seq.block_table
        r = self._rank_for(seq)
        if r is None:
            raise RuntimeError("allocate() without can_allocate()")
        seq.dp_rank = r
        self.seqs_on_rank[r] += 1
        seq.block_table = [self.free[r].popleft() for _ in range(self.blocks_needed(len(seq)))]

    def can_append(self, seq: Sequence) -> bool:
        """Room for the token the next decode step writes (at position len(seq) - 1)."""
        return self.blocks_needed(len(seq)) <= len(seq.block_table) or len(self.free[seq.dp_rank]) > 0

    def append(self, seq: Sequence) -> None:
        if self.blocks_needed(len(seq)) > len(seq.block_table):
            seq.block_table.append(self.free[seq.dp_rank].popleft())

    def deallocate(self, seq: Sequence) -> None:
        if seq.block_table:
            self.free[seq.dp_rank].extend(seq.block_table)
            self.seqs_on_rank[seq.dp_rank] -= 1
        seq.block_table = []
        seq.num_cached_tokens = 0
