"""The serving headline (issue 20): every mode behind ``bole serve`` under the same closed loop.

For each mode (ar, chain, tree-serial, bole) on the bundled model with its MTP drafter and the
default tree, a ``bole serve --mode M --max-batch 32`` starts as a subprocess on 127.0.0.1 and a
free port (its own process group, stopped with it whatever happens). Once /health answers, a
short warm-up load runs (prefill shapes compiled, nothing of it measured), then the load
generator (bole/bench/loadgen.py) sends --requests streaming greedy completions of the bundled
code prompts from --concurrency closed-loop clients, --max-tokens each. Per mode: TTFT, TPOT and
ITL (mean, p50, p90, p99), output tokens/s, goodput under the TPOT SLO, the speculative
statistics of /metrics over the measured load alone (rounds, accepted tokens per request and
round, round time), the server's start-up time and CUDA-graph capture time (from its log).

``--workload shared-prefix``: every request a 2,048-token prefix (one of 8) and a 64-token suffix
of its own (token ids from the bundled model's code prompts), ``unique-prefix`` the same lengths
with a prefix per request; ``--no-prefix-cache`` serves with the cache off (the prefix cache's
hit rate is in each record).

Writes serve-<date>-bundled-all-modes<tag>.json (meta: device, versions, date, commit, settings;
one record per mode; the issue's targets) and a .png (output tokens/s and p50 TPOT per mode),
and prints a markdown table. Targets: bole's output tokens/s >= 1.8x ar's, its p50 TPOT <= 0.5x.

    python bench/serve.py                      # on a GPU: into $OUT if set, else bench/results
    python bench/serve.py --device cpu --dtype float32 --requests 8 --concurrency 4 \\
        --max-tokens 8 --out /tmp/serve-smoke                   # CPU smoke run
    python bench/serve.py --modes bole --workload shared-prefix --tag=-shared        # on a GPU
    python bench/serve.py --modes bole --workload shared-prefix --no-prefix-cache --tag=-shared-off

``--replicas 1 2`` (issue 48) measures the first of --modes under ``bole serve --replicas N`` for
each N (0: plain ``bole serve``, no Ray) instead of the modes, each N's output tokens/s over the
first N's, into serve-<date>-bundled-replicas<tag>.json and a markdown table. Target: on the CPU,
2 replicas >= 1.7x one replica's output tokens/s under 32 clients, on a machine with the cores for
it (--replica-cpus cores each; the record holds the machine's core count):

    python bench/serve.py --device cpu --modes bole --replicas 1 2 --max-batch 16 \\
        --requests 128 --max-tokens 64 --concurrency 32             # needs bole[ray]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
# Run by path, Python puts bench/ first on sys.path: drop it, so that bench's modules are reached
# as bench.<name> and can never shadow, or be shadowed by, an installed package of the same name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bench.harness import add_output_args, results_path, run_label, save_png  # noqa: E402

from bole.assets import code_prompts  # noqa: E402
from bole.engine.spec import MODES  # noqa: E402
from bole.bench.loadgen import LoadConfig, Prompt, format_table, run_load  # noqa: E402

ALL_MODES = ("ar", "chain", "tree-serial", "bole")
assert set(ALL_MODES) == set(MODES)
#: the issue's targets for bole against ar at the same load
TARGET_TOKENS_X, TARGET_TPOT_X = 1.8, 0.5
DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
          "fp32": "fp32", "float32": "fp32"}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CAPTURED = re.compile(r"captured (\d+) CUDA graphs for batches up to (\d+) in ([\d.]+) s")

#: run in the server's process: die with this script (PR_SET_PDEATHSIG, so that not even a
#: SIGKILL of the script leaves a server behind), then ``bole serve`` with the arguments given
_LAUNCH = """import os, signal, sys
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except Exception:
    pass
if os.getppid() != {parent}:
    sys.exit(3)
from bole.cli import main
sys.exit(main(sys.argv[1:]))
"""


WORKLOADS = {
    "code": "the bundled code prompts, cycled",
    "shared-prefix": "8 token-id prefixes of --prefix-tokens, each request one of them (in "
                     "turn) and --suffix-tokens of its own",
    "unique-prefix": "a token-id prefix of --prefix-tokens and --suffix-tokens for each request",
}
#: distinct prefixes of the shared-prefix workload
SHARED_PREFIXES = 8


def workload_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts of ``args.workload``: texts, or token ids drawn (seeded) from the bundled
    code prompts' tokens, so that lengths are exact."""
    if args.workload == "code":
        return [Prompt(t) for t in code_prompts()]
    import random

    from tokenizers import Tokenizer

    from bole.assets import BUNDLED_MODEL
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    pool = [i for t in code_prompts() for i in tok.encode(t).ids]
    rng = random.Random(0)

    def draw(n: int) -> list[int]:
        start = rng.randrange(len(pool))
        return [pool[(start + j * 7 + rng.randrange(3)) % len(pool)] for j in range(n)]
    n = args.requests + args.warmup
    shared = [draw(args.prefix_tokens) for _ in range(SHARED_PREFIXES)]
    prefixes = [shared[i % SHARED_PREFIXES] if args.workload == "shared-prefix"
                else draw(args.prefix_tokens) for i in range(n)]
    return [Prompt(p + draw(args.suffix_tokens)) for p in prefixes]


class ServerError(RuntimeError):
    """A server that did not come up or answer: the message ends with its log's tail."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").replace("\r", "\n")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class Server:
    """``bole serve`` in a process group of its own: started on entry, stopped on exit (SIGINT to
    the group, SIGKILL after ``grace`` s), whatever happened in between."""

    def __init__(self, mode: str, args: argparse.Namespace, log: Path, grace: float = 20.0,
                 replicas: int = 0):
        """``replicas``: ``bole serve --replicas N`` (0: a plain server)."""
        self.mode, self.args, self.log, self.grace = mode, args, log, grace
        self.replicas = replicas
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def command(self) -> list[str]:
        a = self.args
        argv = ["serve", "--mode", self.mode, "--max-batch", str(a.max_batch),
                "--host", "127.0.0.1", "--port", str(self.port), "--device", a.device]
        if a.dtype != ("bf16" if a.device.startswith("cuda") else "fp32"):
            argv += ["--dtype", a.dtype]              # only when not serve's own default
        if a.engine_process:
            argv.append("--engine-process")
        if not a.prefix_cache:
            argv.append("--no-prefix-cache")
        if self.replicas:
            argv += ["--replicas", str(self.replicas)]
            if a.replica_cpus:
                argv += ["--replica-cpus", str(a.replica_cpus)]
        return [sys.executable, "-c", _LAUNCH.format(parent=os.getpid()), *argv]

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the start until /health answered 200; ServerError if it never did."""
        t0, deadline = time.perf_counter(), time.perf_counter() + timeout
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise ServerError(f"bole serve --mode {self.mode} exited with code "
                                      f"{self.proc.returncode} before it was ready:\n"
                                      f"{_tail(self.log)}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise ServerError(f"bole serve --mode {self.mode} not ready after {timeout:.0f} s:\n"
                          f"{_tail(self.log)}")

    def get(self, path: str) -> httpx.Response:
        with httpx.Client(trust_env=False, timeout=30.0) as client:
            resp = client.get(f"{self.url}{path}")
        resp.raise_for_status()
        return resp

    def stop(self) -> None:
        """SIGINT to the group (uvicorn shuts down, the engine thread stops), then SIGKILL to
        whatever of the group is left; the server reaped."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(self.grace)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                print(f"bole serve --mode {self.mode} ignored SIGINT for {self.grace:.0f} s: "
                      "killed", file=sys.stderr)
        try:                                          # children left in the group, if any
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.exit_code = proc.wait()
        self.proc = None


def capture_time(log: Path) -> dict[str, Any]:
    """The CUDA-graph capture of the server's log: graphs, largest batch, seconds (None: none)."""
    try:
        m = CAPTURED.search(log.read_text(errors="replace"))
    except OSError:
        m = None
    return dict(graphs=int(m[1]), max_batch=int(m[2]), seconds=float(m[3])) if m else \
        dict(graphs=None, max_batch=None, seconds=None)


def scrape(text: str) -> dict[str, float]:
    """A /metrics page as {sample name with labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def spec_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The speculative statistics of the load between two /metrics scrapes."""
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean(name: str, scale: float = 1.0) -> float | None:
        n = d(f"{name}_count")
        return scale * d(f"{name}_sum") / n if n else None
    return dict(rounds=d("bole_rounds_total"),
                request_rounds=d("bole_accepted_tokens_per_round_count"),
                accepted_tokens=d("bole_accepted_tokens_per_round_sum"),
                mean_accepted_tokens=mean("bole_accepted_tokens_per_round"),
                mean_round_ms=mean("bole_round_seconds", 1e3),
                mean_verified_node_slots=mean("bole_verified_node_slots_per_round"),
                round_s=d("bole_round_seconds_sum"),
                admissions=d("bole_admission_seconds_count"),
                admitted_requests=d("bole_admitted_requests_total"),
                admission_s=d("bole_admission_seconds_sum"),
                mean_admission_ms=mean("bole_admission_seconds", 1e3),
                step_s=d("bole_step_seconds_sum"),
                output_tokens=d("bole_output_tokens_total"),
                prompt_tokens=d("bole_prompt_tokens_total"),
                prefix_cache_queries=d("bole_prefix_cache_queries_total"),
                prefix_cache_hits=d("bole_prefix_cache_hits_total"),
                prefix_cache_hit_rate=d("bole_prefix_cache_hits_total")
                / max(1.0, d("bole_prefix_cache_queries_total")),
                requests={k.split('status=')[1].rstrip('}'): d(k) for k in after
                          if k.startswith("bole_requests_total{") and d(k)})


def settled(server: Server, before: dict[str, float], completed: int,
            timeout: float = 5.0) -> dict[str, float]:
    """/metrics once the server has counted ``completed`` more finished requests (a stream's
    last chunk reaches the client just before the server books its request), or after
    ``timeout`` s."""
    deadline = time.perf_counter() + timeout
    while True:
        after = scrape(server.get("/metrics").text)
        done = sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k.startswith("bole_requests_total{"))
        if done >= completed or time.perf_counter() > deadline:
            return after
        time.sleep(0.05)


def _pick(stats: dict | None) -> dict | None:
    return None if stats is None else {k: stats[k] for k in ("mean", "p50", "p90", "p99")}


def measure(mode: str, args: argparse.Namespace, prompts: list[Prompt], log: Path,
            replicas: int = 0) -> dict:
    """Start mode's server (``replicas``: under ``--replicas N``), warm it up, load it, scrape
    it, stop it: the mode's record."""
    rec: dict[str, Any] = dict(mode=mode, ok=False, error=None, replicas=replicas)
    load = dict(concurrency=args.concurrency, temperature=0.0, slo_tpot_ms=args.slo_tpot_ms,
                duration=args.duration, timeout=args.request_timeout)
    server = Server(mode, args, log, replicas=replicas)
    try:
        with server:
            startup = server.wait_ready(args.startup_timeout)
            card = server.get("/v1/models").json()["data"][0]
            rec["server"] = dict(startup_s=startup, card=card, command=server.command()[3:])
            if card.get("bole", {}).get("mode") != mode:
                raise ServerError(f"the server reports mode {card.get('bole')}, not {mode}")
            print(f"[serve] {mode}: ready after {startup:.1f} s, warming up", flush=True)
            # token-id workloads: the warm-up's requests are the ones after the measured ones
            # (the shared-prefix workload's warm-up uses its prefixes: a warm cache)
            measured, warm = (prompts, prompts) if args.workload == "code" else \
                (prompts[:args.requests], prompts[args.requests:] or prompts)
            if args.warmup:
                run_load(server.url, warm, num_requests=args.warmup,
                         max_tokens=min(args.max_tokens, 16), **load)
            before = scrape(server.get("/metrics").text)
            report = run_load(server.url, measured, num_requests=args.requests,
                              max_tokens=args.max_tokens, **load)
            after = settled(server, before, report.summary["completed"])
    except Exception as exc:                          # the other modes still run
        rec["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[serve] {mode} failed: {rec['error']}", file=sys.stderr, flush=True)
        return rec
    finally:
        rec.setdefault("server", {}).update(capture=capture_time(log),
                                            exit_code=server.exit_code)
    print(format_table(report), flush=True)
    s = report.summary
    spec = spec_stats(before, after)
    print(f"[serve] {mode}: engine steps {spec['step_s']:.2f} s (rounds {spec['round_s']:.2f} s, "
          f"{spec['admissions']:.0f} admissions of {spec['admitted_requests']:.0f} requests "
          f"{spec['admission_s']:.2f} s)", flush=True)
    rec.update(ok=bool(s["completed"]) and s["completed"] == s["requests"],
               error=None if s["completed"] == s["requests"] else
               f"{s['completed']} of {s['requests']} requests completed "
               f"(errors {s['errors_by_status']}, cancelled {s['cancelled']})",
               output_tokens_per_s=s["output_tokens_per_s"], requests_per_s=s["requests_per_s"],
               goodput_rps=s["goodput_rps"], goodput_requests=s["goodput_requests"],
               ttft_ms=_pick(s["ttft_ms"]), tpot_ms=_pick(s["tpot_ms"]),
               itl_ms=_pick(s["itl_ms"]), e2e_ms=_pick(s["e2e_ms"]),
               mean_accepted_tokens=spec["mean_accepted_tokens"], spec=spec,
               loadgen=dict(meta=report.meta, summary=s))
    return rec


def compare(records: list[dict]) -> dict[str, Any]:
    """Each record's ratios to ar (in place), and whether bole meets the issue's targets."""
    by = {r["mode"]: r for r in records if r["ok"]}
    ar = by.get("ar")
    for r in records:
        r["x_ar_tokens_per_s"] = r["x_ar_tpot_p50"] = None
        if ar and r["ok"] and ar["output_tokens_per_s"]:
            r["x_ar_tokens_per_s"] = r["output_tokens_per_s"] / ar["output_tokens_per_s"]
        if ar and r["ok"] and r["tpot_ms"] and ar["tpot_ms"]:
            r["x_ar_tpot_p50"] = r["tpot_ms"]["p50"] / ar["tpot_ms"]["p50"]
    bole = by.get("bole")
    tok = bole["x_ar_tokens_per_s"] if bole else None
    tpot = bole["x_ar_tpot_p50"] if bole else None
    return dict(tokens_per_s_x=TARGET_TOKENS_X, tpot_p50_x=TARGET_TPOT_X,
                bole_tokens_per_s_x=tok, bole_tpot_p50_x=tpot,
                tokens_ok=None if tok is None else tok >= TARGET_TOKENS_X,
                tpot_ok=None if tpot is None else tpot <= TARGET_TPOT_X,
                hold=None if tok is None or tpot is None else
                tok >= TARGET_TOKENS_X and tpot <= TARGET_TPOT_X)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _yes(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def table(data: dict) -> str:
    """The headline as a markdown table, and the targets' verdict."""
    t = data["targets"]
    lines = ["| mode | output tok/s | x ar | p50 TPOT ms | x ar's TPOT | p50 TTFT ms | "
             "accepted tokens / round | targets hold |", "|---|" + "---:|" * 7]
    for r in data["records"]:
        if not r["ok"] and r.get("output_tokens_per_s") is None:
            lines.append(f"| {r['mode']} | failed: {r['error'].splitlines()[0][:90]} |"
                         + " |" * 6)
            continue
        verdict = (f"tok/s {_yes(t['tokens_ok'])}, TPOT {_yes(t['tpot_ok'])}"
                   if r["mode"] == "bole" else "")
        lines.append(
            f"| {r['mode']} | {r['output_tokens_per_s']:.1f} | {_f(r['x_ar_tokens_per_s'], '.2f')}"
            f" | {_f((r['tpot_ms'] or {}).get('p50'), '.2f')} | {_f(r['x_ar_tpot_p50'], '.2f')}"
            f" | {_f((r['ttft_ms'] or {}).get('p50'), '.1f')} | "
            f"{_f(r['mean_accepted_tokens'], '.2f')} | {verdict} |")
    lines.append("")
    lines.append(f"targets: bole output tok/s >= {t['tokens_per_s_x']}x ar's "
                 f"({_f(t['bole_tokens_per_s_x'], '.2f')}x: {_yes(t['tokens_ok'])}), bole p50 "
                 f"TPOT <= {t['tpot_p50_x']}x ar's ({_f(t['bole_tpot_p50_x'], '.2f')}x: "
                 f"{_yes(t['tpot_ok'])}); both hold: {_yes(t['hold'])}")
    return "\n".join(lines)


def plot(path: Path) -> Path:
    """Output tokens/s and p50 TPOT (p90 whiskers) per mode, the targets dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.loads(path.read_text())
    recs, meta = [r for r in data["records"] if r.get("output_tokens_per_s") is not None], \
        data["meta"]
    modes = [r["mode"] for r in recs]
    ar = next((r for r in recs if r["mode"] == "ar"), None)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    tps = [r["output_tokens_per_s"] for r in recs]
    bars = a1.bar(modes, tps, color="tab:blue")
    a1.bar_label(bars, labels=[_f(r["x_ar_tokens_per_s"], ".2f") + "x" for r in recs], fontsize=8)
    a1.set(ylabel="output tokens/s", title="throughput")
    p50 = [(r["tpot_ms"] or {}).get("p50") or 0.0 for r in recs]
    p90 = [(r["tpot_ms"] or {}).get("p90") or 0.0 for r in recs]
    bars = a2.bar(modes, p50, color="tab:orange",
                  yerr=[[0] * len(recs), [max(b - a, 0.0) for a, b in zip(p50, p90)]], capsize=4)
    a2.bar_label(bars, labels=[_f(r["x_ar_tpot_p50"], ".2f") + "x" for r in recs], fontsize=8)
    a2.set(ylabel="p50 TPOT ms (whisker: p90)", title="time per output token")
    if ar:
        a1.axhline(TARGET_TOKENS_X * ar["output_tokens_per_s"], color="r", ls="--",
                   label=f"target {TARGET_TOKENS_X}x ar")
        if ar["tpot_ms"]:
            a2.axhline(TARGET_TPOT_X * ar["tpot_ms"]["p50"], color="r", ls="--",
                       label=f"target {TARGET_TPOT_X}x ar")
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)
    s = meta["settings"]
    fig.suptitle(f"bole serve, bundled model ({meta['dtype']}, {meta['drafter']} drafter), "
                 f"{s['requests']} requests x {s['max_tokens']} tokens, concurrency "
                 f"{s['concurrency']}\n{run_label(meta)}", fontsize=9)
    return save_png(fig, path)


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it); (None, None) without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
        return head, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return None, None


def _versions(device: str) -> dict[str, Any]:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else \
        f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return dict(device=name, torch=torch.__version__, triton=tv, python=platform.python_version())


def _on_sigterm(signum, frame):                       # run the finally blocks: servers stopped
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(ALL_MODES), choices=list(ALL_MODES))
    ap.add_argument("--requests", type=int, default=128, help="measured requests per mode")
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--max-batch", type=int, default=32, help="bole serve --max-batch")
    ap.add_argument("--engine-process", action="store_true",
                    help="bole serve --engine-process: the engine in a process of its own")
    ap.add_argument("--workload", default="code", choices=list(WORKLOADS),
                    help="code: the bundled code prompts; shared-prefix: 8 prefixes of "
                         "--prefix-tokens shared by the requests, a --suffix-tokens suffix "
                         "each; unique-prefix: the same lengths, nothing shared")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="bole serve --no-prefix-cache")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default: bf16 on a GPU, float32 on the CPU")
    ap.add_argument("--warmup", type=int, default=None,
                    help="unmeasured requests (at most 16 tokens) before the load; default: "
                         "--concurrency; 0: none")
    ap.add_argument("--slo-tpot-ms", type=float, default=LoadConfig.slo_tpot_ms,
                    help="TPOT SLO of goodput, ms")
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds a server may take to answer /health (load and capture)")
    ap.add_argument("--duration", type=float, default=300.0, help="cap on one mode's load, s")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="per request, s")
    ap.add_argument("--log-dir", default=None,
                    help="keep the servers' logs here (default: a temporary folder)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git's HEAD)")
    ap.add_argument("--replicas", type=int, nargs="+", default=None,
                    help="measure the first of --modes under bole serve --replicas N for each N "
                         "(0: plain bole serve) instead of the modes")
    ap.add_argument("--replica-cpus", type=int, default=None,
                    help="bole serve --replica-cpus (with --replicas, on the CPU)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    for name in ("requests", "concurrency", "max_tokens", "max_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu --dtype float32 for a smoke run", file=sys.stderr)
        return 2
    args.dtype = DTYPES[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    args.warmup = args.concurrency if args.warmup is None else max(args.warmup, 0)
    if args.replicas is not None and min(args.replicas) < 0:
        ap.error("--replicas counts must be >= 0 (0: plain bole serve)")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run(args) if args.replicas is None else run_replicas(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    """Every mode of ``args.modes`` in turn; the JSON, the plot and the table. 0: all measured."""
    now = _dt.datetime.now()
    commit, dirty = (args.commit, None) if args.commit else git_commit()
    settings = dict(modes=args.modes, requests=args.requests, concurrency=args.concurrency,
                    max_tokens=args.max_tokens, max_batch=args.max_batch, warmup=args.warmup,
                    temperature=0.0, slo_tpot_ms=args.slo_tpot_ms, arrival="closed-loop",
                    prompts=WORKLOADS[args.workload], workload=args.workload,
                    prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                    prefix_cache=args.prefix_cache, engine_process=args.engine_process)
    meta = dict(_versions(args.device), date=now.date().isoformat(), time=now.strftime("%H:%M:%S"),
                commit=commit, dirty=dirty, model="bundled", dtype=DTYPE_NAMES[args.dtype],
                drafter=None, settings=settings)
    which = "all-modes" if set(args.modes) == set(ALL_MODES) else "-".join(args.modes)
    path = results_path(args.out, f"serve-{meta['date']}-bundled-{which}{args.tag}.json")
    prompts = workload_prompts(args)
    records: list[dict] = []
    data = dict(meta=meta, records=records, targets=compare(records))
    logs = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bole-serve-"))
    t0 = time.perf_counter()
    for mode in args.modes:
        records.append(measure(mode, args, prompts, logs / f"serve-{mode}.log"))
        card = records[-1].get("server", {}).get("card", {}).get("bole", {})
        meta["drafter"] = meta["drafter"] or card.get("drafter")
        meta["tree"] = meta.get("tree") or (dict(depth=card["depth"], topk=card["topk"],
                                                 budget=card["budget"]) if card else None)
        data["targets"] = compare(records)
        meta["wall_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(data, indent=1))   # after every mode: a cut run keeps some
    png = plot(path)
    print()
    print(f"bundled model, {meta['dtype']} on {meta['device']}, {args.requests} requests x "
          f"{args.max_tokens} tokens, {args.concurrency} clients, --max-batch {args.max_batch}, "
          f"{meta['wall_s']:.0f} s")
    print(table(data))
    print(f"wrote {path}\nwrote {png}")
    ok = all(r["ok"] for r in records)
    if args.log_dir or not ok:
        print(f"the servers' logs are in {logs}")
    else:
        for f in sorted(logs.glob("*.log")):
            f.unlink()
        logs.rmdir()
    return 0 if ok else 1


#: issue 48's target on the CPU: 2 replicas' output tokens/s over one replica's
TARGET_REPLICAS_X = 1.7


def replicas_table(data: dict) -> str:
    """The replica counts' records as a markdown table, and the target's verdict."""
    lines = ["| replicas | output tok/s | x first | p50 TPOT ms | p50 TTFT ms | requests | "
             "load avg after |", "|---|" + "---:|" * 6]
    for r in data["records"]:
        name = r["replicas"] or "plain"
        if r.get("output_tokens_per_s") is None:
            lines.append(f"| {name} | failed: {(r['error'] or '').splitlines()[0][:90]} |"
                         + " |" * 5)
            continue
        s = r["loadgen"]["summary"]
        lines.append(f"| {name} | {r['output_tokens_per_s']:.1f} | {_f(r['x_first'], '.2f')} | "
                     f"{_f((r['tpot_ms'] or {}).get('p50'), '.2f')} | "
                     f"{_f((r['ttft_ms'] or {}).get('p50'), '.1f')} | "
                     f"{s['completed']}/{s['requests']} | "
                     f"{_f((r.get('loadavg_after') or [None])[0], '.1f')} |")
    t = data["targets"]
    lines += ["", f"target: 2 replicas >= {TARGET_REPLICAS_X}x one replica's output tok/s "
              f"({_f(t['x'], '.2f')}x: {_yes(t['ok'])}) on {data['meta']['device']}"]
    return "\n".join(lines)


def run_replicas(args: argparse.Namespace) -> int:
    """``--replicas``: the first mode under each replica count; the JSON and the table."""
    now = _dt.datetime.now()
    commit, dirty = (args.commit, None) if args.commit else git_commit()
    mode = args.modes[0]
    settings = dict(mode=mode, replicas=args.replicas, replica_cpus=args.replica_cpus,
                    requests=args.requests, concurrency=args.concurrency,
                    max_tokens=args.max_tokens, max_batch=args.max_batch, warmup=args.warmup,
                    temperature=0.0, arrival="closed-loop", workload=args.workload,
                    prompts=WORKLOADS[args.workload], cores=os.cpu_count())
    meta = dict(_versions(args.device), date=now.date().isoformat(), time=now.strftime("%H:%M:%S"),
                commit=commit, dirty=dirty, model="bundled", dtype=DTYPE_NAMES[args.dtype],
                settings=settings)
    path = results_path(args.out, f"serve-{meta['date']}-bundled-replicas{args.tag}.json")
    prompts = workload_prompts(args)
    records: list[dict] = []
    data = dict(meta=meta, records=records, targets=dict(x=None, ok=None))
    logs = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bole-serve-"))
    for n in args.replicas:
        records.append(measure(mode, args, prompts, logs / f"serve-replicas-{n}.log", n))
        records[-1]["loadavg_after"] = os.getloadavg()     # others' work on a shared machine
        first = records[0].get("output_tokens_per_s")
        for r in records:
            tps = r.get("output_tokens_per_s")
            r["x_first"] = tps / first if tps is not None and first else None
        by = {r["replicas"]: r.get("output_tokens_per_s") for r in records}
        x = by[2] / by[1] if by.get(1) and by.get(2) else None
        data["targets"] = dict(x=x, ok=None if x is None else x >= TARGET_REPLICAS_X)
        path.write_text(json.dumps(data, indent=1))
    print()
    print(f"bundled model, {mode} mode, {meta['dtype']} on {meta['device']}, {args.requests} "
          f"requests x {args.max_tokens} tokens, {args.concurrency} clients, --max-batch "
          f"{args.max_batch} per replica")
    print(replicas_table(data))
    print(f"wrote {path}\nthe servers' logs are in {logs}")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
