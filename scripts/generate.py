#!/usr/bin/env python
"""Generate text with moejax. Without --model it uses the embedded default: a tiny
DeepSeek-V3-architecture model with RANDOM weights, built on the spot (its text is gibberish).

  python scripts/generate.py
  python scripts/generate.py --model /path/to/DeepSeek-V2-Lite --prompt "Hello" --max-new-tokens 64
  python scripts/generate.py --model deepseek-v2-lite --load-format dummy   # RANDOM weights at its real shapes
  python -m moejax.launch --nproc 8 -- scripts/generate.py --model /path/to/DeepSeek-V3 --parallel dp8-ep8

Several processes (python -m moejax.launch): every process generates the same, process 0 prints.
Every engine setting is a flag (moejax/engine_args.py: --dtype, --max-model-len, --parallel, --kernels, ...).
"""

import argparse
import time

import jax

import moejax
from moejax.engine_args import EngineArgs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint directory (default: the tiny random model)")
    ap.add_argument("--prompt", action="append", help="may be repeated (default: three sample prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    EngineArgs.add_cli_args(ap)
    a = ap.parse_args(argv)

    path = a.model
    if path is None:
        from moejax.tiny.default_model import default_model_path
        path = default_model_path()
        print(f"No --model given: using the embedded tiny DeepSeek-V3-architecture model with RANDOM weights "
              f"({path}); expect gibberish.")
    elif a.load_format == "dummy":
        print(f"--load-format dummy: {path!r} with RANDOM weights (not read from any checkpoint); expect gibberish.")
    model = moejax.load(path, **EngineArgs.from_cli_args(a).kwargs())
    prompts = a.prompt or ["The capital of France is", "def fibonacci(n):", "Mixture-of-Experts models"]
    t0 = time.perf_counter()
    results = moejax.generate(model, prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                              top_p=a.top_p, top_k=a.top_k, seed=a.seed, progress=True)
    dt = time.perf_counter() - t0
    if jax.process_index() != 0:  # the same results in every process of a multi-process job
        return
    for p, r in zip(prompts, results):
        print(f"\n### {p!r}\n{r.text!r}\n[{len(r.token_ids)} tokens, finish_reason={r.finish_reason}]")
    s = model.engine.stats
    print(f"\n{sum(len(r.token_ids) for r in results)} tokens in {dt:.2f}s (first run includes compilation); "
          f"decode-only: {s.decode_tokens} tokens in {s.decode_time:.2f}s")


if __name__ == "__main__":
    main()
