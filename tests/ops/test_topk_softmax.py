"""topk_softmax (bole/ops/topk_softmax.py): the two-stage kernel against torch.topk over the fp32
softmax (under the interpreter on CPU, small vocabularies split into several chunks)."""

import pytest
import torch

from bole.ops.topk_softmax import MAX_K, topk_softmax
from tests.kernel_utils import DEV

ON_GPU = DEV == "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _softmax_topk(logits: torch.Tensor, k: int):
    """The obvious definition: every probability, then the k largest, lower column on ties."""
    p = torch.softmax(logits.double(), dim=-1)
    vals, cols = [], []
    for row_p, row_l in zip(p.tolist(), logits.float().tolist()):
        ranked = sorted(range(len(row_l)), key=lambda j: (-row_l[j], j))[:k]
        cols.append(ranked)
        vals.append([row_p[j] for j in ranked])
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(cols, dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,V,k,chunk", [(1, 1000, 4, 128), (4, 777, 1, 64), (3, 300, 8, 512),
                                         (2, 64, 16, 16), (5, 1, 1, 64)])
def test_kernel_matches_definition(dtype, M, V, k, chunk):
    gen = torch.Generator().manual_seed(M * V + k)
    logits = (3 * torch.randn(M, V, generator=gen)).to(dtype).to(DEV)
    probs, cols = topk_softmax(logits, k, impl="triton", chunk=chunk)
    want_p, want_c = _softmax_topk(logits.cpu(), k)
    assert probs.dtype == torch.float32 and cols.dtype == torch.int64
    assert probs.shape == cols.shape == (M, k)
    # low-precision logits tie often: the lower column wins, as in the definition
    assert torch.equal(cols.cpu(), want_c)
    torch.testing.assert_close(probs.cpu().double(), want_p, rtol=2e-6, atol=1e-7)
    ref_p, ref_c = topk_softmax(logits, k, impl="torch")
    torch.testing.assert_close(probs, ref_p, rtol=2e-6, atol=1e-7)


def test_ties_take_the_lower_column_across_chunks():
    logits = torch.zeros(2, 200, device=DEV)
    logits[0, [150, 20, 90]] = 5.0          # equal maxima in three chunks
    logits[1, 199] = 1.0
    probs, cols = topk_softmax(logits, 4, impl="triton", chunk=64)
    assert cols[0].tolist() == [20, 90, 150, 0]
    assert cols[1].tolist() == [199, 0, 1, 2]
    torch.testing.assert_close(probs.sum(1).cpu(), topk_softmax(logits, 4, impl="torch")[0]
                               .sum(1).cpu())


def test_strided_rows_and_empty_batch():
    wide = torch.randn(3, 2 * 300, device=DEV)
    view = wide[:, ::2]
    probs, cols = topk_softmax(view, 3, impl="triton", chunk=128)
    ref_p, ref_c = topk_softmax(view.contiguous(), 3, impl="torch")
    assert torch.equal(cols, ref_c)
    torch.testing.assert_close(probs, ref_p)
    p, c = topk_softmax(torch.randn(0, 50, device=DEV), 2, impl="triton")
    assert p.shape == c.shape == (0, 2)


@pytest.mark.parametrize("bad,k,match", [((4,), 2, "rows, vocabulary"), ((2, 5), 6, "k must"),
                                         ((2, 100), MAX_K + 1, "k must"), ((2, 5), 0, "k must")])
def test_bad_arguments(bad, k, match):
    with pytest.raises(ValueError, match=match):
        topk_softmax(torch.randn(*bad), k)


def test_minus_inf_chunks_and_rows_with_few_finite_logits():
    """A chunk of -inf logits adds nothing to the normaliser (it made the row NaN), and a row with
    fewer finite logits than k still gets k distinct columns, the -inf ones lowest column first."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(5))
    logits[0, 64:128] = float("-inf")                 # a whole chunk masked
    logits[1, :] = float("-inf")
    logits[1, [70, 5]] = torch.tensor([1.0, 0.5])     # two finite logits, k = 4
    logits[2, 200:] = float("-inf")                   # the last chunks masked
    logits = logits.to(DEV)
    probs, cols = topk_softmax(logits, 4, impl="triton", chunk=64)
    want_p, want_c = _softmax_topk(logits.cpu(), 4)
    assert torch.isfinite(probs).all()
    assert torch.equal(cols.cpu(), want_c)
    assert cols[1].tolist() == [70, 5, 0, 1]
    torch.testing.assert_close(probs.cpu().double(), want_p, rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="power of two"):
        topk_softmax(logits, 2, impl="triton", chunk=48)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_ids_return_the_tokens_the_columns_stand_for(impl, id_dtype):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 300, generator=gen).to(DEV)
    ids = torch.randperm(5000, generator=gen)[:600].to(id_dtype).to(DEV)[::2]   # strided
    probs, tokens = topk_softmax(logits, 4, impl=impl, chunk=64, ids=ids)
    ref_p, ref_c = topk_softmax(logits, 4, impl=impl, chunk=64)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, ids[ref_c].long())
    assert torch.equal(probs, ref_p)


@pytest.mark.parametrize("ids", [torch.arange(7), torch.arange(8).float(),
                                 torch.arange(8).view(2, 4)])
def test_bad_ids(ids):
    with pytest.raises(ValueError, match="ids must be an integer tensor"):
        topk_softmax(torch.randn(2, 8), 2, ids=ids)
