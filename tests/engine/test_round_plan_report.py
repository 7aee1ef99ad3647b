"""What the round asks of the budget policy and tells it, beyond the tokens (which verification
keeps exact whatever these are): the plan's width and learning for its own kind, the trees'
branching, the snapshot store reserved up front, the acceptance map refit every FIT_EVERY
learning rounds, the draft depth a round reports, and which rounds' times goodput may average."""

import itertools

import pytest
from bole.engine import Engine, SamplingParams, SpecConfig
from bole.speculative.budget.goodput import FIT_EVERY
from tests.engine.forward_spy import record_plans
from tests.engine.test_budget_policy import (PROMPTS, _goodput_case, _knee_profile,  # noqa: F401
                                             _profile, model)


def _mtp_goodput(**kw) -> SpecConfig:
    return SpecConfig("bole", "mtp", depth=3, topk=2, budget=6, budget_policy="goodput", **kw)


def test_a_plan_asks_the_policy_for_its_own_kinds_width_and_learning(model, monkeypatch):  # noqa: F811
    """Each plan asks the width and the learning of the kind the policy just planned, for its
    bucket: asked without the kind, the policy answers for the kind it would plan next (after
    a whole stretch's last round, a select width for a whole round)."""
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=3,
                    budget_profile=_profile(1000.0, T=spec.nodes_per_request))
    policy, rounds = engine.rounds.policy, engine.rounds
    asked, plans = [], record_plans(engine, monkeypatch)
    width, learns = policy.width, policy.learns
    monkeypatch.setattr(policy, "width", lambda *a: (asked.append(("width", a)), width(*a))[1])
    monkeypatch.setattr(policy, "learns", lambda *a: (asked.append(("learns", a)), learns(*a))[1])
    res = engine.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    assert len(asked) == 2 * len(plans) and {p.kind for p in plans} >= {"select", "whole"}
    for p, (w, lr) in zip(plans, zip(asked[::2], asked[1::2])):
        n = len(p.requests)
        assert w == ("width", (p.R, n, p.kind)) and lr == ("learns", (p.kind, p.R))
        assert p.width == {"plain": 1, "whole": spec.nodes_per_request}.get(p.kind, p.width)
    kinds = [p.kind for p in plans]                  # a whole stretch ended: its last round
    assert any(a == "whole" and b == "select" for a, b in zip(kinds, kinds[1:])), kinds


@pytest.mark.parametrize("mode,branches", [("bole", True), ("tree-serial", True),
                                           ("chain", False)])
def test_trees_branch_top_k_wide_and_chains_do_not(model, mode, branches):  # noqa: F811
    """The drafted trees the round verifies: top-k children per node in bole and tree-serial,
    one in chain."""
    engine = Engine(model, SpecConfig(mode, "mtp", depth=3, topk=2, budget=6), max_slots=2)
    widest = []
    verify = engine.rounds._verify

    def spy(b, W, kind):
        parents, valid = b.tree_parents[:1], b.tree_valid[:1]
        kids = [int(((parents[0] == i) & valid[0]).sum()) for i in range(parents.shape[1])]
        widest.append(max(kids))
        return verify(b, W, kind)
    engine.rounds._verify = spy
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=12))
    assert engine.rounds.topk == (2 if branches else 1) and widest
    assert max(widest) == (2 if branches else 1), widest


@pytest.mark.parametrize("mode", ["tree-serial", "chain"])
def test_the_serial_backends_snapshot_store_is_reserved_for_every_slots_tree(model, mode,  # noqa: F811
                                                                           monkeypatch):
    """The triton-serial backend (tree-serial, chain) keeps a per-node state snapshot: one
    store for every slot's tree, reserved when the engine starts and shared by every verify
    forward (so every batch bucket's graph shares it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = SpecConfig(mode, "mtp", depth=3, topk=2, budget=6)
    engine = Engine(model, spec, max_slots=3, gdn_backend="triton-serial")
    stores, nodes = engine.runner.reserved["linear_attention"]
    T = spec.nodes_per_request
    gdn = engine.model.linear["linear_attention"]
    assert nodes == 3 * T and len(stores) == len(gdn.cfg.layers)
    assert all(s.numel() == 3 * T * gdn.hv * gdn.dk * gdn.dv for s in stores)


def test_the_acceptance_map_is_refit_every_fit_every_learning_rounds(model, monkeypatch):  # noqa: F811
    """Goodput refits its rho -> acceptance map after every FIT_EVERY rounds that learn (here
    the policy's learning rounds but every third), counting from the engine's start; rounds
    that do not learn do not count."""
    params = SamplingParams(max_tokens=48)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=3,             # every round selects
                    budget_profile=_knee_profile(spec.nodes_per_request))
    policy, calib = engine.rounds.policy, engine.rounds.calibrator
    every_third = itertools.cycle([True, True, False])
    learns, fit = policy.learns, calib.fit
    monkeypatch.setattr(policy, "learns", lambda k, R: learns(k, R) and next(every_third))
    plans, fits = record_plans(engine, monkeypatch), []
    monkeypatch.setattr(calib, "fit", lambda: (fits.append(len(plans)), fit())[1])
    res = engine.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    learnt = list(itertools.accumulate(int(p.learn) for p in plans))
    want = [i + 1 for i, p in enumerate(plans) if p.learn and learnt[i] % FIT_EVERY == 0]
    assert len(want) >= 2 and not all(p.learn for p in plans)
    assert fits == want


def test_each_round_reports_the_depth_its_device_drafter_grew(model):  # noqa: F811
    """A round's timing names the depth its device drafter grew; a plain round (goodput's) and
    a host drafter's round name none."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for spec, profile in ((SpecConfig("bole", "mtp", depth=3, topk=2, budget=6), None),
                          (SpecConfig("bole", "ngram", depth=3, topk=2, budget=6), None),
                          (_mtp_goodput(), _profile(1000.0, t_dec_ms=1e-3, T=6))):
        engine = Engine(model, spec, max_slots=2, budget_profile=profile)
        reqs = [engine.new_request(i, p, params) for i, p in enumerate(PROMPTS[:2])]
        for r in reqs:
            engine.admit(r)
        seen = []
        while all(r.result is None for r in reqs):
            t = engine.step(reqs)
            seen.append((t["plain"], t["depth"]))
        if spec.drafter == "ngram":
            assert {d for _, d in seen} == {None}
        elif profile is None:
            assert {d for _, d in seen} == {3}
        else:
            assert {d for plain, d in seen if plain} == {None}
            assert any(plain for plain, _ in seen) and all(
                isinstance(d, int) and 1 <= d <= 3 for plain, d in seen if not plain)
        for r in reqs:
            engine.release(r)


def test_goodput_does_not_average_a_round_that_dropped_a_queued_draft(model, monkeypatch):  # noqa: F811
    """A draft queued before the last round's synchronisation that this round cannot use (its
    rows changed) still ran: the round's time holds it, and goodput is told not to average it.
    The rounds before, and those after that reuse their queued draft, are measured."""
    engine = Engine(model, _mtp_goodput(), max_slots=4,
                    budget_profile=_profile(1000.0, T=6))
    policy = engine.rounds.policy
    measured, after_round = [], policy.after_round
    monkeypatch.setattr(policy, "after_round", lambda *a, **k: (
        measured.append(k["measured"]), after_round(*a, **k))[1])
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    reqs = [engine.new_request(i, p, params) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.admit(r)
    for _ in range(3):
        engine.step(reqs, prelaunch=True)
    assert engine.rounds._pending is not None          # the fourth round's draft is queued
    engine.release(reqs[2])                             # ... for rows that then change
    for _ in range(3):
        engine.step(reqs[:2], prelaunch=True)
    assert engine.timings.plain_rounds == 0             # drafting pays at this profile
    assert measured == [True, True, True, False, True, True]
    for r in reqs[:2]:
        engine.release(r)

