"""Value-tiled Triton kernel for exact GDN tree verification (Algorithm 1 of the paper).

One program ("CTA") holds one request's whole draft tree for one value head and one tile of ``BV``
value columns; grid = ``(d_v / BV, R, H_v)`` (``(1, R, H_v)`` with ``whole_head``: each program
then takes its head's value tiles in turn). With ``A(i)`` the strict ancestors of node i and
``L_i = sum of g over A(i) + {i}`` (DESIGN.md section 2), each program computes

    decay_ij = exp(where(j in A(i) + {i}, L_i - L_j, -inf))          (masked *before* exp)
    G = beta_i decay_ij (k_i . k_j) on strict ancestors,   C = decay_ij (q_i . k_j) incl. self
    R = beta (V - e^L K S_pre),   (I + G) U = R   by  U <- R - G U  (max_depth sweeps)
    O = e^L Q S_pre + C U

streaming ``d_k`` in tiles of ``BK`` for the Gram products ``K K^T``, ``Q K^T`` and the state
products ``K S_pre``, ``Q S_pre`` (the S_pre tile ``[BK, BV]`` read from the state pool at slot
``state_indices[r]``). l2 normalisation and the query scale are applied afterwards as row/column
scalings of these products, so the keys are never rewritten. The state pool is only read; the
program writes O and U (and, once per head, L and the key inverse norms).

Each value tile recomputes the ``[BT, BT]`` Gram products of its tree: that redundancy is the price
of ``d_v / BV`` times more parallelism, which small batches need; where the batch fills the GPU
without it, ``VerifyConfig.whole_head`` gives each program a whole head, forming the Grams, G and C
once and then taking the value tiles in turn; ``VerifyConfig.early_decay`` forms the decays before
the d_k loop (with ``decay_in_loop``, in its first step, after its first loads are issued).
``VerifyConfig.split_gram`` streams d_k twice (K for G, R and the solve; then Q for C and O) so
that one Gram tile is live at a time, for large trees. 64-bit offsets sit in scalar per-tree bases
(``cu_nodes[r] * stride``, the pool slot times its stride); per-element offsets within a tree stay
32-bit. Padding rows past ``cu_nodes[-1]`` are written (zeros) by the last request's programs,
so no output needs a memset.

Inputs may be fp16/bf16/fp32; gates, state and all accumulation are fp32. ``precision`` selects
tl.dot's ``input_precision`` for fp32 operands ("tf32" fast, "tf32x3", or "ieee" exact); fp16/bf16
Gram products are formed in the input dtype with fp32 accumulation. In "tf32" the table's launches
replace tf32 (whose fp32 operands the tensor cores truncate, bench/precision_model.py) wherever it
cost accuracy or time: the state products with bf16 inputs as split bf16 (``bf16_state``: S as
bf16 hi + lo), the output product ``C U`` as three bf16 products of hi/lo halves (``cu_bf16x3``)
and the Neumann sweeps in fp16 with R scaled by a power of two (``fp16_sweeps``, where its
overflow bound holds), on the transposed system so that the iterate stays in registers
(``transposed_sweeps``).

This module knows nothing of models or requests beyond :class:`bole.tree.ForestMeta`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from bole.ops.gdn.closed_form import TreeFactors
from bole.ops.gdn.common import check_gdn_tensors
from bole.ops.triton_utils import check_kernel_device, interpreting
from bole.tree import ForestMeta

try:                                    # in Triton 3.6 and 3.9; a Triton without it never raises it
    from triton.runtime.errors import PTXASError
except ImportError:                     # pragma: no cover
    class PTXASError(Exception):
        """Stand-in that nothing raises."""
try:
    from triton.runtime.errors import OutOfResources
except ImportError:                     # pragma: no cover
    class OutOfResources(Exception):
        """Stand-in that nothing raises."""

__all__ = [
    "VerifyConfig", "CONFIG_TABLE", "NARROW_TILE", "INTERPRET_CONFIG", "PRECISIONS", "pick_config",
    "tree_gdn_verify_triton",
]

PRECISIONS = ("tf32", "tf32x3", "ieee")
#: deepest tree whose Neumann iterates provably fit fp16 (``_neumann``'s docstring)
F16_SWEEP_MAX_DEPTH = 15
KERNEL_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VerifyConfig:
    """Compile-time tiling of the verification kernel.

    BV: value columns per program (power of two >= 16); the grid has ``cdiv(d_v, BV)`` value tiles.
    BK: key columns streamed per step of the d_k loop (power of two >= 16).
    num_warps, num_stages: as for any Triton launch (num_stages pipelines the d_k loop).
    split_gram: stream d_k twice (K: G, R and the solve; then Q: C and O) so that only one
        ``[BT, BT]`` Gram accumulator is live at a time; trades a second read of K and the S_pre
        tile (from L2) for registers, for large trees.
    maxnreg: cap on registers per thread (ptxas ``.maxnreg``), None for none: fewer registers
        mean more blocks per SM at the price of spills (bench/kernel_registers.py shows both).
        Capped 8-warp launches were slower than the table's at every batch on the H200
        (bench/NOTES.md), so pick_config never sets it; it is there for sweeps.
    bf16_state: with bf16 q/k and precision "tf32", form the state products ``K S_pre`` and
        ``Q S_pre`` as two bf16 products each, ``S = S_hi + S_lo`` split in bf16 (16 mantissa bits
        of S against tf32's 10; q/k are exact in bf16), straight from q/k in shared memory instead
        of widened fp32 copies; ignored for other inputs or precisions.
    cu_bf16x3: with precision "tf32", run the output product ``C U`` as three bf16 products of
        hi/lo halves (``C_hi U_hi + C_hi U_lo + C_lo U_hi``) instead of one tf32 product. The
        tensor cores truncate fp32 operands to tf32, and in ``C U`` that sets O's error: 7.5e-4
        relative to fp64 against 1.5e-5 with this (bench/precision_model.py emulates each
        product's rounding).
    fused_norms: take the key norms from the diagonal of ``K K^T`` instead of sums of squares in
        the d_k loop, and fold the key inverse norms (a column scaling of G and C) into the
        decays' exponent, one ftz exp2 per element. Offline (sm_90 SASS, bench/NOTES.md item 20):
        about 8% fewer instructions per warp and no spills at BV = 64; 3-6% faster on the H200 at
        BT = 32 to 128 (CONFIG_TABLE). Ignored with split_gram, and for fp32 keys under "tf32"
        (their Gram products are rounded).
    fp16_sweeps: with precision "tf32", run the Neumann sweeps' products ``G U`` in fp16 (R
        scaled by a power of two) instead of tf32: twice the tensor-core rate, rounding to
        nearest instead of tf32's truncation. Used only where it is safe from overflow: raw gates,
        in-kernel l2 norm and trees of depth <= F16_SWEEP_MAX_DEPTH (tf32 otherwise).
    defer_gates: load the gate inputs at the start but compute the gates after the d_k loop, so
        that the loop's prologue (its first pipelined loads) does not wait behind them (in the
        sm_90 SASS the gates' layout conversion, a barrier, sits between the first and the
        second stage's loads). Ignored with split_gram.
    prefetch_tiles: load the ancestor mask and the value tile before the d_k loop instead of
        after it (their latency hidden behind the loop, for BT^2 / 512 + BT * BV / 256 more live
        registers per thread through the loop at 4 warps: 24 at BT = BV = 64). Ignored with
        split_gram.
    transposed_sweeps: run the Neumann sweeps on the transposed system, ``U^T <- R^T - U^T G^T``,
        so that the iterate is the tensor cores' register operand: no shared-memory store of U,
        fence and barrier per sweep (in the sm_90 SASS each sweep of the plain form stores U,
        waits on a memory barrier and two block barriers); two transpositions (R, U) once. Only
        where the sweeps run in fp16 (``fp16_sweeps`` applies) and ``BV >= 16 * num_warps`` (the
        rows of U^T must fill wgmma's tiles); ignored elsewhere.
    whole_head: one program per (request, value head) instead of per value tile: it forms the
        Grams, decays, G and C once, then takes the head's ``d_v / BV`` value tiles in turn (state
        products, sweeps, O), so that none of that is redone per tile; for batches large enough
        to fill the GPU with ``R * H_v`` programs. Ignored with split_gram.
    early_decay: form the decays (from the gates and the ancestor mask, which it loads before the
        d_k loop) before the loop instead of after it, which shortens the chain after the loop;
        the key norms then scale G and C's columns after the loop instead of riding in the decays'
        exponent. The aim was to overlap the loop's first tile loads (8% of batch 1's samples wait
        on them, ncu), but in the sm_90 SASS Triton 3.6 issues those loads only after the decays,
        which overlap the gate and mask loads instead (``decay_in_loop`` fixes the order).
        Overrides defer_gates; ignored with split_gram.
    decay_in_loop: with early_decay, form the decays in the first step of the d_k loop instead of
        before it: the loop's prologue (the first stages' loads) is then issued before them, with
        the gate and mask loads, so that the decays wait for one round trip to memory instead of
        coming between two (sm_90 SASS at BV 32: the first tile load at instruction 108 against
        675); the decays (and the gates) then overlap the first Gram products.
    decay_last_step: with decay_in_loop, in the loop's last step instead of its first (Triton
        peels that step off the loop): the loop then runs from the first tiles' arrival to the
        last products with no gate, mask or decay work in between, and the decays come after it,
        independent of the Gram products they scale (batch 1, T = 64, BK 64: 7% faster).
    fp32_log_decay: with precision "tf32", the path log-decays ``L`` and their differences in the
        fused decays in fp32 instead of fp64 (the fp64 form costs ~90 more instructions per
        thread at BT = 64, conversions and half-rate adds). fp32 loses about ``eps_fp32 * |L|`` in
        ``L_i - L_j``: O's error against fp64 at T = 64 went from 5.0e-6 to 5.2e-6, far below
        what the tf32-mode products leave; the "ieee" mode keeps fp64.
    """

    BV: int
    BK: int
    num_warps: int = 4
    num_stages: int = 2
    split_gram: bool = False
    maxnreg: int | None = None
    bf16_state: bool = False
    cu_bf16x3: bool = False
    fused_norms: bool = False
    fp16_sweeps: bool = False
    defer_gates: bool = False
    prefetch_tiles: bool = False
    transposed_sweeps: bool = False
    whole_head: bool = False
    early_decay: bool = False
    decay_in_loop: bool = False
    decay_last_step: bool = False
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

#: Measured on the H200 (bench/results/kernels-2026-11-29-9b.json: every (BV, BK, warps, split)
#: combination timed for Qwen3.5-9B shapes at batch 1 and 4, T = 8..128, depth 8):
#:   * the best launches fill about one wave: BV = 32 at R * H_v = 32, BV = 128 at R * H_v = 128;
#:   * BK = 32 is best or within 3%; 4 warps for small tiles, 8 for BT = 128 or BT * BV >= 8192;
#:   * split_gram makes no measurable difference up to BT = 128 (it is kept for BT = 256);
#:   * 16 warps at BT = 128 gave wrong results (U error 3e-3 vs 1e-5), so it is never chosen.
#: At BT = 64 and batch >= 4, BV = 64 with 4 warps (two programs per head, two per SM) beat
#: BV = 128 with 8 warps by 5-8% (bench/results/kernel-probe-2026-11-30-run1.json: 28.7 vs 30.2 us
#: at batch 4, 98.0 vs 106.1 us at batch 16), so BT = 64 caps BV at 64.
#: Three pipeline stages for the d_k loop (two tiles in flight ahead of the one in use) up to
#: BT = 64: 6-12% faster at batch 1 and 4 (T = 64, batch 1: 17.3 against 18.7 us; T = 8, batch 4:
#: 10.7 against 12.1 us), within noise at batch 16 and 64; at BT = 128 three were then 1-3% slower
#: from batch 4 on (bench/results/kernel-probe-2026-11-30-stages-*.json; not since the bf16 state
#: products, below). Re-measured
#: after the gate-layout change at T = 64: 12.9 against 14.7 us at batch 1, a wash at 4-64
#: (kernel-probe-2026-11-30-gates-stages.json).
#: bf16 state products (``bf16_state``, bf16 inputs only) at BT = 64 and 128: T = 64, BV = 64:
#: 23.1 -> 18.1 us at batch 4, 81.7 -> 64.1 us at batch 16, 311 -> 239 us at batch 64 (fewer
#: registers and spills: q/k feed the products from shared memory, no fp32 copies); T = 128 (with
#: three stages, now 1% better than two): 26.8 -> 25.0 / 75.3 -> 70.9 / 283 -> 268 us at batch
#: 1 / 4 / 16. At BT = 16 and 32 (BV = 128) splitting the wide S tile costs more than it saves:
#: 22.0 -> 26.3 us at T = 8, batch 16 (bench/results/kernel-probe-2026-11-30-bf16-state-*.json).
#: ``cu_bf16x3`` everywhere: O's error against fp64 7.7e-4 -> 1.0e-5 for 1-3% of time at T = 64
#: (kernel-probe-2026-11-30-cu-bf16x3-t*.json; bench/NOTES.md item 17).
#: ``fused_norms`` at BT = 32, 64 and 128: T = 64, batch 1 / 4 / 16 / 64: 12.17 / 18.57 / 66.01 /
#: 245.3 -> 11.77 / 18.09 / 63.08 / 232.5 us; T = 128, batch 4 / 16: 69.9 -> 66.5, 262.0 -> 247.5;
#: T = 32 3-9% faster; at T = 16 faster at batch 1 and 4 but 13% slower at batch 16 (23.3 -> 26.4),
#: so BT = 16 keeps the loop sums (bench/results/kernel-probe-2026-11-30-fused-norms-*.json).
#: ``fp16_sweeps`` at BT = 16 to 128 (where the sweeps' tf32 products were a fifth of the time):
#: T = 64, batch 1 / 4 / 16 / 64: 12.07 / 18.22 / 64.64 / 236.3 -> 12.08 / 17.62 / 61.45 / 221.7 us;
#: T = 128, batch 1 / 4 / 16: 26.1 / 66.8 / 249.6 -> 22.9 / 57.7 / 213.9; T = 16 and 32 3-14%
#: faster; O's fp32-out error 7.9e-6 -> 5.0e-6 at T = 64 (kernel-probe-2026-11-30-fp16-sweeps-*.json).
#: BT = 256 (split_gram) was not measured with it.
#: ``prefetch_tiles`` at BT = 64 and 128: T = 64, batch 1 / 4 / 16 / 64: 11.70 / 17.20 / 60.72 /
#: 222.6 -> 11.32 / 16.59 / 58.24 / 211.3 us; T = 128 batch 1 24.5 -> 21.3, batch 4 equal, batch 16
#: 2% slower. ``defer_gates`` on top: within 1% either way, so off (kernel-probe-2026-11-30-early-loads-
#: *.json). Neither was measured at BT = 16 and 32.
#: CONFIG_TABLE maps BT to the warps, BK and split choice; pick_config sets BV from the wave rule.
#: ``transposed_sweeps`` at BT = 16 to 128 (applies where BV >= 16 per warp, so not to the BV = 32
#: launches of batch 1): T = 64, batch 16 / 64 57.6 -> 56.8, 211.2 -> 205.3 us (batch 4 within
#: 1.3%); T = 128 batch 4 / 16 / 64 -3% / -4% / -2%; T = 16 and 32 -2% to -4.5%
#: (kernel-probe-2026-11-30-tsweeps-*.json). ``whole_head`` at BT = 64 where pick_config's wave
#: model expects it to pay (below): T = 64, batch 6 / 8 / 16 / 64 29.0 / 30.4 / 58.1 / 212.3 ->
#: 26.6 / 28.0 / 54.1 / 197.9 us, but batch 4 16.8 -> 21.4 and batch 12 44.5 -> 51.0
#: (kernel-probe-2026-11-30-whole-head-*.json).
#: ``early_decay`` at BT = 64 for BV 64: T = 64, batch 4 / 16 16.43 / 53.63 -> 15.98 / 51.65 us
#: (kernel-probe-2026-11-30-early-decay.json); kernels.py, all of the table: batch 4 / 16 / 64
#: 16.7 / 53.3 / 200.2 -> 16.1 / 51.9 / 194.6 us (kernels-2026-11-30-9b-session9.json). Its
#: ``decay_in_loop`` form spills there (batch 4 / 16 16.08 / 53.22 -> 16.94 / 56.59 us) but not at
#: BT = 32, where both together are 1.4-6.5% faster at every batch (T = 32, batch 1 / 4 / 16 / 64:
#: 8.88 / 12.86 / 32.21 / 111.57 -> 8.30 / 12.67 / 31.51 / 110.05 us; early_decay alone -1% to
#: +6%); at BT = 16 only batch 1 gains (NARROW_TILE), batch 16 is 25% slower
#: (kernel-probe-2026-11-30-decay-in-loop-*.json). BT = 128: more spills (offline), not timed.
#: ``fp32_log_decay`` wherever the decays are fused (BT = 32 to 128): T = 64, batch 1 / 4 / 16 / 64
#: 10.52 / 15.98 / 51.88 / 193.1 -> 10.28 / 15.67 / 50.64 / 186.0 us; T = 32 batch 1 / 4 / 16
#: -2% / -3% / -1%; T = 128 batch 1 / 4 / 16 -5.6% / -1.4% / -2.4% (kernel-probe-2026-11-30-fp32-
#: log-decay-t*.json). ``decay_last_step`` at BT = 64 and BV 64 (with decay_in_loop): batch 4
#: 15.67 -> 15.34, batch 16 50.59 -> 51.09 (whole_head), so not in the table (-session10-switches-b).
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

#: Programs in about one wave of the H200's 132 SMs: BV shrinks until the launch has this many.
MIN_PROGRAMS = 128
#: Changes for the narrowest value tile (BV = 32: batch 1 at BT <= 64), by block. Tenth session
#: (kernel-probe-2026-11-30-decay-step*.json, -decay-last-*.json, -session10-*.json; the same
#: switches spelled x_decay_last, x_f32_L there): at BT = 64 BK 64 with the decays in the d_k
#: loop's last step, and the fp32 path sums of CONFIG_TABLE: 10.83-11.18 -> 10.10-10.48 us in five
#: side-by-side runs (-session10-repeats.json; 10.32 / 10.52 with fp64 sums); at BT = 16 the
#: same (T = 16: 6.9 -> 6.0 us, T = 8: 5.9) with bf16 state products, fused norms and prefetched
#: tiles; at BT = 32 those two switches (8.36 -> 8.09 us; the last step there: 9.07, slower).
#: Before (ninth session): the decays formed in the d_k loop's first step (``early_decay`` +
#: ``decay_in_loop``: no spills, 238 registers at BT = 64 against 255 and 12 bytes with the
#: decays before the loop). H200, batch 1,
#: side by side: T = 64 10.90 / 10.87 us in two runs against 11.06 / 11.09 for the launch of
#: kernels-2026-11-30-9b-session9.json (BK 64, decays before the loop; that BK 64 had taken
#: 11.39 / 11.44 to 11.24 / 11.23, kernel-probe-2026-11-30-bk64-b1*.json); T = 16 6.99 -> 6.82
#: (kernel-probe-2026-11-30-decay-in-loop-*.json).
NARROW_TILE: dict[int, dict] = {
    16: dict(BK=64, bf16_state=True, fused_norms=True, prefetch_tiles=True, early_decay=True,
             decay_in_loop=True, decay_last_step=True, fp32_log_decay=True),
    32: dict(bf16_state=True, prefetch_tiles=True),
    64: dict(BK=64, early_decay=True, decay_in_loop=True, decay_last_step=True)}
#: Changes for launches of BV >= 64 with at most one program per SM (ONE_WAVE_PROGRAMS), by block:
#: like batch 1's, such a launch is one dependent chain per SM, and the decays in the d_k loop's
#: last step pay there (eleventh session, kernel-probe-2026-11-30-session11-bv64-last-step-r1/-r2,
#: T = 64, two calls: batch 2 (128 programs) 11.64 / 11.71 -> 11.18 / 11.29 us; batch 3 -1%, 4
#: within 1%, 9 and 12 +2.3% / +1.4%).
ONE_WAVE: dict[int, dict] = {64: dict(early_decay=True, decay_in_loop=True, decay_last_step=True)}
#: The H200's SMs; a launch of at most this many programs runs as one wave, one program per SM
ONE_WAVE_PROGRAMS = 132
#: Programs resident at once on the H200 at BT = 64 (two 4-warp programs of ~255 registers per SM)
WAVE_SLOTS = 2 * ONE_WAVE_PROGRAMS
#: Time of one whole-head program over that of the head's value-tile programs together (T = 64,
#: batch 64, where both launches run many full waves: 197.9 / 206.8 us)
WHOLE_HEAD_COST = 0.955


def _interpreting() -> bool:
    """Whether the kernel runs under Triton's CPU interpreter.

    Decided by how ``@triton.jit`` wrapped the kernel (TRITON_INTERPRET as it was at import time),
    so a later change of the environment variable cannot desynchronise the two.
    """
    kernel = globals().get("_tree_gdn_verify_kernel")
    if kernel is not None:
        return type(kernel).__name__ == "InterpretedFunction"
    return interpreting()


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def pick_config(block_nodes: int, d_k: int, d_v: int, num_programs: int, *,
                interpret: bool | None = None) -> VerifyConfig:
    """Configuration for one launch shape.

    ``num_programs`` is the number of (request, value head) pairs, ``R * H_v``; the launch has
    ``num_programs * cdiv(d_v, BV)`` programs. Under TRITON_INTERPRET (or ``interpret=True``)
    returns :data:`INTERPRET_CONFIG`.
    """
    if interpret is None:
        interpret = _interpreting()
    if interpret:
        return INTERPRET_CONFIG
    keys = sorted(CONFIG_TABLE)
    key = next((kb for kb in keys if kb >= block_nodes), keys[-1])
    base = CONFIG_TABLE[key]
    bv = max(16, min(base.BV, _next_pow2(d_v)))
    bk = max(16, min(base.BK, _next_pow2(d_k)))
    while bv > 32 and num_programs * triton.cdiv(d_v, bv) < MIN_PROGRAMS:
        bv //= 2
    warps = 8 if (block_nodes >= 128 or block_nodes * bv >= 8192) else base.num_warps
    whole_head = base.whole_head and _whole_head_pays(num_programs, triton.cdiv(d_v, bv))
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
          and num_programs * triton.cdiv(d_v, bv) <= ONE_WAVE_PROGRAMS):
        config = replace(config, **ONE_WAVE[key])
    return config


def _whole_head_pays(num_programs: int, tiles: int) -> bool:
    """Whether one program per head beats one per value tile, by counting waves: each launch
    takes ``cdiv(programs, WAVE_SLOTS)`` waves (a part-filled wave costs a whole one), a
    whole-head program ``WHOLE_HEAD_COST * tiles`` times a tile program. It matches every
    measured T = 64 batch: faster at 6, 8, 16 and 64; slower at 4 (under half a wave) and 12
    (1.45 waves against 2.9)."""
    if tiles < 2:
        return False
    head_waves = triton.cdiv(num_programs, WAVE_SLOTS) * WHOLE_HEAD_COST * tiles
    return head_waves < triton.cdiv(num_programs * tiles, WAVE_SLOTS)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------

@triton.jit
def _pad_rows(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p0, num_nodes, h, hk, vcols, v_ok,
              first_tile, H_V: tl.constexpr, H_K: tl.constexpr, GROUP: tl.constexpr,
              D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, L2NORM: tl.constexpr):
    """Padding rows ``p0 .. p0 + BT`` of this program's value tile: o = u = 0, L = 0 (once per head),
    and k_inv_norm of the padding keys (once per key head), so keys() is defined on every row.
    ``first_tile`` is a [BT] vector (all equal): whether this is the head's first value tile."""
    rows = tl.arange(0, BT)
    p_ok = (p0 + rows) < num_nodes
    base = p0.to(tl.int64)                                           # 64-bit scalar row base
    zero_tile = tl.zeros([BT, BV], dtype=tl.float32)
    _store_o_u(o_ptr, u_ptr, zero_tile, zero_tile, base, rows, h, vcols,
               p_ok[:, None] & v_ok[None, :], H_V, D_V)
    mask = p_ok & first_tile
    rk = tl.full([BT], 1.0, dtype=tl.float32)                        # not stored without L2NORM
    if L2NORM:
        w_ok = mask & ((rows * 0 + h % GROUP) == 0)                  # the rows whose norm is stored
        k_rows = k_ptr + base * s_kn + hk * s_kh
        ss = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, D_K, BK):
            kc = k0 + tl.arange(0, BK)
            k_t = tl.load(k_rows + rows[:, None] * s_kn + kc[None, :],
                          mask=w_ok[:, None] & (kc < D_K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(k_t * k_t, axis=1)
        rk = tl.rsqrt(ss + 1e-6)
    _store_node_factors(L_ptr, kinv_ptr, tl.zeros([BT], dtype=tl.float64), rk, base, rows, mask,
                        h, hk, H_V, H_K, GROUP, L2NORM)


@triton.jit
def _tree_rows(cu_ptr, r, BT: tl.constexpr):
    """Request r's tree: its first packed node (64-bit), its end (int32), the local rows
    ``0 .. BT`` and which of them are nodes of the tree."""
    lo32 = tl.load(cu_ptr + r)
    hi32 = tl.load(cu_ptr + r + 1)
    rows = tl.arange(0, BT)
    return lo32.to(tl.int64), hi32, rows, rows < hi32 - lo32


@triton.jit
def _pad_tail(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p_start, num_nodes, h, hk, vcols,
              v_ok, first_tile, H_V: tl.constexpr, H_K: tl.constexpr, GROUP: tl.constexpr,
              D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, L2NORM: tl.constexpr, INTERPRET: tl.constexpr):
    """Every padding row from ``p_start`` (the end of the last tree) to ``num_nodes``, BT at a time."""
    if INTERPRET:
        # the interpreter needs a while loop over a runtime bound (see _neumann)
        p0 = p_start
        while p0 < num_nodes:
            _pad_rows(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p0, num_nodes, h, hk, vcols,
                      v_ok, first_tile, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV, L2NORM)
            p0 += BT
    else:
        for p0 in range(p_start, num_nodes, BT):
            _pad_rows(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, p0, num_nodes, h, hk, vcols,
                      v_ok, first_tile, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV, L2NORM)


@triton.jit
def _store_o_u(o_ptr, u_ptr, O, U, lo, rows, h, vcols, out_mask, H_V: tl.constexpr, D_V: tl.constexpr):
    """One tree's ``[BT, BV]`` tiles of O (in o's dtype) and U (fp32) for value head h."""
    base = lo * (H_V * D_V)                                         # 64-bit scalar tree base
    out_off = rows[:, None] * (H_V * D_V) + h * D_V + vcols[None, :]   # 32-bit within the tree
    tl.store(o_ptr + base + out_off, O.to(o_ptr.dtype.element_ty), mask=out_mask)
    tl.store(u_ptr + base + out_off, U, mask=out_mask)


@triton.jit
def _store_node_factors(L_ptr, kinv_ptr, L, rk, lo, rows, mask, h, hk, H_V: tl.constexpr,
                        H_K: tl.constexpr, GROUP: tl.constexpr, L2NORM: tl.constexpr):
    """One tree's path log-decays L of value head h and, from the first value head of each key
    head only, the key inverse norms; ``mask`` a ``[BT]`` row vector (a scalar bool in a mask is
    refused by Triton >= 3.7's interpreter)."""
    tl.store(L_ptr + lo * H_V + rows * H_V + h, L, mask=mask)
    if L2NORM:
        tl.store(kinv_ptr + lo * H_K + rows * H_K + hk, rk, mask=mask & ((rows * 0 + h % GROUP) == 0))


@triton.jit
def _load_gate_columns(g_rows, b_rows, s_gn, s_bn, A_log_ptr, dt_bias_ptr, h, rows, row_ok,
                       RAW_GATES: tl.constexpr):
    """The per-node gate inputs of one tree and head as ``[BT, 1]`` fp32 columns (zero on padding
    rows): ``g`` and ``beta``, or the raw ``a, b`` with the head's ``A_log, dt_bias`` when
    RAW_GATES (else those two are 0). :func:`_gates` turns them into the gates."""
    col = rows[:, None] + tl.arange(0, 1)[None, :]                   # [BT, 1]
    ok = row_ok[:, None]
    g_col = tl.load(g_rows + col * s_gn, mask=ok, other=0.0).to(tl.float32)
    b_col = tl.load(b_rows + col * s_bn, mask=ok, other=0.0).to(tl.float32)
    if RAW_GATES:
        A_log = tl.load(A_log_ptr + h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    else:
        A_log = 0.0
        dt_bias = 0.0
    return g_col, b_col, A_log, dt_bias


@triton.jit
def _gates(g_col, b_col, A_log, dt_bias, row_ok, RAW_GATES: tl.constexpr):
    """Per-node gates in fp32 from :func:`_load_gate_columns`, zero on padding rows: ``g`` (log
    decay) and ``beta``, fused from the raw ``a, b`` with ``A_log, dt_bias`` when RAW_GATES.

    The gates are computed as ``[BT, 1]`` columns and summed over the unit axis. That sum is exact
    (one term) and is there for the layout: a ``[BT]`` vector used in the ``[BT, BT]`` tiles takes
    their replicated slice layout, and Triton 3.6 then loads and computes every gate 16 times per
    thread (libdevice ``logf`` included); the reduction stops that propagation, so each thread
    computes one gate and the result is converted once (sm_90 SASS of the batch-1 launch: 3528 ->
    2848 instructions, 254 -> 238 registers; bench/NOTES.md).
    """
    ok = row_ok[:, None]
    if RAW_GATES:
        x = g_col + dt_bias
        # softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p by its series where 1 + t rounds to 1
        t = tl.exp(-tl.abs(x))
        log1p_t = tl.where(t < 1e-4, t * (1.0 - 0.5 * t), tl.log(1.0 + t))
        g = -tl.exp(A_log) * (tl.maximum(x, 0.0) + log1p_t)
        e_b = tl.exp(-tl.abs(b_col))                                  # sigmoid without overflow
        beta = tl.where(b_col >= 0, 1.0, e_b) / (1.0 + e_b)
    else:
        g = g_col
        beta = b_col
    g = tl.sum(tl.where(ok, g, 0.0), axis=1)
    beta = tl.sum(tl.where(ok, beta, 0.0), axis=1)
    return g, beta


@triton.jit
def _tree_matrices(kk, qk, ss_k, ss_q, strict, decay, beta, L, scale, BT: tl.constexpr,
                   L2NORM: tl.constexpr, COLS_IN_DECAY: tl.constexpr):
    """G (strict ancestors) and C (ancestors and self) from the Gram products, with the l2
    normalisation and the query scale as row / column scalings (the column scaling ``rk_j``
    already inside ``decay`` when COLS_IN_DECAY); also the key inverse norms and the row factors
    ``e^L rk`` of ``K S_pre`` and ``e^L rq`` of ``Q S_pre``."""
    # (inline, not a helper: a nested jit call changed the picked BV 64 launch's ptxas output)
    e_L = tl.exp(L.to(tl.float32))
    if L2NORM:
        rk = tl.rsqrt(ss_k + 1e-6)                                   # k_inv_norm
        rq = tl.rsqrt(ss_q + 1e-6) * scale
    else:
        rk = tl.full([BT], 1.0, dtype=tl.float32)
        rq = tl.full([BT], 1.0, dtype=tl.float32) * scale
    if COLS_IN_DECAY:
        G = tl.where(strict, (beta * rk)[:, None] * decay * kk, 0.0)
        C = decay * qk * rq[:, None]
    elif L2NORM:
        G = tl.where(strict, (beta * rk)[:, None] * decay * kk * rk[None, :], 0.0)
        C = decay * qk * (rq[:, None] * rk[None, :])
    else:
        G = tl.where(strict, beta[:, None] * decay * kk, 0.0)
        C = decay * qk * scale
    return G, C, rk, e_L * rk, e_L * rq


@triton.jit
def _exp2_ftz(x, INTERPRET: tl.constexpr):
    """2^x in one MUFU.EX2 (``ex2.approx.ftz``: results below 2^-126 flush to zero). ``tl.exp``
    lowers to ``ex2.approx.f32`` after a multiply, and Triton 3.6's non-ftz form costs five
    instructions per element (a range test and a predicated rescale around the MUFU)."""
    if INTERPRET:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _load_ancestors(mask_rows, s_mn, rows, row_ok):
    """The tree's ancestor mask rows (self included), ``[BT, BT]`` uint8 as stored."""
    # rows past the tree may lie past the buffer; columns never do (the mask is [N, BT]), and a
    # set bit in a padding column is harmless (its key, gate and beta are zero), so the mask is
    # uniform along a row and the loads vectorise
    return tl.load(mask_rows + rows[:, None] * s_mn + rows[None, :], mask=row_ok[:, None], other=0)


@triton.jit
def _tree_decay(anc_u8, g, rows, col_log2, FUSED: tl.constexpr, INTERPRET: tl.constexpr,
                F32_L: tl.constexpr = False):
    """Ancestor mask (self included) from :func:`_load_ancestors`, strict mask, path log-decay L
    and the masked decay matrix.

    FUSED: ``decay_ij = 2^(L_i log2(e) - L_j log2(e) + col_log2_j)`` in one ftz exp2 per element,
    the exponent in fp64 (fp32 when F32_L: ``L`` then returns in fp32); ``col_log2`` (``[BT]``
    fp32) folds a column scaling (the key inverse norms) into the decays. Otherwise
    ``exp(L_i - L_j)`` and ``col_log2`` is not read."""
    anc = anc_u8 != 0
    strict = anc & (rows[:, None] != rows[None, :])
    # L_i = sum_j mask_ij g_j in fp64 (L_i - L_j of two long paths loses eps * |L| in fp32);
    # decays from the differences, masked to -inf *before* exp
    if F32_L:
        L = tl.sum(tl.where(anc, g[None, :], 0.0), axis=1)
    else:
        L = tl.sum(tl.where(anc, g.to(tl.float64)[None, :], 0.0), axis=1)
    if FUSED:
        L2 = L * 1.4426950408889634                                  # log2(e)
        if F32_L:
            diff = L2[:, None] - (L2 - col_log2)[None, :]
        else:
            diff = (L2[:, None] - (L2 - col_log2.to(tl.float64))[None, :]).to(tl.float32)
        decay = _exp2_ftz(tl.where(anc, diff, float("-inf")), INTERPRET)
    else:
        diff = (L[:, None] - L[None, :]).to(tl.float32)
        decay = tl.exp(tl.where(anc, diff, float("-inf")))
    return strict, L, decay


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """``tl.dot(a, b, acc, input_precision=PREC)``. Under Triton's interpreter, whose products of
    bf16 tiles are wrong (Triton 3.6 to 3.9), bf16 operands are widened to fp32 first (exact), so
    that the bf16 paths run on the CPU too; compiled, it is plain ``tl.dot``."""
    if INTERPRET and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _split_bf16(s):
    """fp32 ``s`` as ``s_hi + s_lo``, both bf16, round to nearest: ``|s - s_hi - s_lo| <= 2^-17 |s|``
    (16 mantissa bits against tf32's 10), so that bf16 ``x`` times s runs as two bf16 products."""
    s_hi = s.to(tl.bfloat16)
    s_lo = (s - s_hi.to(tl.float32)).to(tl.bfloat16)
    return s_hi, s_lo


@triton.jit
def _load_dk_tiles(x_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk, s_sv,
                   D_K: tl.constexpr, D_V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   LOAD_X: tl.constexpr):
    """Step ``k0`` of the d_k loop: ``X``'s and K's ``[BT, BK]`` tiles (input dtype; X = K unless
    LOAD_X) and the S_pre tile ``[BK, BV]`` (fp32). Where BK divides d_k (and BV d_v) the column
    masks are left out: the q/k masks are then uniform along a row, so the loads vectorise, and
    the S_pre tile needs none (per-element masks cost address and predicate work every step)."""
    kc = k0 + tl.arange(0, BK)
    if D_K % BK == 0:
        k_t = tl.load(k_base + kc[None, :], mask=row_ok[:, None], other=0.0)
        x_t = k_t
        if LOAD_X:
            x_t = tl.load(x_base + kc[None, :], mask=row_ok[:, None], other=0.0)
        s_ptrs = s_base + kc[:, None] * s_sk + vcols[None, :] * s_sv
        if D_V % BV == 0:
            s_t = tl.load(s_ptrs)
        else:
            s_t = tl.load(s_ptrs, mask=v_ok[None, :], other=0.0)
    else:
        kc_ok = kc < D_K
        ld_mask = row_ok[:, None] & kc_ok[None, :]
        k_t = tl.load(k_base + kc[None, :], mask=ld_mask, other=0.0)
        x_t = k_t
        if LOAD_X:
            x_t = tl.load(x_base + kc[None, :], mask=ld_mask, other=0.0)
        s_t = tl.load(s_base + kc[:, None] * s_sk + vcols[None, :] * s_sv,
                      mask=kc_ok[:, None] & v_ok[None, :], other=0.0)
    return x_t, k_t, s_t


@triton.jit
def _state_products(x_t, s_t, xs, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """``xs + X S`` for one d_k step: S split into bf16 halves (two products) when S_BF16X2,
    else one product at PREC of X widened to fp32."""
    if S_BF16X2:
        s_hi, s_lo = _split_bf16(s_t)
        xs = _dot(x_t, s_hi, xs, PREC, INTERPRET)
        xs = _dot(x_t, s_lo, xs, PREC, INTERPRET)
    else:
        xs = tl.dot(x_t.to(tl.float32), s_t, xs, input_precision=PREC)
    return xs


@triton.jit
def _stream_state(q_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                  D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """One pass over d_k for the state products alone: ``K S`` and ``Q S`` [BT, BV]."""
    ks = tl.zeros([BT, BV], dtype=tl.float32)
    qs = tl.zeros([BT, BV], dtype=tl.float32)
    for k0 in range(0, D_K, BK):
        q_t, k_t, s_t = _load_dk_tiles(q_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk, s_sv,
                                       D_K, D_V, BK, BV, True)
        ks = _state_products(k_t, s_t, ks, PREC, S_BF16X2, INTERPRET)
        qs = _state_products(q_t, s_t, qs, PREC, S_BF16X2, INTERPRET)
    return ks, qs


@triton.jit
def _output(C, U, row_qs, qs, PREC: tl.constexpr, CU_BF16X3: tl.constexpr,
            INTERPRET: tl.constexpr):
    """``O = e^L Q S_pre + C U`` (l2 normalisation and scale applied as row / column scalings):
    ``C U`` as three bf16 products of hi/lo halves when CU_BF16X3 (16 mantissa bits against
    tf32's 10), else one product at PREC."""
    if CU_BF16X3:
        c_hi, c_lo = _split_bf16(C)
        u_hi, u_lo = _split_bf16(U)
        O = _dot(c_hi, u_hi, row_qs[:, None] * qs, PREC, INTERPRET)
        O = _dot(c_hi, u_lo, O, PREC, INTERPRET)
        O = _dot(c_lo, u_hi, O, PREC, INTERPRET)
    else:
        O = row_qs[:, None] * qs + tl.dot(C, U, input_precision=PREC)
    return O


@triton.jit
def _stream_dk(x_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
               D_K: tl.constexpr, D_V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, X_IS_K: tl.constexpr, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
               INTERPRET: tl.constexpr):
    """One pass over d_k: ``X K^T`` [BT, BT], ``X S`` [BT, BV] and the row sums of squares of X."""
    xk = tl.zeros([BT, BT], dtype=tl.float32)
    xs = tl.zeros([BT, BV], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, D_K, BK):
        x_t, k_t, s_t = _load_dk_tiles(x_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk, s_sv,
                                       D_K, D_V, BK, BV, not X_IS_K)
        xk = _dot(x_t, tl.trans(k_t), xk, PREC, INTERPRET)
        xs = _state_products(x_t, s_t, xs, PREC, S_BF16X2, INTERPRET)
        x_f = x_t.to(tl.float32)
        ss += tl.sum(x_f * x_f, axis=1)
    return xk, xs, ss


@triton.jit
def _pow2_scale(Rm):
    """Powers of two ``(s, 1 / s)`` with ``max |Rm| * s`` in ``[0.5, 1)`` (``s`` from the exponent
    bits of ``max |Rm|``, so scaling by it is exact); ``s = 2^126`` when ``Rm`` is zero."""
    m = tl.max(tl.max(tl.abs(Rm), axis=1), axis=0)
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF                 # biased exponent, 0..254
    e = tl.minimum(tl.maximum(e, 1), 252)
    s = ((253 - e) << 23).to(tl.float32, bitcast=True)               # 2^(126 - e)
    s_inv = ((e + 1) << 23).to(tl.float32, bitcast=True)             # 2^(e - 126)
    return s, s_inv


@triton.jit
def _sweep_product(G, U, PREC: tl.constexpr, F16: tl.constexpr):
    """``G U`` of one sweep: fp16 operands (G already fp16) when F16, else ``PREC``."""
    if F16:
        return tl.dot(G, U.to(tl.float16))
    else:
        return tl.dot(G, U, input_precision=PREC)


@triton.jit
def _neumann(G, Rm, max_depth, PREC: tl.constexpr, F16: tl.constexpr, TRANS: tl.constexpr,
             INTERPRET: tl.constexpr):
    """``(I + G) U = R`` for G nilpotent of index <= max_depth + 1: max_depth sweeps are exact.

    TRANS (with F16 only): sweep the transposed system, ``U^T = R^T - U^T G^T``: the iterate is
    then the product's first operand, which the tensor cores take from registers, so a sweep
    needs no shared-memory store of U and no barrier (G^T, the constant operand, is stored once).

    F16: the products ``G U`` in fp16 (twice tf32's tensor-core rate; operands rounded to
    nearest with tf32's 10 mantissa bits, where tf32 truncates fp32 operands), fp32 accumulation
    and fp32 U. Only for ``|G_ij| <= 1`` (l2-normalised keys, beta <= 1, decays <= 1) and
    ``max_depth <= 15``: R is scaled by a power of two to ``max |R| < 1``, and every iterate then
    stays under ``2^max_depth <= 2^15`` (fp16's largest finite value is 65504): row i of ``G^m R``
    is bounded by the number of ancestor chains of length m ending at i, ``C(depth_i, m)``."""
    if F16:
        s, s_inv = _pow2_scale(Rm)
        Rm = Rm * s
        G = G.to(tl.float16)
    if TRANS:
        U = _neumann_transposed(tl.trans(G), tl.trans(Rm), max_depth, INTERPRET)
        U = tl.trans(U)
    else:
        U = _neumann_sweeps(G, Rm, max_depth, PREC, F16, INTERPRET)
    if F16:
        U = U * s_inv
    return U


@triton.jit
def _neumann_sweeps(G, Rm, max_depth, PREC: tl.constexpr, F16: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """max_depth sweeps ``U <- R - G U`` from ``U = R`` (operands as _neumann prepared them)."""
    U = Rm
    if INTERPRET:
        # Triton 3.6's interpreter cannot use a scalar argument as a range() bound under
        # numpy >= 2.4 (int() of a 1-element array); a while loop only needs bool().
        sweep = 0
        while sweep < max_depth:
            U = Rm - _sweep_product(G, U, PREC, F16)
            sweep += 1
    elif max_depth > 0:
        # the first sweep is peeled so that G's conversion to the dot-operand layout happens
        # before the loop and CSE reuses it in there; in the plain loop Triton 3.6 redoes it in
        # every sweep (32 shuffles and 32 selects per thread and sweep in the sm_90 SASS)
        U = Rm - _sweep_product(G, Rm, PREC, F16)
        for _ in range(1, max_depth):
            U = Rm - _sweep_product(G, U, PREC, F16)
    return U


@triton.jit
def _neumann_transposed(Gt, Rt, max_depth, INTERPRET: tl.constexpr):
    """max_depth sweeps ``U^T <- R^T - U^T G^T`` from ``U^T = R^T``: ``Rt`` [BV, BT] fp32, ``Gt``
    [BT, BT] fp16; the products in fp16 with fp32 accumulation."""
    Ut = Rt
    if INTERPRET:
        sweep = 0
        while sweep < max_depth:
            Ut = Rt - tl.dot(Ut.to(tl.float16), Gt)
            sweep += 1
    elif max_depth > 0:
        Ut = Rt - tl.dot(Rt.to(tl.float16), Gt)
        for _ in range(1, max_depth):
            Ut = Rt - tl.dot(Ut.to(tl.float16), Gt)
    return Ut


# the sizes vary round to round: specialising on them (== 1, % 16) would compile a variant each
@triton.jit(do_not_specialize=["num_nodes", "num_requests", "max_depth"])
def _tree_gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr,
    g_ptr, beta_ptr,                # g, beta  -- or the raw a, b when RAW_GATES
    A_log_ptr, dt_bias_ptr,         # [H_v], only read when RAW_GATES
    state_ptr, state_idx_ptr,       # state pool [S, H_v, d_k, d_v] fp32 (strided), slots [R]
    cu_ptr, mask_ptr,               # cu_nodes [R + 1] int32, ancestor mask [N, BT] uint8
    o_ptr, u_ptr, L_ptr, kinv_ptr,  # o [N, H_v, d_v] (v's dtype), u [N, H_v, d_v] fp32,
                                    # L [N, H_v] fp32, k_inv_norm [N, H_k] fp32
    num_nodes, num_requests, max_depth, scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh,
    s_gn, s_gh, s_bn, s_bh,
    s_ss, s_sh, s_sk, s_sv,
    s_mn,
    H_V: tl.constexpr, H_K: tl.constexpr, GROUP: tl.constexpr,
    D_K: tl.constexpr, D_V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr,
    RAW_GATES: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr, S_BF16X2: tl.constexpr,
    CU_BF16X3: tl.constexpr, FUSED_NORMS: tl.constexpr, F16_SWEEPS: tl.constexpr,
    DEFER_GATES: tl.constexpr, PREFETCH: tl.constexpr, T_SWEEPS: tl.constexpr,
    WHOLE_HEAD: tl.constexpr, EARLY_DECAY: tl.constexpr, DECAY_IN_LOOP: tl.constexpr,
    DECAY_STEP: tl.constexpr, F32_L: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    iv = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // GROUP

    lo, hi32, rows, row_ok = _tree_rows(cu_ptr, r, BT)
    # 64-bit offsets live in the scalar per-tree bases; per-element offsets (< BT rows) stay 32-bit
    gate_in = _load_gate_columns(g_ptr + lo * s_gn + h * s_gh, beta_ptr + lo * s_bn + h * s_bh,
                                 s_gn, s_bn, A_log_ptr, dt_bias_ptr, h, rows, row_ok, RAW_GATES)
    if not (DEFER_GATES or DECAY_IN_LOOP):
        g, beta = _gates(*gate_in, row_ok, RAW_GATES)

    vcols = iv * BV + tl.arange(0, BV)
    v_ok = vcols < D_V
    slot = tl.load(state_idx_ptr + r).to(tl.int64)
    s_base = state_ptr + slot * s_ss + h.to(tl.int64) * s_sh
    q_base = q_ptr + lo * s_qn + hk * s_qh + rows[:, None] * s_qn
    k_base = k_ptr + lo * s_kn + hk * s_kh + rows[:, None] * s_kn
    mask_rows = mask_ptr + lo * s_mn
    v_rows = v_ptr + lo * s_vn + h * s_vh + rows[:, None] * s_vn

    if SPLIT:
        # Two passes over d_k: K first (G, R, then U), Q second (C, O), so that at most one
        # [BT, BT] Gram accumulator is live at a time; K and S_pre are read twice (from L2).
        kk, ks, ss_k = _stream_dk(k_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                                  D_K, D_V, BT, BK, BV, True, PREC, S_BF16X2, INTERPRET)
        strict, L, decay = _tree_decay(_load_ancestors(mask_rows, s_mn, rows, row_ok), g, rows, beta,
                                        False, INTERPRET)
        e_L = tl.exp(L.to(tl.float32))
        if L2NORM:
            rk = tl.rsqrt(ss_k + 1e-6)                               # k_inv_norm
            G = tl.where(strict, (beta * rk)[:, None] * decay * kk * rk[None, :], 0.0)
            row_ks = e_L * rk
        else:
            rk = tl.full([BT], 1.0, dtype=tl.float32)
            G = tl.where(strict, beta[:, None] * decay * kk, 0.0)
            row_ks = e_L
        v_t = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :],
                      other=0.0).to(tl.float32)
        U = _neumann(G, beta[:, None] * (v_t - row_ks[:, None] * ks), max_depth, PREC,
                     F16_SWEEPS, T_SWEEPS, INTERPRET)
        qk, qs, ss_q = _stream_dk(q_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                                  D_K, D_V, BT, BK, BV, False, PREC, S_BF16X2, INTERPRET)
        strict, L, decay = _tree_decay(_load_ancestors(mask_rows, s_mn, rows, row_ok), g, rows, beta,
                                        False, INTERPRET)
        if L2NORM:
            rq = tl.rsqrt(ss_q + 1e-6) * scale
            C = decay * qk * (rq[:, None] * rk[None, :])
        else:
            rq = tl.full([BT], 1.0, dtype=tl.float32) * scale
            C = decay * qk * scale
        row_qs = e_L * rq
    else:
        # One pass over d_k accumulating both Gram products and both state products.
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        ks = tl.zeros([BT, BV], dtype=tl.float32)
        qs = tl.zeros([BT, BV], dtype=tl.float32)
        ss_k = tl.zeros([BT], dtype=tl.float32)
        ss_q = tl.zeros([BT], dtype=tl.float32)
        if PREFETCH or EARLY_DECAY:
            # issued before the loop so that their latency hides behind it (registers permitting)
            anc_u8 = _load_ancestors(mask_rows, s_mn, rows, row_ok)
        if PREFETCH:
            v_in = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        if EARLY_DECAY:
            # the decays need only the gates and the mask (Triton 3.6 issues the loop's first
            # loads after them); the key norms' column scaling is applied after the loop, and a
            # decay of a non-ancestor is 0, so the mask is not needed again (only the diagonal is
            # taken out of G). DECAY_IN_LOOP: in the loop's step DECAY_STEP (the first, after
            # its first loads, or the last, which Triton peels off the loop)
            if DECAY_IN_LOOP:
                beta = tl.zeros([BT], dtype=tl.float32)
                L = tl.zeros([BT], dtype=tl.float32 if F32_L else tl.float64)
                decay = tl.zeros([BT, BT], dtype=tl.float32)
            else:
                _, L, decay = _tree_decay(anc_u8, g, rows, tl.zeros([BT], dtype=tl.float32), True,
                                          INTERPRET, F32_L)
        for k0 in range(0, D_K, BK):
            if DECAY_IN_LOOP:
                if k0 == DECAY_STEP * BK:
                    g, beta = _gates(*gate_in, row_ok, RAW_GATES)
                    _, L, decay = _tree_decay(anc_u8, g, rows, tl.zeros([BT], dtype=tl.float32),
                                              True, INTERPRET, F32_L)
            q_t, k_t, s_t = _load_dk_tiles(q_base, k_base, s_base, k0, row_ok, vcols, v_ok, s_sk,
                                           s_sv, D_K, D_V, BK, BV, True)
            kt_t = tl.trans(k_t)
            kk = _dot(k_t, kt_t, kk, PREC, INTERPRET)
            qk = _dot(q_t, kt_t, qk, PREC, INTERPRET)
            ks = _state_products(k_t, s_t, ks, PREC, S_BF16X2, INTERPRET)
            qs = _state_products(q_t, s_t, qs, PREC, S_BF16X2, INTERPRET)
            k_f = k_t.to(tl.float32)
            q_f = q_t.to(tl.float32)
            if L2NORM:
                if not FUSED_NORMS:
                    ss_k += tl.sum(k_f * k_f, axis=1)
                ss_q += tl.sum(q_f * q_f, axis=1)
        # unless PREFETCH, the ancestor mask and V are loaded after the loop so that no other
        # tile is live in it; G and C are formed at once so that kk, qk and decay die before the
        # solve. DEFER_GATES: the gates computed only now from inputs loaded at the start, so
        # that the prologue's loads are not held up behind the gate loads' latency.
        if DEFER_GATES:
            g, beta = _gates(*gate_in, row_ok, RAW_GATES)
        if not (PREFETCH or EARLY_DECAY):
            anc_u8 = _load_ancestors(mask_rows, s_mn, rows, row_ok)
        if FUSED_NORMS and L2NORM:
            # |k_i|^2 from the diagonal of K K^T (the same products, accumulated by the tensor
            # cores)
            ss_k = tl.sum(tl.where(rows[:, None] == rows[None, :], kk, 0.0), axis=1)
        if EARLY_DECAY:
            strict = rows[:, None] != rows[None, :]
        elif FUSED_NORMS:
            # the column scaling rk_j of G and C folded into the decays' exponent
            if L2NORM:
                col_log2 = tl.log2(tl.rsqrt(ss_k + 1e-6))        # log2 of _tree_matrices' rk
            else:
                col_log2 = tl.zeros([BT], dtype=tl.float32)
            strict, L, decay = _tree_decay(anc_u8, g, rows, col_log2, True, INTERPRET, F32_L)
        else:
            strict, L, decay = _tree_decay(anc_u8, g, rows, beta, False, INTERPRET)
        G, C, rk, row_ks, row_qs = _tree_matrices(kk, qk, ss_k, ss_q, strict, decay, beta, L, scale,
                                                  BT, L2NORM, FUSED_NORMS and not EARLY_DECAY)
        if not PREFETCH:
            v_in = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        if WHOLE_HEAD and F16_SWEEPS:
            G = G.to(tl.float16)          # kept for the head's other tiles: half the registers
        U = _neumann(G, beta[:, None] * (v_in.to(tl.float32) - row_ks[:, None] * ks), max_depth,
                     PREC, F16_SWEEPS, T_SWEEPS, INTERPRET)

    O = _output(C, U, row_qs, qs, PREC, CU_BF16X3, INTERPRET)

    # ---- write O, U (and L, k_inv_norm once per head) ----
    _store_o_u(o_ptr, u_ptr, O, U, lo, rows, h, vcols, row_ok[:, None] & v_ok[None, :], H_V, D_V)
    # masks as row vectors (Triton >= 3.7's interpreter refuses a scalar bool in a mask)
    first_tile = (rows * 0 + iv) == 0                    # [BT], all equal
    _store_node_factors(L_ptr, kinv_ptr, L, rk, lo, rows, row_ok & first_tile, h, hk,
                        H_V, H_K, GROUP, L2NORM)

    # ---- padding rows (past cu_nodes[-1]) are written by the last request's programs ----
    if r == num_requests - 1:
        _pad_tail(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, hi32, num_nodes, h, hk, vcols,
                  v_ok, first_tile, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV, L2NORM, INTERPRET)

    if WHOLE_HEAD:
        # ---- the head's other value tiles, reusing G, C and the row scalings ----
        not_first = rows < 0                             # [BT], all False: L, k_inv_norm are done
        for t in range(1, (D_V + BV - 1) // BV):
            vcols = t * BV + tl.arange(0, BV)
            v_ok = vcols < D_V
            v_in = tl.load(v_rows + vcols[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
            ks, qs = _stream_state(q_base, k_base, s_base, row_ok, vcols, v_ok, s_sk, s_sv,
                                   D_K, D_V, BT, BK, BV, PREC, S_BF16X2, INTERPRET)
            U = _neumann(G, beta[:, None] * (v_in.to(tl.float32) - row_ks[:, None] * ks),
                         max_depth, PREC, F16_SWEEPS, T_SWEEPS, INTERPRET)
            O = _output(C, U, row_qs, qs, PREC, CU_BF16X3, INTERPRET)
            _store_o_u(o_ptr, u_ptr, O, U, lo, rows, h, vcols, row_ok[:, None] & v_ok[None, :],
                       H_V, D_V)
            if r == num_requests - 1:
                _pad_tail(o_ptr, u_ptr, L_ptr, kinv_ptr, k_ptr, s_kn, s_kh, hi32, num_nodes, h,
                          hk, vcols, v_ok, not_first, H_V, H_K, GROUP, D_K, D_V, BT, BK, BV,
                          L2NORM, INTERPRET)


# --------------------------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------------------------

def kernel_switches(config: VerifyConfig, *, dtype: torch.dtype, precision: str, raw_gates: bool,
                    l2norm: bool, max_depth: int, interpret: bool, d_k: int) -> dict[str, int]:
    """The kernel's compile-time switches for ``config`` on these inputs: each of the config's
    options where it applies, off where it does not (bench/kernel_registers.py compiles with the
    same flags)."""
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
        # 64-row tiles; below that Triton falls back to mma.sync with register shuffles (sm_90
        # SASS at BV = 32, 4 warps: the sweep loop 47 -> 491 instructions). fp16 sweeps only:
        # that is the form verified compiled on the H200 (bench/verify_configs.py); tf32 register
        # operands were never checked there (item 25's wrong results came from such operands)
        T_SWEEPS=bool(config.transposed_sweeps) and config.BV >= 16 * config.num_warps
        and f16_sweeps,
        WHOLE_HEAD=bool(config.whole_head) and not split,
        EARLY_DECAY=early_decay,
        DECAY_IN_LOOP=decay_in_loop,
        # the d_k loop's step that forms the decays under DECAY_IN_LOOP: the first or the last
        DECAY_STEP=triton.cdiv(d_k, config.BK) - 1 if decay_in_loop and config.decay_last_step
        else 0,
        # fp32 path sums where the decays are fused (the only _tree_decay form that takes them):
        # the error they add is far below that of tf32-mode products
        F32_L=bool(config.fp32_log_decay) and precision == "tf32" and (early_decay or fused_norms),
        INTERPRET=interpret,
    )


def _refuse_known_miscompile(config: VerifyConfig, switches: dict[str, bool], block_nodes: int,
                             dtype: torch.dtype, precision: str) -> None:
    """Refuse the one launch known to compute wrong results: Triton 3.6 on the H200 gave O off by
    ~0.1 for BT = 64, BV = 128, 8 warps, 3 stages with fp16/bf16 inputs and unsplit tf32 state
    products (BV 64, 2 stages, bf16_state, fp32 inputs, "ieee" and BT = 128 were all correct:
    bench/NOTES.md, seventh session). pick_config never makes it (BT = 64 caps BV at 64)."""
    if (switches["INTERPRET"] or block_nodes != 64 or config.BV < 128 or config.num_warps != 8
            or config.num_stages < 3 or switches["S_BF16X2"] or precision != "tf32"
            or dtype not in (torch.float16, torch.bfloat16)):
        return
    raise ValueError(
        f"{config} at block_nodes=64 with {dtype} inputs and precision='tf32' miscompiles under "
        f"Triton 3.6 (wrong results on the H200); use num_stages=2, BV=64, bf16_state=True (bf16 "
        f"inputs) or config=None for pick_config's choice")


def _rows(x: torch.Tensor, n: int, *tail: int) -> torch.Tensor:
    """``x`` reshaped to ``[n, *tail]`` (a view where possible) with unit stride in the last dim."""
    y = x.reshape(n, *tail)
    if y.stride(-1) != 1 and y.shape[-1] > 1:
        y = y.contiguous()
    return y


def _check_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}; put every input on one device")


def tree_gdn_verify_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForestMeta, *,
    g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
    initial_state: torch.Tensor, state_indices: torch.Tensor | None = None,
    scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
    precision: str | None = None, check_values: bool = False, config: VerifyConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, TreeFactors]:
    """Verify every node of a packed forest in one launch.

    Args:
        q, k: ``[B, T, H_k, d_k]``; v: ``[B, T, H_v, d_v]`` (fp16, bf16 or fp32), ``B * T == N``.
        meta: :meth:`PackedForest.kernel_meta` on the inputs' device.
        g, beta: ``[B, T, H_v]`` gates, or raw ``a, b [B, T, H_v]`` with ``A_log, dt_bias [H_v]``
            (gates then computed in the kernel, in fp32).
        initial_state: state pool ``[S, H_v, d_k, d_v]`` fp32, only read.
        state_indices: ``[R]`` integer slot of each request in the pool; default ``arange(R)``
            (then ``S`` must equal ``R``), built on the device at every call: one more launch
            (about 1 us on the H200), so a caller that runs many layers passes its slots.
        scale: query scale, default ``d_k ** -0.5``.
        precision: tl.dot input precision for fp32 operands: "tf32", "tf32x3" or "ieee". Default:
            "tf32" for fp16/bf16 inputs (measured on the H200, bf16 inputs, Qwen3.5-9B shapes,
            T = 64: fp32 O within 8e-6 of fp64, a bf16 O within 1.6e-4 of the correctly rounded
            fp64 result), "ieee" for fp32 inputs: with fp32 q/k the Gram products
            also run in tf32, and on the H200 (Triton 3.6, d = 128) that gave 0.7e-3 to 4e-2
            relative error (bench/results/kernels-2026-11-29.json, "bole-tf32-fp32-out"); ask
            for "tf32" explicitly only where that is acceptable.
        check_values: also check for NaN/inf, positive g and out-of-range slots (syncs the device).
        config: override of :func:`pick_config`'s choice (benchmark sweeps).
        out_dtype: dtype of ``o`` (fp16, bf16 or fp32), default v's dtype. fp32 keeps the kernel's
            own accuracy: a bf16 ``o`` carries bf16's rounding (~1.7e-3 relative) on top of it.

    Returns ``(o, factors)``: ``o`` shaped like ``v`` in ``out_dtype``; ``factors`` with
    ``log_decay [N, H_v]`` fp64, ``k`` the raw keys ``[N, H_k, d_k]`` (a view), ``u [N, H_v, d_v]``
    fp32 and ``k_inv_norm [N, H_k]`` fp32 when ``use_qk_l2norm_in_kernel`` (else None).
    Padding nodes get ``o = 0``, ``u = 0``, ``log_decay = 0``; their ``k_inv_norm`` is the true
    inverse norm of their keys, so ``factors.keys()`` is the normalised keys on every row.
    """
    if not isinstance(meta, ForestMeta):
        raise TypeError(f"meta must be a ForestMeta (PackedForest.kernel_meta), got {type(meta).__name__}")
    if precision is None:
        precision = "tf32" if getattr(q, "dtype", None) in (torch.float16, torch.bfloat16) else "ieee"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if initial_state is None:
        raise ValueError("initial_state (the state pool [S, H_v, d_k, d_v]) is required")
    if out_dtype is not None and out_dtype not in KERNEL_INPUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float16, torch.bfloat16 or torch.float32, got {out_dtype}")

    # raw gates are validated but not computed here: the kernel fuses the gating
    B, T, H_k, d_k, H_v, d_v, _, _ = check_gdn_tensors(
        q, k, v, g, beta, a, b, A_log, dt_bias, initial_state, None, check_values,
        resolve_raw_gates=False)
    raw_gates = g is None
    check_kernel_device(q.device, "tree_gdn_verify_triton")
    if q.dtype not in KERNEL_INPUT_DTYPES:
        raise TypeError(
            f"the Triton kernel takes fp16, bf16 or fp32 q/k/v, got {q.dtype}; "
            "use tree_gdn_closed_form for fp64")
    if initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state has dtype {initial_state.dtype}; the Triton kernel reads an fp32 pool")
    if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (H_v, d_k, d_v):
        raise ValueError(
            f"initial_state has shape {tuple(initial_state.shape)}, expected a state pool "
            f"[S, H_v={H_v}, d_k={d_k}, d_v={d_v}]")

    N, R, BT = meta.num_nodes, meta.num_requests, meta.block_nodes
    if B * T != N:
        raise ValueError(
            f"inputs carry B*T = {B}*{T} = {B * T} nodes but the forest has {N}; "
            "pass a packed forest as B=1, T=N")
    if BT < 16 or BT & (BT - 1) or BT < meta.max_tree_nodes:
        raise ValueError(
            f"meta.block_nodes={BT} must be a power of two >= max(16, max_tree_nodes={meta.max_tree_nodes})")
    if tuple(meta.ancestor_mask.shape) != (N, BT) or meta.ancestor_mask.dtype != torch.uint8:
        raise ValueError(
            f"meta.ancestor_mask must be uint8 [N={N}, block_nodes={BT}], got "
            f"{meta.ancestor_mask.dtype} {tuple(meta.ancestor_mask.shape)}")
    if tuple(meta.cu_nodes.shape) != (R + 1,) or meta.cu_nodes.dtype != torch.int32:
        raise ValueError(f"meta.cu_nodes must be int32 [R + 1 = {R + 1}], got "
                         f"{meta.cu_nodes.dtype} {tuple(meta.cu_nodes.shape)}")

    device = q.device
    S = initial_state.shape[0]
    if state_indices is None:
        if S != R:
            raise ValueError(
                f"the state pool has {S} slots but the forest has {R} requests; "
                "pass state_indices to say which slot each request reads")
        state_indices = torch.arange(R, dtype=torch.int32, device=device)
    else:
        if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError("state_indices must be an int32 or int64 tensor")
        if tuple(state_indices.shape) != (R,):
            raise ValueError(
                f"state_indices has shape {tuple(state_indices.shape)}, expected [R={R}], one slot per request")
        if check_values and R and bool(((state_indices < 0) | (state_indices >= S)).any()):
            raise ValueError(f"state_indices must lie in [0, {S}) (the pool's slots)")
    _check_device(device, v=v, g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                  initial_state=initial_state, state_indices=state_indices,
                  cu_nodes=meta.cu_nodes, ancestor_mask=meta.ancestor_mask)

    if config is None:
        config = pick_config(BT, d_k, d_v, R * H_v)
    config.validate()
    scale = float(d_k ** -0.5 if scale is None else scale)

    qf = _rows(q, N, H_k, d_k)
    k_raw = k.reshape(N, H_k, d_k)
    kf = k_raw if k_raw.stride(-1) == 1 or d_k == 1 else k_raw.contiguous()
    vf = _rows(v, N, H_v, d_v)
    gate1, gate2 = (a, b) if raw_gates else (g, beta)
    gate1 = gate1.reshape(N, H_v)
    gate2 = gate2.reshape(N, H_v)
    if raw_gates:
        A_log_t, dt_bias_t = A_log.contiguous(), dt_bias.contiguous()
    else:
        A_log_t = dt_bias_t = gate1               # never read

    o = torch.empty(v.shape, dtype=v.dtype if out_dtype is None else out_dtype, device=device)
    u = torch.empty(N, H_v, d_v, dtype=torch.float32, device=device)
    log_decay = torch.empty(N, H_v, dtype=torch.float64, device=device)
    k_inv_norm = (torch.empty(N, H_k, dtype=torch.float32, device=device)
                  if use_qk_l2norm_in_kernel else None)

    kinv_arg = k_inv_norm if k_inv_norm is not None else log_decay       # never written then
    if N > 0 and R > 0:
        switches = kernel_switches(config, dtype=q.dtype, precision=precision,
                                   raw_gates=raw_gates, l2norm=bool(use_qk_l2norm_in_kernel),
                                   max_depth=int(meta.max_depth), interpret=_interpreting(),
                                   d_k=d_k)
        _refuse_known_miscompile(config, switches, BT, q.dtype, precision)
        value_tiles = 1 if switches["WHOLE_HEAD"] else triton.cdiv(d_v, config.BV)
        try:
            _tree_gdn_verify_kernel[(value_tiles, R, H_v)](
                qf, kf, vf, gate1, gate2, A_log_t, dt_bias_t,
                initial_state, state_indices, meta.cu_nodes, meta.ancestor_mask,
                o, u, log_decay, kinv_arg,
                N, R, int(meta.max_depth), scale,
                qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
                gate1.stride(0), gate1.stride(1), gate2.stride(0), gate2.stride(1),
                *initial_state.stride(),
                meta.ancestor_mask.stride(0),
                H_V=H_v, H_K=H_k, GROUP=H_v // H_k, D_K=d_k, D_V=d_v, BT=BT, BK=config.BK,
                BV=config.BV, RAW_GATES=raw_gates, L2NORM=bool(use_qk_l2norm_in_kernel),
                PREC=precision, **switches,
                num_warps=config.num_warps, num_stages=config.num_stages,
                **({"maxnreg": config.maxnreg} if config.maxnreg and not switches["INTERPRET"]
                   else {}))
        except PTXASError as exc:
            if not config.maxnreg:
                raise
            # e.g. Triton 3.6 at BT = 256: one wgmma's accumulator alone needs ~154 registers
            said = next((ln.strip() for ln in str(exc).splitlines() if "ptxas fatal" in ln),
                        "no reason given")
            raise ValueError(
                f"ptxas could not compile the verification kernel for {config} at "
                f"block_nodes={BT} under maxnreg={config.maxnreg}; raise maxnreg or leave it "
                f"None (ptxas: {said[:240]})") from exc
        except OutOfResources as exc:
            # raised before the launch: the outputs are new and the pool is only read
            raise ValueError(
                f"the verification kernel for {config} does not fit this GPU at "
                f"block_nodes={BT} ({exc}); use fewer num_stages, a smaller BV or BK, "
                f"split_gram=True for trees over 128 nodes, or config=None for pick_config's "
                f"choice") from exc
    return o, TreeFactors(log_decay=log_decay, k=k_raw, u=u, k_inv_norm=k_inv_norm)
