"""Greedy tokens against themselves: 32 random-dataset prompts sent within a batch of 256 (the server's
max_num_seqs, as in the 4096-stream run) and one at a time to the server on PORT. Prints how many agree
and, where they differ, the gap between the two best logprobs of the batched run at the first differing
position (top_logprobs=2). A float32 server agrees on all; in bfloat16 a rounding that depends on the
batch shape can flip a near-tie of the output or of an MoE routing choice upstream (then the output gap
can be large).

  python greedy_batch_vs_alone.py PORT
"""
import asyncio
import os
import sys

import aiohttp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bench_serve  # noqa: E402

port = sys.argv[1]
reqs = bench_serve.random_requests(bench_serve._tokenizer(None), 4096, 32, 32, 0.0, 0)
batch = np.random.default_rng().choice(4096, 256, replace=False)
idx = batch[:32]


async def one(s, i):
    body = {"prompt": reqs[int(i)].prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True}
    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        lp = (await r.json())["choices"][0]["logprobs"]
        return [int(t.split(":")[1]) for t in lp["tokens"]], lp["top_logprobs"]


async def main():
    async with aiohttp.ClientSession() as s:
        together = (await asyncio.gather(*(one(s, i) for i in batch)))[:32]
        alone = [await one(s, i) for i in idx]
    return together, alone

together, alone = asyncio.run(main())
gaps = []
for (a, ta), (b, _) in zip(together, alone):
    if a != b:
        k = next(j for j in range(len(a)) if a[j] != b[j])
        v = sorted(ta[k].values(), reverse=True)
        gaps.append(v[0] - v[1])
print(f"batched vs one at a time: {len(idx) - len(gaps)}/{len(idx)} identical; top-2 logprob gap at the first "
      f"difference: {['%.4f' % g for g in gaps]}")
