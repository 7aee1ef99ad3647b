"""`bole serve --tp 2` on the CPU: rank 0 serves on loopback, rank 1 steps in lockstep with it
(two gloo processes). Two concurrent greedy completions, one streamed, equal a single-process
engine's output token for token; stopping rank 0 stops every process it started. In one
process: a follower that replays rank 0's step events ends with rank 0's outputs, sampled and
cancelled requests included."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.distributed import free_port  # noqa: E402
from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.engine.lockstep import LockstepScheduler, StepEvents  # noqa: E402
from tests.server.served import Served, offline  # noqa: E402


def test_serve_with_two_ranks_equals_one_and_leaves_nothing_behind(tmp_path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in code_prompts()[:2]]
    with Served(tmp_path, "--tp", "2") as served:            # batched in lockstep
        assert served.spawned, "no follower process"
        text, n, ids = served.plain_and_streamed(prompts)
        want_ids, want_texts = offline(prompts, tok)
        assert ids == want_ids[1]
        assert n == len(want_ids[0]) and text == want_texts[0]
    assert served.returncode == 0, served.output
    assert not served.left, f"processes left behind: {served.left}\n{served.output}"
    assert "Application shutdown complete" in served.output


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
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    handles = [lead.submit([5, 9, 17, 33], SamplingParams(max_tokens=12, ignore_eos=True)),
               lead.submit([7, 7, 8], sampled),
               lead.submit([100, 3], replace(sampled, seed=4))]
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
