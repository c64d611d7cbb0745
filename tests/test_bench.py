"""scripts/bench_serve.py metric definitions, scripts/sweep.py end to end on the tiny model (CPU), bench_decode and
profile_step."""

import csv
import json
import os
import sys

import jax
import numpy as np
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
                       "--out-dir", out, "--disable-tqdm", "--warmup", "--server-args=--no-precompile"])
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
    the saved JSON and merges a later partial run keeping the earlier baseline. (bench_decode's
    --components and --memory: test_a_failing_variant_is_recorded_and_the_others_kept.)"""
    rows = sweep.main(["--offline", "--presets", "v3-tiny", "--concurrency", "2",
                       "--random-input-len", "12", "--random-output-len", "10", "--steps", "2",
                       "--peer", "--fill", "random", "--out-dir", str(tmp_path)])
    assert [(r["preset"], r["concurrency"]) for r in rows] == [("v3-tiny", 2)]
    with open(tmp_path / "decode_sweep.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 1 and all(float(r["tok_per_s"]) > 0 and float(r["xla_tok_per_s"]) > 0 for r in got)
    assert float(got[0]["peer_tok_per_s"]) > 0
    again = sweep.main(["--collect", str(tmp_path / "decode_v3-tiny_c2.json"),
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


def test_random_fill_leaves_the_engine_as_a_prefill_would(tmp_path):
    """bench_decode --fill random against a real prefill of the same prompts: same blocks, cached
    lengths and queue state; the cache is written (finite, nonzero) and decode then runs on it."""
    import bench_decode
    import numpy as np
    from moejax.engine.sampling_params import SamplingParams
    from moejax.tiny.presets import preset
    from moejax.model import random_model
    engines = []
    seed = int(np.random.default_rng().integers(1 << 30))  # the same prompts for both fills
    for fill in ("prefill", "random"):
        m = random_model(preset("v3-tiny"), "float32", max_model_len=64, max_num_seqs=4, num_kv_blocks=16)
        eng = m.engine
        rng = np.random.default_rng(seed)
        # ignore_eos as the benchmark sets it: a random model may sample EOS first and finish a sequence
        seqs = [eng.add_request(rng.integers(2, 100, size=n).tolist(), SamplingParams(max_new_tokens=5, ignore_eos=True))
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
    and in the sweep table. The same run (its cache filled by a real prefill, bench_decode's default)
    splits the step into components and counts the donated cache in the aliased bytes (--components,
    --memory; one bench_decode run for both checks)."""
    import bench_decode
    real = bench_decode.run_one

    def run_one(hf, parallel, kernels, a, weight_dtype="bf16"):
        if kernels == "xla":
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 48.38GiB")
        return real(hf, parallel, kernels, a, weight_dtype)

    monkeypatch.setattr(bench_decode, "run_one", run_one)
    out = tmp_path / "decode_v3-tiny_c2.json"
    bench_decode.main(["--preset", "v3-tiny", "--concurrency", "2", "--input-len", "12", "--output-len", "10",
                       "--steps", "2", "--kernels", "auto,xla", "--components", "--memory", "--json", str(out)])
    res = json.load(open(out))
    assert res["runs_by_kernels"]["auto"]["none"]["tok_per_s"] > 0 and "xla" not in res["runs_by_kernels"]
    assert res["failed"]["xla"]["none"].startswith("RESOURCE_EXHAUSTED")
    comp = res["components_s"]  # of the first kernel mode, auto (the one measured)
    assert set(comp) == {"attention", "moe", "rest"} and comp["attention"] > 0 and comp["moe"] > 0
    mem = res["runs"]["none"]["memory"]
    assert mem["cache_bytes"] > 0 and mem["alias_bytes"] >= mem["cache_bytes"]  # the cache is donated
    assert mem["temp_bytes"] > 0
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


def test_profile_step_table_on_tiny_model(tmp_path, capsys):
    """scripts/profile_step.py (v3-tiny, CPU): the per-op table of the decode step from the profiler's
    trace has rows in the table's categories whose shares sum to 100%, the category summary adds up to
    the same, the sampler's ops are told from the step's, and the step's cost analysis is reported."""
    import profile_step
    out, table = tmp_path / "prof.json", tmp_path / "prof.csv"
    res = profile_step.main(["--preset", "v3-tiny", "--concurrency", "8", "--input-len", "64", "--steps", "3",
                             "--warmup", "2", "--top", "10", "--json", str(out), "--csv", str(table)])
    printed = capsys.readouterr().out
    assert "category" in printed and "moe/experts" in printed and "cost analysis" in printed
    saved = json.loads(out.read_text())
    assert saved["ops"] == json.loads(json.dumps(res["ops"]))
    ops, cats = saved["ops"], saved["categories"]
    assert len(ops) > 20 and all(r["time_s"] > 0 and r["count"] > 0 for r in ops)
    assert sum(r["share"] for r in ops) == pytest.approx(1.0, abs=1e-6)
    assert sum(c["share"] for c in cats) == pytest.approx(1.0, abs=1e-6)
    assert {r["category"] for r in ops} <= set(profile_step.CATEGORIES)
    assert {"attention", "moe/experts", "dense matmul", "lm_head", "sampling/sort"} <= {c["category"] for c in cats}
    assert all(r["category"] == "sampling/sort" for r in ops if r["program"] == "sample")
    assert {r["program"] for r in ops} == {"decode", "sample"}  # the synchronous loop: no token feed
    assert 0 < saved["busy_s"] <= saved["op_s"] * 1.001 and saved["step_s"] >= saved["busy_s"] * 0.99
    assert saved["cost"]["flops"] > 0 and saved["cost"]["bytes"] > 0 and saved["achieved_bytes_per_s"] > 0
    with open(table) as f:
        assert len(list(csv.DictReader(f))) == len(ops)


def test_profile_step_reads_a_gpu_trace():
    """profile_step's trace reading on a GPU-shaped trace (no GPU needed): only the stream lines' kernels
    are summed (not the XLA Ops / XLA Modules lines that repeat them), each kernel goes to the program
    whose execution span holds it even where two programs have an op of the same name, ops get their
    category from their HLO metadata, and a dot's FLOPs come from its shapes."""
    import profile_step
    decode = profile_step.Program("decode", """HloModule jit_per_rank, entry_computation_layout={(bf16[8,64]{1,0})->bf16[8,64]{1,0}}

%fused_dot (param_0: bf16[8,64], param_1: bf16[64,64]) -> bf16[8,64] {
  %param_0 = bf16[8,64]{1,0} parameter(0)
  %param_1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,64]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(per_rank)/DeepseekForCausalLM.decode/layers_0.decode/self_attn.decode/o_proj/dot_general"}
}

ENTRY %main (p0: bf16[8,64], p1: bf16[64,64]) -> bf16[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0), metadata={op_name="args[0]"}
  %p1 = bf16[64,64]{1,0} parameter(1), metadata={op_name="params['layers_0']['self_attn']['o_proj']['weight']"}
  %fusion.1 = bf16[8,64]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%fused_dot
  ROOT %add.3 = bf16[8,64]{1,0} add(%fusion.1, %p0), metadata={op_name="jit(per_rank)/DeepseekForCausalLM.decode/layers_0.decode/add"}
}
""")
    sample = profile_step.Program("sample", """HloModule jit_per_rank

%fused_argmax (param_0: f32[8,320]) -> s32[8] {
  %param_0 = f32[8,320]{1,0} parameter(0)
  ROOT %reduce.2 = s32[8]{0} reduce(%param_0), dimensions={1}, metadata={op_name="jit(per_rank)/argmax"}
}

ENTRY %main.2 (p0: f32[8,320]) -> s32[8] {
  %p0 = f32[8,320]{1,0} parameter(0)
  ROOT %fusion.1 = s32[8]{0} fusion(%p0), kind=kInput, calls=%fused_argmax
}
""")
    assert decode.op_flops("fusion.1") == 2 * 8 * 64 * 64 and decode.op_bytes("fusion.1") == (512 + 4096 + 512) * 2
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}}]
    meta += [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
             for t, n in ((1, "Stream #7(Compute)"), (2, "Stream #8(MemcpyH2D)"), (3, "XLA Ops"), (4, "XLA Modules"))]
    ev = []
    for step, t0 in enumerate((0.0, 1000.0)):
        kern = lambda tid, ts, dur, name, op: {"ph": "X", "pid": 1, "tid": tid, "ts": t0 + ts, "dur": dur,  # noqa: E731
                                               "name": name, "args": {"hlo_op": op, "hlo_module": "jit_per_rank"}}
        ev += [{"ph": "X", "pid": 701, "tid": 9, "ts": t0, "dur": 200.0, "name": "profile_step", "args": {"step": str(step)}},
               {"ph": "X", "pid": 1, "tid": 4, "ts": t0 + 5, "dur": 100.0, "name": "jit_per_rank(1)"},
               kern(1, 10, 60.0, "gemm_kernel_sm90", "fusion.1"), kern(3, 10, 60.0, "fusion.1", "fusion.1"),
               kern(1, 80, 4.0, "loop_add_fusion", "add.3"),
               {"ph": "X", "pid": 1, "tid": 2, "ts": t0 + 108, "dur": 2.0, "name": "MemcpyH2D", "args": {}},
               {"ph": "X", "pid": 1, "tid": 4, "ts": t0 + 110, "dur": 30.0, "name": "jit_per_rank(2)"},
               kern(1, 112, 20.0, "input_reduce_fusion", "fusion.1"), kern(3, 112, 20.0, "fusion.1", "fusion.1")]
    res = profile_step.analyze({"traceEvents": meta + ev}, [decode, sample], steps=2)
    rows = {(r["program"], r["name"]): r for r in res["ops"]}
    assert set(rows) == {("decode", "fusion.1"), ("decode", "add.3"), ("sample", "fusion.1"), ("", "MemcpyH2D")}
    assert [rows[k]["category"] for k in sorted(rows)] == ["copy", "norm/rope/elementwise", "dense matmul",
                                                    "sampling/sort"]
    assert rows[("decode", "fusion.1")]["time_s"] == pytest.approx(60e-6) and rows[("decode", "fusion.1")]["count"] == 1
    assert rows[("decode", "fusion.1")]["flops_per_s"] == pytest.approx(2 * 8 * 64 * 64 / 60e-6)
    assert res["op_s"] == pytest.approx(86e-6) and res["busy_s"] == pytest.approx(86e-6)
    assert res["step_s"] == pytest.approx(200e-6) and sum(r["share"] for r in res["ops"]) == pytest.approx(1.0)


def test_profile_step_tells_programs_apart_by_module_name():
    """Two programs with the same op names (a speculative verify and draft both run fusion.1): each
    execution span goes to the program of its HLO module's name, which Jaccard over op names could not tell."""
    import profile_step
    hlo = """HloModule jit_{name}

%fused (param_0: f32[8,64]) -> f32[8,64] {{
  ROOT %param_0 = f32[8,64]{{1,0}} parameter(0)
}}

ENTRY %main (p0: f32[8,64]) -> f32[8,64] {{
  %p0 = f32[8,64]{{1,0}} parameter(0)
  ROOT %fusion.1 = f32[8,64]{{1,0}} fusion(%p0), kind=kLoop, calls=%fused
}}
"""
    progs = [profile_step.Program(n, hlo.format(name=n)) for n in ("spec_verify", "spec_draft")]
    assert [p.module for p in progs] == ["jit_spec_verify", "jit_spec_draft"]
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    meta += [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
             for t, n in ((1, "Stream #7(Compute)"), (4, "XLA Modules"))]
    ev = [{"ph": "X", "pid": 1, "tid": 4, "ts": 0.0, "dur": 50.0, "name": "jit_spec_draft(7)"},
          {"ph": "X", "pid": 1, "tid": 1, "ts": 5.0, "dur": 30.0, "name": "k", "args": {"hlo_op": "fusion.1"}},
          {"ph": "X", "pid": 1, "tid": 4, "ts": 60.0, "dur": 50.0, "name": "jit_spec_verify(8)"},
          {"ph": "X", "pid": 1, "tid": 1, "ts": 65.0, "dur": 10.0, "name": "k", "args": {"hlo_op": "fusion.1"}}]
    events, _, modules = profile_step.op_events({"traceEvents": meta + ev})
    assert profile_step.assign_programs(events, progs, modules) == ["spec_draft", "spec_verify"]


def test_bench_spec_decode_runs_on_cpu(tmp_path):
    """bench_spec_decode.py on the tiny preset (with its MTP layer): a step time for each (batch, k) and the
    projection sum_{i<=k} a^i x batch / step time (k = 0: batch / step time at every rate)."""
    import bench_spec_decode
    out = tmp_path / "spec.json"
    (run,) = bench_spec_decode.main(["--preset", "v3-tiny", "--batch", "2", "--k", "0,1", "--input-len", "8",
                                     "--steps", "2", "--dtype", "float32", "--json", str(out)])
    rows = run["rows"]
    assert [(r["batch"], r["k"]) for r in rows] == [(2, 0), (2, 1)]
    assert json.load(open(out))["rows"] == rows
    for r in rows:
        step = r["step_ms"] / 1e3
        assert step > 0 and r["measured_tok_per_s"] > 0
        np.testing.assert_allclose(r["projected_tok_per_s"]["0.8"],
                                   2 * sum(0.8 ** i for i in range(r["k"] + 1)) / step, rtol=1e-9)
    assert bench_spec_decode.expected_tokens(0.9, 2) == pytest.approx(1 + 0.9 + 0.81)


def test_bench_spec_decode_projects_to_depth(tmp_path, capsys):
    """Runs at two layer counts -> each (batch, k) fitted as fixed + per-layer cost (exact for exact lines),
    projected to the preset's depth, its ratio to k = 0 and tokens/s against k = 0 at each acceptance rate;
    one layer count is refused (nothing to fit)."""
    import bench_spec_decode
    rng = np.random.default_rng()
    fixed, per = {0: 1.0, 1: 2.5}, {0: 0.5, 1: 0.6}  # ms, drawn lines below
    fixed = {k: v * rng.uniform(0.5, 2) for k, v in fixed.items()}
    files = []
    for L in (2, 4):
        rows = [{"batch": 16, "k": k, "step_ms": fixed[k] + per[k] * L} for k in (0, 1)]
        f = tmp_path / f"l{L}.json"
        f.write_text(json.dumps({"preset": "deepseek-v3-ep8-rank", "layers": L, "device": "cpu", "rows": rows}))
        files.append(str(f))
    runs = bench_spec_decode.main(["--project", *files, "--acceptance", "0.8"])
    out = bench_spec_decode.print_depth_projection(runs, 61, [0.8])
    by_k = {r["k"]: r for r in out}
    for k in (0, 1):
        assert by_k[k]["step_ms"] == pytest.approx(fixed[k] + per[k] * 61)
    ratio = (fixed[1] + per[1] * 61) / (fixed[0] + per[0] * 61)
    assert by_k[1]["ratio_to_plain"] == pytest.approx(ratio)
    assert by_k[1]["tok_s_vs_plain"]["0.8"] == pytest.approx(1.8 / ratio)
    assert "PROJECTION to 61 layers" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="two or more layer counts"):
        bench_spec_decode.main(["--project", files[0]])


def test_bench_serve_spec_decode_summary():
    """The acceptance rate bench_serve.py reports from the server's spec_decode counters (before/after the
    run); nothing when the server reports none."""
    lab = '{model_name="m",position="%d"}'
    before = {"vllm:spec_decode_num_drafts_total": 10, "vllm:spec_decode_num_draft_tokens_total": 20,
              "vllm:spec_decode_num_accepted_tokens_total": 5,
              "vllm:spec_decode_num_accepted_tokens_per_pos_total" + lab % 0: 4,
              "vllm:spec_decode_num_accepted_tokens_per_pos_total" + lab % 1: 1}
    after = {"vllm:spec_decode_num_drafts_total": 110, "vllm:spec_decode_num_draft_tokens_total": 220,
             "vllm:spec_decode_num_accepted_tokens_total": 145,
             "vllm:spec_decode_num_accepted_tokens_per_pos_total" + lab % 0: 84,
             "vllm:spec_decode_num_accepted_tokens_per_pos_total" + lab % 1: 61}
    s = bench_serve.spec_decode_stats(before, after)
    assert s["spec_acceptance_rate"] == pytest.approx(140 / 200)
    assert s["spec_acceptance_length"] == pytest.approx(1 + 140 / 100)
    assert s["spec_acceptance_per_pos"] == pytest.approx([0.8, 0.6])
    assert bench_serve.spec_decode_stats({}, {}) == {}
