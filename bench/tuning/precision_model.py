"""Where the verification kernel's error against fp64 comes from, by emulation on the CPU.

Recomputes the closed form in fp64 on bench/harness.py's inputs (Qwen3.5-9B shapes, T = 64, depth 8,
bf16 q/k/v, raw gates, in-kernel l2 norm), rounding the operands of one group of products at a
time as the kernel's tensor-core products do: tf32 (10 mantissa bits; round to nearest or
truncated), three tf32 products (Triton's "tf32x3"), three bf16 products of hi/lo halves
(``VerifyConfig.cu_bf16x3``), fp16 with a power-of-two scaling (``VerifyConfig.fp16_sweeps``)
or the bf16 split ``S = S_hi + S_lo`` of ``VerifyConfig.bf16_state``.
The groups are the state products (``K S_pre``, ``Q S_pre``), the Neumann sweeps (``G U``) and
``C U``; q and k are exact in both formats. Prints the relative error of O (Frobenius, as
bench/harness.py's ``rel_err``) per variant. No GPU needed.

    python bench/tuning/precision_model.py [--batch 1] [--nodes 64] [--two-step]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Run by path, Python puts bench/tuning/ first on sys.path: drop it, so that bench's modules are
# reached as bench.<name> and never shadow, or are shadowed by, an installed package of that name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench" / "tuning")]

from bench import harness as kb  # noqa: E402  (bench/harness.py: inputs and the fp64 reference)

from bole.config import gdn_shape  # noqa: E402
from bole.ops.gdn.common import expand_heads, prepare_gdn_tree_inputs  # noqa: E402
from bole.tree import DraftTree, PackedForest  # noqa: E402


def tf32(x: torch.Tensor, mode: str) -> torch.Tensor:
    """fp64 ``x`` through fp32, then to 10 mantissa bits: ``rn`` to nearest, ``rz`` truncated."""
    bits = x.float().view(torch.int32)
    if mode == "rn":
        bits = bits + 0x1000 + ((bits >> 13) & 1) - 1          # to nearest, ties to even
    return (bits & ~0x1FFF).view(torch.float32).double()


def bf16_split(x: torch.Tensor) -> torch.Tensor:
    """``S_hi + S_lo`` of the kernel's ``_split_bf16`` (fp32, then two bf16 roundings)."""
    x32 = x.float()
    hi = x32.bfloat16()
    lo = (x32 - hi.float()).bfloat16()
    return hi.double() + lo.double()


def pow2_scale(r: torch.Tensor) -> torch.Tensor:
    """Per matrix, the power of two that brings ``max |r|`` into [0.5, 1) (``_pow2_scale``)."""
    m = r.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
    return torch.exp2(-(torch.floor(torch.log2(m)) + 1))


def fp16_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with both operands rounded to fp16 (to nearest)."""
    return a.float().half().double() @ b.float().half().double()


def neumann_sweeps(G: torch.Tensor, R: torch.Tensor, depth: int, product,
                   scaled: bool = False) -> torch.Tensor:
    """The Neumann sweeps ``U <- R - G U``, each ``G U`` by ``product(G, U)``. ``scaled``: R is
    first scaled by :func:`pow2_scale` and U divided by it at the end, as
    ``VerifyConfig.fp16_sweeps`` does (with :func:`fp16_product`)."""
    s = pow2_scale(R) if scaled else 1.0
    Rs = U = R * s
    for _ in range(depth):
        U = Rs - product(G, U)
    return U / s


def fp64_inputs(x, forest, l2norm: bool):
    """bench/harness.py's inputs in fp64, gated and laid out per node (prepare_gdn_tree_inputs)."""
    return prepare_gdn_tree_inputs(
        x["q"].double(), x["k"].double(), x["v"].double(), forest,
        initial_state=x["initial_state"].double(), a=x["a"].double(), b=x["b"].double(),
        A_log=x["A_log"].double(), dt_bias=x["dt_bias"].double(),
        use_qk_l2norm_in_kernel=l2norm, check_values=False)


def emulate(x, forest, state: str, sweeps: str, cu: str) -> torch.Tensor:
    """O in fp64 with the operands of each product group rounded as named: "exact", "rn", "rz"
    (tf32), "3xtf32" (sweeps and C U), "fp16" (sweeps), "3xbf16" (C U) or "bf16x2" (state
    products)."""
    def rnd(t, how):
        if how == "exact":
            return t
        return bf16_split(t) if how == "bf16x2" else tf32(t, how)

    def product(a, b, how):
        """a @ b with both operands rounded; "3xtf32": big/small tf32 halves, three products
        (``a_big b_big + a_big b_small + a_small b_big``), as Triton's "tf32x3"."""
        if how == "fp16":
            return fp16_product(a, b)
        if how == "3xbf16":
            a_hi, b_hi = a.float().bfloat16().double(), b.float().bfloat16().double()
            a_lo = (a.float() - a_hi.float()).bfloat16().double()
            b_lo = (b.float() - b_hi.float()).bfloat16().double()
            return a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi
        if how != "3xtf32":
            return rnd(a, how) @ rnd(b, how)
        a_big, b_big = tf32(a, "rz"), tf32(b, "rz")
        a_small, b_small = tf32(a.float().double() - a_big, "rz"), tf32(b.float().double() - b_big, "rz")
        return a_big @ b_big + a_big @ b_small + a_small @ b_big

    p = fp64_inputs(x, forest, l2norm=False)          # raw keys: the norms are applied below
    scale = x["q"].shape[-1] ** -0.5
    o = torch.zeros_like(p.v)
    cu_nodes = forest.cu_nodes.tolist()
    for r in range(forest.num_requests):
        lo, hi = cu_nodes[r], cu_nodes[r + 1]
        tree = forest.tree(r)
        anc = tree.ancestor_mask(include_self=True)
        strict = anc & ~torch.eye(hi - lo, dtype=torch.bool)
        L = (anc.double() @ p.g[lo:hi].double()).T                      # [H_v, T]
        decay = torch.exp((L[:, :, None] - L[:, None, :]).masked_fill(~anc, float("-inf")))
        qh = expand_heads(p.q[lo:hi], p.group).transpose(0, 1)          # raw (bf16-valued) q, k
        kh = expand_heads(p.k[lo:hi], p.group).transpose(0, 1)
        rk = kh.norm(dim=-1, keepdim=True).reciprocal()                 # [H_v, T, 1]
        rq = qh.norm(dim=-1, keepdim=True).reciprocal() * scale
        beta = p.beta[lo:hi].T[:, :, None]
        # as the kernel: Grams of raw q/k (exact), norms as row / column scalings afterwards
        G = torch.where(strict, beta * rk * decay * (kh @ kh.transpose(1, 2)) * rk.transpose(1, 2), 0.0)
        C = decay * (qh @ kh.transpose(1, 2)) * (rq * rk.transpose(1, 2))
        s_pre = rnd(p.state[r], state)
        e_L = torch.exp(L)[:, :, None]
        R = beta * (p.v[lo:hi].transpose(0, 1) - e_L * rk * (kh @ s_pre))
        U = neumann_sweeps(G, R, tree.max_depth, lambda a, b: product(a, b, sweeps),
                           scaled=sweeps == "fp16")
        o[lo:hi] = (e_L * rq * (qh @ s_pre) + product(C, U, cu)).transpose(0, 1)
    return o


def two_step_solve_errors(model: str = "qwen3.5-9b") -> dict[str, float]:
    """U's error (max-norm, relative to the fp64 sweeps) of the two-step Neumann solve
    ``U <- (I - G) R + G^2 U`` (ceil((depth - 1) / 2) dependent products after G^2 and G R,
    against depth for the sweeps), with the products' operands in fp64, rounded to fp32 or
    truncated to tf32, next to the sweeps',
    on a 17-node chain whose keys are nearly parallel (the case that ruled out repeated squaring).
    Rejected on 2026-11-30 by these figures; kept as the record of why."""
    shape = gdn_shape(model)
    forest = PackedForest.pack([DraftTree.chain(17)])
    x = kb.make_inputs(shape, forest, "cpu", seed=1)
    x["k"] = (x["k"][:, :1] + 0.05 * x["k"]).to(torch.bfloat16)      # nearly parallel keys
    x["a"], x["b"] = torch.full_like(x["a"], -8.0), torch.full_like(x["b"], 6.0)
    p = fp64_inputs(x, forest, l2norm=True)
    tree = forest.tree(0)
    anc = tree.ancestor_mask(include_self=True)
    strict = anc & ~torch.eye(forest.num_nodes, dtype=torch.bool)
    L = (anc.double() @ p.g.double()).T
    decay = torch.exp((L[:, :, None] - L[:, None, :]).masked_fill(~anc, float("-inf")))
    kh = expand_heads(p.k, p.group).transpose(0, 1)
    beta = p.beta.T[:, :, None]
    G = torch.where(strict, beta * decay * (kh @ kh.transpose(1, 2)), 0.0)
    R = beta * (p.v.transpose(0, 1) - torch.exp(L)[:, :, None] * (kh @ p.state[0]))

    def solve(two_step: bool, how: str) -> torch.Tensor:
        rnd = {"exact": lambda t: t, "fp32": lambda t: t.float().double()}.get(
            how, lambda t: tf32(t, how))
        if not two_step:
            return neumann_sweeps(G, R, tree.max_depth,
                                  fp16_product if how == "fp16" else lambda a, b: rnd(a) @ rnd(b),
                                  scaled=how == "fp16")
        G2, Rp = rnd(G) @ rnd(G), R - rnd(G) @ rnd(R)
        U = Rp
        for _ in range(math.ceil((tree.max_depth - 1) / 2)):
            U = Rp + rnd(G2) @ rnd(U)
        return U

    ref = solve(False, "exact")
    return {f"{'two-step' if two else 'sweeps'} {how}":
            float((solve(two, how) - ref).abs().max() / ref.abs().max())
            for two in (False, True) for how in ("exact", "fp32", "rz", "fp16")
            if not (two and how == "fp16")}


#: (label, rounding of the state products, of the sweeps, of C U) for :func:`errors`
VARIANTS = (
    [(f"state products {m}", m, "exact", "exact") for m in ("rn", "rz", "bf16x2")]
    + [(f"sweeps G U {m}", "exact", m, "exact") for m in ("rn", "rz", "fp16")]
    + [(f"C U {m}", "exact", "exact", m) for m in ("rn", "rz", "3xtf32", "3xbf16")]
    + [("all tf32 (rz), the kernel before the fifth session", "rz", "rz", "rz"),
       ("bf16x2 state, tf32 (rz) sweeps and C U", "bf16x2", "rz", "rz"),
       ("bf16x2 state, tf32 (rz) sweeps, 3xbf16 C U: the fifth session's kernel", "bf16x2", "rz",
        "3xbf16"),
       ("bf16x2 state, fp16 sweeps, 3xbf16 C U (fp16_sweeps)", "bf16x2", "fp16", "3xbf16")])


def errors(model: str = "qwen3.5-9b", batch: int = 1, nodes: int = 64) -> dict[str, float]:
    """Relative error of O against fp64 for each of :data:`VARIANTS` (and "exact products", the
    emulation's own error) on bench/harness.py's inputs for this shape."""
    shape = gdn_shape(model)
    forest, _ = kb.bench_forest(nodes, batch, batch * 1000 + nodes, "cpu")
    x = kb.make_inputs(shape, forest, "cpu", seed=batch)
    ref, _ = kb.reference_fp64(x, forest)
    ref = ref.reshape(forest.num_nodes, shape.num_v_heads, -1)
    out = {"exact products": kb.rel_err(emulate(x, forest, "exact", "exact", "exact"), ref)}
    for name, state, sweeps, cu in VARIANTS:
        out[name] = kb.rel_err(emulate(x, forest, state, sweeps, cu), ref)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--two-step", action="store_true",
                    help="also the rejected two-step Neumann solve on an adversarial chain")
    args = ap.parse_args(argv)
    print(f"{gdn_shape(args.model).name}, batch {args.batch}, T = {args.nodes}: "
          "relative error of O against fp64 (rn: tf32 rounded to nearest, rz: truncated)")
    for name, err in errors(args.model, args.batch, args.nodes).items():
        print(f"  {name:<62} {err:.1e}")
    if args.two_step:
        print("17-node chain, nearly parallel keys: relative error of U (operands in fp64: exact; "
              "rounded to fp32: fp32; truncated to tf32: rz; fp16 as fp16_sweeps: fp16)")
        for name, err in two_step_solve_errors(args.model).items():
            print(f"  {name:<62} {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
