"""A reduced draft vocabulary (bole/speculative/drafters/draft_vocab.py): the MTP head proposes the top-k
of the draft vocabulary's softmax, output stays plain decoding's, and bad counts are clear errors."""

import json

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.speculative.drafters.draft_vocab import draft_vocab_ids, frequent_ids, load_counts
from bole.speculative.drafters.mtp import MTPDrafter
from bole.speculative.tree_growth import NodeTable, node_capacity
from tests.speculative.test_mtp import _mtp_model, _setup


@pytest.fixture(scope="module")
def model():
    return _mtp_model()


def test_frequent_ids_ties_and_order():
    counts = torch.tensor([5, 9, 5, 0, 9, 1])
    assert frequent_ids(counts, 3).tolist() == [0, 1, 4]       # 9, 9, then the lower of the 5s
    assert frequent_ids(counts, 6).tolist() == list(range(6))
    for bad in (0, 7):
        with pytest.raises(ValueError, match="draft vocabulary holds 1 to 6"):
            frequent_ids(counts, bad)


def _step(mtp, slot, ctx, topk):
    table = NodeTable.empty(torch.tensor([7]), node_capacity(topk, 2))
    step = mtp.step_fn(torch.tensor([slot], dtype=torch.int32), torch.tensor([ctx]), topk=topk)
    return step(0, torch.tensor([[0]]), table)


def test_head_proposes_the_top_of_the_draft_vocabulary(model):
    """With vocabulary ids ``ids`` the step's proposals are the top-k of softmax(logits[ids]):
    the full-vocabulary head's logits restricted to ids, renormalised."""
    V = model.config.vocab_size
    prompt = torch.arange(3, 12)
    runner, full, (s,) = _setup(model, [prompt])
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:V // 3].sort().values
    reduced = MTPDrafter(model, 2, 64, 32, vocab_ids=ids)
    reduced.k.copy_(full.k), reduced.v.copy_(full.v), reduced.last_hidden.copy_(full.last_hidden)
    tok, p = _step(reduced, s, 9, topk=4)
    assert set(tok.flatten().tolist()) <= set(ids.tolist())
    # the reference: full logits of the ids (via the full head's softmax up to a constant)
    logits = torch.log_softmax(model.lm_head(_head_output(full, s, 9)), -1)[0, ids]
    want = torch.topk(torch.softmax(logits, -1), 4)
    assert tok.flatten().tolist() == ids[want.indices].tolist()
    torch.testing.assert_close(p.flatten(), want.values, rtol=1e-5, atol=1e-6)
    # the ids of the whole vocabulary give exactly the full head's proposals
    every = MTPDrafter(model, 2, 64, 32, vocab_ids=torch.arange(V))
    every.k.copy_(full.k), every.v.copy_(full.v), every.last_hidden.copy_(full.last_hidden)
    tok_e, p_e = _step(every, s, 9, topk=4)
    tok_f, p_f = _step(full, s, 9, topk=4)
    assert torch.equal(tok_e, tok_f)
    torch.testing.assert_close(p_e, p_f)


def _head_output(mtp, slot, ctx):
    """The MTP layer's output m at the root (the step's input to the LM head), recomputed."""
    captured = {}
    original = mtp.model.lm_head

    def spy(h):
        captured["m"] = h.clone()
        return original(h)
    mtp.model.lm_head = spy
    try:
        _step(mtp, slot, ctx, topk=1)
    finally:
        del mtp.model.lm_head
    return captured["m"]


def test_engine_output_equals_ar_with_a_reduced_draft_vocabulary(model):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 9, 9]]
    params = SamplingParams(max_tokens=16)
    ar = Engine(model, SpecConfig(mode="ar")).generate(prompts, params, seed=0)
    for mode in ("bole", "chain"):
        spec = SpecConfig(mode=mode, drafter="mtp", depth=3, topk=2, budget=6, draft_vocab=40)
        engine = Engine(model, spec)
        assert engine.rounds.device_drafter.vocab_ids.tolist() == list(range(40))   # wired in
        res = engine.generate(prompts, params, seed=0)
        assert [r.token_ids for r in res] == [r.token_ids for r in ar]


def test_counts_file_errors(tmp_path, model):
    with pytest.raises(ValueError, match="token_counts.json does not exist"):
        load_counts(tmp_path, 10)
    (tmp_path / "token_counts.json").write_text(json.dumps({"counts": [1, 2]}))
    with pytest.raises(ValueError, match="must hold 10 non-negative integer counts"):
        load_counts(tmp_path, 10)
    (tmp_path / "token_counts.json").write_text("not json")
    with pytest.raises(ValueError, match="not a token-count file"):
        load_counts(tmp_path, 10)
    with pytest.raises(ValueError, match="draft_vocab must be >= 0"):
        draft_vocab_ids(model, -1)
    assert draft_vocab_ids(model, 0) is None and draft_vocab_ids(model, 10 ** 6) is None
    assert draft_vocab_ids(model, 5).tolist() == list(range(5))    # random weights: first ids
    with pytest.raises(ValueError, match="cannot give top-4"):
        SpecConfig(drafter="mtp", topk=4, draft_vocab=3).validate()
    with pytest.raises(ValueError, match="the ngram drafter has none"):
        SpecConfig(drafter="ngram", draft_vocab=100).validate()


def test_the_bundled_model_ships_its_counts():
    from bole.assets import BUNDLED_MODEL
    counts = load_counts(BUNDLED_MODEL, 8192)
    assert int(counts.sum()) > 1_000_000 and int((counts > 0).sum()) > 8000
