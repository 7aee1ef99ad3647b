"""Configurations of real models for random-weight runs (benchmarks need no checkpoint).

The GDN layers' shapes come from :data:`bole.config.GDN_SHAPES` (one table for demos, memory
accounting and presets); the rest (hidden size, attention heads, MLP, vocabulary) is the models'
own, as in docs/design.md section 4. Fields that do not change the cost of a forward (rope
theta, token ids) keep transformers' defaults.
"""

from __future__ import annotations

from bole.config import GDN_SHAPES
from bole.models.config import HybridConfig

#: one full-attention layer after every three GDN layers, in every supported Qwen hybrid
FULL_ATTENTION_INTERVAL = 4
_ATTENTION = dict(head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=262144,
                  rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                   "rope_type": "default"})


def _hybrid(shape: str) -> dict:
    """The GDN part of a preset (and the layer count it implies) from ``GDN_SHAPES[shape]``."""
    s = GDN_SHAPES[shape]
    n = FULL_ATTENTION_INTERVAL
    return dict(linear_num_key_heads=s.num_k_heads, linear_num_value_heads=s.num_v_heads,
                linear_key_head_dim=s.head_k_dim, linear_value_head_dim=s.head_v_dim,
                linear_conv_kernel_dim=s.conv_kernel, full_attention_interval=n,
                num_hidden_layers=s.num_gdn_layers * n // (n - 1), **_ATTENTION)


def _gdn(num_hidden_layers: int, key_heads: int, value_heads: int) -> dict:
    """The GDN part of a preset not in ``GDN_SHAPES`` (head dims 128, conv 4)."""
    return dict(linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                full_attention_interval=FULL_ATTENTION_INTERVAL,
                num_hidden_layers=num_hidden_layers, **_ATTENTION)


PRESETS: dict[str, dict] = {
    "qwen3.5-4b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560,
                       num_attention_heads=16, num_key_value_heads=4, intermediate_size=9216,
                       tie_word_embeddings=True, **_hybrid("qwen3.5-4b")),
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096,
                       num_attention_heads=16, num_key_value_heads=4, intermediate_size=12288,
                       **_hybrid("qwen3.5-9b")),
    "qwen3.5-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120,
                        num_attention_heads=24, num_key_value_heads=4, intermediate_size=17408,
                        **_hybrid("qwen3.5-27b")),
    # Qwen/Qwen3-Next-80B-A3B-Instruct, config.json on the Hugging Face Hub (model_type
    # qwen3_next): hidden 2048, 48 layers (full attention every 4th), attention 16 / 2 KV heads
    # of 256, GDN 16 key / 32 value heads of 128, 512 experts, top 10, expert FFN 512, a gated
    # shared expert of 512, dense intermediate_size 5120 (unused: no mlp_only_layers),
    # vocabulary 151,936
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                               num_attention_heads=16, num_key_value_heads=2,
                               intermediate_size=5120, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               **_hybrid("qwen3-next-80b-a3b")),
    # Qwen/Qwen3.5-35B-A3B, text_config of its config.json on the Hugging Face Hub (model_type
    # qwen3_5_moe; the same numbers are transformers 5's Qwen3_5MoeTextConfig defaults, documented
    # against that checkpoint, and THUDM/slime scripts/models/qwen3.5-35B-A3B.sh): hidden 2048,
    # 40 layers (full attention every 4th), attention 16 / 2 KV heads of 256, GDN 16 key / 32
    # value heads of 128, 256 experts, top 8, expert FFN 512, a gated shared expert of 512,
    # vocabulary 248,320, untied lm_head
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
                            num_attention_heads=16, num_key_value_heads=2, num_experts=256,
                            num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512,
                            **_gdn(num_hidden_layers=40, key_heads=16, value_heads=32)),
    # Qwen/Qwen3.5-122B-A10B (model_type qwen3_5_moe): hidden 3072, 48 layers (full attention
    # every 4th), 32 attention heads, 256 experts with 8 routed and 1 shared per token (the model
    # card, as Vultr's model page restates it); 2 KV heads of 256 and GDN 16 key / 64 value heads
    # of 128 as bole.config.GDN_SHAPES; expert FFN 1024 and a shared expert of 1024 are not read
    # from the published config.json but are what the parameter counts imply: 256 experts x 3 x
    # 3072 x 1024 x 48 layers = 116B of the 122B, and 9 active experts 4.1B of the 10B active;
    # vocabulary 248,320, untied lm_head
    "qwen3.5-122b-a10b": dict(model_type="qwen3_5_moe_text", vocab_size=248320,
                              hidden_size=3072, num_attention_heads=32, num_key_value_heads=2,
                              num_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                              **_hybrid("qwen3.5-122b-a10b")),
    # for tests and smoke runs of the benchmarks
    "tiny": dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4,
                 full_attention_interval=FULL_ATTENTION_INTERVAL,
                 **{**_ATTENTION, "head_dim": 16}),
    # the tiny model with a mixture of experts (Qwen3.5-MoE layout), for tests and smoke runs
    "tiny-moe": dict(model_type="qwen3_5_moe_text", vocab_size=128, hidden_size=64,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_conv_kernel_dim=4, full_attention_interval=FULL_ATTENTION_INTERVAL,
                     **{**_ATTENTION, "head_dim": 16}),
}


#: a preset name's suffix for its FP8 twin: weights quantized as Qwen's FP8 releases are (e4m3,
#: one scale per 128 x 128 block; bole.models.weights.fp8_quantized says which)
FP8_SUFFIX = "-fp8"


def preset_config(name: str) -> HybridConfig:
    """The config of preset ``name``; ``<preset>-fp8`` is its FP8 twin (:data:`FP8_SUFFIX`)."""
    key = name.lower()
    fp8 = key.endswith(FP8_SUFFIX)
    try:
        raw = PRESETS[key[: -len(FP8_SUFFIX)] if fp8 else key]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)} (each also as "
                         f"<name>{FP8_SUFFIX})") from None
    if fp8:
        raw = {**raw, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                              "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}}
    return HybridConfig.from_dict(raw, source=f"preset {name}")
