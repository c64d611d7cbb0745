#!/usr/bin/env python
"""Profile of the decode step scripts/bench_decode.py times: the same engine and batch (random
weights at a named shape, a full batch at --concurrency and --input-len, the cache filled at that
length), a few warm-up steps, then --steps engine steps under jax.profiler.trace, each inside a
TraceAnnotation ("profile_step"). The trace the profiler wrote (plugins/profile/<run>/*.trace.json.gz,
Perfetto / Chrome JSON) is then read back and summed per operation:

- the operations are the device's kernels (the events on the GPU's stream lines, named by their HLO
  op, e.g. fusion.123 or custom-call.7) or, on CPU, the XLA ops the host threads ran (events named
  after the HLO op / fusion);
- each is matched to the compiled program it belongs to (decode step, sampler, token feed), whose
  optimised HLO gives the op's metadata (op_name: the model's module path; source file, line and
  function) and, estimated from its shapes, the bytes it moves and the FLOPs of its dots;
- CATEGORY_RULES below puts each op in one category.

Printed: one row per op (--top), time per step, share of all op time, launches per step, estimated
GB/s and FLOP/s, where in the model; one row per category; the step's wall time against the op
time and the device's busy time; and, from XLA's cost analysis of the step's programs, the achieved
bytes/s and FLOP/s against the copy bandwidth and bf16 matmul rate measured in the same run (the
floors bench_decode reports).

  python scripts/profile_step.py --preset v3-tiny --concurrency 8 --input-len 64           # CPU
  python scripts/profile_step.py --preset deepseek-v3-ep8-rank --layers 4 --concurrency 512 \\
      --input-len 2048 --kernels auto --weight-dtype fp8 --trace-dir /tmp/prof --json prof.json

--trace-dir keeps the trace (open the .trace.json.gz in ui.perfetto.dev, or `tensorboard --logdir`
with the profile plugin); without it the trace goes to a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import csv
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

# XLA:GPU runs a step's kernels as CUDA-graph command buffers, which the trace shows as one op
# ("command_buffer_1": the whole step); the per-op table needs them off (a flag the user set wins).
if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from moejax.benchmark.decode_setup import (add_engine_flags, bench_hf_config, build_decode_batch,
                                            capture_step_programs, step_floor, weight_kw)
from moejax.benchmark.roofline import measure_copy_bandwidth, measure_matmul_rate
from moejax.config import EngineConfig
from moejax.models.registry import parse_model_config

# Categories, in the order the summary lists them.
CATEGORIES = ("attention", "moe/experts", "dense matmul", "lm_head", "sampling/sort", "norm/rope/elementwise",
              "cache write", "collective", "copy", "other")

# (category, field, pattern): the first rule whose pattern (re.search, case-insensitive) matches the
# op's field wins. Fields:
#   program  the compiled program the op ran in: decode, sample or feed
#   op       the HLO op's name, opcode and custom-call target, and the kernel's name (GPU)
#   where    the op's HLO metadata: op_name (the model's module path, e.g. "jit(per_rank)/
#            DeepseekForCausalLM.decode/layers_1.decode/self_attn.decode/bhc,btc->bht/dot_general";
#            a fusion without its own: its fused ops', else its weight operands' names) and its
#            source ("moejax/layers/paged_attention.py:70 mla_decode_attention")
CATEGORY_RULES = (
    ("collective", "op", r"all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute|^nccl|"
                         r"^(send|recv)(-done)?\b"),
    ("collective", "where", r"all_to_all|all_gather|psum|ppermute|reduce_scatter"),
    ("sampling/sort", "program", r"^sample$"),
    ("sampling/sort", "where", r"sampler\.py"),
    ("cache write", "where", r"write_cache|encode_rows|quantize_rows|self_attn[\w.]*/scatter"),
    ("copy", "op", r"^(loop_|wrapped_|input_)?(copy|transpose_copy|bitcast_copy)([_.\-]|$)|copy-(start|done)|"
                   r"^(memcpy|memset)"),
    ("copy", "program", r"^feed$"),
    ("norm/rope/elementwise", "where", r"layernorm|/norm/|rms_?norm|layers/norm\.py|_rope\b|rope\.py"),
    ("lm_head", "where", r"\.logits/|lm_head"),
    ("moe/experts", "where", r"(?<!shared_)experts/|/gate/|router|experts\.py|moe\.py|dispatch\.py"),
    ("dense matmul", "where", r"_proj/|shared_experts|/mlp/"),
    # the rest of the attention block: over the cache, and MLA's absorbed products (q x W_UK, ctx x W_UV)
    ("attention", "where", r"self_attn|attention|mla\.py|mfa\.py"),
    ("other", "where", r"embed"),
    ("dense matmul", "op", r"\bdot\b|dot[._]|gemm|cublas|nvjet|matmul"),
    ("sampling/sort", "op", r"sort|top_?k"),
    ("norm/rope/elementwise", "op", r"fusion|convert|add|multiply|subtract|divide|select|broadcast|reduce|exp|"
                                    r"rsqrt|iota|compare|negate|maximum|minimum|slice|concatenate|pad|"
                                    r"reshape|transpose|bitcast|gather|scatter|clamp|tanh|log"),
    ("other", "op", r""),
)
_RULES = [(cat, field, re.compile(p, re.I)) for cat, field, p in CATEGORY_RULES]
assert {c for c, _, _ in CATEGORY_RULES} <= set(CATEGORIES)

ANNOTATION = "profile_step"  # the TraceAnnotation around each profiled step
# Lines of a device that repeat its kernels at another level (xprof's derived timelines): not summed.
_DERIVED_LINES = re.compile(r"XLA Modules|XLA Ops|Steps|Framework|Source|TraceMe|Name Scope|Launch|"
                            r"Host Threads|Sparse", re.I)


def categorize(fields: dict) -> str:
    for cat, field, pattern in _RULES:
        if pattern.search(fields.get(field) or ""):
            return cat
    return "other"


# ----- the compiled programs' HLO: per op metadata, source, bytes and FLOPs --------------------------
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25}
_SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_CONTROL = {"while", "conditional", "call"}  # run other computations' ops: not summed when those have events
_SUBCOMPS = re.compile(r"\b(?:body|condition|to_apply|branch_computations|true_computation|false_computation)="
                       r"(\{[^}]*\}|%?[\w.\-]+)")
_FREE = {"bitcast", "reshape", "get-tuple-element", "tuple", "parameter", "constant", "after-all"}
_READS_PART = {"gather", "dynamic-slice", "slice"}  # read only what they return from operand 0
_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}  # writes operand 0 in place: the update's index


def _itemsize(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1 if dtype.startswith("f8") else 0.5
    return _ITEMSIZE.get(dtype, 0)


def _shapes(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(type_str)
            if d in _ITEMSIZE or d[:2] in ("f8", "f4", "f6")]


def _nbytes(type_str: str) -> float:
    return sum(_itemsize(d) * int(np.prod(s, dtype=np.int64)) for d, s in _shapes(type_str))


def _matching(s: str, i: int) -> int:
    """Index just past the bracket that closes the one at s[i]."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    close = pairs[s[i]]
    for j in range(i, len(s)):
        if s[j] == s[i]:
            depth += 1
        elif s[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


class Instr:
    __slots__ = ("name", "type", "opcode", "operands", "param", "calls", "subcomps", "op_name", "frame", "source",
                 "target", "attrs")

    def __init__(self, name: str, rest: str):
        self.name = name
        end = _matching(rest, 0) if rest.startswith("(") else rest.find(" ")
        self.type, rest = rest[:end], rest[end:].lstrip()
        p = rest.find("(")
        self.opcode = rest[:p] if p > 0 else rest.split(" ")[0]
        close = _matching(rest, p) if p > 0 else p + 1
        self.operands = re.findall(r"%([\w.\-]+)", rest[p:close]) if p > 0 else []
        m = re.match(r"\((\d+)\)", rest[p:close]) if self.opcode == "parameter" else None
        self.param = int(m.group(1)) if m else None
        self.attrs = rest[close:]
        m = re.search(r"\bcalls=\{?%?([\w.\-]+)", self.attrs)
        self.calls = m.group(1) if m else None
        # computations a control-flow op runs (their ops have events of their own)
        self.subcomps = [c for group in _SUBCOMPS.findall(self.attrs) for c in re.findall(r"%?([\w.\-]+)", group)
                         ] if self.opcode in _CONTROL else []
        m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
        self.target = m.group(1) if m else ""
        m = re.search(r"metadata=\{", self.attrs)
        meta = self.attrs[m.end() - 1:_matching(self.attrs, m.end() - 1)] if m else ""
        m = re.search(r'op_name="([^"]*)"', meta)
        self.op_name = m.group(1) if m else ""
        m = re.search(r"stack_frame_id=(\d+)", meta)
        self.frame = int(m.group(1)) if m else None
        m = re.search(r'source_file="([^"]*)" source_line=(\d+)', meta)
        self.source = f"{_short_file(m.group(1))}:{m.group(2)}" if m else ""


def _short_file(path: str) -> str:
    i = path.rfind("moejax/")
    return path[i:] if i >= 0 else os.path.basename(path)


class Program:
    """One compiled program's optimised HLO (``compiled.as_text()``): its ops by name, with where in the
    model each comes from and its estimated bytes and FLOPs."""

    def __init__(self, name: str, hlo_text: str, cost: dict | None = None):
        self.name, self.cost = name, cost or {}
        m = re.match(r"HloModule ([\w.-]+)", hlo_text)
        self.module = m.group(1) if m else ""  # the execution's name in a trace
        self.comps: dict[str, dict[str, Instr]] = {}
        self.roots: dict[str, str] = {}
        self.entry = None
        tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
        section, comp, cname = None, None, None
        for line in hlo_text.splitlines():
            if comp is not None:
                m = _INSTR.match(line)
                if m:
                    ins = Instr(m.group(1), m.group(2))
                    comp[ins.name] = ins
                    if line.lstrip().startswith("ROOT "):
                        self.roots[cname] = ins.name
                elif line.startswith("}"):
                    comp = None
                continue
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = line
                continue
            m = _COMP.match(line)
            if m and not line.startswith("HloModule"):
                cname, comp, section = m.group(1), {}, None
                self.comps[cname] = comp
                if line.startswith("ENTRY"):
                    self.entry = cname
                continue
            if section and line.strip():
                k, _, v = line.strip().partition(" ")
                if k.isdigit():
                    tables[section][int(k)] = v.strip().strip('"')
        self.frames = dict(tables)
        self.ops: dict[str, tuple[str, Instr]] = {}  # op name -> (computation, instruction)
        for cname, comp in self.comps.items():
            for ins in comp.values():
                self.ops.setdefault(ins.name, (cname, ins))
        self._users: dict[str, dict[str, list[tuple[Instr, int]]]] = {}
        # the ops that run as such (a kernel or thunk each): the entry computation's and those of the
        # computations its control flow runs, not the ops inside fusions
        self.top_ops: set[str] = set()
        todo, done = [self.entry] if self.entry else list(self.comps), set()
        while todo:
            c = todo.pop()
            if c in done or c not in self.comps:
                continue
            done.add(c)
            for ins in self.comps[c].values():
                if ins.opcode not in _FREE:
                    self.top_ops.add(ins.name)
                todo += ins.subcomps

    # -- where an op comes from
    def _source(self, ins: Instr) -> str:
        if ins.source or ins.frame is None or "StackFrames" not in self.frames:
            return ins.source
        try:
            loc = self.frames["StackFrames"][ins.frame]
            loc_id = int(re.search(r"file_location_id=(\d+)", loc).group(1))
            fl = self.frames["FileLocations"][loc_id]
            f = self.frames["FileNames"][int(re.search(r"file_name_id=(\d+)", fl).group(1))]
            fn = self.frames.get("FunctionNames", {}).get(int(re.search(r"function_name_id=(\d+)", fl).group(1)), "")
            line = re.search(r"\bline=(\d+)", fl).group(1)
        except (KeyError, AttributeError, ValueError):
            return ""
        return f"{_short_file(f)}:{line} {fn}".strip()

    def where(self, op: str) -> tuple[str, str]:
        """(metadata op_name, source) of an op; for a fusion without its own, its fused ops' (the root's
        first, else the most common), else the names of the weights it reads."""
        if op not in self.ops:
            return "", ""
        cname, ins = self.ops[op]
        if ins.op_name:
            return ins.op_name, self._source(ins)
        if ins.calls in self.comps:
            inner = self.comps[ins.calls]
            root = inner.get(self.roots.get(ins.calls, ""))
            if root is not None and root.op_name:
                return root.op_name, self._source(root)
            named = collections.Counter(i.op_name for i in inner.values() if i.op_name)
            if named:
                best = named.most_common(1)[0][0]
                return best, self._source(next(i for i in inner.values() if i.op_name == best))
        params = [self.comps[cname][o].op_name for o in ins.operands
                  if o in self.comps[cname] and self.comps[cname][o].opcode == "parameter"]
        params = [re.sub(r"\[\\?'([^'\\]*)\\?'\]", r"/\1", p) for p in params if p.startswith("params")]
        if params:
            return " ".join(params), ""
        # nothing of its own (e.g. a dtype conversion XLA added): its producer's or consumer's, marked "~"
        comp = self.comps[cname]
        near = [comp[o] for o in ins.operands if o in comp and comp[o].opcode not in ("parameter", "constant")]
        near += [u for u, _ in self._users_of(cname).get(ins.name, [])]
        for n in near:
            if n.op_name:
                return "~" + n.op_name, self._source(n)
        return "", ""

    def is_container(self, op: str, traced: set[str]) -> bool:
        """A control-flow op (while, conditional, call) some of whose computations' ops are in ``traced``."""
        if op not in self.ops or self.ops[op][1].opcode not in _CONTROL:
            return False
        return any(traced & self.comps.get(c, {}).keys() for c in self.ops[op][1].subcomps)

    # -- estimated bytes and FLOPs
    def _users_of(self, cname: str) -> dict[str, list[tuple[Instr, int]]]:
        if cname not in self._users:
            users = collections.defaultdict(list)
            for ins in self.comps[cname].values():
                for k, o in enumerate(ins.operands):
                    users[o].append((ins, k))
            self._users[cname] = users
        return self._users[cname]

    def _effective_users(self, cname: str, name: str) -> list[tuple[Instr, int]]:
        """Users of ``name`` in ``cname``, looking through bitcasts and reshapes (free)."""
        out = []
        for ins, k in self._users_of(cname).get(name, []):
            if ins.opcode in ("bitcast", "reshape"):
                out += self._effective_users(cname, ins.name)
            else:
                out.append((ins, k))
        return out

    def _operand_bytes(self, cname: str, ins: Instr, k: int) -> float:
        comp = self.comps[cname]
        o = comp.get(ins.operands[k]) if k < len(ins.operands) else None
        return _nbytes(o.type) if o is not None else 0.0

    def op_bytes(self, op: str) -> float | None:
        """Bytes an op reads and writes, from its shapes: every operand and the result, except that an
        operand only gathered / sliced counts what is taken from it, and an operand updated in place
        (scatter, dynamic-update-slice) counts only the update, read and written."""
        if op not in self.ops:
            return None
        cname, ins = self.ops[op]
        if ins.opcode in _FREE:
            return 0.0
        if ins.opcode == "fusion" and ins.calls in self.comps:
            inner, fc = self.comps[ins.calls], ins.calls
            params = {i.param: i for i in inner.values() if i.opcode == "parameter"}
            total = 0.0
            in_place = False
            for k in range(len(ins.operands)):
                p = params.get(k)
                full = self._operand_bytes(cname, ins, k)
                if p is None:
                    total += full
                    continue
                users = self._effective_users(fc, p.name)
                if users and all(u.opcode in _READS_PART and j == 0 for u, j in users):
                    total += sum(_nbytes(u.type) for u, _ in users)
                elif users and all(u.opcode in _IN_PLACE and j == 0 for u, j in users):
                    in_place = True
                else:
                    total += full
            root = inner.get(self.roots.get(fc, ""))
            if in_place and root is not None and root.opcode in _IN_PLACE:
                upd = inner.get(root.operands[_IN_PLACE[root.opcode]]) if len(root.operands) > 1 else None
                return total + (_nbytes(upd.type) if upd is not None else 0.0)
            return total + _nbytes(ins.type)
        if ins.opcode in _READS_PART:
            return 2 * _nbytes(ins.type) + sum(self._operand_bytes(cname, ins, k) for k in range(1, len(ins.operands)))
        if ins.opcode in _IN_PLACE:
            i = _IN_PLACE[ins.opcode]
            return sum(self._operand_bytes(cname, ins, k) for k in range(1, len(ins.operands))) + \
                self._operand_bytes(cname, ins, i)
        return sum(self._operand_bytes(cname, ins, k) for k in range(len(ins.operands))) + _nbytes(ins.type)

    def op_flops(self, op: str) -> float:
        """2 x output elements x contracted size of every dot (and ragged dot, cuBLAS gemm) the op runs."""
        if op not in self.ops:
            return 0.0
        cname, ins = self.ops[op]
        return self._flops(cname, ins, depth=0)

    def _flops(self, cname: str, ins: Instr, depth: int) -> float:
        if depth > 8:
            return 0.0
        if ins.calls in self.comps and ins.opcode in ("fusion", "call", "async-start"):
            return sum(self._flops(ins.calls, i, depth + 1) for i in self.comps[ins.calls].values())
        is_gemm = ins.opcode == "custom-call" and re.search(r"gemm|matmul", ins.target, re.I)
        if ins.opcode not in ("dot", "ragged-dot") and not is_gemm:
            return 0.0
        m = re.search(r'lhs_contracting_dim(?:s=\{|ensions":\[)([^}\]]*)', ins.attrs)
        lhs = self.comps[cname].get(ins.operands[0]) if ins.operands else None
        out = _shapes(ins.type)
        if not m or lhs is None or not out or not _shapes(lhs.type):
            return 0.0
        dims = [int(d) for d in re.findall(r"\d+", m.group(1))]
        lshape = _shapes(lhs.type)[0][1]
        k = int(np.prod([lshape[d] for d in dims if d < len(lshape)], dtype=np.int64))
        return 2.0 * int(np.prod(out[0][1], dtype=np.int64)) * k


# ----- the trace ---------------------------------------------------------------------------------
def find_trace(trace_dir: str) -> str:
    files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not files:
        raise SystemExit(f"no *.trace.json.gz under {trace_dir}/plugins/profile/: did the profiler run?")
    return max(files, key=os.path.getmtime)


def op_events(trace: dict) -> tuple[list[dict], str, list[tuple[float, float]]]:
    """The events that are the step's operations, where they came from, and the program executions'
    spans where the trace has them: the first device's kernels (its stream lines) and its "XLA Modules"
    line if the trace has a device, else the host's XLA op events (CPU: named after the HLO op, with
    hlo_op, hlo_module and run_id in their args)."""
    events = trace.get("traceEvents", [])
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "name" in e]
    devices = sorted(pid for pid, n in procs.items() if n.startswith("/device:") and "CPU" not in n.upper())
    for pid in devices[:1]:
        mine = [e for e in spans if e["pid"] == pid]
        line = {tid: n for (p, tid), n in threads.items() if p == pid}
        streams = {tid for tid, n in line.items() if n.lower().startswith("stream")}
        kept = ([e for e in mine if e.get("tid") in streams] if streams else
                [e for e in mine if not _DERIVED_LINES.search(line.get(e.get("tid"), ""))])
        modules = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in mine if line.get(e.get("tid")) == "XLA Modules")
        if kept:
            return kept, procs[pid], modules
    host = [e for e in spans if "hlo_op" in e.get("args", {})]
    return host, procs.get(host[0]["pid"], "host") if host else "host", []


def step_spans(trace: dict) -> list[float]:
    return [e["dur"] * 1e-6 for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("name") == ANNOTATION and "dur" in e]


def _busy(events: list[dict]) -> float:
    """Seconds covered by at least one event (the union of their intervals)."""
    total, end = 0.0, -float("inf")
    for s, d in sorted((e["ts"], e["dur"]) for e in events):
        if s + d > end:
            total += s + d - max(s, end)
            end = s + d
    return total * 1e-6


def assign_programs(events: list[dict], programs: list[Program], modules=()) -> list[str | None]:
    """The program each event ran in. The events of one execution (one run_id, or program_id, in their
    args; else inside one span of the device's "XLA Modules" line) go together to the program of that
    execution's HLO module name (the runner names each program's module: jit_decode, jit_spec_verify, ...),
    or, where several programs or none have that name, to the one whose op names they match best
    (Jaccard; programs of one name share op names such as fusion.1); an event in none of those goes to the
    first program that has an op of its name."""
    starts = [s for s, _, _ in modules]
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(events):
        a = e.get("args", {})
        run = a.get("run_id") or a.get("program_id")
        if run:
            key = (a.get("hlo_module") or "?", run)
        else:
            k = bisect.bisect_right(starts, e["ts"]) - 1
            key = (re.sub(r"\(\d+\)$", "", modules[k][2]) or "?", k) if k >= 0 and e["ts"] < modules[k][1] else ("", i)
        groups[key].append(i)
    out: list[str | None] = [None] * len(events)
    for key, idx in groups.items():
        names = {events[i].get("args", {}).get("hlo_op") or events[i]["name"] for i in idx}
        if key[0] != "":
            named = [p for p in programs if p.module == key[0]]
            if len(named) == 1:
                for i in idx:
                    out[i] = named[0].name
                continue
            score, best = max(((len(names & p.top_ops) / len(names | p.top_ops), p.name) for p in named or programs),
                              default=(0, None))
            if score > 0:
                for i in idx:
                    out[i] = best
                continue
        for i in idx:
            op = events[i].get("args", {}).get("hlo_op") or events[i]["name"]
            out[i] = next((p.name for p in programs if op in p.ops), None)
    return out


def counted(events: list[dict], programs: list[Program], modules=()) -> list[tuple[dict, str | None]]:
    """(event, its program) for the events the tables count: not a loop / conditional / call whose ops are
    counted themselves (a while loop's span also holds its own overhead between its body's ops)."""
    by_name = {p.name: p for p in programs}
    progs = assign_programs(events, programs, modules)
    traced: dict[str | None, set[str]] = collections.defaultdict(set)
    for e, prog in zip(events, progs):
        traced[prog].add(e.get("args", {}).get("hlo_op") or e["name"])
    containers = {(prog, op) for prog, ops in traced.items() if prog in by_name
                  for op in ops if by_name[prog].is_container(op, ops)}
    return [(e, prog) for e, prog in zip(events, progs)
            if (prog, e.get("args", {}).get("hlo_op") or e["name"]) not in containers]


def summarize(events: list[dict], programs: list[Program], steps: int, modules=()) -> list[dict]:
    """One row per (program, op): seconds and launches per step, category, where, estimated bytes and FLOPs."""
    by_name = {p.name: p for p in programs}
    acc: dict[tuple, dict] = {}
    for e, prog in counted(events, programs, modules):
        a = e.get("args", {})
        op = a.get("hlo_op") or e["name"]
        r = acc.setdefault((prog, op), {"program": prog or "", "name": op, "kernels": set(), "time_us": 0.0,
                                        "events": 0, "args": a})
        r["time_us"] += e["dur"]
        r["events"] += 1
        if e["name"] != op:
            r["kernels"].add(e["name"])
    rows = []
    for (prog, op), r in acc.items():
        p = by_name.get(prog)
        path, source = p.where(op) if p else ("", "")
        ins = p.ops[op][1] if p and op in p.ops else None
        a = r["args"]
        path = path or a.get("tf_op", "") or a.get("long_name", "")
        source = source or a.get("source", "")
        fields = {"program": prog or "", "where": f"{path} {source}",
                  "op": " ".join([op, ins.opcode if ins else "", ins.target if ins else "", *sorted(r["kernels"])])}
        flops = float(a["flops"]) if "flops" in a else (p.op_flops(op) if p else 0.0)
        nbytes = float(a["bytes_accessed"]) if "bytes_accessed" in a else (p.op_bytes(op) if p else None)
        n = r["events"] / steps
        runs = n / max(1, len(r["kernels"]))  # executions a step: an op of k kernels has k events a run
        rows.append({"name": op, "program": r["program"], "category": categorize(fields),
                     "time_s": r["time_us"] * 1e-6 / steps, "count": n, "where": path, "source": source,
                     "kernels": sorted(r["kernels"])[:4],
                     "bytes": None if nbytes is None else nbytes * runs, "flops": flops * runs})
    total = sum(r["time_s"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["time_s"] / total
        t = r["time_s"]
        r["bytes_per_s"] = r["bytes"] / t if r["bytes"] and t > 0 else None
        r["flops_per_s"] = r["flops"] / t if r["flops"] and t > 0 else None
    return sorted(rows, key=lambda r: -r["time_s"])


def by_category(rows: list[dict]) -> list[dict]:
    total = sum(r["time_s"] for r in rows) or 1.0
    out = []
    for cat in CATEGORIES:
        mine = [r for r in rows if r["category"] == cat]
        if mine:
            t = sum(r["time_s"] for r in mine)
            out.append({"category": cat, "time_s": t, "share": t / total, "ops": len(mine),
                        "count": sum(r["count"] for r in mine)})
    return sorted(out, key=lambda c: -c["time_s"])


# ----- printing ----------------------------------------------------------------------------------
def _rate(x: float | None, unit: str) -> str:
    if not x:
        return ""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _short_where(path: str, source: str, width: int = 64) -> str:
    """The op_name without the program's own prefixes, and the source file's name and line."""
    s = re.sub(r"^(~?)jit\([\w.]+\)/", r"\1", path)
    s = re.sub(r"\w+ForCausalLM\.decode/", "", s)
    s = re.sub(r"\w+ForCausalLM\.", "", s)
    s = re.sub(r"(layers_\d+)\.\w+/\1\.", r"\1/", s)
    s = re.sub(r"\.(decode|prefill|__call__)\b", "", s)
    s = re.sub(r"\b[\w]+\.(_\w+)/", r"\1/", s)  # self_attn._rope/ -> _rope/
    if source:
        src = os.path.basename(source.split()[0])
        s = f"{s} ({src})" if s else src
    return s if len(s) <= width else s[:width // 2 - 1] + ".." + s[-(width - width // 2 - 1):]


def print_table(res: dict, top: int) -> None:
    rows, cats = res["ops"], res["categories"]
    print(f"step {res['step_s'] * 1e3:.3f} ms (wall, mean of {res['steps']} engine steps); ops "
          f"{res['op_s'] * 1e3:.3f} ms a step (sum of {sum(r['count'] for r in rows):.0f} op events), busy "
          f"{res['busy_s'] * 1e3:.3f} ms = {res['busy_s'] / res['step_s'] * 100:.1f}% of the step "
          f"(the rest: host work and gaps); events from {res['source']}")
    hdr = f"{'#':>3}  {'operation':<30} {'program':<7} {'category':<22} {'ms/step':>9} {'share':>6} {'count':>6} " \
          f"{'est. B/s':>10} {'est. FLOP/s':>12}  where"
    print(hdr)
    for i, r in enumerate(rows[:top], 1):
        print(f"{i:>3}  {r['name'][:30]:<30} {r['program'][:7]:<7} {r['category']:<22} {r['time_s'] * 1e3:>9.4f} "
              f"{r['share'] * 100:>5.1f}% {r['count']:>6.3g} {_rate(r['bytes_per_s'], 'B/s'):>10} "
              f"{_rate(r['flops_per_s'], 'FLOP/s'):>12}  {_short_where(r['where'], r['source'])}")
    if len(rows) > top:
        rest = rows[top:]
        print(f"     ({len(rest)} more ops: {sum(r['time_s'] for r in rest) * 1e3:.4f} ms, "
              f"{sum(r['share'] for r in rest) * 100:.1f}%; --top)")
    print(f"\n{'category':<24} {'ms/step':>9} {'share':>7} {'ops':>5} {'count':>7}")
    for c in cats:
        print(f"{c['category']:<24} {c['time_s'] * 1e3:>9.4f} {c['share'] * 100:>6.1f}% {c['ops']:>5} "
              f"{c['count']:>7.4g}")
    print(f"{'total':<24} {res['op_s'] * 1e3:>9.4f} {100.0:>6.1f}%")
    cost = res.get("cost")
    if cost:
        step = res["step_s"]
        print(f"\ncost analysis (XLA, the step's programs: {', '.join(cost['programs'])}): "
              f"{cost['bytes'] / 1e6:.4g} MB, {cost['flops'] / 1e9:.4g} GFLOP a step")
        print(f"achieved over the step's {step * 1e3:.3f} ms: {_rate(cost['bytes'] / step, 'B/s')} = "
              f"{cost['bytes'] / step / res['copy_bw'] * 100:.1f}% of the measured copy bandwidth "
              f"({_rate(res['copy_bw'], 'B/s')}); {_rate(cost['flops'] / step, 'FLOP/s')} = "
              f"{cost['flops'] / step / res['matmul_rate'] * 100:.2f}% of the measured bf16 matmul rate "
              f"({_rate(res['matmul_rate'], 'FLOP/s')})")
        fl = res["floor"]
        print(f"floors: memory {cost['bytes'] / res['copy_bw'] * 1e3:.3f} ms, compute "
              f"{cost['flops'] / res['matmul_rate'] * 1e3:.3f} ms (cost analysis); bench_decode's model floor "
              f"{fl['s'] * 1e3:.3f} ms ({fl['bytes'] / 1e6:.4g} MB, {fl['flops'] / 1e9:.4g} GFLOP) = "
              f"{fl['s'] / step * 100:.1f}% of the step")


def write_csv(path: str, rows: list[dict]) -> None:
    cols = ["name", "program", "category", "time_s", "share", "count", "bytes", "flops", "bytes_per_s",
            "flops_per_s", "where", "source"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


# ----- the run -----------------------------------------------------------------------------------
def compile_programs(calls) -> list[Program]:
    """The step's programs (each once), with their HLO and XLA's cost analysis."""
    programs, seen = [], set()
    for name, fn, args, kw in calls:
        if name in seen:
            continue
        seen.add(name)
        compiled = fn.lower(*args, **kw).compile()
        cost = compiled.cost_analysis()
        cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
        prog = Program(name, compiled.as_text(), cost)
        programs.append(prog)
    return programs


def profile(a) -> dict:
    if a.kernels not in ("auto", "pallas", "xla"):
        raise SystemExit(f"--kernels: {a.kernels!r} is not one of auto, pallas, xla")
    k = a.speculative_tokens
    hf = bench_hf_config(a.preset, a.layers, a.set, **({"num_nextn_predict_layers": 1} if k else {}))
    cfg = parse_model_config(hf)
    a.output_len = (a.warmup + a.steps + 8) * (k + 1)  # the batch stays full through every step
    t0 = time.perf_counter()
    # The synchronous loop: each annotated step is one whole step (with the engine's default async loop a
    # step's span is the host's call while the device runs the one before, so spans and per-step sums
    # would not line up); the gaps it shows are the host time the async loop hides.
    m, eng, seqs = build_decode_batch(hf, "none", a.kernels, a, a.weight_dtype, async_scheduling=False,
                                      speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)
    for _ in range(a.warmup):  # compiles the step and the sampler
        kind, _ = eng.step()
        assert kind == "decode", kind
    programs = compile_programs(capture_step_programs(eng))
    print(f"built, filled and warmed up in {time.perf_counter() - t0:.1f} s; programs a step: "
          f"{', '.join(p.name for p in programs)}", flush=True)
    bw, rate = measure_copy_bandwidth(), measure_matmul_rate()

    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="profile_step_")
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0  # Python call events would slow the host loop being measured
        walls = []
        with jax.profiler.trace(trace_dir, profiler_options=opts):
            for i in range(a.steps):
                t = time.perf_counter()
                with jax.profiler.TraceAnnotation(ANNOTATION, step=i):
                    kind, _ = eng.step()  # synchronous: returns with the step's tokens on the host
                walls.append(time.perf_counter() - t)
                assert kind == "decode", kind
        if any(s.is_finished for s in seqs):
            raise SystemExit("the batch finished during the profiled steps")
        path = find_trace(trace_dir)
        with gzip.open(path, "rt") as f:
            res = analyze(json.load(f), programs, a.steps)
    finally:
        if not a.trace_dir:
            shutil.rmtree(trace_dir, ignore_errors=True)
    del m, eng, seqs
    if res["step_s"] is None:  # the annotations did not come through: the host's own clock
        res["step_s"] = float(np.mean(walls))
    step = res["step_s"]
    ctx = a.input_len + a.warmup + 1 + a.steps // 2  # bench_decode's: the cache length mid-way
    fp8 = EngineConfig.create(cfg, **weight_kw(a.weight_dtype)).fp8
    fbytes, fflops = step_floor(cfg, a.concurrency, ctx, kv_itemsize=1 if a.kv_dtype == "fp8" else 2, fp8=fp8)
    cost = None
    if all(p.cost.get("flops") is not None and p.cost.get("bytes accessed") is not None for p in programs):
        cost = {"programs": [p.name for p in programs], "flops": sum(float(p.cost["flops"]) for p in programs),
                "bytes": sum(float(p.cost["bytes accessed"]) for p in programs),
                "by_program": {p.name: {"flops": float(p.cost["flops"]), "bytes": float(p.cost["bytes accessed"])}
                               for p in programs}}
    head = {"preset": a.preset, "layers": cfg.num_hidden_layers, "concurrency": a.concurrency,
            "input_len": a.input_len, "kernels": a.kernels, "weight_dtype": a.weight_dtype, "kv_dtype": a.kv_dtype,
            "device": jax.devices()[0].device_kind, "wall_step_s": float(np.mean(walls)), "copy_bw": bw,
            "matmul_rate": rate, "floor": {"bytes": fbytes, "flops": fflops, "s": max(fbytes / bw, fflops / rate)},
            "cost": cost, "trace": path if a.trace_dir else None}
    if cost:
        head["achieved_bytes_per_s"], head["achieved_flops_per_s"] = cost["bytes"] / step, cost["flops"] / step
    return {**head, **res}


def analyze(trace: dict, programs: list[Program], steps: int) -> dict:
    """The tables from a loaded trace of ``steps`` annotated steps of ``programs``."""
    events, source, modules = op_events(trace)
    if not events:
        raise SystemExit("no op events in the trace")
    rows = summarize(events, programs, steps, modules)
    spans = step_spans(trace)
    busy = _busy([e for e, _ in counted(events, programs, modules)])  # over the events the rows count
    return {"steps": steps, "source": source, "step_s": float(np.mean(spans)) if len(spans) == steps else None,
            "op_s": sum(r["time_s"] for r in rows), "busy_s": busy / steps,
            "categories": by_category(rows), "ops": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (first layer dense)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10, help="profiled steps (the table is per step)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kernels", default="xla", help="auto / pallas / xla")
    ap.add_argument("--fill", choices=["prefill", "random"], default="random",
                    help="how the batch's cache is filled before the steps (bench_decode --fill)")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--weight-dtype", default="bf16", help="bf16 / fp8 / fp8:<layer types joined by +>")
    ap.add_argument("--speculative-tokens", type=int, default=0,
                    help="MTP draft tokens a step (the preset's MTP layer added): a speculative step is profiled")
    ap.add_argument("--trace-dir", default=None, help="keep the trace here (Perfetto / TensorBoard)")
    ap.add_argument("--top", type=int, default=25, help="rows of the per-op table")
    ap.add_argument("--json", default=None, help="write the tables (every op) and the step's numbers here")
    ap.add_argument("--csv", default=None, help="write the per-op table (every op) here")
    add_engine_flags(ap)  # --dtype, --fp8-variant, --moe-kernel, --mla-kernel, ... (moejax/engine_args.py)
    a = ap.parse_args(argv)
    if a.concurrency < 1 or a.steps < 1:
        raise SystemExit("--concurrency and --steps must be positive")
    print(f"decode step profile: {a.preset}{f', {a.layers} layers' if a.layers else ''}, c{a.concurrency}, input "
          f"{a.input_len}, {a.weight_dtype} weights, {a.kv_dtype} KV cache, kernels {a.kernels}, {a.steps} steps; "
          f"device {jax.devices()[0].device_kind}", flush=True)
    res = profile(a)
    print_table(res, a.top)
    if res["trace"]:
        print(f"trace: {res['trace']} (ui.perfetto.dev, or tensorboard --logdir {a.trace_dir})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    if a.csv:
        write_csv(a.csv, res["ops"])
    sys.stdout.flush()
    return res


if __name__ == "__main__":
    main()
