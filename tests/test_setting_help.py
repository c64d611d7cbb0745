"""The engine settings' help (moejax/engine_args.py) names code that exists: every file it cites, and
each rule it names after the file (``moejax/kernels/moe.py: moe_kernel``), defined there."""

import dataclasses
import os
import re

from moejax.engine_args import EngineArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CITATION = re.compile(r"((?:moejax|pallas_kernels|docs|configs)/[\w/]+\.\w+)(?:: (\w+))?")


def test_every_file_and_rule_a_setting_cites_exists():
    cited = 0
    for f in dataclasses.fields(EngineArgs):
        for path, name in CITATION.findall(f.metadata["help"]):
            assert os.path.isfile(os.path.join(ROOT, path)), f"{f.name}'s help cites {path}, which does not exist"
            if name:
                text = open(os.path.join(ROOT, path)).read()
                assert re.search(rf"^(def|class) {name}\b|^{name} =", text, re.M), \
                    f"{f.name}'s help names {name} in {path}, which does not define it"
            cited += 1
    assert cited >= 6  # the kernel settings each cite their rule
