"""Transient-state accounting and the README's demo."""

from dataclasses import replace

import pytest

from bole.cli import main
from bole.config import GDN_SHAPES, gdn_shape
from bole.memory import speculative_state_bytes
from bole.models.presets import PRESETS, preset_config


def test_qwen35_9b_figures():
    s = gdn_shape("qwen3.5-9b")
    m = speculative_state_bytes(s, nodes=64, batch=1)
    # 24 layers x 64 nodes x 32 heads x 128 x 128 x 4 B = 3 GiB of snapshots
    assert m.snapshot_bytes == 24 * 64 * 32 * 128 * 128 * 4 == 3 * 2**30
    assert m.factor_bytes == 24 * 64 * (32 * 8 + 16 * 128 * 4 + 32 * 128 * 4)
    assert m.ratio > 50
    assert speculative_state_bytes(s, 128, batch=4).ratio == pytest.approx(m.ratio)


@pytest.mark.parametrize("name", sorted(GDN_SHAPES))
def test_all_presets_well_above_50x(name):
    assert speculative_state_bytes(GDN_SHAPES[name], 64).ratio > 50


@pytest.mark.parametrize("name", sorted(PRESETS.keys() & GDN_SHAPES.keys()))
def test_presets_take_their_gdn_layers_from_the_shapes(name):
    """Random-weight presets and the shape table describe the same GDN layers."""
    shape = preset_config(name).gdn_shape()
    assert shape == replace(GDN_SHAPES[name], name=shape.name)


def test_bad_accounting_inputs():
    with pytest.raises(ValueError, match="unknown model shape"):
        gdn_shape("llama")
    with pytest.raises(ValueError, match="nodes and batch"):
        speculative_state_bytes(gdn_shape("qwen3.5-9b"), 0)


def test_demo_prints_agreement_and_ratio(capsys):
    assert main(["demo", "--shape", "qwen3.5-4b", "--nodes", "16", "--depth", "4"]) == 0
    out = capsys.readouterr().out
    assert "agreement: OK" in out and "84.5x" in out
    assert "identical to plain greedy decoding: yes" in out and "tokens per round" in out
