"""The precompiled set is one list (ModelRunner.precompile_programs): precompile builds exactly its
programs, one each, no two of them the same program (function and call signature), and its total is the
list's length, with and without a speculative proposer; print_programs (--print-programs) lists each with
its bucket and why it exists."""

import numpy as np
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


def test_kv_role_builds_its_side_of_the_handoff_only(ckpt):
    """kv_role (engine_args.py): a plain engine lists no cache-row export/import program, a prefill side one
    export a rows bucket, a decode side one import, both each (one bucket, 16 rows, at max_model_len 16), the
    rest of the set the same. A precompiled prefill side hands a sequence out compiling nothing; the import it
    never built is a ValueError naming kv_role, compiling and allocating nothing; a plain engine refuses both."""
    from moejax.engine.kv_handoff import add_prefilled, take_prefilled
    from moejax.engine.sampling_params import SamplingParams
    engines = {role: moejax.load(ckpt, **KW, kv_role=role).engine for role in ("none", "prefill", "decode")}
    sets = {role: [p.label for p in e.runner.precompile_programs()] for role, e in engines.items()}
    base = sets["none"]
    assert not any(lb.split()[0] in ("export_rows", "import_rows") for lb in base)
    assert sets["prefill"] == base + ["export_rows P=16"] and sets["decode"] == base + ["import_rows P=16"]
    both = moejax.load(ckpt, **KW, kv_role="both").engine.runner
    assert [p.label for p in both.precompile_programs()] == base + ["export_rows P=16", "import_rows P=16"]

    plain = engines["none"].runner
    with pytest.raises(ValueError, match="kv_role is 'none'.*does not export"):
        plain.export_rows(np.arange(3))
    with pytest.raises(ValueError, match="kv_role is 'none'.*does not import"):
        plain.import_rows(np.arange(3), np.zeros((plain.cache.shape[1], 16, plain.row_dim), plain.row_dtype))
    eng = engines["prefill"]
    assert eng.precompile(progress=False)["programs"] == len(sets["prefill"])
    built = compilation.COUNTER.snapshot()[0]
    seq = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    req = take_prefilled(eng, seq)
    assert req.rows.shape[1] == 16 and compilation.COUNTER.snapshot()[0] == built
    free = eng.blocks.num_free
    with pytest.raises(ValueError, match="kv_role is 'prefill'.*does not import.*'decode' or 'both'"):
        add_prefilled(eng, req)
    assert eng.blocks.num_free == free and eng.runner.trace_counts["import_rows"] == 0
    assert compilation.COUNTER.snapshot()[0] == built


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
