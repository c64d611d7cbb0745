#!/usr/bin/env python
"""Peak host memory of moejax.load on a multi-GB synthetic FP8 checkpoint (issue 16's streaming claim).

  python scripts/measure_load_memory.py --dir /tmp/fp8-ckpt   # writes the checkpoint once, then measures

The load runs in a child process that samples its own anonymous resident memory (RssAnon: what
the process allocated, not the checkpoint's file pages, which the kernel may drop) every 10 ms.
On CPU the "device" is host memory too, so the loaded parameters themselves are resident at the
end; the figure that matters is the peak above that: what the loader held besides the loaded model
(the leaves being assembled, conversion temporaries). Streaming bounds it by the largest leaf,
not by the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, os, sys, threading, time
import numpy as np
def rss_anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
peak = [0]
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], rss_anon()); time.sleep(0.01)
import jax, moejax
from moejax.weights.param_tree import flatten
base = rss_anon()
t = threading.Thread(target=sample, daemon=True); t.start()
t0 = time.time()
m = moejax.load(sys.argv[1], max_model_len=256, max_num_seqs=1, num_kv_blocks=16, progress=False,
                weight_dtype=sys.argv[2])
jax.block_until_ready(m.params)
stop = True; t.join()
leaves = flatten(m.params)
params = sum(a.nbytes for a in leaves.values())
largest = max(a.nbytes for a in leaves.values())
print(json.dumps({"base": base, "peak": max(peak[0], rss_anon()), "params": params, "largest_leaf": largest,
                  "load_s": time.time() - t0}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/moejax-fp8-load-ckpt")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from moejax.tiny.checkpoint import make_random_checkpoint
    from moejax.tiny.presets import preset, with_layers
    hf = with_layers(preset("deepseek-v3", vocab_size=32000, n_routed_experts=a.experts, n_group=8, topk_group=4,
                            num_nextn_predict_layers=0), a.layers)
    if not os.path.exists(os.path.join(a.dir, "config.json")):
        t0 = time.time()
        make_random_checkpoint(a.dir, hf, seed=0, dtype="bfloat16", fp8=True, max_shard_bytes=1 << 30)
        print(f"wrote {a.dir} in {time.time() - t0:.0f} s", flush=True)
    size = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir) if f.endswith(".safetensors"))
    out = {"checkpoint_bytes": size, "config": {k: hf[k] for k in ("num_hidden_layers", "n_routed_experts",
                                                                     "hidden_size", "moe_intermediate_size")}}
    for wd in ("auto", "bf16"):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        r = subprocess.run([sys.executable, "-c", CHILD, a.dir, wd], capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        m = json.loads(r.stdout.strip().splitlines()[-1])
        m["above_params"] = m["peak"] - m["base"] - m["params"]
        out[wd] = m
        print(f"weight_dtype={wd}: checkpoint {size / 1e9:.2f} GB, loaded params {m['params'] / 1e9:.2f} GB, "
              f"peak RssAnon {(m['peak'] - m['base']) / 1e9:.2f} GB above start = params + "
              f"{m['above_params'] / 1e9:.2f} GB (largest leaf {m['largest_leaf'] / 1e9:.2f} GB), "
              f"{m['load_s']:.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
