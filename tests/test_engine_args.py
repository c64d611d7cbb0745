"""moejax/engine_args.py: every engine setting declared once, and everything derived from it.

- every declared setting is a flag of ``moejax serve`` (and scripts/serve.py, scripts/generate.py) with
  the declaration's default and choices, and a keyword of ``moejax.load`` with its default;
- settings round-trip through argv: ``from_cli_args(parse(to_argv(x))) == x``, the disaggregated
  workers' argv included;
- ``moejax.load`` refuses an unknown keyword and a bad value with a ValueError naming it, the command
  line with a usage error;
- a kernel override set on the engine reaches kernel selection while the step is traced, and only then;
- a setting added to the declaration is a flag and an EngineConfig attribute with nothing else written;
  one field added to a copy of moejax/engine_args.py is a keyword of ``moejax.load``, an attribute of the
  loaded engine's EngineConfig and a flag of ``moejax serve --help``.
"""

import argparse
import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import moejax
from moejax import cli as moejax_cli
from moejax.kernels import common as ks, moe as moe_kernels
from moejax.config import EngineConfig
from moejax.engine_args import EngineArgs, positive_int, setting
from moejax.server import cli as serve_cli
from moejax.tiny.presets import preset
from pallas_kernels import triton_fp8_dots

REPO = Path(__file__).resolve().parent.parent
FIELDS = dataclasses.fields(EngineArgs)
OVERRIDES = {"moe_kernel": ks.MOE_KERNEL_ENV, "w8a8_kernel": ks.W8A8_KERNEL_ENV,
             "w8a8_dense_kernel": ks.W8A8_DENSE_KERNEL_ENV, "mla_kernel": ks.MLA_KERNEL_ENV}
# Non-default values of the settings whose values are not just a choice, a bool or a number.
SAMPLES = {"fp8_layers": "experts,attention", "parallel": "dp2-ep2", "scheduling_policy": "interleave:2",
           "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
           "compilation_cache_dir": "/tmp/moejax-cache", "executable_cache_dir": "/tmp/moejax-executables", "max_model_len": 512, "num_kv_blocks": 99,
           "gpu_memory_utilization": 0.5}


def _other_value(f: dataclasses.Field):
    """A valid value of the setting other than its default."""
    if f.name in SAMPLES:
        return SAMPLES[f.name]
    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != f.default)
    if isinstance(f.default, bool):
        return not f.default
    if isinstance(f.default, int):
        return f.default + 3
    raise AssertionError(f"no sample value for the setting {f.name}: add one to SAMPLES")


def all_changed() -> EngineArgs:
    return EngineArgs(**{f.name: _other_value(f) for f in FIELDS})


def _flags(parser: argparse.ArgumentParser) -> dict:
    return {opt: action for action in parser._actions for opt in action.option_strings}


@pytest.mark.parametrize("which", ["declaration", "moejax serve"])
def test_every_setting_is_a_flag_with_its_default_and_choices(which):
    """Invariant: each EngineArgs field is a --flag of its name with the declaration's default (moejax serve's
    own defaults where it has one: it precompiles) and choices; bools are --x / --no-x."""
    if which == "declaration":
        parser, defaults = argparse.ArgumentParser(), {}
        EngineArgs.add_cli_args(parser)
    else:
        parser, defaults = serve_cli.build_parser(), serve_cli.SERVE_DEFAULTS
    flags = _flags(parser)
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        assert flag in flags, f"{f.name} has no flag {flag}"
        action = flags[flag]
        assert action.dest == f.name and action.default == defaults.get(f.name, f.default), f.name
        assert (tuple(action.choices) if action.choices else None) == f.metadata["choices"], f.name
        assert action.help == f.metadata["help"], f.name
        if isinstance(f.default, bool):
            assert "--no-" + flag[2:] in flags, f.name
    assert parser.parse_args([]).precompile is (which == "moejax serve")


def test_every_setting_is_a_keyword_of_load_with_its_default():
    """moejax.load's signature (and docstring) is derived from the declaration: every setting a keyword-only
    parameter with the declaration's default; the load's own parameters are path and progress."""
    params = inspect.signature(moejax.load).parameters
    assert list(params)[:2] == ["path", "progress"]
    for f in FIELDS:
        p = params[f.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == f.default, f.name
        assert f"``{f.name}``" in moejax.load.__doc__, f.name
    assert set(params) == {"path", "progress", *EngineArgs.names()}


def test_help_of_the_commands_lists_every_setting(capsys):
    """`moejax serve --help`, the scripts/serve.py shim (the same main) and scripts/generate.py --help show
    every setting's flag; the console script is declared in pyproject.toml."""
    with pytest.raises(SystemExit) as e:
        moejax_cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moejax serve")
    generate = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), "--help"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert generate.returncode == 0, generate.stderr[-2000:]
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        assert flag in out and flag in generate.stdout, f.name
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["moejax"] == "moejax.cli:main"
    shim = (REPO / "scripts" / "serve.py").read_text()
    assert "from moejax.server.cli import" in shim and len(shim.splitlines()) <= 20  # a thin shim


@pytest.mark.parametrize("parser", ["declaration", "moejax serve"])
@pytest.mark.parametrize("args", ["defaults", "all changed"])
def test_round_trip_through_argv(parser, args):
    """from_cli_args(parse(to_argv(x))) == x, for the defaults and for every setting changed at once, through
    a parser of the declaration's defaults and through moejax serve's (other defaults: to_argv spells out all)."""
    x = EngineArgs() if args == "defaults" else all_changed()
    if args == "all changed":
        assert all(getattr(x, f.name) != f.default for f in FIELDS)  # every setting is covered
    if parser == "declaration":
        ap = argparse.ArgumentParser()
        EngineArgs.add_cli_args(ap)
    else:
        ap = serve_cli.build_parser()
    assert EngineArgs.from_cli_args(ap.parse_args(x.to_argv())) == x


def test_disaggregated_workers_get_every_setting():
    """worker_argv (what the router starts each worker with) carries every engine setting, the role's own
    layout, block size and kv_role (its side of the handoff: only those programs built) in place of the
    router's; a worker started by hand with --role gets its kv_role from it, and one that contradicts it
    is refused."""
    ap = serve_cli.build_parser()
    x = all_changed()
    a = ap.parse_args(["--disaggregated", "--prefill-block-size", "32", "--decode-parallel", "dp4-ep4",
                       *x.to_argv()])
    for role, want in (("prefill", x.replace(block_size=32, kv_role="prefill")),
                       ("decode", x.replace(parallel="dp4-ep4", kv_role="decode"))):
        w = ap.parse_args(serve_cli.worker_argv(a, role, 1234))
        assert EngineArgs.from_cli_args(w) == want, role
        assert (w.role, w.port) == (role, 1234)
        assert serve_cli.worker_kwargs(w, {"kv_role": role}) == {"kv_role": role}  # kept: it is the role's
    both = ap.parse_args(["--disaggregated", "--kv-role", "both"])
    assert ap.parse_args(serve_cli.worker_argv(both, "decode", 1)).kv_role == "both"
    assert serve_cli.worker_kwargs(ap.parse_args(["--role", "decode"]), {}) == {"kv_role": "decode"}
    with pytest.raises(SystemExit, match="--kv-role prefill"):
        serve_cli.worker_kwargs(ap.parse_args(["--role", "decode", "--kv-role", "prefill"]), {})
    # MODEL given as the positional argument: the workers get it as --model
    a = serve_cli.parse_args(["deepseek-v3", "--load-format", "dummy", "--disaggregated"])
    assert ap.parse_args(serve_cli.worker_argv(a, "decode", 1)).model == "deepseek-v3"
    kw = serve_cli.build_load_kwargs(a)
    assert kw["load_format"] == "dummy" and "precompile" not in kw  # the server precompiles itself
    with pytest.raises(SystemExit):
        serve_cli.parse_args(["a", "--model", "b"])


def test_load_refuses_an_unknown_keyword_naming_it():
    with pytest.raises(ValueError, match="'max_num_seq'.*did you mean 'max_num_seqs'"):
        moejax.load("v3-tiny", load_format="dummy", max_num_seq=4)
    with pytest.raises(ValueError, match="'moe_kernels'"):
        EngineConfig.create(moejax.parse_model_config(preset("v3-tiny")), moe_kernels="triton")


@pytest.mark.parametrize("name,bad", [("moe_kernel", "cutlass"), ("mla_kernel", "flash"),
                                      ("w8a8_dense_kernel", "deepgemm"), ("w8a8_kernel", "cutlass"),
                                      ("kernels", "cuda"), ("fp8_fast_accum", "yes"), ("max_num_seqs", 0),
                                      ("gpu_memory_utilization", 1.5), ("scheduling_policy", "interleave:0"),
                                      ("fp8_layers", "mlp"), ("load_format", "pt"), ("max_preemptions", -1)])
def test_a_bad_value_is_refused_naming_the_setting(name, bad):
    """moejax.load: a ValueError naming the setting (before anything is loaded); the command line: a usage
    error (argparse exits 2)."""
    with pytest.raises(ValueError, match=name):
        moejax.load("v3-tiny", **{"load_format": "dummy", name: bad})
    f = next(f for f in FIELDS if f.name == name)
    if not isinstance(f.default, bool):
        with pytest.raises(SystemExit) as e:
            serve_cli.build_parser().parse_args(["--" + name.replace("_", "-"), str(bad)])
        assert e.value.code == 2


def test_kernel_overrides_reach_the_kernel_plans(monkeypatch):
    """The overrides given to moejax.load are carried in EngineConfig and read by kernel selection while the
    engine's step is traced (KernelScopedModule's scope): a setting wins over its environment variable, which
    is read only where the setting is auto; outside the trace, no engine's settings apply. fp8_fast_accum
    reaches the FP8 dots' lowering hook."""
    seen = []
    real = moe_kernels.plan

    def spy(*args, **kwargs):
        seen.append((ks.current_mode(), {n: ks.override(n, env, getattr(ks, n.upper() + "S"))
                                         for n, env in OVERRIDES.items()}))
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_kernels, "plan", spy)
    monkeypatch.setenv(ks.MOE_KERNEL_ENV, "pallas")  # the setting wins
    monkeypatch.setenv(ks.MLA_KERNEL_ENV, "triton")  # read: the setting is auto
    previous = triton_fp8_dots.set_fast_accumulation(True)
    try:
        model = moejax.load("v3-tiny", load_format="dummy", dtype="float32", max_model_len=32, max_num_seqs=2,
                            kernels="xla", moe_kernel="triton", w8a8_dense_kernel="cublaslt", fp8_fast_accum=False,
                            progress=False)
        assert (model.config.moe_kernel, model.config.w8a8_dense_kernel, model.config.mla_kernel) == \
            ("triton", "cublaslt", "auto")
        assert model.config.args.fp8_fast_accum is False and model.module.settings is model.config.args
        moejax.generate(model, [[5, 6, 7]], max_new_tokens=2)
        assert triton_fp8_dots._fast is False  # set for the lowering that followed the trace
    finally:
        triton_fp8_dots.set_fast_accumulation(previous)
    # The engine's traces run under its kernels="xla"; shape-only traces outside an engine (the parameter
    # shapes, abstract_variables) under the default mode, with no engine's settings.
    step = [o for mode, o in seen if mode == "xla"]
    assert step, "moe.plan was not called while the step was traced"
    assert all(o == {"moe_kernel": "triton", "w8a8_kernel": "auto", "w8a8_dense_kernel": "cublaslt",
                     "mla_kernel": "triton"} for o in step), step
    assert all(o["moe_kernel"] == "pallas" and o["w8a8_dense_kernel"] == "auto" for mode, o in seen if mode != "xla")
    assert ks._SETTINGS.get() is None and moe_kernels.moe_kernel() == "pallas"  # outside: the environment's


def test_a_new_setting_is_one_declaration():
    """A setting added to the declaration (here by a subclass) is a flag with its default and help, checked
    with its own check, round-trips through argv, and is an attribute of the EngineConfig built from it."""
    @dataclasses.dataclass(frozen=True)
    class WithNew(EngineArgs):
        new_thing: int = setting(7, "a setting this test adds", layer="scheduler", check=positive_int, parse=int)

    ap = argparse.ArgumentParser()
    WithNew.add_cli_args(ap)
    action = _flags(ap)["--new-thing"]
    assert action.default == 7 and action.help == "a setting this test adds"
    x = WithNew.from_cli_args(ap.parse_args(["--new-thing", "3"]))
    assert x.new_thing == 3 and WithNew.from_cli_args(ap.parse_args(x.to_argv())) == x
    with pytest.raises(ValueError, match="new_thing"):
        WithNew(new_thing=0)
    config = EngineConfig.create(moejax.parse_model_config(preset("v3-tiny")), x)
    assert config.new_thing == 3 and config.max_num_seqs == 256
    with pytest.raises(AttributeError):
        config.not_a_setting


# The one line a new setting is: inserted into a copy of the package's declaration (EngineArgs's last field).
NEW_SETTING = ('    new_thing: int = setting(7, "a setting this test adds", layer="scheduler", check=positive_int, '
               'parse=int)\n\n')
NEW_SETTING_CHECK = """
import inspect, moejax
p = inspect.signature(moejax.load).parameters["new_thing"]
assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == 7, p
assert "``new_thing``" in moejax.load.__doc__
try:
    moejax.load("v3-tiny", load_format="dummy", new_thing=0)
    raise SystemExit("new_thing=0 was not refused")
except ValueError as e:
    assert "new_thing" in str(e), e
model = moejax.load("v3-tiny", load_format="dummy", dtype="float32", max_model_len=32, max_num_seqs=2,
                    new_thing=3, progress=False)
print("config", model.config.new_thing, model.config.args.new_thing)
"""


def test_a_new_setting_is_one_declaration_end_to_end(tmp_path):
    """One field added to EngineArgs in moejax/engine_args.py (a copy of the package, nothing else edited) is a
    keyword of moejax.load with its default and its check, an attribute of the loaded engine's EngineConfig,
    and a flag of `moejax serve --help` with its help."""
    for package in ("moejax", "pallas_kernels"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    declaration = tmp_path / "moejax" / "engine_args.py"
    text = declaration.read_text()
    at = text.index("    def __post_init__(self):", text.index("class EngineArgs"))
    declaration.write_text(text[:at] + NEW_SETTING + text[at:])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(tmp_path)}
    run = dict(capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    loaded = subprocess.run([sys.executable, "-c", NEW_SETTING_CHECK], **run)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split()[-3:] == ["config", "3", "3"], loaded.stdout
    helped = subprocess.run([sys.executable, "-m", "moejax", "serve", "--help"], **run)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "--new-thing NEW_THING" in helped.stdout and "a setting this test adds" in helped.stdout, helped.stdout


@pytest.mark.parametrize("env,want", [(None, True), ("0", False)])
def test_fp8_fast_accum_falls_back_to_its_environment_variable(env, want):
    """MOEJAX_FP8_FAST_ACC (read once, at import) is fp8_fast_accum's default: moejax.load's keyword, the
    flag's default and the lowering's choice for kernels run outside an engine; a given setting wins."""
    code = ("import inspect, argparse, moejax; from moejax.engine_args import EngineArgs; "
            "from pallas_kernels import triton_fp8_dots as t; ap = argparse.ArgumentParser(); "
            "EngineArgs.add_cli_args(ap); "
            "print(inspect.signature(moejax.load).parameters['fp8_fast_accum'].default, "
            "ap.parse_args([]).fp8_fast_accum, t._fast, EngineArgs(fp8_fast_accum=True).fp8_fast_accum)")
    environ = {k: v for k, v in os.environ.items() if k != triton_fp8_dots.ENV}
    if env is not None:
        environ[triton_fp8_dots.ENV] = env
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(want)] * 3 + ["True"]
