"""Whether two programs of the tiny default's precompiled set are the same program: each lowered to StableHLO,
its module name and locations dropped, hashed; prints the count of distinct modules and any label groups
that share one. Run from the repository root; flags after the script go to moejax serve's parser
(e.g. --kv-role both for the set with every export/import program)."""

import collections
import hashlib
import os
import re
import sys

sys.path.insert(0, os.getcwd())

import moejax  # noqa: E402
from moejax.server.cli import build_load_kwargs, parse_args  # noqa: E402
from moejax.tiny.default_model import default_model_path  # noqa: E402

kw = build_load_kwargs(parse_args(sys.argv[1:]))
kw["executable_cache_dir"] = "off"
programs = moejax.load(default_model_path(), progress=False, **kw).engine.runner.precompile_programs()
by = collections.defaultdict(list)
for p in programs:
    text = re.sub(r"loc\(.*?\)", "", re.sub(r"module @\S+", "module", p.lower().as_text()))
    by[hashlib.sha256(text.encode()).hexdigest()].append(p.label)
print(len(programs), "programs,", len(by), "distinct lowered modules")
for labels in by.values():
    if len(labels) > 1:
        print("the same program:", labels)
