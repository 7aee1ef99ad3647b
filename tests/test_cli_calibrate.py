"""`bole calibrate` on the bundled model (CPU): the profile it writes, and what it refuses."""

import argparse

import pytest
import torch

from bole.cli import main
from bole.cli.common import load_model
from bole.engine import Engine, SpecConfig
from bole.speculative.budget.widths import spread_width
from bole.speculative.budget.profile import BudgetProfile

TREE = ["--depth", "3", "--topk", "2", "--budget", "8"]
QUICK = ["--device", "cpu", "--batches", "1", "2", "--reps", "1", "--context", "16"]


def test_calibrate_writes_the_profile_of_its_tree_and_engines_find_it(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path))
    assert main(["calibrate", *QUICK, *TREE]) == 0
    out = capsys.readouterr()
    (path,) = tmp_path.glob("budget-*.json")
    assert path.name.endswith("-tree8.json") and f"wrote {path}" in out.out
    assert path.with_suffix(".png").exists()
    assert "calibrating [" in out.err                            # the progress bar
    profile = BudgetProfile.load(path)
    assert profile.batches == [1, 2] and profile.tree_nodes == 8
    assert profile.node_grid == [1, 2, 4, 8, 14]                 # up to every draft node of b2
    rows = [line.split() for line in out.out.splitlines()[1:3]]
    assert [int(r[0]) for r in rows] == [1, 2]
    assert [int(r[2]) for r in rows] == profile.b_ver
    # each B_ver's verify width (8-node trees: widths 2, 4, 8), which it fills unless a grid
    # point of that width measured above the tolerance (CPU timings are noisy), or "-" for 0
    for b, r in zip((1, 2), rows):
        n = int(r[2])
        assert r[3] == "-" if n == 0 else int(r[3]) == spread_width(b, n, 8) in (2, 4, 8)
    # an engine with the same tree and policy loads it without measuring again
    model, _, _ = load_model(argparse.Namespace(preset=None, model=None), "cpu", torch.float32)
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8, budget_policy="goodput")
    engine = Engine(model, spec, max_slots=2)
    assert engine.rounds.policy.profile == profile
    assert "calibrating" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--eps", "-0.5"], "--eps must be >= 0"),
    (["--batches", "0"], "batches"),
    (["--reps", "0"], "reps"),
])
def test_calibrate_refuses_bad_arguments_before_measuring(argv, message, tmp_path, monkeypatch,
                                                          capsys):
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path))
    assert main(["calibrate", *QUICK, *argv]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("budget-*"))
