"""Record the forwards an engine's runner builds: ``(tokens a row, GDN backend name)`` each, so a
test can check what a round verified (one root a row in a plain round, a tree otherwise)."""


def record_forwards(engine, monkeypatch) -> list[tuple[int, str | None]]:
    """The list ``engine.runner.make_batch`` appends to from now on, for the test's duration."""
    forwards: list[tuple[int, str | None]] = []
    make = engine.runner.make_batch

    def spy(tokens, forest, slots, gdn=None, prefill=None):
        forwards.append((tokens.numel() // slots.numel(), gdn))
        return make(tokens, forest, slots, gdn, prefill)
    monkeypatch.setattr(engine.runner, "make_batch", spy)
    return forwards
