"""The value-tiled Triton tree-verification kernel against the fp64 closed form and serial reference.

On a machine without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is imported) on tiny fp32/fp16/bf16 shapes (bf16 products widened to fp32 there, see
``_dot``); with CUDA the same tests run compiled, plus checks of tf32's rounding at real head dims.
"""

import os
from dataclasses import replace

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from bole.ops.gdn.closed_form import commit_factored, tree_gdn_closed_form  # noqa: E402
from bole.ops.gdn.reference import tree_gdn_serial  # noqa: E402
from bole.ops.gdn.verify.kernel import (  # noqa: E402
    CONFIG_TABLE, INTERPRET_CONFIG, NARROW_TILE, VerifyConfig, _interpreting, pick_config,
    tree_gdn_verify_triton)
from bole.tree import DraftTree, PackedForest  # noqa: E402
from tests.strategies import padded  # noqa: E402

pytestmark = pytest.mark.skipif(
    not HAS_CUDA and not _interpreting(),
    reason="no CUDA device and TRITON_INTERPRET is off: the Triton kernel cannot run")

DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = 1e-5          # relative (to the largest reference entry) error allowed in fp32 with "ieee" dots
#: U, L and the normalised keys: fp32 arithmetic without tf32 products (the interpreter, or "ieee"
#: compiled) measured at most 4.2e-7 (U), 6.2e-8 (L) and 1.4e-7 (keys) on this file's inputs
FACTOR_TOL = 1e-6
#: compiled "tf32" rounds the operands of every product to 10 mantissa bits (~1e-3 per product)
COMPILED_TF32_TOL = 2e-2


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all()
    scale = max(float(expected.abs().max()), 1e-30)
    return float((actual - expected).abs().max()) / scale


def make_case(forest: PackedForest, *, H_k=1, H_v=2, d_k=16, d_v=16, raw=False, l2norm=True,
              pool_slots=None, seed=0, dtype=torch.float32):
    """Random inputs (on CPU, fp32 values rounded to ``dtype``) for one forest."""
    gen = torch.Generator().manual_seed(seed)
    N, R = forest.num_nodes, forest.num_requests

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(1, N, H_k, d_k), randn(1, N, H_k, d_k)
    if not l2norm:                      # unit-ish keys keep (I + G) well conditioned
        q, k = q / d_k ** 0.5, k / d_k ** 0.5
    case = dict(q=q.to(dtype), k=k.to(dtype), v=randn(1, N, H_v, d_v).to(dtype))
    if raw:
        case.update(a=randn(1, N, H_v), b=2 * randn(1, N, H_v),
                    A_log=0.5 * randn(H_v), dt_bias=0.5 * randn(H_v))
    else:
        case.update(g=-torch.rand(1, N, H_v, generator=gen),
                    beta=0.05 + 0.9 * torch.rand(1, N, H_v, generator=gen))
    S = R if pool_slots is None else pool_slots
    case["initial_state"] = 0.5 * randn(S, H_v, d_k, d_v)
    if pool_slots is not None:
        case["state_indices"] = torch.randperm(S, generator=gen)[:R].to(torch.int32)
    case["use_qk_l2norm_in_kernel"] = l2norm
    return case


def run_kernel(case, forest, meta=None, **kw):
    args = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    kw.setdefault("precision", "ieee")
    meta = forest.kernel_meta(DEVICE) if meta is None else meta
    return tree_gdn_verify_triton(q, k, v, meta, **args, **kw)


def _with_and_without(case, forest, config, switch, precision="tf32", **kw):
    """``(o, factors)`` of one launch with the VerifyConfig switch on and of the same launch with
    it off."""
    return tuple(run_kernel(case, forest, precision=precision,
                            config=replace(config, **{switch: on}), **kw) for on in (True, False))


def fp64_inputs(case):
    args = {n: (t.double() if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else t)
            for n, t in case.items()}
    args = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    idx = args.pop("state_indices", None)
    if idx is not None:
        args["initial_state"] = args["initial_state"][idx.long()]
    return args


def run_reference(case, forest):
    args = fp64_inputs(case)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return tree_gdn_closed_form(q, k, v, forest, **args)


def check_against_closed_form(case, forest, tol=TOL, o_tol=None, u_tol=FACTOR_TOL, **kw):
    """The kernel's O (within ``o_tol``, default ``tol``), U (``u_tol``), path log-decays and
    normalised keys (:data:`FACTOR_TOL`, no product rounds them) against the fp64 closed form."""
    o, f = run_kernel(case, forest, **kw)
    o_ref, f_ref = run_reference(case, forest)
    assert o.shape == case["v"].shape and o.dtype == case["v"].dtype
    assert f.u.dtype == torch.float32 and f.log_decay.dtype == torch.float64
    assert rel_err(o, o_ref) < (o_tol or tol)
    assert rel_err(f.u, f_ref.u) < u_tol
    assert rel_err(f.log_decay, f_ref.log_decay) < FACTOR_TOL
    keys = f.k.double() if f.k_inv_norm is None else f.k.double() * f.k_inv_norm[..., None].double()
    assert rel_err(keys, f_ref.k) < FACTOR_TOL
    if case["k"].dtype == torch.float32:
        assert rel_err(f.keys(), f_ref.k) < FACTOR_TOL
    return o, f, o_ref, f_ref


def tf32_tols(tol=TOL) -> dict:
    """``tol`` and ``u_tol`` for a "tf32" launch: the compiled products' rounding on a GPU,
    the fp32 tolerances under the interpreter (which computes tf32 products exactly)."""
    if HAS_CUDA and not _interpreting():
        return dict(tol=COMPILED_TF32_TOL, u_tol=COMPILED_TF32_TOL)
    return dict(tol=tol)


# ---------------------------------------------------------------------------------------------
# correctness against the closed form
# ---------------------------------------------------------------------------------------------

TREES = {
    "chain": lambda: DraftTree.chain(9),
    "star": lambda: DraftTree.star(10),
    "kary": lambda: DraftTree.full_kary(2, 3),                                 # 15 nodes
    "random": lambda: DraftTree.random(20, 5, np.random.default_rng(3)),
}


#: every compile-time variant of the kernel body: one or two passes over d_k; key norms from sums
#: of squares or (fused_norms) from the Gram diagonal, folded into the decays; the gates computed
#: after the d_k loop and the mask / value tiles loaded before it (early_loads); the decays
#: formed before the loop (early_decay, which overrides defer_gates) or in its first step
#: (decay_in_loop; d_k = 16 is one step: test_decays_in_the_last_d_k_step takes the last of three)
VARIANTS = {
    "sweep": None,
    "split_gram": VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, split_gram=True),
    "fused_norms": VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, fused_norms=True),
    "early_loads": VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, defer_gates=True,
                                prefetch_tiles=True),
    "early_decay": VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, early_decay=True),
    "early_decay_fused": VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, early_decay=True,
                                      fused_norms=True, prefetch_tiles=True, defer_gates=True),
    "decay_in_loop": VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, early_decay=True,
                                  decay_in_loop=True, fused_norms=True, prefetch_tiles=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("shape", sorted(TREES))
def test_tree_shapes(shape, l2norm, variant):
    forest = PackedForest.pack([TREES[shape]()])
    check_against_closed_form(make_case(forest, l2norm=l2norm, seed=len(shape)), forest,
                              config=VARIANTS[variant])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("nodes", [9, 17, 33])
def test_deep_chains_with_parallel_keys(nodes, variant):
    """Nearly parallel keys and beta near 1 make |G_ij| ~ 1, so the powers of G grow like
    binomials: a solve that formed them (repeated squaring) loses 2e-4 at depth 16 and everything
    at depth 32 in fp32. The sweeps stay at rounding level."""
    forest = PackedForest.pack([DraftTree.chain(nodes), DraftTree.star(4)])
    case = make_case(forest, seed=nodes)
    case["k"] = torch.randn(16, generator=torch.Generator().manual_seed(nodes)) + 0.3 * case["k"]
    case["g"] = case["g"] * 0.05                     # long chains: keep the decays away from 0
    case["beta"] = torch.full_like(case["beta"], 0.95)
    check_against_closed_form(case, forest, config=VARIANTS[variant])


@pytest.mark.parametrize("fp32_log_decay", [False, True])
def test_decays_in_the_last_d_k_step(fp32_log_decay):
    """decay_last_step forms the gates and decays in the d_k loop's last step, here the third of
    three (the VARIANTS' d_k = 16 has one step): the same decays as in the first step, so the
    same results bit for bit, and the closed form's. fp32_log_decay: the path sums in fp32 (tf32
    precision only), within the tolerance of the fp64 reference too."""
    forest = PackedForest.pack([DraftTree.random(20, 5, np.random.default_rng(5)),
                                DraftTree.chain(9), DraftTree.star(4)])
    case = make_case(forest, H_k=1, H_v=2, d_k=48, raw=True, seed=21)
    first = VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, early_decay=True,
                         decay_in_loop=True, fused_norms=True, prefetch_tiles=True,
                         fp32_log_decay=fp32_log_decay)
    last = replace(first, decay_last_step=True)
    o1, f1 = run_kernel(case, forest, precision="tf32", config=first)
    o2, f2 = run_kernel(case, forest, precision="tf32", config=last)
    assert torch.equal(o1, o2) and torch.equal(f1.u, f2.u)
    assert torch.equal(f1.log_decay, f2.log_decay)
    check_against_closed_form(case, forest, precision="tf32", config=last, **tf32_tols())


def test_fp32_log_decay_only_in_tf32_mode():
    """In the "ieee" mode the path sums stay fp64: the switch changes nothing there."""
    forest = PackedForest.pack([DraftTree.random(30, 8, np.random.default_rng(6))])
    case = make_case(forest, H_k=1, H_v=2, raw=True, seed=22)
    base = VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, fused_norms=True)
    on, off = _with_and_without(case, forest, base, "fp32_log_decay", precision="ieee")
    assert torch.equal(on[0], off[0]) and torch.equal(on[1].log_decay, off[1].log_decay)


def test_set_bits_in_padding_columns_change_nothing():
    """The kernel masks only the rows of the ancestor mask (so its loads vectorise): bits in the
    columns past a tree's size must not matter, as their keys, gates and betas are zero."""
    forest = PackedForest.pack([DraftTree.random(11, 4, np.random.default_rng(2)), DraftTree.chain(5)])
    case = make_case(forest, H_k=1, H_v=2, raw=True, seed=3)
    meta = forest.kernel_meta(DEVICE)
    o, f = run_kernel(case, forest, meta=meta)
    noisy = meta.ancestor_mask.clone()
    for r in range(forest.num_requests):
        lo, hi = int(forest.cu_nodes[r]), int(forest.cu_nodes[r + 1])
        noisy[lo:hi, hi - lo:] = 1
    o2, f2 = run_kernel(case, forest, meta=replace(meta, ancestor_mask=noisy))
    assert torch.equal(o, o2) and torch.equal(f.u, f2.u) and torch.equal(f.log_decay, f2.log_decay)


def test_chain_batch_layout_equals_recurrence():
    """B equal chains passed as [B, T, ...]: the ordinary recurrence, o in the input layout."""
    forest = PackedForest.from_parents(torch.arange(-1, 7).expand(2, 8))
    case = make_case(forest, H_k=2, H_v=2, seed=11)
    for n in ("q", "k", "v", "g", "beta"):
        case[n] = case[n].reshape(2, 8, *case[n].shape[2:])
    o, f = run_kernel(case, forest)
    assert o.shape == (2, 8, 2, 16)
    args = fp64_inputs(case)
    o_ser, u_ser, _ = tree_gdn_serial(args.pop("q"), args.pop("k"), args.pop("v"), forest, **args)
    assert rel_err(o, o_ser) < TOL
    assert rel_err(f.u, u_ser) < TOL


@pytest.mark.parametrize("raw,variant", [(False, "sweep"), (True, "sweep"), (True, "split_gram"),
                                         (True, "early_loads")])
def test_ragged_forest_grouped_pool_padding_and_commit(raw, variant):
    """3 ragged requests + padding, H_k=2 / H_v=4, d = 32 (two key and two value tiles), a
    permuted pool larger than R; the pool stays untouched and the factors commit exactly."""
    trees = [DraftTree.chain(5), DraftTree.full_kary(3, 2), DraftTree.random(9, 4, np.random.default_rng(0))]
    forest = padded(PackedForest.pack(trees), 32)
    case = make_case(forest, H_k=2, H_v=4, d_k=32, d_v=32, raw=raw, pool_slots=7, seed=5 + raw)
    pool_before = case["initial_state"].clone()
    pool_dev = case["initial_state"].to(DEVICE)
    case["initial_state"] = pool_dev
    o, f, o_ref, f_ref = check_against_closed_form(case, forest, config=VARIANTS[variant])
    case["initial_state"] = pool_dev.cpu()

    assert torch.equal(pool_dev.cpu(), pool_before), "the state pool must only be read"
    valid = forest.num_valid_nodes
    assert valid < forest.num_nodes
    assert not o[0, valid:].any() and not f.u[valid:].any() and not f.log_decay[valid:].any()
    assert f.k_inv_norm.shape == (forest.num_nodes, 2)
    assert f.k.shape == (forest.num_nodes, 2, 32)

    # the factors commit to the serial reference's state at every request's accepted node
    idx = case["state_indices"].long()
    args = fp64_inputs(case)
    _, _, states = tree_gdn_serial(args.pop("q"), args.pop("k"), args.pop("v"), forest,
                                   return_states=True, **args)
    for accepted in ([0, 0, 0], [4, 12, 8], [2, 7, 5]):
        new = commit_factored(f, pool_dev[idx.to(DEVICE)], forest, accepted)
        expect = states[forest.cu_nodes[:-1] + torch.tensor(accepted)]
        assert rel_err(new, expect) < TOL


def test_factors_k_is_raw_key_view():
    forest = PackedForest.pack([DraftTree.star(6)])
    case = make_case(forest, seed=2)
    k = case["k"].to(DEVICE)
    o, f = tree_gdn_verify_triton(case["q"].to(DEVICE), k, case["v"].to(DEVICE), forest.kernel_meta(DEVICE),
                                  g=case["g"].to(DEVICE), beta=case["beta"].to(DEVICE),
                                  initial_state=case["initial_state"].to(DEVICE),
                                  use_qk_l2norm_in_kernel=True, precision="ieee")
    assert f.k.data_ptr() == k.data_ptr() and f.k.shape == (6, 1, 16)
    assert f.k_inv_norm is not None
    _, f2 = tree_gdn_verify_triton(case["q"].to(DEVICE), k, case["v"].to(DEVICE), forest.kernel_meta(DEVICE),
                                   g=case["g"].to(DEVICE), beta=case["beta"].to(DEVICE),
                                   initial_state=case["initial_state"].to(DEVICE), precision="ieee")
    assert f2.k_inv_norm is None


def test_factors_out_are_written_in_place():
    """Slices of layer-stacked buffers receive exactly the factors the kernel would return."""
    from bole.ops.gdn.closed_form import TreeFactors
    forest = PackedForest.pack([DraftTree.star(5), DraftTree.chain(4)])
    case = make_case(forest, seed=3)
    args = (case["q"].to(DEVICE), case["k"].to(DEVICE), case["v"].to(DEVICE),
            forest.kernel_meta(DEVICE))
    kw = dict(g=case["g"].to(DEVICE), beta=case["beta"].to(DEVICE),
              initial_state=case["initial_state"].to(DEVICE), use_qk_l2norm_in_kernel=True,
              precision="ieee")
    o, want = tree_gdn_verify_triton(*args, **kw)
    N = forest.num_nodes
    store = TreeFactors(torch.full((3, N, 2), 7.0, dtype=torch.float64, device=DEVICE),
                        torch.empty(3, 0, device=DEVICE),
                        torch.full((3, N, 2, 16), 7.0, device=DEVICE),
                        torch.full((3, N, 1), 7.0, device=DEVICE))
    out = TreeFactors(store.log_decay[1], store.k[1], store.u[1], store.k_inv_norm[1])
    o2, got = tree_gdn_verify_triton(*args, **kw, factors_out=out)
    assert torch.equal(o2, o)
    for name in ("log_decay", "u", "k_inv_norm"):
        assert getattr(got, name).data_ptr() == getattr(out, name).data_ptr()
        assert torch.equal(getattr(got, name), getattr(want, name))
        for other in (0, 2):                               # the other layers' slices untouched
            assert bool((getattr(store, name)[other] == 7.0).all())
    bad = TreeFactors(out.log_decay, out.k, store.u[1].double(), out.k_inv_norm)
    with pytest.raises(ValueError, match="factors_out.u must be a contiguous"):
        tree_gdn_verify_triton(*args, **kw, factors_out=bad)
    bad = TreeFactors(out.log_decay, out.k, out.u, None)
    with pytest.raises(ValueError, match="factors_out.k_inv_norm"):
        tree_gdn_verify_triton(*args, **kw, factors_out=bad)


@pytest.mark.parametrize("seed", [21, 22])
def test_random_ragged_forests(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 17, size=3)
    trees = [DraftTree.random(int(n), int(rng.integers(1, 6)), rng) for n in sizes]
    forest = padded(PackedForest.pack(trees), int(sizes.sum()) + int(rng.integers(0, 5)))
    case = make_case(forest, H_k=1, H_v=2, raw=bool(seed % 2), l2norm=bool(seed % 2), seed=seed)
    check_against_closed_form(case, forest)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_extreme_gates(variant):
    """g near 0 and -20 (deep paths underflow e^L), beta near 0 and 1, for g/beta and raw gates."""
    kw = {"config": VARIANTS[variant]} if VARIANTS[variant] else {}
    forest = PackedForest.pack([DraftTree.chain(16), DraftTree.random(12, 4, np.random.default_rng(1))])
    N, H_v = forest.num_nodes, 2
    case = make_case(forest, H_v=H_v, seed=9)
    g_vals = torch.tensor([-1e-7, -20.0, -1e-3, -20.0, -3.0])
    b_vals = torch.tensor([1e-6, 1 - 1e-6, 0.5, 1.0, 1e-6, 1 - 1e-6, 0.3])
    case["g"] = g_vals[torch.arange(N * H_v) % 5].reshape(1, N, H_v)
    case["beta"] = b_vals[torch.arange(N * H_v) % 7].reshape(1, N, H_v)
    check_against_closed_form(case, forest, **kw)

    # fp32 gates against fp64 ones on paths with L ~ -250: L_i - L_j loses ~ulp(250) ~ 2e-5
    raw = make_case(forest, H_v=H_v, raw=True, seed=10)
    a_vals = torch.tensor([30.0, -30.0, 0.0, 25.0, -80.0])
    b_vals = torch.tensor([-30.0, 30.0, 0.0, 14.0, -14.0, 100.0, -100.0])
    raw["a"] = a_vals[torch.arange(N * H_v) % 5].reshape(1, N, H_v)
    raw["b"] = b_vals[torch.arange(N * H_v) % 7].reshape(1, N, H_v)
    raw["A_log"] = torch.tensor([-4.0, 0.5])
    raw["dt_bias"] = torch.tensor([0.0, -2.0])
    check_against_closed_form(raw, forest, tol=3e-5, **kw)


@pytest.mark.parametrize("d_k,d_v", [(24, 20), (32, 20), (24, 32)])
def test_edge_shapes(d_k, d_v):
    """Lone roots (depth 0), a 32-node chain (BT = 32, 31 sweeps), head dims that are not multiples
    of the 16-wide tiles (each of d_k, d_v alone: the loads drop column masks where the tiles
    divide), and a meta with a wider tile than the trees need."""
    forest = padded(PackedForest.pack([DraftTree.chain(1), DraftTree.chain(32), DraftTree.star(1)]), 37)
    case = make_case(forest, H_k=1, H_v=2, d_k=d_k, d_v=d_v, raw=True, l2norm=True, seed=15)
    check_against_closed_form(case, forest)
    check_against_closed_form(case, forest, meta=forest.kernel_meta(DEVICE, block_nodes=64))

    lone = PackedForest.pack([DraftTree.chain(1)])
    check_against_closed_form(make_case(lone, seed=16, l2norm=False), lone)


def test_fp16_inputs():
    forest = padded(PackedForest.pack([DraftTree.full_kary(2, 2), DraftTree.chain(6)]), 16)
    case = make_case(forest, H_k=1, H_v=2, d_k=32, d_v=16, raw=True, dtype=torch.float16, seed=4)
    # o is rounded to fp16 on output; everything else is fp32 from exact fp16 inputs
    check_against_closed_form(case, forest, o_tol=2e-3)


def test_fp32_output_from_fp16_inputs():
    """out_dtype=fp32: o keeps the kernel's fp32 accuracy instead of fp16's output rounding."""
    forest = padded(PackedForest.pack([DraftTree.full_kary(2, 2), DraftTree.chain(6)]), 16)
    case = make_case(forest, H_k=1, H_v=2, d_k=32, d_v=16, raw=True, dtype=torch.float16, seed=4)
    o16, _ = run_kernel(case, forest)
    o32, f = run_kernel(case, forest, out_dtype=torch.float32)
    o_ref, f_ref = run_reference(case, forest)
    assert o16.dtype == torch.float16 and o32.dtype == torch.float32
    assert rel_err(o32, o_ref) < TOL < rel_err(o16, o_ref)
    assert torch.equal(o32.to(torch.float16), o16)
    with pytest.raises(TypeError, match="out_dtype"):
        run_kernel(case, forest, out_dtype=torch.int32)


def test_strided_views_of_a_fused_projection():
    """q, k, v as column slices of one [1, N, channels] tensor, g / beta as slices too: no copies."""
    forest = PackedForest.pack([DraftTree.full_kary(3, 2)])
    N, H_k, H_v, d = forest.num_nodes, 1, 2, 16
    gen = torch.Generator().manual_seed(8)
    fused = torch.randn(1, N, 2 * H_k * d + H_v * d + 2 * H_v, generator=gen).to(DEVICE)
    q = fused[..., :H_k * d].unflatten(-1, (H_k, d))
    k = fused[..., H_k * d: 2 * H_k * d].unflatten(-1, (H_k, d))
    v = fused[..., 2 * H_k * d: 2 * H_k * d + H_v * d].unflatten(-1, (H_v, d))
    a = fused[..., -2 * H_v: -H_v]
    b = fused[..., -H_v:]
    assert not q.is_contiguous() and not a.is_contiguous()
    case = dict(q=q, k=k, v=v, a=a, b=b, A_log=torch.randn(H_v, generator=gen).to(DEVICE),
                dt_bias=torch.randn(H_v, generator=gen).to(DEVICE),
                initial_state=torch.randn(1, H_v, d, d, generator=gen).to(DEVICE),
                use_qk_l2norm_in_kernel=True)
    o, f = run_kernel(case, forest)
    assert f.k.data_ptr() == k.data_ptr()
    o_ref, f_ref = run_reference({n: (t.cpu() if isinstance(t, torch.Tensor) else t)
                                  for n, t in case.items()}, forest)
    assert rel_err(o, o_ref) < TOL and rel_err(f.u, f_ref.u) < TOL


def test_config_override_and_default_state_indices():
    forest = padded(PackedForest.pack([DraftTree.random(14, 4, np.random.default_rng(7))]), 20)
    case = make_case(forest, d_k=32, d_v=32, raw=True, seed=12)
    o1, f1 = run_kernel(case, forest)                          # default config, default slots
    o2, f2 = run_kernel(case, forest, config=VerifyConfig(BV=32, BK=32, num_warps=2, num_stages=1))
    o_ref, f_ref = run_reference(case, forest)
    for o, f in ((o1, f1), (o2, f2)):
        assert rel_err(o, o_ref) < TOL and rel_err(f.u, f_ref.u) < TOL


def test_tf32_precision_runs():
    """"tf32" is the fast default: exact under the interpreter, ~1e-3 per product on the GPU."""
    forest = PackedForest.pack([DraftTree.full_kary(2, 3)])
    case = make_case(forest, seed=13)
    check_against_closed_form(case, forest, precision="tf32", **tf32_tols())


def test_bf16_inputs():
    forest = padded(PackedForest.pack([DraftTree.full_kary(2, 3), DraftTree.chain(12)]), 40)
    case = make_case(forest, H_k=2, H_v=4, d_k=64, d_v=64, raw=True, dtype=torch.bfloat16,
                     pool_slots=5, seed=14)
    # O is written in bf16 (its rounding: 3.8e-3); U, L and the keys keep fp32 accuracy
    check_against_closed_form(case, forest, tol=1e-2, precision="ieee")
    check_against_closed_form(case, forest, precision="tf32", **tf32_tols(1e-2))


#: the split-product paths of bf16 inputs, at tiles small enough for the interpreter
BF16_PATHS = {
    "bf16_state": dict(bf16_state=True),
    "cu_bf16x3": dict(cu_bf16x3=True),
    "table-like": dict(bf16_state=True, cu_bf16x3=True, fused_norms=True, fp16_sweeps=True,
                       prefetch_tiles=True, defer_gates=True),
    # batch 1's launch at BT = 64 (its decays in the d_k loop's last step, here the only one; the
    # path sums in fp32)
    "batch-1-like": dict(bf16_state=True, cu_bf16x3=True, fused_norms=True, fp16_sweeps=True,
                         prefetch_tiles=True, early_decay=True, decay_in_loop=True,
                         decay_last_step=True, fp32_log_decay=True),
}


@pytest.mark.parametrize("path", sorted(BF16_PATHS))
def test_bf16_paths(path):
    """bf16 inputs through the split products, on the CPU too (``_dot`` widens bf16 operands under
    the interpreter, whose bf16 products are wrong). Each path must be taken (O differs from the
    plain tf32 launch's) and stay within its rounding: 2^-17 per split operand, fp16's 2^-11 on
    the sweeps' corrections (interpreter: 7e-6 to 5e-5). Compiled, the plain products are tf32
    (O ~1e-3), so the bound is checked where every product is split."""
    forest = PackedForest.pack([DraftTree.random(20, 5, np.random.default_rng(7)), DraftTree.chain(9)])
    case = make_case(forest, H_k=1, H_v=2, raw=True, seed=50, dtype=torch.bfloat16)
    o_ref, f_ref = run_reference(case, forest)
    base = VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1)
    o, f = run_kernel(case, forest, precision="tf32", config=replace(base, **BF16_PATHS[path]),
                      out_dtype=torch.float32)
    o0, _ = run_kernel(case, forest, precision="tf32", config=base, out_dtype=torch.float32)
    assert not torch.equal(o, o0)
    if _interpreting() or path == "table-like":
        assert rel_err(o, o_ref) < 2e-4 and rel_err(f.u, f_ref.u) < 2e-4
    assert rel_err(f.log_decay, f_ref.log_decay) < TOL


@pytest.mark.skipif(not HAS_CUDA, reason="compares against tf32's rounding, which the interpreter does not emulate")
def test_bf16_state_products_cuda():
    """bf16_state: K S_pre and Q S_pre as two bf16 products of S = S_hi + S_lo (16 mantissa bits)
    against tf32 products (10 bits); ignored unless the inputs are bf16 and the precision tf32."""
    forest = PackedForest.pack([DraftTree.random(60, 8, np.random.default_rng(5)),
                                DraftTree.chain(9)])
    configs = {b: VerifyConfig(BV=64, BK=32, num_warps=4, num_stages=3, bf16_state=b)
               for b in (False, True)}
    # beta = 0: U = 0 and O = e^L Q S_pre alone, so O's error is the state product's rounding
    case = make_case(forest, H_k=2, H_v=4, d_k=128, d_v=128, dtype=torch.bfloat16, pool_slots=3,
                     seed=21)
    case["beta"] = torch.zeros_like(case["beta"])
    o_ref, _ = run_reference(case, forest)
    err = {b: rel_err(run_kernel(case, forest, precision="tf32", config=c,
                                 out_dtype=torch.float32)[0], o_ref) for b, c in configs.items()}
    assert err[True] < 2e-5 and err[True] < 0.25 * err[False], err
    # the whole kernel (raw gates): no worse than with tf32 state products, which C U's tf32
    # rounding dominates (bench/NOTES.md)
    case = make_case(forest, H_k=2, H_v=4, d_k=128, d_v=128, raw=True, dtype=torch.bfloat16,
                     pool_slots=3, seed=22)
    o_ref, f_ref = run_reference(case, forest)
    errs = {}
    for b, c in configs.items():
        o, f = run_kernel(case, forest, precision="tf32", config=c, out_dtype=torch.float32)
        errs[b] = (rel_err(o, o_ref), rel_err(f.u, f_ref.u))
        assert rel_err(f.log_decay, f_ref.log_decay) < TOL
    assert all(errs[True][i] <= 1.1 * errs[False][i] + 1e-6 for i in (0, 1)), errs
    # fp16 inputs: the option does not apply, results equal the plain launch's
    case16 = make_case(forest, H_k=2, H_v=4, d_k=128, d_v=128, raw=True, dtype=torch.float16,
                       pool_slots=3, seed=21)
    outs = [run_kernel(case16, forest, precision="tf32", config=c)[0] for c in configs.values()]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not HAS_CUDA, reason="compares against tf32's rounding, which the interpreter does not emulate")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_product_in_three_bf16_products_cuda(dtype):
    """cu_bf16x3: C U as three bf16 products of hi/lo halves. The tensor cores truncate fp32
    operands to tf32, and in C U that set O's error (bench/tuning/precision_model.py emulates 7.5e-4
    against 1.5e-5); with fp32 output O must now be far closer to fp64, and U unchanged."""
    forest = PackedForest.pack([DraftTree.random(60, 8, np.random.default_rng(6)),
                                DraftTree.chain(9)])
    case = make_case(forest, H_k=2, H_v=4, d_k=128, d_v=128, raw=True, dtype=dtype,
                     pool_slots=3, seed=23)
    o_ref, f_ref = run_reference(case, forest)
    res = {}
    for cu in (False, True):
        cfg = VerifyConfig(BV=64, BK=32, num_warps=4, num_stages=3, bf16_state=True, cu_bf16x3=cu)
        o, f = run_kernel(case, forest, precision="tf32", config=cfg, out_dtype=torch.float32)
        res[cu] = (rel_err(o, o_ref), f.u)
    # bf16 inputs: the state products are bf16 too (bf16_state), so C U was the last tf32 product
    # (H200: 5.7e-4 -> 5.3e-5 in this max-norm measure); fp16 inputs keep tf32 state products,
    # which then lead (7.7e-4 -> 5.0e-4)
    bound, ratio = (1e-4, 0.2) if dtype == torch.bfloat16 else (1e-3, 0.9)
    assert res[True][0] < bound and res[True][0] < ratio * res[False][0], (res[True][0], res[False][0])
    assert rel_err(res[True][1], res[False][1]) < 1e-6      # U does not depend on the option
    # the table's launch has it
    assert all(c.cu_bf16x3 for c in CONFIG_TABLE.values())


#: on a GPU the other tf32 products are split too (bf16 inputs), so that the sweeps' rounding is
#: what the bounds below see (tf32's truncation in C U alone gives ~1e-3 in the max norm)
F16_SWEEPS = VerifyConfig(BV=16, BK=16, num_warps=4, num_stages=1, fp16_sweeps=True,
                          bf16_state=HAS_CUDA, cu_bf16x3=HAS_CUDA)


@pytest.mark.parametrize("shape", sorted(TREES))
def test_fp16_sweeps_against_the_closed_form(shape):
    """fp16_sweeps: G U in fp16 (R scaled by a power of two), fp32 accumulation. The path must be
    taken (U differs from the tf32 sweeps') and stay within fp16's rounding of the fp64 result."""
    forest = PackedForest.pack([TREES[shape](), DraftTree.chain(12)])
    case = make_case(forest, H_k=1, H_v=2, raw=True, seed=40 + len(shape),
                     dtype=torch.bfloat16 if HAS_CUDA else torch.float32)
    (o, f), (o32, f32) = _with_and_without(case, forest, F16_SWEEPS, "fp16_sweeps",
                                           out_dtype=torch.float32)
    o_ref, f_ref = run_reference(case, forest)
    assert not torch.equal(f.u, f32.u)
    # interpreter, fp32 inputs: 4e-5 to 1e-4 (fp16's 2^-11 on the corrections G U)
    errs = [rel_err(x, ref) for x, ref in ((f.u, f_ref.u), (o, o_ref), (f32.u, f_ref.u), (o32, o_ref))]
    assert errs[0] < 1e-3 and errs[1] < 1e-3, errs
    assert rel_err(f.log_decay, f_ref.log_decay) < TOL


def test_fp16_sweeps_at_the_growth_bound():
    """The worst case for fp16's range: a depth-15 chain with parallel keys, beta ~ 1 and decays
    ~ 1, so |G_ij| ~ 1 and the Neumann iterates grow binomially (to ~2^13 max |R|) before they
    cancel. They must stay finite and U as accurate as with tf32 sweeps."""
    forest = PackedForest.pack([DraftTree.chain(16)])
    case = make_case(forest, H_k=1, H_v=2, raw=True, seed=44)
    case["k"] = case["k"][:, :1] + 1e-3 * case["k"]              # parallel keys
    case["a"] = torch.full_like(case["a"], -30.0)                  # g ~ -1e-13: decays ~ 1
    case["b"] = torch.full_like(case["b"], 30.0)                   # beta ~ 1
    (o, f), (_, f32) = _with_and_without(case, forest, F16_SWEEPS, "fp16_sweeps",
                                         out_dtype=torch.float32)
    o_ref, f_ref = run_reference(case, forest)
    assert torch.isfinite(f.u).all() and not torch.equal(f.u, f32.u)
    # interpreter: U 2.1e-4, O 6.6e-4
    assert rel_err(f.u, f_ref.u) < 2e-3 and rel_err(o, o_ref) < 2e-3


@pytest.mark.parametrize("shape", sorted(TREES))
def test_transposed_fp16_sweeps(shape):
    """The fp16 sweeps on the transposed system: the same fp16 operands and fp32 sums in another
    order, so within fp32 rounding of the plain form's U and O."""
    forest = PackedForest.pack([TREES[shape](), DraftTree.chain(12)])
    case = make_case(forest, H_k=1, H_v=2, raw=True, seed=60 + len(shape),
                     dtype=torch.bfloat16 if HAS_CUDA else torch.float32)
    config = replace(F16_SWEEPS, num_warps=1)
    (o, f), (o0, f0) = _with_and_without(case, forest, config, "transposed_sweeps",
                                         out_dtype=torch.float32)
    assert rel_err(f.u, f0.u) < 1e-5 and rel_err(o, o0) < 1e-5


def test_transposed_sweeps_where_they_apply():
    """The transposed form only where U^T's rows fill the warpgroups' tiles (BV >= 16 per warp)
    and the sweeps are fp16 (the form verified compiled on the H200)."""
    from bole.ops.gdn.verify.kernel import kernel_switches
    kw = dict(dtype=torch.bfloat16, precision="tf32", raw_gates=True, l2norm=True, max_depth=8,
              interpret=False, d_k=128)

    def on(bv, w, **cfg):
        config = VerifyConfig(BV=bv, BK=32, num_warps=w, transposed_sweeps=True, **cfg)
        return kernel_switches(config, **kw)["T_SWEEPS"]

    assert {(bv, w): on(bv, w, fp16_sweeps=True) for bv in (32, 64, 128) for w in (4, 8)} == {
        (32, 4): False, (64, 4): True, (128, 4): True, (32, 8): False, (64, 8): False,
        (128, 8): True}
    assert not on(128, 8) and not on(64, 4)                          # tf32 sweeps
    assert not kernel_switches(VerifyConfig(BV=128, BK=32, fp16_sweeps=True), **kw)["T_SWEEPS"]
    kw["max_depth"] = 16                                             # past fp16's bound
    assert not on(64, 4, fp16_sweeps=True)


#: whole_head on its own and with the table's switches (fp16 sweeps, transposed, split products)
WHOLE_HEAD = {
    "plain": VerifyConfig(BV=16, BK=16, num_warps=1, num_stages=1, whole_head=True),
    "table-like": VerifyConfig(BV=16, BK=16, num_warps=1, num_stages=1, whole_head=True,
                               bf16_state=True, cu_bf16x3=True, fused_norms=True,
                               fp16_sweeps=True, prefetch_tiles=True, transposed_sweeps=True),
}


@pytest.mark.parametrize("variant", sorted(WHOLE_HEAD))
@pytest.mark.parametrize("d_v", [40, 64])
def test_whole_head(variant, d_v):
    """One program per head taking its value tiles in turn (three, the last part-masked, at
    d_v = 40; four at 64): every tile's O and U as with one program per tile, padding rows
    included, and within the kernel's rounding of the fp64 result."""
    forest = padded(PackedForest.pack([DraftTree.random(20, 5, np.random.default_rng(9)),
                                DraftTree.chain(9), DraftTree.star(6)]), 48)
    bf16 = variant == "table-like"
    case = make_case(forest, H_k=1, H_v=2, d_v=d_v, raw=True, pool_slots=4, seed=70 + d_v,
                     dtype=torch.bfloat16 if bf16 else torch.float32)
    precision = "tf32" if bf16 else "ieee"
    (o, f), (o0, f0) = _with_and_without(case, forest, WHOLE_HEAD[variant], "whole_head",
                                         precision=precision, out_dtype=torch.float32)
    assert rel_err(o, o0) < 1e-6 and rel_err(f.u, f0.u) < 1e-6
    assert torch.equal(f.log_decay, f0.log_decay)
    assert torch.equal(f.k_inv_norm, f0.k_inv_norm)
    o_ref, f_ref = run_reference(case, forest)
    tol = 2e-4 if bf16 else TOL
    assert rel_err(o, o_ref) < tol and rel_err(f.u, f_ref.u) < tol


def test_known_miscompile_is_refused():
    """The launch Triton 3.6 miscompiled on the H200 (BT 64, BV 128, 8 warps, 3 stages, 16-bit
    inputs, unsplit tf32 state products) is refused with what to do; its neighbours are not."""
    from bole.ops.gdn.verify.kernel import _refuse_known_miscompile, kernel_switches
    bad = VerifyConfig(BV=128, BK=32, num_warps=8, num_stages=3)

    def check(config, block_nodes=64, dtype=torch.bfloat16, precision="tf32"):
        switches = kernel_switches(config, dtype=dtype, precision=precision, raw_gates=True,
                                   l2norm=True, max_depth=8, interpret=False, d_k=128)
        _refuse_known_miscompile(config, switches, block_nodes, dtype, precision)

    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match="num_stages=2"):
            check(bad, dtype=dtype)
    for fine in (dict(config=replace(bad, num_stages=2)), dict(config=replace(bad, BV=64)),
                 dict(config=replace(bad, bf16_state=True)), dict(config=bad, block_nodes=128),
                 dict(config=bad, dtype=torch.float32), dict(config=bad, precision="ieee")):
        check(**fine)


@pytest.mark.parametrize("what", ["deeper than 15", "loaded gates", "no l2 norm", "ieee"])
def test_fp16_sweeps_only_where_safe(what):
    """Outside its overflow bound the option is ignored: bit-for-bit the tf32 sweeps' results."""
    forest = PackedForest.pack([DraftTree.chain(17 if what == "deeper than 15" else 9)])
    case = make_case(forest, H_k=1, H_v=2, raw=what != "loaded gates",
                     l2norm=what != "no l2 norm", seed=45)
    on, off = _with_and_without(case, forest, F16_SWEEPS, "fp16_sweeps",
                                precision="ieee" if what == "ieee" else "tf32")
    assert torch.equal(on[0], off[0]) and torch.equal(on[1].u, off[1].u)


#: launches compiled on a GPU besides each CONFIG_TABLE entry and pick_config's choice
GPU_VARIANTS = (VerifyConfig(BV=32, BK=32), VerifyConfig(BV=64, BK=32),
                VerifyConfig(BV=32, BK=32, num_stages=3, bf16_state=True),
                VerifyConfig(BV=16, BK=32, num_stages=3),
                VerifyConfig(BV=64, BK=32, num_stages=3, bf16_state=True, cu_bf16x3=True,
                             fused_norms=True),
                VerifyConfig(BV=32, BK=32, num_stages=3, bf16_state=True, cu_bf16x3=True,
                             fused_norms=True, fp16_sweeps=True),
                VerifyConfig(BV=64, BK=32, num_stages=3, bf16_state=True, cu_bf16x3=True,
                             fused_norms=True, fp16_sweeps=True, prefetch_tiles=True),
                VerifyConfig(BV=64, BK=32, num_stages=3, bf16_state=True, cu_bf16x3=True,
                             fused_norms=True, fp16_sweeps=True, prefetch_tiles=True,
                             transposed_sweeps=True),
                VerifyConfig(BV=128, BK=32, num_warps=8, num_stages=3, bf16_state=True,
                             cu_bf16x3=True, fused_norms=True, fp16_sweeps=True,
                             prefetch_tiles=True, transposed_sweeps=True),
                VerifyConfig(BV=64, BK=32, num_stages=3, bf16_state=True, cu_bf16x3=True,
                             fused_norms=True, fp16_sweeps=True, prefetch_tiles=True,
                             transposed_sweeps=True, whole_head=True),
                VerifyConfig(BV=64, BK=32, num_stages=3, bf16_state=True, cu_bf16x3=True,
                             fused_norms=True, fp16_sweeps=True, prefetch_tiles=True,
                             transposed_sweeps=True, early_decay=True, decay_in_loop=True,
                             decay_last_step=True, fp32_log_decay=True),
                VerifyConfig(BV=32, BK=32, num_stages=2, whole_head=True),
                VerifyConfig(BV=32, BK=64, num_warps=8),
                VerifyConfig(BV=64, BK=32, num_warps=8, maxnreg=128))


@pytest.mark.skipif(not HAS_CUDA, reason="compiled table configurations need a GPU")
@pytest.mark.parametrize("config", ["table", "picked", *GPU_VARIANTS], ids=str)
@pytest.mark.parametrize("nodes", [12, 30, 60, 120, 129])
def test_table_configs_cuda(nodes, config):
    """Every CONFIG_TABLE entry, pick_config's choice and a few variants compile and are correct
    at the real head dims (d = 128, bf16)."""
    rng = np.random.default_rng(nodes)
    forest = PackedForest.pack([DraftTree.random(nodes, 8, rng), DraftTree.chain(min(nodes, 9))])
    case = make_case(forest, H_k=2, H_v=4, d_k=128, d_v=128, raw=True, dtype=torch.bfloat16,
                     pool_slots=3, seed=nodes)
    block = forest.kernel_meta().block_nodes
    variant = not isinstance(config, str)
    config = {"table": CONFIG_TABLE[block], "picked": None}.get(config, config)
    if block >= 256 and variant:
        # at BT = 256 a variant meant for smaller trees may not fit: a register cap too low for
        # ptxas (Triton 3.6 needs >= 154 for one wgmma accumulator) or more shared memory than
        # the GPU has (BV 64, 3 stages, no split_gram: 254 KB on the H200). Then the wrapper must
        # say so, not pass on Triton's error
        try:
            run_kernel(case, forest, precision="tf32", config=config)
        except ValueError as exc:
            assert "raise maxnreg" in str(exc) or "does not fit this GPU" in str(exc), exc
            return
    o, f, _, _ = check_against_closed_form(case, forest, tol=1e-2, u_tol=1e-2, precision="tf32",
                                           config=config)
    # a race in compiled code shows as results that change from run to run (bench/NOTES.md)
    for _ in range(3):
        o2, f2 = run_kernel(case, forest, precision="tf32", config=config)
        assert torch.equal(o2, o) and torch.equal(f2.u, f.u), "repeated runs differ"


# ---------------------------------------------------------------------------------------------
# validation and configuration
# ---------------------------------------------------------------------------------------------

def _valid_args():
    forest = PackedForest.pack([DraftTree.chain(3), DraftTree.star(4)])
    case = make_case(forest, H_k=1, H_v=2, seed=1)
    args = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
    return forest, args


def _call(forest, args, meta=None, **over):
    a = dict(args, **over)
    q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
    return tree_gdn_verify_triton(q, k, v, meta or forest.kernel_meta(DEVICE), **a)


def test_malformed_inputs_raise():
    forest, args = _valid_args()
    with pytest.raises(TypeError, match="share one dtype"):
        _call(forest, args, k=args["k"].half())
    with pytest.raises(TypeError, match="fp64"):
        _call(forest, args, q=args["q"].double(), k=args["k"].double(), v=args["v"].double())
    with pytest.raises(TypeError, match="fp32 pool"):
        _call(forest, args, initial_state=args["initial_state"].double())
    with pytest.raises(ValueError, match="state pool"):
        _call(forest, args, initial_state=args["initial_state"][:, :, :8])
    with pytest.raises(ValueError, match="state_indices"):
        _call(forest, args, initial_state=torch.cat([args["initial_state"]] * 2))
    with pytest.raises(ValueError, match="one slot per request"):
        _call(forest, args, state_indices=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="state_indices"):
        _call(forest, args, state_indices=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="precision"):
        _call(forest, args, precision="bf16")
    with pytest.raises(ValueError, match="nodes but the forest"):
        _call(forest, args, meta=PackedForest.pack([DraftTree.chain(8)]).kernel_meta(DEVICE))
    with pytest.raises(TypeError, match="ForestMeta"):
        _call(forest, args, meta=forest)
    with pytest.raises(ValueError, match="power of two"):
        _call(forest, args, config=VerifyConfig(BV=8, BK=16))
    with pytest.raises(ValueError, match="maxnreg"):
        _call(forest, args, config=VerifyConfig(BV=16, BK=16, maxnreg=300))
    with pytest.raises(ValueError, match="g and beta"):
        _call(forest, args, g=None)
    with pytest.raises(ValueError, match="H_v"):
        _call(forest, args, beta=args["beta"][..., :1])
    # value checks only with check_values=True
    with pytest.raises(ValueError, match="log-decay"):
        _call(forest, args, g=-args["g"], check_values=True)
    with pytest.raises(ValueError, match="NaN"):
        _call(forest, args, v=args["v"].clone().fill_(float("nan")), check_values=True)
    with pytest.raises(ValueError, match="must lie in"):
        _call(forest, args, state_indices=torch.tensor([0, 2], dtype=torch.int32, device=DEVICE),
              check_values=True)


def test_ptxas_failure_under_register_cap_is_a_clear_error(monkeypatch):
    """A ptxas failure of a launch with ``maxnreg`` becomes a ValueError that names the cap (Triton
    3.6 cannot fit BT = 256 in 128 registers); without a cap the error passes through unchanged."""
    from bole.ops.gdn.verify import kernel as tv

    class FailingLaunch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise tv.PTXASError("Internal Triton PTX codegen error\n`ptxas` stderr:\n"
                                    "ptxas fatal   : (C7602) Insufficient registers (128)\n")
            return launch

    forest, args = _valid_args()
    monkeypatch.setattr(tv, "_tree_gdn_verify_kernel", FailingLaunch())
    with pytest.raises(ValueError, match=r"maxnreg=128; raise maxnreg.*Insufficient registers"):
        _call(forest, args, config=VerifyConfig(BV=16, BK=16, maxnreg=128))
    with pytest.raises(tv.PTXASError):
        _call(forest, args, config=VerifyConfig(BV=16, BK=16))


def test_launch_too_large_for_the_gpu_is_a_clear_error(monkeypatch):
    """A launch that needs more shared memory than the GPU has (on the H200: BV 64, 3 stages and
    no split_gram at BT = 256) becomes a ValueError that says what to change, raised before
    anything is written."""
    from bole.ops.gdn.verify import kernel as tv

    class FailingLaunch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise tv.OutOfResources(253952, 232448, "shared memory")
            return launch

    forest, args = _valid_args()
    pool = args["initial_state"].clone()
    monkeypatch.setattr(tv, "_tree_gdn_verify_kernel", FailingLaunch())
    with pytest.raises(ValueError, match=r"does not fit this GPU.*shared memory, Required: 253952"
                                         r".*fewer num_stages"):
        _call(forest, args, config=VerifyConfig(BV=16, BK=16, num_stages=3))
    assert torch.equal(args["initial_state"], pool)


def test_cpu_tensors_without_the_interpreter_are_a_clear_error(monkeypatch):
    """Compiled (no TRITON_INTERPRET), the kernels take CUDA tensors only: CPU tensors get a
    ValueError that says what to do, not Triton's "Pointer argument (at 0)" from the launcher."""
    from bole.ops.gdn.verify import kernel as tv
    from bole.ops.triton_utils import check_kernel_device
    with pytest.raises(ValueError, match=r"on cpu, but the compiled Triton kernels need CUDA.*"
                                         r"TRITON_INTERPRET=1"):
        check_kernel_device("cpu", "x", interpret=False)
    check_kernel_device("cpu", "x", interpret=True)
    if HAS_CUDA:
        check_kernel_device("cuda", "x", interpret=False)
        return
    forest, args = _valid_args()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="tree_gdn_verify_triton got tensors on cpu"):
        _call(forest, args)
    monkeypatch.setattr(tv, "_tree_gdn_verify_kernel", None)       # never reached
    with pytest.raises(ValueError, match=r"gdn_backend='triton' got tensors on cpu"):
        from bole.models.presets import preset_config
        from bole.models.qwen3_hybrid import HybridModel
        HybridModel.random(preset_config("tiny"), dtype=torch.float32, gdn_backend="triton")


def test_pick_config():
    assert pick_config(32, 16, 16, 8, interpret=True) == INTERPRET_CONFIG
    for bt in (16, 32, 64, 128, 256, 512):
        for programs in (1, 32, 2048):
            c = pick_config(bt, 128, 128, programs, interpret=False)
            c.validate()
            assert c.BV <= 128 and c.BK <= 128 and c.num_warps <= 8
            key = min((kb for kb in CONFIG_TABLE if kb >= bt), default=max(CONFIG_TABLE))
            base = CONFIG_TABLE[key]
            narrow = NARROW_TILE.get(key, {}) if c.BV == 32 else {}
            assert c.BK == narrow.get("BK", base.BK) and c.split_gram == base.split_gram
            assert c.bf16_state == narrow.get("bf16_state", base.bf16_state)
            assert c.num_stages == base.num_stages
            if programs >= 2048:
                assert c.BV == base.BV
    # measured on the H200: at BT = 64, BV 32 at batch 1 (32 heads), 64 with 4 warps from batch 4;
    # at BT = 32, BV 128 with 4 warps at batch 4
    assert pick_config(64, 128, 128, 32, interpret=False).BV == 32
    assert pick_config(64, 128, 128, 128, interpret=False).BV == 64
    assert pick_config(64, 128, 128, 512, interpret=False).BV == 64
    assert pick_config(64, 128, 128, 128, interpret=False).num_warps == 4
    assert pick_config(32, 128, 128, 128, interpret=False).BV == 128
    assert pick_config(32, 128, 128, 128, interpret=False).num_warps == 4
    # whole_head where the wave model expects it to pay, at every Qwen3.5-9B batch measured at
    # T = 64 (32 value heads): slower at 4 and 12, faster at 6, 8, 16 and 64
    whole = {b: pick_config(64, 128, 128, 32 * b, interpret=False).whole_head
             for b in (1, 4, 6, 8, 12, 16, 64)}
    assert whole == {1: False, 4: False, 6: True, 8: True, 12: False, 16: True, 64: True}
    assert not pick_config(128, 128, 128, 2048, interpret=False).whole_head      # one tile
    # early_decay at BT = 64; at batch 1's BV 32 formed in the d_k loop's last step (BK 64: two
    # steps), at BV 64 before the loop (in it, it spills); at BT = 32 in the loop's first step at
    # every batch, at BT = 16 only for batch 1 (in the last step); fp32 path sums where the
    # decays are fused (BT >= 32, and batch 1 at BT = 16)
    picks = {(bt, b): pick_config(bt, 128, 128, 32 * b, interpret=False)
             for bt in (16, 32, 64) for b in (1, 4, 16)}
    # at batch 2 (64 heads, 128 programs of BV 64: one per SM) the decays in the last step too
    picks.update({(64, b): pick_config(64, 128, 128, 32 * b, interpret=False) for b in (2, 3)})
    assert {k: (c.BV, c.BK, c.early_decay, c.decay_in_loop, c.decay_last_step, c.fp32_log_decay)
            for k, c in picks.items()} == {
        (64, 1): (32, 64, True, True, True, True), (64, 4): (64, 32, True, False, False, True),
        (64, 16): (64, 32, True, False, False, True), (64, 2): (64, 32, True, True, True, True),
        (64, 3): (64, 32, True, False, False, True),
        (32, 1): (32, 32, True, True, False, True), (32, 4): (128, 32, True, True, False, True),
        (32, 16): (128, 32, True, True, False, True),
        (16, 1): (32, 64, True, True, True, True), (16, 4): (128, 32, False, False, False, False),
        (16, 16): (128, 32, False, False, False, False)}
    assert pick_config(64, 16, 128, 32, interpret=False).BK == 16       # never past d_k
    # tiny heads: tiles never exceed the (power-of-two padded) head dims
    c = pick_config(16, 16, 16, 4096, interpret=False)
    assert c.BV == 16 and c.BK == 16

def test_narrow_tile_decays_in_loop_need_two_d_k_steps():
    """The narrow-tile launches that form the decays inside the d_k loop keep the loop at two
    steps or more: at head size 64 the single-step launch (BT 64, BK 64) read out of bounds on
    the H200 (chains of 33+ nodes, the bundled model's prefill without fla)."""
    for block in (16, 64):
        for d in (32, 64, 128):
            cfg = pick_config(block, d, d, 4, interpret=False)
            if cfg.BV == 32 and cfg.decay_in_loop:
                assert cfg.BK < d, (block, d, cfg)
    assert pick_config(64, 128, 128, 32, interpret=False).BK == 64     # 9B batch 1 unchanged
