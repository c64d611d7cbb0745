#!/usr/bin/env python
"""Serving benchmark: a load generator with the flags and metric definitions of `vllm bench serve`.

  python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --max-concurrency 64 \\
      --dataset-name random --random-input-len 1024 --random-output-len 1024 --ignore-eos

Metrics (as in vLLM): TTFT = time to the first streamed chunk; ITL = gaps between successive
streamed chunks; TPOT = (e2el - ttft) / (output_tokens - 1) per request; E2EL = request latency;
request / output / total token throughput over the benchmark duration. Also the server's
decode-only throughput: the change of moejax:decode_tokens_total over moejax:decode_time_seconds_total
read from /metrics before and after the run (prefill time excluded).

The random dataset sends each prompt as a list of token ids in the completions `prompt` field,
so input lengths are exact. Uses aiohttp, like vLLM's benchmark client.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from datetime import datetime

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclasses.dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


@dataclasses.dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    error: str = ""


# ----- datasets ------------------------------------------------------------------------------

def _tokenizer(path: str | None):
    from moejax.tokenizer import Tokenizer
    if path is None:
        from moejax.tiny.default_model import default_model_path
        path = default_model_path()
    return Tokenizer(path)


def random_requests(tok, num: int, input_len: int, output_len: int, range_ratio: float, seed: int):
    rng = np.random.default_rng(seed)
    lo_i, hi_i = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    lo_o, hi_o = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
    in_lens = rng.integers(lo_i, hi_i + 1, size=num)
    out_lens = rng.integers(lo_o, hi_o + 1, size=num)
    vocab = tok.vocab_size
    specials = sorted({t for t in (tok.bos_token_id, tok.eos_token_id) if t is not None})
    plain = np.setdiff1d(np.arange(vocab), specials)  # draw from the non-special ids only (no stray BOS/EOS)
    reqs = []
    for n, m in zip(in_lens, out_lens):
        ids = plain[rng.integers(0, len(plain), size=int(n))].tolist()
        reqs.append(SampleRequest(ids, int(n), int(m)))
    return reqs


def sharegpt_requests(tok, path: str, num: int, output_len: int | None, seed: int):
    with open(path) as f:
        data = json.load(f)
    data = [d for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(data)
    reqs = []
    for d in data:
        if len(reqs) >= num:
            break
        prompt, completion = d["conversations"][0]["value"], d["conversations"][1]["value"]
        p_len = len(tok.encode(prompt))
        o_len = output_len if output_len is not None else len(tok.encode(completion, add_special_tokens=False))
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:  # vLLM's filter
            continue
        reqs.append(SampleRequest(prompt, p_len, o_len))
    if len(reqs) < num:
        print(f"warning: only {len(reqs)} usable ShareGPT conversations (asked for {num})")
    return reqs


# ----- one request -------------------------------------------------------------------------

async def send_request(session: aiohttp.ClientSession, url: str, model: str, req: SampleRequest, chat: bool,
                       ignore_eos: bool, temperature: float, pbar=None, extra: dict | None = None) -> RequestOutput:
    payload = {"model": model, "max_tokens": req.expected_output_len, "temperature": temperature,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, **(extra or {})}
    if chat:
        content = req.prompt if isinstance(req.prompt, str) else None
        if content is None:
            raise ValueError("the chat endpoint needs text prompts: use --dataset-name sharegpt")
        payload["messages"] = [{"role": "user", "content": content}]
    else:
        payload["prompt"] = req.prompt
    out = RequestOutput(prompt_len=req.prompt_len)
    st = time.perf_counter()
    last = st
    texts = []
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        out.error = json.dumps(obj["error"])
                        return out
                    now = time.perf_counter()
                    if obj.get("choices"):
                        c = obj["choices"][0]
                        piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                        if chat and (c.get("delta") or {}).get("role") and not piece and not c.get("finish_reason"):
                            continue  # the role-only first chunk carries no token
                        if out.ttft == 0.0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        texts.append(piece or "")
                    if obj.get("usage"):
                        out.output_tokens = obj["usage"]["completion_tokens"]
            out.latency = last - st
            out.generated_text = "".join(texts)
            if out.output_tokens == 0:
                out.output_tokens = len(out.itl) + (1 if out.ttft else 0)
            out.success = out.ttft > 0
            if not out.success:
                out.error = "no tokens received"
    except Exception as e:  # noqa: BLE001 - a failed request is recorded, not fatal
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if pbar is not None:
            pbar.update(1)
    return out


# ----- server metrics -----------------------------------------------------------------------

async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    from moejax.server.metrics import parse_metrics
    try:
        async with session.get(base_url + "/metrics") as r:
            return parse_metrics(await r.text()) if r.status == 200 else {}
    except aiohttp.ClientError:
        return {}


def spec_decode_stats(before: dict, after: dict) -> dict:
    """Speculative decoding over the run, from vLLM's spec_decode counters (empty when the server has none):
    acceptance rate = accepted / draft tokens; per draft position, accepted / drafts; mean acceptance length
    = 1 + accepted / drafts (tokens a step gives a sequence)."""
    name = "vllm:spec_decode_num_draft_tokens_total"
    if name not in after:
        return {}
    d = {k: after.get(f"vllm:spec_decode_num_{k}_total", 0) - before.get(f"vllm:spec_decode_num_{k}_total", 0)
         for k in ("drafts", "draft_tokens", "accepted_tokens")}
    per_pos = {}
    for key, v in after.items():
        if key.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{"):
            pos = int(key.split('position="')[1].split('"')[0])
            per_pos[pos] = v - before.get(key, 0)
    return {"spec_num_drafts": d["drafts"], "spec_num_draft_tokens": d["draft_tokens"],
            "spec_num_accepted_tokens": d["accepted_tokens"],
            "spec_acceptance_rate": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            "spec_acceptance_length": 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else 1.0,
            "spec_acceptance_per_pos": [per_pos[p] / d["drafts"] if d["drafts"] else 0.0 for p in sorted(per_pos)]}


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    arr = np.asarray(values_s or [0.0]) * 1000
    d = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
         f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        d[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return d


def calculate_metrics(outs: list[RequestOutput], duration: float, percentiles: list[float]) -> dict:
    ok = [o for o in outs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    m = {"duration": duration, "completed": len(ok), "failed": len(outs) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
         "total_token_throughput": (total_in + total_out) / duration}
    m.update(_stats("ttft", [o.ttft for o in ok], percentiles))
    m.update(_stats("tpot", tpots, percentiles))
    m.update(_stats("itl", [x for o in ok for x in o.itl], percentiles))
    m.update(_stats("e2el", [o.latency for o in ok], percentiles))
    return m


# ----- the benchmark ------------------------------------------------------------------------

async def benchmark(a, reqs: list[SampleRequest]) -> dict:
    from tqdm.auto import tqdm
    base = a.base_url.rstrip("/")
    url = base + a.endpoint
    chat = "chat" in a.endpoint
    percentiles = [float(p) for p in a.metric_percentiles.split(",")]
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=connector) as session:
        model = a.model
        if model is None:
            async with session.get(base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        if not a.skip_test_run:
            test = await send_request(session, url, model, dataclasses.replace(reqs[0], expected_output_len=min(
                reqs[0].expected_output_len, 8)), chat, a.ignore_eos, a.temperature, extra=a.extra_body)
            if not test.success:
                raise RuntimeError(f"the initial test request failed: {test.error}")
        before = await scrape(session, base)
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        pbar = None if a.disable_tqdm else tqdm(total=len(reqs), desc="requests")
        rng = np.random.default_rng(a.seed)

        async def limited(r):
            if sem is None:
                return await send_request(session, url, model, r, chat, a.ignore_eos, a.temperature, pbar, a.extra_body)
            async with sem:
                return await send_request(session, url, model, r, chat, a.ignore_eos, a.temperature, pbar, a.extra_body)

        t0 = time.perf_counter()
        tasks = []
        for i, r in enumerate(reqs):
            if i and a.request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / a.request_rate)))  # Poisson arrivals
            tasks.append(asyncio.create_task(limited(r)))
        outs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
        after = await scrape(session, base)

    m = calculate_metrics(outs, duration, percentiles)
    dtok = after.get("moejax:decode_tokens_total", 0) - before.get("moejax:decode_tokens_total", 0)
    dtime = after.get("moejax:decode_time_seconds_total", 0) - before.get("moejax:decode_time_seconds_total", 0)
    m.update({"server_decode_tokens": dtok, "server_decode_time_s": dtime,
              "server_decode_throughput": dtok / dtime if dtime > 0 else 0.0,
              "server_num_preemptions": after.get("vllm:num_preemptions_total", 0)
              - before.get("vllm:num_preemptions_total", 0),
              # EP balancedness (mean/max tokens per rank, measured in the dispatch; imbalance = 1/it)
              "server_eplb_balancedness": next((v for k, v in after.items()
                                                if k.startswith("moejax:eplb_balancedness{") and 'layer="all"' in k),
                                               1.0)})
    m.update(spec_decode_stats(before, after))
    m.update({"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if chat else "openai",
              "model_id": model, "base_url": base, "endpoint": a.endpoint, "dataset_name": a.dataset_name,
              "num_prompts": len(reqs), "request_rate": a.request_rate if a.request_rate != float("inf") else "inf",
              "max_concurrency": a.max_concurrency, "ignore_eos": a.ignore_eos, "extra_body": a.extra_body,
              "percentile_metrics": a.percentile_metrics, "metric_percentiles": a.metric_percentiles,
              "input_lens": [o.prompt_len for o in outs], "output_lens": [o.output_tokens for o in outs],
              "ttfts": [o.ttft for o in outs], "itls": [o.itl for o in outs],
              "generated_texts": [o.generated_text for o in outs], "errors": [o.error for o in outs]})
    return m


def print_report(m: dict, a) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
            ("Maximum request concurrency:", m["max_concurrency"]),
            ("Benchmark duration (s):", f"{m['duration']:.2f}"), ("Total input tokens:", m["total_input_tokens"]),
            ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
            ("Server decode-only throughput (tok/s):", f"{m['server_decode_throughput']:.2f}"),
            ("EP balancedness (mean/max per rank):", f"{m.get('server_eplb_balancedness', 1.0):.3f}")]
    if "spec_acceptance_rate" in m:  # the server decodes speculatively (vLLM's spec decode summary)
        rows += [("Spec decode acceptance rate:", f"{m['spec_acceptance_rate']:.3f}"),
                 ("Spec decode acceptance length:", f"{m['spec_acceptance_length']:.2f}"),
                 ("Spec decode drafts / draft tokens:", f"{m['spec_num_drafts']:.0f} / {m['spec_num_draft_tokens']:.0f}"),
                 ("Spec decode per-position acceptance:", " ".join(f"{r:.3f}" for r in m["spec_acceptance_per_pos"]))]
    for k, v in rows:
        if v is not None:  # no concurrency bound (a request rate alone): the row is left out, as vLLM does
            print(f"{k:<40}{v:<10}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key in a.percentile_metrics.split(","):
        key = key.strip()
        if key not in names:
            continue
        print("{s:{c}^{n}}".format(s=names[key], n=w, c="-"))
        print(f"{'Mean ' + key.upper() + ' (ms):':<40}{m[f'mean_{key}_ms']:<10.2f}")
        print(f"{'Median ' + key.upper() + ' (ms):':<40}{m[f'median_{key}_ms']:<10.2f}")
        for p in a.metric_percentiles.split(","):
            print(f"{'P' + p.strip() + ' ' + key.upper() + ' (ms):':<40}{m[f'p{float(p):g}_{key}_ms']:<10.2f}")
    print("=" * w)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="server base URL (overrides --host/--port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    ap.add_argument("--tokenizer", default=None,
                    help="checkpoint directory with tokenizer.json (default: --model if a directory, "
                         "else the embedded tiny model)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second (inf: all at once; otherwise Poisson arrivals)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                    help='fields added to every request (vLLM\'s flag), e.g. \'{"repetition_penalty": 1.1}\'')
    ap.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    ap.add_argument("--dataset-path", default=None)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--sharegpt-output-len", type=int, default=None)
    ap.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    ap.add_argument("--metric-percentiles", default="99")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", action="store_true")
    ap.add_argument("--result-dir", default=None)
    ap.add_argument("--result-filename", default=None)
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--skip-test-run", action="store_true", help="skip the initial single test request")
    return ap


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    if a.extra_body is not None and not isinstance(a.extra_body, dict):
        raise SystemExit(f"--extra-body must be a JSON object, not {a.extra_body!r}")
    if a.base_url is None:
        a.base_url = f"http://{a.host}:{a.port}"
    tok_path = a.tokenizer or (a.model if a.model and os.path.isdir(a.model) else None)
    tok = _tokenizer(tok_path)
    if a.dataset_name == "random":
        reqs = random_requests(tok, a.num_prompts, a.random_input_len, a.random_output_len, a.random_range_ratio,
                               a.seed)
    else:
        if not a.dataset_path:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path")
        reqs = sharegpt_requests(tok, a.dataset_path, a.num_prompts, a.sharegpt_output_len, a.seed)
    if not reqs:
        raise SystemExit("no requests to send")
    m = asyncio.run(benchmark(a, reqs))
    print_report(m, a)
    if a.save_result or a.result_filename:
        fn = a.result_filename or (f"moejax-{a.request_rate}qps-concurrency{a.max_concurrency}-"
                                   f"{m['date']}.json")
        if a.result_dir:
            os.makedirs(a.result_dir, exist_ok=True)
            fn = os.path.join(a.result_dir, fn)
        with open(fn, "w") as f:
            json.dump(m, f, indent=1)
        print(f"results written to {fn}")
    return m


if __name__ == "__main__":
    main()
