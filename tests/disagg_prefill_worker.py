"""A prefill process for tests/test_disaggregation.py: reads one JSON command a line from stdin, answers
one JSON line on stdout, until stdin closes.

  {"op": "rows", "shape": [L, P, D], "dtype": "bfloat16" | "float8_e4m3fn", "seed": s}
      random rows (every byte pattern, for FP8) offered through the transfer server;
      answers {"transfer": {"address", "uuid"}, "sha256": of the rows' bytes}
  {"op": "prefill", "prompt": [...], "params": {...}}   (needs the checkpoint path as argv[1])
      prefills the prompt, takes the sequence out with its rows and offers them; answers its metadata
      (PrefilledRequest.meta + "transfer"), or {"finished": output ids} when its first token ended it
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moejax  # noqa: E402
from moejax.engine.kv_handoff import take_prefilled  # noqa: E402
from moejax.engine.kv_transfer import KVTransfer  # noqa: E402
from moejax.engine.sampling_params import SamplingParams  # noqa: E402


def rows_sha(rows) -> str:
    return hashlib.sha256(np.asarray(jax.lax.bitcast_convert_type(rows, jnp.uint8)).tobytes()).hexdigest()


def main():
    xfer = KVTransfer()
    engine = None
    kv = os.environ.get("KV_CACHE_DTYPE", "auto")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "rows":
            rng = np.random.default_rng(cmd["seed"])
            dt = jnp.dtype(cmd["dtype"])
            raw = rng.integers(0, 256, size=(*cmd["shape"], dt.itemsize), dtype=np.uint8)
            rows = jax.lax.bitcast_convert_type(jnp.asarray(raw), dt) if dt.itemsize > 1 else \
                jax.lax.bitcast_convert_type(jnp.asarray(raw[..., 0]), dt)
            out = {"transfer": {"address": xfer.address, "uuid": xfer.offer(rows)}, "sha256": rows_sha(rows)}
        else:
            if engine is None:
                engine = moejax.load(sys.argv[1], dtype="float32", max_model_len=256, max_num_seqs=8,
                                     block_size=16, kv_cache_dtype=kv, enable_prefix_caching=False,
                                     kv_role="prefill", progress=False).engine
            seq = engine.add_request(cmd["prompt"], SamplingParams(**cmd["params"]))
            while seq.num_output_tokens == 0:
                engine.step()
            if seq.is_finished:
                out = {"finished": seq.output_ids}
            else:
                out = xfer.offer_request(take_prefilled(engine, seq))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
