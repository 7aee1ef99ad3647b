"""The MTP drafter on the device: its pool follows commits exactly, drafting is batched across
requests without changing any request's tree, and drafting with it stays lossless."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import ModelRunner
from bole.forest import DenseForest
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.models.weights import mtp_specs
from bole.speculative.accept_device import accept_greedy
from bole.speculative.drafters.mtp import MTPDrafter
from bole.speculative.tree_growth import NodeTable, TreeGrowth, node_capacity
from bole.tree import DraftTree, PackedForest


def _mtp_model(seed=4):
    cfg = preset_config("tiny")
    m = HybridModel.random(cfg, dtype=torch.float32, seed=seed, gdn_backend="torch")
    gen = torch.Generator().manual_seed(9)
    tensors = dict(m.w)
    for name, shape in mtp_specs(cfg, num_layers=1).items():
        tensors[name] = (torch.randn(shape, generator=gen) * 0.05 if len(shape) > 1
                         else torch.zeros(shape))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 50
    return HybridModel(cfg, tensors, gdn_backend="torch")


@pytest.fixture(scope="module")
def model():
    return _mtp_model()


def _setup(model, prompts, scratch=32):
    runner = ModelRunner(model, model.new_cache(len(prompts) + 1, 64), "torch")
    mtp = MTPDrafter(model, len(prompts) + 1, 64, scratch)
    slots = []
    for p in prompts:
        slot = runner.cache.allocate(40)
        _, hidden = runner.prefill(slot, p)
        mtp.observe_prompt(slot, p, hidden)
        slots.append(slot)
    return runner, mtp, slots


def test_mtp_pool_after_commits_equals_a_fresh_prefill(model):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (9,), generator=gen)
    extra = torch.randint(0, 128, (4,), generator=gen)          # root + 3 drafted, all accepted
    runner, mtp, (a,) = _setup(model, [prompt])
    batch, out = runner.verify([a], PackedForest.pack([DraftTree.chain(4)]), extra)
    runner.commit_accepted(batch, out, [3])
    slot_a = torch.tensor([a], dtype=torch.int32)
    mtp.observe(slot_a, extra[None], out.hidden[None, :4], torch.tensor([9]), torch.tensor([4]))
    # fresh: the whole sequence as one prompt, in a second slot
    b = runner.cache.allocate(40)
    whole = torch.cat([prompt, extra])
    _, hidden = runner.prefill(b, whole)
    mtp.observe_prompt(b, whole, hidden)
    assert torch.allclose(mtp.k[a, :12], mtp.k[b, :12], atol=1e-5)
    assert torch.allclose(mtp.v[a, :12], mtp.v[b, :12], atol=1e-5)
    assert torch.allclose(mtp.last_hidden[a], mtp.last_hidden[b], atol=1e-5)
    # a drafted root writes the entry that committing it writes: same token, hidden, position
    table = NodeTable.empty(torch.tensor([7]), node_capacity(2, 2))
    step = mtp.step_fn(torch.tensor([b], dtype=torch.int32), torch.tensor([13]), topk=2)
    step(0, torch.tensor([[0]]), table)
    drafted = mtp.k[b, 12].clone()
    mtp.observe(torch.tensor([b], dtype=torch.int32), torch.tensor([[7]]), hidden[-1:][None],
                torch.tensor([13]), torch.tensor([1]))
    assert torch.allclose(drafted, mtp.k[b, 12], atol=1e-6)


def test_batched_drafting_across_requests_equals_drafting_each_alone(model):
    """One batched MTP call per level over requests with different contexts gives each request
    the tree it gets alone."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 11, 8)]
    runner, mtp, slots = _setup(model, prompts)
    roots, limits = torch.tensor([4, 2, 9]), torch.tensor([4, 0, 3])
    ctx = torch.tensor([runner.cache.host_lengths[s] for s in slots])
    slot_t = torch.tensor(slots, dtype=torch.int32)
    together = TreeGrowth(3, 3, 4, 10).grow(roots, limits, mtp.step_fn(slot_t, ctx, 3))
    for i in range(3):
        alone = TreeGrowth(1, 3, 4, 10).grow(roots[i:i + 1], limits[i:i + 1],
                                             mtp.step_fn(slot_t[i:i + 1], ctx[i:i + 1], 3))
        assert torch.equal(together.tokens[i], alone.tokens[0])
        assert torch.equal(together.parents[i], alone.parents[0])
        assert torch.allclose(together.rho[i], alone.rho[0], atol=1e-6)
    assert int(together.valid[1].sum()) == 1                    # depth limit 0: a lone root


def test_mtp_draft_tree_is_well_formed_and_verifies(model):
    runner, mtp, (s,) = _setup(model, [torch.arange(10)])
    ctx = torch.tensor([10])
    slot_t = torch.tensor([s], dtype=torch.int32)
    trees = TreeGrowth(1, 3, 4, 12).grow(torch.tensor([5]), torch.tensor([4]),
                                         mtp.step_fn(slot_t, ctx, 3))
    assert int(trees.valid.sum()) == 12 and int(trees.forest.depth.max()) <= 4
    forest = DenseForest.from_parents(trees.parents, trees.valid, 4)
    batch = runner.make_batch(trees.tokens.reshape(-1), forest, slot_t)
    out = runner.forward(batch)
    acc = accept_greedy(out.logits.view(1, 12, -1).argmax(-1), trees.tokens, forest)
    path = acc.path[0, :int(acc.path_len[0])]
    # the accepted path follows the target's argmax from the root
    argmax = out.logits.argmax(-1)
    for parent, child in zip(path[:-1].tolist(), path[1:].tolist()):
        assert int(trees.tokens[0, child]) == int(argmax[parent])
    assert int(acc.bonus[0]) == int(argmax[path[-1]])


def test_every_tree_node_drafts_what_its_path_drafts_alone(model):
    """The tree's bookkeeping (frontier inputs, pool rows, masks, each node's parent output)
    against the plainest drafting: each drafted node's path fed alone, one node a step, to a
    fresh drafter as a chain. Every node's best proposal and its probability agree."""
    prompt = torch.arange(10)
    topk, depth = 3, 4
    runner, mtp, (s,) = _setup(model, [prompt])
    slot_t, ctx = torch.tensor([s], dtype=torch.int32), torch.tensor([10])
    inner, seen = mtp.step_fn(slot_t, ctx, topk), []

    def record(i, frontier, table):
        tokens, probs = inner(i, frontier, table)
        seen.append((frontier.clone(), table.tokens.clone(), table.parents.clone(),
                     tokens.clone(), probs.clone()))
        return tokens, probs
    TreeGrowth(1, topk, depth, 16).grow(torch.tensor([5]), torch.tensor([depth]), record)
    checked = 0
    for frontier, tokens, parents, drafted, probs in seen:
        for k, x in enumerate(frontier[0].tolist()):
            if x < 0:
                continue
            path = [x]
            while int(parents[0, path[-1]]) >= 0:
                path.append(int(parents[0, path[-1]]))
            path = path[::-1]
            d = len(path)
            chain = NodeTable.empty(tokens[:, 0], d)
            chain.tokens[0] = tokens[0, path]
            chain.parents[0, 1:] = torch.arange(d - 1)
            chain.depth[0] = torch.arange(d)
            chain.live[:] = True
            chain.ancestors[0] = torch.ones(d, d, dtype=torch.bool).tril()
            _, alone, (s2,) = _setup(model, [prompt])
            step = alone.step_fn(torch.tensor([s2], dtype=torch.int32), ctx, 1)
            for j in range(d):
                t1, p1 = step(j, torch.tensor([[j]]), chain)
            assert int(t1[0, 0, 0]) == int(drafted[0, k, 0])
            assert float(p1[0, 0, 0]) == pytest.approx(float(probs[0, k, 0]), rel=1e-4, abs=1e-6)
            checked += 1
    assert checked >= 1 + topk + 2                  # the root and nodes of several depths


def test_engine_with_mtp_drafter_equals_ar(model):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 9, 9]]
    params = SamplingParams(max_tokens=16)
    ar = Engine(model, SpecConfig(mode="ar")).generate(prompts, params, seed=0)
    for mode in ("bole", "tree-serial", "chain"):
        spec = Engine(model, SpecConfig(mode=mode, drafter="mtp", depth=3, topk=2, budget=6))
        res = spec.generate(prompts, params, seed=0)
        assert [r.token_ids for r in res] == [r.token_ids for r in ar]


def test_no_mtp_head_is_a_clear_error():
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32)
    with pytest.raises(ValueError, match="no MTP head"):
        MTPDrafter(m, 1, 16, 8)
