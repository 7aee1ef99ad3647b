"""FP8 checkpoints in the published format (float8 e4m3 weights, ``<name>_scale_inv`` block
scales, ``quantization_config``): loaded, and greedy-equal to their dequantized twins in all four
modes (fp32, CPU; the FP8 products through the Triton kernels under the interpreter)."""

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.models.config import HybridConfig, fp8_block  # noqa: E402
from bole.models.loader import CheckpointError, load_checkpoint  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.models.weights import SCALE_SUFFIX, fp8_quantized  # noqa: E402
from bole.ops.fp8 import Fp8Weight, StackedWeight, quantize_blockwise  # noqa: E402
from tests.models.test_config_and_loader import build  # noqa: E402
from tests.models.test_moe_models import _add_mtp_head, verify_logits_by_backend  # noqa: E402

BLOCK = [16, 16]
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": BLOCK}
PROMPTS = [[3, 14, 15, 9, 26, 5], [7, 7, 1]]
MODES = ("ar", "chain", "tree-serial", "bole")


def _files(path):
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text()), sorted(set(json.loads(index.read_text())
                                                         ["weight_map"].values()))
    return None, ["model.safetensors"]


def to_fp8_and_twin(src, fp8_dir, twin_dir):
    """``src`` quantized as Qwen's FP8 releases are (bf16 scales) into ``fp8_dir``, and its
    twin with the dequantized weights (fp32, no quantization_config) into ``twin_dir``."""
    for d in (fp8_dir, twin_dir):
        shutil.copytree(src, d)
    index, files = _files(src)
    quantized = 0
    for fname in files:
        fp8, twin = {}, {}
        for name, t in load_file(str(src / fname)).items():
            if fp8_quantized(name) and t.dim() == 2:
                fw = quantize_blockwise(t.float(), tuple(BLOCK))
                fp8[name], fp8[name + SCALE_SUFFIX] = fw.q, fw.scale.bfloat16()
                twin[name] = fw.dequantize()
                quantized += 1
            else:
                fp8[name] = twin[name] = t
        save_file(fp8, str(fp8_dir / fname), metadata={"format": "pt"})
        save_file(twin, str(twin_dir / fname), metadata={"format": "pt"})
        if index is not None:
            index["weight_map"].update({n: fname for n in fp8})
    if index is not None:
        (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    raw = json.loads((src / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**raw, "quantization_config": QUANT}))
    return quantized


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def fp8_checkpoint(request, tmp_path_factory):
    """(kind, FP8 folder, dequantized twin folder), each with an MTP head."""
    root = tmp_path_factory.mktemp(request.param)
    build(request.param).save_pretrained(root / "src")
    _add_mtp_head(root / "src")
    assert to_fp8_and_twin(root / "src", root / "fp8", root / "twin") > 0
    return request.param, root / "fp8", root / "twin"


def test_fp8_checkpoint_loads_fp8_weights_and_keeps_the_rest(fp8_checkpoint):
    kind, fp8, _ = fp8_checkpoint
    tensors, report = load_checkpoint(fp8, dtype=torch.float32)
    assert not report.problems and report.has_mtp
    cfg = HybridConfig.from_pretrained(fp8)
    assert cfg.fp8_block == (16, 16)
    for name, t in tensors.items():
        assert isinstance(t, Fp8Weight) == (fp8_quantized(name) and len(t.shape) == 2), name
    raw = load_file(str(fp8 / "model.safetensors")) if (fp8 / "model.safetensors").is_file() \
        else {}
    for name, t in tensors.items():
        if isinstance(t, Fp8Weight) and name in raw:
            assert torch.equal(t.q.float(), raw[name].float())
            assert torch.equal(t.scale, raw[name + SCALE_SUFFIX].float())
    model = HybridModel.from_pretrained(fp8, dtype=torch.float32)
    p = f"{cfg.weight_prefix}layers.0.linear_attn."
    fused = model.w[p + ("in_proj_qkvzba.weight" if kind == "qwen3_next" else "in_proj_all.weight")]
    assert isinstance(fused, StackedWeight)          # FP8 qkv(z) and bf16 b / a in one call
    assert isinstance(fused.parts[0], Fp8Weight) and not isinstance(fused.parts[1], Fp8Weight)


def test_fp8_greedy_output_equals_the_dequantized_twin_in_all_four_modes(fp8_checkpoint):
    kind, fp8, twin = fp8_checkpoint
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = {}
    for name, path in (("fp8", fp8), ("twin", twin)):
        model = HybridModel.from_pretrained(path, dtype=torch.float32)
        model.w["lm_head.weight"] = model.w["lm_head.weight"] * 50     # clear greedy margins
        for mode in MODES:
            spec = SpecConfig(mode, "mtp", depth=3, topk=2, budget=6) if mode != "ar" else \
                SpecConfig(mode="ar")
            engine = Engine(model, spec, max_slots=2, max_len=64)
            outputs[name, mode] = [r.token_ids for r in engine.generate(PROMPTS, params)]
    for mode in MODES:
        assert outputs["fp8", mode] == outputs["twin", "ar"], (kind, mode)


def test_unsupported_quantization_configs_are_named():
    for quant, match in (({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
                         ({"quant_method": "fp8"}, "per-tensor FP8 is not supported"),
                         ({**QUANT, "fmt": "e5m2"}, "fmt 'e5m2'"),
                         ({**QUANT, "activation_scheme": "static"}, "static activation")):
        with pytest.raises(ValueError, match=match):
            fp8_block(quant)
    assert fp8_block(QUANT) == (16, 16) and fp8_block(None) is None


def test_malformed_fp8_tensors_are_named(fp8_checkpoint, tmp_path):
    kind, fp8, _ = fp8_checkpoint
    if kind != "qwen3_5_text":
        pytest.skip("one checkpoint is enough")
    bad = shutil.copytree(fp8, tmp_path / "bad")
    path = bad / "model.safetensors"
    tensors = load_file(str(path))
    name = next(n for n in tensors if n.endswith("self_attn.q_proj.weight"))
    tensors[name + SCALE_SUFFIX] = tensors[name + SCALE_SUFFIX][:1]
    other = next(n for n in tensors if n.endswith("linear_attn.out_proj.weight"))
    del tensors[other + SCALE_SUFFIX]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:          # the index still names the scale
        load_checkpoint(bad, dtype=torch.float32)
    msg = str(err.value)
    assert f"{name}{SCALE_SUFFIX}" in msg and "has scales of shape" in msg
    assert f"missing tensor {other}{SCALE_SUFFIX}: the index maps it to model.safetensors" in msg
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"][other + SCALE_SUFFIX]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:          # nothing names it
        load_checkpoint(bad, dtype=torch.float32)
    assert f"{other} in model.safetensors is torch.float8_e4m3fn without a scale" in str(err.value)


def test_fp8_under_tensor_parallelism_is_refused(fp8_checkpoint):
    from bole.distributed import TPShard
    _, fp8, _ = fp8_checkpoint
    with pytest.raises(CheckpointError, match="tensor parallelism over FP8"):
        load_checkpoint(fp8, shard=TPShard(0, 2))


def test_fp8_presets_quantize_the_published_projections():
    cfg = preset_config("tiny-moe-fp8")
    assert cfg.fp8_block == (128, 128)
    model = HybridModel.random(cfg, dtype=torch.float32, mtp=True)
    fp8 = {n for n, t in model.w.items() if isinstance(t, Fp8Weight)}
    assert any(n.endswith("experts.all_gate_up_proj") or n.endswith("experts.gate_up_proj")
               for n in fp8)
    assert not any(n.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight",
                               "in_proj_b.weight", "in_proj_a.weight")) for n in fp8)
    runner_out = model.lm_head(model.embed(torch.tensor([1, 2, 3])))
    assert torch.isfinite(runner_out).all()
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("tiny-fp16")


def test_fp8_experts_through_the_kernels_equal_the_expert_loop(fp8_checkpoint, monkeypatch):
    """A verify forward of the FP8 MoE checkpoints with the fused kernels (interpreted on the
    CPU; both paths: grouped GEMMs, and the matrix-vector kernels) against the torch loop over
    dequantized experts."""
    kind, fp8, _ = fp8_checkpoint
    if kind == "qwen3_5_text":
        pytest.skip("dense: no experts")
    logits = verify_logits_by_backend(fp8, monkeypatch)
    assert torch.allclose(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    assert torch.allclose(logits["gemv"], logits["torch"], atol=1e-4, rtol=1e-4)
