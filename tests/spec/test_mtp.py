"""The MTP drafter: its cache follows commits exactly, and drafting with it stays lossless."""

import pytest
import torch

from bole.engine import Engine, GenerationParams, SpecConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.models.weights import mtp_specs
from bole.spec.accept import accept_forest
from bole.spec.mtp import MTPDrafter
from bole.spec.sampling import SamplingParams, target_probs
from bole.tree import DraftTree, PackedForest


@pytest.fixture(scope="module")
def model():
    cfg = preset_config("tiny")
    m = HybridModel.random(cfg, dtype=torch.float32, seed=4, gdn_backend="torch")
    gen = torch.Generator().manual_seed(9)
    for name, shape in mtp_specs(cfg, num_layers=1).items():
        m.w[name] = (torch.randn(shape, generator=gen) * 0.05 if len(shape) > 1
                     else torch.zeros(shape))
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50
    return m


def test_mtp_cache_after_commits_equals_a_fresh_prefill(model):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (9,), generator=gen)
    extra = torch.randint(0, 128, (4,), generator=gen)          # root + 3 drafted, all accepted
    # incremental: prefill, then a verify round whose chain is accepted to its end
    cache = model.new_cache(2, 64)
    a = cache.allocate(32)
    mtp = MTPDrafter(model, 2, 64)
    _, hid = model.prefill(cache, a, prompt, return_hidden=True)
    mtp.observe(a, prompt.tolist(), hid, 0)
    forest = PackedForest.pack([DraftTree.chain(4)])
    out = model.forward_tree(cache, [a], forest, extra)
    model.commit(cache, out, [3])
    mtp.observe(a, extra.tolist(), out.hidden, 9)
    # fresh: the whole sequence as one prompt
    b = cache.allocate(32)
    _, hid_b = model.prefill(cache, b, torch.cat([prompt, extra]), return_hidden=True)
    mtp.observe(b, torch.cat([prompt, extra]).tolist(), hid_b, 0)
    assert mtp.length[a] == mtp.length[b] == 13
    assert torch.allclose(mtp.k[a, 1:13], mtp.k[b, 1:13], atol=1e-5)
    assert torch.allclose(mtp.last_hidden[a], mtp.last_hidden[b], atol=1e-5)
    # a drafted root is the entry that committing it writes: same token, hidden and position
    _, k_draft, _, _ = mtp.expander(a).node((7,))
    mtp.observe(a, [7], hid[-1:], 13)
    assert torch.allclose(k_draft, mtp.k[a, 13:14], atol=1e-6)
    mtp.length[a], mtp.last_hidden[a] = 13, mtp.last_hidden[b]      # undo
    paths = [[7], [7, 3], [7, 3, 11]]
    for x, y in zip(mtp.expander(a)(paths, 3), mtp.expander(b)(paths, 3)):
        assert [t for t, _ in x] == [t for t, _ in y]
        assert torch.allclose(torch.tensor([p for _, p in x]), torch.tensor([p for _, p in y]),
                              atol=1e-5)


def test_engine_with_mtp_drafter_equals_ar(model):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 9, 9]]
    params = GenerationParams(max_tokens=16)
    ar = Engine(model, SpecConfig(mode="ar")).generate(prompts, params, seed=0)
    for mode in ("bole", "tree-serial"):
        spec = Engine(model, SpecConfig(mode=mode, drafter="mtp", depth=3, topk=2, budget=6))
        res = spec.generate(prompts, params, seed=0)
        assert [r.token_ids for r in res] == [r.token_ids for r in ar]


def test_mtp_draft_tree_is_well_formed(model):
    cache = model.new_cache(1, 64)
    s = cache.allocate(32)
    mtp = MTPDrafter(model, 1, 64)
    prompt = torch.arange(10)
    _, hid = model.prefill(cache, s, prompt, return_hidden=True)
    mtp.observe(s, prompt.tolist(), hid, 0)
    from bole.spec.draft_tree import build_draft_tree
    res = build_draft_tree(5, mtp.expander(s), depth=4, topk=3, budget=12)
    assert res.tree.num_nodes == 12 and res.tree.max_depth <= 4
    forest = PackedForest.pack([res.tree])
    out = model.forward_tree(cache, [s], forest, res.tokens)
    acc = accept_forest(target_probs(out.logits, SamplingParams(temperature=0)), res.tokens, forest)
    assert acc.accepted[0] in range(12)


def test_no_mtp_head_is_a_clear_error():
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32)
    with pytest.raises(ValueError, match="no MTP head"):
        MTPDrafter(m, 1, 16)


def _same_proposals(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert [t for t, _ in x] == [t for t, _ in y]
        assert torch.allclose(torch.tensor([p for _, p in x]), torch.tensor([p for _, p in y]),
                              atol=1e-5)


def test_batched_drafting_across_requests_equals_drafting_each_alone(model):
    """One batched MTP call per level over requests with different contexts (a ragged
    block-structured mask) gives each request the proposals and trees it gets alone."""
    from bole.spec.draft_tree import build_draft_tree, build_draft_trees
    gen = torch.Generator().manual_seed(3)
    cache = model.new_cache(3, 64)
    mtp = MTPDrafter(model, 3, 64)
    slots = []
    for n in (5, 11, 8):
        slot = cache.allocate(40)
        prompt = torch.randint(0, 128, (n,), generator=gen)
        _, hid = model.prefill(cache, slot, prompt, return_hidden=True)
        mtp.observe(slot, prompt.tolist(), hid, 0)
        slots.append(slot)
    paths = [[[4], [4, 9]], [], [[2], [2, 5], [2, 5, 1]]]
    batched = mtp.batch_expander(slots)(paths, 3)
    for slot, p, got in zip(slots, paths, batched):
        _same_proposals(got, mtp.expander(slot)(p, 3) if p else [])
    roots, depths = [4, 2, 9], [4, 0, 3]
    trees = build_draft_trees(roots, mtp.batch_expander(slots), depths=depths, topk=3, budget=10)
    for slot, root, depth, res in zip(slots, roots, depths, trees):
        alone = build_draft_tree(root, mtp.expander(slot), depth=depth, topk=3, budget=10)
        assert res.tree.parents.tolist() == alone.tree.parents.tolist()
        assert res.tokens.tolist() == alone.tokens.tolist()
        assert torch.allclose(res.rho, alone.rho, atol=1e-5)
