"""The static buffers of rounds and admissions (bole/engine/buffers.py), against values written out
and a float64 reference: the sampling variant's flags, the per-row parameters a round's graph
reads (padding rows greedy), the initial tree of each row, a round's log-probabilities and their
host reading, and the packed admission rows."""

import pytest
import torch

from bole.engine.buffers import PrefillBuffers, RoundBuffers, RoundLogprobs, StaticSampling
from bole.sampling_params import SamplingParams
from bole.speculative.accept_device import SamplingBatch

GREEDY = SamplingParams(temperature=0)
HOT = SamplingParams(temperature=0.7)
TOPK = SamplingParams(temperature=1.0, top_k=5)
TOPK3 = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
PEN = SamplingParams(temperature=0, presence_penalty=0.5)


def test_flags_name_the_acceptance_variant():
    """(all greedy, any greedy, any top-k, any top-p, top-k bucket, any penalty, logprobs): the
    filters of sampled rows only, top-k widths by powers of two, penalties of every row."""
    f = StaticSampling.flags_for
    assert f([]) == (True, True, False, False, 0, False, False)
    assert f([GREEDY, GREEDY]) == (True, True, False, False, 0, False, False)
    assert f([GREEDY, HOT], logprobs=True) == (False, True, False, False, 0, False, True)
    assert f([HOT, TOPK]) == (False, True, True, False, 8, False, False)
    assert f([TOPK3]) == (False, True, True, True, 4, False, False)
    assert f([SamplingParams(temperature=1.0, top_k=1)]) == (False, True, True, False, 1, False,
                                                              False)
    assert f([SamplingParams(temperature=1.0, top_k=16)])[4] == 16
    assert f([SamplingParams(temperature=1.0, top_k=17)])[4] == 32
    # a greedy row's filters never matter; its penalty does
    assert f([SamplingParams(temperature=0, top_k=3, top_p=0.5), PEN]) == \
        (True, True, False, False, 0, True, False)
    assert f([HOT, SamplingParams(temperature=1.0, repetition_penalty=1.2)])[5] is True
    assert f([HOT], logprobs=0)[6] is False and f([HOT], logprobs=2)[6] is True


def _fields(batch):
    return {k: getattr(batch, k) for k in ("temperature", "top_k", "top_p", "inv_temperature",
                                             "presence", "frequency", "repetition")}


def test_static_sampling_writes_each_row_and_pads_with_greedy_rows():
    s = StaticSampling(4, "cpu")
    assert s.R == 4 and s.flags == StaticSampling.flags_for([]) and s.all_greedy
    assert not s.logprobs
    start = _fields(s.batch())
    want = _fields(SamplingBatch.from_params([GREEDY] * 4))
    assert start.keys() == want.keys()
    for k in want:
        assert torch.equal(start[k], want[k]), k
    params = [TOPK3, PEN, HOT]
    s.write(params, logprobs=True)
    assert s.flags == StaticSampling.flags_for(params, True) and s.logprobs and not s.all_greedy
    got, want = s.batch(), SamplingBatch.from_params(params + [GREEDY])
    for k, v in _fields(want).items():
        assert torch.equal(getattr(got, k), v), k
    assert (got.all_greedy, got.any_greedy, got.any_top_k, got.any_top_p, got.max_top_k,
            got.any_penalty) == (False, True, True, True, 4, True)
    before = {k: v.data_ptr() for k, v in s.tensors.items()}
    s.write([GREEDY])                            # in place: a captured graph reads these
    assert {k: v.data_ptr() for k, v in s.tensors.items()} == before
    assert s.all_greedy and not s.logprobs
    for k, v in _fields(SamplingBatch.from_params([GREEDY] * 4)).items():
        assert torch.equal(s.tensors[k], v), k


def test_round_buffers_start_as_one_root_per_row_on_the_dummy_slot():
    R, T, D, K = 3, 5, 2, 4
    b = RoundBuffers(R, T, D, K, torch.device("cpu"), dummy_slot=9)
    assert (b.R, b.T) == (R, T)
    assert b.slots.dtype == torch.int32 and b.slots.tolist() == [9] * R
    assert b.active.dtype == torch.bool and not b.active.any() and b.active.shape == (R,)
    for t in (b.roots, b.remaining, b.kept, b.num_emitted, b.num_host, b.kept_host):
        assert t.dtype == torch.int64 and t.shape == (R,) and not t.any()
    assert b.uniforms.shape == (R, D + 1, K + 1) and b.uniforms.dtype == torch.float32
    assert b.tree_tokens.shape == (R, T) and b.tree_tokens.dtype == torch.int64
    assert not b.tree_tokens.any()
    assert b.tree_parents.dtype == torch.int64 and b.tree_parents.tolist() == [[-1] * T] * R
    assert b.tree_valid.tolist() == [[True] + [False] * (T - 1)] * R
    assert b.tree_rho.dtype == torch.float64
    assert b.tree_rho.tolist() == [[1.0] + [0.0] * (T - 1)] * R
    assert b.budget.shape == () and b.budget.dtype == torch.int64 and int(b.budget) == 0
    for t in (b.emitted, b.emitted_host):
        assert t.shape == (R, D + 1) and t.dtype == torch.int64 and not t.any()
    assert b.widen.dtype == torch.bool and b.widen.shape == () and bool(b.widen)
    assert b.widen_host.dtype == torch.bool and bool(b.widen_host)
    assert b.sampling.R == R and b.sampling.all_greedy
    assert b.goodput is None and b.rows == () and b.logprobs is None


def test_round_logprobs_against_a_float64_log_softmax():
    """Each emitted token's log-probability at its path node, and the top L (min(20, V)) in
    descending order, as a float64 log_softmax gives them; the host reading per request."""
    gen = torch.Generator().manual_seed(0)
    R, W, V, D = 2, 4, 30, 2
    lp = RoundLogprobs.empty(R, D, V, "cpu")
    assert lp.token.shape == (R, D + 1) and lp.token.dtype == torch.float32
    assert lp.top_ids.shape == (R, D + 1, 20) and lp.top_ids.dtype == torch.int64
    assert lp.top.shape == (R, D + 1, 20) and lp.top.dtype == torch.float32
    assert [t.shape for t in lp.host] == [(R, D + 1), (R, D + 1, 20), (R, D + 1, 20)]
    assert [t.dtype for t in lp.host] == [torch.float32, torch.int64, torch.float32]
    assert RoundLogprobs.empty(1, 0, 7, "cpu").top.shape == (1, 1, 7)
    logits = 3 * torch.randn(R, W, V, generator=gen, dtype=torch.float64)
    path = torch.tensor([[0, 2, 3], [0, 1, 1]])
    emitted = torch.tensor([[4, 29, 0], [7, -1, -1]])          # -1: nothing emitted there
    lp.write(logits.float(), path, emitted)
    ref = torch.log_softmax(logits, dim=-1)
    for r in range(R):
        for j in range(D + 1):
            row = ref[r, path[r, j]]
            tok = max(int(emitted[r, j]), 0)
            assert float(lp.token[r, j]) == pytest.approx(float(row[tok]), abs=1e-5)
            values, ids = torch.sort(row, descending=True)
            assert lp.top_ids[r, j].tolist() == ids[:20].tolist()
            torch.testing.assert_close(lp.top[r, j].double(), values[:20], atol=1e-5, rtol=0)
    lp.to_host()
    for host, dev in zip(lp.host, (lp.token, lp.top_ids, lp.top)):
        assert torch.equal(host, dev)
    rows = lp.rows([3, 1], [2, None])
    assert rows[1] is None and len(rows[0]) == 3
    for j, (token, top) in enumerate(rows[0]):
        assert token == float(lp.token[0, j])
        assert top == list(zip(lp.top_ids[0, j, :2].tolist(), lp.top[0, j, :2].tolist()))
    assert lp.rows([1, 0], [0, 5]) == [[(float(lp.token[0, 0]), [])], []]


def test_prefill_buffers_pack_rows_lengths_and_slots():
    b = PrefillBuffers(3, 4, "cpu", dummy_slot=7)
    assert (b.R, b.T, b.dummy_slot) == (3, 4, 7)
    assert b.packed.shape == b.host.shape == (3, 6) and b.packed.dtype == torch.int64
    assert b.packed[:, 5].tolist() == [7, 7, 7] and not b.packed[:, :5].any()
    assert b.slots.dtype == torch.int32 and b.slots.tolist() == [7, 7, 7]
    b.write([2, 0, 1], torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [9, 0, 0, 0]]), [4, 2, 1])
    b.write([5, 3], torch.tensor([[11, 12, 0, 0], [13, 0, 0, 0]]), [2, 1])
    assert b.packed.tolist() == [[11, 12, 0, 0, 2, 5], [13, 0, 0, 0, 1, 3], [0, 0, 0, 0, 0, 7]]
    assert b.tokens.tolist() == [[11, 12, 0, 0], [13, 0, 0, 0], [0, 0, 0, 0]]
    assert b.lengths.tolist() == [2, 1, 0] and b.slots.tolist() == [5, 3, 7]
    assert b.tokens.data_ptr() == b.packed.data_ptr()        # views: one upload fills them
