"""Helpers shared by the Triton kernel tests (tests/conftest.py sets TRITON_INTERPRET on CPU)."""

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5


def assert_rel(actual, expected, tol=TOL):
    """Max abs error within ``tol`` relative to the reference's magnitude (at least 1)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(a).all()
    err = float((a - e).abs().max()) if a.numel() else 0.0
    scale = max(1.0, float(e.abs().max()) if e.numel() else 0.0)
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"
