"""``target_probs`` over logits of any leading shape equals a step-by-step reference applied to
each row alone: greedy one-hot, temperature, top-k, top-p and their combination."""

import pytest
import torch

from bole.sampling_params import SamplingParams
from bole.speculative.sampling import target_probs
from tests.engine.test_user_visible import reference_probs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.3, top_k=9, top_p=0.75)])
def test_target_probs_equals_a_per_row_reference(params):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 16, generator=gen) * 2
    probs = target_probs(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for row, got in zip(logits.reshape(-1, 16), probs.reshape(-1, 16)):
        if params.greedy:
            want = torch.nn.functional.one_hot(row.argmax(), 16).double()
        else:
            ref = reference_probs(row, params.temperature, params.top_k, params.top_p)
            want = torch.zeros(16, dtype=torch.float64)
            for t, q in ref.items():
                want[t] = q
        assert torch.allclose(got.double(), want, atol=1e-6), (params, got, want)
