"""Packaging: the parallel layouts ship inside the package (the repository's configs/ becomes
moejax.configs), dp{N}-ep{N} layouts are generated, and scripts/serve.py forwards moejax.load's
options. The slow test builds the wheel, installs it (not editable) into a fresh venv and loads
layouts (and the FFI extension, built by setup.py) from that install; then installs the same tree
editable into the venv and checks again. scripts/make_tiny_checkpoint.py runs without torch (the
NumPy writer)."""

import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import pytest

from moejax.parallel.config import _FIELDS, ParallelConfig, shipped_layouts
from moejax.parallel.dispatch import BACKENDS

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "dp8-ep8-eplb"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# --- layouts, from this tree --------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_generated_layouts(n):
    """dp{N}-ep{N} generated for any N, against the expected ParallelConfig (a2a, no EPLB, defaults)."""
    pc = ParallelConfig.load(f"dp{n}-ep{n}")
    assert pc == ParallelConfig(name=f"dp{n}-ep{n}", data_parallel_size=n, expert_parallel_size=n,
                                moe_backend="a2a", num_redundant_experts=0, eplb_interval=0, eplb_window=1000)
    assert pc.num_ranks == n


@pytest.mark.parametrize("spec", ["dp2-ep4", "dp0-ep0", "dp02-ep02", "nope", "dp8-ep8-eplbx"])
def test_unknown_names_list_the_choices(spec):
    """Invariant: an unknown layout name is refused with an error quoting it and listing the choices."""
    with pytest.raises(ValueError) as e:
        ParallelConfig.load(spec)
    msg = str(e.value)
    assert repr(spec) in msg and "not found" in msg and "dp{N}-ep{N}" in msg and EXAMPLE in msg


def test_shipped_example():
    """The shipped dp8-ep8-eplb.yaml: its values, every config field set in it, every backend described,
    and the same layout by name and by path."""
    assert EXAMPLE in shipped_layouts()
    pc = ParallelConfig.load(EXAMPLE)
    assert (pc.name, pc.data_parallel_size, pc.expert_parallel_size, pc.moe_backend) == (EXAMPLE, 8, 8, "a2a")
    assert pc.num_redundant_experts > 0 and pc.eplb_interval > 0 and pc.eplb_window >= 1
    text = (REPO / "configs" / f"{EXAMPLE}.yaml").read_text()
    # every field is set (so documented in place), every backend is described
    keys = set(re.findall(r"^([a-z_]+):", text, re.M))
    assert keys == _FIELDS, keys ^ _FIELDS
    for b in BACKENDS:
        assert re.search(rf"^#\s+{b}\s", text, re.M), b
    # the same file read as a path gives the same layout
    assert ParallelConfig.load(str(REPO / "configs" / f"{EXAMPLE}.yaml")) == pc


def test_no_shipped_layout_is_shadowed_by_the_generated_names():
    """Invariant: no configs/*.yaml is named dp{N}-ep{N} (those names are generated)."""
    for name in shipped_layouts():
        assert not re.fullmatch(r"dp[0-9]+-ep[0-9]+", name), \
            f"configs/{name}.yaml: dp{{N}}-ep{{N}} names are generated; give the file another name"


def test_layout_files_are_validated(tmp_path):
    """A layout file by path (str or Path) parses to its values; each invalid field is refused with an
    error saying what is wrong; a missing file is "not found"."""
    p = tmp_path / "mine.yaml"
    p.write_text("data_parallel_size: 4\nexpert_parallel_size: 4\nmoe_backend: replicated\neplb_interval: 5\n")
    pc = ParallelConfig.load(str(p))
    assert (pc.name, pc.num_ranks, pc.moe_backend, pc.eplb_interval) == ("mine", 4, "replicated", 5)
    assert ParallelConfig.load(p) == pc  # a pathlib.Path works too
    for body, needle in [("data_parallel_size: 2\nexpert_parallel_size: 2\nbogus: 1\n", "unknown field"),
                         ("data_parallel_size: 2\nexpert_parallel_size: 4\n", "must equal"),
                         ("data_parallel_size: 0\nexpert_parallel_size: 0\n", "integer >= 1"),
                         ("eplb_window: 0\n", "integer >= 1"),
                         ("num_redundant_experts: true\n", "integer >= 0"),
                         ("moe_backend: nccl\n", "moe_backend must be one of")]:
        p.write_text(body)
        with pytest.raises(ValueError, match=needle):
            ParallelConfig.load(str(p))
    with pytest.raises(ValueError, match="not found"):
        ParallelConfig.load(str(tmp_path / "missing.yaml"))


def test_pyproject_lists_every_package():
    """pyproject.toml lists the packages explicitly (a find cannot map configs/ to moejax.configs)."""
    cfg = _pyproject()["tool"]["setuptools"]
    listed = set(cfg["packages"])
    assert cfg["package-dir"] == {"moejax.configs": "configs"}
    want = {"moejax.configs"}
    for top in ("moejax", "pallas_kernels"):
        for d, dirs, files in os.walk(REPO / top):
            dirs[:] = [x for x in dirs if x != "__pycache__" and not x.startswith(".")]
            if any(f.endswith(".py") for f in files):
                want.add(".".join(Path(d).relative_to(REPO).parts))
    assert not want - listed, f"add {sorted(want - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert not listed - want, f"pyproject.toml lists packages that do not exist: {sorted(listed - want)}"


# --- the wheel (and editable) install in a fresh venv ------------------------------------------------

_CHECK = textwrap.dedent("""
    import dataclasses, importlib.metadata, importlib.resources, json, sys
    import moejax
    from moejax.parallel.config import ParallelConfig, layout_dir, shipped_layouts
    from moejax.parallel import ffi_library
    res = importlib.resources.files("moejax.configs")
    dist = importlib.metadata.distribution("moejax")
    print(json.dumps({
        "moejax": moejax.__file__,
        "layout_dir": str(layout_dir()),
        "configs_resource": str(res),
        "configs_files": sorted(f.name for f in res.iterdir() if f.name.endswith(".yaml")),
        "shipped": sorted(shipped_layouts()),
        "dp2": dataclasses.asdict(ParallelConfig.load("dp2-ep2")),
        "example": dataclasses.asdict(ParallelConfig.load(sys.argv[1])),
        "dist_files": sorted(str(f) for f in dist.files or () if "configs" in str(f)),
        "editable": dist.read_text("direct_url.json"),  # PEP 610: dir_info.editable for -e
        "ffi_library": str(ffi_library.library_path("cpu")),
        "ffi_available": ffi_library.available("cpu"),
    }))
""")


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _pip_can_target_other_pythons() -> bool:
    import pip
    return tuple(int(x) for x in re.findall(r"\d+", pip.__version__)[:2]) >= (22, 3)


def _no_isolation_ok() -> bool:
    """Build offline with this interpreter's setuptools when it meets pyproject's requirement."""
    import importlib.metadata
    try:  # not imported here: setuptools' distutils shim clashes with a distutils already imported
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return int(re.match(r"\d+", version).group()) >= 68


def _copy_tree(dst: Path) -> Path:
    """What the build needs (pyproject, readme, the package directories), without build outputs."""
    cfg = _pyproject()
    tops = {p.split(".")[0] for p in cfg["tool"]["setuptools"]["packages"]}
    tops |= {d.split("/")[0] for d in cfg["tool"]["setuptools"]["package-dir"].values()}
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "libmoejax_ep_*.so")
    dst.mkdir()
    for name in ("pyproject.toml", "setup.py", cfg["project"]["readme"]):
        shutil.copy2(REPO / name, dst / name)
    for top in sorted(tops | {"ffi"}):  # ffi/: the C++ extension setup.py builds with CMake
        shutil.copytree(REPO / top, dst / top, ignore=ignore)
    return dst


def test_wheel_and_editable_install_in_fresh_venv(tmp_path):
    """The built wheel, installed in a fresh venv, ships configs/*.yaml as moejax.configs and loads the
    same layouts as this tree; the same tree installed editable maps moejax.configs to configs/."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("venv") is None:
        pytest.fail(f"{sys.executable} lacks pip or venv, which this test needs to build and install the wheel")
    if not _pip_can_target_other_pythons():
        pytest.fail("pip >= 22.3 needed (pip --python); upgrade pip")
    src = _copy_tree(tmp_path / "src")
    build_flags = ["--no-build-isolation"] if _no_isolation_ok() else []  # else pip fetches setuptools
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *build_flags, "-w", tmp_path / "dist", src])
    wheels = list((tmp_path / "dist").glob("moejax-*.whl"))
    assert len(wheels) == 1, wheels

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if sys.prefix != sys.base_prefix:
        # run from a venv (.ci/run): --system-site-packages gives the base interpreter's packages, so add
        # this venv's (jax, yaml, ...) after the new venv's own; their .pth files are not processed, so an
        # editable moejax there is not importable from the new venv
        purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
        outer = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
        Path(purelib, "_outer_env.pth").write_text("\n".join(outer) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps"]
    work = tmp_path / "cwd"  # neither the source tree nor the copy: moejax must come from the venv
    work.mkdir()
    check = tmp_path / "check.py"
    check.write_text(_CHECK)

    _run([*pip, "--no-index", "--force-reinstall", wheels[0]])
    r = json.loads(_run([py, "-I", check, EXAMPLE], cwd=work))
    site = Path(r["moejax"]).resolve().parent.parent
    assert Path(r["moejax"]).resolve().is_relative_to(venv.resolve()), f"moejax imported from {r['moejax']}"
    assert not json.loads(r["editable"] or "{}").get("dir_info", {}).get("editable"), r["editable"]
    shipped = sorted(f.name for f in (REPO / "configs").glob("*.yaml"))
    assert f"{EXAMPLE}.yaml" in shipped and r["configs_files"] == shipped
    assert Path(r["layout_dir"]).resolve() == Path(r["configs_resource"]).resolve() == site / "moejax" / "configs"
    assert {f"moejax/configs/{f}" for f in shipped} <= set(r["dist_files"])
    assert r["shipped"] == [f[:-5] for f in shipped]
    assert r["dp2"] == dict(name="dp2-ep2", data_parallel_size=2, expert_parallel_size=2, moe_backend="a2a",
                            num_redundant_experts=0, eplb_interval=0, eplb_window=1000, dbo="off",
                            dbo_decode_min_tokens=64, dbo_prefill_min_tokens=512)
    assert r["example"] == dict(name=EXAMPLE, **{k: v for k, v in ParallelConfig.load(EXAMPLE).__dict__.items()
                                                  if k != "name"})
    # the FFI extension (ffi/) is built into the wheel where a C++ compiler is found, and loads from the install
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    assert r["ffi_available"] == bool(compiler), r["ffi_library"]
    if compiler:
        assert Path(r["ffi_library"]).resolve() == site / "moejax" / "parallel" / "libmoejax_ep_host.so"

    # the same tree, editable (as .ci/run installs it): moejax and moejax.configs map to the tree
    _run([*pip, *build_flags, "-e", src])  # isolated (fetching setuptools) as the wheel build was
    r = json.loads(_run([py, "-I", check, EXAMPLE], cwd=work))
    assert Path(r["moejax"]).resolve() == (src / "moejax" / "__init__.py").resolve()
    assert r["editable"] is not None and json.loads(r["editable"])["dir_info"].get("editable")
    assert Path(r["layout_dir"]).resolve() == Path(r["configs_resource"]).resolve() == (src / "configs").resolve()
    assert r["configs_files"] == shipped and r["shipped"] == [f[:-5] for f in shipped]
    assert r["dp2"]["data_parallel_size"] == 2 and r["example"]["name"] == EXAMPLE
    if compiler:  # built into the source tree, next to the code that loads it
        assert r["ffi_available"] and Path(r["ffi_library"]).resolve() == src / "moejax" / "parallel" / "libmoejax_ep_host.so"


# --- scripts/serve.py -----------------------------------------------------------------------------

def _serve_module():
    spec = importlib.util.spec_from_file_location("moejax_serve_script", REPO / "scripts" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_api_key_flag_and_environment(monkeypatch):
    """scripts/serve.py's --api-key defaults to $MOEJAX_API_KEY; the flag overrides it; neither: open."""
    key = "sk-" + os.urandom(6).hex()
    monkeypatch.delenv("MOEJAX_API_KEY", raising=False)
    assert _serve_module().build_parser().parse_args([]).api_key is None
    monkeypatch.setenv("MOEJAX_API_KEY", key)
    ap = _serve_module().build_parser()
    assert ap.parse_args([]).api_key == key and ap.parse_args(["--api-key", "other"]).api_key == "other"


def test_serve_forwards_load_options():
    """scripts/serve.py's flags reach moejax.load unchanged; every forwarded option is a moejax.load
    parameter with the same default; bad choices are refused by the parser."""
    import moejax
    serve = _serve_module()
    ap = serve.build_parser()
    kw = serve.build_load_kwargs(ap.parse_args(["--parallel", "dp2-ep2", "--kv-cache-dtype", "fp8",
                                                "--kernels", "xla", "--dtype", "float32", "--max-num-seqs", "4",
                                                "--gpu-memory-utilization", "0.55"]))
    assert (kw["parallel"], kw["kv_cache_dtype"], kw["kernels"], kw["dtype"], kw["max_num_seqs"]) == \
        ("dp2-ep2", "fp8", "xla", "float32", 4)
    assert kw["gpu_memory_utilization"] == 0.55
    kw = serve.build_load_kwargs(ap.parse_args([]))
    assert (kw["parallel"], kw["kv_cache_dtype"], kw["kernels"]) == (None, "auto", "auto")
    assert serve.build_load_kwargs(ap.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False
    assert serve.build_load_kwargs(ap.parse_args([]))["async_scheduling"] is True  # the default
    a = ap.parse_args(["--model", "deepseek-v3", "--load-format", "dummy"])
    assert serve.build_load_kwargs(a)["load_format"] == "dummy"
    assert ap.parse_args(serve.worker_argv(a, "decode", 1234)).load_format == "dummy"  # disaggregated workers too
    # everything forwarded is a moejax.load parameter, with the same default but for the server's own
    # (SERVE_DEFAULTS: precompile before /health, the executable cache under ~/.cache)
    from moejax.server.cli import SERVE_DEFAULTS
    params = inspect.signature(moejax.load).parameters
    for k, v in kw.items():
        assert k in params, k
        assert v == SERVE_DEFAULTS.get(k, params[k].default), (k, params[k].default, v)
    for bad in (["--kernels", "triton"], ["--kv-cache-dtype", "int8"], ["--load-format", "pt"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)


def test_serve_disaggregated_speculative_config():
    """--disaggregated passes --speculative-config to both roles' workers; start-up refuses a speculative
    decode worker beside a prefill worker without speculation (no MTP-layer rows: kv_handoff.py's rule)."""
    serve = _serve_module()
    ap = serve.build_parser()
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    a = ap.parse_args(["--disaggregated", "--speculative-config", json.dumps(mtp)])
    for role in ("prefill", "decode"):
        assert ap.parse_args(serve.worker_argv(a, role, 1234)).speculative_config == mtp
    assert "--speculative-config" not in serve.worker_argv(ap.parse_args(["--disaggregated"]), "decode", 1234)
    spec, plain = {"speculative_config": mtp, "num_cache_layers": 62}, {"speculative_config": None, "num_cache_layers": 61}
    serve.check_speculative([spec], [spec])
    serve.check_speculative([spec], [plain])  # the decode side drops the MTP rows
    serve.check_speculative([plain], [plain])
    with pytest.raises(ValueError, match="speculative_config"):
        serve.check_speculative([spec, plain], [spec])


def test_serve_shutdown_timeout_default():
    """scripts/serve.py's --shutdown-timeout defaults to the lifecycle's drain default (whose exit fits
    Kubernetes' 30 s grace: tests/test_server_faults.py)."""
    from moejax.server.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S
    assert _serve_module().build_parser().parse_args([]).shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT_S


def test_make_tiny_checkpoint_without_torch(tmp_path):
    """scripts/make_tiny_checkpoint.py after `pip install -e .` alone (torch and transformers made
    unimportable by a sitecustomize): without --via it writes with the NumPy writer and says so on
    stderr; --via transformers exits non-zero naming the test extra and --via numpy."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}

    def run(*args):
        return subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_checkpoint.py"), *args], env=env,
                              capture_output=True, text=True, timeout=300)

    r = run(str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    assert "torch cannot be imported" in r.stderr and "--via numpy" in r.stderr
    assert (tmp_path / "a" / "config.json").exists() and (tmp_path / "a" / "model.safetensors").exists()
    r = run(str(tmp_path / "b"), "--via", "transformers")
    assert r.returncode != 0 and 'pip install -e ".[test]"' in r.stderr and "--via numpy" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()
