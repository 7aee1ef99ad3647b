"""Our runtime against transformers as the oracle (fla blocked), for every supported model type.

Prefill logits, 16 decode steps, tree verification (each node equals decoding its path), and the
decode step after committing an accepted path, all to 1e-4 in fp32.
"""

import numpy as np
import pytest
import torch

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)

pytest.importorskip("transformers")

from bole.cache import CacheFull  # noqa: E402
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
    return hf, model


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode(pair):
    hf, model = pair
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (11,), generator=gen)
    cache = model.new_cache(max_slots=2, max_len=64)
    slot = cache.allocate(40)
    logits = model.prefill(cache, slot, prompt, chunk=4)          # 3 chunks: exercises chunking
    assert rel(logits, hf_logits(hf, prompt.tolist())) <= TOL
    ids = prompt.tolist()
    for _ in range(16):
        nxt = int(torch.randint(0, 64, (1,), generator=gen))
        ids.append(nxt)
        step = model.decode(cache, [slot], torch.tensor([nxt]))
        assert rel(step[0], hf_logits(hf, ids)[-1]) <= TOL
    assert int(cache.lengths[slot]) == len(ids)


def test_tree_verify_and_commit(pair):
    hf, model = pair
    gen = torch.Generator().manual_seed(2)
    cache = model.new_cache(max_slots=3, max_len=64)
    prompts = [torch.randint(0, 64, (n,), generator=gen) for n in (7, 5)]
    slots = [cache.allocate(40) for _ in prompts]
    for s, p in zip(slots, prompts):
        model.prefill(cache, s, p)
    rng = np.random.default_rng(3)
    trees = [DraftTree.random(9, 3, rng), DraftTree.full_kary(2, 2)]
    forest = PackedForest.pack(trees)
    tokens = torch.randint(0, 64, (forest.num_nodes,), generator=gen)
    out = model.forward_tree(cache, slots, forest, tokens)
    for r, tree in enumerate(trees):
        lo = int(forest.cu_nodes[r])
        for node in range(tree.num_nodes):
            path = tokens[tree.path(node) + lo].tolist()
            expect = hf_logits(hf, prompts[r].tolist() + path)[-1]
            assert rel(out.logits[lo + node], expect) <= TOL, (r, node)
    accepted = [int(trees[0].depth.argmax()), 4]
    model.commit(cache, out, accepted)
    nxt = torch.randint(0, 64, (2,), generator=gen)
    step = model.decode(cache, slots, nxt)
    for r, tree in enumerate(trees):
        lo = int(forest.cu_nodes[r])
        ids = prompts[r].tolist() + tokens[tree.path(accepted[r]) + lo].tolist() + [int(nxt[r])]
        assert rel(step[r], hf_logits(hf, ids)[-1]) <= TOL
        assert int(cache.lengths[slots[r]]) == len(ids)


def test_cache_errors(pair):
    _, model = pair
    cache = model.new_cache(max_slots=1, max_len=8)
    with pytest.raises(CacheFull, match="does not fit"):
        cache.allocate(9)
    slot = cache.allocate(8)
    with pytest.raises(CacheFull, match="all 1 cache slots are in use"):
        cache.allocate(1)
    with pytest.raises(ValueError, match="past the cache"):
        model.prefill(cache, slot, torch.arange(9))
    with pytest.raises(ValueError, match="token ids"):
        model.decode(cache, [slot], torch.tensor([999]))
    cache.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        model.decode(cache, [slot], torch.tensor([1]))
    again = cache.allocate(4)                       # freed slots come back zeroed
    assert int(cache.lengths[again]) == 0 and not cache.gdn_state[:, again].any()


def test_chain_prefill_plumbing(pair):
    """The fla prefill path (used on GPUs with fla) wired to a stand-in with fla's signature."""
    from bole.ops.gdn.reference import chain_gdn_recurrent
    hf, model = pair

    def fake_fla(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        assert output_final_state and use_qk_l2norm_in_kernel
        return chain_gdn_recurrent(q, k, v, g, beta, initial_state=initial_state,
                                   use_qk_l2norm_in_kernel=True)

    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 64, (13,), generator=gen)
    saved = model.prefill_gdn
    model.prefill_gdn = fake_fla
    try:
        cache = model.new_cache(1, 64)
        slot = cache.allocate(32)
        logits = model.prefill(cache, slot, prompt, chunk=5)
        step = model.decode(cache, [slot], torch.tensor([3]))
    finally:
        model.prefill_gdn = saved
    assert rel(logits, hf_logits(hf, prompt.tolist())) <= TOL
    assert rel(step[0], hf_logits(hf, prompt.tolist() + [3])[-1]) <= TOL


def test_layers_make_no_device_sync(pair):
    """On a GPU, no layer of a tree forward synchronises the device: the slots, positions and
    kernel metadata reach it once per forward (a Python list as a cache index, or a host tensor
    moved per layer, is a pageable host-to-device copy, which waits for the stream)."""
    _, model = pair
    if model.device.type != "cuda":
        pytest.skip("CUDA's sync debug mode needs the model on a GPU")
    gen = torch.Generator().manual_seed(6)
    cache = model.new_cache(max_slots=2, max_len=64)
    slots = [cache.allocate(32) for _ in range(2)]
    for s in slots:
        model.prefill(cache, s, torch.randint(0, 64, (5,), generator=gen))
    forest = PackedForest.pack([DraftTree.full_kary(2, 2), DraftTree.chain(4)])
    out = model.forward_tree(cache, slots, forest,
                             torch.randint(0, 64, (forest.num_nodes,), generator=gen))
    positions = forest.positions(cache.lengths[slots]).to(model.device)
    x = out.hidden.to(model.dtype)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(model.config.num_hidden_layers):
            if model.config.is_full_attention(layer):
                model._attention(layer, x, cache, out, positions)
            else:
                model._gdn(layer, x, cache, out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
