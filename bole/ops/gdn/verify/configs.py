"""Launch configurations of the tree-verification kernel (:mod:`bole.ops.gdn.verify.kernel`).

:class:`VerifyConfig` is one launch's compile-time tiling and switches; :func:`pick_config`
chooses one per launch shape from :data:`CONFIG_TABLE` (by the tree block ``BT``), shrinking the
value tile until the launch fills about one wave of the GPU, and applying :data:`NARROW_TILE`,
:data:`ONE_WAVE` and ``whole_head`` where their measured rules say they pay; and
:func:`kernel_switches` turns a config into the kernel's constexpr flags for given inputs. The
table and the rules were measured on the H200 (132 SMs); the wave rules scale with the device's
SM count. The measurements behind every entry are in bench/NOTES.md ("Launch configurations").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from bole.ops.triton_utils import interpreting

__all__ = [
    "CONFIG_TABLE", "F16_SWEEP_MAX_DEPTH", "H200_SMS", "INTERPRET_CONFIG", "MIN_PROGRAMS",
    "NARROW_TILE", "ONE_WAVE", "ONE_WAVE_PROGRAMS", "PRECISIONS", "VerifyConfig",
    "WAVE_SLOTS", "WHOLE_HEAD_COST", "device_sms", "kernel_switches", "pick_config",
]

PRECISIONS = ("tf32", "tf32x3", "ieee")
#: deepest tree whose Neumann iterates provably fit fp16 (see ``_neumann`` in the kernel)
F16_SWEEP_MAX_DEPTH = 15


@dataclass(frozen=True)
class VerifyConfig:
    """Compile-time tiling of the verification kernel, and its optional code paths.

    Every switch computes the same result up to rounding; each is ignored where it does not
    apply (:func:`kernel_switches` says where).
    """

    #: value columns per program (power of two >= 16); the grid has ``cdiv(d_v, BV)`` value tiles
    BV: int
    #: key columns streamed per step of the d_k loop (power of two >= 16)
    BK: int
    num_warps: int = 4
    #: pipeline stages of the d_k loop's loads
    num_stages: int = 2
    #: stream d_k twice (K for G, R and the solve; then Q for C and O) so that one ``[BT, BT]``
    #: Gram accumulator is live at a time: a second read of K and S_pre for registers (BT 256)
    split_gram: bool = False
    #: cap on registers per thread (ptxas ``.maxnreg``), None for none; for sweeps only
    maxnreg: int | None = None
    #: bf16 q/k under "tf32": ``K S_pre`` and ``Q S_pre`` as two bf16 products each of
    #: ``S = S_hi + S_lo`` (16 mantissa bits against tf32's 10), q/k straight from shared memory
    bf16_state: bool = False
    #: under "tf32": ``C U`` as three bf16 products of hi/lo halves instead of one tf32 product,
    #: whose truncated operands would otherwise set O's error (7.5e-4 against 1.5e-5)
    cu_bf16x3: bool = False
    #: key norms from the diagonal of ``K K^T``; their column scaling of G and C rides in the
    #: decays' exponent (one ftz exp2 per element). Not for fp32 keys under "tf32" (rounded Grams)
    fused_norms: bool = False
    #: under "tf32": the sweeps' products ``G U`` in fp16, R scaled by a power of two; only where
    #: the overflow bound holds (raw gates, in-kernel l2 norm, depth <= F16_SWEEP_MAX_DEPTH)
    fp16_sweeps: bool = False
    #: compute the gates after the d_k loop from inputs loaded before it
    defer_gates: bool = False
    #: load the ancestor mask and the value tile before the d_k loop, to hide their latency
    prefetch_tiles: bool = False
    #: sweep the transposed system ``U^T <- R^T - U^T G^T`` so that the iterate is the tensor
    #: cores' register operand (no shared-memory round trip per sweep); fp16 sweeps and
    #: ``BV >= 16 * num_warps`` only
    transposed_sweeps: bool = False
    #: one program per (request, value head) that forms the Grams, G and C once and then takes
    #: the head's value tiles in turn; for batches that fill the GPU (``_whole_head_pays``)
    whole_head: bool = False
    #: form the decays from the gates and the mask before the d_k loop instead of after it
    early_decay: bool = False
    #: with early_decay: form them inside the d_k loop, after its first loads are issued
    decay_in_loop: bool = False
    #: with decay_in_loop: in the loop's last step (peeled by Triton) instead of its first
    decay_last_step: bool = False
    #: under "tf32": the path log-decays L and their differences in fp32 instead of fp64 (loses
    #: about ``eps_fp32 * |L|``, far below the tf32-mode products' rounding)
    fp32_log_decay: bool = False

    def validate(self) -> None:
        for name in ("BV", "BK"):
            x = getattr(self, name)
            if not isinstance(x, int) or x < 16 or x & (x - 1):
                raise ValueError(f"VerifyConfig.{name}={x!r} must be a power of two >= 16 (tl.dot tiles)")
        if not isinstance(self.num_warps, int) or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"VerifyConfig.num_warps={self.num_warps!r} must be a power of two")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"VerifyConfig.num_stages={self.num_stages!r} must be a positive int")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int)
                                         or not 32 <= self.maxnreg <= 255):
            raise ValueError(f"VerifyConfig.maxnreg={self.maxnreg!r} must be None or an int in 32..255")


#: The single configuration used under TRITON_INTERPRET (CPU); tiny tiles keep it cheap.
INTERPRET_CONFIG = VerifyConfig(BV=16, BK=16, num_warps=1, num_stages=1)

#: The launch for each tree block BT (the smallest key >= BT, else the largest); pick_config
#: narrows BV from here. BT = 64 caps BV at 64 (two 4-warp programs per SM beat one of 8 warps).
CONFIG_TABLE: dict[int, VerifyConfig] = {
    16: VerifyConfig(BV=128, BK=32, num_warps=4, num_stages=3, cu_bf16x3=True, fp16_sweeps=True,
                     transposed_sweeps=True),
    32: VerifyConfig(BV=128, BK=32, num_warps=4, num_stages=3, cu_bf16x3=True, fused_norms=True,
                     fp16_sweeps=True, transposed_sweeps=True, early_decay=True,
                     decay_in_loop=True, fp32_log_decay=True),
    64: VerifyConfig(BV=64, BK=32, num_warps=4, num_stages=3, bf16_state=True, cu_bf16x3=True,
                     fused_norms=True, fp16_sweeps=True, prefetch_tiles=True,
                     transposed_sweeps=True, whole_head=True, early_decay=True,
                     fp32_log_decay=True),
    128: VerifyConfig(BV=128, BK=32, num_warps=8, num_stages=3, bf16_state=True, cu_bf16x3=True,
                      fused_norms=True, fp16_sweeps=True, prefetch_tiles=True,
                      transposed_sweeps=True, fp32_log_decay=True),
    256: VerifyConfig(BV=128, BK=32, num_warps=8, num_stages=2, split_gram=True, cu_bf16x3=True),
}

#: Changes for the narrowest value tile (BV = 32: batch 1 at BT <= 64), by block: one program
#: per SM, a single dependent chain, where the decays pay in the d_k loop's last step.
NARROW_TILE: dict[int, dict] = {
    16: dict(BK=64, bf16_state=True, fused_norms=True, prefetch_tiles=True, early_decay=True,
             decay_in_loop=True, decay_last_step=True, fp32_log_decay=True),
    32: dict(bf16_state=True, prefetch_tiles=True),
    64: dict(BK=64, early_decay=True, decay_in_loop=True, decay_last_step=True)}
#: Changes for launches of BV >= 64 with at most one program per SM, by block: like batch 1's,
#: one dependent chain per SM, and the decays in the d_k loop's last step pay there too.
ONE_WAVE: dict[int, dict] = {64: dict(early_decay=True, decay_in_loop=True, decay_last_step=True)}

#: SMs of the H200, where the table was measured; assumed when no GPU is visible
H200_SMS = 132
#: Programs in about one wave on the H200: BV shrinks until the launch has this many
#: (scaled by the SM count on other GPUs)
MIN_PROGRAMS = 128
#: On the H200, a launch of at most this many programs runs as one wave, one program per SM
ONE_WAVE_PROGRAMS = H200_SMS
#: Programs resident at once on the H200 at BT = 64 (two 4-warp programs of ~255 registers per SM)
WAVE_SLOTS = 2 * ONE_WAVE_PROGRAMS
#: Time of one whole-head program over that of the head's value-tile programs together (T = 64,
#: batch 64, where both launches run many full waves)
WHOLE_HEAD_COST = 0.955


@functools.lru_cache(maxsize=None)
def device_sms() -> int:
    """Streaming multiprocessors of GPU 0 (:data:`H200_SMS` when there is no GPU)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    return H200_SMS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def pick_config(block_nodes: int, d_k: int, d_v: int, num_programs: int, *,
                interpret: bool | None = None, num_sms: int | None = None) -> VerifyConfig:
    """Configuration for one launch shape.

    ``num_programs`` is the number of (request, value head) pairs, ``R * H_v``; the launch has
    ``num_programs * cdiv(d_v, BV)`` programs. ``num_sms`` defaults to :func:`device_sms`; the
    wave rules use it. Under TRITON_INTERPRET (or ``interpret=True``) returns
    :data:`INTERPRET_CONFIG`.
    """
    if interpreting() if interpret is None else interpret:
        return INTERPRET_CONFIG
    sms = device_sms() if num_sms is None else int(num_sms)
    keys = sorted(CONFIG_TABLE)
    key = next((kb for kb in keys if kb >= block_nodes), keys[-1])
    base = CONFIG_TABLE[key]
    bv = max(16, min(base.BV, _next_pow2(d_v)))
    bk = max(16, min(base.BK, _next_pow2(d_k)))
    while bv > 32 and num_programs * _cdiv(d_v, bv) < MIN_PROGRAMS * sms // H200_SMS:
        bv //= 2
    warps = 8 if (block_nodes >= 128 or block_nodes * bv >= 8192) else base.num_warps
    whole_head = base.whole_head and _whole_head_pays(num_programs, _cdiv(d_v, bv), 2 * sms)
    config = replace(base, BV=bv, BK=bk, num_warps=max(base.num_warps, warps),
                     whole_head=whole_head)
    if bv == 32 and key in NARROW_TILE:
        narrow = dict(NARROW_TILE[key])
        narrow["BK"] = max(16, min(narrow.get("BK", bk), _next_pow2(d_k)))
        if narrow.get("decay_in_loop") and narrow["BK"] >= d_k:
            # the decays formed inside the d_k loop need a loop of two steps or more: with a
            # single step the compiled launch read out of bounds (head size 64, BT 64, BK 64)
            narrow["BK"] = max(16, _next_pow2(d_k) // 2)
        config = replace(config, **narrow)
    elif (key in ONE_WAVE and bv >= 64 and not whole_head
          and num_programs * _cdiv(d_v, bv) <= sms):
        config = replace(config, **ONE_WAVE[key])
    return config


def _whole_head_pays(num_programs: int, tiles: int, wave_slots: int = WAVE_SLOTS) -> bool:
    """Whether one program per head beats one per value tile, by counting waves: each launch
    takes ``cdiv(programs, wave_slots)`` waves (a part-filled wave costs a whole one), a
    whole-head program ``WHOLE_HEAD_COST * tiles`` times a tile program."""
    if tiles < 2:
        return False
    head_waves = _cdiv(num_programs, wave_slots) * WHOLE_HEAD_COST * tiles
    return head_waves < _cdiv(num_programs * tiles, wave_slots)


def kernel_switches(config: VerifyConfig, *, dtype: torch.dtype, precision: str, raw_gates: bool,
                    l2norm: bool, max_depth: int, interpret: bool, d_k: int) -> dict[str, int]:
    """The kernel's compile-time switches for ``config`` on these inputs: each of the config's
    options where it applies, off where it does not (bench/tuning/kernel_registers.py compiles
    with the same flags)."""
    split = bool(config.split_gram)
    s_bf16x2 = bool(config.bf16_state) and dtype == torch.bfloat16 and precision == "tf32"
    # |G_ij| <= 1 needs normalised keys and beta from the raw gates (a sigmoid)
    f16_sweeps = (bool(config.fp16_sweeps) and precision == "tf32" and raw_gates and l2norm
                  and max_depth <= F16_SWEEP_MAX_DEPTH)
    # the Gram diagonal is the sum of squares unless fp32 keys are rounded to tf32
    fused_norms = (bool(config.fused_norms) and not split
                   and (dtype != torch.float32 or precision != "tf32"))
    early_decay = bool(config.early_decay) and not split
    decay_in_loop = bool(config.decay_in_loop) and early_decay
    return dict(
        SPLIT=split,
        S_BF16X2=s_bf16x2,
        CU_BF16X3=bool(config.cu_bf16x3) and precision == "tf32",
        FUSED_NORMS=fused_norms,
        F16_SWEEPS=f16_sweeps,
        # early_decay needs the gates before the loop; split_gram computes them there anyway
        DEFER_GATES=bool(config.defer_gates) and not split and not config.early_decay,
        PREFETCH=bool(config.prefetch_tiles),
        # the iterate as wgmma's register operand needs its rows (BV) to fill the warpgroups'
        # 64-row tiles (below that Triton falls back to mma.sync with register shuffles); fp16
        # sweeps only: the one form verified compiled
        T_SWEEPS=bool(config.transposed_sweeps) and config.BV >= 16 * config.num_warps
        and f16_sweeps,
        WHOLE_HEAD=bool(config.whole_head) and not split,
        EARLY_DECAY=early_decay,
        DECAY_IN_LOOP=decay_in_loop,
        # the d_k loop's step that forms the decays under DECAY_IN_LOOP: the first or the last
        DECAY_STEP=_cdiv(d_k, config.BK) - 1 if decay_in_loop and config.decay_last_step else 0,
        # fp32 path sums only where the decays are fused (the one _tree_decay form that takes them)
        F32_L=bool(config.fp32_log_decay) and precision == "tf32" and (early_decay or fused_norms),
        INTERPRET=interpret,
    )


def _refuse_known_miscompile(config: VerifyConfig, switches: dict[str, bool], block_nodes: int,
                            dtype: torch.dtype, precision: str) -> None:
    """Refuse the one launch known to compute wrong results: Triton 3.6 on the H200 gave O off by
    ~0.1 for BT = 64, BV = 128, 8 warps, 3 stages with fp16/bf16 inputs and unsplit tf32 state
    products. pick_config never makes it (BT = 64 caps BV at 64)."""
    if (switches["INTERPRET"] or block_nodes != 64 or config.BV < 128 or config.num_warps != 8
            or config.num_stages < 3 or switches["S_BF16X2"] or precision != "tf32"
            or dtype not in (torch.float16, torch.bfloat16)):
        return
    raise ValueError(
        f"{config} at block_nodes=64 with {dtype} inputs and precision='tf32' miscompiles under "
        f"Triton 3.6 (wrong results on the H200); use num_stages=2, BV=64, bf16_state=True (bf16 "
        f"inputs) or config=None for pick_config's choice")
