"""Fused ops (bole/ops/fused.py): torch references bit for bit against the hybrid layers' unfused
torch code, Triton kernels against the references (under the interpreter on CPU, tiny shapes)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from bole.ops import fused, rope
from bole.ops.conv import tree_conv1d, tree_conv_windows
from tests.kernel_utils import DEV, assert_rel
from tests.strategies import forests

ON_GPU = DEV == "cuda"
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6


def rnd(*shape, dtype=torch.float32, seed=0, scale=1.0, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view whose rows are strided (padding after each row's last dim)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    wide[..., 1:t.shape[-1] + 1] = t
    view = wide[..., 1:t.shape[-1] + 1]
    assert view.stride(-1) == 1 and not view.is_contiguous()
    return view


def inv_freq(rd: int, theta: float = 10000.0, device=DEV) -> torch.Tensor:
    """As HybridModel.__init__ builds it."""
    return (1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))).to(device)


# ---- oracles: the hybrid layers' unfused torch code, op for op ----

def unfused_rms_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def unfused_gated_rms_norm(x, z, w, eps):
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = w * h.to(dt)
    return (h * F.silu(z.float())).to(dt)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def unfused_rope(x, positions, inv, rd):
    freqs = positions.to(x.device, torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def check_kernel(actual, expected):
    assert actual.dtype == expected.dtype and actual.is_contiguous()
    assert_rel(actual, expected, TOL[expected.dtype])


# ---- references are the unfused code, bit for bit (CPU, bf16 included) ----

@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("w_dtype", ["fp32", "same"])
def test_norm_references_equal_unfused_code(dtype, w_dtype):
    wd = torch.float32 if w_dtype == "fp32" else dtype
    x, r = rnd(5, 37, dtype=dtype, device="cpu"), rnd(5, 37, dtype=dtype, seed=1, device="cpu")
    w = rnd(37, dtype=wd, seed=2, scale=0.2, device="cpu")
    out, s = fused.add_rms_norm(x, w, EPS, r, impl="torch")
    assert torch.equal(s, x + r) and torch.equal(out, unfused_rms_norm(x + r, w, EPS))
    xs = strided(x)                 # the same view to both (torch's CPU kernels take other paths
    out, s = fused.add_rms_norm(xs, w, EPS, impl="auto")    # for strided inputs); auto = reference
    assert torch.equal(out, unfused_rms_norm(xs, w, EPS)) and s is xs
    xg, z = rnd(3, 4, 13, dtype=dtype, seed=3, device="cpu"), rnd(3, 4, 13, dtype=dtype, seed=4,
                                                                   device="cpu")
    wg = (1 + rnd(13, dtype=torch.float32, seed=5, scale=0.3, device="cpu")).to(wd)
    for zz in (z, strided(z)):
        got = fused.gated_rms_norm(xg, zz, wg, EPS, impl="auto")
        assert torch.equal(got, unfused_gated_rms_norm(xg, zz, wg, EPS))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_silu_mul_and_qk_references_equal_unfused_code(dtype):
    gate, up = rnd(4, 21, dtype=dtype, device="cpu"), rnd(4, 21, dtype=dtype, seed=1, device="cpu")
    gu = torch.cat([gate, up], dim=1)
    for g in (gu, strided(gu)):
        assert torch.equal(fused.silu_mul(g, impl="torch"), F.silu(gate) * up)
    for hd, rd in ((16, 8), (12, 12)):
        q_gate = rnd(3, 4, 2 * hd, dtype=dtype, seed=hd, device="cpu")
        q = q_gate.chunk(2, dim=-1)[0]                # the strided view attention_qkv normalises
        w = rnd(hd, dtype=dtype, seed=2, scale=0.2, device="cpu")
        pos, inv = torch.tensor([0, 5, 3001]), inv_freq(rd, device="cpu")
        got = rope.qk_norm_rope(q, w, pos, inv, rd, EPS, impl="auto")
        expect = unfused_rope(unfused_rms_norm(q, w, EPS), pos, inv, rd)
        assert got.is_contiguous() and torch.equal(got, expect)


# ---- kernels against the references ----

@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("H", [1, 37, 64])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm_kernel(dtype, H, residual):
    x, r = strided(rnd(5, H, dtype=dtype)), rnd(5, H, dtype=dtype, seed=1, scale=3.0)
    w = rnd(H, seed=2, scale=0.2)
    res = r if residual else None
    out, s = fused.add_rms_norm(x, w, EPS, res, impl="triton")
    ref, ref_s = fused.add_rms_norm(x, w, EPS, res, impl="torch")
    check_kernel(out, ref)
    assert torch.equal(s, ref_s) and (residual or s is x)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("H", [1, 37, 64])
def test_embed_norm_pair_kernel(dtype, H):
    """The MTP head's fc input: the gathered embedding rows and the hidden rows, each normed with
    its own weight, side by side; the reference is two add_rms_norm calls on the gathered rows."""
    table, prev = rnd(11, H, dtype=dtype), strided(rnd(6, H, dtype=dtype, seed=1, scale=3.0))
    we, wh = rnd(H, seed=2, scale=0.2), rnd(H, seed=3, scale=0.2)
    tokens = torch.tensor([10, 0, 3, 3, 7, 1], device=DEV)
    got = fused.embed_norm_pair(tokens, table, prev, we, wh, EPS, impl="triton")
    ref = fused.embed_norm_pair(tokens, table, prev, we, wh, EPS, impl="torch")
    unfused = torch.cat([fused.add_rms_norm(table[tokens], we, EPS, impl="torch")[0],
                         fused.add_rms_norm(prev, wh, EPS, impl="torch")[0]], 1)
    assert torch.equal(ref, unfused)
    check_kernel(got, ref)
    with pytest.raises(TypeError, match="prev"):
        fused.embed_norm_pair(tokens, table, prev.double(), we, wh, EPS)
    with pytest.raises(ValueError, match="prev has shape"):
        fused.embed_norm_pair(tokens[:3], table, prev, we, wh, EPS)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_add_rms_norm_into_half_of_a_wider_buffer(impl):
    """``out=``: the normed rows land in a strided view (the MTP head's fc input) and nowhere
    else; the same values as a fresh output."""
    x, w = rnd(4, 24), rnd(24, seed=2, scale=0.2)
    wide = torch.full((4, 48), 7.0, device=DEV)
    got, _ = fused.add_rms_norm(x, w, EPS, out=wide[:, 24:], impl=impl)
    want, _ = fused.add_rms_norm(x, w, EPS, impl=impl)
    assert torch.equal(wide[:, 24:], want) and torch.equal(got, want)
    assert (wide[:, :24] == 7.0).all()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_add_rms_norm_kernel_streams_long_rows(dtype, monkeypatch):
    monkeypatch.setattr(fused, "_MAX_ROW_BLOCK", 16)      # rows of 37 take the two-pass loop
    monkeypatch.setattr(fused, "_LOOP_BLOCK", 16)
    x, r, w = rnd(3, 37, dtype=dtype), rnd(3, 37, dtype=dtype, seed=1), rnd(37, seed=2, scale=0.2)
    out, s = fused.add_rms_norm(x, w.to(dtype), EPS, r, impl="triton")
    ref, ref_s = fused.add_rms_norm(x, w.to(dtype), EPS, r, impl="torch")
    check_kernel(out, ref)
    assert torch.equal(s, ref_s)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("w_dtype", ["fp32", "same"])
@pytest.mark.parametrize("D, tile", [(13, 2048), (24, 64), (64, 64)])
def test_gated_rms_norm_kernel(dtype, w_dtype, D, tile, monkeypatch):
    monkeypatch.setattr(fused, "_TILE", tile)             # several programs, a part-empty last one
    wd = torch.float32 if w_dtype == "fp32" else dtype
    x, z = rnd(2, 3, D, dtype=dtype), strided(rnd(2, 3, D, dtype=dtype, seed=1, scale=2.0))
    w = (1 + rnd(D, seed=2, scale=0.3)).to(wd)
    check_kernel(fused.gated_rms_norm(x, z, w, EPS, impl="triton"),
                 fused.gated_rms_norm(x, z, w, EPS, impl="torch"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("I, block", [(21, 1024), (40, 16), (1, 1024)])
def test_silu_mul_kernel(dtype, I, block, monkeypatch):
    monkeypatch.setattr(fused, "_SILU_BLOCK", block)
    gu = strided(rnd(4, 2 * I, dtype=dtype, scale=3.0))
    check_kernel(fused.silu_mul(gu, impl="triton"), fused.silu_mul(gu, impl="torch"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("heads, hd, rd, tile", [(3, 13, 6, 2048), (4, 16, 16, 32), (2, 64, 16, 64)])
def test_qk_norm_rope_kernel(dtype, heads, hd, rd, tile, monkeypatch):
    monkeypatch.setattr(fused, "_TILE", tile)
    q = rnd(4, heads, 2 * hd, dtype=dtype, scale=2.0)[..., :hd]      # strided, like q of q_gate
    w = rnd(hd, seed=1, scale=0.2).to(dtype)
    pos = torch.tensor([0, 1, 77, 4095], device=DEV)
    inv = inv_freq(rd)
    check_kernel(rope.qk_norm_rope(q, w, pos, inv, rd, EPS, impl="triton"),
                 rope.qk_norm_rope(q, w, pos, inv, rd, EPS, impl="torch"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("hq, hkv, hd, rd, tile", [(4, 2, 16, 16, 32), (6, 1, 13, 6, 2048),
                                                   (8, 2, 64, 16, 64)])
def test_qk_norm_rope_pair_equals_two_calls(dtype, hq, hkv, hd, rd, tile, monkeypatch):
    """q and k in one launch: the single launches' values (the same kernel body; a launch
    of another warp count may sum squares in another order) and the torch reference's."""
    monkeypatch.setattr(fused, "_TILE", tile)
    qkv = rnd(5, 2 * hq * hd + 2 * hkv * hd, dtype=dtype, scale=2.0)
    q = qkv[:, :2 * hq * hd].view(5, hq, 2 * hd)[..., :hd]           # q of q_gate: strided
    k = qkv[:, 2 * hq * hd:2 * hq * hd + hkv * hd].view(5, hkv, hd)
    wq, wk = rnd(hd, seed=1, scale=0.2).to(dtype), rnd(hd, seed=2, scale=0.2).to(dtype)
    pos = torch.tensor([0, 1, 77, 4095, 9], device=DEV)
    inv = inv_freq(rd)
    qo, ko = rope.qk_norm_rope_pair(q, k, wq, wk, pos, inv, rd, EPS, impl="triton")
    for out, x, w in ((qo, q, wq), (ko, k, wk)):
        check_kernel(out, rope.qk_norm_rope(x, w, pos, inv, rd, EPS, impl="triton"))
        check_kernel(out, rope.qk_norm_rope(x, w, pos, inv, rd, EPS, impl="torch"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("given_rows", [False, True])
def test_qk_norm_rope_to_pool_equals_the_pair_and_index_put(dtype, given_rows):
    """k (normed, rotated) and v land in the pool rows the torch path's index_put writes, and
    nowhere else; q equals the pair's q. Rows are the scratch rows ctx + j, or given per token."""
    R, T, hq, hkv, hd, rd, S, M = 3, 4, 4, 2, 16, 8, 5, 20
    N = R * T
    qkv = rnd(N, 2 * hq * hd + 2 * hkv * hd, dtype=dtype, scale=2.0)
    q = qkv[:, :2 * hq * hd].view(N, hq, 2 * hd)[..., :hd]
    k = qkv[:, 2 * hq * hd:2 * hq * hd + hkv * hd].view(N, hkv, hd)
    v = qkv[:, 2 * hq * hd + hkv * hd:].view(N, hkv, hd)
    wq, wk = rnd(hd, seed=1, scale=0.2).to(dtype), rnd(hd, seed=2, scale=0.2).to(dtype)
    pos = torch.arange(N, device=DEV) * 7
    inv = inv_freq(rd)
    slots = torch.tensor([4, 0, 2], device=DEV, dtype=torch.int32)
    ctx = torch.tensor([0, 9, 16], device=DEV)
    rows = (torch.randperm(M - 1)[:N] + 1).to(DEV) if given_rows else None
    kw = dict(rows=rows) if given_rows else dict(ctx_lens=ctx)
    pools = {}
    for impl in ("triton", "torch"):
        kp = torch.zeros(S, M, hkv, hd, dtype=dtype, device=DEV)
        vp = torch.zeros_like(kp)
        qo = rope.qk_norm_rope_to_pool(q, k, v, wq, wk, pos, inv, rd, EPS, kp, vp, slots, **kw,
                                        impl=impl)
        pools[impl] = (qo, kp, vp)
    (qt, kt, vt), (qr, kr, vr) = pools["triton"], pools["torch"]
    assert torch.equal(qt, rope.qk_norm_rope_pair(q, k, wq, wk, pos, inv, rd, EPS,
                                                   impl="triton")[0])
    check_kernel(qt, qr)
    check_kernel(kt, kr)
    assert torch.equal(vt, vr) and int((vt != 0).any(-1).any(-1).sum()) == N


def test_kernels_accept_empty_batches():
    x = torch.empty(0, 8, device=DEV)
    out, s = fused.add_rms_norm(x, torch.zeros(8, device=DEV), EPS, x, impl="triton")
    assert out.shape == s.shape == (0, 8)
    assert fused.silu_mul(x, impl="triton").shape == (0, 4)
    assert fused.gated_rms_norm(x.view(0, 2, 4), x.view(0, 2, 4), torch.ones(4, device=DEV), EPS,
                                impl="triton").shape == (0, 2, 4)


# ---- tree conv: windows of the dense layout, the pool-reading conv ----

def dense_layout(forest):
    """(parents [R, T], depth [R, T], dense index of each valid packed node) of a packed forest."""
    R, sizes = forest.num_requests, forest.sizes()
    T = int(sizes.max())
    parents = torch.full((R, T), -1, dtype=torch.int64)
    depth = torch.zeros((R, T), dtype=torch.int64)
    dense_of = torch.empty(forest.num_valid_nodes, dtype=torch.int64)
    for r in range(R):
        lo, n = int(forest.cu_nodes[r]), int(sizes[r])
        parents[r, :n], depth[r, :n] = forest.parents[lo:lo + n], forest.depth[lo:lo + n]
        dense_of[lo:lo + n] = r * T + torch.arange(n)
    return parents, depth, dense_of


def packed_windows_as_codes(forest, K, dense_of):
    """tree_conv_windows of the valid nodes in tree_conv1d_pool's coding, dense node indices."""
    ref = tree_conv_windows(forest, K)[:forest.num_valid_nodes]
    base = forest.num_requests * (K - 1)
    return torch.where(ref >= base, dense_of[(ref - base).clamp(min=0)], -ref - 1)


@given(forest=forests(max_requests=3, max_nodes=24), K=st.sampled_from([2, 3, 4]))
@settings(max_examples=40)
def test_conv_windows_from_parents_match_tree_conv_windows(forest, K):
    parents, depth, dense_of = dense_layout(forest)
    windows = fused.conv_windows_from_parents(parents, depth, K)
    assert windows.shape == (parents.numel(), K) and windows.dtype == torch.int32
    assert torch.equal(windows[dense_of].long(), packed_windows_as_codes(forest, K, dense_of))


@given(forest=forests(max_requests=3, max_nodes=24), K=st.sampled_from([2, 4]),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25)
def test_tree_conv1d_pool_reference_equals_tree_conv1d(forest, K, seed):
    gen = torch.Generator().manual_seed(seed)
    R, C = forest.num_requests, 5
    x = torch.randn(forest.num_nodes, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64)
    pool = torch.randn(R + 2, C, K - 1, generator=gen, dtype=torch.float64)
    slots = torch.randperm(R + 2, generator=gen)[:R]
    expect = tree_conv1d(x[None], w, pool[slots], forest)[0]
    # packed layout, pool = the gathered state: the same gather and einsum, bit for bit
    base = R * (K - 1)
    ref = tree_conv_windows(forest, K)
    codes = torch.where(ref >= base, ref - base, -ref - 1)
    got = fused.tree_conv1d_pool(x, w, pool[slots], torch.arange(R), codes, impl="torch")
    valid = forest.valid
    assert torch.equal(got[valid], expect[valid])
    # dense layout read through the slots
    parents, depth, dense_of = dense_layout(forest)
    xd = torch.randn(parents.numel(), C, generator=gen, dtype=torch.float64)
    xd[dense_of] = x[:forest.num_valid_nodes]
    windows = fused.conv_windows_from_parents(parents, depth, K)
    got = fused.tree_conv1d_pool(xd, w, pool, slots, windows, impl="torch")
    assert torch.allclose(got[dense_of], expect[valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("K, C, block", [(4, 13, 512), (4, 24, 8), (2, 7, 512)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_tree_conv1d_pool_kernel(dtype, K, C, block, index_dtype, monkeypatch):
    monkeypatch.setattr(fused, "_CONV_BLOCK", block)
    parents = torch.tensor([[-1, 0, 1, 1], [-1, 0, -1, -1]], device=DEV)   # a tree, a chain + pad
    depth = torch.tensor([[0, 1, 2, 2], [0, 1, 0, 0]], device=DEV)
    windows = fused.conv_windows_from_parents(parents, depth, K).to(index_dtype)
    x = strided(rnd(8, C, dtype=dtype))
    w = rnd(C, K, seed=1, scale=0.5)
    pool = rnd(5, C, K - 1, dtype=dtype, seed=2)
    slots = torch.tensor([3, 1], device=DEV, dtype=torch.int32)
    check_kernel(fused.tree_conv1d_pool(x, w, pool, slots, windows, impl="triton"),
                 fused.tree_conv1d_pool(x, w, pool, slots, windows, impl="torch"))


@given(forest=forests(max_requests=2, max_nodes=4, pad=False), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=6)
def test_tree_conv1d_pool_kernel_equals_tree_conv1d(forest, seed):
    parents, depth, dense_of = dense_layout(forest)
    R, K, C = forest.num_requests, 4, 6
    x, w = rnd(parents.numel(), C, seed=seed), rnd(C, K, seed=seed + 1)
    pool, slots = rnd(3, C, K - 1, seed=seed + 2), torch.tensor([2, 0][:R], device=DEV)
    windows = fused.conv_windows_from_parents(parents.to(DEV), depth.to(DEV), K)
    got = fused.tree_conv1d_pool(x, w, pool, slots, windows, impl="triton")
    expect = tree_conv1d(x[dense_of.to(DEV)][None], w, pool[slots], forest)[0]
    assert_rel(got[dense_of.to(DEV)], expect, TOL[torch.float32])


# ---- bad input ----

def _cases():
    x, w = torch.randn(3, 8), torch.randn(8)
    g3, z3 = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    q, pos, inv = torch.randn(2, 3, 8), torch.tensor([0, 1]), inv_freq(4, device="cpu")
    cx, cw, pool = torch.randn(4, 5), torch.randn(5, 4), torch.randn(3, 5, 3)
    slots, win = torch.tensor([0]), torch.zeros(4, 4, dtype=torch.int64)
    par, dep = torch.tensor([[-1, 0]]), torch.tensor([[0, 1]])
    return [
        (lambda: fused.add_rms_norm(x[0], w, EPS), ValueError, "x has shape"),
        (lambda: fused.add_rms_norm(x, w[:5], EPS), ValueError, "weight has shape"),
        (lambda: fused.add_rms_norm(x, w, EPS, x.half()), TypeError, "share a dtype"),
        (lambda: fused.add_rms_norm(x, w, EPS, x[:2]), ValueError, "residual has shape"),
        (lambda: fused.add_rms_norm(x.long(), w, EPS), TypeError, "floating point"),
        (lambda: fused.add_rms_norm(torch.randn(8, 3).t(), w, EPS), ValueError, "contiguous"),
        (lambda: fused.add_rms_norm(x, w, EPS, impl="cuda"), ValueError, "impl must be"),
        (lambda: fused.add_rms_norm(x, w, EPS, "res"), TypeError, "torch.Tensor"),
        (lambda: fused.add_rms_norm(x.double().to(DEV), w.to(DEV), EPS, impl="triton"), TypeError,
         "fp16/bf16"),
        (lambda: fused.gated_rms_norm(g3, z3[:, :2], w, EPS), ValueError, "z has shape"),
        (lambda: fused.gated_rms_norm(g3, z3, w[:4], EPS), ValueError, "weight has shape"),
        (lambda: fused.silu_mul(torch.randn(2, 7)), ValueError, "even"),
        (lambda: rope.qk_norm_rope(q, w, pos, inv, 5, EPS), ValueError, "rotary_dim"),
        (lambda: rope.qk_norm_rope(q, w, pos, inv, 10, EPS), ValueError, "rotary_dim"),
        (lambda: rope.qk_norm_rope(q, w, pos.float(), inv, 4, EPS), TypeError, "integer"),
        (lambda: rope.qk_norm_rope(q, w, pos[:1], inv, 4, EPS), ValueError, "positions has"),
        (lambda: rope.qk_norm_rope(q, w, pos, inv.double(), 4, EPS), TypeError, "fp32"),
        (lambda: rope.qk_norm_rope(q, w, pos, inv[:1], 4, EPS), ValueError, "inv_freq has"),
        (lambda: fused.tree_conv1d_pool(cx, cw[:, :1], pool[..., :0], slots, win[:, :1]),
         ValueError, "K = weight"),
        (lambda: fused.tree_conv1d_pool(cx, cw[:4], pool, slots, win), ValueError, "weight has"),
        (lambda: fused.tree_conv1d_pool(cx, cw, pool[:, :4], slots, win), ValueError, "conv_pool"),
        (lambda: fused.tree_conv1d_pool(cx, cw, pool.half(), slots, win), TypeError, "share"),
        (lambda: fused.tree_conv1d_pool(cx, cw, pool, slots.float(), win), TypeError, "slots"),
        (lambda: fused.tree_conv1d_pool(cx, cw, pool, slots, win.float()), TypeError, "windows"),
        (lambda: fused.tree_conv1d_pool(cx, cw, pool, slots, win.short()), TypeError, "int32"),
        (lambda: fused.tree_conv1d_pool(cx, cw, pool, slots, win[:3]), ValueError, "windows has"),
        (lambda: fused.conv_windows_from_parents(par, dep[:, :1], 4), ValueError, "depth has"),
        (lambda: fused.conv_windows_from_parents(par.float(), dep, 4), TypeError, "parents"),
        (lambda: fused.conv_windows_from_parents(par, dep, 1), ValueError, "K must"),
    ]


@pytest.mark.parametrize("case", range(len(_cases())))
def test_bad_inputs_raise(case):
    call, exc, match = _cases()[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(ON_GPU, reason="CPU tensors without the interpreter")
def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        fused.silu_mul(torch.randn(2, 4), impl="triton")
