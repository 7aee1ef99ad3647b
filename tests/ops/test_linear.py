"""Decode-shape linear layers (bole/ops/linear.py): the kernel against an fp64 product (the CPU
interpreter here, fp32 tiny shapes; compiled in bf16 on a GPU), the dispatcher against
F.linear, and the errors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from bole.ops.linear import (KERNEL_ROWS, MAX_ROWS, WIDE_ROWS, LinearConfig, linear,
                             linear_triton, pick_linear_config)
from tests.kernel_utils import DEV, assert_rel

ON_GPU = DEV == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = 2e-2 if ON_GPU else 1e-5
CONFIGS = [LinearConfig(16, 16, 4, 2), LinearConfig(32, 32, 4, 3), LinearConfig(64, 16, 4, 1)]


def rnd(*shape, gen):
    return torch.randn(*shape, generator=gen).to(DTYPE).to(DEV)


@given(M=st.integers(1, KERNEL_ROWS), N=st.integers(1, 70), K=st.integers(1, 80),
       cfg=st.sampled_from(CONFIGS), bias=st.booleans(), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_kernels_equal_fp64_product(M, N, K, cfg, bias, seed):
    """Every tile, at shapes that leave partial tiles in N and K and padding rows (rows past
    the dispatcher's MAX_ROWS too: bench/linear.py times them)."""
    gen = torch.Generator().manual_seed(seed)
    x, w = rnd(M, K, gen=gen), rnd(N, K, gen=gen)
    b = rnd(N, gen=gen) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert_rel(linear_triton(x, w, b, config=cfg), want, TOL * max(1.0, K ** 0.5))


def test_strided_rows_of_x():
    """x may be a row-strided view (a slice of a wider buffer), as the model's splits are."""
    gen = torch.Generator().manual_seed(1)
    wide, w = rnd(3, 100, gen=gen), rnd(40, 48, gen=gen)
    x = wide[:, 10:58]
    assert not x.is_contiguous()
    for cfg in CONFIGS:
        assert_rel(linear_triton(x, w, config=cfg), x.double() @ w.double().T, TOL * 7)


@pytest.mark.skipif(not ON_GPU, reason="the dispatcher takes the kernel on CUDA only")
def test_dispatcher_takes_the_kernel_at_decode_shapes():
    """On CUDA in bf16: a 3-D x of few rows and a bias go through the kernel (and agree with
    cuBLAS to rounding); more rows, a strided bias or fp32 go to F.linear itself."""
    import bole.ops.linear as lin
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 1024, generator=gen).to(DTYPE).to(DEV)
    w = (torch.randn(4096, 1024, generator=gen) * 0.03).to(DTYPE).to(DEV)
    b = torch.randn(4096, generator=gen).to(DTYPE).to(DEV)
    calls = []
    real = lin.linear_triton
    try:
        lin.linear_triton = lambda *a, **k: calls.append(1) or real(*a, **k)
        y = lin.linear(x, w, b)
        assert calls and y.shape == (2, 3, 4096)
        assert_rel(y, F.linear(x.float(), w.float(), b.float()), 2e-2)
        calls.clear()
        wide = torch.zeros(2 * 4096, dtype=DTYPE, device=DEV)[::2]
        assert torch.equal(lin.linear(x, w, wide), F.linear(x, w, wide)) and not calls
        many = torch.randn(WIDE_ROWS + 1, 1024, generator=gen).to(DTYPE).to(DEV)
        assert torch.equal(lin.linear(many, w), F.linear(many, w)) and not calls
        wide_w = torch.randn(8192, 1024, generator=gen).to(DTYPE).to(DEV)
        assert torch.equal(lin.linear(many[:MAX_ROWS + 1], wide_w),
                           F.linear(many[:MAX_ROWS + 1], wide_w)) and not calls
        y = lin.linear(many[:WIDE_ROWS], w)       # a narrow output past MAX_ROWS: the kernel
        assert calls and y.shape == (WIDE_ROWS, 4096)
        assert_rel(y, F.linear(many[:WIDE_ROWS].float(), w.float()), 2e-2)
        calls.clear()
        assert torch.equal(lin.linear(x.float(), w.float()), F.linear(x.float(), w.float()))
        assert not calls
    finally:
        lin.linear_triton = real


def test_dispatcher_is_f_linear_off_its_shapes():
    """On the CPU, in fp32, with many rows: F.linear itself, bit for bit (the interpreter's
    kernel would round differently)."""
    gen = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(2, 5, 64, generator=gen), torch.randn(300, 64, generator=gen), \
        torch.randn(300, generator=gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x[0, 0], w), F.linear(x[0, 0], w))


def test_picked_launches():
    """Decode shapes take the kernel; many rows, unaligned K and narrow weights take cuBLAS."""
    assert pick_linear_config(1, 12352, 4096) == LinearConfig(32, 256, 4, 3)   # H200 sweep
    assert pick_linear_config(1, 4096, 12288) == LinearConfig(32, 256, 4, 5)
    assert pick_linear_config(1, 248320, 4096) == LinearConfig(64, 128, 4, 3)
    assert pick_linear_config(MAX_ROWS, 4096, 4096) is not None
    assert pick_linear_config(MAX_ROWS + 1, 4096, 4096) == LinearConfig(32, 256, 4, 4)
    assert pick_linear_config(WIDE_ROWS, 248320, 4096) == LinearConfig(64, 128, 4, 4)
    assert pick_linear_config(MAX_ROWS + 1, 10240, 4096) is None     # the attention qkv
    assert pick_linear_config(MAX_ROWS + 1, 24576, 4096) is None     # the MLP's gate and up
    assert pick_linear_config(WIDE_ROWS + 1, 4096, 4096) is None
    assert pick_linear_config(1, 4096, 4100) is None
    assert pick_linear_config(1, 64, 4096) is None
    assert pick_linear_config(1, 768, 256) is None           # the bundled model's: cuBLAS


def test_errors_say_what_is_wrong():
    x, w = torch.zeros(2, 8, dtype=DTYPE, device=DEV), torch.zeros(4, 8, dtype=DTYPE, device=DEV)
    with pytest.raises(ValueError, match="x \\[M, K\\] and w \\[N, K\\]"):
        linear_triton(x, torch.zeros(4, 9, dtype=DTYPE, device=DEV))
    with pytest.raises(ValueError, match="share a dtype"):
        linear_triton(x, w.double())
    with pytest.raises(ValueError, match="share a dtype"):
        linear_triton(x, w, torch.zeros(5, dtype=DTYPE, device=DEV))
    with pytest.raises(ValueError, match="share a dtype"):
        linear_triton(x, w, torch.zeros(4, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="unit stride"):
        linear_triton(x, w, torch.zeros(8, dtype=DTYPE, device=DEV)[::2])
    with pytest.raises(ValueError, match="unit stride"):
        linear_triton(x, torch.zeros(8, 4, dtype=DTYPE, device=DEV).T)
    with pytest.raises(ValueError, match=f"at most {KERNEL_ROWS} rows"):
        linear_triton(torch.zeros(KERNEL_ROWS + 1, 8, dtype=DTYPE, device=DEV), w)


def test_out_receives_the_product_in_place():
    """``linear(out=...)`` writes one layer's slice of a stacked buffer, equal to F.linear."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    store = torch.full((3, 6, 48), 9.0)
    for b in (None, bias):
        got = linear(x, w, b, out=store[1])
        assert got.data_ptr() == store[1].data_ptr()
        torch.testing.assert_close(store[1], F.linear(x, w, b))
        assert bool((store[0] == 9.0).all()) and bool((store[2] == 9.0).all())
    # the kernel into a slice: the same values as its own output (tf32 dots on a GPU in fp32)
    tri = torch.full((2, 6, 48), 9.0, device=DEV)
    linear_triton(x.to(DEV), w.to(DEV), out=tri[1])
    assert torch.equal(tri[1], linear_triton(x.to(DEV), w.to(DEV)))
    assert bool((tri[0] == 9.0).all())
    with pytest.raises(ValueError, match="out must be"):
        linear(x, w, out=torch.empty(6, 47))
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        linear(x[None], w, out=store[0])


@pytest.mark.skipif(DEV != "cuda", reason="the dispatcher takes the kernel on CUDA only")
@pytest.mark.parametrize("rows", [8, 40])            # the kernel; cuBLAS past WIDE_ROWS
def test_out_with_a_row_stride_of_a_wider_buffer_cuda(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1024, device="cuda", generator=gen).bfloat16()
    w = torch.randn(4096, 1024, device="cuda", generator=gen).bfloat16()
    big = torch.zeros(rows, 5000, device="cuda", dtype=torch.bfloat16)
    out = big[:, 100:100 + 4096]                      # row stride 5000
    linear(x, w, out=out)
    if rows <= WIDE_ROWS:                             # the same kernel: the same bits
        assert torch.equal(out, linear(x, w))
    else:                                             # cuBLAS may tile another leading dim
        torch.testing.assert_close(out.float(), linear(x, w).float(), rtol=2e-2, atol=0.5)
    assert bool((big[:, :100] == 0).all()) and bool((big[:, 100 + 4096:] == 0).all())
