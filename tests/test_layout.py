"""The package's layout rules, checked on the source (ast), not by convention:

- no import cycles between moejax/pallas_kernels modules;
- imports inside function bodies only for optional dependencies (torch, transformers);
- a model family lives in its module: no model_type string outside moejax/models/;
- every registered family provides what the shared code reads (checked against the
  tiny preset of each family: its config parses, its Flax module builds, its HF-name
  table round-trips every parameter).
"""

import ast
import pathlib

import pytest

from moejax.models.registry import FAMILIES, abstract_params, family_of, parse_model_config
from moejax.weights.param_tree import flatten, is_stacked_expert

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("moejax", "pallas_kernels")
# Optional dependencies, imported where used so the package runs without them: the test extra, and the
# triton extra (jax_triton_compat imports Triton on first use: its interpreter is chosen at import)
OPTIONAL = {"torch", "transformers", "triton", "jax_triton", "xgrammar"}


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), path, ast.parse(path.read_text())


def _imported(node, module: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
            base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def test_no_import_cycles():
    """Invariant, on the source (ast): the module import graph of moejax and pallas_kernels is acyclic
    (a failure names the cycle)."""
    mods = {name: tree for name, _, tree in _modules()}
    graph = {}
    for name, tree in mods.items():
        deps = set()
        for node in ast.walk(tree):
            found = [d for d in _imported(node, name) if d in mods]
            if isinstance(node, ast.ImportFrom) and len(found) > 1:
                found = found[1:]  # "from pkg import module": the module, not pkg's __init__
            # A module's own package is imported before it whatever it says: not an edge.
            deps |= {d for d in found if d != name and not name.startswith(d + ".")}
        graph[name] = deps
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for d in graph[n]:
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [n])


def test_function_local_imports_only_for_optional_dependencies():
    """Invariant, on the source: imports inside function bodies are only of torch / transformers
    (a failure names file, line and module)."""
    found = []
    for name, path, tree in _modules():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                for dep in _imported(node, name)[:1]:
                    if dep.split(".")[0] not in OPTIONAL:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {dep}")
    assert not found, "function-local imports of required modules:\n" + "\n".join(found)


def test_no_model_type_outside_the_family_modules():
    """Invariant, on the source: no registered model_type string appears outside moejax/models/ (nor in
    moejax/server/tool_parsers.py, whose --tool-call-parser names are vLLM's spellings of output formats,
    one of them a model_type's too)."""
    model_types = {mt for f in FAMILIES for mt in f.model_types}
    found = []
    for name, path, tree in _modules():
        if name.startswith("moejax.models.") or name == "moejax.server.tool_parsers":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in model_types:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, "family branches outside moejax/models/:\n" + "\n".join(found)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_name_table_round_trips_every_parameter(family):
    """Each parameter's HF name maps back to the same leaf (and expert), so the generic loader
    and writer agree with the family's model; a fused leaf's HF tensors map to their own paths,
    fill its rows exactly, and its own name is no HF name."""
    tiny = next(p for p in family.presets.values() if p["vocab_size"] < 1000)
    cfg = parse_model_config(tiny)
    assert family_of(cfg) is family
    for path, leaf in flatten(abstract_params(cfg, "float32")).items():
        parts = family.fused_parts(cfg, path)
        if parts:
            assert family.hf_to_param(family.param_to_hf(path, None)) is None, path
            assert sum(rows for _, rows in parts) == leaf.shape[0], (path, parts)
            for part, _ in parts:
                ref = family.hf_to_param(family.param_to_hf(part, None))
                assert ref is not None and ref.path == part and ref.expert is None and not ref.stacked, (part, ref)
            continue
        experts = [None] if not is_stacked_expert(path) or family.experts_stacked_on_disk else [0, leaf.shape[0] - 1]
        for e in experts:
            name = family.param_to_hf(path, e)
            ref = family.hf_to_param(name)
            assert ref is not None and ref.path == path and ref.expert == e, (name, ref, path)
            assert ref.stacked == (is_stacked_expert(path) and family.experts_stacked_on_disk), name


def test_a_failing_test_reports_its_seed_and_the_seed_replays_it(tmp_path):
    """The conftest's seed mechanism end to end: a failing test's report names its seed, and running
    it again with that seed draws the same 'fresh' random numbers."""
    import os
    import re
    import subprocess
    import sys
    (tmp_path / "test_draw.py").write_text(
        "import numpy as np\n"
        "def test_draw():\n"
        "    x = np.random.default_rng().random()\n"
        "    print(f'DRAW={x!r}')\n"
        "    assert False\n")

    def run(seed=None):
        # Only the conftest as a plugin (no entry-point plugins: a second and a half less a run).
        env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        env.pop("MOEJAX_TEST_SEED", None)
        if seed is not None:
            env["MOEJAX_TEST_SEED"] = seed
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                              str(tmp_path / "test_draw.py")], capture_output=True, text=True, env=env,
                             cwd=tmp_path).stdout
        return re.search(r"^DRAW=(\S+)$", out, re.M).group(1), re.search(r"MOEJAX_TEST_SEED=(\d+)", out).group(1)

    draw, seed = run()
    assert run(seed) == (draw, seed)
    assert run()[0] != draw  # fresh without the seed
