"""A prefix-cache hit against the same prompt fresh (issue 30: the hit compiled a new program inside the request,
5.1 s against 27 ms). Programs for both paths are compiled first (precompile); then a 2000-token prompt is
prefilled fresh, and sent again (all but its last block from the prefix cache). Median of 5 each."""
import statistics
import time

import numpy as np

import moejax

m = moejax.load("deepseek-v2-lite", load_format="dummy", max_num_seqs=4, max_model_len=2176, max_prefill_tokens=2048,
                precompile=True,
                progress=False)
rng = np.random.default_rng(0)
fresh, hit = [], []
for i in range(5):
    prompt = rng.integers(0, 100000, size=2000).tolist()
    for out in (fresh, hit):
        t = time.perf_counter()
        moejax.generate(m, [prompt], max_new_tokens=1)
        out.append(time.perf_counter() - t)
print(f"2000-token prompt, 1 output token: fresh median {1e3 * statistics.median(fresh):.1f} ms "
      f"({', '.join(f'{1e3 * x:.1f}' for x in fresh)}); prefix hit median {1e3 * statistics.median(hit):.1f} ms "
      f"({', '.join(f'{1e3 * x:.1f}' for x in hit)})")
print(f"prefix hits: {m.engine.stats.prefix_cache_hits} of {m.engine.stats.prefix_cache_queries} tokens")
