"""The MTP head's inputs for accepted paths in one launch (bole/ops/inputs/observe.py)
against the torch reference: paths of every length (0 for padding rows, which share the dummy
slot), the remembered hidden states updated in place only where a path was committed."""

import pytest
import torch

from bole.ops.inputs.observe import observe_inputs, observe_inputs_torch
from tests.kernel_utils import DEV


@pytest.mark.parametrize("R,T,P,H,dtype", [(4, 10, 4, 40, torch.float32),
                                           (2, 16, 9, 1100, torch.bfloat16),
                                           (3, 1, 1, 8, torch.float32)])
def test_kernel_equals_reference(R, T, P, H, dtype):
    gen = torch.Generator().manual_seed(R * 100 + P)
    S = R + 2
    tree_tokens = torch.randint(0, 500, (R, T), generator=gen)
    count = torch.randint(0, P + 1, (R,), generator=gen)
    count[0] = P
    if R > 2:
        count[-1] = 0
    path = torch.zeros(R, P, dtype=torch.int64)
    for r in range(R):                          # increasing node indices, padded with the last
        nodes = torch.sort(torch.randperm(T, generator=gen)[:P]).values if T >= P else \
            torch.arange(P)
        n = max(1, int(count[r]))
        path[r, :n] = nodes[:n]
        path[r, n:] = nodes[n - 1]
    path[:, 0] = 0
    path_global = path + T * torch.arange(R)[:, None]
    hidden = torch.randn(R * T, H, generator=gen).to(dtype)
    last = torch.randn(S, H, generator=gen).to(dtype)
    slots = torch.randperm(S - 1, generator=gen)[:R].to(torch.int32)
    if R > 2:
        slots[-1] = S - 1                          # a padding row on the dummy slot
    start = torch.randint(1, 50, (R,), generator=gen)
    want_last = last.clone()
    want = observe_inputs_torch(tree_tokens, path, path_global, hidden, want_last, slots, start,
                                count, 77)
    got_last = last.to(DEV)
    got = observe_inputs(*(x.to(DEV) for x in (tree_tokens, path, path_global, hidden)), got_last,
                         slots.to(DEV), start.to(DEV), count.to(DEV), 77, impl="triton")
    for name in ("tokens", "prev", "positions", "rows"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert torch.equal(got_last.cpu(), want_last)
    # the reference itself: committed rows remember their last node, the others keep theirs
    for r in range(R):
        n = int(count[r])
        expect = hidden[int(path_global[r, n - 1])] if n else last[int(slots[r])]
        assert torch.equal(want_last[int(slots[r])], expect)
