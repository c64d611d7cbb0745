"""The generate half of tests/test_multiprocess.py: loads a checkpoint with each layout, generates,
scores, rebalances (EPLB layouts) and round-trips an orbax save (the weights read back equal the
saved model's), returning what it computed.

The test runs it in its own process (1 process x 8 devices: the reference) and, through
``python -m moejax.launch``, as ``python tests/multiprocess_generate.py CKPT SPEC OUT`` in every
process of a job (2 x 4); process 0 writes the results to OUT (JSON)."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moejax
from moejax.model import _logical_params as logical_params
from moejax.parallel import processes


def _load(path, layout):
    return moejax.load(path, dtype="float32", parallel=layout, max_model_len=96, max_num_seqs=4, num_kv_blocks=24,
                       progress=False)


def _generate(model, spec) -> dict:
    out = moejax.generate(model, spec["prompts"], max_new_tokens=spec["max_new_tokens"], ignore_eos=True,
                          logprobs=True, top_logprobs=2)
    return {"tokens": [r.token_ids for r in out], "logprobs": [r.logprobs for r in out],
            "top": [[sorted(t.items()) for t in r.top_logprobs] for r in out]}


def _same_weights(a, b) -> bool:
    """Whether two models hold bitwise the same weights, experts in logical order (whatever EPLB moved):
    compared on the devices, one program, a replicated answer every process can read."""
    same = jax.jit(lambda x, y: jnp.all(jnp.stack([jnp.array_equal(u, v) for u, v in
                                                   zip(jax.tree.leaves(x), jax.tree.leaves(y))])))
    return bool(same(logical_params(a), logical_params(b)))


def run(path: str, spec: dict) -> dict:
    results = {}
    for name, layout in spec["layouts"].items():
        model = _load(path, layout)
        r = _generate(model, spec)
        r["logits"] = model.score(np.array(spec["score_ids"], np.int32)).tolist()
        bal = model.engine.balancer
        r["rebalances"] = bal.num_rebalances
        r["placements"] = {"/".join(k): p.logical_of_slot.tolist() for k, p in bal.placements.items()}
        r["window_load"] = bal.window_load().tolist()
        if name in spec.get("save_layouts", ()):  # orbax: every process writes its shards, then reads them back
            saved = os.path.join(spec["save_dir"], name)
            moejax.save(model, saved)
            r["reloaded_equal"] = _same_weights(_load(saved, layout), model)
        results[name] = r
    return results


if __name__ == "__main__":
    ckpt, spec_file, out_file = sys.argv[1:4]
    with open(spec_file) as f:
        got = run(ckpt, json.load(f))
    if processes.is_leader():
        with open(out_file, "w") as f:
            json.dump({"processes": processes.count(), "results": got}, f)
