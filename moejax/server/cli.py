"""``moejax serve MODEL [flags]``: the OpenAI-compatible HTTP server and its processes (vLLM's ``vllm serve``).

  moejax serve                                            # the embedded tiny RANDOM-weight model
  moejax serve /path/to/DeepSeek-V2-Lite --port 8000
  moejax serve /path/to/DeepSeek-V3 --parallel dp8-ep8 --kernels auto --kv-cache-dtype fp8
  moejax serve deepseek-v3 --load-format dummy --weight-dtype fp8 --parallel dp8-ep8   # RANDOM weights

(``python scripts/serve.py --model MODEL [flags]`` is the same server.) The engine's flags come from
its settings' one declaration (moejax/engine_args.py: ``--max-num-seqs``, ``--max-model-len``,
``--kv-cache-dtype``, ``--moe-kernel``, ...); the rest are the server's own.

Several processes (one per GPU or group of devices; docs/multiprocess.md):

  python -m moejax.launch --nproc 8 -- scripts/serve.py --model /path/to/DeepSeek-V3 --parallel dp8-ep8

Process 0 is the HTTP front end and forwards each engine step to the others, which step with it.
A process that dies makes /health answer 503 and the server exit non-zero within --peer-timeout s.

Prefill/decode disaggregation (docs/disaggregation.md): worker processes of two roles, each with its own
devices and parallel layout, one OpenAI front end routing requests (prefill worker, then decode worker;
the latent KV cache moved between them by jax.experimental.transfer):

  moejax serve /path/to/DeepSeek-V3 --disaggregated --prefill-workers 1 --decode-workers 1 \\
      --prefill-parallel dp4-ep4 --prefill-devices 0,1,2,3 --decode-parallel dp4-ep4 --decode-devices 4,5,6,7

Endpoints: /v1/completions, /v1/chat/completions (SSE streaming, stream_options.include_usage),
/v1/models, /health, /metrics (Prometheus, vLLM metric names + moejax decode-only throughput).

The server uses aiohttp: one dependency gives both the server and the benchmark's
streaming client (scripts/bench_serve.py), as `vllm bench serve` uses aiohttp too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request

import moejax
from moejax.engine.kv_transfer import KVTransfer
from moejax.engine.replicated import LeaderEngine, follow
from moejax.engine_args import EngineArgs
from moejax.model import tokenizer_source
from moejax.parallel import peer_watch, processes
from moejax.parallel.step_channel import StepChannel
from moejax.server import protocol
from moejax.server.access import AccessPolicy
from moejax.server.app import build_app, free_port, make_app
from moejax.server.chat_output import check_markers
from moejax.server.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S, Server
from moejax.server.reasoning_parsers import REASONING_PARSERS
from moejax.server.router import Router, WorkerHandle
from moejax.server.tool_parsers import TOOL_PARSERS
from moejax.server.worker import WorkerConfig, add_worker_routes
from moejax.tiny.default_model import default_model_path
from moejax.tokenizer import Tokenizer

# moejax serve's own defaults for engine settings: the server compiles every program before /health
# answers 200 (make_app), so no request compiles anything, and keeps the executables for its next start
# (moejax/executable_cache.py's default folder).
SERVE_DEFAULTS = {"precompile": True, "executable_cache_dir": "auto"}
# The directory that holds the moejax package: on the worker processes' PYTHONPATH, so `python -m moejax`
# finds this moejax whether it was installed or run from a checkout (scripts/serve.py).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="HF checkpoint directory, or a preset name with --load-format dummy (default: the embedded "
                         "tiny random model); the same as --model")
    ap.add_argument("--model", help="the same as MODEL")
    ap.add_argument("--served-model-name", help="the name clients use (default: the model argument)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                    help="seconds SIGTERM/SIGINT lets requests in flight finish before aborting them (exit 0); "
                         "the default (lifecycle.DEFAULT_SHUTDOWN_TIMEOUT_S) exits within 25 s, inside "
                         "Kubernetes' default 30 s grace period")
    ap.add_argument("--api-key", default=os.environ.get("MOEJAX_API_KEY"),
                    help="require 'Authorization: Bearer <key>' on /v1/* (default: $MOEJAX_API_KEY; none: open)")
    ap.add_argument("--allowed-origins", default="",
                    help="comma list of browser origins allowed by CORS (e.g. http://localhost:3000, or *); "
                         "default none: cross-origin requests are refused")
    ap.add_argument("--chat-template", help="a Jinja chat template (a file, or the text) in place of the tokenizer's")
    ap.add_argument("--generation-config", default="auto",
                    help="auto: the checkpoint's generation_config.json sampling defaults; vllm: none; or a directory")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='tool_choice "auto" (the default with tools): the calls the model writes returned as '
                         "tool_calls, read by --tool-call-parser; without it, tools are refused unless "
                         'tool_choice is "none"')
    ap.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                    help="the format the model writes its tool calls in (vLLM's names)")
    ap.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                    help="chat answers' thinking (before </think>) returned as reasoning_content, apart from content")
    ap.add_argument("--max-request-mb", type=float, default=32.0, help="request bodies above this get 413")
    ap.add_argument("--peer-timeout", type=float, default=10.0,
                    help="multi-process: seconds without a heartbeat after which process 0 declares another "
                         "process dead (/health 503, exit 1)")
    EngineArgs.add_cli_args(ap, defaults=SERVE_DEFAULTS)
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
                   help="comma list of prefill workers started elsewhere (moejax serve --role prefill --host H "
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


def parse_args(argv=None, prog: str | None = None) -> argparse.Namespace:
    """The command line, MODEL and --model made one (``a.model``)."""
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    if a.model_tag is not None and a.model is not None and a.model_tag != a.model:
        ap.error(f"MODEL {a.model_tag!r} and --model {a.model!r} differ: give one")
    a.model = a.model if a.model is not None else a.model_tag
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        ap.error("--enable-auto-tool-choice requires --tool-call-parser")
    return a


def serving_parsers(a: argparse.Namespace, tokenizer) -> dict:
    """ServingContext's parser fields from --reasoning-parser, --tool-call-parser and --enable-auto-tool-choice,
    checked against the tokenizer (a SystemExit naming the flag)."""
    out = {"enable_auto_tool_choice": a.enable_auto_tool_choice}
    for flag, key, table, name in (("--reasoning-parser", "reasoning_parser", REASONING_PARSERS, a.reasoning_parser),
                                   ("--tool-call-parser", "tool_parser", TOOL_PARSERS, a.tool_call_parser)):
        if name is not None:
            try:
                check_markers(tokenizer, table[name], f"{flag} {name}")
            except ValueError as e:
                raise SystemExit(str(e)) from None
            out[key] = table[name]
    return out


def build_load_kwargs(a: argparse.Namespace) -> dict:
    """moejax.load's keyword arguments from the parsed command line: every engine setting, but precompile,
    which the server does itself (make_app, follow_leader) once the model is loaded."""
    kw = EngineArgs.from_cli_args(a).kwargs()
    del kw["precompile"]
    return kw


def main(argv=None, prog: str | None = None) -> int:
    a = parse_args(argv, prog)
    handler = logging.StreamHandler()  # moejax's own lines (one per program compiled at start-up), not aiohttp's
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger("moejax").addHandler(handler)
    logging.getLogger("moejax").setLevel(logging.INFO)
    logging.getLogger("moejax").propagate = False

    kw = build_load_kwargs(a)
    path, name = a.model, a.served_model_name
    if path is None:
        path = default_model_path()
        name = name or "moejax-tiny-random"
        print(f"No model given: serving the embedded tiny DeepSeek-V3-architecture model with RANDOM weights "
              f"({path}) as {name!r}; its output is gibberish.", flush=True)
    elif a.load_format == "dummy":
        print(f"--load-format dummy: serving {path!r} with RANDOM weights (made on the device, not read from any "
              f"checkpoint); its output is gibberish.", flush=True)
    if not a.peer_timeout > 0:
        raise SystemExit(f"--peer-timeout must be > 0 seconds, got {a.peer_timeout}")
    if a.disaggregated:
        return serve_disaggregated(a, path, name or a.model or path)
    if a.role is not None:
        return serve_worker(a, path, name or a.model or path, worker_kwargs(a, kw))
    multi = processes.initialize_from_env()
    if multi and not processes.is_leader():
        return follow_leader(path, kw, a.precompile)
    model = moejax.load(path, **kw)
    if a.chat_template:
        model.tokenizer.set_chat_template(a.chat_template)
    engine = LeaderEngine(model.engine, StepChannel()) if multi else None
    origins = tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip())
    policy = AccessPolicy(api_key=a.api_key or None, allowed_origins=origins, bind_host=a.host)
    app, aengine = make_app(model, name or a.model, extra_names=(a.model,) if a.model else (), policy=policy,
                            max_body_bytes=int(a.max_request_mb * (1 << 20)), engine=engine, precompile=a.precompile,
                            generation_config=a.generation_config, parsers=serving_parsers(a, model.tokenizer))
    watcher = peer_watch.watch(aengine.fail, a.peer_timeout) if multi else None
    print(f"Serving {name or a.model} on http://{a.host}:{a.port}  (max_model_len={model.max_model_len}, "
          f"KV blocks={model.engine.blocks.num_blocks} x {model.block_size}"
          f"{f', {processes.count()} processes' if multi else ''})", flush=True)
    code = asyncio.run(Server(app, a.host, a.port, shutdown_timeout=a.shutdown_timeout).run())
    if multi and code == 0:
        watcher.stop()  # before the interpreter exits (peer_watch.Stoppable says why)
        engine.stop_followers()
    elif multi:
        # A process died: the engine thread may be stuck in a collective with it, and jax.distributed's
        # shutdown barrier would wait for it. Exit now, non-zero, as a one-process server would.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    return code


def worker_kwargs(a: argparse.Namespace, kw: dict) -> dict:
    """A --role worker's load keywords: kv_role its role's handoff side (the export programs of a prefill
    worker, the import ones of a decode worker) unless --kv-role gives one that covers it."""
    if a.kv_role == "none":
        return {**kw, "kv_role": a.role}
    if a.kv_role not in (a.role, "both"):
        raise SystemExit(f"--kv-role {a.kv_role} does not do a {a.role} worker's handoff: give --kv-role {a.role} "
                         "or both, or leave it out")
    return kw


def serve_worker(a: argparse.Namespace, path: str, name: str, kw: dict) -> int:
    """A disaggregated worker (started by the router): its own engine, the colocated app plus the internal
    routes (moejax/server/worker.py)."""
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
    """A worker's command line: the router's model and every engine setting (EngineArgs.to_argv), its role's
    layout, block size and kv_role in place of the router's."""
    parallel = (a.prefill_parallel if role == "prefill" else a.decode_parallel) or a.parallel
    block = (a.prefill_block_size if role == "prefill" else a.decode_block_size) or a.block_size
    kv_role = "both" if a.kv_role == "both" else role  # the router's own --kv-role is no worker's side
    settings = EngineArgs.from_cli_args(a, parallel=parallel, block_size=block, kv_role=kv_role)
    argv = ["--role", role, "--host", "127.0.0.1", "--port", str(port),
            "--kv-pull-timeout", str(a.kv_pull_timeout), "--shutdown-timeout", str(a.shutdown_timeout),
            *settings.to_argv()]
    model = a.model if a.model is not None else getattr(a, "model_tag", None)
    for flag, v in (("--model", model), ("--served-model-name", a.served_model_name)):
        if v is not None:
            argv += [flag, str(v)]
    if role == "decode" and a.inject_kv_transfer_failures:
        argv += ["--inject-kv-transfer-failures", str(a.inject_kv_transfer_failures)]
    return argv


def _device_groups(spec: str, n: int, flag: str) -> list[str | None]:
    groups = [g.strip() for g in spec.split(";")] if spec else []
    if groups and len(groups) != n:
        raise SystemExit(f"{flag} names {len(groups)} device groups for {n} workers")
    return groups or [None] * n


def start_workers(a: argparse.Namespace):
    """Starts every worker process (``python -m moejax serve`` with worker_argv); returns (prefill, decode)
    WorkerHandles once each answers /internal/info, and the smallest max_model_len and the vocab size
    they report."""
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
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT,
                                                                            os.environ.get("PYTHONPATH")])))
            if group is not None:
                env["CUDA_VISIBLE_DEVICES"] = group
            proc = subprocess.Popen([sys.executable, "-m", "moejax", "serve", *worker_argv(a, role, port)], env=env)
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
    if a.role is not None or int(os.environ.get("MOEJAX_NUM_PROCESSES") or 1) > 1:
        raise SystemExit("--disaggregated starts its own workers: run it alone, not under --role or the launcher")
    prefill, decode, max_len, vocab = start_workers(a)
    try:
        router = Router(prefill, decode, name)
        ctx = router_context(a, path, name, max_len, vocab)
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


def router_context(a: argparse.Namespace, path: str, name: str, max_len: int, vocab: int) -> protocol.ServingContext:
    """The disaggregated router's ServingContext: what make_app gives a colocated server (its names, the
    tokenizer with --chat-template, --generation-config's defaults, the chat parsers); the router parses each
    request, so the workers get its sampling parameters with these defaults applied."""
    names = tuple(dict.fromkeys([name, *((a.model,) if a.model else ()), path]))
    tokenizer = Tokenizer(tokenizer_source(path, a.load_format))
    if a.chat_template:
        tokenizer.set_chat_template(a.chat_template)
    defaults = protocol.generation_defaults(path if a.generation_config == "auto" else a.generation_config)
    return protocol.ServingContext(names, tokenizer, max_len, vocab, defaults, **serving_parsers(a, tokenizer))


def follow_leader(path: str, kw: dict, precompile: bool = True) -> int:
    """A process other than 0: loads its shards, then steps whatever process 0's engine steps."""
    beating = peer_watch.start_beating()
    model = moejax.load(path, **kw)
    if precompile:  # the same programs as process 0's, compiled here (no collective: each its own)
        model.engine.precompile(progress=False)
    follow(model.engine, StepChannel())
    beating.stop()
    return 0
