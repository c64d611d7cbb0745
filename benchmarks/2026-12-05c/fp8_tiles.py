"""Tile sweep of the W8A8 Pallas kernels with FP8 dots on wgmma (pallas_kernels/triton_fp8_dots.py),
against the bf16 paths, on one GPU: what kernel_selection should pick for W8A8 at M >= 128.

  PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 python benchmarks/2026-12-05c/fp8_tiles.py --out $OUT/fp8_tiles.json
  python benchmarks/2026-12-05c/fp8_tiles.py --tiny   # CPU check (interpreter, tiny shapes)
"""
import argparse
import functools
import json
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "scripts")
from bench_fp8_kernels import quantize_fp8, rel  # noqa: E402

from moejax.benchmark.roofline import time_call  # noqa: E402
from moejax.kernel_selection import kernel_mode, select_moe, select_moe_fp8  # noqa: E402
from moejax.layers.fp8_linear import dequantize_fp8  # noqa: E402
from pallas_kernels.block_scaled_matmul import block_scaled_matmul  # noqa: E402
from pallas_kernels.fused_moe import fused_moe  # noqa: E402
from pallas_kernels.fused_moe_fp8 import fused_moe_fp8  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def timeit(fn, *args, iters):
    fn = jax.jit(fn)
    try:
        out = jax.block_until_ready(fn(*args))
        ts = time_call(fn, *args, iters=iters, warmup=2, reduce=sorted)
        return dict(us=statistics.median(ts) * 1e6, p10=ts[len(ts) // 10] * 1e6, p90=ts[-1 - len(ts) // 10] * 1e6), out
    except Exception as e:  # a tile Triton rejects (shared memory, registers)
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}"), None


DENSE_TILES = [dict(block_m=bm, block_n=bn, block_k=128, num_warps=w, num_stages=s)
               for bm, bn, w, s in ((64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3),
                                    (64, 256, 8, 3), (128, 256, 8, 3))]
MOE_TILES = [dict(block_n=bn, block_k=128, block_n_down=bnd, block_k_down=128, num_warps=w, num_stages=s)
             for bn, bnd, w, s in ((128, 128, 8, 3), (128, 128, 4, 3), (128, 128, 4, 4), (64, 128, 4, 3),
                                   (128, 256, 8, 3))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows, key = [], jax.random.key(0)

    def emit(r):
        rows.append(r)
        t = f"{r['us']:9.1f} us  p10 {r['p10']:8.1f} p90 {r['p90']:8.1f}" if "us" in r else r.get("error", "")
        print(f"{r['kind']:5} {r['case']:22} {r['path']:10} {t}  {r.get('tflops', '')} {r.get('rel', '')} {r.get('params', '')}",
              flush=True)

    dense = [(32, 384, 256)] if a.tiny else [(m, n, k) for n, k in ((7168, 7168), (24576, 1536))
                                              for m in (256, 512, 2048)]
    for M, N, K in dense:
        kx, kw = jax.random.split(jax.random.fold_in(key, M * N + K))
        x = jax.random.normal(kx, (M, K), F32).astype(BF16)
        w8, s = quantize_fp8(jax.random.normal(kw, (N, K), F32) * 0.02)
        wb = dequantize_fp8(w8, s, BF16)
        flops, case = 2 * M * N * K, f"M{M}_N{N}_K{K}"
        t, ref = timeit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=F32).astype(BF16), x, wb, iters=a.iters)
        emit(dict(kind="dense", case=case, path="xla_bf16", **t, tflops=round(flops / t.get("us", 1e30) / 1e6, 1)))
        for p in (DENSE_TILES[:1] if a.tiny else DENSE_TILES):
            p = dict(p, block_m=min(p["block_m"], max(16, M)))
            fn = functools.partial(block_scaled_matmul, variant="w8a8", **p)
            t, out = timeit(fn, x, w8, s, iters=a.iters)
            emit(dict(kind="dense", case=case, path="w8a8", params=p, **t,
                      tflops=round(flops / t["us"] / 1e6, 1) if "us" in t else None,
                      rel=round(rel(out, ref), 4) if out is not None else None))

    moe = [(4, 256, 128, 16)] if a.tiny else [(32, 7168, 2048, t) for t in (64, 128, 256)]
    for E, H, I, t in moe:
        N = E * t
        k = jax.random.split(jax.random.fold_in(key, N), 4)
        x = jax.random.normal(k[0], (N, H), F32).astype(BF16)
        gs = jnp.full((E,), t, jnp.int32)
        qs = [quantize_fp8(jax.random.normal(kk, sh, F32) * 0.02) for kk, sh in
              ((k[1], (E, I, H)), (k[2], (E, I, H)), (k[3], (E, H, I)))]  # [E, out, in]
        bf = [jnp.swapaxes(dequantize_fp8(w, s, BF16), 1, 2) for w, s in qs]  # [E, in, out] for the bf16 kernel
        nk = [z for w, s in qs for z in (w, s)]
        flops, case = 6 * N * H * I, f"E{E}_t{t}"
        with kernel_mode("pallas"):
            pb = select_moe(N, E, H, I, BF16).params
            p8 = select_moe_fp8(N, E, H, I, BF16, jnp.float8_e4m3fn, "w8a8").params
        tb, ref = timeit(functools.partial(fused_moe, **pb), x, gs, *bf, iters=a.iters)
        emit(dict(kind="moe", case=case, path="bf16", params=pb, **tb, tflops=round(flops / tb.get("us", 1e30) / 1e6, 1)))
        for p in [p8] + ([] if a.tiny else MOE_TILES):
            p = dict(p8, **{kk: v for kk, v in p.items() if kk in MOE_TILES[0]})
            fn = functools.partial(fused_moe_fp8, **p, weight_layout="nk")
            tt, out = timeit(fn, x, gs, *nk, iters=a.iters)
            emit(dict(kind="moe", case=case, path="w8a8", params=p, **tt,
                      tflops=round(flops / tt["us"] / 1e6, 1) if "us" in tt else None,
                      rel=round(rel(out, ref), 4) if out is not None else None))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
