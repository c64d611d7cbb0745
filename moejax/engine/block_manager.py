"""Allocates fixed-size KV-cache blocks to sequences (host-side bookkeeping), with
automatic prefix caching.

With data parallelism each rank (device) has its own cache and block pool; a
sequence is placed on one rank at admission and stays there. Block ids are local
to the rank.

Prefix caching (vLLM's scheme): a full block whose latents are computed is keyed
by a hash of its token ids chained with the hash of every block before it, so a key
names the whole prefix up to the block's end. A new sequence reuses the cached
blocks of its longest cached prefix (reference-counted: several sequences may share
a block) and only the rest is prefilled. A block nobody holds goes to the back of
its rank's free queue but keeps its key; allocation takes from the front, so the
least recently freed cached blocks are evicted first (LRU), and only when no
never-used block is left ahead of them.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from moejax.engine.sequence import Sequence


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The key of a full block: its tokens chained to the key of the block before it."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


class _RankPool:
    """One rank's blocks: reference counts, the LRU free queue and the prefix-cache table."""

    def __init__(self, num_blocks: int):
        self.ref = [0] * num_blocks
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.key_of: dict[int, bytes] = {}  # block -> its key (while its contents are valid)
        self.block_of: dict[bytes, int] = {}  # key -> block
        self.num_seqs = 0

    def take(self) -> int:
        """A free block (the least recently freed); a cached one loses its key."""
        b, _ = self.free.popitem(last=False)
        key = self.key_of.pop(b, None)
        if key is not None:
            del self.block_of[key]
        self.ref[b] = 1
        return b

    def share(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_ranks: int = 1, max_seqs_per_rank: int | None = None,
                 enable_prefix_caching: bool = True):
        """num_blocks is per rank."""
        if num_blocks < 1 or block_size < 1 or num_ranks < 1:
            raise ValueError("num_blocks, block_size and num_ranks must be positive")
        self.blocks_per_rank = num_blocks
        self.block_size = block_size
        self.num_ranks = num_ranks
        self.max_seqs_per_rank = max_seqs_per_rank
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [_RankPool(num_blocks) for _ in range(num_ranks)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_rank * self.num_ranks

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached-but-unused ones included: they are reclaimable)."""
        return sum(len(p.free) for p in self.pools)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def seqs_on_rank(self) -> list[int]:
        return [p.num_seqs for p in self.pools]

    # ----- prefix cache ---------------------------------------------------
    def _keys(self, seq: Sequence, n: int) -> list[bytes]:
        """Keys of the sequence's first n full blocks, hashed once: token ids only ever grow,
        so ``seq.block_hashes`` is extended, never recomputed (admission retries every step)."""
        bs, keys = self.block_size, seq.block_hashes
        for i in range(len(keys), n):
            keys.append(block_hash(keys[i - 1] if i else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return keys[:n]

    def _prefix_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the sequence's full blocks that may be reused: at least one token is always
        left to compute (its logits give the next token)."""
        return self._keys(seq, (len(seq) - 1) // self.block_size)

    def _cached_prefix(self, pool: _RankPool, keys: list[bytes]) -> list[int]:
        blocks = []
        for k in keys:
            b = pool.block_of.get(k)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # ----- allocation -----------------------------------------------------
    def _plan(self, seq: Sequence):
        """(rank, cached blocks, keys) for admitting seq, or None when no rank has room."""
        # a sequence asking for prompt logprobs computes its whole prompt (engine/prompt_logprobs.py)
        reads = self.enable_prefix_caching and seq.params.prompt_logprobs is None
        keys = self._prefix_keys(seq) if reads else []
        need_total = self.blocks_needed(len(seq))
        best = None
        for r, pool in enumerate(self.pools):
            if self.max_seqs_per_rank is not None and pool.num_seqs >= self.max_seqs_per_rank:
                continue
            hit = self._cached_prefix(pool, keys)
            # Cached blocks nobody holds sit in the free queue: reusing them takes them out of it.
            idle_hits = sum(1 for b in hit if pool.ref[b] == 0)
            if need_total - len(hit) > len(pool.free) - idle_hits:
                continue
            rank_key = (-len(hit), pool.num_seqs, -len(pool.free))
            if best is None or rank_key < best[0]:
                best = (rank_key, r, hit)
        return None if best is None else (best[1], best[2], keys)

    def can_allocate(self, seq: Sequence) -> bool:
        return self._plan(seq) is not None

    def cached_tokens(self, seq: Sequence) -> int | None:
        """The tokens allocate(seq) would find in the prefix cache now; None when it cannot allocate."""
        plan = self._plan(seq)
        return None if plan is None else len(plan[1]) * self.block_size

    def allocate(self, seq: Sequence) -> int:
        """Blocks for every token the sequence has now (its prefill), on the chosen rank, reusing
        its longest cached prefix. Returns the number of tokens found in the cache."""
        assert not seq.block_table
        plan = self._plan(seq)
        if plan is None:
            raise RuntimeError("allocate() without can_allocate()")
        r, hit, keys = plan
        pool = self.pools[r]
        seq.dp_rank = r
        pool.num_seqs += 1
        for b in hit:
            pool.share(b)
        seq.block_table = hit + [pool.take() for _ in range(self.blocks_needed(len(seq)) - len(hit))]
        seq.num_keyed_blocks = len(hit)
        seq.num_cached_tokens = len(hit) * self.block_size
        return seq.num_cached_tokens

    def can_append(self, seq: Sequence) -> bool:
        """Room for the token the next decode step writes: at position len(seq) - 1, or one further per
        token still pending on the device (async scheduling: its position is known, not its value)."""
        n = len(seq) + seq.num_pending_tokens
        return self.blocks_needed(n) <= len(seq.block_table) or len(self.pools[seq.dp_rank].free) > 0

    def append(self, seq: Sequence) -> None:
        if self.blocks_needed(len(seq) + seq.num_pending_tokens) > len(seq.block_table):
            seq.block_table.append(self.pools[seq.dp_rank].take())

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for up to num_tokens tokens, taken only while free ones are left (no preemption): the
        positions a speculative step writes ahead of the sequence (its drafts); kept for its next tokens."""
        pool = self.pools[seq.dp_rank]
        while self.blocks_needed(num_tokens) > len(seq.block_table) and pool.free:
            seq.block_table.append(pool.take())

    def cache_computed(self, seq: Sequence) -> None:
        """Registers the sequence's full blocks whose latents are now all in the cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_cached_tokens, len(seq)) // self.block_size
        if full <= seq.num_keyed_blocks:  # no block filled since: the common decode step (host time at c1024)
            return
        pool = self.pools[seq.dp_rank]
        keys = self._keys(seq, full)
        for i in range(seq.num_keyed_blocks, full):
            b = seq.block_table[i]
            if keys[i] not in pool.block_of and b not in pool.key_of:
                pool.block_of[keys[i]] = b
                pool.key_of[b] = keys[i]
        seq.num_keyed_blocks = max(seq.num_keyed_blocks, full)

    def deallocate(self, seq: Sequence) -> None:
        if seq.block_table:
            pool = self.pools[seq.dp_rank]
            for b in reversed(seq.block_table):  # a prefix's tail is evicted before its head
                pool.release(b)
            pool.num_seqs -= 1
        seq.block_table = []
        seq.num_keyed_blocks = 0
        seq.num_cached_tokens = 0
