"""The speculative configuration a user passes (``--mode``, ``--drafter``, the tree shape, the
budget policy and its options): every documented limit is taken at its edge and refused just
outside it, with the whole message ``bole generate`` / ``bole serve`` print; the default drafter
follows the model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bole.engine.spec import MAX_BUDGET, MAX_DEPTH, MAX_TOPK, MODES, SpecConfig, default_drafter

SHAPE = (f"need 1 <= depth <= {MAX_DEPTH}, 1 <= topk <= {MAX_TOPK} and 2 <= budget <= "
         f"{MAX_BUDGET}; got depth={{}}, topk={{}}, budget={{}}")


@pytest.mark.parametrize("kw", [
    dict(depth=1), dict(depth=MAX_DEPTH), dict(topk=1), dict(topk=MAX_TOPK), dict(budget=2),
    dict(budget=MAX_BUDGET), dict(depth=1, topk=1, budget=2),
    dict(depth=MAX_DEPTH, topk=MAX_TOPK, budget=MAX_BUDGET), dict(root_floor=0),
    dict(drafter="mtp", draft_vocab=4, topk=4), dict(drafter="mtp", draft_vocab=0),
    dict(budget_policy="calibrated", budget_eps=0), dict(budget_policy="calibrated", budget_eps=0.0),
    dict(budget_policy="calibrated", budget_eps=1e9 - 1), dict(drafter="replay", mode="ar"),
    dict(drafter="replay", acceptance="bundled"),
    dict(drafter="replay", acceptance="bundled", forced_acceptance=True),
] + [dict(mode=m) for m in MODES])
def test_a_configuration_at_the_edge_of_every_limit_is_taken(kw):
    SpecConfig(**kw).validate()


@pytest.mark.parametrize("kw, message", [
    (dict(mode="magic"), f"mode must be one of {MODES}, got 'magic'"),
    (dict(depth=0), SHAPE.format(0, 4, 16)),
    (dict(depth=MAX_DEPTH + 1), SHAPE.format(MAX_DEPTH + 1, 4, 16)),
    (dict(topk=0), SHAPE.format(6, 0, 16)),
    (dict(topk=MAX_TOPK + 1), SHAPE.format(6, MAX_TOPK + 1, 16)),
    (dict(budget=1), SHAPE.format(6, 4, 1)),
    (dict(budget=MAX_BUDGET + 1), SHAPE.format(6, 4, MAX_BUDGET + 1)),
    (dict(root_floor=-1), "root_floor must be >= 0, got -1"),
    (dict(drafter="mtp", draft_vocab=-1),
     "draft_vocab must be >= 0 (0: the whole vocabulary), got -1"),
    (dict(drafter="mtp", draft_vocab=3, topk=4),
     "a draft vocabulary of 3 tokens cannot give top-4 proposals; make it at least topk"),
    (dict(drafter="mtp", draft_vocab=1, topk=2),
     "a draft vocabulary of 1 tokens cannot give top-2 proposals; make it at least topk"),
    (dict(drafter="ngram", draft_vocab=8),
     "draft_vocab restricts the MTP head's proposals; the ngram drafter has none (leave it at 0)"),
    (dict(forced_acceptance=True),
     "forced_acceptance replays a known continuation: it needs the replay drafter"),
    (dict(budget_eps=0.5),
     "budget_eps is the calibrated policy's tolerance; the fixed policy has none (leave it "
     "unset)"),
    (dict(budget_policy="calibrated", budget_eps=-0.1),
     "budget_eps must be a finite number in [0, 1e9), got -0.1"),
    (dict(budget_policy="calibrated", budget_eps=1e9),
     "budget_eps must be a finite number in [0, 1e9), got 1000000000.0"),
    (dict(budget_policy="calibrated", budget_eps=float("nan")),
     "budget_eps must be a finite number in [0, 1e9), got nan"),
    (dict(budget_policy="calibrated", budget_eps=True),
     "budget_eps must be a finite number in [0, 1e9), got True"),
    (dict(budget_policy="calibrated", budget_eps="0.1"),
     "budget_eps must be a finite number in [0, 1e9), got '0.1'"),
    (dict(drafter="replay"),
     "the replay drafter needs an acceptance profile (--acceptance bundled, qwen3-next-mtp or "
     "a JSON file)"),
    (dict(drafter="replay", mode="chain"),
     "the replay drafter needs an acceptance profile (--acceptance bundled, qwen3-next-mtp or "
     "a JSON file)"),
])
def test_a_configuration_just_outside_a_limit_is_refused_with_its_whole_message(kw, message):
    with pytest.raises(ValueError) as err:
        SpecConfig(**kw).validate()
    assert str(err.value) == message


def test_unknown_drafters_and_policies_are_named():
    with pytest.raises(ValueError, match="^drafter must be one of"):
        SpecConfig(drafter="magic").validate()
    with pytest.raises(ValueError, match="^budget_policy must be one of"):
        SpecConfig(budget_policy="magic").validate()


@pytest.mark.parametrize("mtp_head, draft_model, drafter", [
    (False, None, "ngram"), (True, None, "mtp"), (False, object(), "draft"),
    (True, object(), "draft"),
])
def test_the_default_drafter_is_the_draft_model_then_the_mtp_head_then_ngram(
        mtp_head, draft_model, drafter):
    assert default_drafter(SimpleNamespace(has_mtp_head=mtp_head), draft_model) == drafter
