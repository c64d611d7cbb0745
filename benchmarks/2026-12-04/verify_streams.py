"""Checks a bench_serve result of the random dataset (seed 0, range ratio 0) against the server still
running on PORT: every stream finished with all its tokens and no error, and 64 streamed texts drawn at
random equal the server's non-streaming greedy (temperature 0) answers to the same prompts.

  python verify_streams.py bench_result.json PORT
"""
import asyncio
import json
import os
import sys

import aiohttp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bench_serve  # noqa: E402

res, port = json.load(open(sys.argv[1])), sys.argv[2]
n, in_len, out_len = res["num_prompts"], res["input_lens"][0], max(res["output_lens"])
reqs = bench_serve.random_requests(bench_serve._tokenizer(None), n, in_len, out_len, 0.0, 0)
assert res["input_lens"] == [r.prompt_len for r in reqs], "not the random dataset of seed 0"
errors = [e for e in res["errors"] if e]
print(f"streams: {n}, completed {res['completed']}, failed {res['failed']}, errors {len(errors)}, "
      f"all {out_len} tokens: {all(x == out_len for x in res['output_lens'])}")
sample = np.random.default_rng().choice(n, min(64, n), replace=False)


async def main():
    async with aiohttp.ClientSession() as s:
        async def one(i):
            body = {"prompt": reqs[i].prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True}
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                return (await r.json())["choices"][0]["text"]
        return await asyncio.gather(*(one(int(i)) for i in sample))

texts = asyncio.run(main())
same = sum(t == res["generated_texts"][int(i)] for i, t in zip(sample, texts))
print(f"streamed text == non-streaming greedy text: {same}/{len(sample)}")
