#!/usr/bin/env python
"""OpenAI-compatible HTTP server for moejax (continuous batching; prefill and decode run as separate steps).

  python scripts/serve.py                                # the embedded tiny RANDOM-weight model
  python scripts/serve.py --model /path/to/DeepSeek-V2-Lite --port 8000
  python scripts/serve.py --model /path/to/DeepSeek-V3 --parallel dp8-ep8 --kernels auto --kv-cache-dtype fp8

Several processes (one per GPU or group of devices; docs/multiprocess.md):

  python -m moejax.launch --nproc 8 -- scripts/serve.py --model /path/to/DeepSeek-V3 --parallel dp8-ep8

Process 0 is the HTTP front end and forwards each engine step to the others, which step with it.
A process that dies makes /health answer 503 and the server exit non-zero within --peer-timeout s.

Endpoints: /v1/completions, /v1/chat/completions (SSE streaming, stream_options.include_usage),
/v1/models, /health, /metrics (Prometheus, vLLM metric names + moejax decode-only throughput).

The server uses aiohttp: one dependency gives both the server and the benchmark's
streaming client (scripts/bench_serve.py), as `vllm bench serve` uses aiohttp too.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint directory (default: the embedded tiny random model)")
    ap.add_argument("--served-model-name", help="the name clients use (default: the --model argument)")
    ap.add_argument("--parallel", help="parallel layout, passed to moejax.load: dp{N}-ep{N} (e.g. dp8-ep8), a "
                                       "shipped layout (e.g. dp8-ep8-eplb) or a path to a .yaml file")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="auto: the model dtype; fp8: e4m3 rows with a per-row scale (DeepSeek MLA only)")
    ap.add_argument("--kernels", choices=["auto", "pallas", "xla"], default="auto",
                    help="auto: Pallas on GPU, XLA on CPU")
    ap.add_argument("--weight-dtype", choices=["auto", "fp8", "bf16"], default="auto",
                    help="auto: an FP8 checkpoint stays FP8 on the GPU; fp8: also quantise a bf16 checkpoint "
                         "(128x128 blocks); bf16: dequantise")
    ap.add_argument("--fp8-layers", default="default",
                    help="layer types that run FP8: default, or a comma list of experts, shared_experts, "
                         "dense_mlp, attention, lm_head")
    ap.add_argument("--fp8-variant", choices=["w8a16", "w8a8"], default="w8a16")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV cache blocks per rank (default: max-num-seqs x max-model-len, within the memory that "
                         "--gpu-memory-utilization leaves)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="share of the device's memory (weights, cache, a reserve for the step) the cache is "
                         "sized to fill when --num-kv-blocks is not given; on CPU the cache is 2 GiB at most")
    ap.add_argument("--max-preemptions", type=int, default=16,
                    help="a request preempted more often than this is ended with an error (503) instead of "
                         "being recomputed again")
    ap.add_argument("--max-prefill-tokens", type=int, default=8192,
                    help="tokens of one prefill step; longer prompts are prefilled in chunks")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the KV blocks of a prompt's longest cached prefix (vLLM's automatic prefix caching)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                    help="build decode step t+1 while step t runs, reading t's tokens one step late (vLLM's async "
                         "scheduling; off by default: slower than the synchronous loop in its first H200 run)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds SIGTERM/SIGINT lets requests in flight finish before aborting them (exit 0)")
    ap.add_argument("--api-key", default=os.environ.get("MOEJAX_API_KEY"),
                    help="require 'Authorization: Bearer <key>' on /v1/* (default: $MOEJAX_API_KEY; none: open)")
    ap.add_argument("--allowed-origins", default="",
                    help="comma list of browser origins allowed by CORS (e.g. http://localhost:3000, or *); "
                         "default none: cross-origin requests are refused")
    ap.add_argument("--max-request-mb", type=float, default=32.0, help="request bodies above this get 413")
    ap.add_argument("--peer-timeout", type=float, default=10.0,
                    help="multi-process: seconds without a heartbeat after which process 0 declares another "
                         "process dead (/health 503, exit 1)")
    return ap


def build_load_kwargs(a: argparse.Namespace) -> dict:
    """moejax.load's keyword arguments from the parsed command line."""
    return dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, block_size=a.block_size,
                num_kv_blocks=a.num_kv_blocks, max_prefill_tokens=a.max_prefill_tokens, parallel=a.parallel,
                kv_cache_dtype=a.kv_cache_dtype, kernels=a.kernels, weight_dtype=a.weight_dtype,
                fp8_layers=a.fp8_layers, fp8_variant=a.fp8_variant, enable_prefix_caching=a.enable_prefix_caching,
                gpu_memory_utilization=a.gpu_memory_utilization, max_preemptions=a.max_preemptions,
                async_scheduling=a.async_scheduling)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)

    import asyncio

    import moejax
    from moejax.engine.replicated import LeaderEngine
    from moejax.parallel import peer_watch, processes
    from moejax.parallel.step_channel import StepChannel
    from moejax.server.access import AccessPolicy
    from moejax.server.app import make_app
    from moejax.server.lifecycle import Server

    kw = build_load_kwargs(a)
    path, name = a.model, a.served_model_name
    if path is None:
        from moejax.tiny.default_model import default_model_path
        path = default_model_path()
        name = name or "moejax-tiny-random"
        print(f"No --model given: serving the embedded tiny DeepSeek-V3-architecture model with RANDOM weights "
              f"({path}) as {name!r}; its output is gibberish.", flush=True)
    if not a.peer_timeout > 0:
        raise SystemExit(f"--peer-timeout must be > 0 seconds, got {a.peer_timeout}")
    multi = processes.initialize_from_env()
    if multi and not processes.is_leader():
        return follow_leader(path, kw)
    model = moejax.load(path, **kw)
    engine = LeaderEngine(model.engine, StepChannel()) if multi else None
    origins = tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip())
    policy = AccessPolicy(api_key=a.api_key or None, allowed_origins=origins, bind_host=a.host)
    app, aengine = make_app(model, name or a.model, extra_names=(a.model,) if a.model else (), policy=policy,
                            max_body_bytes=int(a.max_request_mb * (1 << 20)), engine=engine)
    if multi:
        peer_watch.watch(aengine.fail, a.peer_timeout)
    print(f"Serving {name or a.model} on http://{a.host}:{a.port}  (max_model_len={model.max_model_len}, "
          f"KV blocks={model.engine.blocks.num_blocks} x {model.block_size}"
          f"{f', {processes.count()} processes' if multi else ''})", flush=True)
    code = asyncio.run(Server(app, a.host, a.port, shutdown_timeout=a.shutdown_timeout).run())
    if multi and code == 0:
        engine.stop_followers()
    elif multi:
        # A process died: the engine thread may be stuck in a collective with it, and jax.distributed's
        # shutdown barrier would wait for it. Exit now, non-zero, as a one-process server would.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    return code


def follow_leader(path: str, kw: dict) -> int:
    """A process other than 0: loads its shards, then steps whatever process 0's engine steps."""
    import moejax
    from moejax.engine.replicated import follow
    from moejax.parallel import peer_watch
    from moejax.parallel.step_channel import StepChannel
    stop = peer_watch.start_beating()
    model = moejax.load(path, **kw)
    follow(model.engine, StepChannel())
    stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
