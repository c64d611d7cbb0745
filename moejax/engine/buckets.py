"""The shapes the engine's compiled steps take: every rule that pads a batch to a bucket, in one place.

The set is finite and known at start-up, so the server compiles all of it before it reports
healthy (ModelRunner.precompile) and never compiles inside a request. It is kept small, since each
big program is a whole-model compile:

- decode: the per-rank batch to a power of two (1 ... max_num_seqs); the block-table width to a
  power of two of the longest context, but only where the decode attention's cost grows with the
  width (the XLA gather path; the Pallas kernel never visits tiles past a sequence's length, so it
  takes one width, the longest): at most four widths, the shortest 1/8 of the longest.
- packed prefill (whole prompts, nothing cached): the stream's tokens to a bucket of ``token_bucket``
  (powers of two up to 128, then 1.5x and 2x steps: under 50% padding, two programs per doubling);
  its number of prompts is not a bucket of its own: it is min(T, ``max_prefill_seqs``) rows, which
  bounds every batch of T tokens (a prompt has a token at least).
- paged prefill (chunks after a cached prefix or an earlier chunk): the longest chunk to S (a
  power of two, 16 at least; a chunk is one sequence's, so S stops at max_model_len's), the number of chunks to B = 1 or ``wide_batch(S)`` (as many chunks as
  ``max_prefill_tokens`` holds at S, at most ``max_prefill_seqs``); the block-table width is the
  longest (the kernel walks only the live context).
- speculative decoding (engine/speculative.py): the verify takes each decode shape (B, W) with k+1 rows
  a sequence (B x (k+1) rows, the sampler likewise), the draft programs each decode shape and each
  prefill batch B; the decode program and its feed are not built (every decode step is a verify).
- sampling runs in its own small program per (batch rows, SampleMode), apart from the model step.

Where a program's compile costs more than a coarser bucket's padding (``compile_bound``: XLA:CPU, the tiny
default, tests, CI; BENCHMARKS.md "2026-12-07c start-up (CPU)", "2026-12-07f start-up (CPU)"): two decode
widths, the longest and a quarter of it; paged chunk lengths a factor of 4 apart (16, 64, 256, ..., and the
longest); every step's rows (the decode batch, a packed prefill's prompts, a wide paged prefill's chunks:
the sampler's rows too) a power of 4 (1, 4, 16, ..., and the largest), the wide paged batch rounded down
to one; packed streams of 16, 64, 256, ... tokens and the largest; the sampler's top logprobs always
computed (``sample_mode``: a batch asking none keeps none of them, so its tokens and logprobs are the same
and a mode without them needs no program of its own).

A batch that fits no bucket (more prompts than ``max_prefill_seqs``, more chunks than B rows) is
run as several steps by the runner (``split``), never as a new shape.
"""

from __future__ import annotations

from moejax.kernels.common import pow2
from moejax.layers.sampler import SampleMode

MAX_PREFILL_SEQS = 256  # prompts (or chunks) of one prefill program per rank at most: its logits rows
MAX_DECODE_WIDTHS = 4  # block-table widths of the decode program where the attention reads the whole table
COMPILE_BOUND_WIDTH_STEP = 4  # compile_bound: the longest width and 1/4 of it
COMPILE_BOUND_CHUNK_STEP = 4  # compile_bound: paged chunk lengths 16, 64, 256, ... and the longest
COMPILE_BOUND_ROWS_STEP = 4  # compile_bound: a step's rows 1, 4, 16, ... and the largest
COMPILE_BOUND_TOKENS_STEP = 4  # compile_bound: packed stream tokens 16, 64, 256, ... and the largest


def token_bucket(n: int) -> int:
    """Tokens of a prefill stream of n: a power of two up to 128 (16 at least), then 1.5 x 2^k or 2^(k+1)."""
    p = pow2(n, 16)
    if p <= 128:
        return p
    return p * 3 // 4 if n <= p * 3 // 4 else p


def powers_of(step: int, hi: int, lo: int = 1) -> list[int]:
    """lo, lo x step, lo x step^2, ... up to hi."""
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= step
    return out


def powers_of_two(hi: int, lo: int = 1) -> list[int]:
    out, v = [], pow2(lo)
    while v <= hi:
        out.append(v)
        v *= 2
    return out


class Buckets:
    def __init__(self, max_num_seqs: int, max_prefill_tokens: int, max_blocks_per_seq: int,
                 decode_width_scales: bool, max_chunk: int | None = None, compile_bound: bool = False):
        """decode_width_scales: whether the decode attention's cost grows with the block-table width
        (moejax/kernels/decode_tables.py): then several widths, else the longest only. max_chunk: the
        longest chunk a paged prefill takes (max_model_len: one sequence's tokens; default
        max_prefill_tokens). compile_bound: fewer shapes (the module docstring)."""
        self.max_decode_batch = pow2(max_num_seqs)
        self.max_width = pow2(max_blocks_per_seq)
        self.max_prefill_seqs = min(MAX_PREFILL_SEQS, self.max_decode_batch)
        self.max_tokens = token_bucket(max_prefill_tokens)
        self.prefill_tokens = max_prefill_tokens
        self.max_chunk = min(max_prefill_tokens, max_chunk or max_prefill_tokens)
        self.compile_bound = compile_bound
        top = pow2(self.max_chunk, 16)
        self.paged_lens = [S for S in powers_of_two(top, 16)
                           if not compile_bound or S == top or (S // 16).bit_length() % 2 == 1]
        # compile_bound: the rows sizes of every step (and so of the sampler), and the packed streams' tokens
        self.rows_sizes = (sorted({*powers_of(COMPILE_BOUND_ROWS_STEP, self.max_decode_batch), self.max_decode_batch,
                                   self.max_prefill_seqs}) if compile_bound else None)
        self.token_sizes = (sorted({t for t in powers_of(COMPILE_BOUND_TOKENS_STEP, self.max_tokens, 16)}
                                   | {self.max_tokens}) if compile_bound else None)
        widths = powers_of_two(self.max_width)
        if compile_bound:
            widths = sorted({self.max_width, max(1, self.max_width // COMPILE_BOUND_WIDTH_STEP)})
        self.decode_widths = widths[-MAX_DECODE_WIDTHS:] if decode_width_scales else [self.max_width]

    # ----- decode
    def _rows(self, n: int) -> int:
        """compile_bound: the smallest rows size of at least n (n <= the largest)."""
        return next(r for r in self.rows_sizes if r >= n)

    def decode_batch(self, n: int) -> int:
        if self.compile_bound:
            return self._rows(min(n, self.max_decode_batch))
        return min(pow2(n), self.max_decode_batch)

    def decode_width(self, blocks: int) -> int:
        return next(w for w in self.decode_widths if w >= min(blocks, self.max_width))

    def decode_batches(self) -> list[int]:
        return self.rows_sizes if self.compile_bound else powers_of_two(self.max_decode_batch)

    def decode_shapes(self) -> list[tuple[int, int]]:
        return [(b, w) for b in self.decode_batches() for w in self.decode_widths]

    # ----- packed prefill
    def packed(self, tokens: int) -> tuple[int, int]:
        """(T, B): stream tokens and prompt rows of a packed prefill whose longest rank has ``tokens``."""
        if self.compile_bound:
            T = next((t for t in self.token_sizes if t >= tokens), None) or token_bucket(tokens)
            return T, self._rows(min(pow2(T), self.max_prefill_seqs))
        T = token_bucket(tokens)
        return T, min(pow2(T), self.max_prefill_seqs)

    def packed_shapes(self) -> list[tuple[int, int]]:
        if self.compile_bound:
            return [self.packed(t) for t in self.token_sizes]
        sizes = sorted({token_bucket(n) for n in [*powers_of_two(self.max_tokens),
                                                  *(p * 3 // 4 for p in powers_of_two(self.max_tokens, 256))]
                        if n <= self.max_tokens} | {self.max_tokens})
        return [self.packed(t) for t in sizes]

    # ----- paged prefill
    def paged_len(self, longest_chunk: int) -> int:
        return next(S for S in self.paged_lens if S >= min(longest_chunk, self.paged_lens[-1]))

    def wide_batch(self, S: int) -> int:
        """Chunks of up to S tokens a paged prefill takes at most (compile_bound: rounded down to a rows size)."""
        n = max(1, min(self.max_prefill_seqs, pow2(self.prefill_tokens) // S))
        return max(r for r in self.rows_sizes if r <= n) if self.compile_bound else n

    def paged(self, chunks: int, S: int) -> int:
        """B rows for ``chunks`` chunks of at most S tokens (chunks <= wide_batch(S))."""
        return 1 if chunks == 1 else self.wide_batch(S)

    def paged_shapes(self) -> list[tuple[int, int]]:
        out = []
        for S in self.paged_lens:
            out += sorted({(1, S), (self.wide_batch(S), S)})
        return out

    def split_paged(self, chunks: list[tuple[int, int]]) -> list[list[int]]:
        """Indices of (rank, chunk length) pairs grouped so that each group fits one paged shape: longest
        first; a group's S is its first chunk's, and it closes when a rank's rows (wide_batch(S)) are full."""
        order = sorted(range(len(chunks)), key=lambda i: -chunks[i][1])
        groups, cur, per_rank, cap = [], [], {}, 0
        for i in order:
            rank, n = chunks[i]
            if cur and per_rank.get(rank, 0) >= cap:
                groups.append(cur)
                cur, per_rank = [], {}
            if not cur:
                cap = self.wide_batch(self.paged_len(n))
            cur.append(i)
            per_rank[rank] = per_rank.get(rank, 0) + 1
        return groups + [cur] if cur else groups

    def split_packed(self, ranks: list[int]) -> list[list[int]]:
        """Indices of prompts (by rank) in groups of at most max_prefill_seqs a rank, in order."""
        groups, cur, per_rank = [], [], {}
        for i, rank in enumerate(ranks):
            if per_rank.get(rank, 0) >= self.max_prefill_seqs:
                groups.append(cur)
                cur, per_rank = [], {}
            cur.append(i)
            per_rank[rank] = per_rank.get(rank, 0) + 1
        return groups + [cur] if cur else groups

    # ----- sampling
    def sample_mode(self, mode: SampleMode) -> SampleMode:
        """The sampler program a batch of ``mode`` runs: compile_bound, the one with top logprobs."""
        return mode._replace(top=True) if self.compile_bound else mode

    def sample_modes(self) -> list[SampleMode]:
        """The sampler programs of a rows size (SampleMode.all, merged by ``sample_mode``)."""
        return list(dict.fromkeys(self.sample_mode(m) for m in SampleMode.all()))

    def sample_rows(self) -> list[int]:
        """Every batch-rows size a step hands to the sampler."""
        rows = set(self.decode_batches())
        rows |= {b for _, b in self.packed_shapes()} | {b for b, _ in self.paged_shapes()}
        return sorted(rows)
