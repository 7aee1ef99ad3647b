import math
"""The batch-shared budget in the round: output unchanged, the budget honoured, widths that
follow the previous round, calibration on this device (CPU here)."""

from dataclasses import replace

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.speculative.budget.registry import make_policy
from bole.speculative.budget.round_select import select
from bole.speculative.budget.widths import width_buckets
from bole.speculative.budget.profile import FORMAT
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from tests.engine.forward_spy import record_forwards

PROMPTS = [[5, 9, 17, 33, 2] * 4, [7, 7, 8, 9, 1, 2, 3, 7, 7, 8], [100, 3, 100, 3, 100]]


@pytest.fixture(scope="module")
def model():
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, mtp=True,
                           gdn_backend="torch")
    tensors = dict(m.w)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 50
    return HybridModel(m.config, tensors, gdn_backend="torch")


@pytest.mark.parametrize("mode", ["bole", "tree-serial"])
@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_a_shared_budget_keeps_greedy_output(model, mode, drafter):
    params = SamplingParams(max_tokens=16)
    ar = [r.token_ids for r in Engine(model, SpecConfig(mode="ar"), gdn_backend="torch-serial")
          .generate(PROMPTS, params)]
    for budget in (1, 4, 12):
        spec = SpecConfig(mode, drafter, depth=4, topk=3, budget=12, budget_policy="global",
                          shared_budget=budget)
        engine = Engine(model, spec, max_slots=3)
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == ar, budget
        stats = engine.timings.summary()
        floors = len(PROMPTS)                      # one root child each, even past the budget
        assert 0 < stats["draft_nodes_per_round"] <= max(budget, floors)
        assert stats["plain_round_share"] == 0


def test_rows_near_their_token_limit_do_not_set_the_next_width(model):
    """A request within a tree's depth of its token limit drafts a shallower tree; its kept
    count would narrow the next round's verify for requests that draft whole trees (the last
    round of a lone request, or a warm-up of a few tokens, then the next request's first)."""
    spec = SpecConfig("bole", "mtp", depth=4, topk=3, budget=12, budget_policy="global",
                      shared_budget=24)
    engine = Engine(model, spec, max_slots=3)
    engine.generate(PROMPTS, SamplingParams(max_tokens=4))   # every round within depth 4
    assert engine.rounds.policy.last_kept == {}
    engine.generate(PROMPTS, SamplingParams(max_tokens=16))
    assert engine.rounds.policy.last_kept                      # rounds of whole trees counted


def test_the_selection_honours_the_budget_and_floors():
    # three requests, 6 node slots: chains of rho 1 > 0.9 > 0.8 ... ; the last row is padding
    R, T = 3, 6
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4]] * R)
    valid = torch.ones(R, T, dtype=torch.bool)
    rho = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6, 0.5],
                        [1.0, 0.95, 0.2, 0.1, 0.05, 0.01],
                        [1.0, 0.99, 0.98, 0.97, 0.96, 0.95]], dtype=torch.float64)
    tokens = torch.arange(R * T).view(R, T)
    active = torch.tensor([True, True, False])
    sel = select(rho, tokens, parents, valid, torch.tensor(4), active, 1, 4, 5)
    assert sel.kept.tolist() == [4, 2, 1]          # floors (one child each), then 0.8, 0.7
    assert sel.forest.valid.sum(1).tolist() == [4, 2, 1]
    assert sel.tokens[0].tolist() == [0, 1, 2, 3] and sel.tokens[1, :2].tolist() == [6, 7]
    narrow = select(rho, tokens, parents, valid, torch.tensor(4), active, 1, 2, 5)
    assert narrow.forest.valid.sum(1).tolist() == [2, 2, 1]      # truncated: still a tree
    assert narrow.kept.tolist() == [4, 2, 1]                     # what the next width follows


def test_widths_follow_the_previous_round():
    spec = SpecConfig(budget=32, budget_policy="global", shared_budget=24)
    policy = make_policy(spec, 32)
    assert width_buckets(32) == (2, 4, 8, 16, 32) and width_buckets(12) == (2, 4, 8, 12)
    assert policy.width(8, 6) == 8                   # 1 + ceil(24 / 6) = 5 -> 8
    policy.observe(8, [3, 11, 2])
    assert policy.width(8, 6) == 16
    policy.observe(8, [])                           # every row's tree cut by its limit
    assert policy.width(8, 6) == 16                 # the last counts stay
    assert make_policy(SpecConfig(budget=32), 32).width(8, 6) == 32      # fixed: the tree
    with pytest.raises(ValueError, match="shared_budget"):
        make_policy(SpecConfig(budget_policy="global"), 32)
    with pytest.raises(ValueError, match="profile"):
        make_policy(SpecConfig(budget_policy="calibrated"), 32)


def test_goodput_compares_what_drafting_and_plain_rounds_deliver():
    """The host decides whether to draft from realised tokens per request per ms: drafting
    rounds against plain ones, or before any plain round has run, one decode forward of the
    profile (1 ms) plus a drafting round's accept time (0.5 ms): 0.67 a ms. A bucket's first
    FIRST_ROUNDS rates are averaged by their median, and it falls back only after that many."""
    from bole.speculative.budget.goodput import AR_ROUNDS, FIRST_ROUNDS
    assert FIRST_ROUNDS == 3
    policy = make_policy(SpecConfig("bole", budget=3, budget_policy="goodput"), 3,
                          profile=_profile(3.0, t_dec_ms=1.0, T=3))
    policy.after_round(1, False, draft_ms=0.6, accept_ms=0.5, rate=0.01)   # a slow first round
    assert not policy.plain_round() and policy.overhead_ms == pytest.approx(1.1)
    policy.after_round(1, False, draft_ms=0.6, accept_ms=0.5, rate=0.9)
    assert not policy.plain_round() and policy.draft_rate[1] == pytest.approx(0.455)
    policy.after_round(1, False, draft_ms=0.6, accept_ms=0.5, rate=0.8)
    assert not policy.plain_round() and policy.draft_rate[1] == pytest.approx(0.8)  # median
    rounds = 3
    while not policy.plain_round():
        policy.after_round(1, False, draft_ms=0.6, accept_ms=0.5, rate=0.1)
        rounds += 1
    assert rounds == 6 and policy.draft_rate[1] < 1 / 1.5    # 0.8, 0.73, 0.667, 0.61
    assert policy.ar_rounds_left == AR_ROUNDS
    for _ in range(AR_ROUNDS):
        policy.after_round(1, True, draft_ms=0.0, accept_ms=0.2, rate=0.9)
    assert not policy.plain_round() and policy.plain_rate[1] == pytest.approx(0.9)
    before = policy.draft_rate[1]
    policy.after_round(1, False, draft_ms=0.6, accept_ms=0.5, rate=1.3)   # a look: weight 0.5
    assert policy.draft_rate[1] == pytest.approx((before + 1.3) / 2) and not policy.plain_round()
    # another batch bucket has rates of its own; rounds that held a capture are not averaged
    policy.after_round(4, False, draft_ms=0.6, accept_ms=0.5, rate=0.2, measured=False)
    assert 4 not in policy.draft_rate and not policy.plain_round()
    for n in range(FIRST_ROUNDS):
        assert not policy.plain_round()
        policy.after_round(4, False, draft_ms=0.6, accept_ms=0.5, rate=0.3)
    assert policy.draft_rate[4] == pytest.approx(0.3) and policy.draft_rate[1] > 0.9
    assert policy.plain_round()              # 0.3 < 1 / (1 + 0.5): bucket 4 has no plain rate


def test_goodput_explores_only_while_its_choice_could_change():
    """A select round reports whether anything past its fill could change the choice; while it
    could not, the bucket does not explore, however long since it last did; once it could, the
    next round explores."""
    T, K = 4, 40
    policy = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                          profile=_profile(1.0, t_dec_ms=100.0, slope=0.5, t_select_ms=0.25,
                                           T=T))
    assert not policy.whole_trees(2)
    kinds = []
    for n in range(K + 3):
        kinds.append(policy.plan(2))
        policy.observe(2, [2, 2], kinds[-1], could_widen=n >= K)
        policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
    assert K > 2 * policy.explore_every(2)
    assert kinds[:K + 1] == ["select"] * (K + 1) and kinds[K + 1:] == ["whole", "select"]


def test_goodput_verifies_the_best_width_of_an_uncertain_tree():
    """A drafted tree is paid for: however little its nodes promise, the round verifies the
    width with the most expected tokens per ms rather than its roots alone."""
    policy = make_policy(SpecConfig("bole", budget=3, budget_policy="goodput"), 3,
                          profile=_profile(3.0, t_dec_ms=1.0, T=3))
    goodput = policy.goodput_inputs(1, "cpu")
    assert goodput.widths.tolist() == [2, 3]
    goodput.t_ver.copy_(torch.tensor([1.0, 1.0], dtype=torch.float64))
    parents = torch.tensor([[-1, 0, 1]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    tokens = torch.arange(3).view(1, 3)
    for p in (0.01, 1.0):
        rho = torch.tensor([[1.0, p, p * p]], dtype=torch.float64)
        sel = select(rho, tokens, parents, valid, torch.tensor(0), torch.tensor([True]), 1, 3, 2,
                     goodput=goodput)
        assert sel.kept.tolist() == [3]         # widths 2 and 3 cost the same: both nodes


def test_goodput_fills_the_width_it_picks():
    """Every row of a dense verify costs its width whether it fills it or not: the choice is a
    width, and every row keeps its best nodes up to it (a global budget of 4 would keep 3 nodes
    of the confident row and 1 of the other at the same width 4)."""
    from bole.speculative.budget.round_select import Goodput
    parents = torch.tensor([[-1, 0, 1, 2]] * 2)
    valid = torch.ones(2, 4, dtype=torch.bool)
    rho = torch.tensor([[1.0, 0.9, 0.8, 0.7], [1.0, 0.1, 0.01, 0.001]], dtype=torch.float64)
    tokens = torch.arange(8).view(2, 4)
    active = torch.ones(2, dtype=torch.bool)
    # width 2: 2 + 0.9 + 0.1 = 3.0 tokens; width 4: 2 + 2.4 + 0.111 = 4.511
    for t_ver, kept in (([1.0, 3.0], [2, 2]), ([1.0, 1.2], [4, 4])):
        goodput = Goodput.on("cpu", (2, 4), t_ver)
        sel = select(rho, tokens, parents, valid, torch.tensor(0), active, 1, 4, 3,
                     goodput=goodput)
        assert sel.kept.tolist() == kept, t_ver


def test_goodput_fills_this_rounds_width_with_its_best_nodes():
    """When the choice is wider than the width this round's forward was built for, the row is
    filled to that width in rank order (compaction alone would keep its first slots), and its
    count at the choice goes to the host for the next round's width."""
    from bole.speculative.budget.round_select import Goodput
    parents = torch.tensor([[-1, 0, 1, 2, 0, 4, 5, 6]])
    valid = torch.ones(1, 8, dtype=torch.bool)
    rho = torch.tensor([[1.0, 0.9, 0.1, 0.05, 0.85, 0.8, 0.75, 0.7]], dtype=torch.float64)
    goodput = Goodput.on("cpu", (2, 4, 8), [1.0, 1.0, 1.0])
    sel = select(rho, torch.arange(8).view(1, 8), parents, valid, torch.tensor(0),
                 torch.tensor([True]), 1, 4, 7, goodput=goodput)
    assert sel.rho.tolist() == [[1.0, 0.9, 0.85, 0.8]] and sel.tokens.tolist() == [[0, 1, 4, 5]]
    assert sel.kept.tolist() == [8]


def test_goodput_never_chooses_a_width_narrower_than_its_floors():
    """A width that cannot hold a root and its floors would be priced below the width its rows
    need: goodput does not offer it."""
    policy = make_policy(SpecConfig("bole", budget=8, root_floor=3, budget_policy="goodput"), 8,
                          profile=_profile(3.0, t_dec_ms=1.0, T=8))
    assert policy.widths == (2, 4, 8) and policy.goodput_widths == (4, 8)
    assert policy.goodput_inputs(1, "cpu").widths.tolist() == [4, 8]


def test_goodput_prices_each_width_from_the_profile():
    """Bucket R's width W costs the profile's forward of its measured batch at that width:
    the largest grid point whose even spread fits ``rows * (W - 1)`` nodes."""
    policy = make_policy(SpecConfig("bole", budget=16, budget_policy="goodput"), 16,
                          profile=_profile(3.0, t_dec_ms=1.0, T=16))
    profile = policy.profile
    row = profile.row(2)
    by_n = dict(zip(profile.node_grid, profile.t_ver[row]))
    # 2 rows: width 2 holds 2 nodes, 4 holds 6 (point 4), 8 holds 14 (point 8), 16 30 (16)
    assert [policy.t_ver_at_width(2, w) for w in policy.widths] == \
        [by_n[2], by_n[4], by_n[8], by_n[16]]
    assert policy.goodput_inputs(2, "cpu").t_ver.tolist() == [by_n[2], by_n[4], by_n[8], by_n[16]]


def test_calibrated_policy_calibrates_on_first_use(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path))
    import bole.engine.calibrate as cal
    monkeypatch.setattr(cal, "DEFAULT_GRID", (1, 2, 4, 8))
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8, budget_policy="calibrated")
    params = SamplingParams(max_tokens=10)
    ar = [r.token_ids for r in Engine(model, SpecConfig(mode="ar")).generate(PROMPTS, params)]
    engine = Engine(model, spec, max_slots=3)
    assert "calibrating now" in capsys.readouterr().err
    profiles = list(tmp_path.glob("budget-*.json"))
    assert len(profiles) == 1 and list(tmp_path.glob("budget-*.png"))
    assert engine.rounds.policy.profile.batches == [1, 2, 3]
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == ar
    Engine(model, spec, max_slots=3)                 # the saved profile is found: no new run
    assert "calibrating" not in capsys.readouterr().err
    bigger = Engine(model, spec, max_slots=5)        # past the profile's batches: again
    assert "reaches batch 3 and 21 draft nodes; this engine needs batch 5 and 35" in \
        capsys.readouterr().err
    assert bigger.rounds.policy.profile.batches[-1] == 5
    assert max(bigger.rounds.policy.profile.node_grid) == 35
    assert all(t > 0 for t in bigger.rounds.policy.profile.t_select)   # the selection, timed


def test_each_tree_size_has_its_own_profile(model, tmp_path, monkeypatch, capsys):
    """A profile measures verify widths up to its tree's size and the selection over its
    trees, so an engine with larger trees calibrates its own (a second file) rather than
    pricing widths its profile never ran; each engine then finds its own again."""
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path))
    import bole.engine.calibrate as cal
    monkeypatch.setattr(cal, "DEFAULT_GRID", (1, 4))
    small = SpecConfig("bole", "mtp", depth=2, topk=2, budget=4, budget_policy="goodput")
    large = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8, budget_policy="goodput")
    assert (small.nodes_per_request, large.nodes_per_request) == (4, 8)
    Engine(model, small, max_slots=2)
    capsys.readouterr()
    engine = Engine(model, large, max_slots=2)
    assert "tree size (8 nodes): calibrating now" in capsys.readouterr().err
    assert engine.rounds.policy.profile.tree_nodes == 8
    assert sorted(p.name.rsplit("-", 1)[1] for p in tmp_path.glob("budget-*.json")) == \
        ["tree4.json", "tree8.json"]
    for spec in (small, large):
        found = Engine(model, spec, max_slots=2).rounds.policy.profile
        assert found.tree_nodes == spec.nodes_per_request
    assert "calibrating" not in capsys.readouterr().err


def test_a_profile_of_another_tree_size_is_refused():
    spec = SpecConfig("bole", "mtp", budget=16, budget_policy="goodput")
    with pytest.raises(ValueError, match="measured for trees of 8 nodes, and this engine's "
                                         "trees have 16.*--depth, --topk and --budget"):
        make_policy(spec, 16, profile=_profile(1.0, T=8))
    calibrated = SpecConfig("bole", "mtp", budget=16, budget_policy="calibrated")
    with pytest.raises(ValueError, match="trees of 8 nodes"):
        make_policy(calibrated, 16, profile=_profile(1.0, T=8))


def test_a_profile_of_an_older_layout_is_calibrated_again(model, tmp_path, monkeypatch, capsys):
    """A cached profile written by an older Bole (format 1: no selection times) is neither
    used nor an error: the engine says so and calibrates again."""
    import json
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path))
    import bole.engine.calibrate as cal
    monkeypatch.setattr(cal, "DEFAULT_GRID", (1, 4))
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8, budget_policy="calibrated")
    Engine(model, spec, max_slots=2)
    path = next(tmp_path.glob("budget-*.json"))
    raw = json.loads(path.read_text())
    raw["format"] = 1
    del raw["t_select"]
    path.write_text(json.dumps(raw))
    capsys.readouterr()
    engine = Engine(model, spec, max_slots=2)
    err = capsys.readouterr().err
    assert f"format 1, this Bole reads format {FORMAT}" in err and "calibrating now" in err
    assert len(engine.rounds.policy.profile.t_select) == 2
    assert json.loads(path.read_text())["format"] == FORMAT


def test_calibrated_caps_each_row_at_the_width_its_budget_was_measured_at():
    """The calibrated policy verifies at the width bucket of B_ver spread over the profile's
    batch: its graphs stop there, its widths never pass it, and its budget fills it."""
    T = 8                                            # verify widths 2, 4, 8
    # t_ver 1000, 1010, 1020, ... at N = 1, 2, 4, 8, 16 against t_dec 1000: at eps 0.025 N = 4
    # passes, which is 4, 2 and 1 a row at batches 1, 2 and 4 (widths 8, 4 and 2)
    profile = _profile(1000.0, T=T).at_eps(0.025)
    pol = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="calibrated"), T,
                       profile=profile)
    assert [pol.budget(R) for R in (1, 2, 4)] == [7, 6, 4] == profile.b_ver
    assert [pol.row_width(R) for R in (1, 2, 4)] == [8, 4, 2]
    assert pol.whole_trees(1) and not pol.whole_trees(2)
    assert pol.variants(2) == [("select", 2, False), ("select", 4, False)]
    assert pol.variants(4) == [("select", 2, False)]
    assert pol.width(4, 4) == 2
    assert pol.width(2, 1) == 4           # one request in bucket 2: its even share is 6, capped
    pol.observe(2, [3, 2])
    assert pol.width(2, 2) == 4
    # a bucket the profile did not measure takes its measured batch's width: 4 nodes over the 4
    # rows measured (width 2), not over the 3 of the bucket
    assert pol.row_width(3) == 2
    # and a width always holds the root and its floors
    floors = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="calibrated",
                                     root_floor=3), T, profile=profile)
    assert floors.row_width(4) == 4
    for other in ("global", "goodput"):
        spec = SpecConfig("bole", "mtp", budget=T, budget_policy=other, shared_budget=4)
        assert make_policy(spec, T, profile=profile).row_width(2) is None


def test_calibrated_rounds_keep_each_request_within_its_width(model, monkeypatch):
    """The round passes the calibrated policy's width to its selection: every select round's
    rows keep at most that many nodes, and greedy output equals plain decoding's."""
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8, budget_policy="calibrated")
    profile = _profile(1000.0, T=spec.nodes_per_request).at_eps(0.025)   # batch 4: width 2
    params = SamplingParams(max_tokens=12)
    ar = [r.token_ids for r in Engine(model, SpecConfig(mode="ar")).generate(PROMPTS, params)]
    engine = Engine(model, spec, max_slots=3, budget_profile=profile)
    policy, seen = engine.rounds.policy, []
    real = policy.observe

    def observe(R, kept, kind="select", could_widen=None):
        seen.append((R, kind, list(kept)))
        return real(R, kept, kind, could_widen)
    monkeypatch.setattr(policy, "observe", observe)
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == ar
    selected = [(R, kept) for R, kind, kept in seen if kind == "select" and kept]
    assert selected
    assert all(max(kept) <= policy.row_width(R) for R, kept in selected), selected


def _profile(t_ver_ms: float, t_dec_ms: float = 1000.0, slope: float = 0.01,
             t_select_ms: float = 0.0, *, T: int):
    """A synthetic profile for trees of ``T`` nodes: decode and verify times far above this
    CPU's measured draft and accept overhead (15-100 ms on a busy CI machine), so that the
    choice follows the profile. The verify time grows by ``slope`` a grid point (so that the
    selection can pay)."""
    from bole.speculative.budget.profile import BudgetProfile
    grid = [1, 2, 4, 8, 16]
    return BudgetProfile(gpu="test", config_hash="x", dtype="float32", torch_version="",
                         triton_version="", eps=0.1, batches=[1, 2, 4], node_grid=grid,
                         t_dec=[t_dec_ms] * 3,
                         t_ver=[[t_ver_ms * (1 + slope * i) for i in range(len(grid))]] * 3,
                         b_ver=[16, 16, 16], t_select=[t_select_ms] * 3, tree_nodes=T,
                         model="tiny", created="")


def _knee_profile(T: int):
    """Past 4 draft nodes a verify costs 1000x: the choice is never whole trees (at any batch,
    a width of more than 4 costs 1000x more), so that every drafting round selects and learns."""
    knee = _profile(1000.0, slope=0.0, T=T)
    knee.t_ver = [[1000.0 if n <= 4 else 1e6 for n in knee.node_grid] for _ in knee.batches]
    return knee


def test_whole_trees_where_the_selection_cannot_pay():
    """Buckets whose budget covers every drafted node, or (goodput) where whole trees' verify
    costs at most the cheapest one plus the selection, verify whole trees without selecting."""
    T = 4                                             # 3 draft nodes a request
    glob = make_policy(SpecConfig(drafter="mtp", budget=T, budget_policy="global",
                                   shared_budget=6), T)
    assert [glob.whole_trees(R) for R in (1, 2, 4)] == [True, True, False]
    assert glob.width(2, 2) == T
    calibrated = make_policy(SpecConfig(drafter="mtp", budget=T, budget_policy="calibrated"),
                              T, profile=_profile(1.0, T=T))         # b_ver 16 at every batch
    assert [calibrated.whole_trees(R) for R in (1, 2, 4)] == [True, True, True]
    # host drafters' trees are often small: their rounds always compact
    ngram = make_policy(SpecConfig(drafter="ngram", budget=T, budget_policy="calibrated"), T,
                         profile=_profile(1.0, T=T))
    assert not any(ngram.whole_trees(R) for R in (1, 2, 4))
    # goodput, bucket 2: width 4 (6 draft nodes: grid 4, 1.02 ms) against width 2 (grid 2,
    # 1.01 ms)
    goodput = lambda sel: make_policy(  # noqa: E731
        SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
        profile=_profile(1.0, slope=0.01, t_select_ms=sel, T=T))
    assert not goodput(0.005).whole_trees(2) and goodput(0.015).whole_trees(2)
    assert goodput(0.0).whole_trees(1) is False            # 3 nodes: grid 2 (1.01) vs 1.0
    flat = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                        profile=_profile(1.0, slope=0.0, T=T))
    assert all(flat.whole_trees(R) for R in (1, 2, 4)) and flat.width(4, 4) == T
    assert flat.plan(4) == "whole" and not flat.learns("whole", 4)
    # a bucket that never chooses never explores: its rounds never pay for learning
    from bole.speculative.budget.goodput import EXPLORE_EVERY
    for _ in range(3 * EXPLORE_EVERY):
        kind = flat.plan(4)
        assert kind == "whole" and not flat.learns(kind, 4) and not flat.exploring(4)
        flat.after_round(4, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
    assert flat.since_explore[4] == 3 * EXPLORE_EVERY


def test_goodput_explores_whole_trees_and_weighs_its_selection():
    """One drafting round in EXPLORE_EVERY is a whole round (width T, no selection) that
    learns, without moving the next round's width, or fewer where whole trees cost more than
    the choice: exploring adds at most EXPLORE_SHARE of the rounds' time by the profile. The
    choice's overhead holds the profile's selection time where the bucket selects."""
    from bole.speculative.budget.goodput import EXPLORE_EVERY, EXPLORE_SHARE
    T = 4
    for slope, select_ms in ((0.5, 0.25), (0.5, 0.002)):
        policy = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                              profile=_profile(1.0, t_dec_ms=100.0, slope=slope,
                                               t_select_ms=select_ms, T=T))
        assert not policy.whole_trees(2) and policy.explore_every(2) == EXPLORE_EVERY
        policy.observe(2, [2, 1])                      # width 2: grid point 2
        policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
        # whole trees (width 4, 6 nodes: grid point 4) cost 1 + 2 * slope against the
        # choice's 1 + slope
        round_ms = 1.0 + slope + policy.round_overhead_ms(2)
        every = max(EXPLORE_EVERY, math.ceil(slope / (EXPLORE_SHARE * round_ms)))
        assert policy.explore_every(2) == every > EXPLORE_EVERY
        seen = []
        for _ in range(2 * every):
            kind = policy.plan(2)
            seen.append((kind, policy.width(2, 2, kind), policy.learns(kind, 2)))
            policy.observe(2, [T, T] if kind == "whole" else [2, 1], kind)
            policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
        # the round before the loop counted as the first of its period
        assert [k for k, _, _ in seen] == (["select"] * (every - 2) + ["whole"]
                                           + ["select"] * (every - 1) + ["whole"] + ["select"])
        assert all(w == (T if k == "whole" else 2) and learn for k, w, learn in seen)
        assert policy.round_overhead_ms(2) == pytest.approx(policy.overhead_ms + select_ms)
    # where whole trees cost about the choice's forward, one round in EXPLORE_EVERY explores
    policy = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                          profile=_profile(1.0, t_dec_ms=100.0, slope=0.5, t_select_ms=0.25,
                                           T=T))
    policy.observe(2, [T, 3])                          # the whole trees' width
    assert policy.explore_every(2) == EXPLORE_EVERY
    kinds = []
    for _ in range(2 * EXPLORE_EVERY):
        kinds.append(policy.plan(2))
        policy.observe(2, [T, 3], kinds[-1])
        policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
    assert kinds == (["select"] * (EXPLORE_EVERY - 1) + ["whole"]) * 2
    # a look (after a plain stretch) measures the rounds the policy runs: never an exploration
    while policy.since_explore[2] != EXPLORE_EVERY - 2:
        policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
    policy.after_round(2, True, draft_ms=0.0, accept_ms=0.1, rate=100.0)  # plain beats it
    policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=1.0)   # -> a plain stretch
    assert policy.plain_round() and policy.since_explore[2] == EXPLORE_EVERY - 1
    assert policy.plan(2) == "plain" and policy.width(2, 2, "plain") == 1
    while policy.plain_round():
        policy.after_round(2, True, draft_ms=0.0, accept_ms=0.1, rate=100.0)
    assert policy.looking and policy.plan(2) == "select" and policy.width(2, 2) == T


def test_a_choice_of_every_node_is_followed_by_whole_rounds():
    """When goodput's choice keeps every drafted node, the next WHOLE_ROUNDS rounds verify
    whole trees without selecting (and learn only when they explore), then it chooses again;
    a choice that drops nodes, or another policy, starts no such stretch."""
    from bole.speculative.budget.goodput import EXPLORE_EVERY, WHOLE_ROUNDS
    T = 4
    policy = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                          profile=_profile(1.0, t_dec_ms=100.0, slope=0.5, T=T))
    assert policy.plan(2) == "select"
    policy.observe(2, [T, 3], "select")                # one request lost a node: no stretch
    assert policy.plan(2) == "select"
    policy.observe(2, [T, T], "select")
    policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
    kinds = []
    for _ in range(WHOLE_ROUNDS + 1):
        kind = policy.plan(2)
        kinds.append((kind, policy.learns(kind, 2), policy.exploring(2)))
        policy.observe(2, [T, T], kind)            # whole rounds' counts start nothing
        policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=10.0)
    assert [k for k, _, _ in kinds] == ["whole"] * WHOLE_ROUNDS + ["select"]
    assert all(learn == (k == "select" or explore) for k, learn, explore in kinds)
    assert sum(explore for _, _, explore in kinds) == (WHOLE_ROUNDS + 1) // EXPLORE_EVERY
    assert policy.last_kept[2] == T
    # a stretch follows its batch: another bucket's round, or a plain stretch, ends it
    policy.observe(2, [T, T], "select")
    assert policy.width(2, 2) == T and policy.plan(4) == "select" and policy.plan(2) == "select"
    policy.observe(2, [T, T], "select")
    while not policy.plain_round():
        assert policy.whole_left
        policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=1e-6)
    assert not policy.whole_left
    glob = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="global",
                                   shared_budget=2), T)
    glob.observe(2, [T, T], "select")
    assert glob.plan(2) == "select" and not glob.learns("select", 2)


def test_whole_stretches_double_while_the_choice_stays_whole():
    """Each choice in a row that keeps every drafted node doubles the next whole stretch, up to
    WHOLE_ROUNDS_MAX; a choice that drops a node, or a plain stretch, starts over."""
    from bole.speculative.budget.goodput import WHOLE_ROUNDS, WHOLE_ROUNDS_MAX
    T = 4
    policy = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                          profile=_profile(1.0, t_dec_ms=100.0, slope=0.5, T=T))

    def stretch() -> int:
        """Choose whole trees, then count the whole rounds until the next choice."""
        assert policy.plan(2) == "select"
        policy.observe(2, [T, T], "select")
        n = 0
        while policy.plan(2) == "whole":
            n += 1
            policy.observe(2, [T, T], "whole")
        return n

    expected, n = [], WHOLE_ROUNDS
    for _ in range(6):
        expected.append(n)
        n = min(2 * n, WHOLE_ROUNDS_MAX)
    assert expected[-1] == WHOLE_ROUNDS_MAX > WHOLE_ROUNDS
    policy.explore_every = lambda R: 10 ** 9          # no exploring round inside the stretches
    assert [stretch() for _ in expected] == expected
    policy.observe(2, [T, 3], "select")                # a choice that drops a node
    assert not policy.whole_left.get(2) and stretch() == WHOLE_ROUNDS
    assert stretch() == 2 * WHOLE_ROUNDS
    policy.observe(2, [T, T], "select")
    for _ in range(3):                                 # drafting stops paying: a plain stretch
        policy.after_round(2, False, draft_ms=0.1, accept_ms=0.1, rate=1e-6)
    assert policy.plain_round() and not policy.whole_left
    while policy.plain_round():
        policy.after_round(2, True, draft_ms=0.0, accept_ms=0.1, rate=1e-6)
    assert stretch() == WHOLE_ROUNDS


def test_each_policy_names_the_rounds_it_can_run():
    """The graphs a bucket captures: fixed and whole-tree buckets one whole round, selecting
    buckets every width, goodput its plain round and a whole round with and without learning
    (without only, in a bucket of whole trees: it never explores)."""
    T = 4
    fixed = make_policy(SpecConfig("bole", "mtp", budget=T), T)
    assert fixed.variants(2) == [("whole", T, False)]
    glob = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="global",
                                   shared_budget=6), T)
    assert glob.variants(2) == [("whole", T, False)]
    assert glob.variants(4) == [("select", W, False) for W in width_buckets(T)]
    goodput = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                           profile=_profile(1.0, slope=0.5, T=T))
    extra = [("plain", 1, False), ("whole", T, False), ("whole", T, True)]
    assert goodput.variants(2) == extra + [("select", W, True) for W in width_buckets(T)]
    flat = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                        profile=_profile(1.0, slope=0.0, T=T))
    assert flat.whole_trees(2) and flat.variants(2) == extra[:2]


def test_whole_tree_rounds_verify_every_drafted_node(model):
    """Against a flat verify curve, goodput rounds skip the selection: every drafted node is
    verified (as the fixed policy verifies them), and greedy output is plain decoding's."""
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=3,
                    budget_profile=_profile(1000.0, slope=0.0, T=spec.nodes_per_request))
    fixed = Engine(model, SpecConfig(**{**spec.__dict__, "budget_policy": "fixed"}),
                   max_slots=3)
    res = engine.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    assert all(engine.rounds.policy.whole_trees(R) for R in engine.rounds.buffers)
    want = fixed.generate(PROMPTS, params, continuations=ar)
    assert [r.accepted for r in res] == [r.accepted for r in want]
    assert engine.timings.summary()["draft_nodes_per_round"] > 0


def _goodput_case(model, params):
    """Plain decoding's output of PROMPTS, and a goodput spec over the replay drafter (its rho
    follows its profile, so drafting is likely to pay; the random head's rho is ~0)."""
    ar = [r.token_ids for r in Engine(model, SpecConfig(mode="ar"), gdn_backend="torch-serial")
          .generate(PROMPTS, params)]
    return ar, SpecConfig("bole", "replay", depth=4, topk=3, budget=12, budget_policy="goodput",
                          acceptance="qwen3-next-mtp")


def test_goodput_drafts_when_it_pays_and_decodes_plainly_when_not(model):
    """Against a profile whose decode takes 1 s, drafting delivers more (tokens per round > 1);
    against a decode of 1 us it delivers less, and the batch decodes plainly, drafting again
    after AR_ROUNDS rounds to look; greedy output is plain decoding's either way."""
    from bole.speculative.budget.goodput import AR_ROUNDS, FIRST_ROUNDS
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    cheap = Engine(model, spec, max_slots=3,
                   budget_profile=_profile(1000.0, T=spec.nodes_per_request))
    res = cheap.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    assert res[0].accepted[0] > 1 and sum(r.mean_accepted_tokens for r in res) / 3 > 1.5
    costly = Engine(model, spec, max_slots=3,
                    budget_profile=_profile(1000.0, t_dec_ms=1e-3, T=spec.nodes_per_request))
    res = costly.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    rounds = res[0].accepted                    # tokens per round of the first request
    # the plain rounds after the bucket's first FIRST_ROUNDS drafting rounds
    assert rounds[FIRST_ROUNDS:FIRST_ROUNDS + AR_ROUNDS] == [1] * AR_ROUNDS
    assert costly.rounds.policy.overhead_ms > 0
    assert costly.timings.summary()["plain_round_share"] > 0.5
    assert cheap.timings.summary()["plain_round_share"] < 0.5


def test_goodputs_plain_rounds_verify_only_the_roots(model, monkeypatch):
    """A plain round of the goodput policy is plain decoding: one forward of one token a row
    (the roots) with the in-place decode recurrence, not the last drafted tree verified again."""
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    costly = Engine(model, spec, max_slots=3,
                    budget_profile=_profile(1000.0, t_dec_ms=1e-3, T=spec.nodes_per_request))
    forwards = record_forwards(costly, monkeypatch)
    res = costly.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    plain = costly.timings.plain_rounds
    assert plain > 0
    assert forwards.count((1, "torch-decode")) == plain, forwards


def test_goodput_learns_acceptance_from_its_rounds(model):
    """The goodput policy counts every verified draft node against whether it was accepted and
    refits its rho -> acceptance map every FIT_EVERY drafting rounds: after a run the counts
    equal the verified draft nodes, the accepted ones the drafted tokens that were emitted, and
    the table has moved off its prior where nodes were seen."""
    from bole.speculative.budget.goodput import FIT_EVERY
    params = SamplingParams(max_tokens=40)
    model = HybridModel(model.config, dict(model.w), gdn_backend="torch")   # nothing learnt yet
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=3,
                    budget_profile=_knee_profile(spec.nodes_per_request))
    calib = engine.rounds.calibrator
    prior = calib.table.clone()
    res = engine.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    drafted_rounds = sum(len(r.accepted) for r in res)
    assert drafted_rounds >= FIT_EVERY
    accepted_drafts = sum(n - 1 for r in res for n in r.accepted)
    assert float(calib.hits.sum()) == accepted_drafts > 0
    assert float(calib.count.sum()) > accepted_drafts       # some drafted nodes were rejected
    assert not torch.equal(calib.table, prior)
    # the select rounds reported whether anything past their fill could change the choice
    assert set(engine.rounds.policy.could_widen.values()) <= {True, False}
    assert engine.rounds.policy.could_widen
    table = calib.table.tolist()
    assert all(a <= b + 1e-12 for a, b in zip(table, table[1:]))


def test_engines_of_one_model_share_what_goodput_learnt(model):
    """Acceptance per rho belongs to a model and its drafter: a second engine of the same model
    and drafter starts from the first one's estimates; another drafter or model does not."""
    _, spec = _goodput_case(model, SamplingParams(max_tokens=4))
    profile = _profile(1000.0, T=spec.nodes_per_request)
    first = Engine(model, spec, max_slots=3, budget_profile=profile)
    second = Engine(model, spec, max_slots=2, budget_profile=profile)
    assert second.rounds.calibrator is first.rounds.calibrator
    other_vocab = Engine(model, SpecConfig(**{**spec.__dict__, "draft_vocab": 64}), max_slots=3,
                         budget_profile=_profile(1000.0, T=spec.nodes_per_request))
    assert other_vocab.rounds.calibrator is not first.rounds.calibrator
    twin = HybridModel(model.config, dict(model.w), gdn_backend="torch")
    assert Engine(twin, spec, max_slots=3, budget_profile=profile).rounds.calibrator \
        is not first.rounds.calibrator


def test_goodput_looks_less_often_while_drafting_keeps_not_paying():
    """Each look (a drafting round after plain ones) that again finds drafting does not pay
    doubles the plain stretch, up to AR_ROUNDS_MAX; a look that drafts resets it."""
    from bole.speculative.budget.goodput import AR_ROUNDS, AR_ROUNDS_MAX, FIRST_ROUNDS
    policy = make_policy(SpecConfig("bole", budget=4, budget_policy="goodput"), 4,
                          profile=_profile(1.0, t_dec_ms=1.0, T=4))
    for _ in range(FIRST_ROUNDS - 1):                # the bucket's first rounds: no decision
        policy.after_round(1, False, draft_ms=1.0, accept_ms=0.1, rate=0.1)
        assert not policy.plain_round()
    stretches = []
    for _ in range(7):
        policy.after_round(1, False, draft_ms=1.0, accept_ms=0.1, rate=0.1)   # a look: no
        n = 0
        while policy.plain_round():
            policy.after_round(1, True, draft_ms=0.0, accept_ms=0.1, rate=0.5)
            n += 1
        stretches.append(n)
    assert stretches == [min(AR_ROUNDS * 2 ** i, AR_ROUNDS_MAX) for i in range(7)]
    policy.after_round(1, False, draft_ms=1.0, accept_ms=0.1, rate=2.0)   # a look: yes
    assert not policy.plain_round()
    while not policy.plain_round():                  # drafting stops paying again
        policy.after_round(1, False, draft_ms=1.0, accept_ms=0.1, rate=0.0)
    assert policy.ar_rounds_left == AR_ROUNDS


def test_goodput_is_refused_under_tensor_parallelism(model):
    """Goodput decides on each rank's host from its own timings: tensor-parallel ranks could
    part ways (one decoding plainly, one verifying trees) and their collectives would not
    match, so an engine refuses it there and names the policies that work."""
    import types
    twin = HybridModel(model.config, dict(model.w), gdn_backend="torch")
    twin.tp = types.SimpleNamespace(world=2)
    _, spec = _goodput_case(model, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="tensor-parallel ranks.*fixed, global or calibrated"):
        Engine(twin, spec, max_slots=2,
               budget_profile=_profile(1000.0, T=spec.nodes_per_request))


def test_budget_eps_derives_b_ver_from_the_profiles_curves(model):
    """``budget_eps`` (``--budget-eps``) sets the calibrated policy's tolerance without
    measuring again: B_ver at that eps from the same curves; greedy output unchanged."""
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8, budget_policy="calibrated")
    # t_ver 1000, 1010, 1020, 1030, 1040 at N = 1, 2, 4, 8, 16 against t_dec 1000; B_ver is
    # the passing N raised to its verify width's capacity at batches 1, 2, 4 (widths 8, 4, 2 at
    # eps 0.025; at eps 0 N = 2 and 4 of width 2 failed, so B_ver stays 1); without budget_eps
    # the profile is used as given
    profile = _profile(1000.0, T=spec.nodes_per_request)
    params = SamplingParams(max_tokens=10)
    ar = [r.token_ids for r in Engine(model, SpecConfig(mode="ar")).generate(PROMPTS, params)]
    for eps, b_ver in ((None, [16, 16, 16]), (0.0, [1, 1, 1]), (0.025, [7, 6, 4]),
                       (1.0, [7, 14, 28])):
        engine = Engine(model, replace(spec, budget_eps=eps), max_slots=3,
                        budget_profile=profile)
        used = engine.rounds.policy.profile
        assert used.b_ver == b_ver and used.eps == (0.1 if eps is None else eps)
        assert engine.rounds.policy.budget(2) == b_ver[1]
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == ar
    assert profile.b_ver == [16, 16, 16]                 # the caller's profile is not changed
    for bad, match in ((replace(spec, budget_eps=-1.0), "budget_eps must be"),
                       (replace(spec, budget_eps=True), "budget_eps must be"),
                       (replace(spec, budget_eps=float("nan")), "budget_eps must be"),
                       (replace(spec, budget_policy="goodput", budget_eps=0.5),
                        "calibrated policy's tolerance")):
        with pytest.raises(ValueError, match=match):
            bad.validate()


def test_goodput_enters_a_bucket_at_the_width_of_the_nearest_one_that_chose():
    """A bucket's first select round: goodput's budget (the node grid's largest point) spread
    evenly would verify whole trees; it takes the width the nearest bucket chose (by ratio of
    rows, the larger on a tie), and then what its own rounds keep. Other policies keep the even
    share."""
    T = 32
    policy = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="goodput"), T,
                          profile=_profile(1.0, T=T))
    assert policy.width(4, 4, "select") == 8          # no bucket has chosen: 1 + ceil(16 / 4)
    policy.observe(64, [7, 5, 6], "select")
    policy.observe(16, [12, 3], "select")
    assert policy.width(32, 30, "select") == 8        # 16 and 64 equally near: the larger
    assert policy.width(8, 8, "select") == 16         # 16 is the nearest
    assert policy.width(128, 100, "select") == 8
    policy.observe(32, [3], "select")
    assert policy.width(32, 30, "select") == 4        # its own rounds from then on
    glob = make_policy(SpecConfig("bole", "mtp", budget=T, budget_policy="global",
                                   shared_budget=64), T)
    glob.observe(64, [3], "select")
    assert glob.width(8, 8, "select") == 16           # 1 + ceil(64 / 8) = 9
