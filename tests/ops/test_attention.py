"""Tree attention over the KV pool (Triton kernel and torch path), pool writes and prefill, against
the fp64 oracle. On CPU the Triton kernels run under the interpreter, so launches stay tiny."""

import pytest
import torch

from bole.ops.attention import (prefill_attention, tree_attention, tree_attention_reference,
                                write_kv)
from tests.kernel_utils import DEV, assert_rel

IMPLS = ["torch", "triton"]


def random_tree_mask(n_nodes: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor mask (self included) of a random tree, parents before children: ``[width, width]``
    with rows/columns past ``n_nodes`` zero (padding nodes)."""
    mask = torch.zeros(width, width, dtype=torch.bool)
    for i in range(n_nodes):
        if i:
            mask[i] = mask[int(torch.randint(0, i, (1,), generator=gen))]
        mask[i, i] = True
    return mask


def make_case(seed: int, *, R=3, Tq=5, Tk=None, Hkv=2, group=2, D=16, M=32, S=5,
              dtype=torch.float32, gate=False, arbitrary=False):
    """Random pool, requests and masks. ``ctx_lens`` hold 0 and the maximum ``M - Tk``; each
    request's tree has a random size (the rest of its rows are padding); with ``arbitrary`` the
    last request gets a random (non-tree) mask. q and gate are strided views, as in the model."""
    gen = torch.Generator().manual_seed(seed)
    Tk = Tq if Tk is None else Tk
    Hq, N = Hkv * group, R * Tq
    k_pool = torch.randn(S, M, Hkv, D, generator=gen).to(dtype)
    v_pool = torch.randn(S, M, Hkv, D, generator=gen).to(dtype)
    slots = torch.randperm(S, generator=gen)[:R]
    ctx = torch.randint(0, M - Tk + 1, (R,), generator=gen)
    ctx[0], ctx[-1] = 0, M - Tk
    masks = []
    for r in range(R):
        size = int(torch.randint(1, min(Tq, Tk) + 1, (1,), generator=gen))
        m = random_tree_mask(size, max(Tq, Tk), gen)[:Tq, :Tk]
        if arbitrary and r == R - 1:
            m = torch.rand(Tq, Tk, generator=gen) < 0.5
        masks.append(m)
    q_gate = torch.randn(N, Hq, 2 * D, generator=gen).to(dtype)
    q, g = q_gate.chunk(2, dim=-1)
    args = [x.to(DEV) for x in (q, k_pool, v_pool, slots, ctx, torch.cat(masks))]
    return args, dict(scale=D ** -0.5, gate=g.reshape(N, -1).to(DEV) if gate else None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("group,num_splits,gate", [
    (1, 1, False), (2, 2, True), (4, 3, False), (1, 3, True), (2, 1, True), (4, 2, True)])
def test_matches_reference(impl, group, num_splits, gate):
    args, kw = make_case(10 * group + num_splits, group=group, gate=gate, arbitrary=gate)
    expect = tree_attention_reference(*args, **kw)
    assert_rel(tree_attention(*args, **kw, num_splits=num_splits, impl=impl), expect)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_gate_as_a_strided_head_view(impl, num_splits):
    """The gate straight from the q projection ([N, Hq, D] with a head stride of 2 D, as
    attention_qkv returns it) gives the flattened gate's output."""
    args, kw = make_case(11, group=2, gate=True, arbitrary=True)
    N, Hq, D = args[0].shape
    wide = torch.zeros(N, Hq, 2 * D, dtype=kw["gate"].dtype, device=DEV)
    wide[..., D:] = kw["gate"].view(N, Hq, D)
    strided = wide[..., D:]
    assert not strided.is_contiguous()
    want = tree_attention(*args, **kw, num_splits=num_splits, impl=impl)
    got = tree_attention(*args, scale=kw["scale"], gate=strided, num_splits=num_splits, impl=impl)
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_more_scratch_keys_than_nodes_uint8_mask_and_head_dim_32(impl):
    args, kw = make_case(7, R=2, Tq=4, Tk=7, group=2, D=32, M=48, gate=True, arbitrary=True)
    args[-1] = args[-1].to(torch.uint8)
    expect = tree_attention_reference(*args, **kw)
    assert_rel(tree_attention(*args, **kw, num_splits=2, impl=impl), expect)


def test_invariant_to_num_splits():
    args, kw = make_case(3, R=2, Tq=4, M=64, group=2, gate=True)
    outs = [tree_attention(*args, **kw, num_splits=s, impl="triton") for s in (1, 2, 3, 5, None)]
    for o in outs[1:]:
        assert_rel(o, outs[0], tol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_row_with_nothing_visible_gives_zeros(impl):
    args, kw = make_case(5, R=2, Tq=4, gate=True)
    ctx, mask = args[4], args[5]
    ctx[0] = 0                     # request 0: no context, and its node 2 sees no scratch key
    mask[2] = False
    o = tree_attention(*args, **kw, num_splits=2, impl=impl)
    assert torch.isfinite(o).all()
    assert not o[2].any()
    assert o[0].abs().sum() > 0
    assert_rel(o, tree_attention_reference(*args, **kw))


@pytest.mark.parametrize("impl", IMPLS)
def test_write_kv_then_attention_matches_dense_attention(impl):
    """The position convention end to end: write the nodes' k/v into the scratch region, then
    compare with softmax over ``cat(committed keys, new keys)`` as the model's eager loop does."""
    gen = torch.Generator().manual_seed(11)
    R, T, Hkv, group, D, M = 2, 4, 2, 2, 16, 24
    args, kw = make_case(11, R=R, Tq=T, Hkv=Hkv, group=group, D=D, M=M)
    q, k_pool, v_pool, slots, ctx, mask = args
    k_new = torch.randn(R * T, Hkv, D, generator=gen).to(DEV)
    v_new = torch.randn(R * T, Hkv, D, generator=gen).to(DEV)
    write_kv(k_pool, v_pool, k_new, v_new, slots, ctx)
    o = tree_attention(*args, **kw, impl=impl)
    for r in range(R):
        s, c, rows = int(slots[r]), int(ctx[r]), slice(r * T, r * T + T)
        keys = torch.cat([k_pool[s, :c], k_new[rows]]).repeat_interleave(group, 1).transpose(0, 1)
        vals = torch.cat([v_pool[s, :c], v_new[rows]]).repeat_interleave(group, 1).transpose(0, 1)
        visible = torch.cat([torch.ones(T, c, dtype=torch.bool, device=DEV), mask[rows]], 1)
        scores = (q[rows].transpose(0, 1) @ keys.transpose(1, 2) * kw["scale"]).masked_fill(~visible, -torch.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)       # padding rows may see nothing
        assert_rel(o[rows], (probs @ vals).transpose(0, 1))


def test_write_kv_round_trip_and_bounds():
    gen = torch.Generator().manual_seed(2)
    S, M, Hkv, D, R, Tk = 4, 10, 2, 8, 2, 3
    k_pool, v_pool = torch.randn(S, M, Hkv, D, generator=gen), torch.randn(S, M, Hkv, D, generator=gen)
    before_k, before_v = k_pool.clone(), v_pool.clone()
    k, v = torch.randn(R * Tk, Hkv, D, generator=gen), torch.randn(R * Tk, Hkv, D, generator=gen)
    slots, ctx = torch.tensor([3, 1]), torch.tensor([M - Tk, 0], dtype=torch.int32)   # exact fit
    write_kv(k_pool, v_pool, k, v, slots, ctx)
    touched = torch.zeros(S, M, dtype=torch.bool)
    for r in range(R):
        s, c = int(slots[r]), int(ctx[r])
        assert torch.equal(k_pool[s, c:c + Tk], k[r * Tk:(r + 1) * Tk])
        assert torch.equal(v_pool[s, c:c + Tk], v[r * Tk:(r + 1) * Tk])
        touched[s, c:c + Tk] = True
    assert torch.equal(k_pool[~touched], before_k[~touched])
    assert torch.equal(v_pool[~touched], before_v[~touched])
    with pytest.raises(IndexError):             # one position past M: refused, not written OOB
        write_kv(k_pool, v_pool, k, v, slots, torch.tensor([M - Tk + 1, 0]))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("ctx_len,P", [(0, 1), (0, 6), (5, 4), (9, 7), (25, 7)])
def test_prefill_matches_reference(group, ctx_len, P):
    gen = torch.Generator().manual_seed(100 * group + ctx_len + P)
    S, M, Hkv, D = 3, 32, 2, 16
    k_pool, v_pool = torch.randn(S, M, Hkv, D, generator=gen), torch.randn(S, M, Hkv, D, generator=gen)
    q = torch.randn(P, Hkv * group, D, generator=gen)
    gate = torch.randn(P, Hkv * group * D, generator=gen) if P % 2 else None
    pools = [x.to(DEV) for x in (q, k_pool, v_pool)]
    o = prefill_attention(*pools, 2, ctx_len, scale=0.3, gate=None if gate is None else gate.to(DEV))
    chain = torch.ones(P, P, dtype=torch.bool).tril()        # token i's ancestors: 0 .. i
    expect = tree_attention_reference(*pools, torch.tensor([2], device=DEV),
                                      torch.tensor([ctx_len], device=DEV), chain.to(DEV), scale=0.3,
                                      gate=None if gate is None else gate.to(DEV))
    assert_rel(o, expect)


def test_torch_path_in_bf16():
    args, kw = make_case(9, dtype=torch.bfloat16, gate=True)
    o = tree_attention(*args, **kw, impl="torch")
    assert o.dtype == torch.bfloat16
    assert_rel(o, tree_attention_reference(*args, **kw), tol=2e-2)


def _bad_inputs():
    args, kw = make_case(1, R=2, Tq=3)
    q, k_pool, v_pool, slots, ctx, mask = args
    N = q.shape[0]
    yield ValueError, "multiple of the 2 requests", (q[:5], k_pool, v_pool, slots, ctx, mask[:5]), kw
    yield ValueError, "k_pool and v_pool", (q, k_pool, v_pool[:, :4], slots, ctx, mask), kw
    yield TypeError, "share one dtype", (q.double(), k_pool, v_pool, slots, ctx, mask), kw
    yield TypeError, "share one floating dtype", (q, k_pool, v_pool.half(), slots, ctx, mask), kw
    yield ValueError, "head dim", (q[..., :8], k_pool, v_pool, slots, ctx, mask), kw
    yield ValueError, "not a multiple", (q[:, :3], k_pool, v_pool, slots, ctx, mask), kw
    yield TypeError, "int32 or int64", (q, k_pool, v_pool, slots.float(), ctx, mask), kw
    yield ValueError, "ctx_lens 3", (q, k_pool, v_pool, slots, torch.cat([ctx, ctx[:1]]), mask), kw
    yield TypeError, "bool or uint8", (q, k_pool, v_pool, slots, ctx, mask.float()), kw
    yield ValueError, r"tree_mask must be \[N, Tk\]", (q, k_pool, v_pool, slots, ctx, mask[:4]), kw
    yield ValueError, "gate must be", args, dict(kw, gate=torch.zeros(N, 5, device=DEV))
    yield TypeError, "gate", args, dict(kw, gate=torch.zeros(N, q.shape[1] * 16, device=DEV).half())


@pytest.mark.parametrize("case", range(12))
def test_bad_inputs_raise(case):
    error, match, args, kw = list(_bad_inputs())[case]
    for impl in IMPLS:
        with pytest.raises(error, match=match):
            tree_attention(*args, **kw, impl=impl)


def test_bad_impl_write_kv_and_prefill_inputs_raise():
    args, kw = make_case(1, R=2, Tq=3)
    q, k_pool, v_pool, slots, ctx, _ = args
    with pytest.raises(ValueError, match="impl must be"):
        tree_attention(*args, **kw, impl="cuda")
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention(*args, **kw, impl="triton", num_splits=0)
    k = torch.zeros(6, 2, 16, device=DEV)
    with pytest.raises(ValueError, match=r"k must be \[N, Hkv, D\]"):
        write_kv(k_pool, v_pool, k[:, :1], k, slots, ctx)
    with pytest.raises(TypeError, match="must match the pool"):
        write_kv(k_pool, v_pool, k.half(), k, slots, ctx)
    with pytest.raises(ValueError, match="multiple of the 2 requests"):
        write_kv(k_pool, v_pool, k[:5], k[:5], slots, ctx)
    with pytest.raises(ValueError, match="must fit"):
        prefill_attention(q, k_pool, v_pool, 0, 30, scale=1.0)
    with pytest.raises(ValueError, match="slot 9"):
        prefill_attention(q, k_pool, v_pool, 9, 0, scale=1.0)
    with pytest.raises(TypeError, match="slot must be a Python int"):
        prefill_attention(q, k_pool, v_pool, slots[0], 0, scale=1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_with_new_values_real_head_dim(dtype):
    """Capture once, then replay with other slots, lengths and masks (head_dim 256, GQA 8)."""
    args, kw = make_case(21, R=4, Tq=8, Hkv=2, group=8, D=256, M=512, S=6, dtype=dtype, gate=True)
    static = [a.clone() for a in args]
    gate = kw["gate"].clone()
    tree_attention(*static, scale=kw["scale"], gate=gate)          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(*static, scale=kw["scale"], gate=gate)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for seed in (22, 23):
        new, new_kw = make_case(seed, R=4, Tq=8, Hkv=2, group=8, D=256, M=512, S=6, dtype=dtype,
                                gate=True, arbitrary=True)
        for dst, src in zip(static + [gate], new + [new_kw["gate"]]):
            dst.copy_(src)
        graph.replay()
        assert_rel(out, tree_attention_reference(*new, **new_kw), tol=tol)
