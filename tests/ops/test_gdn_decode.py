"""The in-place decode step (bole/ops/gdn/decode.py) against the serial reference: every row a
lone root from its slot's state, the pool updated to the reference's state after it, other
slots untouched; the kernel (interpreter on CPU, compiled on a GPU) against the torch path."""

import pytest
import torch

from bole.ops.gdn.decode import gdn_decode_inplace
from bole.ops.gdn.reference import tree_gdn_serial
from bole.tree import DraftTree, PackedForest
from tests.kernel_utils import DEV, assert_rel


def _inputs(R, Hk, Hv, dk, dv, S, dtype, seed, gate_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * scale)  # noqa: E731
    q, k, v = r(R, Hk, dk), r(R, Hk, dk), r(R, Hv, dv)
    a, b = r(R, Hv, scale=3.0 * gate_scale), r(R, Hv, scale=3.0)
    A_log, dt_bias = r(Hv, scale=0.5), r(Hv, scale=0.5)
    pool = r(S, Hv, dk, dv)
    slots = torch.randperm(S, generator=gen)[:R]
    return [t.to(dtype) for t in (q, k, v, a, b)] + [A_log, dt_bias, pool, slots]


@pytest.mark.parametrize("R,Hk,Hv,dk,dv", [(1, 1, 1, 8, 8), (3, 2, 4, 16, 12), (5, 1, 3, 5, 7)])
@pytest.mark.parametrize("gate_scale", [1.0, 30.0])
def test_torch_path_equals_the_serial_reference(R, Hk, Hv, dk, dv, gate_scale):
    q, k, v, a, b, A_log, dt_bias, pool, slots = _inputs(R, Hk, Hv, dk, dv, R + 2,
                                                        torch.float64, R, gate_scale)
    before = pool.clone()
    forest = PackedForest.pack([DraftTree.chain(1)] * R)
    o_ref, _, states = tree_gdn_serial(q[:, None].reshape(1, R, Hk, dk),
                                       k[:, None].reshape(1, R, Hk, dk), v.reshape(1, R, Hv, dv),
                                       forest, a=a[None], b=b[None], A_log=A_log,
                                       dt_bias=dt_bias, initial_state=pool[slots],
                                       use_qk_l2norm_in_kernel=True, return_states=True)
    o = gdn_decode_inplace(q, k, v, a, b, A_log, dt_bias, pool, slots, impl="torch")
    torch.testing.assert_close(o, o_ref.reshape(R, Hv, dv), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pool[slots], states, rtol=1e-12, atol=1e-12)
    other = torch.ones(pool.shape[0], dtype=torch.bool)
    other[slots] = False
    assert torch.equal(pool[other], before[other])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,Hk,Hv,dk,dv", [(2, 1, 2, 16, 16), (3, 2, 4, 16, 40)])
def test_kernel_equals_the_torch_path(dtype, R, Hk, Hv, dk, dv):
    q, k, v, a, b, A_log, dt_bias, pool, slots = _inputs(R, Hk, Hv, dk, dv, R + 1, dtype, 7)
    dev = dict(device=DEV)
    want_pool = pool.float().clone()
    want = gdn_decode_inplace(q, k, v, a, b, A_log.float(), dt_bias.float(), want_pool, slots,
                              impl="torch")
    got_pool = pool.float().to(**dev)
    got = gdn_decode_inplace(q.to(**dev), k.to(**dev), v.to(**dev), a.to(**dev), b.to(**dev),
                             A_log.float().to(**dev), dt_bias.float().to(**dev), got_pool,
                             slots.to(device=DEV, dtype=torch.int32), impl="triton")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_rel(got.float(), want.float(), tol)
    assert_rel(got_pool, want_pool, 1e-5)


def test_bad_shapes_are_refused():
    q, k, v, a, b, A_log, dt_bias, pool, slots = _inputs(2, 1, 2, 8, 8, 3, torch.float32, 0)
    with pytest.raises(ValueError, match="H_v a multiple"):
        gdn_decode_inplace(q.repeat(1, 2, 1), k.repeat(1, 2, 1), v[:, :1].expand(2, 3, 8), a, b,
                           A_log, dt_bias, pool, slots)
    with pytest.raises(ValueError, match="pool"):
        gdn_decode_inplace(q, k, v, a, b, A_log, dt_bias, pool[:, :, :4], slots)
    with pytest.raises(ValueError, match="slots"):
        gdn_decode_inplace(q, k, v, a, b, A_log, dt_bias, pool, slots.float())
    with pytest.raises(ValueError, match="a, b"):
        gdn_decode_inplace(q, k, v, a[:1], b, A_log, dt_bias, pool, slots)
