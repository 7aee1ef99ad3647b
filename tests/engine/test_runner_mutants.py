"""ModelRunner against transformers as the oracle (fla blocked; fp32, 1e-4): every path that
commits tokens (chunked prefill with checkpoints, the default chunk, batched prefill, decode,
tree verification and its commit) leaves the logits and the slot's state of the whole sequence
written out, checked by a decode after it; the runner's refusals at their exact limits, with
their messages. Small and fast: the mutation run of ``bole/engine/runner.py`` runs it a mutant.
"""

import re

import numpy as np
import pytest
import torch

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)

pytest.importorskip("transformers")

from bole.engine.runner import (PREFILL_BATCH_MAX, PREFILL_CHUNK_TREE,  # noqa: E402
                                ModelRunner, prefill_bucket)
from bole.models.batch import BACKENDS  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.tree import DraftTree, PackedForest  # noqa: E402
from tests.models.test_config_and_loader import build  # noqa: E402

TOL = 1e-4
V = 64                                  # the oracle's vocabulary (tests/models' SMALL)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = build("qwen3_5_text").eval()
    path = tmp_path_factory.mktemp("runner")
    hf.save_pretrained(path)
    return hf, HybridModel.from_pretrained(path, dtype=torch.float32, gdn_backend="torch")


def oracle(hf, ids):
    """transformers' logits at every position of ``ids`` ``[len(ids), V]``."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([list(ids)])).logits[0].float()


def raises(msg, fn, *args, **kw):
    """``fn`` raises a ValueError whose message is exactly ``msg``."""
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    assert str(e.value) == msg


def ids_of(gen, n):
    return torch.randint(0, V, (n,), generator=gen)


def test_prefill_bucket_is_the_power_of_two_from_16_to_64():
    want = {n: 16 if n <= 16 else 32 if n <= 32 else 64 for n in range(1, 200)}
    assert {n: prefill_bucket(n) for n in range(1, 200)} == want
    assert PREFILL_BATCH_MAX == 64 and PREFILL_CHUNK_TREE == 64


def test_chunked_prefill_after_committed_tokens_with_checkpoints(pair):
    """A 5-token prompt, then 11 more in chunks of 4 with prefix-cache checkpoints: the logits,
    the hidden states, the progress calls and each checkpoint's state (copied out at the
    callback, then decoded) equal the oracle's; checkpoints at or before the slot's length, or
    past the prompt, cut nothing."""
    hf, model = pair
    gen = torch.Generator().manual_seed(1)
    first, second = ids_of(gen, 5), ids_of(gen, 11)
    runner = ModelRunner(model, model.new_cache(5, 40), "torch")
    cache = runner.cache
    slot = cache.allocate(40)
    spare = [cache.allocate(40) for _ in range(3)]
    last, hidden = runner.prefill(slot, first)
    seq = first.tolist() + second.tolist()
    want = oracle(hf, seq + [7])
    assert rel(last, want[4]) <= TOL and rel(model.lm_head(hidden), want[:5]) <= TOL
    assert hidden.shape == (5, model.config.hidden_size)
    assert cache.host_lengths[slot] == 5 == int(cache.lengths[slot])

    chunks, points = [], []

    def on_checkpoint(length):
        assert cache.host_lengths[slot] == length == int(cache.lengths[slot])
        cache.copy_slot(slot, spare[len(points)])
        points.append(length)

    last, hidden = runner.prefill(slot, second, chunk=4,
                                  on_chunk=lambda d, t: chunks.append((d, t)),
                                  checkpoints=(3, 5, 8, 13, 16, 40), on_checkpoint=on_checkpoint)
    # cuts at 4 and 8 (the chunk) and 3 (checkpoint 8 = 5 + 3; 13 = 5 + 8 is a chunk's end too)
    assert chunks == [(3, 11), (4, 11), (8, 11), (11, 11)]
    assert points == [8, 13, 16]
    assert rel(last, want[15]) <= TOL
    assert hidden.shape == (11, model.config.hidden_size)
    assert rel(model.lm_head(hidden), want[5:16]) <= TOL
    assert cache.host_lengths[slot] == 16 == int(cache.lengths[slot])
    # every checkpoint's copy holds exactly its prefix: one decode step each, and the slot's own
    slots = [slot, *spare]
    nxt = torch.tensor([7, 11, 12, 13])
    step = runner.decode(slots, nxt)
    for r, n in enumerate([16, *points]):
        assert rel(step[r], oracle(hf, seq[:n] + [int(nxt[r])])[-1]) <= TOL, n
        assert cache.host_lengths[slots[r]] == n + 1 == int(cache.lengths[slots[r]])


def test_prefill_default_chunk_and_the_cache_limit(pair):
    """On the CPU prompts go in chunks of 64 (the tree path); a prompt may fill its slot to the
    last position, one token more is refused with the position it would reach."""
    hf, model = pair
    gen = torch.Generator().manual_seed(2)
    prompt = ids_of(gen, 70)
    runner = ModelRunner(model, model.new_cache(2, 70), "torch")
    assert not model.chunked_prefill
    slot = runner.cache.allocate(70)
    chunks = []
    last, hidden = runner.prefill(slot, prompt, on_chunk=lambda d, t: chunks.append((d, t)))
    assert chunks == [(64, 70), (70, 70)]
    want = oracle(hf, prompt.tolist())
    assert rel(last, want[-1]) <= TOL and rel(model.lm_head(hidden), want) <= TOL
    other = runner.cache.allocate(70)
    runner.prefill(other, prompt[:60])
    raises("the prompt would reach position 70, past the cache's 70 tokens per slot",
           runner.prefill, other, prompt[:11])
    assert runner.cache.host_lengths[other] == 60
    last, _ = runner.prefill(other, prompt[60:])                # exactly to the end
    assert rel(last, want[-1]) <= TOL
    assert runner.cache.host_lengths[other] == 70 == int(runner.cache.lengths[other])


def test_prefill_refuses_bad_prompts_and_token_ids(pair):
    _, model = pair
    runner = ModelRunner(model, model.new_cache(1, 16), "torch")
    slot = runner.cache.allocate(16)
    msg = "prompt must be a non-empty 1-D tensor of token ids"
    for bad in (torch.zeros(0, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64)):
        raises(msg, runner.prefill, slot, bad)
    for bad in ([-1], [V], [3, V + 5]):
        with pytest.raises(ValueError, match=re.escape(f"token ids must lie in [0, {V})")):
            runner.prefill(slot, torch.tensor(bad))
        with pytest.raises(ValueError, match=re.escape(f"token ids must lie in [0, {V})")):
            runner.prefill_tokens([torch.tensor(bad)])
    assert runner.cache.host_lengths[slot] == 0
    runner.prefill(slot, torch.tensor([0, V - 1]))              # both ends of the vocabulary
    runner.decode([slot], torch.tensor([V - 1]))
    with pytest.raises(ValueError, match=re.escape(f"token ids must lie in [0, {V})")):
        runner.decode([slot], torch.tensor([V]))
    assert runner.cache.host_lengths[slot] == 3


def test_backend_names(pair, monkeypatch):
    _, model = pair
    cache = model.new_cache(1, 8)
    raises(f"gdn must be one of {BACKENDS}, got 'nope'", ModelRunner, model, cache, "nope")
    monkeypatch.setenv("TRITON_INTERPRET", "0")                 # compiled Triton: CUDA only
    with pytest.raises(ValueError, match=re.escape("gdn='triton-serial' got tensors on cpu")):
        ModelRunner(model, cache, "triton-serial")
    runner = ModelRunner(model, cache, "torch-serial")          # a torch backend needs no GPU
    assert (runner.gdn, runner.device, runner.reserved) == ("torch-serial", model.device, {})
    runner.reserve_snapshots(8)                                 # none for a torch backend
    assert runner.reserved == {"linear_attention": None}


def test_batched_prefill_then_decode_equal_the_oracle(pair):
    """Three prompts and a padding row (length 0, the dummy slot) in one forward: each row's
    last logits and hidden states, and the state a decode step then reads, are the oracle's;
    the dummy slot keeps its one token."""
    hf, model = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [ids_of(gen, n) for n in (7, 1, 19)]
    runner = ModelRunner(model, model.new_cache(4, 48), "torch")
    cache = runner.cache
    slots = [cache.allocate(48) for _ in prompts]
    logits, hidden = runner.prefill_batch(slots, prompts)
    assert logits.shape == (3, V)
    for r, p in enumerate(prompts):
        want = oracle(hf, p.tolist())
        assert hidden[r].shape == (p.numel(), model.config.hidden_size)
        assert rel(logits[r], want[-1]) <= TOL and rel(model.lm_head(hidden[r]), want) <= TOL
        assert cache.host_lengths[slots[r]] == p.numel() == int(cache.lengths[slots[r]])
    nxt = torch.tensor([5, 6, 8])
    out = runner.decode_output(slots, nxt)
    for r, p in enumerate(prompts):
        assert rel(out.logits[r], oracle(hf, p.tolist() + [int(nxt[r])])[-1]) <= TOL
    assert rel(model.lm_head(out.hidden), out.logits) <= 1e-6
    # prefill_rows with a padding row: commits nothing to the dummy slot
    fresh = ModelRunner(model, model.new_cache(2, 48), "torch")
    s = fresh.cache.allocate(48)
    dummy = fresh.cache.dummy_slot
    tokens = fresh.prefill_tokens([prompts[0], torch.zeros(0, dtype=torch.int64)])
    assert tokens.shape == (2, 16) and not tokens[0, 7:].any() and not tokens[1].any()
    assert torch.equal(tokens[0, :7], prompts[0])
    lg, hd = fresh.prefill_rows(torch.tensor([s, dummy], dtype=torch.int32), tokens,
                                torch.tensor([7, 0]))
    assert hd.shape == (2, 16, model.config.hidden_size)
    assert rel(lg[0], oracle(hf, prompts[0].tolist())[-1]) <= TOL
    assert int(fresh.cache.lengths[s]) == 7 and int(fresh.cache.lengths[dummy]) == 1


def test_prefill_tokens_width(pair):
    """Rows zero-padded to the bucket of the longest, below a slot's length, never below the
    longest; an explicit width wins."""
    _, model = pair
    p = [torch.arange(1, 6), torch.arange(1, 18)]
    assert ModelRunner(model, model.new_cache(1, 64), "torch").prefill_tokens(p).shape == (2, 32)
    assert ModelRunner(model, model.new_cache(1, 20), "torch").prefill_tokens(p).shape == (2, 19)
    assert ModelRunner(model, model.new_cache(1, 17), "torch").prefill_tokens(p).shape == (2, 17)
    runner = ModelRunner(model, model.new_cache(1, 64), "torch")
    t = runner.prefill_tokens(p, width=40)
    assert t.shape == (2, 40) and t.dtype == torch.int64
    assert torch.equal(t[1, :17], p[1]) and not t[1, 17:].any() and not t[0, 5:].any()


def test_prefill_batch_refusals(pair):
    _, model = pair
    runner = ModelRunner(model, model.new_cache(2, 128), "torch")
    s, s2 = runner.cache.allocate(100), runner.cache.allocate(100)
    one = torch.tensor([3])
    raises("0 prompts for 0 slots", runner.prefill_batch, [], [])
    raises("2 prompts for 1 slots", runner.prefill_batch, [s], [one, one])
    for n in (0, PREFILL_BATCH_MAX + 1):
        raises(f"prefill_batch takes prompts of 1 to 64 tokens, got lengths [2, {n}]",
               runner.prefill_batch, [s, s2],
               [torch.tensor([1, 2]), torch.ones(n, dtype=torch.int64)])
    runner.prefill_batch([s], [torch.ones(PREFILL_BATCH_MAX, dtype=torch.int64)])
    assert runner.cache.host_lengths[s] == 64
    raises("prefill_batch fills fresh slots (no committed tokens)", runner.prefill_batch, [s],
           [one])


def test_verify_commit_accepted_then_decode(pair):
    """Two trees over slots of different lengths: every node's logits are the oracle's at its
    path; committing a deep node and the root (KV rows moved into place) leaves states a decode
    step reads as the oracle does."""
    hf, model = pair
    gen = torch.Generator().manual_seed(4)
    prompts = [ids_of(gen, n) for n in (6, 3)]
    runner = ModelRunner(model, model.new_cache(2, 40), "torch")
    slots = [runner.cache.allocate(40) for _ in prompts]
    for s, p in zip(slots, prompts):
        runner.prefill(s, p)
    trees = [DraftTree.random(9, 4, np.random.default_rng(5)), DraftTree.full_kary(2, 2)]
    forest = PackedForest.pack(trees)
    tokens = ids_of(gen, forest.num_nodes)
    batch, out = runner.verify(slots, forest, tokens, nodes_per_request=10)
    T = batch.nodes_per_request
    assert T == 10 and out.logits.shape == (2 * T, V)
    for r, tree in enumerate(trees):
        lo = int(forest.cu_nodes[r])
        for node in range(tree.num_nodes):
            path = tokens[tree.path(node) + lo].tolist()
            assert rel(out.logits[r * T + node], oracle(hf, prompts[r].tolist() + path)[-1]) \
                <= TOL, (r, node)
    deep = int(trees[0].depth.argmax())
    accepted = [deep, 0]
    lengths = runner.commit_accepted(batch, out, accepted)
    assert lengths == [int(trees[0].depth[deep]) + 1, 1]
    nxt = torch.tensor([9, 10])
    step = runner.decode(slots, nxt)
    for r, tree in enumerate(trees):
        lo = int(forest.cu_nodes[r])
        ids = prompts[r].tolist() + tokens[tree.path(accepted[r]) + lo].tolist() + [int(nxt[r])]
        assert rel(step[r], oracle(hf, ids)[-1]) <= TOL
        cache = runner.cache
        assert cache.host_lengths[slots[r]] == len(ids) == int(cache.lengths[slots[r]])


def test_verify_refuses_trees_past_the_slot(pair):
    """A tree needs its slot's length plus its node count (or its depth + 1) free positions:
    a 4-node chain fits a slot of 12 holding 8 tokens, one token more does not."""
    _, model = pair
    runner = ModelRunner(model, model.new_cache(1, 12), "torch")
    s = runner.cache.allocate(12)
    runner.prefill(s, torch.arange(8))
    chain = PackedForest.pack([DraftTree.chain(4)])
    with pytest.raises(ValueError, match=re.escape(f"token ids must lie in [0, {V})")):
        runner.verify([s], chain, torch.tensor([1, 2, V, 3]))
    runner.verify([s], chain, torch.tensor([1, 2, 3, 4]))        # no commit: the slot stays
    msg = "the trees would reach position 12, past the cache's 12 tokens per slot"
    raises(msg, runner.verify, [s], chain, torch.tensor([1, 2, 3, 4]), nodes_per_request=5)
    runner.prefill(s, torch.tensor([1]))
    raises(msg, runner.verify, [s], chain, torch.tensor([1, 2, 3, 4]))


def test_prefill_projects_only_the_last_token_onto_the_vocabulary(pair, monkeypatch):
    """A prefill's logits are the last token's (``[V]``, a row per prompt when batched): the
    vocabulary projection never runs over a whole prompt (``[P, V]`` would not fit for long
    prompts)."""
    _, model = pair
    rows = []
    head = model.lm_head

    def counted(hidden):
        rows.append(hidden.shape[0])
        return head(hidden)
    monkeypatch.setattr(model, "lm_head", counted)
    runner = ModelRunner(model, model.new_cache(3, 80), "torch")
    s = runner.cache.allocate(80)
    runner.prefill(s, torch.arange(70) % V)
    assert rows == [1]
    rows.clear()
    runner.prefill_batch([runner.cache.allocate(80), runner.cache.allocate(80)],
                         [torch.arange(5), torch.arange(20)])
    assert rows == [2]


def test_prefill_with_a_chunked_kernel_takes_long_chunks(pair):
    """Where the linear-attention layers have a chunked prefill kernel (fla's on a GPU; here a
    stand-in with its signature), prompts go in chunks of 1024: 70 tokens in one, with the
    oracle's logits; a checkpoint still cuts its chunk."""
    from bole.ops.gdn.reference import chain_gdn_recurrent
    hf, model = pair

    def fake_fla(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        return chain_gdn_recurrent(q, k, v, g, beta, initial_state=initial_state,
                                   use_qk_l2norm_in_kernel=True)

    gdn = model.linear["linear_attention"]
    saved = gdn.prefill_kernel
    gdn.prefill_kernel = fake_fla
    try:
        assert model.chunked_prefill
        prompt = ids_of(torch.Generator().manual_seed(6), 70)
        runner = ModelRunner(model, model.new_cache(2, 80), "torch")
        chunks = []
        last, _ = runner.prefill(runner.cache.allocate(80), prompt,
                                 on_chunk=lambda d, t: chunks.append(d))
        assert chunks == [70]
        chunks.clear()
        runner.prefill(runner.cache.allocate(80), prompt, checkpoints=(64,),
                       on_chunk=lambda d, t: chunks.append(d))
        assert chunks == [64, 70]
    finally:
        gdn.prefill_kernel = saved
    assert rel(last, oracle(hf, prompt.tolist())[-1]) <= TOL


def test_batched_prefill_of_rows_as_wide_as_the_bucket(pair):
    """Prompts of exactly the bucket's width (16, 32, 64 tokens: the chain's deepest node at the
    last slot) give the oracle's logits and hidden states, and the state a decode reads."""
    hf, model = pair
    gen = torch.Generator().manual_seed(7)
    for n in (16, 32, 64):
        prompts = [ids_of(gen, n), ids_of(gen, 3)]
        runner = ModelRunner(model, model.new_cache(2, 80), "torch")
        slots = [runner.cache.allocate(80) for _ in prompts]
        assert runner.prefill_tokens(prompts).shape == (2, n)
        logits, hidden = runner.prefill_batch(slots, prompts)
        want = oracle(hf, prompts[0].tolist() + [1])
        assert rel(logits[0], want[n - 1]) <= TOL and rel(model.lm_head(hidden[0]), want[:n]) <= TOL
        assert rel(logits[1], oracle(hf, prompts[1].tolist())[-1]) <= TOL
        assert rel(runner.decode(slots, torch.tensor([1, 2]))[0], want[n]) <= TOL
