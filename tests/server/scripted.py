"""A scripted engine for the server's tests: no model, so that a test of the HTTP layer
(``bole/server/api.py``, ``responses.py``) runs in milliseconds. It is driven by the real
:class:`~bole.engine.scheduler.Scheduler` and the server's engine thread, through the methods
the scheduler knows an engine by, and finishes requests with :class:`~bole.engine.engine.Engine`'s
own ``_emit`` (stop tokens, max_tokens, stop strings, logprobs): only the tokens are scripted.

Every request's output is the script (default: the bundled tokenizer's tokens of :data:`TEXT`)
read from offset ``seed % len(script)`` (0 without a seed), ``per_round`` tokens a round (the
first one at admission, as the engine's prefill emits it), a round every ``round_s``. A token's logprob is
:func:`logprob_of`; its alternatives are the token itself and its successors."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from bole.assets import BUNDLED_MODEL
from bole.engine.engine import Engine
from bole.engine.request import EngineInfo, Request, TokenLogprob
from bole.engine.spec import SpecConfig

#: the scripted output: an emoji split over four byte-level tokens, a word cut in two
TEXT = (" The quick brown fox jumps over the lazy dog. Caf\u00e9 \U0001F642 and more words to "
        "read here.")
EOS = 0
#: a round that runs a request of this prompt raises (the engine process's round failure, which
#: ``fail_next`` set in the test's process cannot reach)
FAILING_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))


def logprob_of(token: int) -> float:
    return -0.125 * (1 + token % 7)


@dataclass
class Slots:
    """The part of the cache the scheduler reads: how many slots, how many free."""

    max_slots: int
    max_len: int
    num_free: int = 0

    def __post_init__(self):
        self.num_free = self.max_slots


class ScriptedEngine:
    """The scheduler's engine (``SteppedEngine``) with scripted tokens. ``hold()``: rounds wait
    until ``go()`` (a test's window to cancel, abort or drain); ``fail_next``: the next round
    raises, as does every round that runs a request of :data:`FAILING_PROMPT`."""

    _emit = Engine._emit
    _stop_string_cut = Engine._stop_string_cut

    def __init__(self, max_slots: int = 4, max_len: int = 256, per_round: int = 3,
                 eos: tuple[int, ...] = (EOS,), round_s: float = 0.01,
                 script: list[int] | None = None):
        self.tokenizer = tokenizer()
        self.script = script or self.tokenizer.encode(TEXT).ids
        self.spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8)
        self.cache = Slots(max_slots, max_len)
        self.per_round = per_round
        self.round_s = round_s          # a round's duration: a stream sees its rounds apart
        self.info = EngineInfo(self.spec, max_len, 8, self.tokenizer.get_vocab_size(), eos, True)
        self.rounds = 0
        self.fail_next = False
        self._go = threading.Event()
        self._go.set()

    # ---- test controls ----
    def hold(self) -> None:
        self._go.clear()

    def go(self) -> None:
        self._go.set()

    def expected(self, seed: int | None, count: int) -> list[int]:
        """The first ``count`` scripted tokens of a request seeded ``seed`` (before any stop)."""
        start = (seed or 0) % len(self.script)
        return [self.script[(start + k) % len(self.script)] for k in range(count)]

    # ---- what the scheduler calls ----
    def check_request(self, prompt, params, name: str = "the prompt") -> None:
        self.info.check_request(prompt, params, name)

    def new_request(self, index: int, prompt, params) -> Request:
        stops = params.all_stop_token_ids(self.info.eos_token_ids)
        return Request(index, [int(t) for t in prompt], params, slot=-1,
                       stop_ids=frozenset(stops))

    def admit_many(self, requests) -> None:
        for r in requests:
            self.cache.num_free -= 1
            r.slot = self.cache.max_slots - self.cache.num_free
            self._emit_next(r, 1, rounds=0)

    def release(self, r: Request) -> None:
        if r.slot >= 0:
            self.cache.num_free += 1
            r.slot = -1

    def step(self, running: list[Request], prelaunch: bool = False) -> dict:
        self._go.wait(timeout=30)
        time.sleep(self.round_s)
        if self.fail_next or any(r.prompt == FAILING_PROMPT for r in running):
            self.fail_next = False
            raise RuntimeError("scripted round failure")
        self.rounds += 1
        for r in running:
            self._emit_next(r, self.per_round, rounds=1)
        return {"total": 1.0}

    def _emit_next(self, r: Request, count: int, rounds: int) -> None:
        if r.result is not None:
            return
        new = self.expected(r.params.seed, len(r.out) + count)[len(r.out):]
        lps = None
        if r.params.logprobs is not None:
            vocab = self.info.vocab_size
            lps = [TokenLogprob(t, logprob_of(t), tuple(
                ((t + a) % vocab, logprob_of(t) - a) for a in range(r.params.logprobs)))
                for t in new]
        self._emit(r, new, rounds, lps)
