"""The fused MoE kernels (bole.ops.moe) against the torch loop over experts.

Interpreted on CPU (tiny fp32 shapes), compiled on a GPU (the same tests, plus bf16, no host
sync and CUDA-graph capture). Routings: ragged random, every token on one expert, every expert
empty but one, top-k ties, a lone decode token; sizes that are not multiples of the tiles.
"""

import pytest
import torch

from bole.ops.moe import (GEMV_MAX_PAIRS, GemvConfig, MoEConfig, align_blocks, fused_moe,
                          max_blocks, moe_gemv, moe_reference, pick_moe_config, route)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def weights(E, H, F, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * F, H, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, F, generator=gen) * F ** -0.5
    return w13.to(DEV, dtype), w2.to(DEV, dtype)


def routing(kind, T, E, k, seed=0):
    """(topk_weights [T, k] fp32, topk_ids [T, k] int32) of one routing kind."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen)
    if kind == "one_expert_everywhere":      # every token's first choice is expert 1
        logits[:, 1] += 20
    elif kind == "all_but_one_empty":        # k = 1: every pair on expert E - 1
        logits[:, E - 1] += 20
    elif kind == "ties":                     # equal logits: the top-k breaks ties
        logits = torch.zeros(T, E)
    w, ids = route(logits.to(DEV), k)
    return w, ids


CASES = [  # (routing, T, E, k, H, F)
    ("ragged", 7, 6, 2, 32, 24),
    ("ragged", 1, 8, 3, 40, 16),             # a lone decode token, H not a tile multiple
    ("one_expert_everywhere", 9, 4, 2, 32, 16),
    ("all_but_one_empty", 11, 5, 1, 16, 32),
    ("ties", 6, 4, 2, 32, 16),
    ("ragged", 20, 3, 3, 48, 40),            # more pairs per expert than a block holds
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}" for c in CASES])
def test_fused_moe_equals_the_expert_loop(case):
    kind, T, E, k, H, F = case
    w13, w2 = weights(E, H, F)
    tw, ids = routing(kind, T, E, k)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(DEV)
    want = moe_reference(x.double(), w13.double(), w2.double(), tw.double(), ids)
    got = fused_moe(x, w13, w2, tw, ids, impl="triton")
    assert got.dtype == x.dtype and got.shape == (T, H)
    err = (got.double() - want).abs().max()
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4), err
    if kind == "ties":
        assert torch.allclose(tw, torch.full_like(tw, 1 / k))
    if kind == "all_but_one_empty":
        assert (ids == E - 1).all()


GEMV_TILES = [GemvConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, down_block_n=16,
                         down_block_k=16, down_num_warps=1),
              GemvConfig(block_n=8, block_k=32, num_warps=1, num_stages=1, down_block_n=32,
                         down_block_k=8, down_num_warps=1)]


@pytest.mark.parametrize("tiles", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}" for c in CASES])
def test_matrix_vector_kernels_equal_the_expert_loop(case, tiles):
    """moe_gemv (the few-token path) on every routing kind, sizes off the tiles."""
    kind, T, E, k, H, F = case
    w13, w2 = weights(E, H, F)
    tw, ids = routing(kind, T, E, k)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(DEV)
    want = moe_reference(x.double(), w13.double(), w2.double(), tw.double(), ids)
    got = fused_moe(x, w13, w2, tw, ids, impl="triton", config=GEMV_TILES[tiles])
    assert got.dtype == x.dtype and got.shape == (T, H)
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4), (got.double() - want).abs().max()
    assert torch.equal(got, moe_gemv(x, w13, w2, tw, ids, GEMV_TILES[tiles]))


@pytest.mark.parametrize("T", [1, 3])
def test_the_shared_expert_as_expert_E_equals_the_gated_shared_mlp(T):
    """Routing with ``shared=True`` over E + 1 stacked experts gives the routed experts' sum
    plus sigmoid(gate) times the shared MLP, computed apart (both kernels, the loop)."""
    E, k, H, F = 6, 2, 32, 16
    w13, w2 = weights(E + 1, H, F, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(T, H, generator=g).to(DEV)
    logits = torch.randn(T, E + 1, generator=g).to(DEV)
    tw, ids = route(logits, k, shared=True)
    assert ids.shape == (T, k + 1) and (ids[:, k] == E).all() and (ids[:, :k] < E).all()
    xd = x.double()
    routed_w, routed_i = route(logits[:, :E], k)
    gate, up = (xd @ w13[E].double().T).split(F, -1)
    shared = torch.sigmoid(logits[:, E:].double()) * ((torch.nn.functional.silu(gate) * up)
                                                       @ w2[E].double().T)
    want = moe_reference(xd, w13.double(), w2.double(), routed_w.double(), routed_i) + shared
    for cfg in (GEMV_TILES[0], MoEConfig(block_m=16, block_n=16, block_k=16, num_warps=1,
                                         num_stages=1)):
        got = fused_moe(x, w13, w2, tw, ids, impl="triton", config=cfg)
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)
    assert torch.allclose(moe_reference(xd, w13.double(), w2.double(), tw.double(), ids), want)


def test_strided_tokens_and_a_larger_tile():
    """x rows strided (a view into a wider buffer) and 32-row blocks."""
    E, H, F, T, k = 4, 32, 32, 10, 2
    w13, w2 = weights(E, H, F)
    tw, ids = routing("ragged", T, E, k, seed=3)
    wide = torch.randn(T, 2 * H, generator=torch.Generator().manual_seed(2)).to(DEV)
    x = wide[:, 5:5 + H]
    want = moe_reference(x.double(), w13.double(), w2.double(), tw.double(), ids)
    for align in ("torch", "triton"):
        cfg = MoEConfig(block_m=32, block_n=16, block_k=16, num_warps=2, num_stages=1,
                        align_impl=align)
        got = fused_moe(x, w13, w2, tw, ids, impl="triton", config=cfg)
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("kind", ["ragged", "one_expert_everywhere", "all_but_one_empty"])
def test_alignment_puts_every_pair_once_in_a_block_of_its_expert(kind, block_m, impl):
    T, E = 13, 6
    k = 1 if kind == "all_but_one_empty" else 3
    _, ids = routing(kind, T, E, k, seed=4)
    a = align_blocks(ids, E, block_m, impl=impl)
    n = T * k
    assert a.num_blocks == max_blocks(n, E, block_m) == -(-n // block_m) + min(E, n)
    assert a.sorted_pairs.shape == (a.num_blocks * block_m,)
    flat = ids.reshape(-1).long().cpu()
    pairs = a.sorted_pairs.cpu().long()
    experts = a.block_expert.cpu().long()
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))                 # every pair exactly once
    block_of = torch.arange(pairs.shape[0]) // block_m
    assert torch.equal(flat[pairs[pairs < n]], experts[block_of[pairs < n]])   # its expert's block
    assert torch.equal(a.expert_counts.cpu().long(), torch.bincount(flat, minlength=E))
    used = -(-a.expert_counts.cpu().long() // block_m)
    assert int((experts < E).sum()) == int(used.sum())             # used blocks first, then E
    assert torch.equal(experts[: int(used.sum())],
                       torch.repeat_interleave(torch.arange(E), used))
    assert (experts[int(used.sum()):] == E).all()
    assert (pairs[block_of >= int(used.sum())] == n).all()
    for e in range(E):                                             # stable within an expert
        mine = real[flat[real] == e]
        assert torch.equal(mine, mine.sort().values)


@pytest.mark.parametrize("T,E,k,block_m", [(1, 8, 3, 16), (37, 5, 2, 4), (70, 12, 4, 16),
                                           (9, 33, 8, 32)])
def test_both_alignments_are_identical(T, E, k, block_m):
    """The one-launch Triton alignment equals the torch ops entry for entry (several chunks of
    pairs, more bins than experts, ties of expert ids across chunks)."""
    for seed in range(3):
        _, ids = routing("ragged", T, E, k, seed=seed)
        a = align_blocks(ids, E, block_m, impl="torch")
        b = align_blocks(ids, E, block_m, impl="triton")
        assert torch.equal(a.sorted_pairs, b.sorted_pairs)
        assert torch.equal(a.block_expert, b.block_expert)
        assert torch.equal(a.expert_counts, b.expert_counts)
    with pytest.raises(ValueError, match="impl must be"):
        align_blocks(ids, E, block_m, impl="cub")


def test_route_is_softmax_topk_renormalised():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w, ids = route(logits.to(DEV), 3)
    p = torch.softmax(logits, -1)
    top, top_i = p.topk(3, -1)
    assert ids.dtype == torch.int32 and torch.equal(ids.cpu().long(), top_i)
    assert torch.allclose(w.cpu().double(), top / top.sum(-1, keepdim=True), atol=1e-6)
    w_raw, _ = route(logits.to(DEV), 3, renormalize=False)
    assert torch.allclose(w_raw.cpu().double(), top, atol=1e-6)


@pytest.mark.parametrize("T,E,k", [(6, 8, 2), (3, 33, 8), (1, 4, 1), (5, 6, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_triton_routing_equals_torch(T, E, k, renormalize):
    # distinct logits (in fp16 too): torch.topk orders ties its own way
    gen = torch.Generator().manual_seed(T * E)
    distinct = torch.randperm(T * E, generator=gen).view(T, E) * (4.0 / (T * E)) - 2.0
    for dtype in (torch.float32, torch.float16):
        logits = distinct.to(DEV, dtype)
        w, ids = route(logits, k, renormalize)
        w_t, ids_t = route(logits, k, renormalize, impl="triton")
        assert ids_t.dtype == torch.int32 and torch.equal(ids_t, ids)
        assert torch.allclose(w_t, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("k,renormalize", [(2, True), (3, False), (8, True)])
def test_routing_with_the_shared_gate(k, renormalize):
    """``shared=True``: the first E columns routed as without it, slot k = (E, sigmoid of the
    last column), in both implementations."""
    T, E = 4, 11
    logits = torch.randn(T, E + 1, generator=torch.Generator().manual_seed(k)).to(DEV)
    w0, i0 = route(logits[:, :E], k, renormalize)
    for impl in ("torch", "triton"):
        w, ids = route(logits, k, renormalize, impl=impl, shared=True)
        assert w.shape == ids.shape == (T, k + 1) and ids.dtype == torch.int32
        assert torch.equal(ids[:, :k], i0) and (ids[:, k] == E).all()
        assert torch.allclose(w[:, :k], w0, atol=1e-6, rtol=1e-5)
        assert torch.allclose(w[:, k], torch.sigmoid(logits[:, E].float()), atol=1e-6)
    with pytest.raises(ValueError, match=r"logits \[T, E \+ 1\]"):
        route(logits[:, :k], k, shared=True)


def test_triton_routing_breaks_ties_to_the_lower_expert():
    logits = torch.zeros(3, 6, device=DEV)
    logits[1, 4] = 1.0                             # one clear winner, then a five-way tie
    w, ids = route(logits, 3, impl="triton")
    assert ids.cpu().tolist() == [[0, 1, 2], [4, 0, 1], [0, 1, 2]]
    assert torch.allclose(w[0], torch.full((3,), 1 / 3, device=DEV))
    with pytest.raises(ValueError, match="1 <= top_k <= E"):
        route(logits, 7, impl="triton")
    with pytest.raises(ValueError, match="route impl must be"):
        route(logits, 2, impl="cub")


def test_torch_impl_is_the_reference_and_bad_inputs_are_named():
    w13, w2 = weights(4, 16, 16)
    tw, ids = routing("ragged", 3, 4, 2)
    x = torch.randn(3, 16).to(DEV)
    assert torch.equal(fused_moe(x, w13, w2, tw, ids, impl="torch"),
                       moe_reference(x, w13, w2, tw, ids))
    with pytest.raises(ValueError, match=r"do not match x \[T, 16\]"):
        fused_moe(x, w13, w2[:, :, :8], tw, ids, impl="triton")
    with pytest.raises(ValueError, match=r"must both be \[T=3, k\]"):
        fused_moe(x, w13, w2, tw[:2], ids[:2], impl="triton")
    with pytest.raises(ValueError, match="or share x.s dtype"):
        fused_moe(x.double(), w13, w2, tw, ids, impl="triton")
    with pytest.raises(ValueError, match="impl must be"):
        fused_moe(x, w13, w2, tw, ids, impl="cutlass")


def test_picked_tiles_are_tl_dot_sized():
    assert isinstance(pick_moe_config(GEMV_MAX_PAIRS, 256, torch.device("cuda")), GemvConfig)
    for pairs in (8, 64, 512, 2048, 8192):
        for dev in ("cpu", "cuda"):
            cfg = pick_moe_config(pairs, 256, torch.device(dev))
            if isinstance(cfg, GemvConfig):
                assert dev == "cuda" and pairs <= GEMV_MAX_PAIRS
                continue
            for c in (cfg, cfg.down or cfg):
                assert min(c.block_m, c.block_n, c.block_k) >= 16 and c.block_m == cfg.block_m


def test_the_down_gemm_takes_its_own_tiles():
    g = torch.Generator().manual_seed(3)
    T, E, H, F, k = 5, 6, 32, 16, 2
    x = torch.randn(T, H, generator=g).to(DEV)
    w13 = (torch.randn(E, 2 * F, H, generator=g) * 0.2).to(DEV)
    w2 = (torch.randn(E, H, F, generator=g) * 0.2).to(DEV)
    tw, ids = route(torch.randn(T, E, generator=g).to(DEV), k)
    down = MoEConfig(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=1)
    cfg = MoEConfig(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1, down=down)
    got = fused_moe(x, w13, w2, tw, ids, impl="triton", config=cfg)
    want = moe_reference(x.double(), w13.double(), w2.double(), tw.double(), ids)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="must equal the gate/up GEMM's"):
        MoEConfig(block_m=16, down=MoEConfig(block_m=32))


# ---- compiled on a GPU only ----

gpu = pytest.mark.skipif(not CUDA, reason="needs a GPU")


@gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_bf16_on_the_gpu(T):
    E, H, F, k = 64, 256, 128, 8
    w13, w2 = weights(E, H, F, torch.bfloat16)
    tw, ids = routing("ragged", T, E, k)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    got = fused_moe(x, w13, w2, tw, ids, impl="triton")
    want = moe_reference(x.double(), w13.double(), w2.double(), tw.double(), ids)
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


@gpu
@pytest.mark.parametrize("T", [2, 24])                 # matrix-vector kernels, grouped GEMMs
def test_no_host_sync_and_cuda_graph_capture(T):
    E, H, F, k = 16, 64, 32, 4
    w13, w2 = weights(E, H, F)
    x = torch.randn(T, H, device=DEV)
    logits = torch.randn(T, E, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tw, ids = route(logits, k, impl="triton")
        fused_moe(x, w13, w2, tw, ids, impl="triton")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                 # warm up (compile) outside the capture
        tw, ids = route(logits, k, impl="triton")
        fused_moe(x, w13, w2, tw, ids, impl="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tw, ids = route(logits, k, impl="triton")
        out = fused_moe(x, w13, w2, tw, ids, impl="triton")
    for seed in range(3):                            # new routings replay in the same graph
        gen = torch.Generator(device=DEV).manual_seed(seed)
        logits.copy_(torch.randn(T, E, device=DEV, generator=gen))
        x.copy_(torch.randn(T, H, device=DEV, generator=gen))
        graph.replay()
        w_ref, i_ref = route(logits, k)
        want = moe_reference(x.double(), w13.double(), w2.double(), w_ref.double(), i_ref)
        assert torch.allclose(out.double(), want, atol=2e-5, rtol=1e-4)
