"""The documents' links and cited result files resolve (fast, no network).

Checks README.md, docs/*.md and bench/README.md: every relative Markdown link points at a file or
folder of the repository, every ``bench/results`` file they name (``NAME-YYYY-MM-DD...``, with an
extension, ``.{json,png}`` or as a prefix) exists, and every file kept in ``bench/results/`` is
cited by one of them or by the bundled model's card.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITERS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bole" / "bundled" / "README.md"]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)
RESULT = re.compile(r"(?<![\w.+-])([A-Za-z][\w.+-]*-20\d\d-\d\d-\d\d[\w.+-]*?)(\.\{json,png\}|\.json|\.png|\.txt)?"
                    r"(?![\w+-]|\.\w)")


def _docs():
    if not (ROOT / "README.md").is_file():
        pytest.skip("no README.md next to the package (an installed copy)")
    return [p for p in DOCS if p.is_file()]


def _prose(path: Path) -> str:
    return FENCE.sub("", path.read_text())


def test_relative_links_resolve():
    broken = []
    for doc in _docs():
        for target in LINK.findall(_prose(doc)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue                                   # a URL or an anchor in the same file
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_cited_results_exist():
    files = {p.name for p in RESULTS.iterdir()}
    missing = []
    for doc in _docs():
        for stem, ext in RESULT.findall(doc.read_text()):
            if ext == ".{json,png}":
                wanted = [stem + ".json", stem + ".png"]
                ok = all(w in files for w in wanted)
            elif ext:
                ok = stem + ext in files
            else:
                ok = any(f.startswith(stem) for f in files)
            if not ok:
                missing.append(f"{doc.relative_to(ROOT)}: {stem}{ext}")
    assert not missing, "cited bench/results files that do not exist:\n" + "\n".join(missing)


def test_every_result_file_is_cited():
    _docs()
    text = "\n".join(p.read_text() for p in CITERS if p.is_file())
    uncited = [p.name for p in sorted(RESULTS.iterdir())
               if p.name.rsplit(".", 1)[0] not in text]
    assert not uncited, "bench/results files no document cites:\n" + "\n".join(uncited)


def test_results_and_docs_stay_within_their_limits():
    """bench/results holds at most 40 files (runs the README and model cards cite; probes are
    lines in bench/NOTES.md), the README at most 300 lines, NOTES at most 600."""
    assert len(list(RESULTS.iterdir())) <= 40, sorted(p.name for p in RESULTS.iterdir())
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    assert len((ROOT / "bench" / "NOTES.md").read_text().splitlines()) <= 600


def test_cited_h200_parts_exist():
    """Every `... h200_runs.sh PART ...` a document quotes is a part the script has."""
    script = (ROOT / "bench" / "h200_runs.sh").read_text()
    listed = re.search(r'^parts="([^"]*)"', script, re.M)
    assert listed, "bench/h200_runs.sh lost its parts list"
    parts = set(listed.group(1).split())
    unknown = []
    for doc in _docs() + [ROOT / "bench" / "NOTES.md"]:
        for span in re.findall(r"`([^`]*h200_runs\.sh[^`]*)`", doc.read_text()):
            for word in span.split("h200_runs.sh", 1)[1].split():
                if re.fullmatch(r"[a-z][a-z0-9-]*", word) and word not in parts:
                    unknown.append(f"{doc.relative_to(ROOT)}: {word}")
    assert not unknown, "bench/h200_runs.sh parts that do not exist:\n" + "\n".join(unknown)
