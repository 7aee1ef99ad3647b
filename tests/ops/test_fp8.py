"""FP8 block-scaled weights (bole.ops.fp8): the published quantization recipe, dequantization,
and the FP8 product against the dequantized weight in fp64 (interpreted on CPU, compiled on a
GPU)."""

import pytest
import torch

from bole.ops.fp8 import FP8_MAX, Fp8Weight, StackedWeight, fp8_linear, quantize_blockwise
from bole.ops.fp8.linear import KERNEL_ROWS, dequantize
from bole.ops.linear import linear

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def test_quantization_follows_the_published_recipe():
    """Per block: scale = amax / 448 (in the scale dtype), q = w / scale in e4m3; the block's
    largest entry maps to +-448; dequantized within e4m3's half-ulp (2^-4 relative)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g)
    w[3, 5] = 9.0                                          # one block with an outlier
    fw = quantize_blockwise(w, (16, 32), scale_dtype=torch.float32)
    assert fw.q.dtype == torch.float8_e4m3fn and fw.scale.shape == (3, 3)
    blocks = torch.zeros(3, 3)
    for i in range(3):
        for j in range(3):
            blocks[i, j] = w[16 * i:16 * i + 16, 32 * j:32 * j + 32].abs().max() / FP8_MAX
    assert torch.allclose(fw.scale, blocks)
    assert fw.q.float().abs().max() == FP8_MAX and fw.q.float()[3, 5] == FP8_MAX
    back = fw.dequantize()
    assert back.shape == w.shape
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + fw.scale.max() * 2 ** -9).all()
    zero = quantize_blockwise(torch.zeros(16, 16), (16, 16))
    assert torch.equal(zero.scale, torch.ones(1, 1)) and not zero.dequantize().any()


def test_stacked_experts_quantize_per_expert_and_bad_scales_are_named():
    w = torch.randn(3, 32, 48)
    fw = quantize_blockwise(w, (16, 16))
    assert fw.q.shape == (3, 32, 48) and fw.scale.shape == (3, 2, 3)
    for e in range(3):
        one = quantize_blockwise(w[e], (16, 16))
        assert torch.equal(fw.q[e].float(), one.q.float()) and torch.equal(fw.scale[e], one.scale)
    with pytest.raises(ValueError, match=r"has scales of shape \[3, 2, 3\]"):
        Fp8Weight(fw.q, fw.scale[:, :1], (16, 16))
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        Fp8Weight(w, fw.scale, (16, 16))


def test_rows_and_cat_keep_the_blocks():
    fw = quantize_blockwise(torch.randn(40, 32), (16, 16))
    assert torch.equal(fw.rows(16, 40).dequantize(), fw.dequantize()[16:40])
    with pytest.raises(ValueError, match="block boundary"):
        fw.rows(8, 40)
    parts = [quantize_blockwise(torch.randn(n, 32), (16, 16)) for n in (32, 16, 8)]
    whole = Fp8Weight.cat(parts)
    assert torch.equal(whole.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError, match="whole row blocks"):
        Fp8Weight.cat(parts[::-1])


@pytest.mark.parametrize("M,N,K,block", [(1, 48, 64, (16, 16)), (5, 100, 96, (32, 32)),
                                         (16, 64, 80, (16, 16)), (33, 40, 128, (16, 64)),
                                         (64, 16, 32, (128, 128)), (130, 24, 32, (16, 16))])
def test_the_fp8_kernel_equals_the_dequantized_product(M, N, K, block):
    """fp32 inputs: the kernel's product against x @ dequantize(w).T in fp64 (error bound:
    fp32 accumulation, stated as 1e-5 relative to the product's scale)."""
    g = torch.Generator().manual_seed(M * N)
    fw = quantize_blockwise(torch.randn(N, K, generator=g), block).to(DEV)
    x = torch.randn(M, K, generator=g).to(DEV)
    bias = torch.randn(N, generator=g).to(DEV)
    want = x.double() @ fw.dequantize(torch.float64).T + bias.double()
    got = fp8_linear(x, fw, bias, kernel=True)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    tol = 1e-5 * want.abs().max().item()
    assert (got.double() - want).abs().max() <= tol
    out = torch.empty(M, N, device=DEV)
    assert torch.equal(fp8_linear(x, fw, bias, kernel=True, out=out), got)
    dense = fp8_linear(x, fw, bias, kernel=False)           # the dequantize-then-linear path
    assert (dense.double() - want).abs().max() <= tol


@pytest.mark.parametrize("N,K,block", [(40, 200, (16, 64)), (33, 130, (128, 128)),
                                       (64, 128, (32, 16))])
def test_the_dequantize_kernel_gives_the_weights_own_values(N, K, block):
    """The one-pass kernel (the wide products' path) against the torch expression, bit for bit:
    the same fp32 product, rounded once (to nearest even; Triton's interpreter truncates to
    bf16, so there a bf16 value may lie one unit lower); ragged last blocks included."""
    g = torch.Generator().manual_seed(N + K)
    fw = quantize_blockwise(torch.randn(N, K, generator=g) * 3, block).to(DEV)
    assert torch.equal(dequantize(fw, torch.float32), fw.dequantize(torch.float32))
    got, want = dequantize(fw, torch.bfloat16), fw.dequantize(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    if CUDA:
        assert torch.equal(got, want)
    else:
        exact = fw.dequantize(torch.float32)
        ulp = 2.0 ** (torch.frexp(exact)[1].float() - 8)
        assert ((exact - got.float()).abs() < ulp).all() and (got.float().abs() <= exact.abs()).all()


def test_linear_dispatches_fp8_and_stacked_weights():
    g = torch.Generator().manual_seed(1)
    fw = quantize_blockwise(torch.randn(32, 48, generator=g), (16, 16))
    dense = torch.randn(8, 48, generator=g)
    x = torch.randn(3, 2, 48, generator=g)
    want = torch.cat([x @ fw.dequantize().T, x @ dense.T], -1)
    got = linear(x, StackedWeight([fw, dense]))
    assert got.shape == (3, 2, 40) and torch.allclose(got, want, atol=1e-5)
    out = torch.empty(6, 40)
    linear(x.reshape(6, 48), StackedWeight([fw, dense]), out=out)
    assert torch.allclose(out, want.reshape(6, 40), atol=1e-5)
    assert torch.allclose(linear(x, fw), x @ fw.dequantize().T, atol=1e-5)
    with pytest.raises(ValueError, match=f"at most {KERNEL_ROWS} rows"):
        fp8_linear(torch.randn(KERNEL_ROWS + 1, 48), fw, kernel=True)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("M", [1, 8, 32, 64, 200, 600])
def test_bf16_product_on_the_gpu(M):
    """bf16 activations: the kernel against the dequantized bf16 weight in fp32 (relative
    error within bf16's rounding of the output, 1e-2 of its scale)."""
    fw = quantize_blockwise(torch.randn(1024, 2048, device=DEV) * 0.02)
    x = torch.randn(M, 2048, device=DEV, dtype=torch.bfloat16)
    want = x.float() @ fw.dequantize(torch.bfloat16).float().T
    got = linear(x, fw)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("T,k", [(1, 3), (7, 2)])
def test_fp8_experts_equal_the_dequantized_expert_loop(T, k):
    """Both MoE paths (grouped GEMMs, matrix-vector kernels) with FP8 experts against the torch
    loop over the dequantized experts in fp64; a shared expert merged as expert E included."""
    from bole.ops.moe import GemvConfig, MoEConfig, fused_moe, moe_reference, route
    g = torch.Generator().manual_seed(T)
    E, H, F = 6, 64, 32
    w13 = quantize_blockwise(torch.randn(E + 1, 2 * F, H, generator=g) * H ** -0.5, (16, 16))
    w2 = quantize_blockwise(torch.randn(E + 1, H, F, generator=g) * F ** -0.5, (16, 16))
    w13, w2 = w13.to(DEV), w2.to(DEV)
    x = torch.randn(T, H, generator=g).to(DEV)
    tw, ids = route(torch.randn(T, E + 1, generator=g).to(DEV), k, shared=True)
    want = moe_reference(x.double(), w13.dequantize(torch.float64), w2.dequantize(torch.float64),
                         tw.double(), ids)
    assert torch.allclose(moe_reference(x.double(), w13, w2, tw.double(), ids), want)
    for cfg in (MoEConfig(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1),
                GemvConfig(block_n=8, block_k=64, num_warps=1, num_stages=1, down_block_n=16,
                           down_block_k=32, down_num_warps=1)):
        got = fused_moe(x, w13, w2, tw, ids, impl="triton", config=cfg)
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4), cfg
    odd = quantize_blockwise(torch.randn(E, 2 * F, H), (16, 24))      # 24 is no power of two
    with pytest.raises(ValueError, match="power of two >= 16"):
        fused_moe(x, odd, quantize_blockwise(torch.randn(E, H, F), (16, 24)), tw[:, :1],
                  ids[:, :1] % E, impl="triton")
