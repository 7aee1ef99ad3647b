"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source export.

On the device (the profile of the verification kernel's picked launches at batch 1 and 16):

    ncu --clock-control none -k regex:_tree_gdn_verify_kernel --set full -o rep \\
        python3 bench/tuning/kernel_probe.py --once --batches 1 16 --nodes 64
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv

Then, anywhere (plain or gzipped csv):

    python bench/tuning/ncu_hotspots.py src.csv [--bucket 100] [--top 20]

For each profiled launch it prints the total of warp-state samples, the stall reasons' shares, the
share of samples per bucket of consecutive SASS instructions (the loops of
``bench/tuning/kernel_registers.py --sass`` are instruction ranges in the same numbering) and the
instructions with the most samples and their two largest reasons.

``--config JSON`` (a ``VerifyConfig`` as keyword arguments, ``--block-nodes``, ``--model``) also
compiles that launch here as bench/tuning/kernel_registers.py does, with the device's Triton (3.6 on the
H200: ``PYTHONPATH=/tmp/triton36``), and shares the samples out by source line through nvdisasm's
line table. It checks that every instruction's opcode matches the profiled one and refuses
otherwise (another Triton, or another launch, gives other code):

    PYTHONPATH=/tmp/triton36 python bench/tuning/ncu_hotspots.py src.csv.gz --config '{"BV": 64, ...}'
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run by path, Python puts bench/tuning/ first on sys.path: drop it, so that bench's modules are
# reached as bench.<name> and never shadow, or are shadowed by, an installed package of that name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench" / "tuning")]

SAMPLES = "Warp Stall Sampling (All Samples)"


def launches(text: str) -> list[list[dict[str, str]]]:
    """One list of per-instruction rows for each kernel launch in the export."""
    parts = [p for p in re.split(r'^"Kernel Name".*\n', text, flags=re.M) if p.strip()]
    return [list(csv.DictReader(io.StringIO(p))) for p in parts]


def number(x: str | None) -> float:
    try:
        return float(x or 0)
    except ValueError:
        return 0.0


def report(rows: list[dict[str, str]], bucket: int, top: int) -> str:
    total = sum(number(r[SAMPLES]) for r in rows) or 1.0
    reasons = [k for k in rows[0] if k.startswith("stall_") and "(Not Issued)" not in k]
    by_reason = Counter({k: sum(number(r[k]) for r in rows) for k in reasons})
    by_bucket = Counter()
    for i, r in enumerate(rows):
        by_bucket[i // bucket * bucket] += number(r[SAMPLES])
    out = [f"{len(rows)} SASS instructions, {total:.0f} samples",
           "stall reasons: " + ", ".join(f"{k[6:]} {v / total:.1%}"
                                         for k, v in by_reason.most_common(8)),
           f"samples per {bucket} instructions: " + ", ".join(
               f"{b}: {v / total:.1%}" for b, v in sorted(by_bucket.items()) if v)]
    for i in sorted(range(len(rows)), key=lambda i: -number(rows[i][SAMPLES]))[:top]:
        r = rows[i]
        lead = sorted(reasons, key=lambda k: -number(r[k]))[:2]
        out.append(f"  {i:5d} {number(r[SAMPLES]) / total:6.1%}  {r['Source'].strip()[:64]:<64} "
                   + ", ".join(f"{k[6:]} {number(r[k]):.0f}" for k in lead))
    return "\n".join(out)


def opcode(sass: str) -> str:
    """The opcode (with its modifiers) of one SASS instruction as ncu prints it."""
    words = sass.split()
    return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


def by_source_line(rows: list[dict[str, str]], lines: list[tuple[str, int, str | None]],
                   top: int) -> str:
    """Shares of the samples per source line, ``lines`` from kernel_registers.sass_source_lines
    of the same binary (opcodes checked one by one)."""
    ops = [opcode(r["Source"].strip()) for r in rows]
    if len(ops) != len(lines) or any(a != b[0] for a, b in zip(ops, lines)):
        bad = next((i for i, (a, b) in enumerate(zip(ops, lines)) if a != b[0]), min(len(ops), len(lines)))
        raise SystemExit(f"the local compile is not the profiled binary ({len(lines)} against "
                         f"{len(ops)} instructions, first difference at {bad}): use the device's "
                         "Triton and the launch's VerifyConfig")
    total = sum(number(r[SAMPLES]) for r in rows) or 1.0
    shares = Counter()
    for r, (_, line, name) in zip(rows, lines):
        shares[(name, line)] += number(r[SAMPLES])
    gdn = Path(__file__).resolve().parents[2] / "bole" / "ops" / "gdn"
    sources = {f.name: f.read_text().splitlines() for f in gdn.glob("*.py")}
    out = ["samples by source line:"]
    for (name, line), v in shares.most_common(top):
        src = sources.get(name, [])
        text = src[line - 1].strip()[:80] if 0 < line <= len(src) else ""
        out.append(f"  {v / total:6.1%}  {name}:{line}  {text}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--bucket", type=int, default=100)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--config", default=None,
                    help="the profiled launch's VerifyConfig as JSON: also share the samples "
                         "out by source line (compiles it here; needs the device's Triton)")
    ap.add_argument("--block-nodes", type=int, default=64)
    ap.add_argument("--model", default="qwen3.5-9b")
    args = ap.parse_args(argv)
    lines = None
    if args.config:
        import json

        from bench.tuning import kernel_registers as kr
        from bole.config import gdn_shape
        from bole.ops.gdn.verify.kernel import VerifyConfig
        compiled = kr.compile_verify(gdn_shape(args.model), args.block_nodes,
                                     VerifyConfig(**json.loads(args.config)))
        lines = kr.sass_source_lines(compiled)
    path = Path(args.csv)
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    for n, rows in enumerate(launches(text)):
        print(f"launch {n}: " + report(rows, args.bucket, args.top))
        if lines is not None:
            print(by_source_line(rows, lines, args.top))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
