"""Goodput's draft depth (bole/speculative/budget/draft_depth.py): the survival counts and the choice against
brute force, the probe rounds, the round's plan, and greedy output unchanged when whole rounds
grow fewer levels (also with drafts queued before the choice changed)."""

import random

import pytest

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.speculative.budget.draft_depth import DraftDepth, fill_depths, MIN_ROWS, PROBE_EVERY
from bole.speculative.budget.registry import make_policy
from tests.engine.test_budget_policy import PROMPTS, _goodput_case, _profile
from tests.engine.test_budget_policy import model  # noqa: F401  (the fixture)


def test_fill_depths_are_the_depths_whose_growth_fills_the_tree():
    assert fill_depths(4, 8, 32) == (3, 4, 5, 6, 7, 8)      # 1 + 4 + 16 (d - 1) >= 32
    assert fill_depths(3, 4, 12) == (2, 3, 4)
    assert fill_depths(1, 6, 7) == (6,)                       # a chain fills only at its depth
    assert fill_depths(4, 2, 100) == (2,)                     # none fills: the deepest
    with pytest.raises(ValueError, match="ascending"):
        DraftDepth((4, 3))


@pytest.mark.parametrize("seed", range(5))
def test_survival_counts_equal_brute_force(seed):
    rng = random.Random(seed)
    dd = DraftDepth((2, 3, 4, 5, 6))
    rows = []                                     # (grown depth, accepted) of every row
    for _ in range(30):
        depth = rng.choice(dd.depths)
        accepted = [rng.randint(0, depth) for _ in range(rng.randint(0, 5))]
        rows += [(depth, a) for a in accepted]
        dd.observe(1, depth, accepted, draft_ms=1.0, rest_ms=1.0)
    for k in range(1, 7):
        reach = sum(1 for d, a in rows if d >= k and a >= k - 1)
        passed = sum(1 for d, a in rows if d >= k and a >= k)
        assert (dd.reach[k], dd.passed[k]) == (reach, passed), k
        assert dd.survival(k) == pytest.approx((passed + 1) / (reach + 2))
    p, want = 1.0, 1.0
    for k in range(1, 5):
        p *= dd.survival(k)
        want += p
    assert dd.expected_tokens(4) == pytest.approx(want)


def test_draft_time_is_measured_or_read_off_the_measured_depths():
    dd = DraftDepth((3, 4, 5, 6, 7, 8))
    assert dd.draft_time(1, 8) is None
    dd.observe(1, 8, [], draft_ms=0.4, rest_ms=0.5)
    assert dd.draft_time(1, 8) == pytest.approx(0.4)
    assert dd.draft_time(1, 6) == pytest.approx(0.3)          # one depth: proportional
    dd.observe(1, 6, [], draft_ms=0.32, rest_ms=0.5)          # 0.04 a level, 0.08 fixed
    assert dd.draft_time(1, 4) == pytest.approx(0.24)
    assert dd.draft_time(1, 7) == pytest.approx(0.36)
    assert dd.draft_time(2, 7) is None                        # per bucket


@pytest.mark.parametrize("survive,level_ms,want", [
    (0.95, 0.01, 8),            # deep levels accepted, cheap: every level pays
    (0.3, 0.2, 3),              # rarely accepted, each level a fifth of the rest: the shallowest
    (0.8, 0.05, None),          # in between: brute force decides
])
def test_the_choice_equals_brute_force(survive, level_ms, want):
    """Rows accept each level with probability ``survive`` (the counts of a large sample); the
    draft costs ``level_ms`` a level over 1 ms of the rest of the round."""
    dd = DraftDepth((3, 4, 5, 6, 7, 8))
    n = 10_000
    accepted = []
    for a in range(9):                                      # geometric, cut at the depth
        share = survive ** a * (1 - survive) if a < 8 else survive ** 8
        accepted += [a] * round(n * share)
    dd.observe(4, 8, accepted, draft_ms=8 * level_ms, rest_ms=1.0)
    dd.observe(4, 4, [], draft_ms=4 * level_ms, rest_ms=1.0)
    rate = {d: dd.expected_tokens(d) / (1.0 + d * level_ms) for d in dd.depths}
    brute = max(dd.depths, key=lambda d: (rate[d], d))
    assert dd.best(4) == brute
    if want is not None:
        assert brute == want


def test_no_choice_below_the_deepest_before_enough_rows():
    dd = DraftDepth((3, 4, 5, 6, 7, 8))
    dd.observe(1, 8, [0] * (MIN_ROWS - 1), draft_ms=10.0, rest_ms=0.1)
    assert dd.chosen[1] == 8                          # shallow would pay, but too few rows
    dd.observe(1, 8, [0], draft_ms=10.0, rest_ms=0.1)
    assert dd.chosen[1] == 3


def test_a_probe_round_grows_one_level_past_the_choice():
    dd = DraftDepth((3, 4, 5, 6, 7, 8))
    dd.chosen[1] = 5
    depths = []
    for _ in range(3 * PROBE_EVERY):
        d = dd.depth(1)
        dd.planned(1, d)
        depths.append(d)
    assert depths == ([5] * (PROBE_EVERY - 1) + [6]) * 3
    dd.chosen[1] = 8
    assert dd.depth(1) == 8                           # nothing deeper to probe


def _whole_policy(T=12, depth=4, topk=3):
    """A goodput policy whose buckets verify whole trees (a flat verify time)."""
    spec = SpecConfig("bole", "mtp", depth=depth, topk=topk, budget=T, budget_policy="goodput")
    return make_policy(spec, spec.nodes_per_request,
                        profile=_profile(1.0, slope=0.0, T=spec.nodes_per_request))


def test_whole_rounds_take_the_choice_select_and_exploring_rounds_the_deepest():
    policy = _whole_policy()
    assert policy.draft_depths() == (2, 3, 4)
    assert policy.whole_trees(1)
    policy.depth.chosen[1] = 2
    assert policy.plan(1) == "whole" and policy.round_depth(1) == 2
    assert policy.takes_draft(1, 4) and policy.takes_draft(1, 2)    # any depth: nothing chosen
    sel = _whole_policy()
    sel._whole[2] = False                              # a bucket that selects
    sel.depth.chosen[2] = 2
    assert sel.plan(2) == "select" and sel.round_depth(2) == 4
    assert not sel.takes_draft(2, 2)                   # a select round chooses from every level
    sel.could_widen[2] = True
    sel.since_explore[2] = 100
    assert sel.plan(2) == "whole" and sel._explores[2] and sel.round_depth(2) == 4
    assert not sel.takes_draft(2, 3)                   # an exploring round learns every level
    # no depth choice where only one depth fills the tree, nor for host drafters or fixed
    assert _whole_policy(T=31, depth=4, topk=3).depth is None
    assert make_policy(SpecConfig("bole", "ngram", budget_policy="goodput"), 16,
                        profile=_profile(1.0, T=16)).depth is None


@pytest.mark.parametrize("seed", range(4))
def test_next_depth_is_what_the_next_plan_gives(seed):
    """The depth a queued draft grows equals the next round's planned depth whenever the round
    in between changes nothing (its observe starts no stretch, its after_round does not fall
    back to plain decoding): over random sequences of buckets, choices and explorations."""
    rng = random.Random(seed)
    policy = _whole_policy()
    policy._whole[2] = False                         # bucket 2 selects and explores
    policy.could_widen[2] = True
    for _ in range(300):
        if rng.random() < 0.3:
            policy.depth.chosen[rng.choice((1, 2))] = rng.choice((2, 3, 4))
        R = rng.choice((1, 2))
        kind = policy.plan(R)
        if kind != "plain":
            policy.drafts(R, kind, policy.round_depth(R))
        predicted = policy.next_depth(R)
        policy.after_round(R, kind == "plain", 1.0, 1.0, rate=1.0, measured=False)
        assert policy.plan(R) is not None and policy.round_depth(R) == predicted


def test_greedy_output_is_unchanged_at_every_depth(model):
    """Whole rounds grown to a depth drawn at random each round (the choice replaced), in a
    batch that stays (its drafts queued before the round that takes them) and in one whose rows
    change (a slot short): greedy output equals plain decoding's, at several depths."""
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    for slots in (3, 2):
        engine = Engine(model, spec, max_slots=slots,
                        budget_profile=_profile(1000.0, slope=0.0, T=spec.nodes_per_request))
        policy = engine.rounds.policy
        rng = random.Random(slots)
        policy.depth.best = lambda R: rng.choice(policy.depth.depths)
        res = engine.generate(PROMPTS, params, continuations=ar)
        assert [r.token_ids for r in res] == ar
        by_depth = engine.timings.by_depth
        assert len(by_depth) >= 2 and set(by_depth) <= set(policy.draft_depths()), by_depth


def test_whole_rounds_grow_the_chosen_depth_and_probe_one_level_more(model):
    """With the choice fixed at the shallowest depth, the whole rounds of a run grow it, except
    the probe rounds (every PROBE_EVERY-th, one level deeper) and the rounds before the choice
    (the first, and the next one, whose draft was queued before the first choice)."""
    params = SamplingParams(max_tokens=60)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=1,
                    budget_profile=_profile(1000.0, slope=0.0, T=spec.nodes_per_request))
    policy = engine.rounds.policy
    policy.depth.best = lambda R: 2
    res = engine.generate(PROMPTS[:1], params, continuations=ar[:1])
    assert [r.token_ids for r in res] == ar[:1]
    by_depth = engine.timings.by_depth
    rounds = sum(by_depth.values())
    # depth 4: the first round, and the one whose draft was queued before the first choice
    assert set(by_depth) == {2, 3, 4} and by_depth[4] == 2
    assert by_depth[3] == rounds // PROBE_EVERY and by_depth[2] == rounds - 2 - by_depth[3]


def test_unmeasured_rounds_leave_the_times_and_halving_keeps_the_survival():
    dd = DraftDepth((3, 4, 5, 6, 7, 8))
    dd.observe(1, 8, [3, 8], draft_ms=0.4, rest_ms=0.6, hidden_ms=0.1)
    dd.observe(1, 8, [2], draft_ms=9.0, rest_ms=9.0, measured=False, hidden_ms=9.0)
    assert (dd.draft_ms[1][8], dd.rest_ms[1], dd.hidden_ms[1]) == (0.4, 0.6, 0.1)
    assert dd.reach[1] == 3                             # the rows count either way
    from bole.speculative.budget.draft_depth import MAX_COUNT
    big = DraftDepth((3, 4))
    big.observe(1, 4, [2, 4] * int(MAX_COUNT), draft_ms=1.0, rest_ms=1.0)   # 2 MAX_COUNT rows
    assert (big.reach[1], big.reach[3], big.passed[3]) == (MAX_COUNT, MAX_COUNT, MAX_COUNT / 2)
    assert big.survival(3) == pytest.approx(0.5, rel=1e-3)


def test_a_draft_hidden_behind_the_host_saves_only_its_visible_part():
    """The choice prices a depth at the rest of the round plus the draft past what hides behind
    the host: with the whole draft hidden, fewer levels save nothing and the deepest wins."""
    dd = DraftDepth((3, 4, 5, 6, 7, 8))
    accepted = [0] * 100 + [8] * 5                       # deep levels rarely accepted
    dd.observe(1, 8, accepted, draft_ms=0.8, rest_ms=1.0)
    assert dd.best(1) < 8
    hid = DraftDepth((3, 4, 5, 6, 7, 8))
    hid.observe(1, 8, accepted, draft_ms=0.8, rest_ms=1.0, hidden_ms=0.8)
    assert hid.best(1) == 8


def test_the_round_feeds_the_choice_what_it_ran(model):
    """Every whole round reports to the choice the depth it grew (the drafted trees reach no
    deeper, and some reach it), the accepted draft tokens of its rows not near their limit, its
    draft time and the rest of its wall time (the CPU hides nothing)."""
    params = SamplingParams(max_tokens=40)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=2,
                    budget_profile=_profile(1000.0, slope=0.0, T=spec.nodes_per_request))
    rounds, policy = engine.rounds, engine.rounds.policy
    rng = random.Random(0)
    policy.depth.best = lambda R: rng.choice(policy.depth.depths)
    reports, grown, steps = [], [], []
    real_after, real_draft, real_run = policy.after_whole, rounds._draft, rounds.run

    def after_whole(*args):
        reports.append(args)
        return real_after(*args)

    def draft(b, d):
        real_draft(b, d)
        parents = b.tree_parents.tolist()
        deepest = 0
        for row, valid in zip(parents, b.tree_valid.tolist()):
            for i, ok in enumerate(valid):
                depth, j = 0, i
                while ok and parents and row[j] >= 0:
                    depth, j = depth + 1, row[j]
                deepest = max(deepest, depth)
        grown.append((d, deepest))

    def run(plan):
        remaining = [r.remaining for r in plan.requests]
        result = real_run(plan)
        steps.append((remaining, [len(t) for t in result.tokens], result.timing))
        return result
    policy.after_whole, rounds._draft, rounds.run = after_whole, draft, run
    res = engine.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    whole = [(rem, n, t) for rem, n, t in steps if t["kind"] == "whole"]
    assert len(reports) == len(whole) > 10
    for (R, depth, accepted, draft_ms, rest_ms, measured, hidden), (rem, n, t) in \
            zip(reports, whole):
        assert depth == t["depth"] and hidden == 0.0
        assert accepted == [c - 1 for c, left in zip(n, rem) if left > spec.depth]
        assert draft_ms == t["draft"] and rest_ms == pytest.approx(t["total"] - t["draft"])
    assert all(deepest <= d for d, deepest in grown)
    assert {d for d, deepest in grown if deepest == d} == {d for d, _ in grown}


def test_a_select_round_drafts_again_over_a_shallower_queued_draft(model):
    """A draft queued at the choice's depth for a round that then selects (it chooses from every
    level) is dropped, and the round grows the deepest tree."""
    params = SamplingParams(max_tokens=40)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=1,
                    budget_profile=_profile(1000.0, slope=0.0, T=spec.nodes_per_request))
    rounds, policy = engine.rounds, engine.rounds.policy
    policy.depth.best = lambda R: 2
    depths = []
    real = rounds._draft
    rounds._draft = lambda b, d: (depths.append(d), real(b, d))[1]
    r = engine.new_request(0, PROMPTS[0], params)
    r.continuation = ar[0]
    engine.admit(r)
    engine.step([r], prelaunch=True)        # whole at 4, queues 4 (chosen after the sync)
    second = engine.step([r], prelaunch=True)       # takes the queued 4, queues the choice's 2
    assert second["kind"] == "whole" and second["depth"] == 4 and depths == [4, 4, 2]
    policy._whole[1] = False                         # the bucket selects from now on
    third = engine.step([r], prelaunch=True)
    assert third["kind"] == "select" and third["depth"] == 4 and depths[3] == 4
