"""Peak memory of a long prefill on the CPU: it must grow linearly with the prompt.

Each prompt length runs in a fresh process (the bundled model, fp32, the runner's chunked
prefill: SDPA attention over the KV pool and the closed form per chunk of GDN), which reports its
peak resident set size (``ru_maxrss``). The bundled model's context is 4,096 positions; the
prompts here go past it on purpose (the cache is sized for them, RoPE extrapolates): what is
measured is memory, not text quality.

    python bench/prefill_memory.py                    # 2k / 4k / 8k / 16k tokens
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import resource, sys, time, torch
sys.path.insert(0, {root!r})
from bole.assets import BUNDLED_MODEL
from bole.engine.runner import ModelRunner
from bole.models.qwen3_hybrid import HybridModel
n = {n}
model = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
runner = ModelRunner(model, model.new_cache(1, n + 8), "torch")
slot = runner.cache.allocate(n + 8)
prompt = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter()
logits, hidden = runner.prefill(slot, prompt)
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      bool(torch.isfinite(logits).all()))
"""


def measure(n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), n=n)],
                         capture_output=True, text=True, check=True).stdout.split()
    return dict(prompt_tokens=n, prefill_s=float(out[0]), peak_rss_gb=int(out[1]) / 1e9,
                finite=out[2] == "True")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--limit-gb", type=float, default=2.0, help="the target for the longest")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    import torch
    rows = [measure(n) for n in args.tokens]
    print(f"{'prompt':>8} {'prefill s':>10} {'peak RSS GB':>12}")
    for r in rows:
        print(f"{r['prompt_tokens']:>8} {r['prefill_s']:>10.2f} {r['peak_rss_gb']:>12.2f}")
    longest = rows[-1]
    ok = longest["peak_rss_gb"] <= args.limit_gb and all(r["finite"] for r in rows)
    print(f"{longest['prompt_tokens']} tokens: {longest['peak_rss_gb']:.2f} GB peak RSS "
          f"({'within' if ok else 'OVER'} the {args.limit_gb} GB target)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    path = out / f"prefill-memory-{date}-cpu.json"
    path.write_text(json.dumps(dict(meta=dict(date=date, model="bundled", dtype="float32",
                                              device="cpu", torch=torch.__version__,
                                              time=time.strftime("%H:%M:%S")),
                                    rows=rows), indent=1))
    print(path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
