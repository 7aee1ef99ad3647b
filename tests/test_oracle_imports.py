"""The fla / causal_conv1d block of the transformers-oracle tests and its lifting."""

import sys
import types

from tests.oracle_imports import FAST_KERNEL_MODULES, block_fast_kernels, fla_unblocked


def test_block_keeps_imported_modules(monkeypatch):
    real = types.ModuleType("causal_conv1d")
    monkeypatch.setitem(sys.modules, "causal_conv1d", real)
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    block_fast_kernels()
    assert sys.modules["fla"] is None and sys.modules["causal_conv1d"] is real
    assert set(FAST_KERNEL_MODULES) == {"fla", "causal_conv1d"}


def test_fla_unblocked_lifts_the_block_and_puts_it_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    with fla_unblocked():
        assert "fla" not in sys.modules
        # what `from fla.ops.x import y` leaves behind
        monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    assert sys.modules["fla"] is None and "fla.ops" not in sys.modules


def test_fla_unblocked_restores_after_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    try:
        with fla_unblocked():
            raise RuntimeError("test failed inside")
    except RuntimeError:
        pass
    assert sys.modules["fla"] is None


def test_fla_unblocked_leaves_a_real_fla_alone(monkeypatch):
    real = types.ModuleType("fla")
    monkeypatch.setitem(sys.modules, "fla", real)
    with fla_unblocked():
        assert sys.modules["fla"] is real
    assert sys.modules["fla"] is real
