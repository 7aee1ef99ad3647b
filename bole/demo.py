"""Demo: verify random draft trees on one GDN layer of a real model's shape, exactly.

For each tree size it runs the serial per-node recurrence (the tree-serial ground truth, fp64) and
Bole's closed form (fp32 and fp64), commits the deepest node's state from the factors, and prints
the agreement and the transient-state figures (per-node snapshots vs factors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from bole.config import GDNShape, gdn_shape
from bole.memory import speculative_state_bytes
from bole.ops.gdn.closed_form import commit_factored, tree_gdn_closed_form
from bole.ops.gdn.reference import tree_gdn_serial
from bole.tree import DraftTree, PackedForest


@dataclass
class DemoRow:
    nodes: int
    depth: int
    err_fp64: float
    err_fp32: float
    commit_err_fp32: float
    serial_s: float
    closed_form_s: float


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_layer(shape: GDNShape, nodes: int, depth: int, seed: int) -> DemoRow:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    tree = DraftTree.random(nodes, depth, rng)
    forest = PackedForest.pack([tree])
    Hk, Hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rnd(1, nodes, Hk, dk), rnd(1, nodes, Hk, dk), rnd(1, nodes, Hv, dv)
    a, b = rnd(1, nodes, Hv), rnd(1, nodes, Hv)
    A_log = torch.log(torch.empty(Hv, dtype=torch.float64).uniform_(1, 16, generator=gen))
    dt_bias = rnd(Hv)
    state = rnd(1, Hv, dk, dv) * 0.1
    gates = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)

    t0 = time.perf_counter()
    o_ref, _, states = tree_gdn_serial(q, k, v, forest, initial_state=state, return_states=True,
                                       **gates)
    t1 = time.perf_counter()
    o64, _ = tree_gdn_closed_form(q, k, v, forest, initial_state=state, **gates)
    f32 = {n: t.float() for n, t in gates.items() if isinstance(t, torch.Tensor)}
    t2 = time.perf_counter()
    o32, factors = tree_gdn_closed_form(q.float(), k.float(), v.float(), forest,
                                        initial_state=state.float(),
                                        use_qk_l2norm_in_kernel=True, **f32)
    t3 = time.perf_counter()
    deepest = int(tree.depth.argmax())
    committed = commit_factored(factors, state.float(), forest, [deepest])
    return DemoRow(nodes, tree.max_depth, _rel(o64, o_ref), _rel(o32, o_ref),
                   _rel(committed[0], states[deepest]), t1 - t0, t3 - t2)


def main(shape_name: str = "qwen3.5-9b", nodes: tuple[int, ...] = (64, 128), depth: int = 8,
         seed: int = 0) -> list[DemoRow]:
    shape = gdn_shape(shape_name)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"Bole demo 2/2: exact tree verification of one {shape.name} GDN layer "
          f"(H_k={shape.num_k_heads}, H_v={shape.num_v_heads}, d_k={shape.head_k_dim}, "
          f"d_v={shape.head_v_dim}), random draft trees of depth <= {depth}, raw gates, "
          f"in-kernel q/k l2-norm; CPU torch {torch.__version__}")
    print(f"{'nodes':>5} {'depth':>5} {'closed-form fp64':>17} {'closed-form fp32':>17} "
          f"{'commit fp32':>12} {'serial s':>9} {'closed s':>9}   (errors: rel. to serial fp64)")
    rows = []
    for i, n in enumerate(nodes):
        row = run_layer(shape, n, depth, seed + i)
        rows.append(row)
        print(f"{row.nodes:>5} {row.depth:>5} {row.err_fp64:>17.2e} {row.err_fp32:>17.2e} "
              f"{row.commit_err_fp32:>12.2e} {row.serial_s:>9.3f} {row.closed_form_s:>9.3f}")
    print(f"\nTransient speculative GDN state per request, all {shape.num_gdn_layers} GDN layers "
          f"(fp32 snapshots vs factors: fp64 L, fp32 k and u):")
    print(f"{'nodes':>5} {'snapshots MiB':>14} {'factors MiB':>12} {'ratio':>7}")
    for n in nodes:
        m = speculative_state_bytes(shape, n)
        print(f"{n:>5} {m.snapshot_bytes / 2**20:>14.1f} {m.factor_bytes / 2**20:>12.2f} "
              f"{m.ratio:>6.1f}x")
    worst = max(max(r.err_fp64 for r in rows) / 1e-10, max(r.err_fp32 for r in rows) / 1e-5,
                max(r.commit_err_fp32 for r in rows) / 1e-5)
    print("\nagreement:", "OK (fp64 <= 1e-10, fp32 <= 1e-5)" if worst <= 1 else "FAILED")
    if worst > 1:
        raise SystemExit(1)
    return rows
