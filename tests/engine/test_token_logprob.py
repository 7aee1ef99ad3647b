"""The first token's logprob (the prefill's, :func:`bole.engine.engine._token_logprob`) against
a log-softmax in float64 scalars: the token's value, the asked number of alternatives, most
likely first, in vocabularies smaller and larger than the 20 alternatives one can ask for."""

from __future__ import annotations

import math

import pytest
import torch

from bole.engine.engine import _token_logprob


def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    total = math.log(sum(math.exp(x - top) for x in row))
    return [x - top - total for x in row]


@pytest.mark.parametrize("V, token, top", [(8, 3, 5), (8, 0, 8), (50, 17, 20), (50, 49, 0),
                                           (50, 2, 1)])
def test_token_logprob_is_the_log_softmax_and_its_best(V: int, token: int, top: int):
    gen = torch.Generator().manual_seed(V + token)
    logits = torch.randn(V, generator=gen) * 3
    want = _log_softmax([float(x) for x in logits.float().tolist()])
    got = _token_logprob(logits, token, top)
    assert got.token_id == token
    assert math.isclose(got.logprob, want[token], abs_tol=1e-5)
    order = sorted(range(V), key=lambda v: -want[v])[:top]
    assert [t for t, _ in got.top] == order
    for (_, value), t in zip(got.top, order):
        assert math.isclose(value, want[t], abs_tol=1e-5)
