"""``bole bench-serve``: a load generator for any OpenAI-compatible ``/v1/completions`` server.

Prompts go out as Poisson arrivals (``--rate``) or from closed-loop clients (``--concurrency``),
each streaming (SSE). TTFT: first attempt's send (retry waits count) to the first non-empty text
delta. TPOT: (end of stream - first delta) / (output tokens - 1). ITL: a delta of k tokens arriving
g after the previous one gives k samples g/k. A delta's tokens come from its chunk (``token_ids``,
``logprobs.tokens`` or a running ``usage``) when every delta has them, else from ``--tokenizer``,
else a delta counts as one token, ITL then being per delta (``count_source`` says which). Output
tokens: the final ``usage`` when sent, else the sum. Goodput: completed requests/s within the SLOs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import math
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import httpx
import numpy as np

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_CLIENTS = 4               # closed-loop clients when neither --rate nor --concurrency
STATS = ("mean", "p50", "p90", "p99")


class LoadgenError(Exception):
    """A problem the user can fix (bad argument, unreachable server): one line, exit code 2."""


@dataclass
class Prompt:
    """One request's prompt (text, or token ids as the OpenAI API takes them); ``max_tokens``
    overrides the run's when set."""
    text: str | list[int]
    max_tokens: int | None = None


def _opt(default: Any, help: str, rule: str | None = None) -> Any:
    """A LoadConfig field: its default, the help of its CLI option and its valid range."""
    return field(default=default, metadata={"help": help, "rule": rule})


@dataclass
class LoadConfig:
    """The settings of a run; ``bench-serve`` has an option for each (``--num-requests``...)."""
    url: str = _opt(DEFAULT_URL, "the server's base URL (nothing else is contacted)")
    model: str | None = _opt(None, "model to request; None: the first of /v1/models")
    num_requests: int = _opt(100, "requests to send", ">= 1")
    rate: float | None = _opt(None, "Poisson arrivals per second; None: closed loop", "> 0")
    concurrency: int | None = _opt(None, f"closed-loop clients (None: {DEFAULT_CLIENTS}); with "
                                   "--rate, the cap on requests in flight", ">= 1")
    duration: float = _opt(600.0, "cap on the run, s (running requests are then cancelled)", "> 0")
    max_tokens: int = _opt(128, "tokens per request (a JSONL prompt's max_tokens wins)", ">= 1")
    temperature: float = _opt(0.0, "sampling temperature (0 = greedy)", ">= 0")
    seed: int = _opt(0, "seed of the Poisson arrival times")
    slo_tpot_ms: float = _opt(100.0, "TPOT SLO of goodput, ms", "> 0")
    slo_ttft_ms: float | None = _opt(None, "TTFT SLO of goodput, ms; None: no TTFT SLO", "> 0")
    max_retries: int = _opt(3, "retries of a 429 or 503 answer", ">= 0")
    max_retry_wait: float = _opt(30.0, "cap on one Retry-After wait, s", ">= 0")
    timeout: float = _opt(60.0, "connect and read timeout of a request, s", "> 0")

    def validate(self) -> None:
        """Raise LoadgenError naming the first bad value by its CLI option."""
        normalize_url(self.url)
        for f in fields(self):
            rule, v = f.metadata["rule"], getattr(self, f.name)
            if rule and v is not None and not (math.isfinite(v) and (
                    v > 0 if rule == "> 0" else v >= float(rule[3:]))):
                raise LoadgenError(f"--{f.name.replace('_', '-')} must be {rule}, got {v}")


@dataclass
class RequestResult:
    """One request's measurements; times in seconds."""
    index: int
    start_s: float                    # first attempt's send, from the run's start
    ok: bool = False
    status: int | None = None         # last HTTP status (None: no answer)
    error: str | None = None
    cancelled: bool = False           # still running at the --duration deadline
    retries: int = 0
    retry_wait_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None        # first send to the end of the stream
    output_tokens: int = 0            # the server's usage when sent, else the deltas' counts
    count_source: str = "deltas"      # tokens per delta from: chunk, tokenizer or deltas (1 each)
    finish_reason: str | None = None
    itl_s: list[float] = field(default_factory=list, repr=False)   # not written to the JSON


@dataclass
class LoadReport:
    """A run: settings and the server's model and mode, ``summarize``'s dict, the requests."""
    meta: dict[str, Any]
    summary: dict[str, Any]
    results: list[RequestResult]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: meta, summary and one record per request (no ITL samples)."""
        requests = [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in self.results]
        return {"meta": self.meta, "summary": self.summary, "requests": requests}


def _stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float] | None:
    """Mean, p50, p90, p99 and size of a sample (None when empty)."""
    v = np.asarray(values, dtype=float) * scale
    return dict(zip(STATS, [float(v.mean()), *map(float, np.percentile(v, [50, 90, 99]))]),
                n=len(v)) if len(v) else None


def summarize(results: list[RequestResult], elapsed_s: float, slo_tpot_ms: float,
              slo_ttft_ms: float | None = None) -> dict[str, Any]:
    """Counts, rates (per second of the run) and latency statistics (ms) of a run."""
    ok, t = [r for r in results if r.ok], max(elapsed_s, 1e-9)
    good = [r for r in ok if (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms)
            and (slo_ttft_ms is None or (r.ttft_s or 0.0) * 1e3 <= slo_ttft_ms)]
    cancelled, tokens = sum(r.cancelled for r in results), sum(r.output_tokens for r in ok)
    return dict(
        requests=len(results), completed=len(ok), errors=len(results) - len(ok) - cancelled,
        cancelled=cancelled, retries=sum(r.retries for r in results), elapsed_s=elapsed_s,
        requests_per_s=len(ok) / t, output_tokens=tokens, output_tokens_per_s=tokens / t,
        goodput_requests=len(good), goodput_rps=len(good) / t,
        ttft_ms=_stats([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        tpot_ms=_stats([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        itl_ms=_stats([x for r in ok for x in r.itl_s], 1e3),
        e2e_ms=_stats([r.e2e_s for r in ok if r.e2e_s is not None], 1e3),
        output_tokens_per_request=_stats([r.output_tokens for r in ok]),
        errors_by_status=dict(Counter(str(r.status) for r in results if not (r.ok or r.cancelled))),
        count_sources=dict(Counter(r.count_source for r in ok)))


def normalize_url(url: str) -> str:
    """The server's base URL (no trailing ``/`` or ``/v1``); LoadgenError unless http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadgenError(f"--url {url!r} is not an http(s) URL such as {DEFAULT_URL}")
    return re.sub(r"(/v1)?/*$", "", url)


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts of a JSONL file: one ``{"prompt": str, "max_tokens": int (optional)}`` a line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):   # OSError: no file
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            text, limit = obj["prompt"], obj.get("max_tokens")
        except (ValueError, TypeError, KeyError, AttributeError):       # not JSON, not an object
            text, limit = None, None
        if not (isinstance(text, str) and text and (
                limit is None or (type(limit) is int and limit >= 1))):
            raise LoadgenError(f'--prompts {path} line {n}: not a JSON object with a non-empty '
                               'string "prompt" and optionally an integer "max_tokens" >= 1')
        out.append(Prompt(text, limit))
    if not out:
        raise LoadgenError(f"--prompts {path} holds no prompts")
    return out


def retry_after(value: str | None, cap: float, default: float = 1.0) -> float:
    """Seconds to wait by a ``Retry-After`` header, at most ``cap``; ``default`` unless seconds."""
    number = value is not None and re.fullmatch(r"\s*\d+(\.\d*)?\s*", value)
    return min(float(value) if number else default, cap)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s) of ``n`` Poisson arrivals: 0, then seeded exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    return [float(t) for t in np.cumsum([0.0] + [rng.expovariate(rate) for _ in range(n - 1)])][:n]


@dataclass
class _Stream:
    """What one SSE stream delivered: (time, text, tokens or None) per non-empty delta."""
    events: list[tuple[float, str, int | None]] = field(default_factory=list)
    usage_tokens: int | None = None   # latest usage.completion_tokens (running or final)
    finish_reason: str | None = None
    done: bool = False                # saw ``data: [DONE]``
    end: float = 0.0

    async def read(self, resp: httpx.Response) -> _Stream:
        """Read to ``[DONE]``, timing lines as they arrive; ValueError on an error or bad data."""
        async with contextlib.aclosing(resp.aiter_lines()) as lines:   # closed here, not by GC
            async for line in lines:
                now = time.perf_counter()
                if line.startswith("data:"):        # skip blank lines, comments, event names
                    if line[5:].strip() == "[DONE]":
                        self.done = True
                        break
                    self.take(json.loads(line[5:]), now)
        self.end = time.perf_counter()
        return self

    def take(self, obj: Any, now: float) -> None:
        """Fold one ``data:`` object in."""
        if not isinstance(obj, dict) or obj.get("error"):
            raise ValueError(f"error in the stream: {json.dumps(obj)[:200]}")
        choices, usage, count = obj.get("choices") or [], obj.get("usage"), None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            if choices:                             # usage in a text chunk: a running total
                count = usage["completion_tokens"] - (self.usage_tokens or 0)
            self.usage_tokens = usage["completion_tokens"]
        c = choices[0] if choices and isinstance(choices[0], dict) else {}
        self.finish_reason = c.get("finish_reason") or self.finish_reason
        text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
        ids = c.get("token_ids") or (c.get("logprobs") or {}).get("tokens")
        if text:                                    # empty deltas carry no timing
            self.events.append((now, text, len(ids) if isinstance(ids, list) else count))


def _finish(res: RequestResult, st: _Stream, sent: float, tokenizer: Any) -> None:
    """Turn a stream's record into TTFT, TPOT, ITL and token counts."""
    events, res.e2e_s = st.events, st.end - sent
    if events and all(c is not None for _, _, c in events):
        res.count_source, counts = "chunk", [int(c or 0) for _, _, c in events]
    elif tokenizer is not None:                     # a tokenizers Encoding or a list of ids
        encoded = (tokenizer.encode(text, add_special_tokens=False) for _, text, _ in events)
        res.count_source, counts = "tokenizer", [max(1, len(getattr(e, "ids", e))) for e in encoded]
    else:
        res.count_source, counts = "deltas", [1] * len(events)
    res.output_tokens = sum(counts) if st.usage_tokens is None else st.usage_tokens
    for (t0, _, _), (t1, _, _), k in zip(events, events[1:], counts[1:]):
        res.itl_s.extend([(t1 - t0) / max(k, 1)] * max(k, 1))
    res.ttft_s = events[0][0] - sent if events else None
    if events and res.output_tokens > 1:
        res.tpot_s = (st.end - events[0][0]) / (res.output_tokens - 1)
    res.finish_reason, res.ok = st.finish_reason, st.done or st.finish_reason is not None
    res.error = None if res.ok else "the stream ended without [DONE] or a finish_reason"


@dataclass
class _Run:
    """Shared state of one run: the client, the settings (url and model resolved), the results."""
    client: httpx.AsyncClient
    config: LoadConfig
    prompts: list[Prompt]
    tokenizer: Any
    t0: float
    results: list[RequestResult] = field(default_factory=list)

    async def request(self, i: int) -> None:
        """Send request ``i`` (again after a busy answer's Retry-After) and record it."""
        cfg, prompt, sent = self.config, self.prompts[i % len(self.prompts)], time.perf_counter()
        self.results.append(res := RequestResult(i, sent - self.t0))
        body = dict(prompt=prompt.text, max_tokens=prompt.max_tokens or cfg.max_tokens, stream=True,
                    temperature=cfg.temperature, stream_options={"include_usage": True},
                    **({"model": cfg.model} if cfg.model else {}))
        try:
            while True:
                async with self.client.stream("POST", f"{cfg.url}/v1/completions", json=body) as r:
                    res.status = r.status_code
                    if r.status_code == 200:
                        _finish(res, await _Stream().read(r), sent, self.tokenizer)
                        return
                    text = (await r.aread()).decode(errors="replace")
                    res.error = f"HTTP {res.status}: {text[:200]}"
                    wait = retry_after(r.headers.get("retry-after"), cfg.max_retry_wait)
                if r.status_code not in (429, 503) or res.retries >= cfg.max_retries:  # busy?
                    return
                res.retries, res.retry_wait_s = res.retries + 1, res.retry_wait_s + wait
                await asyncio.sleep(wait)
        except Exception as exc:                    # a failed or malformed answer: recorded
            res.error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:              # the --duration deadline
            res.cancelled, res.error = True, "cancelled at the --duration deadline"
            raise

    async def drive(self, arrivals: list[float], cap: int) -> None:
        """Send request i at ``arrivals[i]`` s, or later while ``cap`` requests are in flight."""
        slots, tasks = asyncio.Semaphore(cap), []
        try:
            for i, at in enumerate(arrivals):
                await asyncio.sleep(max(0.0, self.t0 + at - time.perf_counter()))
                await slots.acquire()
                tasks.append(asyncio.create_task(self.request(i)))
                tasks[-1].add_done_callback(lambda _: slots.release())
            await asyncio.gather(*tasks)
        finally:                                    # at the deadline: cancel what still runs
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def server_info(client: httpx.AsyncClient, base: str, model: str | None) -> tuple[Any, Any]:
    """(model, mode): the named or first card of ``/v1/models``, its ``bole.mode`` if any."""
    try:
        resp = await client.get(f"{base}/v1/models", timeout=10.0)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise LoadgenError(f"cannot reach the server at {base} ({type(exc).__name__}: {exc}); "
                           "start one (bole serve) or pass --url") from None
    try:                                            # whatever the shape; else model unknown
        cards = [c for c in resp.json()["data"] if isinstance(c, dict)]
        card = next((c for c in cards if c.get("id") == model or not model), {})
        bole = card.get("bole") or (card.get("metadata") or {}).get("bole") or {}
        return model or card.get("id"), bole.get("mode")
    except (ValueError, TypeError, KeyError, AttributeError):
        return model, None


async def run_load_async(prompts: Sequence[str | Prompt], config: LoadConfig,
                         tokenizer: Any = None) -> LoadReport:
    """Drive the server at ``config.url`` and measure every request (see the module's doc)."""
    config.validate()
    items = [p if isinstance(p, Prompt) else Prompt(p) for p in prompts]
    if not items:
        raise LoadgenError("no prompts to send")
    base, n, rate = normalize_url(config.url), config.num_requests, config.rate
    cap = config.concurrency or (n if rate else DEFAULT_CLIENTS)    # closed loop: the clients
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: no proxy from the environment; traffic goes only to the given URL.
    async with httpx.AsyncClient(timeout=config.timeout, limits=limits, trust_env=False) as client:
        model, mode = await server_info(client, base, config.model)
        run = _Run(client, replace(config, url=base, model=model), items, tokenizer,
                   time.perf_counter())
        arrivals = poisson_arrivals(n, rate, config.seed) if rate else [0.0] * n  # all at once
        try:
            await asyncio.wait_for(run.drive(arrivals, cap), timeout=config.duration)
        except asyncio.TimeoutError:
            pass                                    # the --duration cap: report what finished
        elapsed = time.perf_counter() - run.t0
    now = _dt.datetime.now()
    meta = dict(asdict(run.config), mode=mode, date=now.date().isoformat(), time=now.strftime(
        "%H:%M:%S"), arrival="poisson" if rate else "closed-loop", clients=None if rate else cap,
        prompts=len(items), tokenizer=bool(tokenizer))
    results = sorted(run.results, key=lambda r: r.index)
    return LoadReport(meta, summarize(results, elapsed, config.slo_tpot_ms, config.slo_ttft_ms),
                      results)


def run_load(url: str, prompts: Sequence[str | Prompt], *, tokenizer: Any = None,
             **options: Any) -> LoadReport:
    """Blocking :func:`run_load_async`; ``options`` are LoadConfig fields (``rate``...)."""
    return asyncio.run(run_load_async(prompts, LoadConfig(url=url, **options), tokenizer))


def write_report(report: LoadReport, out_dir: Path, tag: str = "") -> tuple[Path, Path | None]:
    """``serve-<date>-<model>-<mode>.json`` and ``.png`` (None without matplotlib); mode: the
    server's, else ``tag`` (with both, ``-<tag>`` follows); the time of day avoids overwriting."""
    m, mode = report.meta, report.meta["mode"] or tag or "unknown"
    stem = f"serve-{m['date']}-{m['model'] or 'model'}-{mode}" + (
        f"-{tag}" if tag and m["mode"] and tag != m["mode"] else "")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)  # file-name safe ("Qwen/Qwen3.5-9B")
    if (out_dir / f"{stem}.json").exists():
        stem += "-" + m["time"].replace(":", "")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"                 # names may hold dots: no with_suffix
    path.write_text(json.dumps(report.to_dict(), indent=1))
    try:
        return path, _plot(report, out_dir / f"{stem}.png")
    except ImportError:
        return path, None


def _plot(report: LoadReport, png: Path) -> Path:
    """CDFs of TTFT, TPOT and ITL, the SLOs marked."""
    from matplotlib.figure import Figure            # no pyplot: no global backend state
    ok, m = [r for r in report.results if r.ok], report.meta
    series = {"TTFT": ([r.ttft_s * 1e3 for r in ok if r.ttft_s is not None], m["slo_ttft_ms"]),
              "TPOT": ([r.tpot_s * 1e3 for r in ok if r.tpot_s is not None], m["slo_tpot_ms"]),
              "ITL": ([x * 1e3 for r in ok for x in r.itl_s], None)}
    fig = Figure(figsize=(13, 3.8))
    for ax, (name, (values, slo)) in zip(fig.subplots(1, 3), series.items()):
        ax.step(np.sort(values), np.arange(1, len(values) + 1) / max(len(values), 1), where="post")
        if slo:
            ax.axvline(slo, color="r", ls="--", label=f"SLO {slo} ms")
            ax.legend(fontsize=7)
        ax.set(xlabel=f"{name} ms", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{m['model']} ({m['mode']}), {m['date']}, {m['arrival']}", fontsize=9)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    return png


def format_table(report: LoadReport) -> str:
    """The short table ``bole bench-serve`` prints."""
    m, s = report.meta, report.summary
    load = f"Poisson {m['rate']} req/s" if m["rate"] else f"{m['clients']} clients"
    slo = f"TPOT <= {m['slo_tpot_ms']} ms" + (f", TTFT <= {m['slo_ttft_ms']} ms"
                                              if m["slo_ttft_ms"] else "")
    rows = (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms"), ("ITL ms", "itl_ms"),
            ("E2E ms", "e2e_ms"), ("output tokens", "output_tokens_per_request"))
    return "\n".join([
        f"{m['url']}: model {m['model']}, mode {m['mode'] or 'unknown'}, {load}",
        f"sent {s['requests']}, completed {s['completed']}, errors {s['errors']}"
        f"{' ' + str(s['errors_by_status']) if s['errors'] else ''}, cancelled {s['cancelled']}, "
        f"retries {s['retries']}, {s['elapsed_s']:.1f} s",
        f"{'':<14}" + "".join(f"{k:>9}" for k in STATS)] + [
        f"{name:<14}" + "".join(f"{s[key][k]:>9.1f}" if s[key] else f"{'-':>9}" for k in STATS)
        for name, key in rows] + [
        f"{s['requests_per_s']:.2f} requests/s, {s['output_tokens_per_s']:.1f} output tokens/s, "
        f"goodput {s['goodput_rps']:.2f} requests/s ({slo}); tokens per delta counted by "
        f"{s['count_sources'] or '-'}"])


def _tokenizer(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json or a folder holding one."""
    from tokenizers import Tokenizer
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:                        # tokenizers raises a bare Exception
        raise LoadgenError(f"--tokenizer {path}: no readable tokenizer.json ({exc})") from None


def main(args: argparse.Namespace) -> int:
    """``bole bench-serve``: 0, 1 when no request completed, 2 on bad arguments or no server."""
    from bole.assets import code_prompts
    try:
        config = LoadConfig(**{f.name: getattr(args, f.name) for f in fields(LoadConfig)})
        prompts = load_prompts(args.prompts) if args.prompts else list(map(Prompt, code_prompts()))
        tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
        report = asyncio.run(run_load_async(prompts, config, tokenizer))
        print(format_table(report))
        path, png = write_report(report, Path(args.out), args.tag)
    except (LoadgenError, OSError, ValueError) as exc:     # ValueError: a malformed URL
        print(f"bole bench-serve: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path.resolve()}")
    print(f"wrote {png.resolve()}" if png else "no plot: matplotlib is not installed")
    return 0 if report.summary["completed"] else 1
