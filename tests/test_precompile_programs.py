"""The precompiled set is one list (ModelRunner.precompile_programs): precompile builds exactly its
programs, one each, and its total is the list's length, with and without a speculative proposer."""

import numpy as np
import pytest

import moejax
from moejax import compilation
from moejax.tiny.checkpoint import make_random_checkpoint
from moejax.tiny.presets import preset

KW = dict(dtype="float32", max_model_len=16, max_num_seqs=2, block_size=8, max_prefill_tokens=8, progress=False,
          compilation_cache_dir="off")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"checkpoint seed {seed}")
    return make_random_checkpoint(str(tmp_path_factory.mktemp("pp")), preset("v3-tiny", num_nextn_predict_layers=1),
                                  seed=seed, std=0.1)


@pytest.mark.parametrize("k", [0, 2])
def test_precompile_builds_the_listed_programs(ckpt, k):
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    runner = moejax.load(ckpt, **KW, speculative_config=spec).engine.runner
    programs = runner.precompile_programs()
    labels = [p.label for p in programs]
    assert len(set(labels)) == len(labels)
    assert any(lb.startswith("spec_verify") for lb in labels) == bool(k)
    assert any(lb.startswith("decode") for lb in labels) == (not k)
    built = compilation.COUNTER.snapshot()[0]
    assert runner.precompile(progress=False)["programs"] == len(programs)
    assert compilation.COUNTER.snapshot()[0] - built == len(programs)
