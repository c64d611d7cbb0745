"""Issue 18: is V2-Lite's decode step slower than on 2026-12-04's first run (23.0 -> 29.0 ms at c256)?
One process, interleaved: shared-expert fusion auto(on) / off, twice each; run in two processes, with
moejax's XLA flags (default) and with them turned off, to separate the two suspects."""
import argparse, json, os, statistics, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import moejax  # noqa: F401  (XLA flags)
import bench_decode as bd
from moejax.tiny.presets import preset, with_layers
L, C, tag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
orig = bd.random_model
FUSE = {"v": "auto"}
bd.random_model = lambda *x, **k: orig(*x, fuse_shared_experts=FUSE["v"], **k)
a = argparse.Namespace(concurrency=C, input_len=2000, output_len=14, warmup=2, steps=8, dtype="bfloat16",
                       fp8_variant="w8a16", kv_dtype="bf16", fill="random", memory=False)
hf = with_layers(preset("deepseek-v2-lite"), L)
res = []
for fuse in ("auto", "off", "auto", "off"):
    FUSE["v"] = fuse
    times, _, dev = bd.run_one(hf, "none", "auto", a, "bf16", device_steps=8)
    res.append({"fuse": fuse, "engine_ms": 1e3 * statistics.median(times), "device_ms": 1e3 * dev})
    print(f"{tag} L{L} c{C} fuse {fuse:>4}: engine step {res[-1]['engine_ms']:.3f} ms, device step {res[-1]['device_ms']:.3f} ms", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"fuse_{tag}.json"), "w"), indent=1)
