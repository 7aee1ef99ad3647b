"""Batch-shared verification budget: node selection, compaction, profiles, the goodput policy."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bole.forest import DenseForest
from bole.models.presets import preset_config
from bole.speculative.budget.expected import (expected_accepted_curve, goodput_budget,
                                              goodput_choice, width_fill_choice,
                                              width_fill_could_widen, width_fill_curve,
                                              width_fill_keep)
from bole.speculative.budget.ranking import (compact, dense_inputs, rank_dense, rank_nodes,
                                             safe_width, select_dense, select_nodes)
from bole.speculative.budget.widths import width_capacity, width_priced_t_ver
from bole.speculative.budget.acceptance import (AcceptanceCalibrator, isotonic_fit,
                                                isotonic_fit_device)
from bole.speculative.budget.profile import (b_ver_from_curve, BudgetProfile, cache_dir,
                                             calibrate, config_hash, find_profile, FORMAT,
                                             plot_profile, profile_path, ProfileFormatError,
                                             runtime_versions, verification_budget)
from tests.no_sync import forbid_host_sync

LEVELS = (1.0, 0.5, 0.25, 0.125)        # few levels: equal rho (ties) across nodes and requests
NAN = float("nan")


# ---- packed forests with rho ----
@dataclasses.dataclass
class Forest:
    rho: list[float]
    parents: list[int]          # global, -1 for roots and padding
    request: list[int]          # -1 for padding

    def tensors(self):
        return (torch.tensor(self.rho, dtype=torch.float64),
                torch.tensor(self.parents, dtype=torch.int64),
                torch.tensor(self.request, dtype=torch.int64))


@st.composite
def packed_forests(draw, max_requests: int = 4, max_nodes: int = 10, rho_mode: str | None = None,
                   shuffle: bool = True) -> Forest:
    """Requests of 0 (padding only) to ``max_nodes`` nodes, each followed by padding slots.

    rho: ``monotone`` (products of few levels), ``equal`` (every draft node 0.5) or ``free``
    (levels and NaN in any order down a path). Optionally the whole node list is permuted, so
    that parents need not precede children."""
    mode = rho_mode or draw(st.sampled_from(("monotone", "monotone", "equal", "free")))
    rho, parents, request = [], [], []
    for r in range(draw(st.integers(1, max_requests))):
        base, n = len(rho), draw(st.integers(0, max_nodes))
        for i in range(n):
            p = -1 if i == 0 else base + draw(st.integers(0, i - 1))
            if i == 0:
                value = 1.0
            elif mode == "monotone":
                value = rho[p] * draw(st.sampled_from(LEVELS))
            elif mode == "equal":
                value = 0.5
            else:
                value = draw(st.sampled_from(LEVELS + (NAN, 0.0)))
            rho.append(value), parents.append(p), request.append(r)
        for _ in range(draw(st.integers(0, 2))):
            rho.append(draw(st.sampled_from((0.0, 0.9, NAN)))), parents.append(-1)
            request.append(-1)
    if shuffle and draw(st.booleans()) and rho:
        perm = draw(st.permutations(range(len(rho))))         # perm[new] = old
        new_of = {old: new for new, old in enumerate(perm)}
        rho = [rho[o] for o in perm]
        request = [request[o] for o in perm]
        parents = [-1 if parents[o] < 0 else new_of[parents[o]] for o in perm]
    return Forest(rho, parents, request)


# ---- the documented rule, by brute force ----
def structure(f: Forest):
    """(roots, draft nodes, score, depth) with plain Python walks up the tree."""
    N = len(f.rho)
    roots = [i for i in range(N) if f.request[i] >= 0 and f.parents[i] < 0]
    draft = [i for i in range(N) if f.request[i] >= 0 and f.parents[i] >= 0]
    score, depth = {}, {}
    for i in draft:
        node, values = i, []
        while f.parents[node] >= 0:
            values.append(-math.inf if math.isnan(f.rho[node]) else f.rho[node])
            node = f.parents[node]
        score[i], depth[i] = min(values), len(values)
    return roots, draft, score, depth


def brute_select(f: Forest, budget: int, root_floor: int) -> set[int]:
    roots, draft, score, depth = structure(f)
    key = lambda i: (-score[i], depth[i], i)  # noqa: E731
    floors = set()
    for r in roots:
        floors |= set(sorted((c for c in draft if f.parents[c] == r), key=key)[:root_floor])
    rest = sorted((i for i in draft if i not in floors), key=key)
    return set(roots) | floors | set(rest[:max(budget - len(floors), 0)])


def kept_set(keep: torch.Tensor) -> set[int]:
    return {i for i, k in enumerate(keep.tolist()) if k}


# ---- select_nodes ----
@given(f=packed_forests(), data=st.data())
@settings(max_examples=400)
def test_select_nodes_matches_brute_force(f, data):
    rho, parents, request = f.tensors()
    roots, draft, score, depth = structure(f)
    budget = data.draw(st.integers(-1, len(draft) + 3), label="budget")
    root_floor = data.draw(st.integers(0, 3), label="root_floor")
    as_tensor = data.draw(st.booleans(), label="tensor budget")
    b = torch.tensor(budget) if as_tensor else budget
    keep = select_nodes(rho, parents, request, b, root_floor)
    got = kept_set(keep)
    assert keep.dtype == torch.bool and keep.shape == rho.shape
    assert got == brute_select(f, budget, root_floor)
    # the same with the exact depth bound (fewer pointer-jumping steps)
    bound = max(depth.values(), default=0)
    assert torch.equal(select_nodes(rho, parents, request, b, root_floor, max_depth=bound), keep)
    # ancestor-closed; roots kept, padding never
    assert all(f.parents[i] in got for i in got if f.parents[i] >= 0)
    assert set(roots) <= got and all(f.request[i] >= 0 for i in got)
    # floors held; the count: the budget filled, or the floors alone when they exceed it
    floors = 0
    for r in roots:
        children = [c for c in draft if f.parents[c] == r]
        want = min(root_floor, len(children))
        assert sum(c in got for c in children) >= want
        floors += want
    kept_draft = len(got) - len(roots)
    if floors <= max(budget, 0):
        assert kept_draft == min(max(budget, 0), len(draft))
    else:
        assert kept_draft == floors


@given(f=packed_forests(rho_mode="monotone"), data=st.data())
@settings(max_examples=200)
def test_select_nodes_is_a_global_top_k_when_the_floors_are_in_it(f, data):
    """With monotone rho the kept draft nodes are the top-budget nodes by (-rho, depth, index)
    whenever that top-budget already holds the floors."""
    rho, parents, request = f.tensors()
    roots, draft, _, depth = structure(f)
    budget = data.draw(st.integers(0, len(draft) + 1))
    root_floor = data.draw(st.integers(0, 2))
    top = set(sorted(draft, key=lambda i: (-f.rho[i], depth[i], i))[:budget])
    floors_in_top = all(
        sum(c in top for c in draft if f.parents[c] == r)
        >= min(root_floor, sum(f.parents[c] == r for c in draft)) for r in roots)
    keep = kept_set(select_nodes(rho, parents, request, budget, root_floor))
    if floors_in_top:
        assert keep == set(roots) | top


def run(rho, parents, request, budget, root_floor=1):
    keep = select_nodes(torch.tensor(rho, dtype=torch.float64),
                        torch.tensor(parents, dtype=torch.int64),
                        torch.tensor(request, dtype=torch.int64), budget, root_floor)
    return kept_set(keep)


def test_padding_only_and_empty_requests():
    assert run([0.5, 0.5], [-1, -1], [-1, -1], 5) == set()
    assert run([], [], [], 3) == set()
    # request 0 has no nodes at all, request 1 is padding slots plus a root and a child
    assert run([0.0, 1.0, 0.4, 0.0], [-1, -1, 1, -1], [-1, 1, 1, -1], 0) == {1, 2}


def test_one_request():
    #      0 -> 1 (0.6) -> 3 (0.3)
    #        -> 2 (0.4) -> 4 (0.2)
    rho, parents, req = [1, 0.6, 0.4, 0.3, 0.2], [-1, 0, 0, 1, 2], [0] * 5
    assert run(rho, parents, req, 0) == {0, 1}
    assert run(rho, parents, req, 2) == {0, 1, 2}
    assert run(rho, parents, req, 3) == {0, 1, 2, 3}
    assert run(rho, parents, req, 9) == {0, 1, 2, 3, 4}
    assert run(rho, parents, req, 0, root_floor=0) == {0}
    assert run(rho, parents, req, 1, root_floor=2) == {0, 1, 2}


def test_budget_below_the_floors():
    # three requests, each a root with children of rho 0.9 and 0.1; floor 2 = 6 > budget 1
    rho = [1, 0.1, 0.9] * 3
    parents = [-1, 0, 0, -1, 3, 3, -1, 6, 6]
    req = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert run(rho, parents, req, 1, root_floor=2) == set(range(9))
    assert run(rho, parents, req, 1, root_floor=1) == {0, 2, 3, 5, 6, 8}
    assert run(rho, parents, req, 4, root_floor=1) == {0, 2, 3, 5, 6, 8, 1}
    assert run(rho, parents, req, 0, root_floor=0) == {0, 3, 6}


def test_all_equal_rho_breaks_ties_parent_first_then_by_index():
    # request 0: chain 0 -> 1 -> 2; request 1: 3 -> 4, 3 -> 5; every draft node rho 0.5
    rho, parents, req = [1, .5, .5, 1, .5, .5], [-1, 0, 1, -1, 3, 3], [0, 0, 0, 1, 1, 1]
    # floors 1 and 4; then depth 1 before depth 2: node 5 (depth 1) beats node 2 (depth 2)
    assert run(rho, parents, req, 3) == {0, 3, 1, 4, 5}
    assert run(rho, parents, req, 4) == set(range(6))
    # no floors: depth-1 nodes by index
    assert run(rho, parents, req, 2, root_floor=0) == {0, 3, 1, 4}


def test_ties_across_requests():
    # two identical requests; equal rho at equal depth goes to the smaller index
    rho = [1, 0.5, 0.5, 0.25] * 2
    parents = [-1, 0, 0, 1, -1, 4, 4, 5]
    req = [0] * 4 + [1] * 4
    assert run(rho, parents, req, 0, root_floor=0) == {0, 4}
    assert run(rho, parents, req, 3, root_floor=0) == {0, 4, 1, 2, 5}
    assert run(rho, parents, req, 5, root_floor=0) == {0, 4, 1, 2, 5, 6, 3}
    # a permuted node list changes the index tie-break only
    assert run(rho[4:] + rho[:4], [-1, 0, 0, 1, -1, 4, 4, 5], req, 3, root_floor=0) \
        == {0, 4, 1, 2, 5}


def test_budget_as_a_tensor():
    rho, parents, req = [1, 0.6, 0.4, 0.3, 0.2], [-1, 0, 0, 1, 2], [0] * 5
    for b in range(6):
        assert run(rho, parents, req, torch.tensor(b)) == run(rho, parents, req, b)
    assert run(rho, parents, req, torch.tensor(2.0)) == {0, 1, 2}
    with pytest.raises(ValueError, match="0-d"):
        run(rho, parents, req, torch.tensor([2]))
    with pytest.raises(TypeError, match="budget"):
        run(rho, parents, req, 2.5)


def test_rho_increasing_down_a_path_ranks_by_the_path_minimum():
    # 0 -> 1 (0.1) -> 2 (0.9); 0 -> 3 (0.5): node 2 scores 0.1, so never before node 1
    rho, parents, req = [1, 0.1, 0.9, 0.5], [-1, 0, 1, 0], [0] * 4
    assert run(rho, parents, req, 1, root_floor=0) == {0, 3}
    assert run(rho, parents, req, 2, root_floor=0) == {0, 3, 1}
    assert run(rho, parents, req, 3, root_floor=0) == {0, 1, 2, 3}
    score = rank_nodes(torch.tensor(rho, dtype=torch.float64), torch.tensor(parents),
                       torch.tensor(req)).score
    assert score[1:].tolist() == [0.1, 0.1, 0.5]


def test_malformed_inputs_are_named():
    r, p, q = torch.ones(3), torch.tensor([-1, 0, 0]), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"must all be \[N\]"):
        select_nodes(r, p[:2], q, 1)
    with pytest.raises(TypeError, match="int64"):
        select_nodes(r, p.int(), q, 1)
    with pytest.raises(ValueError, match="root_floor"):
        select_nodes(r, p, q, 1, root_floor=-1)


# ---- the dense layout ----
@st.composite
def dense_forests(draw, max_rows: int = 4, max_nodes: int = 8):
    """``(rho [R, T], DenseForest, tokens [R, T])``, rows topologically ordered."""
    R, T = draw(st.integers(1, max_rows)), draw(st.integers(1, max_nodes))
    parents = torch.full((R, T), -1, dtype=torch.int64)
    valid = torch.zeros(R, T, dtype=torch.bool)
    rho = torch.zeros(R, T, dtype=torch.float64)
    for r in range(R):
        n = draw(st.integers(1, T))
        valid[r, :n] = True
        rho[r, 0] = 1.0
        for i in range(1, n):
            parents[r, i] = draw(st.integers(0, i - 1))
            rho[r, i] = rho[r, parents[r, i]] * draw(st.sampled_from(LEVELS))
    tokens = torch.arange(R * T).view(R, T) + 100
    return rho, DenseForest.from_parents(parents, valid, max_depth=max(T - 1, 0)), tokens


@given(case=dense_forests(), data=st.data())
@settings(max_examples=150)
def test_select_dense_is_select_nodes_on_the_flat_layout(case, data):
    rho, forest, _ = case
    R, T = rho.shape
    budget, floor = data.draw(st.integers(0, R * T)), data.draw(st.integers(0, 2))
    active = torch.tensor(data.draw(st.lists(st.booleans(), min_size=R, max_size=R)))
    keep = select_dense(rho, forest, budget, floor)
    want = select_nodes(rho.reshape(-1), forest.parent_global(),
                        torch.where(forest.valid, torch.arange(R)[:, None], -1).reshape(-1),
                        budget, floor)
    assert torch.equal(keep, want.view(R, T))
    flat_parents, request = dense_inputs(forest, active)
    assert torch.equal(flat_parents, forest.parent_global())
    assert torch.equal(request.view(R, T) >= 0, forest.valid & active[:, None])
    # inactive rows keep their root only and take no budget: as if only the active rows existed
    partial = select_dense(rho, forest, budget, floor, active=active)
    assert torch.equal(partial[~active], forest.valid[~active] & (torch.arange(T) == 0))
    if active.any():
        sub = DenseForest.from_parents(forest.parents[active], forest.valid[active],
                                       forest.max_depth)
        assert torch.equal(partial[active], select_dense(rho[active], sub, budget, floor))


def dense_structure(rho, forest, active):
    """``(forest as a packed Forest, roots, draft nodes, score, rank key)`` of a dense forest
    whose inactive rows are padding (plain Python)."""
    R, T = rho.shape
    f = Forest(rho.reshape(-1).tolist(), forest.parent_global().tolist(),
               [r if forest.valid[r, i] and active[r] else -1 for r in range(R) for i in range(T)])
    roots, draft, score, depth = structure(f)
    return f, roots, draft, score, lambda i: (-score[i], depth[i], i)


def brute_capped_select(rho, forest, floor, active, budget, width):
    """The roots, the floors, then draft nodes of the whole batch in the documented rank order,
    skipping those whose row already holds ``width - 1`` draft nodes, until the budget (floors
    counted) is spent (plain Python)."""
    R, T = rho.shape
    f, roots, draft, _, key = dense_structure(rho, forest, active)
    floors = set()
    for r in roots:
        floors |= set(sorted((c for c in draft if f.parents[c] == r), key=key)[:floor])
    held = {r // T: sum(1 for c in floors if c // T == r // T) for r in roots}
    kept, left = set(roots) | floors, budget - len(floors)
    for i in sorted((i for i in draft if i not in floors), key=key):
        if left <= 0:
            break
        if held[i // T] < width - 1:
            kept.add(i)
            held[i // T] += 1
            left -= 1
    return kept | {r * T for r in range(R) if forest.valid[r, 0] and not active[r]}


@given(case=dense_forests(), data=st.data())
@settings(max_examples=300)
def test_row_capped_selection_matches_brute_force(case, data):
    """select_dense with a row width: the batch's budget taken in rank order among the nodes each
    row can hold at that width (floors kept whatever the width); ancestor-closed, within the
    budget, and equal to each row's fill when the budget covers every row's room."""
    rho, forest, _ = case
    R, T = rho.shape
    floor = data.draw(st.integers(0, 2))
    budget = data.draw(st.integers(0, R * T))
    width = data.draw(st.integers(1, max(T, 1)))
    active = torch.tensor(data.draw(st.lists(st.booleans(), min_size=R, max_size=R)))
    keep = select_dense(rho, forest, budget, floor, active=active, row_width=width)
    want = brute_capped_select(rho, forest, floor, active.tolist(), budget, width)
    got = kept_set(keep.reshape(-1))
    assert got == want, (sorted(got), sorted(want))
    parents = forest.parent_global().tolist()
    assert all(parents[i] < 0 or parents[i] in got for i in got)          # ancestor-closed
    rank = rank_dense(rho, forest, floor, active)
    if budget >= R * T:                                 # the budget never binds: each row's fill
        filled = width_fill_keep(rank, R, torch.tensor(width))
        filled[:, 0] |= forest.valid[:, 0] & ~active
        assert torch.equal(keep, filled)
    assert torch.equal(select_dense(rho, forest, budget, floor, active=active, row_width=T),
                       select_dense(rho, forest, budget, floor, active=active))


@given(case=dense_forests(), data=st.data())
@settings(max_examples=150)
def test_compact_moves_kept_nodes_to_the_front(case, data):
    rho, forest, tokens = case
    R, T = rho.shape
    budget, floor = data.draw(st.integers(0, R * T)), data.draw(st.integers(0, 2))
    keep = select_dense(rho, forest, budget, floor)
    width = data.draw(st.integers(1, T + 2))
    out = compact(keep, tokens, forest.parents, width)
    assert out.tokens.shape == (R, width)
    for r in range(R):
        kept = [i for i in range(T) if keep[r, i]][:width]
        n = len(kept)
        assert out.valid[r].tolist() == [True] * n + [False] * (width - n)
        assert out.source[r, :n].tolist() == kept and (out.source[r, n:] == -1).all()
        assert out.tokens[r, :n].tolist() == tokens[r, kept].tolist()
        assert out.gather(rho, 0.0)[r, :n].tolist() == rho[r, kept].tolist()
        assert (out.tokens[r, n:] == 0).all() and (out.parents[r, n:] == -1).all()
        for j in range(n):
            p = int(out.parents[r, j])
            old = int(forest.parents[r, kept[j]])
            assert p < j                                          # parents before children
            assert (p == -1 and old == -1) or kept[p] == old      # the same parent
    cf = out.forest(forest.max_depth)
    assert torch.equal(cf.valid, out.valid)
    # a width from safe_width never drops a node
    w = safe_width(T, budget, floor)
    assert out.valid.sum() == keep.sum() or width < w
    assert compact(keep, tokens, forest.parents, w).valid.sum() == keep.sum()


def test_compact_gathers_trailing_dimensions():
    keep = torch.tensor([[True, False, True]])
    out = compact(keep, torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 0]]), 2)
    hidden = torch.arange(6.).view(1, 3, 2)
    assert out.gather(hidden).tolist() == [[[0., 1.], [4., 5.]]]
    assert out.parents.tolist() == [[-1, 0]] and out.tokens.tolist() == [[5, 7]]


# ---- no host synchronisation ----


def test_no_host_synchronisation(monkeypatch):
    f = Forest([1, 0.6, 0.4, 0.3, 0.0, 1, 0.5, 0.5], [-1, 0, 0, 1, -1, -1, 5, 6],
               [0, 0, 0, 0, -1, 1, 1, 1])
    rho, parents, req = f.tensors()
    R, T = 2, 4
    dense = DenseForest.from_parents(torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]]),
                                     torch.tensor([[True] * 4, [True] * 3 + [False]]), 3)
    drho = torch.tensor([[1, .6, .4, .3], [1, .5, .5, 0]], dtype=torch.float64)
    grid = torch.tensor([1, 2, 4])
    calib = AcceptanceCalibrator.log_bins(8)
    with monkeypatch.context() as m:
        forbid_host_sync(m)
        a = select_nodes(rho, parents, req, 2)
        b = select_nodes(rho, parents, req, torch.tensor(3))
        keep = select_dense(drho, dense, torch.tensor(2), 1, active=torch.tensor([True, False]))
        out = compact(keep, torch.arange(R * T).view(R, T), dense.parents, 3)
        curve = expected_accepted_curve(rho, parents, req, grid, acceptance=calib)
        budget, use_ar = goodput_budget(grid, curve, torch.tensor([1.0, 1.1, 1.5]), 1.0, 2)
        rank = rank_dense(drho, dense, 1)
        filled = width_fill_curve(rank, R, torch.tensor([2, 4]), acceptance=calib)
        kept = width_fill_keep(rank, R, torch.tensor(2))
        choice = width_fill_choice(rank, R, torch.tensor([2, 4]),
                                   torch.tensor([1.0, 1.5], dtype=torch.float64),
                                   acceptance=calib, round_overhead_ms=torch.tensor(0.5))
        calib.observe(rho, torch.ones(8, dtype=torch.bool), mask=parents >= 0)
        calib(rho)
    assert kept_set(a) == brute_select(f, 2, 1) and kept_set(b) == brute_select(f, 3, 1)
    assert out.valid.tolist() == [[True, True, True], [True, False, False]]
    assert budget.dim() == 0 and use_ar.dtype == torch.bool
    assert filled.shape == (2,) and kept.sum(1).tolist() == [2, 2]
    assert choice.width.dim() == 0 and choice.keep.shape == (R, T)
    assert choice.kept.shape == (R,) and choice.could_widen.dtype == torch.bool


# ---- the goodput policy ----
@given(f=packed_forests(), data=st.data())
@settings(max_examples=150)
def test_expected_accepted_curve_matches_brute_force(f, data):
    rho, parents, request = f.tensors()
    roots, draft, score, _ = structure(f)
    floor = data.draw(st.integers(0, 2))
    grid = sorted(set(data.draw(st.lists(st.integers(0, len(draft) + 2), min_size=1,
                                         max_size=5))))
    square = data.draw(st.booleans())
    acceptance = (lambda s: s * s) if square else None
    curve = expected_accepted_curve(rho, parents, request, grid, floor, acceptance=acceptance)
    for g, n in enumerate(grid):
        kept = brute_select(f, n, floor) - set(roots)
        est = [min(max(score[i], 0.0), 1.0) for i in kept]
        want = len(roots) + sum(e * e if square else e for e in est)
        assert curve[g].item() == pytest.approx(want, abs=1e-12)


def brute_width_fill(rho, forest, floor, active, width):
    """Each active row's root, floors and best ``width - 1 - floors`` other draft nodes, by the
    documented rank order within the row (plain Python); the inactive rows' roots."""
    R, T = rho.shape
    f, roots, draft, score, key = dense_structure(rho, forest, active)
    kept = set()
    for r in roots:
        row = [i for i in draft if i // T == r // T]
        floors = set(sorted((c for c in row if f.parents[c] == r), key=key)[:floor])
        rest = sorted((i for i in row if i not in floors), key=key)
        kept |= {r} | floors | set(rest[:max(width - 1 - len(floors), 0)])
    kept |= {r * T for r in range(R) if forest.valid[r, 0] and not active[r]}
    return kept, [min(max(score[i], 0.0), 1.0) for i in kept if i in score], len(roots)


@given(case=dense_forests(), data=st.data())
@settings(max_examples=200)
def test_width_fill_matches_brute_force(case, data):
    """At each width every active row keeps its floors and then its best draft nodes in rank
    order until the width is full: the kept set, its expected tokens, and ancestor closure."""
    rho, forest, _ = case
    R, T = rho.shape
    floor = data.draw(st.integers(0, 2))
    active = torch.tensor(data.draw(st.lists(st.booleans(), min_size=R, max_size=R)))
    widths = sorted(set(data.draw(st.lists(st.integers(1, T), min_size=0, max_size=3))) | {T})
    square = data.draw(st.booleans())
    acceptance = (lambda s: s * s) if square else None
    rank = rank_dense(rho, forest, floor, active)
    curve = width_fill_curve(rank, R, torch.tensor(widths), acceptance=acceptance)
    parents = forest.parent_global().tolist()
    for w, width in enumerate(widths):
        keep = width_fill_keep(rank, R, torch.tensor(width))
        keep[:, 0] |= forest.valid[:, 0] & ~active
        want, est, roots = brute_width_fill(rho, forest, floor, active.tolist(), width)
        got = kept_set(keep.reshape(-1))
        assert got == want, (width, sorted(got), sorted(want))
        assert all(parents[i] < 0 or parents[i] in got for i in got)      # ancestor-closed
        assert curve[w].item() == pytest.approx(roots + sum(e * e if square else e for e in est),
                                                abs=1e-12)


@given(case=dense_forests(), data=st.data())
@settings(max_examples=300)
def test_could_widen_matches_brute_force(case, data):
    """could_widen by plain Python: per active row its floors, its eligible nodes in rank order,
    the fill at the chosen width, and the bound on what lies past it (the last kept node's
    estimate, else the best floor's, else 1), which is at least every node past the fill (what
    makes it safe to skip exploring). width_fill_choice's width is the best rate of the curve
    and its keep the fill at that width."""
    rho, forest, _ = case
    R, T = rho.shape
    floor = data.draw(st.integers(0, 2))
    active = data.draw(st.lists(st.booleans(), min_size=R, max_size=R))
    widths = sorted(set(data.draw(st.lists(st.integers(1, T), max_size=3))) | {T})
    t_ver = sorted(data.draw(st.lists(st.floats(0.5, 4.0), min_size=len(widths),
                                      max_size=len(widths))))
    overhead = data.draw(st.floats(0.0, 2.0))
    rank = rank_dense(rho, forest, floor, torch.tensor(active))
    tw, tt = torch.tensor(widths), torch.tensor(t_ver, dtype=torch.float64)
    max_width = data.draw(st.sampled_from(widths))
    choice = width_fill_choice(rank, R, tw, tt, max_width=max_width, round_overhead_ms=overhead)
    width, widen = choice.width, choice.could_widen
    curve = width_fill_curve(rank, R, tw)
    rate = (curve / (tt + overhead)).tolist()
    c = widths.index(int(width))
    assert rate[c] == max(rate)
    # filled to the narrower of the choice and this round's width; counted at the choice
    assert torch.equal(choice.keep, width_fill_keep(rank, R, min(int(width), max_width)))
    assert torch.equal(choice.kept, width_fill_keep(rank, R, width).sum(1) * torch.tensor(active))
    # plain Python
    f, roots, draft, score, key = dense_structure(rho, forest, active)
    est = {i: min(max(score[i], 0.0), 1.0) for i in draft}
    extra = [0.0] * len(widths)
    for r in roots:
        row = [i for i in draft if i // T == r // T]
        floors = sorted((i for i in row if f.parents[i] == r), key=key)[:floor]
        rest = sorted((i for i in row if i not in floors), key=key)
        kept = max(width.item() - 1 - len(floors), 0)
        bound = est[rest[kept - 1]] if 0 < kept <= len(rest) else \
            est[rest[-1]] if kept > len(rest) > 0 else (max(est[i] for i in floors) if floors
                                                        else 1.0)
        assert all(est[i] <= bound for i in rest[kept:])                  # the bound holds
        for w, W in enumerate(widths):
            more = min(max(W - 1 - len(floors), 0), len(rest)) - min(kept, len(rest))
            extra[w] += max(more, 0) * bound
    want = any(W > widths[c] and (curve[c].item() + extra[w]) / (t_ver[w] + overhead)
               > rate[c] for w, W in enumerate(widths))
    assert bool(widen) == want


def test_could_widen_when_the_cutoff_is_close_and_not_when_it_is_far():
    """Two chains: width 2 keeps each row's first node (its floor: 0.9 and 0.5), 3.4 tokens.
    Width 4 brings two more nodes a row, at most 0.9 and 0.5 each: (3.4 + 2.8) / 1.5 > 3.4, so
    at 1.5x the cost it could win (its true 3.711 tokens do not); at 10x it could not."""
    parents = torch.tensor([[-1, 0, 1, 2]] * 2)
    forest = DenseForest.from_parents(parents, torch.ones(2, 4, dtype=torch.bool), 3)
    rho = torch.tensor([[1.0, 0.9, 0.2, 0.1], [1.0, 0.5, 0.01, 0.001]], dtype=torch.float64)
    rank = rank_dense(rho, forest, 1)
    widths = torch.tensor([2, 4])
    for cost, could in ((1.5, True), (10.0, False)):
        t_ver = torch.tensor([1.0, cost], dtype=torch.float64)
        choice = width_fill_choice(rank, 2, widths, t_ver)
        assert int(choice.width) == 2 and bool(choice.could_widen) == could, cost


def test_width_fill_keeps_what_a_budget_of_the_same_width_leaves_empty():
    """Two rows at width 4: a global budget of 4 puts 3 nodes in the confident row and 1 in the
    other, so the verify is 4 wide either way; the fill keeps 3 in each (8 slots, 8 nodes)."""
    parents = torch.tensor([[-1, 0, 1, 2]] * 2)
    forest = DenseForest.from_parents(parents, torch.ones(2, 4, dtype=torch.bool), 3)
    rho = torch.tensor([[1.0, 0.9, 0.8, 0.7], [1.0, 0.5, 0.1, 0.01]], dtype=torch.float64)
    rank = rank_dense(rho, forest, 1)
    assert select_dense(rho, forest, 4, 1, rank=rank).sum(1).tolist() == [4, 2]
    assert width_fill_keep(rank, 2, 4).sum(1).tolist() == [4, 4]
    assert width_fill_keep(rank, 2, 2).sum(1).tolist() == [2, 2]
    curve = width_fill_curve(rank, 2, torch.tensor([2, 4]))
    assert curve.tolist() == pytest.approx([2 + 0.9 + 0.5, 2 + 2.4 + 0.61])


def test_width_priced_t_ver_takes_the_largest_point_whose_even_spread_fits():
    grid, t_ver = [1, 2, 4, 8, 16, 32, 64], [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0]
    # 4 rows: width 2 holds 4 nodes, width 4 holds 12 (point 8), width 8 28 (16), width 16 60
    assert [width_priced_t_ver(4, grid, t_ver, w) for w in (2, 4, 8, 16)] == [1.1, 1.2, 1.5, 2.0]
    assert width_priced_t_ver(4, [8, 16], [2.0, 3.0], 2) == 2.0     # none fits: the first


def brute_goodput(expected, t_ver, t_dec, batch, overhead=0.0, min_gain=1.0):
    best_n, best_rate = None, -math.inf
    for n in sorted(t_ver):
        rate = expected(n) / (t_ver[n] + overhead)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return (0, True) if best_rate < min_gain * batch / t_dec else (best_n, False)


@given(batch=st.integers(1, 64), knee=st.integers(1, 200), slope=st.floats(0.001, 0.2),
       accept=st.floats(0.05, 0.99), overhead=st.floats(0.0, 2.0), data=st.data())
@settings(max_examples=300)
def test_goodput_choice_equals_brute_force(batch, knee, slope, accept, overhead, data):
    """A synthetic T_ver curve (flat, then linear past a knee) and a saturating acceptance."""
    t_dec = 1.0 + 0.02 * batch
    grid = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    t_ver = {n: t_dec * (1.0 + 0.01 * n / knee + slope * max(0, n - knee) / knee) for n in grid}
    def expected(n):
        # n nodes spread evenly over the requests' chains; node d deep is accepted w.p. a^d
        full, extra = divmod(n, batch)
        per_chain = sum(accept ** (d + 1) for d in range(full))
        return batch + batch * per_chain + extra * accept ** (full + 1)
    min_gain = data.draw(st.sampled_from((1.0, 0.98, 1.05)))
    want = brute_goodput(expected, t_ver, t_dec, batch, overhead, min_gain)
    got = goodput_choice(expected, t_ver, t_dec, batch, round_overhead_ms=overhead,
                         min_gain=min_gain)
    assert got == want
    table = {n: expected(n) for n in grid}
    listed = [expected(n) for n in range(max(grid) + 1)]
    for form in (table, listed):
        assert goodput_choice(form, t_ver, t_dec, batch, round_overhead_ms=overhead,
                              min_gain=min_gain) == want
    tensors = [torch.tensor(grid), torch.tensor([table[n] for n in grid], dtype=torch.float64),
               torch.tensor([t_ver[n] for n in grid], dtype=torch.float64)]
    budget, use_ar = goodput_budget(*tensors, t_dec, batch, round_overhead_ms=overhead,
                                    min_gain=min_gain)
    assert (int(budget), bool(use_ar)) == want


def test_goodput_falls_back_to_ar():
    t_ver = {8: 2.0, 16: 3.0}
    # 2 requests: ar makes 2 tokens per 1 ms; the tree makes at most 3.5 / 2 per ms
    assert goodput_choice({8: 3.5, 16: 4.0}, t_ver, t_dec=1.0, batch=2) == (0, True)
    assert goodput_choice({8: 5.0, 16: 4.0}, t_ver, t_dec=1.0, batch=2) == (8, False)
    # equal rates: the fewer nodes
    assert goodput_choice({8: 4.0, 16: 6.0}, t_ver, t_dec=1.0, batch=2) == (8, False)
    with pytest.raises(ValueError, match="t_ver is empty"):
        goodput_choice({}, {}, 1.0, 1)


# ---- profiles ----
def synthetic_time_fn(calls=None):
    """T_dec(b) = 1 + b / 50 ms; T_ver flat (+1%) up to a knee of 256 / b nodes, then linear."""
    def time_fn(batch, nodes):
        if calls is not None:
            calls.append((batch, nodes))
        t_dec = 1.0 + batch / 50
        knee = 256 // batch
        return t_dec if nodes == 0 else t_dec * (1.01 + 0.01 * max(0, nodes - knee))
    return time_fn


def expected_b_ver(batch, grid, eps, T=32):
    # 1.01 + 0.01 * (N - knee) <= 1 + eps  <=>  N <= knee + 100 * eps - 1; then the most nodes
    # the verify width of that N's even spread over the batch holds, unless a grid point up to
    # that count failed
    n = max((n for n in grid if n <= 256 // batch + round(100 * eps) - 1), default=0)
    if n == 0:
        return 0
    per_row = -(-n // batch)
    cap = batch * (next((w for w in (2, 4, 8, 16, 32) if w >= per_row + 1), T) - 1)
    return n if any(n < m <= cap for m in grid) else cap


GRID = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384]


def make_profile(**key):
    defaults = dict(gpu="NVIDIA H200", config_hash="abc123", dtype=torch.bfloat16,
                    versions={"torch": "2.11.0", "triton": "3.6.0"}, model="bundled")
    return calibrate(synthetic_time_fn(), [1, 2, 4, 8, 16, 32, 64], GRID, 0.1, tree_nodes=32,
                     select_fn=lambda b: 0.01 * b, **{**defaults, **key})


def test_calibrate_on_a_synthetic_curve():
    calls, ticks = [], []
    profile = calibrate(synthetic_time_fn(calls), [4, 1, 16], GRID, 0.1, tree_nodes=32,
                        progress=lambda done, total: ticks.append((done, total)))
    assert profile.batches == [1, 4, 16]
    # grid points 256, 64 and 16 pass: widths 32 (one row: its 31 nodes), 32 (16 a row, but
    # 96 of the same width failed: 64 stays) and 2 (one a row)
    assert profile.b_ver == [expected_b_ver(b, GRID, 0.1) for b in (1, 4, 16)] == [31, 64, 16]
    assert calls[0] == (1, 0) and calls[1:len(GRID) + 1] == [(1, n) for n in GRID]
    assert len(calls) == 3 * (len(GRID) + 1) and ticks[-1] == (len(calls), len(calls))
    assert profile.t_dec == [1.02, 1.08, 1.32]
    assert profile.versions == runtime_versions()
    tight = calibrate(synthetic_time_fn(), [64], GRID, 0.0, tree_nodes=32)
    assert tight.b_ver == [0]                     # even N = 1 costs 1% more than decoding


def test_b_ver_takes_the_largest_passing_node_count():
    assert b_ver_from_curve(1.0, [1, 2, 4, 8], [1.0, 1.2, 1.05, 1.3], 0.1) == 4
    assert b_ver_from_curve(1.0, [1, 2], [1.2, 1.3], 0.1) == 0


@pytest.mark.parametrize("rows,passing,want", [
    (64, 128, 192),    # 2 a row + the root: width 4, which holds 3 draft nodes a row
    (64, 64, 64),      # 1 a row: width 2 holds exactly that
    (8, 56, 56),       # 7 a row: width 8, full
    (8, 32, 56),       # 4 a row: width 8
    (8, 65, 120),      # 9 a row: width 16
    (1, 1984, 31),     # a grid point past the batch's nodes: the whole tree
    (3, 7, 9),         # 3 a row: width 4 (a batch that is no power of two)
    (4, 5, 12),        # 2 a row, rounded up: width 4
])
def test_b_ver_is_raised_to_its_verify_widths_capacity(rows, passing, want):
    # no grid point between the passing one and its width's capacity (one there that failed
    # would keep B_ver at the passing point: the next test)
    grid = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 1984)
                   if n <= passing or n > want} | {passing})
    t_ver = [1.0 if n <= passing else 2.0 for n in grid]
    assert b_ver_from_curve(1.0, grid, t_ver, 0.1) == passing
    assert b_ver_from_curve(1.0, grid, t_ver, 0.1, rows=rows, tree_nodes=32) == want
    assert width_capacity(rows, passing, 32) == want
    assert b_ver_from_curve(1.0, grid, [2.0] * len(grid), 0.1, rows=rows, tree_nodes=32) == 0


def test_b_ver_is_not_raised_past_a_point_of_its_width_that_failed():
    # batch 8: 32 and 48 nodes both need width 8 (4 and 6 a row); 48 measured above the
    # tolerance (noise at the edge), so B_ver stays at 32 rather than width 8's 56
    grid, t_ver = [8, 16, 32, 48, 64], [1.0, 1.0, 1.05, 1.11, 1.3]
    assert b_ver_from_curve(1.0, grid, t_ver, 0.1, rows=8, tree_nodes=32) == 32
    assert b_ver_from_curve(1.0, grid, t_ver, 0.12, rows=8, tree_nodes=32) == 56


def test_at_eps_derives_b_ver_again_from_the_same_curves():
    profile = calibrate(synthetic_time_fn(), [1, 4, 16], GRID, 0.1, tree_nodes=32)
    for eps in (0.0, 0.1, 0.5, 3.0):
        at = profile.at_eps(eps)
        assert at.eps == eps and at.t_ver == profile.t_ver and at.t_dec == profile.t_dec
        assert at.b_ver == [b_ver_from_curve(t, GRID, row, eps, rows=b, tree_nodes=32)
                            for b, t, row in zip(profile.batches, profile.t_dec, profile.t_ver)]
    assert profile.at_eps(0.1).b_ver == profile.b_ver and profile.eps == 0.1
    wide = profile.at_eps(100.0)
    assert wide.b_ver == [31, 4 * 31, 16 * 31]            # every drafted node of each batch
    assert all(a <= b for a, b in zip(profile.at_eps(0.0).b_ver, profile.at_eps(0.5).b_ver))
    with pytest.raises(ValueError, match="eps"):
        profile.at_eps(-0.1)


def test_verification_budget_uses_the_bucket_at_or_above():
    profile = calibrate(synthetic_time_fn(), [1, 4, 16], GRID, 0.1, tree_nodes=32)
    rows = {b: verification_budget(profile, b) for b in (1, 2, 3, 4, 5, 16, 17, 100)}
    assert rows == {1: 31, 2: 64, 3: 64, 4: 64, 5: 16, 16: 16, 17: 16, 100: 16}
    assert profile.t_dec_at(3) == 1.08 and list(profile.t_ver_curve(3)) == GRID
    with pytest.raises(ValueError, match="batch"):
        verification_budget(profile, 0)


def test_profile_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path / "cache"))
    profile = make_profile()
    path = profile.save()
    assert path.parent == tmp_path / "cache" and path.suffix == ".json"
    assert path.name == "budget-NVIDIA-H200-abc123-bfloat16-torch2.11.0-triton3.6.0-tree32.json"
    assert BudgetProfile.load(path) == profile
    key = dict(gpu="NVIDIA H200", config_hash="abc123", dtype="bfloat16",
               versions={"torch": "2.11.0", "triton": "3.6.0"}, tree_nodes=32)
    assert find_profile(**key) == profile
    assert find_profile(**{**key, "gpu": "NVIDIA A100"}) is None
    assert find_profile(**{**key, "tree_nodes": 16}) is None     # trees of another size
    assert profile_path(**key) == path
    raw = json.loads(path.read_text())
    assert raw["format"] == FORMAT and raw["b_ver"] == profile.b_ver and raw["tree_nodes"] == 32
    assert raw["t_select"] == [0.01 * b for b in profile.batches]


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("BOLE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "bole"


def test_a_mismatched_profile_names_every_difference(tmp_path):
    profile = make_profile()
    profile.check("NVIDIA H200", "abc123", torch.bfloat16, {"torch": "2.11.0", "triton": "3.6.0"},
                  32)
    with pytest.raises(ValueError) as err:
        profile.check("NVIDIA A100-SXM4-80GB", "ffff00", "float16",
                      {"torch": "2.11.0", "triton": "3.5.0"}, 16)
    msg = str(err.value)
    for part in ("GPU: profile 'NVIDIA H200', here 'NVIDIA A100-SXM4-80GB'",
                 "model config hash: profile 'abc123', here 'ffff00'",
                 "dtype: profile 'bfloat16', here 'float16'",
                 "triton: profile '3.6.0', here '3.5.0'", "tree nodes: profile 32, here 16",
                 "bundled", "bole calibrate", "--depth, --topk and --budget"):
        assert part in msg
    assert "torch:" not in msg                     # only the differences are named
    # a file whose contents disagree with its key is refused on lookup
    path = profile.save(profile_path("NVIDIA A100", "abc123", "bfloat16", profile.versions, 32,
                                     tmp_path))
    assert path.exists()
    with pytest.raises(ValueError, match="GPU: profile 'NVIDIA H200', here 'NVIDIA A100'"):
        find_profile("NVIDIA A100", "abc123", "bfloat16", profile.versions, 32, tmp_path)


def test_malformed_profiles_are_refused(tmp_path):
    raw = make_profile().to_dict()
    with pytest.raises(ProfileFormatError, match=f"format 2, this Bole reads format {FORMAT}"):
        BudgetProfile.from_dict({**raw, "format": 2})
    with pytest.raises(ValueError, match="lacks tree_nodes"):
        BudgetProfile.from_dict({k: v for k, v in raw.items() if k != "tree_nodes"})
    for bad in (1, 0, 2.5, True, "32"):
        with pytest.raises(ValueError, match="tree_nodes must be an int >= 2"):
            BudgetProfile.from_dict({**raw, "tree_nodes": bad})
    with pytest.raises(ValueError, match="lacks b_ver"):
        BudgetProfile.from_dict({k: v for k, v in raw.items() if k != "b_ver"})
    with pytest.raises(ValueError, match="t_ver"):
        BudgetProfile.from_dict({**raw, "t_ver": raw["t_ver"][:-1]})
    with pytest.raises(ValueError, match="t_select"):
        BudgetProfile.from_dict({**raw, "t_select": raw["t_select"][:-1]})


def test_config_hash_covers_every_field():
    config = preset_config("qwen3.5-9b")
    h = config_hash(config)
    assert h == config_hash(preset_config("qwen3.5-9b")) and len(h) == 16
    assert config_hash(dataclasses.replace(config, rms_norm_eps=1e-5)) != h
    flipped = dataclasses.replace(config, mtp_num_hidden_layers=1 - config.mtp_num_hidden_layers)
    assert config_hash(flipped) != h


def test_plot_profile(tmp_path):
    path = plot_profile(make_profile(), tmp_path / "plots" / "profile.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- acceptance against rho ----
def brute_isotonic(y, w):
    """The best non-decreasing fit: the best partition into blocks of non-decreasing means."""
    n, best = len(y), None
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        means = [sum(y[i] * w[i] for i in range(a, b)) / sum(w[a:b])
                 for a, b in zip(bounds, bounds[1:])]
        if any(m1 > m2 for m1, m2 in zip(means, means[1:])):
            continue
        fit = [m for m, a, b in zip(means, bounds, bounds[1:]) for _ in range(a, b)]
        cost = sum(wi * (yi - fi) ** 2 for yi, wi, fi in zip(y, w, fit))
        if best is None or cost < best[0] - 1e-12:
            best = (cost, fit)
    return best[1]


@given(y=st.lists(st.integers(-5, 5).map(float), min_size=1, max_size=7), data=st.data())
@settings(max_examples=200)
def test_pool_adjacent_violators(y, data):
    w = data.draw(st.lists(st.integers(1, 4).map(float), min_size=len(y), max_size=len(y)))
    fit = isotonic_fit(y, w)
    assert all(a <= b for a, b in zip(fit, fit[1:]))
    assert fit == pytest.approx(brute_isotonic(y, w), abs=1e-9)
    assert isotonic_fit(sorted(y)) == sorted(y)
    device = isotonic_fit_device(torch.tensor(y, dtype=torch.float64),
                                 torch.tensor(w, dtype=torch.float64))
    assert device.tolist() == pytest.approx(fit, abs=1e-9)


def test_acceptance_calibrator_learns_a_monotone_map():
    calib = AcceptanceCalibrator.log_bins(bins=8, low=1e-3)
    gen = torch.Generator().manual_seed(0)
    rho = torch.rand(20000, generator=gen, dtype=torch.float64) ** 3
    truth = rho.sqrt()                                 # accepted more often than rho says
    accepted = torch.rand(20000, generator=gen, dtype=torch.float64) < truth
    before = calib(rho)
    calib.observe(rho, accepted)
    table = calib.fit()
    assert all(a <= b for a, b in zip(table.tolist(), table.tolist()[1:]))
    assert float(calib.count.sum()) == 20000
    probe = torch.tensor([0.01, 0.1, 0.5, 0.9], dtype=torch.float64)
    got = calib(probe)
    assert (got[:3] > probe[:3]).all() and (got - probe.sqrt()).abs().max() < 0.2
    assert before.shape == rho.shape
    with pytest.raises(ValueError, match="prior"):
        AcceptanceCalibrator.log_bins(prior=0.0)


def test_learnt_acceptance_is_shared_per_model_until_forgotten():
    """Engines of one model and drafter share one calibrator; forget_acceptance drops it, so the
    next starts from the prior; another model or drafter has its own."""
    from bole.speculative.budget.acceptance import forget_acceptance, learnt_acceptance

    class Model:                      # any weak-referenceable object keys the estimates
        pass
    a, b = Model(), Model()
    first = learnt_acceptance(a, ("replay", "p"), "cpu")
    assert learnt_acceptance(a, ("replay", "p"), "cpu") is first
    assert learnt_acceptance(a, ("mtp", None), "cpu") is not first
    assert learnt_acceptance(b, ("replay", "p"), "cpu") is not first
    first.observe(torch.tensor([0.5]), torch.tensor([True]))
    forget_acceptance(a)
    fresh = learnt_acceptance(a, ("replay", "p"), "cpu")
    assert fresh is not first and float(fresh.count.sum()) == 0.0
    forget_acceptance(Model())        # nothing learnt: nothing to drop


def test_saved_acceptance_restores_a_copy():
    """restore_acceptance makes a saved state what the next engines start from, as a copy:
    rounds after the restore change neither the saved state nor a second restore."""
    from bole.speculative.budget.acceptance import (forget_acceptance, learnt_acceptance,
                                                    restore_acceptance, saved_acceptance)

    class Model:
        pass
    m = Model()
    cal = learnt_acceptance(m, ("replay", "p"), "cpu")
    cal.observe(torch.tensor([0.5, 0.5, 0.01]), torch.tensor([True, False, True]))
    cal.fit()
    saved = saved_acceptance(m)
    forget_acceptance(m)
    assert float(learnt_acceptance(m, ("replay", "p"), "cpu").count.sum()) == 0.0
    restore_acceptance(m, saved)
    got = learnt_acceptance(m, ("replay", "p"), "cpu")
    assert got is not saved[(("replay", "p"), "cpu")]
    assert torch.equal(got.count, cal.count) and torch.equal(got.hits, cal.hits)
    assert torch.equal(got.table, cal.table) and torch.equal(got.edges, cal.edges)
    got.observe(torch.tensor([0.5]), torch.tensor([True]))          # a round after the restore
    restore_acceptance(m, saved)
    again = learnt_acceptance(m, ("replay", "p"), "cpu")
    assert float(again.count.sum()) == 3.0 and torch.equal(again.hits, cal.hits)
    assert saved_acceptance(Model()) == {}
