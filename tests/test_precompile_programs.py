"""The precompiled set is one list (ModelRunner.precompile_programs): precompile builds exactly its
programs, one each, no two of them the same program (function and call signature), and its total is the
list's length, with and without a speculative proposer; print_programs (--print-programs) lists each with
its bucket and why it exists."""

import pytest

import moejax
from moejax import compilation
from moejax.executable_cache import PrecompiledFunction
from moejax.server.cli import build_parser
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
    same = {(p.fn.name, p.fn.signature(p.args)) if isinstance(p.fn, PrecompiledFunction) else (id(p.fn), p.label)
            for p in programs}
    assert len(same) == len(programs)  # no program built twice under two labels
    assert any(lb.startswith("spec_verify") for lb in labels) == bool(k)
    assert any(lb.startswith("decode") for lb in labels) == (not k)
    built = compilation.COUNTER.snapshot()[0]
    assert runner.precompile(progress=False)["programs"] == len(programs)
    assert compilation.COUNTER.snapshot()[0] - built == len(programs)


def test_print_programs_lists_each_with_its_bucket_and_why(ckpt, capsys):
    assert build_parser().parse_args(["--print-programs"]).print_programs  # the flag, from the declaration
    runner = moejax.load(ckpt, **KW, print_programs=True).engine.runner
    n = runner.precompile(progress=False)["programs"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()[:1].isdigit()]
    assert len(lines) == n
    for i, ln in enumerate(lines, 1):
        number, label, why = ln[:4].strip(), ln[6:78].strip(), ln[78:].strip()  # describe's columns
        assert int(number) == i and label and why
    decode = [ln for ln in lines if ln[6:].startswith("decode B=")]
    assert decode and all("block tables" in ln for ln in decode)
    sampler = [ln for ln in lines if ln[6:].startswith("sample rows=")]
    assert sampler and all("rows of: " in ln for ln in sampler)
