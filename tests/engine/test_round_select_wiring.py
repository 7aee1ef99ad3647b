"""What a goodput round hands the batch-shared selection and the policy: the rows that are
requests (padding rows keep only their roots), the round's verify width, the goodput term with
the policy's round overhead and the learnt acceptance map; and, in whole-tree rounds, each row's own kept count. Wrong ones keep
the tokens (verification is exact) and lose speed, which no output test sees."""

import torch

from bole.engine import Engine, SamplingParams
from bole.engine import phases
from tests.engine.forward_spy import record_plans
from tests.engine.test_budget_policy import PROMPTS, _goodput_case, _profile, model  # noqa: F401


def test_a_select_round_passes_its_rows_width_goodput_and_acceptance(model, monkeypatch):  # noqa: F811
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=3,
                    budget_profile=_profile(1000.0, T=spec.nodes_per_request))
    calls = []
    real = phases.select

    def spy(rho, tokens, parents, valid, budget, active, root_floor, width, max_depth,
            goodput=None, acceptance=None, row_width=None):
        R = rho.shape[0]
        calls.append((active.clone(), width, goodput, acceptance, rho.shape,
                      float(goodput.overhead_ms) if goodput is not None else None,
                      engine.rounds.policy.round_overhead_ms(R)))
        return real(rho, tokens, parents, valid, budget, active, root_floor, width, max_depth,
                    goodput=goodput, acceptance=acceptance, row_width=row_width)
    monkeypatch.setattr(phases, "select", spy)
    res = engine.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    assert calls, "no select round ran"
    for active, width, goodput, acceptance, (R, T), overhead, policy_overhead in calls:
        assert active.dtype == torch.bool and active.shape == (R,)
        assert 1 <= int(active.sum()) <= len(PROMPTS) and not active[len(PROMPTS):].any()
        assert isinstance(width, int) and 1 <= width <= T
        assert goodput is not None and acceptance is engine.rounds.calibrator
        # the width choice on the device adds the policy's own round overhead (draft, accept)
        assert overhead == policy_overhead
    assert any(overhead > 0 for *_, overhead, _ in calls)


def test_a_whole_round_tells_the_policy_each_rows_own_kept_count(model, monkeypatch):  # noqa: F811
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    engine = Engine(model, spec, max_slots=3,
                    budget_profile=_profile(1000.0, slope=0.0, T=spec.nodes_per_request))
    policy = engine.rounds.policy
    kept = []
    observe = policy.observe

    def spy(R, counts, *args, **kwargs):
        kept.append(list(counts))
        return observe(R, counts, *args, **kwargs)
    monkeypatch.setattr(policy, "observe", spy)
    res = engine.generate(PROMPTS, params, continuations=ar)
    assert [r.token_ids for r in res] == ar
    assert all(policy.whole_trees(R) for R in engine.rounds.buffers)
    assert kept and any(kept)
    # a row keeps at most its own tree: the root and its drafted nodes
    assert all(1 <= k <= spec.nodes_per_request for counts in kept for k in counts), kept


def test_only_the_rounds_that_learn_feed_the_acceptance_map(model, monkeypatch):  # noqa: F811
    """Goodput learns its rho -> acceptance map from select rounds and exploring whole rounds
    only; a bucket of whole trees never explores, so its rounds leave the map alone."""
    params = SamplingParams(max_tokens=24)
    ar, spec = _goodput_case(model, params)
    for slope, learns in ((0.0, False), (0.01, True)):
        engine = Engine(model, spec, max_slots=3,
                        budget_profile=_profile(1000.0, slope=slope, T=spec.nodes_per_request))
        seen, plans = [], record_plans(engine, monkeypatch)
        calib = engine.rounds.calibrator
        observe = calib.observe
        monkeypatch.setattr(calib, "observe",
                            lambda *a, _seen=seen, _observe=observe, **k:
                            (_seen.append(1), _observe(*a, **k)))
        res = engine.generate(PROMPTS, params, continuations=ar)
        assert [r.token_ids for r in res] == ar
        planned = [p.learn for p in plans]
        assert len(seen) == sum(planned)
        assert (sum(planned) > 0) == learns, planned
