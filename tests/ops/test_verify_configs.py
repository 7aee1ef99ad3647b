"""Launch configurations of the verification kernel: the H200's picks are pinned, other GPUs'
wave rules follow their SM count."""

import hashlib
import json
from dataclasses import asdict

import torch

from bole.ops.gdn.verify import kernel as triton_verify
from bole.ops.gdn.verify.configs import H200_SMS, device_sms, pick_config

#: sha256 of every pick on the grid below for the H200 (132 SMs), as measured and tuned there;
#: a change of the table or the rules changes it (recompute with ``_h200_picks`` on purpose only)
H200_PICKS_SHA256 = "083e2e12fbef2aa8da2be0049c026c05343377fb898cfbb3dc039fcf2c3d9818"
BLOCKS = (1, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 512)
HEADS = ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256), (128, 64), (40, 72))
PROGRAMS = tuple(range(1, 70)) + (96, 128, 131, 132, 133, 160, 192, 256, 264, 265, 384, 512,
                                  768, 1024, 1536, 2048, 4096, 8192)


def _picks(**kw) -> dict[str, dict]:
    return {f"{bt},{dk},{dv},{p}": asdict(pick_config(bt, dk, dv, p, interpret=False, **kw))
            for bt in BLOCKS for dk, dv in HEADS for p in PROGRAMS}


def _digest(picks: dict[str, dict]) -> str:
    return hashlib.sha256(json.dumps(picks, sort_keys=True).encode()).hexdigest()


def test_h200_picks_are_unchanged():
    assert _digest(_picks(num_sms=132)) == H200_PICKS_SHA256


def test_default_sm_count_is_the_devices():
    expect = (torch.cuda.get_device_properties(0).multi_processor_count
              if torch.cuda.is_available() else H200_SMS)
    assert device_sms() == expect
    assert _picks() == _picks(num_sms=expect)


def test_wave_rules_follow_the_sm_count():
    # Qwen3.5-9B at T = 64 (32 value heads per request, d = 128)
    def pick(batch, sms):
        return pick_config(64, 128, 128, 32 * batch, interpret=False, num_sms=sms)
    # batch 2: 128 programs of BV 64 are one wave of 132 SMs (decays in the last d_k step) ...
    assert (pick(2, 132).BV, pick(2, 132).decay_last_step) == (64, True)
    # ... but two waves of 66: no one-wave switches there, and BV stays at 64 (>= 64 programs)
    assert (pick(2, 66).BV, pick(2, 66).decay_last_step) == (64, False)
    # a GPU twice the size wants twice the programs before BV stops shrinking
    assert pick(2, 264).BV == 32 and pick(4, 264).BV == 64
    # whole_head counts waves of two programs per SM
    assert pick(6, 132).whole_head and not pick(6, 66).whole_head


def test_triton_verify_re_exports_the_configurations():
    for name in ("VerifyConfig", "INTERPRET_CONFIG", "CONFIG_TABLE", "MIN_PROGRAMS",
                 "NARROW_TILE", "ONE_WAVE", "ONE_WAVE_PROGRAMS", "WAVE_SLOTS", "WHOLE_HEAD_COST",
                 "pick_config", "_whole_head_pays", "kernel_switches", "_refuse_known_miscompile"):
        assert hasattr(triton_verify, name), name
