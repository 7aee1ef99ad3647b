"""The MTP head's frontier inputs in one launch (bole/ops/inputs/frontier.py) against the
torch reference: random node tables, frontiers with missing entries, roots and deep nodes."""

import pytest
import torch

from bole.ops.inputs.frontier import frontier_inputs, frontier_inputs_torch
from bole.speculative.tree_growth import NodeTable, TreeGrowth, step_slots
from tests.kernel_utils import DEV


def _table(R, topk, depth, seed):
    """A grown table (random proposals) and the frontier of its last step, some entries -1."""
    gen = torch.Generator().manual_seed(seed)
    frontiers = []

    def step(s, frontier, table):
        frontiers.append(frontier.clone())
        K = frontier.shape[1]
        probs = torch.rand(R, K, topk, generator=gen).sort(-1, descending=True).values
        toks = torch.randint(0, 50, (R, K, topk), generator=gen)
        toks[torch.rand(R, K, topk, generator=gen) < 0.15] = -1           # missing proposals
        return toks, probs
    limits = torch.randint(0, depth + 1, (R,), generator=gen)
    out = TreeGrowth(R, topk, depth, 8, impl="torch").grow(torch.randint(0, 50, (R,)), limits, step)
    return out.table, frontiers


@pytest.mark.parametrize("R,topk,depth,H,dtype", [(3, 2, 4, 40, torch.float32),
                                                  (1, 4, 3, 1100, torch.float16),
                                                  (4, 1, 5, 16, torch.float32)])
def test_kernel_equals_reference(R, topk, depth, H, dtype):
    """Step by step, the kernel's inputs equal the reference's, and each node's hidden state is
    its parent's output: the output the previous step computed at the parent's slot (a table of
    outputs by slot, as a drafter that scatters them would keep)."""
    table, frontiers = _table(R, topk, depth, seed=R * 10 + topk)
    C = table.tokens.shape[1]
    gen = torch.Generator().manual_seed(1)
    last_hidden = torch.randn(R + 2, H, generator=gen).to(dtype)
    slots = torch.randperm(R + 2, generator=gen)[:R].to(torch.int32)
    ctx = torch.randint(1, 30, (R,), generator=gen)
    on = lambda x: x.to(DEV)  # noqa: E731
    dev_table = NodeTable(*(on(getattr(table, n)) for n in
                            ("tokens", "parents", "depth", "rho", "live", "ancestors")))
    by_slot = torch.zeros(R, C, H, dtype=dtype)          # every step's outputs at their slots
    prev_out, prev_lo = None, 0
    for s, frontier in enumerate(frontiers):
        want = frontier_inputs_torch(frontier, table, prev_out, prev_lo, topk, last_hidden,
                                     slots, ctx, 99)
        got = frontier_inputs(on(frontier), dev_table,
                              None if prev_out is None else on(prev_out), prev_lo, topk,
                              on(last_hidden), on(slots), on(ctx), 99, impl="triton")
        for name in ("tokens", "positions", "rows", "mask", "prev"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
        K = frontier.shape[1]
        f = frontier.clamp(min=0)
        parent = torch.gather(table.parents, 1, f)
        for r in range(R):
            for k in range(K):
                p = int(parent[r, k])
                expect = by_slot[r, p] if p >= 0 else last_hidden[int(slots[r])]
                assert torch.equal(want.prev[r * K + k], expect)
        # this step's outputs (random), kept in frontier order and by slot
        prev_out = torch.randn(R * K, H, generator=gen).to(dtype)
        for r in range(R):
            for k in range(K):
                if int(frontier[r, k]) >= 0:
                    by_slot[r, int(frontier[r, k])] = prev_out[r * K + k]
        prev_lo = step_slots(topk, s)[0]
    # the cases hold missing frontier entries and nodes below the root
    assert any((f < 0).any() for f in frontiers) and any((f > 0).any() for f in frontiers)
