"""The one per-request parameter type: :class:`SamplingParams` (how a request samples, when it
stops, what it returns).

Every entry point builds it: :class:`bole.LLM` takes it from the user, the server translates an
OpenAI body into it (:func:`bole.server.protocol.engine_params`), ``bole generate`` from its
flags; the engine, its scheduler and the speculative sampling kernels read it. It lives at the
base floor so that :mod:`bole.speculative` (whose target distribution it defines) can import it;
users import it from ``bole``, ``bole.llm`` or ``bole.engine.request``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

__all__ = ["MAX_LOGPROBS", "SEED_MIN", "SEED_END", "SamplingParams"]

#: the most alternatives a request can ask log-probabilities of at each token (OpenAI's limit)
MAX_LOGPROBS = 20
#: the seeds a torch generator takes: [SEED_MIN, SEED_END)
SEED_MIN, SEED_END = -(1 << 63), 1 << 64


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples, when it stops and what it returns (keyword arguments only).

    Sampling -- the target distribution that speculative acceptance reproduces exactly:

    * ``temperature``: 0 is greedy, and **greedy is the default** (the Python API's and the
      engine's). The OpenAI server passes its own default, 1.0, explicitly.
    * ``top_p``: nucleus mass, in (0, 1]; 1 = off. ``top_k``: sample among the k most likely
      tokens; 0 = off.
    * ``presence_penalty``, ``frequency_penalty``: OpenAI's, in [-2, 2] (0 = off), over the
      generated tokens; ``repetition_penalty``: vLLM's / Hugging Face's, > 0 (1 = off), over the
      prompt's and the generated tokens. Penalties change the logits before temperature, top-k
      and top-p (greedy takes the argmax of the penalised logits), as vLLM does; see
      :func:`bole.speculative.sampling.apply_penalties`.
    * ``seed``: seeds this request's draws (random when None), so that a seeded request samples
      the same tokens whatever else runs in its batch; an integer in [-2**63, 2**64).

    Stopping:

    * ``max_tokens``: output tokens at most (>= 1).
    * ``stop``: strings that end the output, not returned with it (a string, a sequence of
      strings or None; kept as a tuple); they need the engine's tokenizer.
    * ``stop_token_ids``: tokens that end the output, returned with it (kept as a tuple).
    * ``ignore_eos``: when False (the default) the checkpoint's end-of-sequence tokens end the
      output too (returned with it); the engine adds them (:meth:`all_stop_token_ids`).

    Output: ``logprobs``: None, or each output token's log-probability with this many (0 to
    :data:`MAX_LOGPROBS`) most likely alternatives, under the model's raw distribution
    (log_softmax of its logits, before penalties, temperature, top-k and top-p, as vLLM's
    default), read at the tree node the token was emitted from.

    Construction does not check values; :meth:`validate` does (every entry point calls it
    before a request runs) and raises a ValueError naming the field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 64
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        # one spelling each: stop strings and stop tokens as tuples (hashable, picklable)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Iterable):
            stop = tuple(stop)
        object.__setattr__(self, "stop", stop)
        if isinstance(self.stop_token_ids, Iterable):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    # ---- checks ----
    def validate(self) -> None:
        """Raise a ValueError naming the first field whose value is out of range."""
        self._validate_sampling()
        self._validate_stopping()
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool)
                               or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {lp!r}")

    def _validate_sampling(self) -> None:
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must lie in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if not (_number(rep) and math.isfinite(rep) and rep > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rep!r}")
        seed = self.seed
        if seed is not None and not (isinstance(seed, int) and SEED_MIN <= seed < SEED_END):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64) (a torch "
                             f"generator's seeds), got {seed!r}")

    def _validate_stopping(self) -> None:
        mt = self.max_tokens
        if not isinstance(mt, int) or mt < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {mt!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s
                                                   for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a sequence of non-empty "
                             f"strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or any(isinstance(t, bool) or not isinstance(t, int)
                                             for t in ids):
            raise ValueError(f"stop_token_ids must be a sequence of integers, got {ids!r}")

    # ---- derived ----
    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def all_stop_token_ids(self, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """Every token that ends the output: the checkpoint's ``eos_token_ids`` unless
        ``ignore_eos``, then ``stop_token_ids``."""
        return (() if self.ignore_eos else tuple(eos_token_ids)) + tuple(self.stop_token_ids)
