"""Pin our conventions to the ecosystem: on chains we must equal transformers' torch reference.

transformers swaps its torch GDN / conv functions for fla's / causal_conv1d's kernels whenever those
import; we block both imports first so the oracle is the plain torch code (DESIGN.md section 3).
"""

import pytest
import torch

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from bole.ops.conv import conv_state_commit, tree_conv1d  # noqa: E402
from bole.ops.gdn.closed_form import commit_factored, tree_gdn_closed_form  # noqa: E402
from bole.ops.gdn.reference import chain_gdn_recurrent  # noqa: E402
from bole.tree import PackedForest  # noqa: E402


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_oracle_is_the_torch_path():
    fn = qwen3_5.torch_recurrent_gated_delta_rule
    assert "fla" not in getattr(fn, "__module__", "") and fn.__module__.startswith("transformers")


@pytest.mark.parametrize("B, T, H_k, H_v, d_k, d_v, l2", [
    (2, 16, 2, 4, 16, 8, True),
    (1, 33, 1, 1, 8, 8, False),
    (3, 8, 2, 6, 16, 16, True),
])
def test_chain_equals_transformers_recurrence(B, T, H_k, H_v, d_k, d_v, l2):
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, H_k, d_k, generator=gen)
    k = torch.randn(B, T, H_k, d_k, generator=gen)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H_v, d_v, generator=gen)
    g = -torch.rand(B, T, H_v, generator=gen) * 4
    beta = torch.rand(B, T, H_v, generator=gen)
    S = torch.randn(B, H_v, d_k, d_v, generator=gen)
    o_hf, s_hf = qwen3_5.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=S.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=l2)
    o_ser, s_ser = chain_gdn_recurrent(q, k, v, g, beta, initial_state=S,
                                       use_qk_l2norm_in_kernel=l2)
    assert rel(o_ser, o_hf) <= 1e-6 and rel(s_ser, s_hf) <= 1e-6
    forest = PackedForest.from_parents(torch.arange(-1, T - 1).expand(B, T))
    o_cf, f = tree_gdn_closed_form(q, k, v, forest, g=g, beta=beta, initial_state=S,
                                   use_qk_l2norm_in_kernel=l2)
    assert rel(o_cf, o_hf) <= 1e-6
    s_cf = commit_factored(f, S, forest, [T - 1] * B)
    assert rel(s_cf, s_hf) <= 1e-6


def test_chain_conv_equals_transformers_conv_update():
    B, T, C, K = 2, 7, 12, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    state = torch.randn(B, C, K - 1, generator=gen)
    hf_state = state.clone()
    y_hf = qwen3_5.causal_conv1d_update(x.transpose(1, 2), hf_state, w, None, "silu")
    forest = PackedForest.from_parents(torch.arange(-1, T - 1).expand(B, T))
    y = tree_conv1d(x, w, state, forest)
    assert rel(y, y_hf.transpose(1, 2)) <= 1e-6
    assert torch.allclose(conv_state_commit(x, state, forest, [T - 1] * B), hf_state)
