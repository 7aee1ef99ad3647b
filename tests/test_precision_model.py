"""bench/tuning/precision_model.py: the emulation of the verification kernel's product roundings.

Checks the claims bench/NOTES.md makes from it on a small shape: the emulation with exact products
is the fp64 closed form, tf32's truncation in ``C U`` dominates O's error, and the split bf16
products the kernel now uses remove it.
"""

from bench.tuning import precision_model as pm


def test_tf32_rounding_helpers():
    import torch
    x = torch.tensor([1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(1.0 + 2.0 ** -12), 3.0], dtype=torch.float64)
    assert pm.tf32(x, "rz").tolist() == [1.0, 1.0 + 2.0 ** -10, -1.0, 3.0]
    # to nearest, ties to even: 1 + 2^-11 is a tie between 1 and 1 + 2^-10 (odd): goes to 1
    assert pm.tf32(x, "rn").tolist() == [1.0, 1.0 + 2.0 ** -9, -1.0, 3.0]
    s = torch.randn(1000, dtype=torch.float64)
    assert float(((pm.bf16_split(s) - s.float().double()).abs() / s.abs()).max()) <= 2.0 ** -17


def test_error_budget_of_the_kernel():
    err = pm.errors(batch=1, nodes=16)
    assert err["exact products"] < 1e-7
    cu, state, sweeps = err["C U rz"], err["state products rz"], err["sweeps G U rz"]
    assert cu > 5 * state and cu > 5 * sweeps                 # C U in tf32 set O's error
    assert err["C U 3xbf16"] < 0.05 * cu and err["state products bf16x2"] < 0.05 * state
    fifth = err["bf16x2 state, tf32 (rz) sweeps, 3xbf16 C U: the fifth session's kernel"]
    assert fifth < 0.1 * err["all tf32 (rz), the kernel before the fifth session"]
    # fp16 sweeps round to nearest where tf32 truncates: no worse than the tf32 sweeps
    assert err["sweeps G U fp16"] < err["sweeps G U rz"]
    assert err["bf16x2 state, fp16 sweeps, 3xbf16 C U (fp16_sweeps)"] <= fifth


def test_fp16_sweeps_scaled_by_r_keep_their_accuracy_on_an_adversarial_chain():
    """On the 17-node chain with nearly parallel keys the iterates grow ~3000x over max |R|; with
    R's power-of-two scaling (as the kernel) fp16 stays normal and loses no more than tf32."""
    err = pm.two_step_solve_errors()
    assert err["sweeps fp16"] <= err["sweeps rz"]


def test_two_step_solve_amplifies_rounding():
    """The rejected two-step Neumann solve: exact in fp64, thousands of times the sweeps' error
    once its operands are rounded (bench/NOTES.md item 20)."""
    err = pm.two_step_solve_errors()
    assert err["two-step exact"] < 1e-9 and err["sweeps exact"] < 1e-12
    assert err["two-step fp32"] > 100 * err["sweeps fp32"]
    assert err["two-step rz"] > 100 * err["sweeps rz"]
