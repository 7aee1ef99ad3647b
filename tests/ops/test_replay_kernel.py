"""The replay drafter's one-launch proposals (bole/ops/replay/kernel.py; the CPU
interpreter here, compiled on a GPU) against its torch code, on every step of grown trees:
on- and off-path nodes, unknown continuations, wrap-around near the vocabulary's end, several
top-k and profiles."""

import pytest
import torch

from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.drafters.mtp import MTPDrafter
from bole.speculative.drafters.replay import AcceptanceProfile, ReplayDrafter
from bole.ops.replay.kernel import propose_triton
from bole.speculative.tree_growth import TreeGrowth, node_capacity
from tests.kernel_utils import DEV

PROFILES = [AcceptanceProfile("a", "unit test", (0.45, 0.2, 0.1, 0.05, 0.05)),
            AcceptanceProfile("b", "unit test", (0.9,)),
            AcceptanceProfile("c", "unit test", (0.3,) * 3)]


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=1,
                              gdn_backend="torch", device=DEV)


@pytest.mark.parametrize("topk,depth,profile", [(1, 4, 0), (2, 5, 1), (3, 3, 2), (4, 4, 0),
                                                (8, 2, 2)])
def test_the_kernel_proposes_as_the_torch_code(model, topk, depth, profile, monkeypatch):
    monkeypatch.setenv("BOLE_REPLAY_KERNEL", "0")          # the torch code drives the growth
    R, max_len, start, vocab = 5, 64, 3, model.config.vocab_size
    mtp = MTPDrafter(model, R + 1, max_len, node_capacity(topk, depth))
    replay = ReplayDrafter(mtp, PROFILES[profile], R + 1, max_len, seed=profile)
    gen = torch.Generator().manual_seed(topk * 10 + depth)
    for r in range(R):
        length = int(torch.randint(2, 40, (), generator=gen))    # some end early: unknown
        if r % 2:                                                # near the vocabulary's end
            cont = (vocab - 1 - torch.randint(0, 3, (length,), generator=gen)).tolist()
        else:
            cont = torch.randint(0, vocab, (length,), generator=gen).tolist()
        replay.set_continuation(r, cont, start)
    checked = 0
    real = replay._propose

    def both(row, ctx, keys, frontier, table, k):
        nonlocal checked
        want, probs = real(row, ctx, keys, frontier, table, k)
        got = propose_triton(replay.continuation, row, ctx, replay.stream, row // replay.width,
                             replay._seed_key, frontier, table.tokens, table.depth,
                             replay.cum, k, vocab, max_len)
        live = (frontier >= 0)[..., None].expand_as(got)    # -1 entries: arbitrary values
        assert torch.equal(got[live], want[live])
        assert torch.equal(got, want)                        # and here the same values too
        checked += int(live.sum())
        return want, probs
    replay._propose = both
    slots = torch.tensor([0, 1, 2, 3, 4, R], dtype=torch.int32, device=DEV)[:R]
    for j in range(6):
        ctx = torch.full((R,), start + j, dtype=torch.int64, device=DEV)
        ctx[R - 1] = start + j + 30                          # past its continuation
        roots = replay.continuation[slots.long(), ctx.clamp(max=max_len)].clamp(min=0)
        TreeGrowth(R, topk, depth, 4 * depth, device=DEV, impl="torch").grow(
            roots, torch.full((R,), depth, device=DEV), replay.step_fn(slots, ctx, topk))
    assert checked > 20 * depth


def test_shapes_are_checked():
    z = torch.zeros(2, 3, dtype=torch.int64, device=DEV)
    r2 = torch.zeros(2, dtype=torch.int64, device=DEV)
    cum = torch.ones(1, dtype=torch.float64, device=DEV)
    cont = torch.zeros(3, 5, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"must be \[R, C\], \[R\], \[R\], \[R\] and \[S\]"):
        propose_triton(cont, r2, r2, r2, torch.zeros(3, dtype=torch.int64, device=DEV), 1, z,
                       z, z[:, :2], cum, 2, 100, 4)
    with pytest.raises(ValueError, match="seed_key"):
        propose_triton(cont, r2, r2, r2, r2, 2 ** 31, z, z, z, cum, 2, 100, 4)


@pytest.mark.skipif(DEV != "cuda", reason="step_fn takes the kernel on CUDA only")
def test_step_fn_grows_the_same_trees_with_and_without_the_kernel(model, monkeypatch):
    """Through the drafter's step (the kernel hashing its own keys, against the torch code's
    round keys): the same forests, proposals and draft probabilities, round after round."""
    topk, depth, R, max_len, start = 3, 4, 4, 64, 3
    replay = ReplayDrafter(MTPDrafter(model, R + 1, max_len, node_capacity(topk, depth)),
                           PROFILES[0], R + 1, max_len, seed=7)
    gen = torch.Generator().manual_seed(3)
    for r in range(R):
        replay.set_continuation(r, torch.randint(0, model.config.vocab_size, (30,),
                                                 generator=gen).tolist(), start)
    slots = torch.arange(R, dtype=torch.int32, device=DEV)
    for j in range(5):
        ctx = torch.full((R,), start + j, dtype=torch.int64, device=DEV)
        roots = replay.continuation[slots.long(), ctx].clamp(min=0)
        forests = []
        for flag in ("1", "0"):
            monkeypatch.setenv("BOLE_REPLAY_KERNEL", flag)
            forests.append(TreeGrowth(R, topk, depth, 12, device=DEV).grow(
                roots, torch.full((R,), depth, device=DEV), replay.step_fn(slots, ctx, topk)))
        a, b = forests
        for x, y in ((a.tokens, b.tokens), (a.rho, b.rho), (a.source, b.source),
                     (a.forest.parents, b.forest.parents), (a.forest.valid, b.forest.valid),
                     (a.table.tokens, b.table.tokens), (a.table.rho, b.table.rho)):
            assert torch.equal(x, y)
        assert bool(a.forest.valid.sum() > R)           # the trees grew past their roots
