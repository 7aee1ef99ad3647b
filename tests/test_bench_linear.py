"""bench/linear.py's shapes are the preset's projections: one decode forward's weights, the same
bytes bench/model_forward.py counts for the preset's model (the sweep itself needs a GPU)."""

from pathlib import Path

import pytest
import torch

from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return load_script("bench/linear.py", "linear_bench")


def test_shapes_are_the_decode_forwards_weights(monkeypatch):
    bench = _bench(monkeypatch)
    from bench import model_forward
    model = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=0, mtp=True)
    shapes = bench.preset_shapes("tiny", draft_vocab=32)
    decode_bytes = sum(s["N"] * s["K"] * 4 * s["count"] for s in shapes)
    weights, _ = model_forward.weight_bytes(model)
    mtp, _ = model_forward.weight_bytes(model, prefix="mtp.")
    assert decode_bytes == weights - mtp
    assert {s["name"] for s in shapes if not s["count"]} == {"mtp.fc", "mtp.head-32"}


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the sweep would run")
    bench = _bench(monkeypatch)
    assert bench.main(["--rows", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
