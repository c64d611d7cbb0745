"""scripts/bench_serve.py metric definitions and scripts/sweep.py end to end on the tiny model (CPU)."""

import csv
import json
import os
import sys

import jax
import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)

import bench_serve  # noqa: E402
import sweep  # noqa: E402


def test_metric_definitions_follow_vllm():
    """calculate_metrics against hand-computed values under vLLM's definitions (TPOT per request
    excludes the first token, ITL pools every chunk gap, failures are counted but not measured)."""
    outs = [bench_serve.RequestOutput(success=True, prompt_len=10, output_tokens=5, ttft=0.1,
                                      itl=[0.05, 0.05, 0.1, 0.1], latency=0.4),
            bench_serve.RequestOutput(success=True, prompt_len=20, output_tokens=3, ttft=0.2, itl=[0.2, 0.2],
                                      latency=0.6),
            bench_serve.RequestOutput(success=False, error="x")]
    m = bench_serve.calculate_metrics(outs, duration=2.0, percentiles=[50, 99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0 and m["total_token_throughput"] == 19.0
    # TPOT per request = (e2el - ttft) / (output_tokens - 1): 0.075 and 0.2
    assert m["mean_tpot_ms"] == pytest.approx((75 + 200) / 2)
    # ITL: all chunk gaps pooled
    assert m["mean_itl_ms"] == pytest.approx(1000 * 0.7 / 6) and m["median_itl_ms"] == pytest.approx(100)
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["p50_e2el_ms"] == pytest.approx(500)


def test_random_prompts_have_exact_lengths():
    """random_requests with range_ratio 0: every prompt exactly input_len in-vocabulary token ids,
    none of them BOS or EOS (a stray EOS would end a benchmark stream early), and the same seed
    gives the same requests (a benchmark run replays)."""
    import numpy as np
    tok = bench_serve._tokenizer(None)
    seed = int(np.random.default_rng().integers(1 << 30))
    reqs = bench_serve.random_requests(tok, 5, 17, 9, 0.0, seed=seed)
    assert all(len(r.prompt) == 17 == r.prompt_len and r.expected_output_len == 9 for r in reqs)
    assert all(isinstance(t, int) and 0 <= t < tok.vocab_size for r in reqs for t in r.prompt)
    assert not {tok.bos_token_id, tok.eos_token_id} & {t for r in reqs for t in r.prompt}
    assert bench_serve.random_requests(tok, 5, 17, 9, 0.0, seed=seed) == reqs


def test_sweep_end_to_end_on_tiny_model(tmp_path):
    """scripts/sweep.py against a served tiny model: every request completes with exactly the
    requested input and output token counts, throughputs are those counts over the measured
    duration, one ITL entry per streamed chunk; the CSV, PNG and per-level JSON are written."""
    out = str(tmp_path / "sweep")
    rows = sweep.main(["--concurrency", "1,4", "--num-prompts", "8", "--random-input-len", "16",
                       "--random-output-len", "6", "--dtype", "float32", "--max-model-len", "128",
                       "--out-dir", out, "--disable-tqdm", "--warmup"])
    assert [r["concurrency"] for r in rows] == [1, 4]
    with open(os.path.join(out, "sweep.csv")) as f:
        table = list(csv.DictReader(f))
    assert [int(r["concurrency"]) for r in table] == [1, 4]
    for r in table:
        assert int(r["completed"]) == 8 and int(r["failed"]) == 0
        assert int(r["total_input_tokens"]) == 8 * 16 and int(r["total_output_tokens"]) == 8 * 6
        assert float(r["output_throughput"]) > 0 and float(r["median_itl_ms"]) > 0
        assert float(r["output_throughput"]) == pytest.approx(8 * 6 / float(r["duration"]), rel=1e-9)
        assert float(r["request_throughput"]) == pytest.approx(8 / float(r["duration"]), rel=1e-9)
        assert float(r["server_decode_throughput"]) > 0
    png = os.path.join(out, "sweep.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "bench_c4.json")) as f:
        res = json.load(f)
    # one chunk per token, unless the client fell behind and queued tokens shared a chunk
    assert res["max_concurrency"] == 4 and len(res["itls"]) == 8 and all(1 <= len(x) <= 5 for x in res["itls"])
    assert res["output_lens"] == [6] * 8 and res["input_lens"] == [16] * 8


def test_offline_decode_sweep_and_components(tmp_path):
    """sweep.py --offline runs bench_decode (moejax auto and XLA baseline, transformers peer) for
    each preset and concurrency and writes the CSV and plot; --collect rebuilds the same table from
    the saved JSON and merges a later partial run keeping the earlier baseline; the step is split
    into components and the donated cache is counted in the aliased bytes."""
    rows = sweep.main(["--offline", "--presets", "v3-tiny,step3-tiny", "--concurrency", "2",
                       "--random-input-len", "12", "--random-output-len", "10", "--steps", "2",
                       "--peer", "--fill", "random", "--out-dir", str(tmp_path)])
    assert [(r["preset"], r["concurrency"]) for r in rows] == [("v3-tiny", 2), ("step3-tiny", 2)]
    with open(tmp_path / "decode_sweep.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 2 and all(float(r["tok_per_s"]) > 0 and float(r["xla_tok_per_s"]) > 0 for r in got)
    assert all(float(r["peer_tok_per_s"]) > 0 for r in got if r["preset"] == "v3-tiny")
    with open(tmp_path / "decode_step3-tiny_c2.json") as f:
        assert "Step3" in json.load(f)["peer_note"]
    again = sweep.main(["--collect", str(tmp_path / "decode_v3-tiny_c2.json"), str(tmp_path / "decode_step3-tiny_c2.json"),
                        "--out-dir", str(tmp_path / "collected")])  # the table rebuilt from the saved results
    assert sorted((r["preset"], r["tok_per_s"]) for r in again) == sorted((r["preset"], r["tok_per_s"]) for r in rows)
    # a later run of the same point without the XLA baseline or the peer: its own numbers, the earlier baseline
    with open(tmp_path / "decode_v3-tiny_c2.json") as f:
        later = json.load(f)
    del later["runs_by_kernels"]["xla"]
    later.pop("peer_tok_per_s", None)
    later["runs_by_kernels"]["auto"]["none"]["tok_per_s"] *= 2
    with open(tmp_path / "later.json", "w") as f:
        json.dump(later, f)
    merged = sweep.main(["--collect", str(tmp_path / "decode_v3-tiny_c2.json"), str(tmp_path / "later.json"),
                         "--out-dir", str(tmp_path / "merged")])
    first = next(r for r in rows if r["preset"] == "v3-tiny")
    assert len(merged) == 1 and merged[0]["tok_per_s"] == 2 * first["tok_per_s"]
    assert merged[0]["xla_tok_per_s"] == first["xla_tok_per_s"] and merged[0]["peer_tok_per_s"] == first["peer_tok_per_s"]
    assert (tmp_path / "decode_sweep.png").stat().st_size > 1000
    import bench_decode
    out = tmp_path / "components.json"
    bench_decode.main(["--preset", "v3-tiny", "--concurrency", "2", "--input-len", "12", "--output-len", "10",
                       "--steps", "2", "--components", "--memory", "--json", str(out)])
    res = json.load(open(out))
    comp = res["components_s"]
    assert set(comp) == {"attention", "moe", "rest"} and comp["attention"] > 0 and comp["moe"] > 0
    mem = res["runs"]["none"]["memory"]
    assert mem["cache_bytes"] > 0 and mem["alias_bytes"] >= mem["cache_bytes"]  # the cache is donated
    assert mem["temp_bytes"] > 0


def test_random_fill_leaves_the_engine_as_a_prefill_would(tmp_path):
    """bench_decode --fill random against a real prefill of the same prompts: same blocks, cached
    lengths and queue state; the cache is written (finite, nonzero) and decode then runs on it."""
    import bench_decode
    import numpy as np
    from moejax.engine.sampling_params import SamplingParams
    from moejax.tiny.presets import preset
    from moejax.tiny.random_model import random_model
    engines = []
    seed = int(np.random.default_rng().integers(1 << 30))  # the same prompts for both fills
    for fill in ("prefill", "random"):
        m = random_model(preset("v3-tiny"), "float32", max_model_len=64, max_num_seqs=4, num_kv_blocks=16)
        eng = m.engine
        rng = np.random.default_rng(seed)
        seqs = [eng.add_request(rng.integers(2, 100, size=n).tolist(), SamplingParams(max_new_tokens=5))
                for n in (7, 16, 3)]
        if fill == "random":
            bench_decode.fill_without_prefill(eng)
        while eng.scheduler.waiting or eng.scheduler.prefilling:
            eng.step()
        engines.append((eng, seqs))
        cache = np.asarray(eng.runner.cache, np.float32)
        assert np.isfinite(cache).all() and np.abs(cache).max() > 0  # written, never zeros
    (e1, s1), (e2, s2) = engines
    assert [len(s) for s in s1] == [len(s) for s in s2] == [8, 17, 4]
    assert [s.num_cached_tokens for s in s1] == [s.num_cached_tokens for s in s2]
    assert [len(s.block_table) for s in s1] == [len(s.block_table) for s in s2]
    assert e1.scheduler.running == s1 and e2.scheduler.running == s2
    kind, stepped = e2.step()
    assert kind == "decode" and stepped == s2 and [len(s) for s in s2] == [9, 18, 5]


def test_a_failing_variant_is_recorded_and_the_others_kept(tmp_path, monkeypatch):
    """bench_decode: a variant that fails on the device (here the XLA baseline out of memory, as it
    was at Step3 c1024 on the H200) is recorded with its reason; the measured one stays in the JSON
    and in the sweep table."""
    import bench_decode
    real = bench_decode.run_one

    def run_one(hf, parallel, kernels, a, weight_dtype="bf16"):
        if kernels == "xla":
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 48.38GiB")
        return real(hf, parallel, kernels, a, weight_dtype)

    monkeypatch.setattr(bench_decode, "run_one", run_one)
    out = tmp_path / "decode_v3-tiny_c2.json"
    bench_decode.main(["--preset", "v3-tiny", "--concurrency", "2", "--input-len", "12", "--output-len", "10",
                       "--steps", "2", "--kernels", "auto,xla", "--fill", "random", "--json", str(out)])
    res = json.load(open(out))
    assert res["runs_by_kernels"]["auto"]["none"]["tok_per_s"] > 0 and "xla" not in res["runs_by_kernels"]
    assert res["failed"]["xla"]["none"].startswith("RESOURCE_EXHAUSTED")
    (row,) = sweep.main(["--collect", str(out), "--out-dir", str(tmp_path / "t")])
    assert row["xla_tok_per_s"] is None and row["failed"].startswith("xla: RESOURCE_EXHAUSTED")


def test_prefill_bench_packed_against_padded(tmp_path):
    """scripts/bench_prefill.py --mixed (tiny models, CPU): the packed step computes the prompts'
    tokens rounded to its bucket, fewer than the padded [B, pow2] layout, and both give each
    prompt's last logits alike (bf16: the padded layout is the reference)."""
    import bench_prefill
    out = tmp_path / "prefill.json"
    bench_prefill.main(["--smoke", "--mixed", "30,5,17", "--kernels", "xla", "--json", str(out)])
    res = json.loads(out.read_text())["presets"]
    for name in ("v3-tiny", "step3-tiny"):
        r = res[name]["mixed"]["30,5,17"]
        assert r["tokens"] == 52 and r["packed"]["tokens_computed"] == 64 and r["padded"]["tokens_computed"] == 96
        assert r["logits_rel_err"] < 2e-2 and r["packed"]["step_s"] > 0


def test_host_overhead_of_both_loops(tmp_path):
    """bench_decode --host-overhead (v3-tiny, CPU): the synchronous and the overlapped loop each get an
    engine step time, the compiled step's own time and their relative difference, in the JSON."""
    import bench_decode
    out = tmp_path / "host.json"
    bench_decode.main(["--preset", "v3-tiny", "--concurrency", "2", "--input-len", "12", "--output-len", "12",
                       "--steps", "3", "--warmup", "2", "--fill", "random", "--host-overhead", "--json", str(out)])
    res = json.loads(out.read_text())["host_overhead"]
    assert set(res) == {"sync", "async"}
    for r in res.values():
        assert r["engine_step_s"] > 0 and r["device_step_s"] > 0 and r["steps"] == 3
        assert r["host_overhead"] == pytest.approx((r["engine_step_s"] - r["device_step_s"]) / r["engine_step_s"])
