"""The precompiled set is one list (ModelRunner.precompile_programs): precompile builds exactly its
programs, one each, and its total is the list's length, with and without a speculative proposer."""

import pytest

import moejax
from moejax import compilation
from conftest import SMALL_ENGINE as KW, random_v3_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_v3_tiny(tmp_path_factory, "pp", num_nextn_predict_layers=1)


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
