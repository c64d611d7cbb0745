"""Decode attention over the paged cache for Hopper in Pallas on Mosaic GPU (TMA copies, wgmma, warp
specialisation): absorbed MLA (``mgpu_mla_decode``: DeepSeek-V3's 128 heads, where decode attention is
compute-bound and the Triton / Pallas-Triton kernels stopped at about half of the floor), and Step3's MFA
(``mgpu_mfa_decode``) on the same design: one kernel over a ``_Layout`` (which column blocks a tile copies,
which each compute warpgroup contracts and multiplies).

Same contract as ``triton_mla_decode`` (flash-decoding: the context cut into splits, combined by
``combine_splits``). A CTA takes 64 heads of one sequence and one split, in three warpgroups:

- a memory warpgroup TMA-copies each tile of ``block_t`` tokens (whole pages of the block table, the
  page ids read as scalars) into ``num_stages`` shared-memory slots: the latent's two halves and the
  rope key, three buffers;
- two compute warpgroups each own one half of the 512 latent columns: warpgroup 0 the first half and
  the rope part, warpgroup 1 the second half. Each computes its partial scores q.k over its columns
  (the contraction split 320 / 256), the two swap partials through shared memory and add them (the
  same sum on both: float addition commutes), run the same online softmax, and accumulate p.v into
  their own half of the [64, 512] context (128 float32 registers a thread; the whole context in one
  warpgroup would not fit the register file). Each warpgroup reads only its own columns of a tile.

Shared memory at 64 tokens a tile, 2 slots: the query's latent 64 KB + tiles 144 KB + the exchange
16 KB = 224.3 KB of Hopper's 227; the query's rope part is staged through a tile slot into warpgroup 0's
registers (wgmma takes its left operand from registers), and the partials take turns in one buffer.
Exactness: against float64 NumPy in Mosaic GPU's interpreter on CPU and on the device
(tests/test_mgpu_decode_attention.py). CUDA (sm_90) only: ROCm keeps the Triton route.

FP8 caches (kv_quant rows, padded to whole 128-byte tiles: ``fp8_row_dim``): one slot of raw rows, widened
to bf16 tiles by the compute warpgroups (exact) and freed at once for the next copy; the row scale
applied to the scores and the probabilities. Runs in the interpreter and lowers for CUDA; not yet run on a
GPU, so the selection keeps Triton for FP8 caches. Query rows a sequence (the speculative verify): a CTA's 64
wgmma rows as Q rows x 64/Q heads (``heads_a_cta``), causal among them, the context read once.

MFA (rows [k | v], one K/V head): four blocks (the key's and the value's halves), warpgroup w contracts the
key's half w and multiplies the value's half w; 32 KB of query + 128 KB of tiles + 16 KB = 176 KB.
Measured: BENCHMARKS.md 2026-12-07f (MLA bf16; FP8, rows together and MFA not yet run on a GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.compat import interpret_mode, platform
from pallas_kernels.paged_decode_attention import combine_splits, layered_cache

try:  # Mosaic GPU's Pallas module ships with jax; guarded for builds without it
    import jax.experimental.pallas.mosaic_gpu as plgpu
    _MISSING = ""
except ImportError as e:  # pragma: no cover - depends on the jax build
    plgpu, _MISSING = None, f"jax.experimental.pallas.mosaic_gpu: {e}"
try:  # its CPU interpreter (tests); a private module, so a jax that moved it only loses the interpreter
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - depends on the jax version
    InterpretGPUParams = None

LOG2E = 1.4426950408889634
FP8 = jnp.float8_e4m3fn
SCALE_BOX = 16  # bytes copied for an FP8 row's scale byte (and its zero padding): TMA's smallest box row
FP8_ROW_ALIGN = 128  # an FP8 row's bytes, for the swizzled copies of its latent halves


def fp8_row_dim(kv_dim: int) -> int:
    """The FP8 cache row this kernel reads: kv_quant's layout (values, scale byte, zero padding) padded to
    whole 128-byte tiles (DeepSeek-V3: 640 bytes, kv_quant's own 592 + 8%)."""
    return -(-(kv_dim + SCALE_BOX) // FP8_ROW_ALIGN) * FP8_ROW_ALIGN


def interpret_mode_for(interpret) -> bool:
    return interpret_mode() if interpret is None else bool(interpret)


HEADS = 64  # heads a CTA: one wgmma M tile a compute warpgroup


def available() -> tuple[bool, str]:
    """(usable, why not): Mosaic GPU's Pallas module importable (it ships with jaxlib's CUDA build)."""
    return plgpu is not None, _MISSING


def check_shapes(heads: int, latent: int, rope: int, block_t: int, block_size: int, cache_dtype, q_dtype,
                 rows: int = 1):
    """The shapes this kernel takes, else a ValueError naming the one it cannot."""
    hq = heads_a_cta(rows)
    if heads % hq:
        raise ValueError(f"heads: the Mosaic GPU MLA kernel takes multiples of {hq} at {rows} query row"
                         f"{'s' if rows > 1 else ''} a sequence, got {heads}")
    if latent % 128:
        raise ValueError(f"latent dim: must be a multiple of 128 (two halves of 64-column tiles), got {latent}")
    if rope % 64:
        raise ValueError(f"rope dim: must be a multiple of 64, got {rope}")
    if block_t != 64 or block_t % block_size:
        # 64: wgmma's contraction over a tile's tokens takes multiples of 64, and 64 score columns are what
        # the registers hold beside the context half.
        raise ValueError(f"block_t: 64 tokens, a multiple of block_size {block_size}; got {block_t}")
    if jnp.dtype(cache_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(FP8)):
        raise ValueError(f"cache dtype: the Mosaic GPU MLA kernel reads bf16 or kv_quant FP8 caches, got "
                         f"{jnp.dtype(cache_dtype)}")
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"q dtype: bf16 or float32, got {jnp.dtype(q_dtype)}")


def _interpret_params(interpret):
    if not interpret:
        return None
    if InterpretGPUParams is None:
        raise ValueError("interpret: this jax has no Mosaic GPU interpreter (jax._src.pallas.mosaic_gpu.interpret)")
    return interpret if isinstance(interpret, InterpretGPUParams) else InterpretGPUParams()


ROWS_HEADS = {1: 64, 2: 32, 3: 16, 4: 16}


def heads_a_cta(rows: int) -> int:
    """Heads a CTA takes for ``rows`` query rows a sequence: its 64 wgmma rows are (row, head) pairs, each
    row's heads a multiple of 8 (the tiled buffers' row groups); 3 rows use 48 of the 64."""
    if rows not in ROWS_HEADS:
        raise ValueError(f"rows: the Mosaic GPU MLA kernel takes 1 to 4 query rows a sequence, got {rows}")
    return ROWS_HEADS[rows]


class _Layout(NamedTuple):
    """What a tile holds and who reads what. ``blocks``: (first column, width) of a cache row copied per tile,
    each block its own shared buffer; ``k_of[w]``: warpgroup w's score contraction, (block, query part)
    pairs, a query part "q0" / "q1" (the query halves' buffers) or "rope" (MLA's rope query, staged through
    that block's buffer into warpgroup 0's registers); ``v_of[w]``: the block warpgroup w multiplies the
    probabilities with (its half of the context columns); ``q_copies``: (query input, first column, width,
    part) copied once."""
    blocks: tuple
    k_of: tuple
    v_of: tuple
    q_copies: tuple


def mgpu_mla_decode(q_latent, q_rope, cache, block_tables, seq_lens, *, block_size: int, scale: float,
                    layer: int | None = None, block_t: int = 64, num_stages: int = 2, num_splits: int = 1,
                    out_dtype=None, interpret=None):
    """q_latent [B, H, C], q_rope [B, H, R], cache [num_slots, C+R] bf16 (or [L, num_slots, D] with
    ``layer``), block_tables [B, nb], seq_lens [B] (>= 1) -> context latents [B, H, C] in ``out_dtype``
    (float32 by default), as ``triton_mla_decode``. Several query rows a sequence (the speculative verify)
    as there: q [B, Q, H, *], seq_lens [B, Q] (each row's own length: causal among a sequence's rows) ->
    [B, Q, H, C], the sequence's context read once for all its rows (a CTA's 64 wgmma rows are Q rows x
    ``heads_a_cta(Q)`` heads)."""
    if plgpu is None:
        raise ValueError(f"mgpu_mla_decode: {_MISSING}; mla_kernel=triton or pallas instead")
    grouped = q_latent.ndim == 4
    if not grouped:
        q_latent, q_rope, seq_lens = q_latent[:, None], q_rope[:, None], seq_lens[:, None]
    B, Q, H, C = q_latent.shape
    R = q_rope.shape[-1]
    if q_rope.shape[:3] != (B, Q, H):
        raise ValueError(f"q_rope: expected [B={B}, {f'Q={Q}, ' if grouped else ''}H={H}, R], got {q_rope.shape}")
    _check_lens(seq_lens, B, Q, grouped)
    cache, layer = layered_cache(cache, layer, block_tables, B)
    check_shapes(H, C, R, block_t, block_size, cache.dtype, q_latent.dtype, Q)
    fp8 = jnp.dtype(cache.dtype) == jnp.dtype(FP8)
    D = cache.shape[-1]
    if D < C + R + (SCALE_BOX if fp8 else 0):
        raise ValueError(f"cache: rows of {D} cannot hold latent {C} + rope {R}"
                         f"{f' + the scale byte and its padding ({SCALE_BOX})' if fp8 else ''}")
    if fp8 and not interpret_mode_for(interpret) and D % FP8_ROW_ALIGN:
        # Mosaic tiles the cache's rows in the copies' swizzle (up to 128 bytes): an FP8 row must be whole tiles.
        raise ValueError(f"cache: FP8 rows of {D} bytes; the Mosaic GPU kernel copies rows of a multiple of "
                         f"{FP8_ROW_ALIGN} bytes (kv_quant's row width rounded up: fp8_row_dim)")
    Ch = C // 2
    # Warpgroup 0: the latent's first half and the rope part; 1: the second half (keys and values alike).
    layout = _Layout(blocks=((0, Ch), (Ch, Ch), (C, R)), k_of=(((0, "q0"), (2, "rope")), ((1, "q1"),)),
                     v_of=(0, 1), q_copies=((0, 0, Ch, "q0"), (0, Ch, Ch, "q1"), (1, 0, R, "rope")))
    out = _paged_decode((q_latent, q_rope), cache, block_tables, seq_lens, layout, layer=layer,
                        block_size=block_size, scale=scale, block_t=block_t, num_stages=num_stages,
                        num_splits=num_splits, out_dtype=out_dtype, interpret=interpret, fp8=fp8)
    return out if grouped else out[:, 0]


def mgpu_mfa_decode(q, cache, block_tables, seq_lens, *, block_size: int, scale: float, layer: int | None = None,
                    block_t: int = 64, num_stages: int = 2, num_splits: int = 1, out_dtype=None, interpret=None):
    """Step3's MFA decode (every query head against one K/V head): q [B, H, D], cache [num_slots, 2D] rows
    [k | v] bf16 (or [L, num_slots, 2D] with ``layer``), block_tables [B, nb], seq_lens [B] (>= 1) -> context
    [B, H, D] in ``out_dtype`` (float32 by default), as ``mfa_decode.run``'s Pallas path. The MLA kernel's
    design on MFA's row: warpgroup 0 contracts the key's first half and multiplies the value's first half,
    1 the second halves (64 heads a CTA; 176 KB of shared memory at 64 tokens, 2 slots)."""
    if plgpu is None:
        raise ValueError(f"mgpu_mfa_decode: {_MISSING}; the Pallas MFA kernel instead")
    B, H, D = q.shape
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens: expected [{B}], got {list(seq_lens.shape)}")
    cache, layer = layered_cache(cache, layer, block_tables, B)
    check_shapes(H, D, 0, block_t, block_size, cache.dtype, q.dtype)
    if jnp.dtype(cache.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"cache dtype: the Mosaic GPU MFA kernel reads bf16 caches, got {jnp.dtype(cache.dtype)}")
    if cache.shape[-1] != 2 * D:
        raise ValueError(f"cache: rows of {cache.shape[-1]}; MFA's rows are [k | v] = {2 * D} (one K/V head)")
    Dh = D // 2
    layout = _Layout(blocks=((0, Dh), (Dh, Dh), (D, Dh), (D + Dh, Dh)), k_of=(((0, "q0"),), ((1, "q1"),)),
                     v_of=(2, 3), q_copies=((0, 0, Dh, "q0"), (0, Dh, Dh, "q1")))
    out = _paged_decode((q[:, None],), cache, block_tables, seq_lens[:, None], layout, layer=layer,
                        block_size=block_size, scale=scale, block_t=block_t, num_stages=num_stages,
                        num_splits=num_splits, out_dtype=out_dtype, interpret=interpret, fp8=False)
    return out[:, 0]


def _check_lens(seq_lens, B, Q, grouped):
    if seq_lens.shape != (B, Q):
        raise ValueError(f"seq_lens: expected {[B, Q] if grouped else [B]}, got "
                         f"{list(seq_lens.shape if grouped else seq_lens.shape[:1])}")


def _paged_decode(q_inputs, cache, block_tables, seq_lens, layout: _Layout, *, layer, block_size, scale, block_t,
                  num_stages, num_splits, out_dtype, interpret, fp8):
    """The kernel over ``layout``: q_inputs [B, Q, H, *] each, cache [L, slots, row], seq_lens [B, Q] ->
    [B, Q, H, 2 x the value blocks' width] in ``out_dtype``."""
    B, Q, H = q_inputs[0].shape[:3]
    hq = heads_a_cta(Q)
    L, slots, D = cache.shape
    if slots % block_size:
        raise ValueError(f"cache: {slots} slots are not whole blocks of {block_size}")
    if num_stages < 2:
        raise ValueError(f"num_stages: at least 2, got {num_stages}")
    nb = block_tables.shape[1]
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    max_len = nb * block_size
    split_len = pl.cdiv(pl.cdiv(max_len, num_splits), block_t) * block_t
    num_splits = pl.cdiv(max_len, split_len)
    widths = [w for _, w in layout.blocks]
    Ch = widths[layout.v_of[0]]  # a warpgroup's context columns, the query halves' width too
    C = 2 * Ch
    assert widths[layout.v_of[1]] == Ch and all(w == Ch for _, _, w, part in layout.q_copies if part != "rope")
    rope_block = next((blk for pairs in layout.k_of for blk, part in pairs if part == "rope"), None)
    bt, bs, S = block_t, block_size, num_splits
    pages_a_tile = bt // bs
    # bf16: the wgmma operands are the TMA'd tiles, num_stages slots. FP8: one slot of raw rows, widened by
    # the compute warpgroups into one slot of bf16 tiles (exact: e4m3 values are bf16 values) and freed
    # for the next tile's copy right after, so the copy overlaps the tile's products; the row scale applied
    # to the scores and the probabilities (it scales both a token's key and value).
    raw_stages = 1 if fp8 else num_stages
    dt = jnp.bfloat16
    # Staged in the query's buffer (bf16, one TMA store) when there is one split and a bf16 result, else in
    # float32 through the exchange buffers, 64 columns at a time.
    stage_bf16 = S == 1 and out_dtype == jnp.dtype(jnp.bfloat16)
    o_dtype = jnp.bfloat16 if stage_bf16 else jnp.float32
    qk_scale = float(scale) * LOG2E
    if interpret is None:
        interpret = interpret_mode()
    interp = bool(interpret)
    if not interp and platform() != "cuda":
        raise ValueError(f"the Mosaic GPU decode kernels compile for CUDA (Hopper) only, not {platform()}; ROCm "
                         "keeps the Triton / Pallas kernels (mla_kernel=triton)")
    cache4 = cache.reshape(L, slots // bs, bs, D)
    nq, nblk = len(q_inputs), len(layout.blocks)
    # The rope query's staging slot in its block's buffer: bf16 slot 1 (the memory warpgroup fills it once
    # warpgroup 0 has read it), FP8 the widened tile's (0 writes it).
    rope_slot = 0 if fp8 else 1
    scale_col = max(c0 + w for c0, w in layout.blocks)  # an FP8 row's scale byte: right after its values

    def body(*refs):
        q_refs, (cache_ref, bt_ref, len_ref, o_ref, lse_ref, scoped) = refs[:nq], refs[nq:]
        (q_half, tiles, xch, lse_smem, raw, k_sc), (q_bar, k_bar, k_free, x_full, rope_read, x_done) = scoped
        q_part = {"q0": q_half[0], "q1": q_half[1]}
        raw = raw if fp8 else tiles
        r_sc = raw[nblk] if fp8 else None
        b = lax.axis_index("b")
        s = lax.axis_index("s")
        h0 = lax.axis_index("h") * hq
        wg = lax.axis_index("wg")
        start = s * split_len
        # Each query row's own end in this split (causal among a sequence's rows); the tiles cover the longest.
        ends = [jnp.minimum(len_ref[b, r], start + split_len) for r in range(Q)]
        length = len_ref[b, 0]
        for r in range(1, Q):
            length = jnp.maximum(length, len_ref[b, r])
        end = jnp.minimum(length, start + split_len)
        n_tiles = jnp.maximum(end - start + (bt - 1), 0) // bt
        last_page = (length - 1) // bs

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            heads = pl.ds(h0, hq)
            for r in range(Q):  # query row r's heads in rows r * hq of the buffers
                mine = pl.ds(r * hq, hq)
                for src, c0, w, part in layout.q_copies:
                    dst = tiles[rope_block].at[rope_slot, mine] if part == "rope" else q_part[part].at[mine]
                    plgpu.copy_gmem_to_smem(q_refs[src].at[b, r, heads, pl.ds(c0, w)], dst, q_bar)

            def issue(tile, slot):
                first = (start + tile * bt) // bs
                for j in range(pages_a_tile):
                    # Pages past the sequence's last one: its last page again (finite rows, masked out).
                    page = bt_ref[b, jnp.minimum(first + j, last_page)]
                    src = cache_ref.at[layer, page]
                    rows = pl.ds(j * bs, bs)
                    for (c0, w), dst in zip(layout.blocks, raw):
                        plgpu.copy_gmem_to_smem(src.at[:, pl.ds(c0, w)], dst.at[slot, rows], k_bar.at[slot])
                    if fp8:
                        plgpu.copy_gmem_to_smem(src.at[:, pl.ds(scale_col, SCALE_BOX)], r_sc.at[slot, rows],
                                                k_bar.at[slot])

            pl.when(n_tiles > 0)(lambda: issue(0, 0))
            if rope_block is not None and not fp8:
                plgpu.barrier_wait(rope_read)
            for i in range(1, raw_stages):
                pl.when(i < n_tiles)(lambda i=i: issue(i, i))

            @pl.loop(raw_stages, jnp.maximum(n_tiles, raw_stages))
            def _refill(tile):
                slot = lax.rem(tile, raw_stages)
                plgpu.barrier_wait(k_free.at[slot])
                issue(tile, slot)

        def compute(role: int):
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_bar)
            f32 = jnp.float32
            q_ops = {}
            for blk, part in layout.k_of[role]:
                if part == "rope":  # into registers (wgmma's left operand), its staging slot freed
                    q_ops[part] = tiles[blk].at[rope_slot][...]
                    if not fp8:
                        plgpu.barrier_arrive(rope_read)
                else:
                    q_ops[part] = q_part[part]
            v_buf = tiles[layout.v_of[role]]
            chunks = Ch // 64
            # Register layouts are the compiler's (the interpreter has none).
            cast = (lambda x, _: x) if interp else plgpu.layout_cast
            m0 = cast(jnp.full((HEADS,), -1e30, f32), plgpu.Layout.WGMMA.reduce(1))
            l0 = cast(jnp.zeros((HEADS,), f32), plgpu.Layout.WGMMA.reduce(1))
            # The context half as one accumulator: one wgmma of all its columns a tile (four of 64 waited for
            # one after another were slower).
            acc0 = cast(jnp.zeros((HEADS, Ch), f32), plgpu.Layout.WGMMA)
            ones = cast(jnp.ones((HEADS, SCALE_BOX), dt), plgpu.Layout.WGMMA) if fp8 else None
            # An untiled buffer read in the layout the tiled stores take (the interpreter has no layouts).
            load = (lambda r: r[...]) if interp else (  # the untiled scale box in the layout tiled stores take
                lambda r: plgpu.load(r, (), layout=plgpu.Layout.WGMMA, optimized=False))

            def mma(acc, pairs):
                """acc + a @ b over (a, b) ``pairs`` in float32; with ``acc`` None the scores sum a @ b.T, b a
                [tokens, columns] tile. wgmma on the device; in the interpreter (no transposed or register
                operands there) the same products as jnp.dot of the loaded values."""
                if interp:
                    val = lambda x: x if isinstance(x, jax.Array) or not hasattr(x, "at") else x[...]  # noqa: E731
                    out = sum(jnp.dot(val(x).astype(f32), (val(y).T if acc is None else val(y)).astype(f32))
                              for x, y in pairs)
                    return out if acc is None else acc + out
                if acc is None:
                    def scores(r):
                        for x, y in pairs:
                            plgpu.wgmma(r, x, plgpu.transpose_ref(y, (1, 0)))
                        return r[...]
                    return pl.run_scoped(scores, plgpu.ACC((HEADS, pairs[0][1].shape[0]), f32))
                (a, b_), = pairs
                return pl.run_state(lambda r: plgpu.wgmma(r, a, b_))(plgpu.ACC.init(acc))

            def tile_step(tile, carry):
                m, l, acc = carry
                slot = lax.rem(tile, raw_stages)
                plgpu.barrier_wait(k_bar.at[slot])
                row_scale = None
                if fp8:  # slot is 0, the raw rows' and the widened tile's (kept traced: the lowering wants it so)
                    for blk in dict.fromkeys([blk for blk, _ in layout.k_of[role]] + [layout.v_of[role]]):
                        src, dst = raw[blk], tiles[blk]
                        for c0 in range(0, src.shape[-1], 128):  # 128 columns at a time: registers
                            w = min(128, src.shape[-1] - c0)
                            dst[0, :, pl.ds(c0, w)] = src[0, :, pl.ds(c0, w)].astype(f32).astype(dt)
                    # [scale | 0...]: the padding bytes after a row's scale byte are zeros, and give 0 here.
                    byte = lax.bitcast_convert_type(load(r_sc.at[0]), jnp.uint8).astype(f32)
                    k_sc[role] = jnp.where(byte > 0.5, jnp.exp2(byte - 127.0), 0.0).astype(dt)
                    plgpu.commit_smem()  # the widened tiles, written by threads, read by wgmma
                    pl.when(tile + 1 < n_tiles)(lambda: plgpu.barrier_arrive(k_free.at[0]))
                    # Every token's scale in the scores' layout: ones [64, 16] @ [scale | 0...]^T.
                    row_scale = mma(None, [(ones, k_sc.at[role])])
                # The partial scores swapped through one buffer, in turn: warpgroup 1 writes its own (its
                # contraction is the shorter or the same), 0 reads it and writes its own, 1 reads that. The
                # buffer is written again only after both reads (1 writes the next tile's after its read).
                part = mma(None, [(q_ops[qp], tiles[blk].at[slot]) for blk, qp in layout.k_of[role]])
                if role == 0:
                    plgpu.barrier_wait(x_full.at[1])
                    theirs = xch[...]
                    xch[...] = part
                    plgpu.barrier_arrive(x_full.at[0])
                    sc = part + theirs
                else:
                    xch[...] = part
                    plgpu.barrier_arrive(x_full.at[1])
                    plgpu.barrier_wait(x_full.at[0])
                    sc = xch[...] + part  # the same sum as warpgroup 0's: float addition commutes
                sc = sc * qk_scale if row_scale is None else sc * (row_scale * qk_scale)
                cols = (lax.broadcasted_iota(jnp.int32, (HEADS, bt), 1) if interp else
                        plgpu.broadcasted_iota(jnp.int32, (HEADS, bt), 1, layout=plgpu.Layout.WGMMA))
                t0 = start + tile * bt
                if Q == 1:
                    lim = end - t0
                else:  # each wgmma row's query row: its own end (rows past Q * hq: none, masked out)
                    row = (lax.broadcasted_iota(jnp.int32, (HEADS, bt), 0) if interp else
                           plgpu.broadcasted_iota(jnp.int32, (HEADS, bt), 0, layout=plgpu.Layout.WGMMA)) // hq
                    lim = jnp.zeros_like(cols)
                    for r in range(Q):
                        lim = jnp.where(row == r, ends[r] - t0, lim)
                sc = jnp.where(cols < lim, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p16 = (p if row_scale is None else p * row_scale).astype(dt)
                acc = mma(acc * lax.broadcast_in_dim(alpha, (HEADS, Ch), [0]), [(p16, v_buf.at[slot])])
                # Every arrival is waited for (the interpreter checks it): the last num_stages tiles free no
                # slot to refill.
                if not fp8:
                    pl.when(tile + num_stages < n_tiles)(lambda: plgpu.barrier_arrive(k_free.at[slot]))
                return m_new, l, acc

            m, l, acc = lax.fori_loop(0, n_tiles, tile_step, (m0, l0, acc0))
            has = l > 0
            inv = 1.0 / jnp.where(has, l, 1.0)
            col0 = role * Ch
            out = acc * lax.broadcast_in_dim(inv, (HEADS, Ch), [0])
            if stage_bf16:
                mine = q_half[role]  # this warpgroup's own query half, read for the last time
                mine[...] = out.astype(dt)
                plgpu.commit_smem()
                for r in range(Q):
                    plgpu.copy_smem_to_gmem(mine.at[pl.ds(r * hq, hq)],
                                            o_ref.at[b * Q + r, s, pl.ds(h0, hq), pl.ds(col0, Ch)])
            else:  # float32 through the exchange buffer, 64 columns at a time: 0's once 1 has read it, then 1's
                if role == 1:
                    plgpu.barrier_arrive(x_done.at[0])
                    plgpu.barrier_wait(x_done.at[1])
                else:
                    plgpu.barrier_wait(x_done.at[0])
                for c in range(chunks):
                    xch[...] = out[:, c * 64:(c + 1) * 64]
                    plgpu.commit_smem()
                    for r in range(Q):
                        plgpu.copy_smem_to_gmem(xch.at[pl.ds(r * hq, hq)],
                                                o_ref.at[b * Q + r, s, pl.ds(h0, hq), pl.ds(col0 + c * 64, 64)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                if role == 0:
                    plgpu.barrier_arrive(x_done.at[1])
            if role == 0:
                lse_smem[...] = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) * (1.0 / LOG2E), -jnp.inf)
                plgpu.commit_smem()
                for r in range(Q):
                    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(r * hq, hq)], lse_ref.at[b * Q + r, s, pl.ds(h0, hq)])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: compute(0))
        pl.when(wg == 1)(lambda: compute(1))

    def entry(*refs):
        def tiled(dtype, cols):  # wgmma / TMA layout: rows of min(128, a row's bytes) swizzled
            swizzle = min(128, cols * jnp.dtype(dtype).itemsize)
            return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)

        def tile(slots, cols, dtype=dt):
            return plgpu.SMEM((slots, bt, cols), dtype, transforms=tiled(dtype, cols))

        conv = 1 if fp8 else num_stages
        raw = ()
        k_sc = None
        if fp8:  # the raw rows' slot (then its scale box) and each compute warpgroup's [scale | 0...] tile
            # Raw rows tiled as the swizzled copies write them (fp8_row_dim: whole 128-byte tiles a row).
            raw = tuple(tile(1, w, FP8) for w in widths) + (plgpu.SMEM((1, bt, SCALE_BOX), FP8),)
            k_sc = tile(2, SCALE_BOX)
        smem = (
            tuple(plgpu.SMEM((HEADS, Ch), dt, transforms=tiled(dt, Ch)) for _ in range(2)),
            tuple(tile(conv, w) for w in widths),
            plgpu.SMEM((HEADS, bt), jnp.float32, transforms=tiled(jnp.float32, bt)),
            plgpu.SMEM((HEADS,), jnp.float32),
            raw, k_sc,
        )
        barriers = (
            plgpu.Barrier(num_arrivals=len(layout.q_copies) * Q),
            plgpu.Barrier(num_arrivals=(nblk + fp8) * pages_a_tile, num_barriers=raw_stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=raw_stages),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(),
            plgpu.Barrier(num_barriers=2),
        )
        pl.run_scoped(lambda *a: body(*refs, a), smem, barriers, collective_axes="wg")

    kernel = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((B * Q, S, H, C), o_dtype), jax.ShapeDtypeStruct((B * Q, S, H), jnp.float32)),
        grid=(H // hq, S, B), grid_names=("h", "s", "b"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0), interpret=_interpret_params(interpret))
    o, lse = kernel(*(x.astype(dt) for x in q_inputs), cache4, block_tables.astype(jnp.int32),
                    seq_lens.astype(jnp.int32))
    return combine_splits(o, lse, out_dtype).reshape(B, Q, H, C)


def smem_bytes(latent: int, rope: int, block_t: int, num_stages: int, fp8: bool = False) -> int:
    """Shared memory the kernel asks for (Hopper's limit: 227 KB a CTA): the query's latent halves (its
    rope part passes through a tile buffer), the bf16 tile slots (one for FP8, plus its raw rows and the
    two [scale | 0...] tiles), the exchange buffer and the lse row."""
    tiles = (1 if fp8 else num_stages) * block_t * (latent + rope) * 2
    raw = block_t * (latent + rope + SCALE_BOX) + 2 * block_t * SCALE_BOX * 2 if fp8 else 0
    return HEADS * latent * 2 + tiles + raw + HEADS * block_t * 4 + HEADS * 4
