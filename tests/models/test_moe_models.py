"""Mixture-of-experts checkpoints (Qwen3.5-MoE, Qwen3-Next) against transformers as the oracle.

Tiny random checkpoints written by transformers' own classes, with an MTP head added: loaded in
either expert layout (per expert, as transformers writes them, or fused, as Qwen publishes
Qwen3.5-MoE), their greedy output equals transformers' in all four modes (ar, chain, tree-serial,
bole) with the MTP head drafting, through the torch expert loop and the fused kernels
(interpreted on CPU, compiled on a GPU). fp32.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)
pytest.importorskip("transformers")

from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.engine.runner import ModelRunner  # noqa: E402
from bole.models.config import HybridConfig  # noqa: E402
from bole.models.loader import CheckpointError, load_checkpoint  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.models.weights import FUSED_DOWN, FUSED_GATE_UP, mtp_specs  # noqa: E402
from tests.models.test_config_and_loader import build  # noqa: E402

MOE_KINDS = ["qwen3_5_moe_text", "qwen3_next", "qwen3_next_wide_shared"]
PROMPTS = [[3, 14, 15, 9, 26, 5], [7, 7, 1]]
MAX_TOKENS = 10
MODES = ("ar", "chain", "tree-serial", "bole")
#: where the fused kernels run: compiled on a GPU, else interpreted on the CPU (conftest)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _add_mtp_head(path, seed=11):
    """A random one-layer MTP head (its MLP a mixture of experts, per expert) in its own file."""
    cfg = HybridConfig.from_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    head = {n: (torch.randn(s, generator=gen) * 0.1 if len(s) > 1 else torch.zeros(s))
            for n, s in mtp_specs(cfg, num_layers=1).items()}
    save_file(head, str(path / "mtp.safetensors"))
    weight_map = {n: "model.safetensors" for n in load_file(str(path / "model.safetensors"))}
    weight_map.update({n: "mtp.safetensors" for n in head})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def _fuse_experts(src, dst, files=None):
    """A copy of checkpoint ``src`` with every MoE layer's experts in the fused layout (only in
    ``files`` when given)."""
    shutil.copytree(src, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else \
        {"metadata": {}, "weight_map": {n: "model.safetensors"
                                        for n in load_file(str(dst / "model.safetensors"))}}
    for fname in files or set(index["weight_map"].values()):
        tensors = load_file(str(dst / fname))
        prefixes = sorted({n[: n.index("experts.")] for n in tensors if ".mlp.experts." in n})
        for p in prefixes:
            E = len({n for n in tensors if n.startswith(p + "experts.") and "gate_proj" in n})
            gate_up = [torch.cat([tensors.pop(f"{p}experts.{e}.gate_proj.weight"),
                                  tensors.pop(f"{p}experts.{e}.up_proj.weight")]) for e in range(E)]
            down = [tensors.pop(f"{p}experts.{e}.down_proj.weight") for e in range(E)]
            tensors[p + FUSED_GATE_UP] = torch.stack(gate_up)
            tensors[p + FUSED_DOWN] = torch.stack(down)
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != fname}
        index["weight_map"].update({n: fname for n in tensors})
    index_file.write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module", params=MOE_KINDS)
def checkpoint(request, tmp_path_factory):
    """(kind, transformers model, per-expert folder, fused folder), each with an MTP head."""
    kind = request.param
    hf = build(kind).eval()
    path = tmp_path_factory.mktemp(kind) / "per_expert"
    hf.save_pretrained(path)
    _add_mtp_head(path)
    fused = _fuse_experts(path, path.parent / "fused")
    return kind, hf, path, fused


def hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_both_expert_layouts_load_to_the_same_stacked_weights(checkpoint):
    kind, _, per_expert, fused = checkpoint
    a = HybridModel.from_pretrained(per_expert, dtype=torch.float32)
    b = HybridModel.from_pretrained(fused, dtype=torch.float32)
    assert a.has_mtp_head and b.has_mtp_head
    assert a.w.keys() == b.w.keys()
    assert all(torch.equal(a.w[n], b.w[n]) for n in a.w)
    cfg = a.config
    stacked = [n for n in a.w if n.endswith(FUSED_GATE_UP)]
    assert len(stacked) == sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))) + 1  # + MTP
    assert not any(".experts.0." in n for n in a.w)
    raw = load_file(str(per_expert / "model.safetensors"))
    p = f"{cfg.weight_prefix}layers.1.mlp."
    F_ = cfg.moe_intermediate_size
    assert torch.equal(a.w[p + FUSED_GATE_UP][2, :F_], raw[p + "experts.2.gate_proj.weight"])
    assert torch.equal(a.w[p + FUSED_GATE_UP][2, F_:], raw[p + "experts.2.up_proj.weight"])
    assert torch.equal(a.w[p + FUSED_DOWN][3], raw[p + "experts.3.down_proj.weight"])


@pytest.mark.parametrize("which", ["model.safetensors", "mtp.safetensors"])
def test_text_model_and_mtp_head_in_different_layouts(checkpoint, tmp_path, which):
    kind, _, per_expert, _ = checkpoint
    mixed = _fuse_experts(per_expert, tmp_path / "mixed", files=[which])
    a = HybridModel.from_pretrained(per_expert, dtype=torch.float32)
    b = HybridModel.from_pretrained(mixed, dtype=torch.float32)
    assert a.w.keys() == b.w.keys() and all(torch.equal(a.w[n], b.w[n]) for n in a.w)


def test_transformers_reads_the_fused_layout(checkpoint):
    kind, hf, _, fused = checkpoint
    cls = type(hf)
    again = cls.from_pretrained(fused, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, hf(input_ids=ids).logits)


@pytest.mark.parametrize("layout,moe_backend", [("per_expert", "torch"), ("fused", "torch"),
                                                ("fused", "triton")])
def test_greedy_output_equals_transformers_in_all_four_modes(checkpoint, layout, moe_backend):
    kind, hf, per_expert, fused = checkpoint
    if moe_backend == "triton" and kind != "qwen3_5_moe_text":
        pytest.skip("the interpreted kernels run on one checkpoint (each launch costs ms)")
    path = per_expert if layout == "per_expert" else fused
    device = KERNEL_DEVICE if moe_backend == "triton" else "cpu"
    model = HybridModel.from_pretrained(path, dtype=torch.float32, device=device,
                                        moe_backend=moe_backend)
    assert model.graph_safe == (moe_backend == "triton")
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for mode in MODES:
        spec = SpecConfig(mode, "mtp", depth=3, topk=2, budget=6) if mode != "ar" else \
            SpecConfig(mode="ar")
        engine = Engine(model, spec, max_slots=2, max_len=64)
        got = [r.token_ids for r in engine.generate(PROMPTS, params)]
        assert got == want, (mode, kind, layout, moe_backend)


def verify_logits_by_backend(folder, monkeypatch, on_model=None) -> dict:
    """One tree-verify forward of checkpoint ``folder`` (both PROMPTS prefilled) through the
    torch loop, the kernels' grouped GEMMs and their matrix-vector path (interpreted on CPU,
    compiled on a GPU): the logits by backend. ``on_model(model)`` sees each model loaded."""
    from bole.ops.moe import GemvConfig, grouped_gemm
    from bole.tree import DraftTree, PackedForest
    logits = {}
    for backend in ("torch", "triton", "gemv"):
        if backend == "gemv":
            tiles = GemvConfig(block_n=8, block_k=16, num_warps=1, num_stages=1,
                               down_block_n=16, down_block_k=8, down_num_warps=1)
            monkeypatch.setattr(grouped_gemm, "pick_moe_config", lambda *a: tiles)
        model = HybridModel.from_pretrained(folder, dtype=torch.float32, device=KERNEL_DEVICE,
                                            moe_backend="torch" if backend == "torch" else "triton")
        if on_model is not None:
            on_model(model)
        runner = ModelRunner(model, model.new_cache(2, 64), "torch")
        slots = [runner.cache.allocate(32) for _ in PROMPTS]
        for s, p in zip(slots, PROMPTS):
            runner.prefill(s, torch.tensor(p))
        forest = PackedForest.pack([DraftTree.full_kary(2, 2), DraftTree.chain(4)])
        tokens = torch.arange(forest.num_nodes) % 60
        _, out = runner.verify(slots, forest, tokens)
        logits[backend] = out.logits.cpu()
    return logits


def test_fused_kernels_equal_the_expert_loop_in_a_verify_forward(checkpoint, monkeypatch):
    """The grouped GEMMs and the matrix-vector kernels against the torch loop in a verify
    forward; the shared expert merged where it is as wide as the experts."""
    kind, _, _, fused = checkpoint

    def merged(model):
        is_merged = any(n.endswith("experts.all_gate_up_proj") for n in model.w)
        assert is_merged == (kind != "qwen3_next_wide_shared")
    logits = verify_logits_by_backend(fused, monkeypatch, merged)
    assert torch.allclose(logits["triton"], logits["torch"], atol=1e-5, rtol=1e-5)
    assert torch.allclose(logits["gemv"], logits["torch"], atol=1e-5, rtol=1e-5)


# ---- malformed MoE checkpoints: the error names the tensor ----

def test_mis_shaped_fused_experts(checkpoint, tmp_path):
    kind, _, _, fused = checkpoint
    path = shutil.copytree(fused, tmp_path / "m")
    cfg = HybridConfig.from_pretrained(path)
    name = f"{cfg.weight_prefix}layers.0.mlp.{FUSED_GATE_UP}"
    t = load_file(str(path / "model.safetensors"))
    t[name] = t[name][:, :-1].contiguous()
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    E, F2, H = cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size
    with pytest.raises(CheckpointError, match=rf"mis-shaped tensor {name.replace('.', '[.]')} in "
                       rf"model\.safetensors: \[{E}, {F2 - 1}, {H}\], expected \[{E}, {F2}, {H}\]"):
        load_checkpoint(path)


def test_missing_expert(checkpoint, tmp_path):
    kind, _, per_expert, _ = checkpoint
    path = shutil.copytree(per_expert, tmp_path / "m")
    cfg = HybridConfig.from_pretrained(path)
    name = f"{cfg.weight_prefix}layers.2.mlp.experts.3.up_proj.weight"
    t = load_file(str(path / "model.safetensors"))
    t.pop(name)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].pop(name)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"missing tensor {name.replace('.', '[.]')}"):
        load_checkpoint(path)


def test_moe_presets_follow_the_published_configs():
    a = preset_config("qwen3.5-35b-a3b")
    assert (a.num_hidden_layers, len(a.gdn_layers), a.hidden_size, a.vocab_size) == \
        (40, 30, 2048, 248320)
    assert (a.linear_num_key_heads, a.linear_num_value_heads, a.num_attention_heads,
            a.num_key_value_heads, a.head_dim) == (16, 32, 16, 2, 256)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size,
            a.shared_expert_intermediate_size) == (256, 8, 512, 512)
    b = preset_config("qwen3.5-122b-a10b")
    assert (b.num_hidden_layers, b.hidden_size, b.num_attention_heads, b.num_key_value_heads,
            b.linear_num_value_heads, b.num_experts, b.num_experts_per_tok,
            b.moe_intermediate_size) == (48, 3072, 32, 2, 64, 256, 8, 1024)
    n = preset_config("qwen3-next-80b-a3b")
    assert (n.family, n.num_experts, n.num_experts_per_tok, n.vocab_size) == \
        ("qwen3_next", 512, 10, 151936)
    for cfg in (a, b, n):
        assert all(map(cfg.is_moe_layer, range(cfg.num_hidden_layers)))
        assert cfg.full_attention_layers == tuple(range(3, cfg.num_hidden_layers, 4))


def test_random_moe_model_is_stacked_and_graph_safe_with_the_kernels():
    cfg = preset_config("tiny-moe")
    m = HybridModel.random(cfg, dtype=torch.float32, device=KERNEL_DEVICE, mtp=True,
                           moe_backend="triton")
    assert m.graph_safe and "mtp.layers.0.mlp." + FUSED_GATE_UP in m.w
    assert m.w[f"model.layers.0.mlp.{FUSED_DOWN}"].shape == (8, 64, 32)
    assert not HybridModel(cfg, m.w, moe_backend="torch").graph_safe
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        HybridModel(cfg, m.w, moe_backend="cutlass")


def test_vision_language_moe_checkpoint_in_the_published_layout(tmp_path):
    """A qwen3_5_moe (vision-language) checkpoint as Qwen publishes it: the text model under
    ``model.language_model.``, the experts fused, the vision tower ignored."""
    from transformers.models.qwen3_5_moe import (Qwen3_5MoeConfig,
                                                 Qwen3_5MoeForConditionalGeneration)
    from tests.models.test_config_and_loader import MOE, SMALL, VISION
    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=dict(**SMALL, **MOE), vision_config=VISION)).eval()
    hf.save_pretrained(tmp_path / "vl")
    path = _fuse_experts(tmp_path / "vl", tmp_path / "vl_fused")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.mlp." + FUSED_GATE_UP in names
    model = HybridModel.from_pretrained(path, dtype=torch.float32)
    assert model.config.weight_prefix == "model.language_model."
    runner = ModelRunner(model, model.new_cache(1, 32), "torch")
    slot = runner.cache.allocate(16)
    _, hidden = runner.prefill(slot, torch.tensor(PROMPTS[0]))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    assert torch.allclose(model.lm_head(hidden), want, atol=1e-5, rtol=1e-4)


def test_model_forward_bench_counts_the_experts_a_forward_touches():
    """bench/model_forward.py's device-side count against the routing read on the host."""
    from bench.model_forward import touched_expert_bytes
    cfg = preset_config("tiny-moe")
    model = HybridModel.random(cfg, dtype=torch.float32, seed=3)
    runner = ModelRunner(model, model.new_cache(1, 32), "torch")
    slot = runner.cache.allocate(16)
    seen = []
    routing = model.moe_routing

    def spy(x, p):
        out = routing(x, p)
        seen.append(len(torch.unique(out[1])))
        return out
    model.moe_routing = spy
    fwd = lambda: runner.prefill(slot, torch.tensor([5, 9, 2]))          # noqa: E731
    fwd()
    del model.moe_routing
    runner.cache.free(slot)
    slot = runner.cache.allocate(16)
    nbytes, mean, params = touched_expert_bytes(model, fwd)
    assert len(seen) == cfg.num_hidden_layers and 2 <= max(seen) <= 6
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert nbytes == sum(seen) * per_expert * 4
    assert mean == sum(seen) / len(seen) and params == cfg.num_hidden_layers * per_expert
    assert "moe_routing" not in model.__dict__          # the bench restores the method


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_slices_of_both_layouts_agree(checkpoint, rank):
    """Rank ``rank`` of 2 reads the same expert columns from a per-expert and a fused
    checkpoint (fused gate_up_proj cut along dim 1 in both halves, down_proj along dim 2)."""
    from bole.distributed import TPShard
    kind, _, per_expert, fused = checkpoint
    shard = TPShard(rank, 2)
    a, _ = load_checkpoint(per_expert, dtype=torch.float32, shard=shard)
    b, _ = load_checkpoint(fused, dtype=torch.float32, shard=shard)
    cfg = HybridConfig.from_pretrained(fused)
    half = cfg.moe_intermediate_size // 2
    for layer in ("mtp.layers.0.", f"{cfg.weight_prefix}layers.2."):
        p = layer + "mlp."
        w13, w2 = b[p + FUSED_GATE_UP], b[p + FUSED_DOWN]
        assert w13.shape == (cfg.num_experts, 2 * half, cfg.hidden_size)
        assert w2.shape == (cfg.num_experts, cfg.hidden_size, half)
        for e in range(cfg.num_experts):
            assert torch.equal(w13[e, :half], a[f"{p}experts.{e}.gate_proj.weight"])
            assert torch.equal(w13[e, half:], a[f"{p}experts.{e}.up_proj.weight"])
            assert torch.equal(w2[e], a[f"{p}experts.{e}.down_proj.weight"])


@pytest.mark.parametrize("kind", ["qwen3_5_moe_text", "qwen3_next"])
def test_router_renormalisation_follows_transformers(kind, tmp_path):
    """Qwen3-Next renormalises the top-k weights only with norm_topk_prob; transformers'
    Qwen3.5-MoE router always does, whatever the config says."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from tests.models.test_config_and_loader import MOE, SMALL
    torch.manual_seed(1)
    if kind == "qwen3_next":
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**SMALL, **MOE, intermediate_size=48,
                                                  norm_topk_prob=False))
    else:
        hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**SMALL, **MOE, norm_topk_prob=False))
    hf.eval().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["norm_topk_prob"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = HybridModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.norm_topk_prob == (kind != "qwen3_next")
    runner = ModelRunner(model, model.new_cache(1, 32), "torch")
    slot = runner.cache.allocate(16)
    _, hidden = runner.prefill(slot, torch.tensor(PROMPTS[0]))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    assert torch.allclose(model.lm_head(hidden), want, atol=1e-5, rtol=1e-4)


# ---- on a GPU: the fused kernels compiled, rounds captured, no eager fallback ----

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_moe_rounds_are_captured_without_eager_fallback_and_equal_transformers(checkpoint):
    kind, hf, _, fused = checkpoint
    model = HybridModel.from_pretrained(fused, dtype=torch.float32, device="cuda")
    assert model.moe_backend == "triton" and model.graph_safe
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for mode in MODES:
        spec = SpecConfig(mode, "mtp", depth=3, topk=2, budget=6) if mode != "ar" else \
            SpecConfig(mode="ar")
        engine = Engine(model, spec, max_slots=2, max_len=64, cuda_graphs=True)
        got = [r.token_ids for r in engine.generate(PROMPTS, params)]
        assert got == want, (mode, kind)
        stats = engine.rounds.graphs.stats
        assert stats["eager_fallbacks"] == 0 and stats["graph_replays"] > 0, (mode, stats)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_moe_forward_makes_no_device_sync(checkpoint):
    from bole.forest import DenseForest
    from bole.tree import DraftTree, PackedForest
    _, _, _, fused = checkpoint
    model = HybridModel.from_pretrained(fused, dtype=torch.float32, device="cuda")
    runner = ModelRunner(model, model.new_cache(2, 64), "triton")
    slots = [runner.cache.allocate(32) for _ in PROMPTS]
    for s, p in zip(slots, PROMPTS):
        runner.prefill(s, torch.tensor(p))
    dense = DenseForest.from_packed(
        PackedForest.pack([DraftTree.full_kary(2, 2), DraftTree.chain(4)]), device="cuda")
    tokens = torch.randint(0, 60, (dense.num_nodes,), device="cuda")
    slot_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    batch = runner.make_batch(tokens, DenseForest.from_parents(dense.parents, dense.valid,
                                                               dense.max_depth), slot_t)
    runner.forward(batch)                     # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
