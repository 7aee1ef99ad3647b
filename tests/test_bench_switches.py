"""bench/kernels.py's VerifyConfig switch flags, shared by kernel_probe.py, verify_configs.py and
kernel_registers.py."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kernels as kb  # noqa: E402

from bole.ops.gdn.triton_verify import VerifyConfig  # noqa: E402


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
