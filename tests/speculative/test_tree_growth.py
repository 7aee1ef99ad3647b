"""Fixed-shape EAGLE-2 tree growth on the device against the host's ``build_draft_trees``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bole.speculative.drafters.host_growth import build_draft_trees
from bole.forest import DenseForest
from bole.speculative.tree_growth import (DraftForest, NodeTable, TreeGrowth, node_capacity,
                                           step_slots)
from tests.kernel_utils import DEV
from tests.no_sync import forbid_host_sync


# ---- a deterministic fake drafter shared by both growths ----
class FakeDrafter:
    """Proposals as a function of (request, path tokens from the root).

    Logits are drawn from a generator seeded by a hash of (seed, request, path) and quantised to
    a few levels, so that equal probabilities (and equal rho) occur and pin the tie-breaking.
    With ``sparse`` a path has a pseudo-random number (0..topk) of proposals."""

    def __init__(self, seed: int, vocab: int = 10, levels: int = 3, sparse: bool = False):
        self.seed, self.vocab, self.levels, self.sparse = seed, vocab, levels, sparse

    def proposals(self, request: int, path, k: int) -> list[tuple[int, float]]:
        g = torch.Generator().manual_seed(hash((self.seed, request, tuple(path))) % 2**31)
        logits = torch.randint(0, self.levels, (self.vocab,), generator=g).float()
        top = torch.topk(torch.softmax(logits, 0), k)                     # float32, descending
        n = int(torch.randint(0, k + 1, (1,), generator=g)) if self.sparse else k
        return [(int(t), float(p)) for t, p in zip(top.indices[:n], top.values[:n])]

    def expand_batch(self, paths_per_request, k):
        """The host's batch expander."""
        return [[self.proposals(r, p, k) for p in paths]
                for r, paths in enumerate(paths_per_request)]


def node_path(table: NodeTable, r: int, node: int) -> list[int]:
    """Tokens from the root to ``node`` of request ``r`` (test code: host loops are fine)."""
    out = []
    while node >= 0:
        out.append(int(table.tokens[r, node]))
        node = int(table.parents[r, node])
    return out[::-1]


def device_step(drafter: FakeDrafter, topk: int, calls: list | None = None):
    """A ``step_fn`` that asks ``drafter`` for each frontier node's path; records
    ``(step, request, frontier rank, path)`` in ``calls``. Rows of -1 frontier slots get garbage
    that the growth must ignore; missing proposals are token -1 with a NaN probability."""
    def step_fn(step, frontier, table):
        R, K = frontier.shape
        assert K == (1 if step == 0 else topk)
        tokens = torch.full((R, K, topk), -1, dtype=torch.int64)
        probs = torch.full((R, K, topk), float("nan"), dtype=torch.float32)
        for r in range(R):
            for f in range(K):
                node = int(frontier[r, f])
                if node < 0:
                    tokens[r, f], probs[r, f] = 1, 0.9                  # must be ignored
                    continue
                assert bool(table.live[r, node]) and int(table.depth[r, node]) == step
                path = node_path(table, r, node)
                if calls is not None:
                    calls.append((step, r, f, path))
                for j, (t, p) in enumerate(drafter.proposals(r, path, topk)):
                    tokens[r, f, j], probs[r, f, j] = t, p
        return tokens, probs
    return step_fn


def grow_on(impl: str, R: int, topk: int, depth: int, budget: int, roots, limits, step_fn):
    """Grow with ``impl`` ("triton" on the GPU when there is one, else under the interpreter);
    the result comes back on the CPU."""
    device = DEV if impl == "triton" else "cpu"
    out = TreeGrowth(R, topk, depth, budget, device=device, impl=impl).grow(
        torch.as_tensor(roots), torch.as_tensor(limits), step_fn)
    f, t = out.forest, out.table
    return DraftForest(out.tokens.cpu(), out.rho.cpu(), out.source.cpu(),
                       DenseForest(f.parents.cpu(), f.valid.cpu(), f.depth.cpu(),
                                   f.ancestors.cpu(), f.max_depth),
                       NodeTable(*(getattr(t, n).cpu() for n in
                                   ("tokens", "parents", "depth", "rho", "live", "ancestors"))))


def assert_same_as_host(out, host, budget: int) -> None:
    """Device trees == host trees: tokens, parents, rho, order; padding after them."""
    for r, res in enumerate(host):
        n = res.tree.num_nodes
        assert out.valid[r].tolist() == [True] * n + [False] * (budget - n)
        assert out.tokens[r, :n].tolist() == res.tokens.tolist()
        assert out.parents[r, :n].tolist() == res.tree.parents.tolist()
        assert torch.equal(out.rho[r, :n], res.rho)
        assert out.parents[r, n:].eq(-1).all() and out.source[r, n:].eq(-1).all()
        # source maps kept nodes back to the table
        src = out.source[r, :n]
        assert torch.equal(out.table.tokens[r, src], out.tokens[r, :n])
        assert torch.equal(out.table.rho[r, src], out.rho[r, :n])
        assert torch.equal(out.table.depth[r, src], out.depth[r, :n])


def growth_cases(max_requests: int, max_depth: int, levels: list[int], examples: int):
    """Hypothesis cases of a growth: requests, top-k, depth, budget slack, proposals' sparsity and
    probability levels (few levels: many ties)."""
    cases = given(seed=st.integers(0, 10_000), R=st.integers(1, max_requests),
                  topk=st.integers(1, 4), depth=st.integers(0, max_depth),
                  extra=st.integers(0, 4), data=st.data(), sparse=st.booleans(),
                  levels=st.sampled_from(levels))
    return lambda test: settings(max_examples=examples)(cases(test))


@growth_cases(4, 6, [2, 3, 50], examples=300)
def test_device_growth_equals_host(seed, R, topk, depth, extra, data, sparse, levels):
    _growth_equals_host(seed, R, topk, depth, extra, data, sparse, levels, "torch")


@growth_cases(3, 4, [1, 2, 50], examples=40)
def test_fused_step_growth_equals_host(seed, R, topk, depth, extra, data, sparse, levels):
    """The one-launch-per-step kernel (under the interpreter on CPU) builds the host's trees."""
    _growth_equals_host(seed, R, topk, depth, extra, data, sparse, levels, "triton")


def _growth_equals_host(seed, R, topk, depth, extra, data, sparse, levels, impl):
    capacity = node_capacity(topk, depth)
    budget = data.draw(st.integers(1, capacity + extra), label="budget")
    limits = data.draw(st.lists(st.integers(0, depth), min_size=R, max_size=R), label="limits")
    roots = data.draw(st.lists(st.integers(0, 9), min_size=R, max_size=R), label="roots")
    drafter = FakeDrafter(seed, levels=levels, sparse=sparse)
    host = build_draft_trees(roots, drafter.expand_batch, depths=limits, topk=topk, budget=budget)
    out = grow_on(impl, R, topk, depth, budget, roots, limits, device_step(drafter, topk))
    assert out.tokens.shape == (R, budget) and out.table.tokens.shape == (R, capacity)
    assert_same_as_host(out, host, budget)
    assert out.forest.max_depth == depth


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_lone_roots_and_clamped_limits(impl):
    drafter = FakeDrafter(3)
    calls = []
    out = grow_on(impl, 2, 2, 3, 1, [4, 5], [3, 3], device_step(drafter, 2, calls))
    assert not calls and out.tokens.tolist() == [[4], [5]] and out.parents.tolist() == [[-1], [-1]]
    # limits beyond depth act as depth, negative ones as 0
    out = grow_on(impl, 2, 2, 3, 20, [4, 5], [9, -2], device_step(drafter, 2))
    host = build_draft_trees([4, 5], drafter.expand_batch, depths=[3, 0], topk=2, budget=20)
    assert_same_as_host(out, host, 20)
    assert out.sizes().tolist() == [host[0].tree.num_nodes, 1]


@given(seed=st.integers(0, 10_000), topk=st.integers(1, 3), levels=st.sampled_from([2, 3, 50]))
@settings(max_examples=25)
def test_frontier_is_the_topk_best_of_the_previous_step(seed, topk, levels):
    """Rebuild the growth from the expander's calls alone: at every step the expanded nodes are
    the topk best (rho, then creation order) of the nodes created at the previous step, in that
    order, and the topk worst of them are never expanded."""
    R, depth, limits = 3, 4, [4, 2, 3]
    drafter, calls = FakeDrafter(seed, levels=levels), []
    TreeGrowth(R, topk, depth, budget=100).grow(torch.tensor([1, 2, 3]), torch.tensor(limits),
                                               device_step(drafter, topk, calls))
    for r in range(R):
        rho = {(): 1.0}
        created: list[tuple] = []            # paths created at the previous step, in creation order
        for step in range(depth):
            expanded = [tuple(p) for s, q, _, p in sorted(calls) if s == step and q == r]
            if step >= limits[r]:
                assert not expanded
                continue
            if step == 0:
                assert len(expanded) == 1 and len(expanded[0]) == 1
                rho[expanded[0]] = 1.0
            else:
                ranked = sorted(range(len(created)), key=lambda i: (-rho[created[i]], i))
                best = [created[i] for i in ranked[:topk]]
                worst = {created[i] for i in ranked[-topk:]} - set(best)
                assert expanded == best
                assert not worst & set(expanded)
            created = []
            for path in expanded:                          # frontier order, then proposal rank
                for tok, p in drafter.proposals(r, list(path), topk):
                    rho[path + (tok,)] = rho[path] * p
                    created.append(path + (tok,))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_ancestors_table(impl):
    drafter, topk, seen = FakeDrafter(7, levels=2, sparse=True), 3, []
    inner = device_step(drafter, topk)

    def step_fn(step, frontier, table):                # what the drafter sees at each step
        seen.append((step, table.ancestors.cpu().clone(), table.live.cpu().clone(),
                     table.parents.cpu().clone()))
        return inner(step, frontier, table)

    out = grow_on(impl, 3, topk, 4, 30, [0, 1, 2], [4, 3, 1], step_fn)
    C, t = out.table.capacity, out.table
    dead = ~t.live
    assert t.live[:, 0].all() and not t.live[:, 0].logical_and(t.parents[:, 0] >= 0).any()
    assert (t.tokens[dead] == 0).all() and (t.parents[dead] == -1).all()
    assert (t.depth[dead] == 0).all() and (t.rho[dead] == 0).all()
    seen.append((4, out.table.ancestors, out.table.live, out.table.parents))
    for step, anc, live, parents in seen:
        assert not live[:, step_slots(topk, step)[0]:].any()       # later slots not yet created
        for r in range(3):
            for i in range(C):
                want, node = set(), i
                while node >= 0 and live[r, i]:
                    want.add(node)
                    node = int(parents[r, node])
                want = want or {i}                                 # slots not created: self only
                assert set(anc[r, i].nonzero().flatten().tolist()) == want
    # the kept forest's ancestors are the table's, restricted to the kept nodes
    for r in range(3):
        n = int(out.valid[r].sum())
        src = out.source[r, :n]
        assert torch.equal(out.forest.ancestors[r, :n, :n], out.table.ancestors[r][src][:, src])


def test_bad_arguments():
    for kwargs, word in [(dict(topk=0), "topk"), (dict(depth=-1), "depth"),
                         (dict(budget=0), "budget"), (dict(num_requests=0), "num_requests")]:
        args = dict(num_requests=2, topk=2, depth=3, budget=5) | kwargs
        with pytest.raises(ValueError, match=word):
            TreeGrowth(**args)
    g = TreeGrowth(2, 2, 3, 5)
    step = device_step(FakeDrafter(0), 2)
    with pytest.raises(ValueError, match="roots"):
        g.grow(torch.tensor([1, 2, 3]), torch.tensor([3, 3]), step)
    with pytest.raises(ValueError, match="depth_limit"):
        g.grow(torch.tensor([1, 2]), torch.tensor([[3, 3]]), step)
    with pytest.raises(TypeError, match="roots"):
        g.grow(torch.tensor([1.0, 2.0]), torch.tensor([3, 3]), step)
    with pytest.raises(ValueError, match="step_fn"):
        g.grow(torch.tensor([1, 2]), torch.tensor([3, 3]),
               lambda s, f, t: (torch.zeros(2, 1, 3, dtype=torch.int64), torch.zeros(2, 1, 3)))


# ---- a tensor-only drafter: no host synchronisation anywhere ----
VOCAB, WEIGHT = 8, 11


def _proposals_from_hash(h: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``h [...]`` int64 path hashes -> (tokens, probs) ``[..., topk]``: dyadic probabilities
    (exact in float32) with ties, tokens in descending probability (stable: lower token first)."""
    v = torch.arange(VOCAB, device=h.device)
    code = (h[..., None] * 2654435761 + v * 40503) % 1009 % 4                # 0..3, many ties
    probs = (code + 1).to(torch.float32) / 8
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :topk]
    return order, torch.gather(probs, -1, order)


def tensor_step(topk: int):
    """A ``step_fn`` without host synchronisation: the path hash is sum over the path of
    ``(token + 1) * WEIGHT**depth``, read off the ancestors table."""
    def step_fn(step, frontier, table):
        R, K = frontier.shape
        weight = WEIGHT ** table.depth                                           # [R, C]
        term = (table.tokens + 1) * weight * table.live
        safe = frontier.clamp(min=0)
        anc = torch.gather(table.ancestors, 1, safe[:, :, None].expand(R, K, table.capacity))
        request = torch.arange(R, device=frontier.device)[:, None]
        h = (anc * term[:, None, :]).sum(-1) + 1000 * request                   # [R, K]
        return _proposals_from_hash(h, topk)
    return step_fn


def host_expander(topk: int):
    def expand_batch(paths_per_request, k):
        out = []
        for r, paths in enumerate(paths_per_request):
            hashes = [sum((t + 1) * WEIGHT ** d for d, t in enumerate(p)) + 1000 * r for p in paths]
            tok, prob = _proposals_from_hash(torch.tensor(hashes, dtype=torch.int64), k)
            out.append([list(zip(t, p)) for t, p in zip(tok.tolist(), prob.tolist())])
        return out
    return expand_batch


def test_grow_has_no_host_synchronisation(monkeypatch):
    R, topk, depth, budget = 3, 3, 4, 16
    roots, limits = torch.tensor([1, 5, 7]), torch.tensor([4, 1, 3])

    with monkeypatch.context() as m:
        forbid_host_sync(m)
        out = TreeGrowth(R, topk, depth, budget).grow(roots, limits, tensor_step(topk))
    host = build_draft_trees(roots.tolist(), host_expander(topk), depths=limits.tolist(),
                             topk=topk, budget=budget)
    assert_same_as_host(out, host, budget)


def to_cpu(out):
    """A DraftForest's tensors on the CPU."""
    table = NodeTable(*(t.cpu() for t in vars(out.table).values()))
    forest = DenseForest.from_parents(out.parents.cpu(), out.valid.cpu(), out.forest.max_depth)
    return DraftForest(out.tokens.cpu(), out.rho.cpu(), out.source.cpu(), forest, table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
@pytest.mark.parametrize("R,topk,depth,budget", [(4, 3, 5, 24), (3, 1, 4, 3), (2, 4, 3, 60),
                                                 (5, 2, 6, 1), (1, 3, 0, 4)])
def test_grow_captures_in_a_cuda_graph(R, topk, depth, budget):
    """Eager on CUDA without synchronisation, then captured and replayed on new inputs: both equal
    the host growth."""
    dev = torch.device("cuda")
    growth, step = TreeGrowth(R, topk, depth, budget, device=dev), tensor_step(topk)
    gen = torch.Generator().manual_seed(R * 100 + depth)
    roots = torch.randint(0, VOCAB, (R,), generator=gen).to(dev)
    limits = torch.randint(0, depth + 1, (R,), generator=gen).to(dev)

    def check(out):
        host = build_draft_trees(roots.tolist(), host_expander(topk), depths=limits.tolist(),
                                 topk=topk, budget=budget)
        assert_same_as_host(to_cpu(out), host, budget)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            eager = growth.grow(roots, limits, step)                 # warm-up, no syncs
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = growth.grow(roots, limits, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    check(eager)
    for _ in range(3):
        roots.copy_(torch.randint(0, VOCAB, (R,), generator=gen))
        limits.copy_(torch.randint(0, depth + 1, (R,), generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        check(captured)


def test_nan_and_out_of_range_probabilities():
    """A NaN probability is a missing proposal and others are clamped to [0, 1], in both
    implementations alike (the fused rerank once read unwritten scratch on such input)."""
    gen = torch.Generator().manual_seed(0)
    R, topk, depth, budget = 2, 3, 4, 12

    def step_fn(step, frontier, table):
        K = frontier.shape[1]
        probs = torch.rand(R, K, topk, generator=gen) * 1.6 - 0.1      # some < 0, some > 1
        probs[torch.rand(R, K, topk, generator=gen) < 0.2] = float("nan")
        tokens = torch.arange(topk).repeat(R, K, 1) + 10 * step
        return tokens, probs
    outs = {}
    for impl in ("torch", "triton"):
        gen.manual_seed(0)
        outs[impl] = grow_on(impl, R, topk, depth, budget, [1, 2], [4, 3], step_fn)
    a, b = outs["torch"], outs["triton"]
    for name in ("tokens", "rho", "source", "parents", "valid"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.isfinite(a.rho).all() and (a.rho <= 1).all() and (a.rho >= 0).all()
    # kept nodes hang from kept parents
    for r in range(R):
        n = int(a.valid[r].sum())
        assert (a.parents[r, 1:n] >= 0).all() and (a.parents[r, 1:n] < torch.arange(1, n)).all()
