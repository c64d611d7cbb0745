"""The written record stays in step with the tree, checked on the files (nothing is run):

- docs/architecture.md names every module of moejax/ and pallas_kernels/ by its path;
- BENCHMARKS.md opens with its at-a-glance table on the first screen;
- every link and every ``benchmarks/...`` path that BENCHMARKS.md, benchmarks/README.md, README.md
  and docs/*.md give exists (a path given at a commit, ``<hash>:benchmarks/...``, in that commit),
  and every ``#anchor`` link names a heading of its file.
"""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("moejax", "pallas_kernels")
RECORD = ("BENCHMARKS.md", "benchmarks/README.md", "README.md",
          *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
FIRST_SCREEN = 45  # lines: the intro and the at-a-glance table


def test_architecture_names_every_module():
    """Invariant: each .py file under moejax/ and pallas_kernels/ appears in docs/architecture.md by its
    path from the repository root (a failure lists the missing ones)."""
    text = (ROOT / "docs/architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
               if "__pycache__" not in p.parts and str(p.relative_to(ROOT)) not in text]
    assert not missing, "docs/architecture.md does not name: " + ", ".join(missing)


def test_benchmarks_first_screen_is_the_glance_table():
    """BENCHMARKS.md's first screen holds the at-a-glance table whole, each row naming a card and a date."""
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    start = lines.index("## At a glance")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append(line)
    end = lines.index(rows[-1])
    assert end < FIRST_SCREEN, f"the table ends at line {end + 1}, past the first screen ({FIRST_SCREEN})"
    header, *body = rows
    cols = [c.strip() for c in header.strip("|").split("|")]
    card, date = cols.index("card"), cols.index("date")
    for row in body:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(cols), row
        assert cells[card] and re.search(r"\d{4}-\d{2}-\d{2}|not given", cells[date]), row


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", RECORD)
def test_record_links_and_paths_exist(doc):
    """Every markdown link target (file or #anchor) and every `benchmarks/...` path in backticks (no
    wildcards) resolves; a failure lists what does not."""
    path = ROOT / doc
    text = path.read_text()
    anchors = _anchors(text)
    bad, held = [], []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        if file:
            if not (path.parent / file).exists():
                bad.append(target)
        elif anchor not in anchors:
            bad.append(target)
    # Any benchmarks/... path in the text, but those given at a commit ("<hash>:benchmarks/...": removed
    # from the tree, still in git) and patterns (wildcards, placeholders).
    for ref in re.findall(r"(?<![\w:/.-])(benchmarks/[^\s`)\],;'\"]*)", text):
        ref = ref.rstrip(".:")
        if any(c in ref for c in "*{}<>[]") or "..." in ref:
            continue
        if not (ROOT / ref).exists():
            bad.append(ref)
    for rev, ref in re.findall(r"\b([0-9a-f]{7,40}):(benchmarks/[^\s`)\],;'\"]*)", text):
        if not any(c in ref for c in "*{}<>[]"):
            held.append((rev, ref.rstrip(".:")))
    assert not bad, f"{doc}: not found: " + ", ".join(sorted(set(bad)))
    git = shutil.which("git")
    if held and git and (ROOT / ".git").exists():
        gone = [f"{rev}:{ref}" for rev, ref in sorted(set(held))
                if subprocess.run([git, "cat-file", "-e", f"{rev}:{ref}"], cwd=ROOT, capture_output=True).returncode]
        assert not gone, f"{doc}: not in git: " + ", ".join(gone)
