"""Malformed GDN inputs raise ValueError/TypeError naming the problem, in every implementation."""

import pytest
import torch

from bole.ops.gdn.closed_form import tree_gdn_closed_form
from bole.ops.gdn.reference import tree_gdn_serial
from bole.tree import DraftTree, PackedForest

IMPLS = [tree_gdn_serial, tree_gdn_closed_form]


def good(N=5, R=1, Hk=2, Hv=4, dk=8, dv=4):
    return dict(q=torch.randn(1, N, Hk, dk), k=torch.randn(1, N, Hk, dk),
                v=torch.randn(1, N, Hv, dv), g=-torch.rand(1, N, Hv), beta=torch.rand(1, N, Hv),
                initial_state=torch.randn(R, Hv, dk, dv))


FOREST = PackedForest.pack([DraftTree.from_parents([-1, 0, 0, 1, 3])])


def changed(**kw):
    x = good()
    x.update(kw)
    return x


CASES = [
    ("q rank", changed(q=torch.randn(5, 2, 8)), ValueError, "4-D"),
    ("k shape", changed(k=torch.randn(1, 5, 2, 6)), ValueError, "k has shape"),
    ("v nodes", changed(v=torch.randn(1, 4, 4, 4)), ValueError, "v has shape"),
    ("heads", changed(v=torch.randn(1, 5, 3, 4), g=-torch.rand(1, 5, 3), beta=torch.rand(1, 5, 3),
                      initial_state=torch.randn(1, 3, 8, 4)), ValueError, "multiple of key heads"),
    ("qkv dtype", changed(k=torch.randn(1, 5, 2, 8, dtype=torch.float64)), TypeError, "share one dtype"),
    ("int q", changed(q=torch.ones(1, 5, 2, 8, dtype=torch.int32)), TypeError, "dtype"),
    ("g shape", changed(g=-torch.rand(1, 5, 2)), ValueError, "g has shape"),
    ("g dtype", changed(g=torch.zeros(1, 5, 4, dtype=torch.int64)), TypeError, "floating point"),
    ("g nan", changed(g=torch.full((1, 5, 4), float("nan"))), ValueError, "g holds .* NaN/inf"),
    ("g inf", changed(g=torch.full((1, 5, 4), float("-inf"))), ValueError, "g holds .* NaN/inf"),
    ("beta inf", changed(beta=torch.full((1, 5, 4), float("inf"))), ValueError, "beta holds"),
    ("g positive", changed(g=torch.rand(1, 5, 4) + 0.1), ValueError, "log-decay <= 0"),
    ("v nan", changed(v=torch.full((1, 5, 4, 4), float("nan"))), ValueError, "v holds"),
    ("state shape", changed(initial_state=torch.randn(2, 4, 8, 4)), ValueError, "initial_state has shape"),
    ("state dtype", changed(initial_state=torch.randn(1, 4, 8, 4).half()), TypeError, "fp32"),
    ("state nan", changed(initial_state=torch.full((1, 4, 8, 4), float("nan"))), ValueError, "initial_state holds"),
    ("forest size", dict(good(N=6)), ValueError, "forest has 5"),
]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name, inputs, exc, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_inputs(impl, name, inputs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        impl(forest=FOREST, **inputs)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda f: f.__name__)
def test_gate_combinations(impl):
    x = good()
    g, beta = x.pop("g"), x.pop("beta")
    with pytest.raises(ValueError, match="give the gates"):
        impl(forest=FOREST, **x)
    with pytest.raises(ValueError, match="raw gating needs"):
        impl(forest=FOREST, a=torch.randn(1, 5, 4), **x)
    with pytest.raises(ValueError, match="not both"):
        impl(forest=FOREST, g=g, beta=beta, a=torch.randn(1, 5, 4), **x)
    with pytest.raises(ValueError, match="A_log has shape"):
        impl(forest=FOREST, a=torch.randn(1, 5, 4), b=torch.randn(1, 5, 4),
             A_log=torch.randn(3), dt_bias=torch.randn(4), **x)
    with pytest.raises(TypeError, match="PackedForest"):
        impl(forest=[-1, 0], g=g, beta=beta, **x)


def test_check_values_can_be_skipped_on_the_hot_path():
    x = changed(g=torch.full((1, 5, 4), float("nan")))
    o, _ = tree_gdn_closed_form(forest=FOREST, check_values=False, **x)
    assert torch.isnan(o).any()     # garbage in, garbage out, but no host sync spent on checks
