"""Record what an engine's rounds do: the forwards its runner builds (``(tokens a row, GDN
backend name)`` each, so a test can check what a round verified: one root a row in a plain round,
a tree otherwise) and the plans the budget policy gave them."""


def record_forwards(engine, monkeypatch) -> list[tuple[int, str | None]]:
    """The list ``engine.runner.make_batch`` appends to from now on, for the test's duration."""
    forwards: list[tuple[int, str | None]] = []
    make = engine.runner.make_batch

    def spy(tokens, forest, slots, gdn=None, prefill=None):
        forwards.append((tokens.numel() // slots.numel(), gdn))
        return make(tokens, forest, slots, gdn, prefill)
    monkeypatch.setattr(engine.runner, "make_batch", spy)
    return forwards


def record_plans(engine, monkeypatch) -> list:
    """The list of :class:`~bole.engine.round.RoundPlan` that ``engine.rounds.plan`` appends to
    from now on, for the test's duration."""
    plans: list = []
    plan = engine.rounds.plan

    def spy(*args, **kwargs):
        plans.append(plan(*args, **kwargs))
        return plans[-1]
    monkeypatch.setattr(engine.rounds, "plan", spy)
    return plans
