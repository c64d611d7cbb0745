"""GPU microbenchmark of the block-FP8 kernels: fused MoE (W8A16, W8A8) and the block-scaled dense GEMM.

    python scripts/bench_fp8_kernels.py                  # both, DeepSeek-V3 shapes (on the GPU machine)
    python scripts/bench_fp8_kernels.py --only moe --tokens 8 32 --sweep
    python scripts/bench_fp8_kernels.py --json out.json  # also write every row as JSON
    python scripts/bench_fp8_kernels.py --smoke          # tiny shapes in interpret mode (checks the script on CPU)

MoE: one EP8 rank's share of DeepSeek-V3 (32 experts, hidden 7168, intermediate 2048), 8 / 32 / 128 /
512 tokens per expert. Per case: the bf16 ``fused_moe`` on the dequantised weights, ``fused_moe_fp8``
W8A16 and W8A8 with the blocks ``moe_fp8.pallas_plan`` picks, and the XLA dequantise-then-ragged_dot path;
time (median), achieved TB/s on the FP8 weight bytes (weights + scales), the floor (FP8 weight bytes
over the copy bandwidth measured first), ratios bf16 / fp8 and xla / fp8, and each path's relative
error against the XLA path (the first GPU check of the kernels' numerics: on CPU they ran only in the
interpreter; W8A8 rows against the XLA path with the same activation quantisation; on a GPU the XLA
path rounds the dequantised weights to bf16, so expect ~3e-3 for W8A16 and ~1e-2 for W8A8, whose
requantisation of h amplifies small differences). GEMM: DeepSeek-V3 projections q_a 7168->1536,
q_b 1536->24576, kv_a 7168->576, o_proj 16384->7168 at M = 64 / 256 / 1024: XLA bf16 (x @ W.T),
``block_scaled_matmul`` W8A16 / W8A8, XLA dequantise-then-dot.

FP8 e4m3fn casts and fp8 dots in Triton need compute capability 8.9+ (H100 / H200: 9.0).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

from moejax.benchmark.roofline import measure_copy_bandwidth, time_call  # noqa: E402
from moejax.kernels import common, fp8_gemm, moe, moe_fp8  # noqa: E402
from moejax.kernels.common import kernel_mode  # noqa: E402
from pallas_kernels.block_scaled_matmul import block_scaled_matmul  # noqa: E402
from pallas_kernels.fused_moe import fused_moe  # noqa: E402
from pallas_kernels.fused_moe_fp8 import fused_moe_fp8  # noqa: E402
from pallas_kernels.jax_triton_compat import available as triton_available  # noqa: E402
from pallas_kernels.cublaslt_fp8_gemm import available as cublaslt_available  # noqa: E402
from pallas_kernels.cublaslt_fp8_gemm import check as cublaslt_check, cublaslt_fp8_matmul  # noqa: E402
from pallas_kernels.triton_block_fp8 import act_quant_triton, block_fp8_matmul, fused_moe_block_fp8  # noqa: E402

BF16, FP8 = jnp.bfloat16, jnp.float8_e4m3fn
PROJECTIONS = {"q_a": (7168, 1536), "q_b": (1536, 24576), "kv_a": (7168, 576), "o_proj": (16384, 7168)}  # in, out
ROWS: list[dict] = []
TRITON = False  # the Triton (jax-triton) W8A8 kernels are timed: set in main


def _has_triton_interpreter() -> bool:
    """triton and torch installed (not imported: Triton's interpreter is chosen at its first import)."""
    return all(importlib.util.find_spec(m) is not None for m in ("triton", "torch"))


def quantize_fp8(w, block: int = 128):
    """float [..., R, C] -> (float8_e4m3fn [..., R, C], float32 scale [..., cdiv(R,b), cdiv(C,b)]), on the device."""
    *lead, R, C = w.shape
    nR, nC = -(-R // block), -(-C // block)
    wp = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, nR * block - R), (0, nC * block - C)])
    blocks = wp.reshape(*lead, nR, block, nC, block)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    q = (blocks / scale[..., :, None, :, None]).astype(FP8).reshape(*lead, nR * block, nC * block)
    return q[..., :R, :C], scale


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def timed(fn, *args, iters, warmup):
    """(seconds, output) or (None, error text)."""
    try:
        out = fn(*args)
        return time_call(fn, *args, iters=iters, warmup=warmup), out
    except Exception as e:  # a config Triton rejects (shared memory, registers), an unsupported cast
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def fmt_t(t):
    return f"{t * 1e6:9.1f}" if t else "   failed"


def triton_moe_grid(sweep: bool):
    """Tiles of the Triton W8A8 fused MoE (``tri``): the selected one first, with --sweep the rest."""
    return [None] + ([dict(block_m=bm, block_n_down=bn2, num_warps=nw, num_stages=ns)
                      for bm, bn2, nw, ns in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (3, 4))]
                     if sweep else [])


def triton_gemm_grid(sweep: bool):
    return [None] + ([dict(block_m=bm, block_n=bn, block_k=128, group_m=8, num_warps=nw, num_stages=ns)
                      for bm, bn, nw, ns in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))] if sweep else [])


def moe_grid():
    """Alternatives for --sweep (decode-sized tiles: the weights stream): wide K steps, the two column
    widths, 4 / 8 warps."""
    return [dict(block_m=16, block_n=bn, block_k=128, block_n_down=bn2, block_k_down=128 if bn >= 128 else 64,
                 num_warps=nw, num_stages=3)
            for bn, bn2, nw in itertools.product((64, 128), (64, 128), (4, 8))]


# --layouts: (label, extra kernel args, whether the weights go in as [E, out, in])
# The main rows run the model's layout, [E, out, in] ("nk"); these are the alternatives.
LAYOUT_CASES = [("a16kn", dict(variant="w8a16", weight_layout="kn"), False),
                ("a8kn", dict(variant="w8a8", weight_layout="kn"), False),
                ("f16nk", dict(variant="w8a16", compute_dtype="float16", weight_layout="nk"), True)]


def run_moe(tokens, bw, smoke, interpret, sweep, iters, warmup, layouts=False, triton_sweep=False):
    E, H, I = (4, 256, 192) if smoke else (32, 7168, 2048)
    k = jax.random.split(jax.random.key(0), 4)
    qs = [quantize_fp8(jax.random.normal(kk, shape, jnp.float32) * 0.02) for kk, shape in
          ((k[1], (E, H, I)), (k[2], (E, H, I)), (k[3], (E, I, H)))]
    (wg, sg), (wu, su), (wd, sd) = qs
    bf = [jax.jit(functools.partial(fp8_gemm.dequantize_fp8, dtype=BF16))(w, s) for w, s in qs]  # same values, bf16
    fp8_bytes = sum(w.size + s.size * 4 for w, s in qs)
    print(f"\n== fused MoE FP8: E={E} H={H} I={I}, FP8 weights {fp8_bytes / 1e9:.3f} GB "
          f"(bf16 {sum(b.size * 2 for b in bf) / 1e9:.3f} GB) ==")
    print(f"{'tok/exp':>7} {'N':>6} {'path':>6} {'us':>9} {'FP8 TB/s':>8} {'floor us':>8} {'bf16/x':>6} "
          f"{'xla/x':>6} {'err vs xla':>10}  params")
    for t in tokens:
        N = E * t
        x = jax.random.normal(k[0], (N, H), jnp.float32).astype(BF16)
        gs = jnp.full((E,), t, jnp.int32)
        floor = fp8_bytes / bw
        xla_fn = jax.jit(moe_fp8.xla)  # takes the model's [E, out, in] layout
        t_x, y_x = timed(xla_fn, x, gs, *(jnp.swapaxes(a, 1, 2) for a in (wg, sg, wu, su, wd, sd)),
                         iters=iters, warmup=warmup)
        with kernel_mode("pallas"):
            pb = moe.pallas_plan(N, E, H, I, BF16).params
        t_b, y_b = timed(jax.jit(functools.partial(fused_moe, **pb, interpret=interpret)), x, gs, *bf,
                         iters=iters, warmup=warmup)
        cases = [("xla", t_x, y_x, {}), ("bf16", t_b, y_b, pb)]
        kn = [wg, sg, wu, su, wd, sd]
        nk = [jnp.swapaxes(a, 1, 2) for a in kn]  # HF's [E, out, in]: the model's FP8 expert layout
        for variant in ("w8a16", "w8a8"):
            with kernel_mode("pallas"):
                p = moe_fp8.pallas_plan(N, E, H, I, BF16, FP8, variant).params
            configs = [p] + ([dict(p, **g) for g in moe_grid()] if sweep else [])
            for i, c in enumerate(configs):
                f = jax.jit(functools.partial(fused_moe_fp8, **c, weight_layout="nk", interpret=interpret))
                tt, y = timed(f, x, gs, *nk, iters=iters, warmup=warmup)
                cases.append((variant if i == 0 else variant[-3:] + "*", tt, y, c))
        if TRITON:
            for i, c in enumerate(triton_moe_grid(triton_sweep)):
                c = c or moe_fp8.triton_params(N, E)
                if c["block_m"] > 16 * max(t, 1) * 8:  # tiles far taller than an expert's rows: skip
                    continue
                f = jax.jit(functools.partial(fused_moe_block_fp8, **c))
                tt, y = timed(f, x, gs, *nk, iters=iters, warmup=warmup)
                cases.append(("tri" if i == 0 else "tri*", tt, y, c))
        if layouts:  # the same weights as [E, in, out], and the f16 dot
            for label, extra, is_nk in LAYOUT_CASES:
                with kernel_mode("pallas"):
                    p = moe_fp8.pallas_plan(N, E, H, I, BF16, FP8, extra["variant"]).params
                base = dict(p, **extra)
                configs = [base]
                for i, c in enumerate(configs):
                    if c.get("compute_dtype") and c.get("variant") != "w8a16":
                        continue
                    f = jax.jit(functools.partial(fused_moe_fp8, **c, interpret=interpret))
                    tt, y = timed(f, x, gs, *(nk if is_nk else kn), iters=iters, warmup=warmup)
                    cases.append((label if i == 0 else label + "*", tt, y, c))
        ref8 = jax.jit(functools.partial(moe_fp8.xla, variant="w8a8"))(x, gs, *nk)
        for name, tt, y, c in cases:  # W8A8 against the XLA path with the same activation quantisation
            ref = ref8 if name.startswith(("w8a8", "a8", "tri")) else (y_x if t_x else None)
            err = rel(y, ref) if (tt and ref is not None) else float("nan")
            r = dict(kind="moe", tokens_per_expert=t, rows=N, path=name, us=tt and tt * 1e6,
                     fp8_tbps=tt and fp8_bytes / tt / 1e12, floor_us=floor * 1e6, err_vs_xla=err, params=c)
            ROWS.append(r)
            if not tt:
                print(f"{t:>7} {N:>6} {name:>6}  failed: {y}")
                continue
            ratio_b = f"{t_b / tt:6.2f}" if t_b else "     -"
            ratio_x = f"{t_x / tt:6.2f}" if t_x else "     -"
            print(f"{t:>7} {N:>6} {name:>6} {fmt_t(tt)} {fp8_bytes / tt / 1e12:8.2f} {floor * 1e6:8.1f} {ratio_b} "
                  f"{ratio_x} {err:10.2e}  {c if name not in ('xla',) else ''}")


def run_gemm(ms, bw, smoke, interpret, iters, warmup, sweep=False):
    shapes = {"tiny": (320, 192)} if smoke else PROJECTIONS
    print("\n== block-scaled GEMM: y = x @ (W * s)^T, W [out, in] e4m3fn, 128x128 scales ==")
    print(f"{'proj':>6} {'in':>6} {'out':>6} {'M':>5} {'path':>6} {'us':>9} {'FP8 TB/s':>8} {'floor us':>8} "
          f"{'bf16/x':>6} {'xla/x':>6} {'err vs xla':>10}  params")
    key = jax.random.key(1)
    for name, (K, Nout) in shapes.items():
        w, s = quantize_fp8(jax.random.normal(key, (Nout, K), jnp.float32) * 0.02)
        wb = fp8_gemm.dequantize_fp8(w, s, BF16)
        fp8_bytes = w.size + s.size * 4
        floor = fp8_bytes / bw
        for M in ms:
            x = jax.random.normal(jax.random.fold_in(key, M), (M, K), jnp.float32).astype(BF16)
            t_b, y_b = timed(jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(BF16)),
                             x, wb, iters=iters, warmup=warmup)
            t_x, y_x = timed(jax.jit(fp8_gemm.xla), x, w, s, iters=iters, warmup=warmup)
            cases = [("bf16", t_b, y_b, {}), ("xla", t_x, y_x, {})]
            for variant in ("w8a16", "w8a8"):
                with kernel_mode("pallas"):
                    p = fp8_gemm.pallas_plan(M, Nout, K, BF16, FP8, variant).params
                f = jax.jit(functools.partial(block_scaled_matmul, **p, interpret=interpret))
                tt, y = timed(f, x, w, s, iters=iters, warmup=warmup)
                cases.append((variant, tt, y, p))
            if TRITON:
                for i, c in enumerate(triton_gemm_grid(sweep)):
                    c = c or fp8_gemm.triton_params(M, Nout, K)
                    f = jax.jit(functools.partial(block_fp8_matmul, **c))
                    tt, y = timed(f, x, w, s, iters=iters, warmup=warmup)
                    cases.append(("tri" if i == 0 else "tri*", tt, y, c))
            if cublaslt_available()[0] and not cublaslt_check(Nout, K):  # cuBLASLt's block-scaled FP8 GEMM
                quant = act_quant_triton if TRITON else None
                tt, y = timed(jax.jit(functools.partial(cublaslt_fp8_matmul, quant=quant)), x, w, s,
                              iters=iters, warmup=warmup)
                cases.append(("cublt", tt, y, {}))
            y_x8 = jax.jit(functools.partial(fp8_gemm.xla, variant="w8a8"))(x, w, s)
            for path, tt, y, c in cases:
                err = rel(y, y_x8 if path in ("w8a8", "tri", "tri*", "cublt") else y_x) if (tt and t_x) else float("nan")
                ROWS.append(dict(kind="gemm", proj=name, K=K, N=Nout, M=M, path=path, us=tt and tt * 1e6,
                                 fp8_tbps=tt and fp8_bytes / tt / 1e12, floor_us=floor * 1e6, err_vs_xla=err,
                                 params=c))
                if not tt:
                    print(f"{name:>6} {K:>6} {Nout:>6} {M:>5} {path:>6}  failed: {y}")
                    continue
                ratio_b = f"{t_b / tt:6.2f}" if t_b else "     -"
                ratio_x = f"{t_x / tt:6.2f}" if t_x else "     -"
                print(f"{name:>6} {K:>6} {Nout:>6} {M:>5} {path:>6} {fmt_t(tt)} {fp8_bytes / tt / 1e12:8.2f} "
                      f"{floor * 1e6:8.1f} {ratio_b} {ratio_x} {err:10.2e}  {c}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("moe", "gemm"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 512], help="MoE tokens per expert")
    ap.add_argument("--m", type=int, nargs="+", default=[64, 256, 1024], help="GEMM rows")
    ap.add_argument("--sweep", action="store_true", help="also time alternative MoE FP8 block sizes")
    ap.add_argument("--triton-sweep", action="store_true",
                    help="also time alternative tiles of the Triton (jax-triton) W8A8 kernels")
    ap.add_argument("--layouts", action="store_true",
                    help="also the MoE with [E, in, out] weights (the layout before 2026-12-03f) and with the f16 dot")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode: checks the script on CPU")
    a = ap.parse_args()
    plat = common.platform()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {jax.default_backend()} ({plat}), device {dev.device_kind}, "
          f"compute capability {getattr(dev, 'compute_capability', '-')}")
    if plat == "cpu" and not a.smoke:
        print("Not on a GPU: the Pallas (Triton) kernels only run here in the interpreter, so nothing is timed.\n"
              "Run this on the GPU machine, or pass --smoke to check the script with tiny shapes.")
        return 0
    interpret = plat == "cpu"
    global TRITON
    ok, why = triton_available() if plat != "cpu" else (False, "on CPU: Triton's interpreter (--smoke only)")
    TRITON = ok or a.smoke and _has_triton_interpreter()
    print("Triton W8A8 kernels (path 'tri'): " + ("timed" if TRITON else f"not timed: {why}"))
    iters, warmup = (2, 1) if a.smoke else (a.iters, 3)
    if a.smoke:
        a.tokens, a.m, a.sweep, a.layouts = [3], [5], False, True
    bw = measure_copy_bandwidth(1 << 20) if a.smoke else measure_copy_bandwidth()
    print(f"measured: copy {bw / 1e12:.2f} TB/s (read + write)")
    if a.only in (None, "moe"):
        run_moe(a.tokens, bw, a.smoke, interpret, a.sweep, iters, warmup, a.layouts, a.triton_sweep)
    if a.only in (None, "gemm"):
        run_gemm(a.m, bw, a.smoke, interpret, iters, warmup, a.triton_sweep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(jax=jax.__version__, device=dev.device_kind, copy_tbps=bw / 1e12, rows=ROWS), f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
