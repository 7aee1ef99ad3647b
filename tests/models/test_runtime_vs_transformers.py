"""Our runtime against transformers as the oracle (fla blocked), for every supported model type.

Prefill logits, 16 decode steps, tree verification (each node equals decoding its path), and the
decode step after committing an accepted path, all to 1e-4 in fp32, through the model runner.
"""

import numpy as np
import pytest
import torch

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)

pytest.importorskip("transformers")

from bole.cache import CacheFull  # noqa: E402
from bole.engine.runner import ModelRunner  # noqa: E402
from bole.forest import DenseForest  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.tree import DraftTree, PackedForest  # noqa: E402
from tests.models.test_config_and_loader import KINDS, build  # noqa: E402

TOL = 1e-4


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max())


# Each model type with the torch GDN path; the Triton paths (interpreted on CPU) on two types.
CASES = [(kind, "torch") for kind in KINDS] + [
    ("qwen3_5_text", "triton"), ("qwen3_next", "triton"), ("qwen3_5", "triton-serial"),
    ("qwen3_5_moe_text", "torch-serial"), ("qwen3_5_text_tied", "torch")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-{b}" for k, b in CASES])
def pair(request, tmp_path_factory):
    kind, backend = request.param
    hf = build(kind).eval()
    path = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(path)
    # the Triton backends: interpreted on a CPU-only machine, compiled on a GPU (where Triton's
    # interpreter is off and its kernels take CUDA tensors only)
    device = "cuda" if backend.startswith("triton") and torch.cuda.is_available() else "cpu"
    model = HybridModel.from_pretrained(path, dtype=torch.float32, gdn_backend=backend, device=device)
    return hf, model, backend


def runner_for(model, backend, max_slots, max_len):
    return ModelRunner(model, model.new_cache(max_slots, max_len), backend)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode(pair):
    hf, model, backend = pair
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (11,), generator=gen)
    runner = runner_for(model, backend, 2, 64)
    cache = runner.cache
    slot = cache.allocate(40)
    last, hidden = runner.prefill(slot, prompt, chunk=4)          # 3 chunks: exercises chunking
    want = hf_logits(hf, prompt.tolist())
    assert rel(model.lm_head(hidden), want) <= TOL
    assert rel(last, want[-1]) <= TOL
    ids = prompt.tolist()
    for _ in range(16):
        nxt = int(torch.randint(0, 64, (1,), generator=gen))
        ids.append(nxt)
        step = runner.decode([slot], torch.tensor([nxt]))
        assert rel(step[0], hf_logits(hf, ids)[-1]) <= TOL
    assert int(cache.lengths[slot]) == len(ids) == cache.host_lengths[slot]


def test_tree_verify_and_commit(pair):
    hf, model, backend = pair
    gen = torch.Generator().manual_seed(2)
    runner = runner_for(model, backend, 3, 64)
    runner.reserve_snapshots(32)          # triton-serial: the snapshots land in a shared store
    cache = runner.cache
    prompts = [torch.randint(0, 64, (n,), generator=gen) for n in (7, 5)]
    slots = [cache.allocate(40) for _ in prompts]
    for s, p in zip(slots, prompts):
        runner.prefill(s, p)
    rng = np.random.default_rng(3)
    trees = [DraftTree.random(9, 3, rng), DraftTree.full_kary(2, 2)]
    forest = PackedForest.pack(trees)
    tokens = torch.randint(0, 64, (forest.num_nodes,), generator=gen)
    batch, out = runner.verify(slots, forest, tokens)
    T = batch.nodes_per_request
    if backend == "triton-serial":
        gdn = model.linear["linear_attention"]
        store = runner.reserved["linear_attention"][0]
        assert batch.linear[gdn.name].snapshot_store is store
        assert out.linear[gdn.name].snapshots[0].data_ptr() == store[0].data_ptr()
    for r, tree in enumerate(trees):
        lo = int(forest.cu_nodes[r])
        for node in range(tree.num_nodes):
            path = tokens[tree.path(node) + lo].tolist()
            expect = hf_logits(hf, prompts[r].tolist() + path)[-1]
            assert rel(out.logits[r * T + node], expect) <= TOL, (r, node)
    accepted = [int(trees[0].depth.argmax()), 4]
    runner.commit_accepted(batch, out, accepted)
    nxt = torch.randint(0, 64, (2,), generator=gen)
    step = runner.decode(slots, nxt)
    for r, tree in enumerate(trees):
        lo = int(forest.cu_nodes[r])
        ids = prompts[r].tolist() + tokens[tree.path(accepted[r]) + lo].tolist() + [int(nxt[r])]
        assert rel(step[r], hf_logits(hf, ids)[-1]) <= TOL
        assert int(cache.lengths[slots[r]]) == len(ids)


def test_cache_errors(pair):
    _, model, backend = pair
    runner = runner_for(model, backend, 1, 8)
    cache = runner.cache
    with pytest.raises(CacheFull, match="does not fit"):
        cache.allocate(9)
    slot = cache.allocate(8)
    with pytest.raises(CacheFull, match="all 1 cache slots are in use"):
        cache.allocate(1)
    with pytest.raises(ValueError, match="past the cache"):
        runner.prefill(slot, torch.arange(9))
    with pytest.raises(ValueError, match="token ids"):
        runner.decode([slot], torch.tensor([999]))
    cache.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        runner.decode([slot], torch.tensor([1]))
    again = cache.allocate(4)                       # freed slots come back zeroed
    assert int(cache.lengths[again]) == 0 and not cache.gdn_state[:, again].any()


def test_chain_prefill_plumbing(pair):
    """The fla prefill path (used on GPUs with fla) wired to a stand-in with fla's signature."""
    from bole.ops.gdn.reference import chain_gdn_recurrent
    hf, model, backend = pair

    def fake_fla(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        assert output_final_state and use_qk_l2norm_in_kernel
        return chain_gdn_recurrent(q, k, v, g, beta, initial_state=initial_state,
                                   use_qk_l2norm_in_kernel=True)

    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 64, (13,), generator=gen)
    gdn = model.linear["linear_attention"]
    saved = gdn.prefill_kernel
    gdn.prefill_kernel = fake_fla
    try:
        runner = runner_for(model, backend, 1, 64)
        slot = runner.cache.allocate(32)
        _, hidden = runner.prefill(slot, prompt, chunk=5)
        step = runner.decode([slot], torch.tensor([3]))
    finally:
        gdn.prefill_kernel = saved
    assert rel(model.lm_head(hidden), hf_logits(hf, prompt.tolist())) <= TOL
    assert rel(step[0], hf_logits(hf, prompt.tolist() + [3])[-1]) <= TOL


def test_forward_and_commit_make_no_device_sync(pair):
    """On a GPU, a forward and its commit built from device tensors never synchronise the
    device (what a captured round relies on)."""
    _, model, backend = pair
    if model.device.type != "cuda":
        pytest.skip("CUDA's sync debug mode needs the model on a GPU")
    if not model.graph_safe:
        pytest.skip("MoE routing syncs the host by design")
    gen = torch.Generator().manual_seed(6)
    runner = runner_for(model, backend, 2, 64)
    slots = [runner.cache.allocate(32) for _ in range(2)]
    for s in slots:
        runner.prefill(s, torch.randint(0, 64, (5,), generator=gen))
    dense = DenseForest.from_packed(
        PackedForest.pack([DraftTree.full_kary(2, 2), DraftTree.chain(4)]), device="cuda")
    tokens = torch.randint(0, 64, (dense.num_nodes,), device="cuda")
    slot_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    accepted = torch.tensor([3, 2], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forest = DenseForest.from_parents(dense.parents, dense.valid, dense.max_depth)
        batch = runner.make_batch(tokens, forest, slot_t)
        out = runner.forward(batch)
        path, path_len = forest.paths(accepted)
        runner.commit(batch, out, path, path_len)
    finally:
        torch.cuda.set_sync_debug_mode(0)
