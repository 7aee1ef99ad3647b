"""`bole serve --tp 2` on the CPU: rank 0 serves on loopback, rank 1 steps in lockstep with it
(two gloo processes). Two concurrent greedy completions, one streamed, equal a single-process
engine's output token for token; stopping rank 0 stops every process it started. In one
process: a follower that replays rank 0's step events ends with rank 0's outputs, sampled and
cancelled requests included."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.distributed import free_port  # noqa: E402
from bole.engine import Engine, GenerationParams, SpecConfig  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.server.lockstep import LockstepScheduler, StepEvents  # noqa: E402
from bole.speculative.sampling import SamplingParams  # noqa: E402

SHAPE = dict(depth=4, topk=3, budget=12)
MAX_TOKENS = 16


def _children(pid: int) -> set[int]:
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


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _offline(prompts: list[list[int]], tok) -> tuple[list[list[int]], list[str]]:
    """Token ids and texts of one process's engine (tp 1), the server's settings."""
    model = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    engine = Engine(model, SpecConfig("bole", "mtp", **SHAPE), max_slots=2, max_len=256,
                    tokenizer=tok)
    params = GenerationParams(max_tokens=MAX_TOKENS, stop_token_ids=model.config.eos_token_id)
    results = engine.generate(prompts, params)
    return [r.token_ids for r in results], [engine.text(r, params) for r in results]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"bole serve --tp 2 exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("bole serve --tp 2 did not come up")


def test_serve_with_two_ranks_equals_one_and_leaves_nothing_behind(tmp_path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in code_prompts()[:2]]
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bole.cli", "serve", "--tp", "2", "--device", "cpu",
         "--port", str(port), "--max-batch", "2", "--max-len", "256", "--mode", "bole",
         "--drafter", "mtp"] + [f"--{k}={v}" for k, v in SHAPE.items()],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    spawned: set[int] = set()
    try:
        _wait_healthy(proc, url)
        spawned = _children(proc.pid)
        assert spawned, "no follower process"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

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

        with concurrent.futures.ThreadPoolExecutor(2) as pool:    # batched in lockstep
            a, b = pool.submit(plain), pool.submit(streamed)
            (text, n), ids = a.result(timeout=120), b.result(timeout=120)
        want_ids, want_texts = _offline(prompts, tok)
        assert ids == want_ids[1]
        assert n == len(want_ids[0]) and text == want_texts[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        deadline = time.time() + 10
        while any(map(_alive, spawned)) and time.time() < deadline:
            time.sleep(0.1)
        left = [p for p in spawned if _alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        log.seek(0)
        output = log.read()
        log.close()
    assert proc.returncode == 0, output
    assert not left, f"processes left behind: {left}\n{output}"
    assert "Application shutdown complete" in output


def test_serve_tp_that_does_not_divide_is_a_clean_usage_error(capsys):
    from bole.cli import main
    assert main(["serve", "--tp", "3", "--device", "cpu", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bole serve: tp=3 does not divide") and "Traceback" not in err


class _Queue:
    """An in-process channel: rank 0's step events kept for one follower, read in order."""

    def __init__(self, events: list):
        self.events = events

    def send(self, events: StepEvents) -> None:
        self.events.append(events)

    def recv(self) -> StepEvents:
        return self.events.pop(0)

    def close(self) -> None:
        self.send(StepEvents(stop=True))


def test_a_follower_replays_rank_0s_steps():
    model = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, mtp=True,
                               gdn_backend="torch")
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=6)
    events: list = []
    lead, follower = (LockstepScheduler(Engine(model, spec, max_slots=2, max_len=128),
                                        _Queue(events)) for _ in range(2))
    sampled = GenerationParams(max_tokens=12, sampling=SamplingParams(temperature=0.8))
    handles = [lead.submit([5, 9, 17, 33], GenerationParams(max_tokens=12)),
               lead.submit([7, 7, 8], sampled), lead.submit([100, 3], sampled, seed=4)]
    assert lead.num_waiting == 3 and not lead.waiting        # nothing applied before a step
    lead.step()                                              # two admitted, one waits
    lead.cancel(handles[0])
    handles.append(lead.submit([1, 2, 3], sampled))
    lead.run_until_idle()
    lead.close()
    requests = {}
    make = follower._request
    follower._request = lambda sub: requests.setdefault(sub.serial, make(sub))
    follower.follow()
    assert not events and follower.idle and follower.engine.cache.num_free == 2
    assert handles[0].result is None and all(h.result is not None for h in handles[1:])
    for h in handles:
        mine = requests[h.request.index]
        assert mine.out == h.request.out and (mine.result is None) == (h.result is None)
