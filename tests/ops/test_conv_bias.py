"""The tree conv with a bias and SiLU equals torch's own depthwise ``nn.Conv1d`` followed by
``F.silu`` along every root-to-node path (the bias goes inside the activation)."""

import torch
import torch.nn.functional as F

from bole.ops.conv import tree_conv1d
from bole.tree import DraftTree, PackedForest


def test_bias_and_silu_equal_nn_conv1d_then_silu_on_every_path():
    gen = torch.Generator().manual_seed(0)
    C, K = 6, 4
    trees = [DraftTree.chain(5), DraftTree.full_kary(2, 2)]
    forest = PackedForest.pack(trees)
    N = forest.num_nodes
    x = torch.randn(1, N, C, generator=gen, dtype=torch.float64)
    state = torch.randn(len(trees), C, K - 1, generator=gen, dtype=torch.float64)
    conv = torch.nn.Conv1d(C, C, K, groups=C, bias=True, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(C, 1, K, generator=gen, dtype=torch.float64))
        conv.bias.copy_(1.5 + torch.randn(C, generator=gen, dtype=torch.float64))
    y = tree_conv1d(x, conv.weight.detach(), state, forest, bias=conv.bias.detach(),
                    activation="silu")
    for r, tree in enumerate(trees):
        base = int(forest.cu_nodes[r])
        for node in range(tree.num_nodes):
            path = [base + int(i) for i in tree.path(node)]
            # the committed inputs, then the path's own: the last output is the node's
            seq = torch.cat([state[r], x[0, path].T], dim=1)[None]
            with torch.no_grad():
                want = F.silu(conv(seq))[0, :, -1]
            assert torch.allclose(y[0, base + node], want, atol=1e-12), (r, node)
