"""Issue 18: the decode step's host-side input building, the old per-row loop (its code as it was,
below) against the current ModelRunner.dispatch_decode, interleaved in one process. The jitted step is
replaced by a stub that returns at once, so only the host's Python/NumPy work is timed; both must
build the same arrays.
  python benchmarks/2026-12-05/host_inputs_ab.py [concurrency] [context]"""
import os, sys, time, types
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import numpy as np
import bench_decode as bd
from moejax.engine.model_runner import DecodeStep, next_pow2
from moejax.layers.sampler import SampleMode
from moejax.tiny.presets import preset
from moejax.tiny.random_model import random_model
from moejax.engine.sampling_params import SamplingParams


def old_dispatch_decode(self, seqs, prev=None):
    """dispatch_decode before the NumPy input building (a Python loop setting each row's fields)."""
    ranks, per_rank = self._by_rank(seqs)
    N, B = self.num_ranks, min(next_pow2(per_rank), next_pow2(self.max_num_seqs))
    nb = min(next_pow2(max(len(s.block_table) for s in seqs)), next_pow2(self.max_blocks_per_seq))
    tokens, positions, lens = (np.zeros((N, B), np.int32) for _ in range(3))
    rows = np.full((N, B), -1, np.int32)
    slots = np.full((N, B), self.num_slots, np.int32)
    tables = np.zeros((N, B, nb), np.int32)
    index = {}
    for r, rs in enumerate(ranks):
        for i, s in enumerate(rs):
            pos = len(s) - 1 + s.num_pending_tokens
            if s.num_pending_tokens:
                rows[r, i] = prev.index[s.seq_id][1]
            else:
                tokens[r, i] = s.token_ids[-1]
            positions[r, i], lens[r, i] = pos, pos + 1
            slots[r, i] = s.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
            tables[r, i, :len(s.block_table)] = s.block_table
            index[s.seq_id] = (r, i)
    self.cache, sampled, counts, dispatched = self._decode(self.params, self.routing, self.cache, tokens, positions,
                                                           slots, tables, lens, self._sampling_arrays(ranks, B),
                                                           mode=SampleMode.of(s.params for s in seqs))
    for s in seqs:
        s.num_pending_tokens += 1
    return DecodeStep(list(seqs), sampled, index)


C = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 1900
m = random_model(preset("v3-tiny"), "float32", kernels="xla", max_model_len=ctx + 64, max_num_seqs=C,
                 block_size=64, num_kv_blocks=C * (-(-(ctx + 64) // 64)))
eng, r = m.engine, m.engine.runner
rng = np.random.default_rng(0)
for _ in range(C):
    eng.add_request(rng.integers(2, 300, size=ctx).tolist(),
                    SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.7, seed=int(rng.integers(1 << 30))))
bd.fill_without_prefill(eng)
seqs = list(eng.scheduler.running)
got = {}
def stub(params, routing, cache, *args, mode):
    got["args"] = args
    return cache, None, None, None
r._decode, r._record = stub, lambda *a: None
variants = {"old": types.MethodType(old_dispatch_decode, r), "new": r.dispatch_decode}
ref = {}
for name, f in variants.items():  # the same arrays from both
    f(seqs)
    for s in seqs: s.num_pending_tokens -= 1
    ref[name] = [np.asarray(a) if not isinstance(a, tuple) else tuple(map(np.asarray, a)) for a in got["args"]]
for a, b in zip(ref["old"], ref["new"]):
    if isinstance(a, tuple):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    else:
        assert np.array_equal(a, b), (a, b)
times = {k: [] for k in variants}
for rep in range(30):
    for name, f in variants.items():
        t = time.perf_counter(); f(seqs); times[name].append(time.perf_counter() - t)
        for s in seqs: s.num_pending_tokens -= 1
for name, ts in times.items():
    ts = np.array(ts[5:]) * 1e3
    print(f"{name}: dispatch_decode host work at c{C} ctx{ctx}: median {np.median(ts):.2f} ms (p10 {np.percentile(ts, 10):.2f}, p90 {np.percentile(ts, 90):.2f})")
if os.environ.get("PROFILE"):
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20):
        variants["new"](seqs)
        for s in seqs: s.num_pending_tokens -= 1
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
