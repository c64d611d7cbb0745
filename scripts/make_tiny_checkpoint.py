#!/usr/bin/env python
"""Write a random-weight DeepSeek-V2/V3 or Step3 checkpoint in HF layout (safetensors + config + tokenizer).

The weights are random: the model is for tests, demos and benchmarks, not for text.

  python scripts/make_tiny_checkpoint.py OUT --preset v3-tiny
  python scripts/make_tiny_checkpoint.py OUT --preset deepseek-v2-lite --set num_hidden_layers=4 --dtype bfloat16
  python scripts/make_tiny_checkpoint.py OUT --config my_config.json --fp8 --via numpy
  python scripts/make_tiny_checkpoint.py OUT --preset step3-tiny --via numpy   (Step3: numpy only)

Without --via it writes with transformers when torch and transformers can be imported (the test
extra), else with the NumPy writer (after `pip install -e .` alone), saying so on stderr.
"""

import argparse
import importlib
import json
import sys

from moejax.tiny.presets import PRESETS, preset


def _value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def missing_for_transformers() -> str | None:
    """The first module the transformers writer needs (torch, transformers) that cannot be imported; None: none."""
    for name in ("torch", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def choose_writer(via: str | None) -> str:
    """--via as given, or without it transformers if importable, else numpy (with a note on stderr).
    --via transformers without torch/transformers: SystemExit naming both ways out."""
    if via == "numpy":
        return via
    missing = missing_for_transformers()
    if missing is None:
        return "transformers"
    if via == "transformers":
        raise SystemExit(f"--via transformers needs {missing}, which cannot be imported: install the test extra "
                         f"(pip install -e \".[test]\") or write with --via numpy (no torch needed)")
    print(f"note: {missing} cannot be imported: writing with the NumPy writer (--via numpy)", file=sys.stderr)
    return "numpy"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default="v3-tiny", choices=sorted(PRESETS))
    src.add_argument("--config", help="an HF config.json to use instead of a preset")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config.json field (value parsed as JSON)")
    ap.add_argument("--via", choices=["transformers", "numpy"], default=None,
                    help="transformers: HF's own classes and save_pretrained (needs the test extra); "
                         "numpy: moejax's writer, no torch needed (default: transformers if torch and "
                         "transformers can be imported, else numpy)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--fp8", action="store_true", help="store projections as FP8 e4m3 with 128x128 block scales")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-mb", type=int, default=None, help="split into shards with an index file")
    a = ap.parse_args(argv)

    cfg = json.load(open(a.config)) if a.config else preset(a.preset)
    for kv in a.set:
        if "=" not in kv:
            ap.error(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        cfg[k] = _value(v)
    a.via = choose_writer(a.via)
    if a.via == "transformers":
        if cfg.get("model_type") in ("step3_text", "step3_vl"):
            ap.error(f"model_type {cfg['model_type']!r}: transformers has no Step3 class; use --via numpy")
        if a.dtype != "float32":
            ap.error("--via transformers writes float32; use --via numpy for bfloat16")
        from moejax.tiny.transformers_checkpoint import make_hf_checkpoint
        shard = f"{a.max_shard_mb}MB" if a.max_shard_mb else None
        make_hf_checkpoint(a.out, cfg, seed=a.seed, fp8=a.fp8, max_shard_size=shard)
    else:
        from moejax.tiny.checkpoint import make_random_checkpoint
        make_random_checkpoint(a.out, cfg, seed=a.seed, dtype=a.dtype, fp8=a.fp8,
                               max_shard_bytes=a.max_shard_mb and a.max_shard_mb << 20)
    print(f"wrote a random-weight {cfg['model_type']} checkpoint to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
