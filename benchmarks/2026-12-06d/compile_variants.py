"""Compiles the Triton MLA decode kernel for sm_90a on this (GPU-less) machine at several tilings and row
counts and prints what ptxas reports: registers, spills, shared memory, the wgmma shapes. No device time.

    TRITON_INTERPRET=0 python benchmarks/2026-12-06d/compile_variants.py
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels import triton_mla_decode as T  # noqa: E402

VARIANTS = json.loads(sys.argv[1]) if len(sys.argv) > 1 else [
    dict(H=128, ROWS=1, BH=64, BN=64, warps=8, stages=2),
    dict(H=128, ROWS=2, BH=64, BN=64, warps=8, stages=2),
    dict(H=16, ROWS=1, BH=16, BN=64, warps=4, stages=2),
    dict(H=16, ROWS=4, BH=64, BN=64, warps=8, stages=2),
]
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
for v in VARIANTS:
    for cache, ty, D in (("bf16", "*bf16", 576), ("fp8", "*fp8e4nv", 592)):
        sig = dict(ql_ptr="*bf16", qr_ptr="*bf16", cache_ptr=ty, bt_ptr="*i32", len_ptr="*i32", o_ptr="*bf16",
                   lse_ptr="*fp32")
        M = v["H"] * v["ROWS"]
        consts = dict(H=v["H"], M=M, MP=-(-M // v["BH"]) * v["BH"], ROWS=v["ROWS"], C=512, R=64, D=D, NB=128, BS=16,
                      LAYER_ROWS=60 * 2 ** 20, SPLIT_LEN=2048, NUM_SPLITS=1, BH=v["BH"], BN=v["BN"], QK_SCALE=0.1,
                      FP8=cache == "fp8", SCALE_COL=576)
        consts.update(v.get("extra", {}))
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(7)}
        src = ASTSource(T._mla_decode_kernel.get(False), dict(sig, **{c: "constexpr" for c in consts}), consts, aligned)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=v["warps"],
                                                                               num_stages=v["stages"]))
        d = tempfile.mkdtemp()
        open(d + "/k.ptx", "w").write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", d + "/k.ptx", "-o", d + "/k.cubin"],
                           capture_output=True, text=True)
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
        wg = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", k.asm["ptx"])))
        print(f"{json.dumps(v)} {cache}: regs {regs} spills {spills} shared {k.metadata.shared} wgmma {wg}")
