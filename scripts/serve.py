#!/usr/bin/env python
"""OpenAI-compatible HTTP server for moejax (continuous batching; prefill and decode run as separate steps).

  python scripts/serve.py                                # the embedded tiny RANDOM-weight model
  python scripts/serve.py --model /path/to/DeepSeek-V2-Lite --port 8000
  python scripts/serve.py --model /path/to/DeepSeek-V3 --parallel dp8-ep8 --kernels auto --kv-cache-dtype fp8
  python scripts/serve.py --model deepseek-v3 --load-format dummy --weight-dtype fp8 --parallel dp8-ep8   # RANDOM

Several processes (one per GPU or group of devices; docs/multiprocess.md):

  python -m moejax.launch --nproc 8 -- scripts/serve.py --model /path/to/DeepSeek-V3 --parallel dp8-ep8

Process 0 is the HTTP front end and forwards each engine step to the others, which step with it.
A process that dies makes /health answer 503 and the server exit non-zero within --peer-timeout s.

Prefill/decode disaggregation (docs/disaggregation.md): worker processes of two roles, each with its own
devices and parallel layout, one OpenAI front end routing requests (prefill worker, then decode worker;
the latent KV cache moved between them by jax.experimental.transfer):

  python scripts/serve.py --model /path/to/DeepSeek-V3 --disaggregated --prefill-workers 1 --decode-workers 1 \
      --prefill-parallel dp4-ep4 --prefill-devices 0,1,2,3 --decode-parallel dp4-ep4 --decode-devices 4,5,6,7

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
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="auto: the checkpoint's weights; dummy: RANDOM weights made on the device at the model's "
                         "shapes (vLLM's --load-format dummy): --model is then a directory holding a config.json "
                         "or a preset name (deepseek-v3, deepseek-v2-lite, step3, v3-tiny, ...)")
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
    ap.add_argument("--fp8-variant", choices=["auto", "w8a16", "w8a8"], default="auto")
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
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="build decode step t+1 while step t runs, reading t's tokens one step late (vLLM's async "
                         "scheduling; on by default: --no-async-scheduling reads every step before building the next)")
    ap.add_argument("--scheduling-policy", type=_scheduling_policy, default="prefill-first",
                    help="when a prefill step may run while sequences decode: prefill-first (whenever a prompt "
                         "waits and fits: throughput), interleave:N (at most N prefill steps in a row, then a "
                         "decode step), token-budget:T (at most T prompt tokens between two decode steps); "
                         "docs/serving.md")
    ap.add_argument("--speculative-config", type=_json_object, default=None,
                    help="speculative decoding, as vLLM's: '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}' "
                         "(the checkpoint's MTP layer drafts k tokens a step; docs/serving.md)")
    ap.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                    help="compile every program the engine can run (decode, prefill and sampling buckets) before "
                         "/health answers 200, so no request compiles anything (default on)")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX's persistent compilation cache, so a restart loads its programs (default: "
                         "$MOEJAX_COMPILATION_CACHE_DIR, else ~/.cache/moejax/jax on a GPU (off on CPU); 'off' disables it)")
    ap.add_argument("--shutdown-timeout", type=float, default=20.0,
                    help="seconds SIGTERM/SIGINT lets requests in flight finish before aborting them (exit 0); "
                         "the default (lifecycle.DEFAULT_SHUTDOWN_TIMEOUT_S) exits within 25 s, inside "
                         "Kubernetes' default 30 s grace period")
    ap.add_argument("--api-key", default=os.environ.get("MOEJAX_API_KEY"),
                    help="require 'Authorization: Bearer <key>' on /v1/* (default: $MOEJAX_API_KEY; none: open)")
    ap.add_argument("--allowed-origins", default="",
                    help="comma list of browser origins allowed by CORS (e.g. http://localhost:3000, or *); "
                         "default none: cross-origin requests are refused")
    ap.add_argument("--max-request-mb", type=float, default=32.0, help="request bodies above this get 413")
    ap.add_argument("--peer-timeout", type=float, default=10.0,
                    help="multi-process: seconds without a heartbeat after which process 0 declares another "
                         "process dead (/health 503, exit 1)")
    d = ap.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    d.add_argument("--disaggregated", action="store_true",
                   help="start prefill and decode worker processes and serve as their router")
    d.add_argument("--prefill-workers", type=int, default=1)
    d.add_argument("--decode-workers", type=int, default=1)
    d.add_argument("--prefill-parallel", help="each prefill worker's parallel layout (default: --parallel)")
    d.add_argument("--decode-parallel", help="each decode worker's parallel layout (default: --parallel)")
    d.add_argument("--prefill-block-size", type=int, help="prefill workers' KV block size (default: --block-size)")
    d.add_argument("--decode-block-size", type=int, help="decode workers' KV block size (default: --block-size)")
    d.add_argument("--prefill-devices", default="",
                   help="devices of each prefill worker, ';' between workers (e.g. '0,1;2,3'): its "
                        "CUDA_VISIBLE_DEVICES; default: every worker sees every device")
    d.add_argument("--decode-devices", default="", help="the same for decode workers")
    d.add_argument("--prefill-urls", default="",
                   help="comma list of prefill workers started elsewhere (scripts/serve.py --role prefill --host H "
                        "--port P, on any host), used instead of starting --prefill-workers")
    d.add_argument("--decode-urls", default="", help="the same for decode workers")
    d.add_argument("--kv-pull-timeout", type=float, default=30.0,
                   help="seconds a decode worker's pull of a request's KV cache may take; later, the request is "
                        "prefilled again")
    d.add_argument("--worker-start-timeout", type=float, default=900.0,
                   help="seconds a worker may take to load and answer")
    d.add_argument("--role", choices=["prefill", "decode"],
                   help="serve as a disaggregated worker of this role (the router starts them; or start one "
                        "yourself and give its URL to the router's --prefill-urls / --decode-urls)")
    d.add_argument("--inject-kv-transfer-failures", type=int, default=0, help=argparse.SUPPRESS)  # tests
    return ap


def _scheduling_policy(spec: str) -> str:
    """--scheduling-policy's value, checked as moejax.load checks it: a bad one is a usage error."""
    from moejax.engine.scheduling_policy import canonical
    try:
        return canonical(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict:
    """--speculative-config's value: a JSON object (its fields are checked by moejax.load)."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def build_load_kwargs(a: argparse.Namespace) -> dict:
    """moejax.load's keyword arguments from the parsed command line."""
    return dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, block_size=a.block_size,
                num_kv_blocks=a.num_kv_blocks, max_prefill_tokens=a.max_prefill_tokens, parallel=a.parallel,
                kv_cache_dtype=a.kv_cache_dtype, kernels=a.kernels, weight_dtype=a.weight_dtype,
                fp8_layers=a.fp8_layers, fp8_variant=a.fp8_variant, enable_prefix_caching=a.enable_prefix_caching,
                gpu_memory_utilization=a.gpu_memory_utilization, max_preemptions=a.max_preemptions,
                async_scheduling=a.async_scheduling, scheduling_policy=a.scheduling_policy,
                load_format=a.load_format, compilation_cache_dir=a.compilation_cache_dir,
                speculative_config=a.speculative_config)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    import logging
    handler = logging.StreamHandler()  # moejax's own lines (one per program compiled at start-up), not aiohttp's
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger("moejax").addHandler(handler)
    logging.getLogger("moejax").setLevel(logging.INFO)
    logging.getLogger("moejax").propagate = False

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
    elif a.load_format == "dummy":
        print(f"--load-format dummy: serving {path!r} with RANDOM weights (made on the device, not read from any "
              f"checkpoint); its output is gibberish.", flush=True)
    if not a.peer_timeout > 0:
        raise SystemExit(f"--peer-timeout must be > 0 seconds, got {a.peer_timeout}")
    if a.disaggregated:
        return serve_disaggregated(a, path, name or a.model or path)
    if a.role is not None:
        return serve_worker(a, path, name or a.model or path, kw)
    multi = processes.initialize_from_env()
    if multi and not processes.is_leader():
        return follow_leader(path, kw, a.precompile)
    model = moejax.load(path, **kw)
    engine = LeaderEngine(model.engine, StepChannel()) if multi else None
    origins = tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip())
    policy = AccessPolicy(api_key=a.api_key or None, allowed_origins=origins, bind_host=a.host)
    app, aengine = make_app(model, name or a.model, extra_names=(a.model,) if a.model else (), policy=policy,
                            max_body_bytes=int(a.max_request_mb * (1 << 20)), engine=engine, precompile=a.precompile)
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


def serve_worker(a: argparse.Namespace, path: str, name: str, kw: dict) -> int:
    """A disaggregated worker (started by the router): its own engine, the colocated app plus the internal
    routes (moejax/server/worker.py)."""
    import asyncio

    import moejax
    from moejax.engine.kv_transfer import KVTransfer
    from moejax.server.access import AccessPolicy
    from moejax.server.app import make_app
    from moejax.server.lifecycle import Server
    from moejax.server.worker import WorkerConfig, add_worker_routes
    if int(os.environ.get("MOEJAX_NUM_PROCESSES") or 1) > 1:
        raise SystemExit("a disaggregated worker is one process (with any number of devices): worker groups of "
                         "several processes (moejax.launch --nproc > 1) are not supported yet")
    model = moejax.load(path, **kw)
    xfer = KVTransfer(host=a.host)
    app, _ = make_app(model, name, policy=AccessPolicy(bind_host=a.host), precompile=a.precompile)
    add_worker_routes(app, WorkerConfig(a.role, a.kv_pull_timeout, a.inject_kv_transfer_failures), xfer,
                      model.max_model_len, model.config.model.vocab_size)
    print(f"{a.role} worker on http://{a.host}:{a.port}, KV transfer server {xfer.address}", flush=True)
    return asyncio.run(Server(app, a.host, a.port, shutdown_timeout=a.shutdown_timeout).run())


def worker_argv(a: argparse.Namespace, role: str, port: int) -> list[str]:
    """A worker's command line: the router's model and engine options, its role's layout and block size."""
    parallel = (a.prefill_parallel if role == "prefill" else a.decode_parallel) or a.parallel
    block = (a.prefill_block_size if role == "prefill" else a.decode_block_size) or a.block_size
    argv = ["--role", role, "--host", "127.0.0.1", "--port", str(port), "--dtype", a.dtype,
            "--max-num-seqs", str(a.max_num_seqs), "--block-size", str(block), "--kv-cache-dtype", a.kv_cache_dtype,
            "--kernels", a.kernels, "--weight-dtype", a.weight_dtype, "--fp8-layers", a.fp8_layers,
            "--fp8-variant", a.fp8_variant, "--gpu-memory-utilization", str(a.gpu_memory_utilization),
            "--max-preemptions", str(a.max_preemptions), "--max-prefill-tokens", str(a.max_prefill_tokens),
            "--enable-prefix-caching" if a.enable_prefix_caching else "--no-enable-prefix-caching",
            "--async-scheduling" if a.async_scheduling else "--no-async-scheduling",
            "--precompile" if a.precompile else "--no-precompile",
            "--scheduling-policy", a.scheduling_policy,
            "--load-format", a.load_format,
            "--kv-pull-timeout", str(a.kv_pull_timeout), "--shutdown-timeout", str(a.shutdown_timeout)]
    for flag, v in (("--model", a.model), ("--served-model-name", a.served_model_name), ("--parallel", parallel),
                    ("--max-model-len", a.max_model_len), ("--num-kv-blocks", a.num_kv_blocks),
                    ("--compilation-cache-dir", a.compilation_cache_dir)):
        if v is not None:
            argv += [flag, str(v)]
    if a.speculative_config is not None:  # both roles: a speculative decode side needs the MTP layer's rows
        import json
        argv += ["--speculative-config", json.dumps(a.speculative_config)]
    if role == "decode" and a.inject_kv_transfer_failures:
        argv += ["--inject-kv-transfer-failures", str(a.inject_kv_transfer_failures)]
    return argv


def _device_groups(spec: str, n: int, flag: str) -> list[str | None]:
    groups = [g.strip() for g in spec.split(";")] if spec else []
    if groups and len(groups) != n:
        raise SystemExit(f"{flag} names {len(groups)} device groups for {n} workers")
    return groups or [None] * n


def start_workers(a: argparse.Namespace):
    """Starts every worker process; returns (prefill, decode) WorkerHandles once each answers /internal/info,
    and the smallest max_model_len and the vocab size they report."""
    import json
    import subprocess
    import time
    import urllib.request

    from moejax.server.app import free_port
    from moejax.server.router import WorkerHandle
    handles = {"prefill": [], "decode": []}
    for role, n, devs, urls in (("prefill", a.prefill_workers, a.prefill_devices, a.prefill_urls),
                                ("decode", a.decode_workers, a.decode_devices, a.decode_urls)):
        urls = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
        if urls:  # started elsewhere: only their URLs are known
            handles[role] = [WorkerHandle(role, i, u) for i, u in enumerate(urls)]
            continue
        if n < 1:
            raise SystemExit(f"--{role}-workers must be at least 1, got {n}")
        for i, group in enumerate(_device_groups(devs, n, f"--{role}-devices")):
            port = free_port()
            env = dict(os.environ)
            if group is not None:
                env["CUDA_VISIBLE_DEVICES"] = group
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *worker_argv(a, role, port)], env=env)
            handles[role].append(WorkerHandle(role, i, f"http://127.0.0.1:{port}", proc))
    infos = []
    deadline = time.monotonic() + a.worker_start_timeout
    for w in handles["prefill"] + handles["decode"]:
        while True:
            if w.check() is not None:
                stop_workers(handles["prefill"] + handles["decode"])
                raise SystemExit(f"{w.dead} while starting")
            try:
                with urllib.request.urlopen(w.url + "/internal/info", timeout=5) as r:
                    infos.append(json.loads(r.read()))
                    w.kv_tokens = int(infos[-1].get("kv_tokens", 0))
                    break
            except OSError:
                if time.monotonic() > deadline:
                    stop_workers(handles["prefill"] + handles["decode"])
                    raise SystemExit(f"{w.name} did not answer within --worker-start-timeout") from None
                time.sleep(0.5)
    try:
        check_speculative(infos[:len(handles["prefill"])], infos[len(handles["prefill"]):])
    except ValueError as e:
        stop_workers(handles["prefill"] + handles["decode"])
        raise SystemExit(str(e)) from None
    return handles["prefill"], handles["decode"], min(i["max_model_len"] for i in infos), infos[0]["vocab_size"]


def check_speculative(prefill_infos: list[dict], decode_infos: list[dict]) -> None:
    """ValueError naming speculative_config when a decode worker speculates (its cache has the MTP layer's)
    and a prefill worker does not write the MTP layer's rows (engine/kv_handoff.py's rule; a worker that
    does not report num_cache_layers is not checked here: its handoffs are, by the decode worker)."""
    for d in decode_infos:
        if not d.get("speculative_config"):
            continue
        for p in prefill_infos:
            if p.get("num_cache_layers") is not None and p["num_cache_layers"] < d.get("num_cache_layers", 0):
                raise ValueError(f"the decode workers run with speculative_config {d['speculative_config']} and need "
                                 "the MTP layer's cache rows, which a prefill worker without speculative_config "
                                 f"does not write (speculative_config {p.get('speculative_config')}): give the "
                                 "prefill workers the same --speculative-config")


def stop_workers(workers, timeout: float = 30.0) -> None:
    """SIGTERM (they drain), then SIGKILL for any still running after ``timeout``."""
    import subprocess
    workers = [w for w in workers if w.proc is not None]  # those started elsewhere are left alone
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def serve_disaggregated(a: argparse.Namespace, path: str, name: str) -> int:
    """The router: starts the workers, then serves the OpenAI app over a Router (moejax/server/router.py)."""
    import asyncio

    from moejax.server import protocol
    from moejax.server.access import AccessPolicy
    from moejax.server.app import build_app
    from moejax.server.lifecycle import Server
    from moejax.model import tokenizer_source
    from moejax.server.router import Router
    from moejax.tokenizer import Tokenizer
    if a.role is not None or int(os.environ.get("MOEJAX_NUM_PROCESSES") or 1) > 1:
        raise SystemExit("--disaggregated starts its own workers: run it alone, not under --role or the launcher")
    prefill, decode, max_len, vocab = start_workers(a)
    try:
        router = Router(prefill, decode, name)
        names = tuple(dict.fromkeys([name, *((a.model,) if a.model else ()), path]))
        ctx = protocol.ServingContext(names, Tokenizer(tokenizer_source(path, a.load_format)), max_len, vocab)
        origins = tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip())
        policy = AccessPolicy(api_key=a.api_key or None, allowed_origins=origins, bind_host=a.host)
        app = build_app(router, ctx, policy, int(a.max_request_mb * (1 << 20)))

        async def _close(_app):
            await router.aclose()

        app.on_startup.append(router.on_startup)
        app.on_cleanup.append(_close)
        print(f"Serving {name} on http://{a.host}:{a.port}: disaggregated, {len(prefill)} prefill and "
              f"{len(decode)} decode worker(s) (max_model_len={max_len})", flush=True)
        return asyncio.run(Server(app, a.host, a.port, shutdown_timeout=a.shutdown_timeout).run())
    finally:
        stop_workers(prefill + decode)


def follow_leader(path: str, kw: dict, precompile: bool = True) -> int:
    """A process other than 0: loads its shards, then steps whatever process 0's engine steps."""
    import moejax
    from moejax.engine.replicated import follow
    from moejax.parallel import peer_watch
    from moejax.parallel.step_channel import StepChannel
    stop = peer_watch.start_beating()
    model = moejax.load(path, **kw)
    if precompile:  # the same programs as process 0's, compiled here (no collective: each its own)
        model.engine.precompile(progress=False)
    follow(model.engine, StepChannel())
    stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
