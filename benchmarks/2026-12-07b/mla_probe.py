"""Probe (device only, torch + Triton, one-off): where the Triton MLA decode kernel
(pallas_kernels/triton_mla_decode.py) loses against its floor at DeepSeek-V3's 128 heads, and whether FP8
tensor-core dots over an FP8 cache (FlashMLA's FP8 mode: the query quantised to e4m3 a (row, head), the
probabilities quantised to e4m3 for the value dot) pay.

Prints per variant: registers and spills of the compiled kernel, the TTGIR's warp-group (wgmma) dots and
async copies, the time (triton.testing.do_bench), TFLOP/s, and the error against a float32 torch
reference of the same (dequantised) cache. The kernel body is the production kernel's, with two constexpr
switches added (QMODE: the score dots, PMODE: the value dot: bf16 / one e4m3 dot / two e4m3 dots).
--smoke checks the bf16 variants only: Triton 3.6's interpreter rounds float -> e4m3 casts unlike torch.

    python benchmarks/2026-12-07b/mla_probe.py [512x2048 64x8192 ...] [out.json]
    TRITON_INTERPRET=1 python benchmarks/2026-12-07b/mla_probe.py --smoke   # CPU: the variants' numerics only
"""

import itertools
import json
import sys

import torch
import triton
import triton.language as tl

SMOKE = "--smoke" in sys.argv
DEV = "cpu" if SMOKE else "cuda"
MODEL_DT = torch.float32 if SMOKE else torch.bfloat16  # bf16 values either way

LOG2E = 1.4426950408889634


@triton.jit
def _split8(x):
    """x (in e4m3's range) as hi + lo / 16, both e4m3: two FP8 dots give about bf16's precision."""
    hi = x.to(tl.float8e4nv)
    lo = ((x - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    return hi, lo


@triton.jit
def mla_kernel(ql_ptr, qr_ptr, qs_ptr, cache_ptr, bt_ptr, end, o_ptr,  # every sequence `end` tokens here
               M: tl.constexpr, C: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
               BS: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, QK_SCALE: tl.constexpr,
               FP8: tl.constexpr, SCALE_COL: tl.constexpr, QMODE: tl.constexpr, PMODE: tl.constexpr,
               NT: tl.constexpr, F32: tl.constexpr):
    # QMODE / PMODE (FP8 cache only): 0 the dot in bf16 (the cache tile widened), 1 one e4m3 dot (the
    # query / probabilities quantised), 2 two e4m3 dots (hi + lo, about bf16's precision).
    hb = tl.program_id(0)
    b = tl.program_id(1)
    offs_h = hb * BH + tl.arange(0, BH)
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    q_row = (b * M + offs_h).to(tl.int64)
    cdt = tl.float32 if F32 else tl.bfloat16  # float32 in --smoke: the interpreter's bf16 dot is wrong on CPU
    q = tl.load(ql_ptr + q_row[:, None] * C + offs_c[None, :])
    qr = tl.load(qr_ptr + q_row[:, None] * R + offs_r[None, :])
    if QMODE > 0:
        qscale = tl.load(qs_ptr + q_row)  # q / qscale within e4m3's range
        qf = q.to(tl.float32) / qscale[:, None]
        qrf = qr.to(tl.float32) / qscale[:, None]
        if QMODE == 1:
            q_hi = qf.to(tl.float8e4nv)
            qr_hi = qrf.to(tl.float8e4nv)
        else:
            q_hi, q_lo = _split8(qf)
            qr_hi, qr_lo = _split8(qrf)
        qscale = qscale * QK_SCALE
    else:
        q = q.to(cdt)
        qr = qr.to(cdt)
    m = tl.full((BH,), -1e30, tl.float32)
    l = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, C), tl.float32)
    offs_n = tl.arange(0, BN)
    for i in range(0, NT):
        t = i * BN + offs_n
        valid = t < end
        page = tl.load(bt_ptr + b * NB + t // BS, mask=valid, other=0)
        row = cache_ptr + (page.to(tl.int64) * BS + t % BS) * D
        if FP8:
            k8 = tl.load(row[:, None] + offs_c[None, :], mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            kr8 = tl.load(row[:, None] + C + offs_r[None, :], mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            byte = tl.load(row + SCALE_COL, mask=valid, other=127)
            row_scale = tl.exp2(byte.to(tl.float32) - 127.0)
            if QMODE == 0:
                sc = tl.dot(q, tl.trans(k8.to(cdt))) + tl.dot(qr, tl.trans(kr8.to(cdt)))
                sc = sc * (row_scale * QK_SCALE)[None, :]
            else:
                sc = tl.dot(q_hi, tl.trans(k8)) + tl.dot(qr_hi, tl.trans(kr8))
                if QMODE == 2:
                    sc += (tl.dot(q_lo, tl.trans(k8)) + tl.dot(qr_lo, tl.trans(kr8))) * 0.0625
                sc = sc * qscale[:, None] * row_scale[None, :]
        else:
            k = tl.load(row[:, None] + offs_c[None, :], mask=valid[:, None], other=0.0).to(cdt)
            kr = tl.load(row[:, None] + C + offs_r[None, :], mask=valid[:, None], other=0.0).to(cdt)
            sc = tl.dot(q, tl.trans(k)) + tl.dot(qr, tl.trans(kr))
            sc = sc * QK_SCALE
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if FP8:
            if PMODE == 0:
                acc = acc * alpha[:, None] + tl.dot((p * row_scale[None, :]).to(cdt), k8.to(cdt))
            else:
                smax = tl.max(row_scale, 0)
                pf = p * (row_scale / smax)[None, :]
                if PMODE == 1:
                    pv = tl.dot(pf.to(tl.float8e4nv), k8)
                else:
                    p_hi, p_lo = _split8(pf)
                    pv = tl.dot(p_hi, k8) + tl.dot(p_lo, k8) * 0.0625
                acc = acc * alpha[:, None] + pv * smax
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(cdt), k)
        m = m_new
    out = acc / l[:, None]
    tl.store(o_ptr + q_row[:, None] * C + offs_c[None, :], out)


def make(B, H, T, fp8, seed, C=512, R=64, BS=16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    NB = T // BS
    pages = B * NB
    vals = torch.randn(pages * BS, C + R, device=DEV, generator=g)
    if fp8:
        D = -(-(C + R + 1) // 16) * 16
        amax = vals.abs().amax(-1, keepdim=True)
        e = torch.ceil(torch.log2(amax / 448.0))
        q8 = (vals * torch.exp2(-e)).clamp(-448, 448).to(torch.float8_e4m3fn)
        cache = torch.zeros(pages * BS, D, dtype=torch.uint8, device=DEV)
        cache[:, :C + R] = q8.view(torch.uint8)
        cache[:, C + R] = (e[:, 0] + 127).to(torch.uint8)
        deq = q8.float() * torch.exp2(e)
    else:
        D = C + R
        cache = vals.to(torch.bfloat16).to(MODEL_DT)
        deq = cache.float()
    bt = torch.randperm(pages, device=DEV, generator=g).to(torch.int32).reshape(B, NB)
    lens = torch.full((B,), T, dtype=torch.int32, device=DEV)
    ql = torch.randn(B, H, C, device=DEV, generator=g).to(torch.bfloat16).to(MODEL_DT)
    qr = torch.randn(B, H, R, device=DEV, generator=g).to(torch.bfloat16).to(MODEL_DT)
    return dict(cache=cache, deq=deq, bt=bt, lens=lens, ql=ql, qr=qr, D=D, NB=NB, C=C, R=R, BS=BS)


def reference(d, scale, nref=8):
    """float32 attention of the first ``nref`` sequences over the dequantised cache."""
    outs = []
    for b in range(nref):
        slots = (d["bt"][b].long()[:, None] * d["BS"] + torch.arange(d["BS"], device=DEV)).reshape(-1)
        kv = d["deq"][slots]
        lat, rope = kv[:, :d["C"]], kv[:, d["C"]:]
        s = (d["ql"][b].float() @ lat.T + d["qr"][b].float() @ rope.T) * scale
        outs.append(torch.softmax(s, -1) @ lat)
    return torch.stack(outs)


def run(d, H, fp8, qmode, pmode, BH, BN, warps, stages, scale):
    B = d["ql"].shape[0]
    C, R = d["C"], d["R"]
    ql, qr = d["ql"], d["qr"]
    # A (row, head)'s scale: its largest magnitude at 224 (hi + lo: lo = 16 x the residual stays in range).
    qs = (torch.cat([ql.float(), qr.float()], -1).abs().amax(-1) / 224.0).clamp_min(1e-30).reshape(-1).contiguous()
    o = torch.zeros(B, H, C, device=DEV, dtype=torch.float32)
    grid = (H // BH, B)
    kw = dict(M=H, C=C, R=R, D=d["D"], NB=d["NB"], BS=d["BS"], BH=BH, BN=BN, QK_SCALE=scale * LOG2E, FP8=fp8,
              SCALE_COL=C + R, QMODE=qmode, PMODE=pmode, F32=SMOKE, NT=-(-int(d["lens"][0]) // BN), num_warps=warps, num_stages=stages)
    fn = lambda: mla_kernel[grid](ql, qr, qs, d["cache"], d["bt"], int(d["lens"][0]), o, **kw)  # noqa: E731
    k = fn()
    if SMOKE:
        return o, 0.0, {}
    torch.cuda.synchronize()
    ttgir = k.asm.get("ttgir", "")
    info = dict(regs=k.n_regs, spills=k.n_spills, wgmma=ttgir.count("warp_group_dot"),
                async_copy=ttgir.count("async_copy_global_to_local"), smem=k.metadata.shared)
    ms = triton.testing.do_bench(fn, warmup=10, rep=50)
    return o, ms, info


def main():
    torch.manual_seed(0)
    H, scale, seed = (64 if SMOKE else 128), 0.1352, 1234
    if not SMOKE:
        a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
        mm = triton.testing.do_bench(lambda: a @ a, warmup=5, rep=30)
        rate = 2 * 8192 ** 3 / mm / 1e9
        print(f"{torch.cuda.get_device_name()} triton {triton.__version__} bf16 matmul {rate:.0f} TFLOP/s", flush=True)
    rows = []
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a and not a.startswith("-")]
    for B, T in ((8, 64),) if SMOKE else (shapes or ((512, 2048), (64, 8192))):
        for fp8 in (False, True):
            d = make(B, H, T, fp8, seed)
            ref = reference(d, scale)
            flops = B * H * T * (2 * (d["C"] + d["R"]) + 2 * d["C"])
            variants = [(0, 0)] if not fp8 else [(0, 0), (2, 0), (2, 2), (1, 1), (2, 1)]
            if "--warps16" in sys.argv:  # 4 warpgroups: the [64, 512] accumulator a quarter a warpgroup
                variants = [(0, 0)]
            for (qmode, pmode), BN, (warps, stages) in itertools.product(
                    variants, (32, 64), ((8, 1),) if SMOKE else
                    ((16, 1), (16, 2), (16, 3)) if "--warps16" in sys.argv else ((8, 1), (8, 2), (8, 3))):
                try:
                    o, ms, info = run(d, H, fp8, qmode, pmode, 64, BN, warps, stages, scale)
                except Exception as e:  # a variant Triton cannot compile or fit: say so, go on
                    print(f"B={B} T={T} fp8={fp8} qmode={qmode} pmode={pmode} BN={BN} w={warps} s={stages}: "
                          f"FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                err = ((o[:8] - ref).abs().max() / ref.abs().max()).item()
                r = dict(B=B, T=T, fp8=fp8, qmode=qmode, pmode=pmode, BN=BN, warps=warps, stages=stages,
                         us=ms * 1e3, tflops=flops / ms / 1e9 if ms else 0.0, rel_err=err, **info)
                rows.append(r)
                print(json.dumps(r), flush=True)
            del d
            torch.cuda.empty_cache()
    out = [a for a in sys.argv[1:] if a.endswith(".json")]
    json.dump(rows, open(out[0] if out else "/tmp/mla_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main()
