"""`bole serve` as a subprocess for the server tests: started on loopback with the bundled model,
the settings of :func:`offline`, until healthy; stopped with SIGTERM, every process it spawned
checked gone. Two concurrent greedy completions (one streamed) to compare with the offline
engine."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import torch

from bole.assets import BUNDLED_MODEL
from bole.distributed import free_port
from bole.engine import Engine, SamplingParams, SpecConfig
from bole.models.qwen3_hybrid import HybridModel

SHAPE = dict(depth=4, topk=3, budget=12)
MAX_TOKENS = 16


def children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def offline(prompts: list[list[int]], tok) -> tuple[list[list[int]], list[str]]:
    """Token ids and texts of one process's engine (tp 1), the server's settings."""
    model = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    engine = Engine(model, SpecConfig("bole", "mtp", **SHAPE), max_slots=2, max_len=256,
                    tokenizer=tok)
    params = SamplingParams(max_tokens=MAX_TOKENS)     # stops at eos, as the server
    results = engine.generate(prompts, params)
    return [r.token_ids for r in results], [engine.text(r, params) for r in results]


class Served:
    """``with Served(tmp_path, *flags) as s:`` runs ``bole serve FLAGS`` (bole mode, MTP drafter,
    :data:`SHAPE`, 2 slots, 256 tokens a request; FLAGS come last and override these) until
    healthy; ``s.url``, ``s.spawned`` (its child processes, read
    once healthy). On exit it stops the server; then ``returncode``, ``left`` (child processes
    still alive, killed) and ``output`` (the log) are for the test to check."""

    def __init__(self, tmp_path: Path, *flags: str, timeout: float = 90):
        self.flags, self.timeout = flags, timeout
        self.log = open(tmp_path / "serve.log", "w+")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.spawned: set[int] = set()
        self.left: list[int] = []
        self.output, self.returncode = "", None

    def __enter__(self) -> Served:
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bole.cli", "serve", "--device", "cpu",
             "--port", port, "--max-batch", "2", "--max-len", "256", "--mode", "bole",
             "--drafter", "mtp"] + [f"--{k}={v}" for k, v in SHAPE.items()] + list(self.flags),
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy()
            self.spawned = children(self.proc.pid)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, \
                f"bole serve {' '.join(self.flags)} exited with {self.proc.returncode}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"bole serve {' '.join(self.flags)} did not come up")

    def __exit__(self, *exc) -> None:
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        deadline = time.time() + 10
        while any(map(alive, self.spawned)) and time.time() < deadline:
            time.sleep(0.1)
        self.left = [p for p in self.spawned if alive(p)]
        for p in self.left:
            os.kill(p, signal.SIGKILL)
        self.log.seek(0)
        self.output = self.log.read()
        self.log.close()
        self.returncode = proc.returncode

    def plain_and_streamed(self, prompts: list[list[int]]) -> tuple[str, int, list[int]]:
        """Two concurrent greedy completions: the first plain (its text and token count), the
        second streamed (its token ids)."""
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                               timeout=60)

        def plain():
            res = client.completions.create(model="bundled", prompt=prompts[0],
                                            max_tokens=MAX_TOKENS, temperature=0)
            return res.choices[0].text, res.usage.completion_tokens

        def streamed():
            ids = []
            for c in client.completions.create(model="bundled", prompt=prompts[1],
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True):
                if c.choices:
                    ids += (c.choices[0].model_extra or {}).get("token_ids") or []
            return ids

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a, b = pool.submit(plain), pool.submit(streamed)
            (text, n), ids = a.result(timeout=120), b.result(timeout=120)
        return text, n, ids
