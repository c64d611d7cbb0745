"""Owns the device state (parameters, paged latent cache) and the compiled steps.

Shapes are padded to buckets so the compiled programs are reused: the decode
batch to a power of two (up to max_num_seqs) and the block-table width to a
power of two of the longest live context; prefill batches to (batch, length)
powers of two. Steady-state decoding therefore compiles nothing new. The cache
is donated to every step, so XLA updates it in place.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.engine.sequence import Sequence
from moejax.layers.sampler import sample


def next_pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class ModelRunner:
    def __init__(self, module, params, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, kv_dtype):
        cfg = module.cfg
        self.module, self.params, self.cfg = module, params, cfg
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.num_slots = num_blocks * block_size
        self.cache = jnp.zeros((cfg.num_hidden_layers, self.num_slots, cfg.kv_cache_dim), kv_dtype)
        # How many times each step was traced (= compiled): tests assert on it.
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,), static_argnames=())
        self._score = jax.jit(self._score_impl)

    # ----- compiled bodies -------------------------------------------------
    def _prefill_impl(self, params, cache, tokens, seq_lens, slots, samp):
        self.trace_counts["prefill"] += 1
        B, S = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        h, cache = self.module.apply({"params": params}, tokens, positions, seq_lens, cache, slots,
                                     method="prefill")
        last = h[jnp.arange(B), jnp.maximum(seq_lens - 1, 0)]
        logits = self.module.apply({"params": params}, last, method="logits")
        toks, lps = sample(logits, *samp, positions=seq_lens)
        return toks, lps, cache

    def _decode_impl(self, params, cache, tokens, positions, slots, block_tables, seq_lens, samp):
        self.trace_counts["decode"] += 1
        h, cache = self.module.apply({"params": params}, tokens, positions, cache, slots, block_tables,
                                     jnp.maximum(seq_lens, 1), self.block_size, method="decode")
        logits = self.module.apply({"params": params}, h, method="logits")
        toks, lps = sample(logits, *samp, positions=positions + 1)
        return toks, lps, cache

    def _score_impl(self, params, tokens):
        self.trace_counts["score"] += 1
        B, S = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        h, _ = self.module.apply({"params": params}, tokens, positions, jnp.full((B,), S, jnp.int32),
                                 method="prefill")
        return self.module.apply({"params": params}, h, method="logits")

    # ----- host-side batching ---------------------------------------------
    def _sampling_arrays(self, seqs: list[Sequence], B: int):
        temp = np.zeros(B, np.float32)
        top_p = np.ones(B, np.float32)
        top_k = np.zeros(B, np.int32)
        seeds = np.zeros(B, np.uint32)
        for i, s in enumerate(seqs):
            p = s.params
            temp[i], top_p[i], top_k[i] = p.temperature, p.top_p, p.top_k
            seeds[i] = s.seed & 0xFFFFFFFF
        return temp, top_p, top_k, seeds

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prefill(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """Runs every token of each sequence, fills its cache, samples its next token."""
        B = next_pow2(len(seqs))
        S = min(next_pow2(max(len(s) for s in seqs), 16), next_pow2(self.max_model_len, 16))
        tokens = np.zeros((B, S), np.int32)
        lens = np.zeros(B, np.int32)
        slots = np.full((B, S), self.num_slots, np.int32)  # out of range: dropped
        for i, s in enumerate(seqs):
            n = len(s)
            tokens[i, :n] = s.token_ids
            lens[i] = n
            slots[i, :n] = [self._slot(s, p) for p in range(n)]
        toks, lps, self.cache = self._prefill(self.params, self.cache, tokens, lens, slots,
                                              self._sampling_arrays(seqs, B))
        for s in seqs:
            s.num_cached_tokens = len(s)
        return np.asarray(toks)[:len(seqs)], np.asarray(lps)[:len(seqs)]

    def decode(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """One token for each sequence; its last token is the one being fed."""
        B = min(next_pow2(len(seqs)), next_pow2(self.max_num_seqs))
        nb = min(next_pow2(max(len(s.block_table) for s in seqs)), next_pow2(self.max_blocks_per_seq))
        tokens = np.zeros(B, np.int32)
        positions = np.zeros(B, np.int32)
        slots = np.full(B, self.num_slots, np.int32)
        tables = np.zeros((B, nb), np.int32)
        lens = np.zeros(B, np.int32)
        for i, s in enumerate(seqs):
            pos = len(s) - 1
            tokens[i], positions[i], lens[i] = s.token_ids[-1], pos, pos + 1
            slots[i] = self._slot(s, pos)
            tables[i, :len(s.block_table)] = s.block_table
        toks, lps, self.cache = self._decode(self.params, self.cache, tokens, positions, slots, tables, lens,
                                             self._sampling_arrays(seqs, B))
        for s in seqs:
            s.num_cached_tokens = len(s)
        return np.asarray(toks)[:len(seqs)], np.asarray(lps)[:len(seqs)]

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        return np.asarray(self._score(self.params, jnp.asarray(token_ids, jnp.int32)))
