#!/usr/bin/env python
"""OpenAI-compatible HTTP server for moejax (continuous batching; prefill and decode run as separate steps).

  python scripts/serve.py                                # the embedded tiny RANDOM-weight model
  python scripts/serve.py --model /path/to/DeepSeek-V2-Lite --port 8000

Endpoints: /v1/completions, /v1/chat/completions (SSE streaming, stream_options.include_usage),
/v1/models, /health, /metrics (Prometheus, vLLM metric names + moejax decode-only throughput).

The server uses aiohttp: one dependency gives both the server and the benchmark's
streaming client (scripts/bench_serve.py), as `vllm bench serve` uses aiohttp too.
"""

import argparse
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint directory (default: the embedded tiny random model)")
    ap.add_argument("--served-model-name", help="the name clients use (default: the --model argument)")
    ap.add_argument("--parallel", help="a parallelism config (configs/...), passed to moejax.load when supported")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    a = ap.parse_args(argv)

    import moejax
    from aiohttp import web

    from moejax.server.app import make_app

    kw = dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, block_size=a.block_size,
              num_kv_blocks=a.num_kv_blocks, max_prefill_tokens=a.max_prefill_tokens)
    if a.parallel:
        if "parallel" not in inspect.signature(moejax.load).parameters:
            ap.error("--parallel: expert parallelism is not yet available in this moejax (moejax.load has no "
                     "'parallel' argument)")
        kw["parallel"] = a.parallel
    path, name = a.model, a.served_model_name
    if path is None:
        from moejax.tiny.default_model import default_model_path
        path = default_model_path()
        name = name or "moejax-tiny-random"
        print(f"No --model given: serving the embedded tiny DeepSeek-V3-architecture model with RANDOM weights "
              f"({path}) as {name!r}; its output is gibberish.", flush=True)
    model = moejax.load(path, **kw)
    app, aengine = make_app(model, name or a.model, extra_names=(a.model,) if a.model else ())
    print(f"Serving {name or a.model} on http://{a.host}:{a.port}  (max_model_len={model.max_model_len}, "
          f"KV blocks={model.engine.blocks.num_blocks} x {model.block_size})", flush=True)
    web.run_app(app, host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
