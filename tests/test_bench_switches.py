"""bench/harness.py's pieces shared by the kernel-tuning scripts in bench/tuning/: the
VerifyConfig switch flags (kernel_probe.py, verify_configs.py, kernel_registers.py) and the
verify / commit launch helpers (kernel_probe.py, verify_configs.py, commit_configs.py)."""

import argparse

from bench import harness as kb
from bole.ops.gdn.verify.kernel import VerifyConfig


def test_switches_are_the_boolean_fields():
    names = kb.config_switches()
    assert {"split_gram", "bf16_state", "cu_bf16x3", "fused_norms", "fp16_sweeps",
            "prefetch_tiles", "transposed_sweeps"} <= set(names)
    assert all(isinstance(getattr(VerifyConfig(BV=16, BK=16), n), bool) for n in names)
    assert "maxnreg" not in names and "BV" not in names


def test_with_switches_crosses_given_values_and_keeps_absent_ones():
    ap = argparse.ArgumentParser()
    kb.add_switch_args(ap)
    base = [VerifyConfig(BV=32, BK=32, cu_bf16x3=True), VerifyConfig(BV=64, BK=32, cu_bf16x3=True)]
    args = ap.parse_args(["--fp16-sweeps", "0", "1", "--bf16-state", "1"])
    out = kb.with_switches(base, args)
    assert len(out) == 4
    assert all(c.bf16_state and c.cu_bf16x3 for c in out)              # given / kept
    assert sorted((c.BV, c.fp16_sweeps) for c in out) == [(32, False), (32, True),
                                                          (64, False), (64, True)]
    assert kb.with_switches(base, ap.parse_args([])) == base


def test_verify_and_commit_inputs_on_a_tiny_shape():
    """The benches' shared launch helpers on CPU (interpreter): verify_inputs gives the fp64
    reference's O, and commit_inputs stacks factors and pool over layers with each request's
    deepest-numbered node accepted, so that the cross-layer commit matches the fp64 commit."""
    import pytest
    import torch
    pytest.importorskip("triton")
    from bole.config import GDNShape
    from bole.ops.gdn.closed_form import TreeFactors, commit_factored
    from bole.ops.gdn.triton_commit import commit_factored_triton

    dev = torch.device("cpu")
    shape = GDNShape("tiny", num_gdn_layers=2, num_k_heads=1, num_v_heads=2, head_k_dim=16,
                     head_v_dim=16)
    forest, meta = kb.bench_forest(12, 2, 5, dev)
    x = kb.make_inputs(shape, forest, dev, seed=3)
    o, fac = kb.verify_inputs(x, meta, precision="ieee", out_dtype=torch.float32)
    ref, _ = kb.reference_fp64(x, forest)
    assert kb.rel_err(o, ref) < 1e-5
    c = kb.commit_inputs(fac, x["initial_state"], forest, shape.num_gdn_layers, dev)
    assert c.pool.shape == (2, *x["initial_state"].shape) and c.factors.u.shape == (2, *fac.u.shape)
    assert c.accepted == [11, 11] and c.slots.tolist() == [0, 1]
    commit_factored_triton(c.factors, c.pool, c.slots, c.index, c.lengths)
    want = commit_factored(TreeFactors(*(t.double() for t in (
        fac.log_decay, fac.k, fac.u, fac.k_inv_norm))), x["initial_state"].double(), forest,
        c.accepted)
    for layer in range(shape.num_gdn_layers):
        assert kb.rel_err(c.pool[layer], want) < 1e-5


def test_source_commit_names_the_stamp_or_the_checkout(monkeypatch):
    """Results name their commit: $BOLE_COMMIT where it is set (the device copy's stamp, which
    wins over a stale .git there), else git's where the checkout has it, else "unknown"."""
    import subprocess
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=kb.ROOT,
                          capture_output=True, text=True).stdout.strip()
    monkeypatch.delenv("BOLE_COMMIT", raising=False)
    kb.source_commit.cache_clear()
    if head:                                         # a git checkout (CI's clean clone is one)
        assert kb.source_commit().startswith(head[:7])
        monkeypatch.setenv("BOLE_COMMIT", "abc1234")
        kb.source_commit.cache_clear()
        assert kb.source_commit() == "abc1234"       # the stamp, not the checkout's describe

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")
    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.setenv("BOLE_COMMIT", "abc1234-dirty")
    kb.source_commit.cache_clear()
    assert kb.source_commit() == "abc1234-dirty"
    monkeypatch.delenv("BOLE_COMMIT")
    kb.source_commit.cache_clear()
    assert kb.source_commit() == "unknown"
    kb.source_commit.cache_clear()
