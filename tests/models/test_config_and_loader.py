"""Config parsing and checkpoint loading against checkpoints written by transformers itself."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)

transformers = pytest.importorskip("transformers")

from bole.models.config import SUPPORTED_MODEL_TYPES, HybridConfig  # noqa: E402
from bole.models.loader import CheckpointError, load_checkpoint  # noqa: E402
from bole.models.weights import IGNORED_PREFIXES, mtp_specs, text_model_specs  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8)
#: the shared expert as wide as the experts, as in every published Qwen MoE hybrid (bole merges
#: it into the expert kernels); "qwen3_next_wide_shared" keeps a wider one apart
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)


def build(kind):
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)
    from transformers.models.qwen3_5_moe import (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig)
    torch.manual_seed(0)
    if kind == "qwen3_5_text":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL, intermediate_size=48))
    if kind == "qwen3_5_text_tied":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL, intermediate_size=48,
                                                    tie_word_embeddings=True))
    if kind == "qwen3_5":
        return Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=dict(**SMALL, intermediate_size=48), vision_config=VISION))
    if kind == "qwen3_5_moe_text":
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**SMALL, **MOE))
    if kind == "qwen3_next":
        return Qwen3NextForCausalLM(Qwen3NextConfig(**SMALL, **MOE, intermediate_size=48))
    if kind == "qwen3_next_wide_shared":
        return Qwen3NextForCausalLM(Qwen3NextConfig(
            **SMALL, **{**MOE, "shared_expert_intermediate_size": 24}, intermediate_size=48))
    raise ValueError(kind)


KINDS = ["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_next"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for kind in KINDS:
        path = root / kind
        build(kind).save_pretrained(path)
        out[kind] = path
    sharded = root / "qwen3_5_text_sharded"
    build("qwen3_5_text").save_pretrained(sharded, max_shard_size="20KB")
    out["sharded"] = sharded
    return out


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("kind", KINDS)
def test_specs_equal_transformers_checkpoints(checkpoints, kind):
    cfg = HybridConfig.from_pretrained(checkpoints[kind])
    assert cfg.model_type == kind
    on_disk = load_file(str(checkpoints[kind] / "model.safetensors"))
    names = {n: tuple(t.shape) for n, t in on_disk.items() if not n.startswith(IGNORED_PREFIXES)}
    assert text_model_specs(cfg) == names


@pytest.mark.parametrize("kind", KINDS)
def test_load_in_dtype_with_fp32_gates(checkpoints, kind):
    tensors, report = load_checkpoint(checkpoints[kind], dtype=torch.bfloat16)
    assert report.loaded == len(tensors) and not report.problems and not report.has_mtp
    cfg = HybridConfig.from_pretrained(checkpoints[kind])
    a_log = tensors[f"{cfg.weight_prefix}layers.0.linear_attn.A_log"]
    assert a_log.dtype == torch.float32
    emb = tensors[f"{cfg.weight_prefix}embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16
    raw = load_file(str(checkpoints[kind] / "model.safetensors"))
    assert torch.equal(emb, raw[f"{cfg.weight_prefix}embed_tokens.weight"].bfloat16())
    assert report.ignored == (sum(n.startswith(IGNORED_PREFIXES) for n in raw))


def test_config_fields(checkpoints):
    c = HybridConfig.from_pretrained(checkpoints["qwen3_5"])
    assert c.family == "qwen3_5" and c.weight_prefix == "model.language_model."
    assert c.full_attention_layers == (3,) and c.gdn_layers == (0, 1, 2)
    assert c.rotary_dim == 4 and c.conv_dim == 2 * 2 * 8 + 4 * 8
    n = HybridConfig.from_pretrained(checkpoints["qwen3_next"])
    assert n.family == "qwen3_next" and n.num_experts == 4 and all(map(n.is_moe_layer, range(4)))
    assert n.gdn_shape().num_v_heads == 4


def test_sharded_checkpoint(checkpoints):
    assert (checkpoints["sharded"] / "model.safetensors.index.json").is_file()
    tensors, report = load_checkpoint(checkpoints["sharded"], dtype=torch.float32)
    assert len(report.files) > 1 and report.loaded == len(tensors)


def test_mtp_head_is_loaded_when_present(checkpoints, tmp_path):
    path = copy(checkpoints["qwen3_5"], tmp_path / "mtp")
    cfg = HybridConfig.from_pretrained(path)
    extra = {n: torch.randn(s) for n, s in mtp_specs(cfg, num_layers=1).items()}
    save_file(extra, str(path / "mtp.safetensors"))
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in
                                            load_file(str(path / "model.safetensors"))}}
    index["weight_map"].update({n: "mtp.safetensors" for n in extra})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    tensors, report = load_checkpoint(path)
    assert report.has_mtp and "mtp.fc.weight" in tensors
    assert "mtp.layers.0.self_attn.q_proj.weight" in tensors


# ---- broken checkpoints: each error names the file and the tensor ----

def rewrite(path, edit):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_tensor(checkpoints, tmp_path):
    path = copy(checkpoints["qwen3_5_text"], tmp_path / "m")
    rewrite(path, lambda t: t.pop("model.layers.3.self_attn.q_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.3\.self_attn\.q_norm"):
        load_checkpoint(path)


def test_mis_shaped_tensor(checkpoints, tmp_path):
    path = copy(checkpoints["qwen3_next"], tmp_path / "m")
    rewrite(path, lambda t: t.update({"model.layers.1.linear_attn.in_proj_ba.weight": torch.zeros(7, 32)}))
    with pytest.raises(CheckpointError, match=r"mis-shaped tensor model\.layers\.1\.linear_attn\."
                       r"in_proj_ba\.weight in model\.safetensors: \[7, 32\], expected \[8, 32\]"):
        load_checkpoint(path)


def test_unexpected_tensor(checkpoints, tmp_path):
    path = copy(checkpoints["qwen3_5_text"], tmp_path / "m")
    rewrite(path, lambda t: t.update({"model.layers.9.mystery.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.9\.mystery\.weight "
                       r"in model\.safetensors"):
        load_checkpoint(path)


def test_truncated_file(checkpoints, tmp_path):
    path = copy(checkpoints["qwen3_5_text"], tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or corrupt"):
        load_checkpoint(path)


def test_shard_lacking_an_indexed_tensor(checkpoints, tmp_path):
    path = copy(checkpoints["sharded"], tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, fname = next(iter(index["weight_map"].items()))
    shard = load_file(str(path / fname))
    shard.pop(name)
    save_file(shard, str(path / fname), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing tensor {name}: the index maps it to {fname}"):
        load_checkpoint(path)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'.*qwen3_5.*qwen3_next"):
        HybridConfig.from_pretrained(tmp_path)
    assert set(SUPPORTED_MODEL_TYPES) >= {"qwen3_5_text", "qwen3_5", "qwen3_5_moe", "qwen3_next"}


def test_not_a_checkpoint(tmp_path, checkpoints):
    with pytest.raises(FileNotFoundError, match="config.json"):
        HybridConfig.from_pretrained(tmp_path)
    shutil.copy(checkpoints["qwen3_5_text"] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(checkpoints["qwen3_5_text"], dtype=torch.int8)
