"""The commit's row moves (bole/ops/commit_rows.py; the CPU interpreter here) against their torch
references, on paths whose source rows overlap their destinations and with padding rows."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bole.ops.commit_rows import (commit_conv_state, commit_conv_state_reference, move_kv_rows,
                                  move_kv_rows_reference)
from tests.kernel_utils import DEV


def random_paths(gen, R, P, T):
    """Root-first paths of increasing local node indices (a node at depth d has index >= d)."""
    path = torch.zeros(R, P, dtype=torch.int64)
    length = torch.randint(0, P + 1, (R,), generator=gen)
    for r in range(R):
        for p in range(1, P):
            lo = int(path[r, p - 1]) + 1
            path[r, p] = torch.randint(lo, max(lo + 1, T - (P - 1 - p)), (1,), generator=gen)
        n = int(length[r])
        if n:
            path[r, n:] = path[r, n - 1]          # padded with the accepted node
    return path, length


@given(R=st.integers(1, 5), P=st.integers(1, 9), L=st.integers(1, 3), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_move_kv_rows_equals_reference(R, P, L, seed):
    gen = torch.Generator().manual_seed(seed)
    S, M, H, D = R + 2, 48, 2, 8
    T = 3 * P + 2
    k = torch.randn(L, S, M, H, D, generator=gen)
    v = torch.randn(L, S, M, H, D, generator=gen)
    slots = torch.randperm(S, generator=gen)[:R]
    ctx = torch.randint(0, M - T, (R,), generator=gen)
    path, length = random_paths(gen, R, P, T)
    want_k, want_v = k.clone(), v.clone()
    move_kv_rows_reference(want_k, want_v, slots, ctx, path, length)
    k, v = k.to(DEV), v.to(DEV)
    move_kv_rows(k, v, slots.to(DEV), ctx.to(DEV), path.to(DEV), length.to(DEV), impl="triton")
    assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)


@given(R=st.integers(1, 5), Kc=st.integers(2, 5), L=st.integers(1, 3), C=st.integers(1, 40),
       seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_commit_conv_state_equals_reference(R, Kc, L, C, seed):
    gen = torch.Generator().manual_seed(seed)
    W, S, N = Kc - 1, R + 2, 4 * R
    pool = torch.randn(L, S, C, W, generator=gen)
    # the conv columns of a wider stacked projection: strided rows, as the forward leaves them
    inputs = torch.randn(L, N, C + 5, generator=gen)[..., 2:C + 2]
    slots = torch.randperm(S, generator=gen)[:R]
    fresh = torch.rand(R, W, generator=gen) < 0.5
    cols = torch.randint(0, W, (R, W), generator=gen)
    code = torch.where(fresh, torch.randint(0, N, (R, W), generator=gen),
                       -(torch.arange(R)[:, None] * W + cols) - 1).to(torch.int32)
    length = torch.randint(0, 3, (R,), generator=gen)
    want = pool.clone()
    commit_conv_state_reference(want, inputs, code, slots, length)
    got = pool.to(DEV)
    commit_conv_state(got, inputs.to(DEV), code.to(DEV), slots.to(DEV), length.to(DEV),
                      impl="triton")
    assert torch.equal(got.cpu(), want)


def test_conv_commit_reads_old_columns_before_writing():
    """A window that shifts the state left by one: column j takes old column j + 1."""
    L, S, C, W = 1, 2, 3, 3
    pool = torch.arange(L * S * C * W, dtype=torch.float32).view(L, S, C, W)
    code = torch.tensor([[-(1 * W + 1) - 1, -(1 * W + 2) - 1, 0]], dtype=torch.int32)
    inputs = torch.full((L, 1, C), -5.0)
    want = pool.clone()
    want[0, 1] = torch.stack([pool[0, 1, :, 1], pool[0, 1, :, 2], torch.full((C,), -5.0)], -1)
    got = pool.to(DEV)
    commit_conv_state(got, inputs.to(DEV), code.to(DEV), torch.tensor([1]).to(DEV),
                      torch.tensor([1]).to(DEV), impl="triton")
    assert torch.equal(got.cpu(), want)
