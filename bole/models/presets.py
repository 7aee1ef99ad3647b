"""Configurations of real models for random-weight runs (benchmarks need no checkpoint).

Shapes are those of DESIGN.md section 3's table (hidden size, layers, heads, MLP, vocabulary);
fields that do not change the cost of a forward (rope theta, token ids) keep transformers' defaults.
"""

from __future__ import annotations

from bole.models.config import HybridConfig

_GDN = dict(linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, head_dim=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                             "rope_type": "default"}, max_position_embeddings=262144,
            full_attention_interval=4)

PRESETS: dict[str, dict] = {
    "qwen3.5-4b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                       linear_num_value_heads=32, intermediate_size=9216, tie_word_embeddings=True,
                       **_GDN),
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                       linear_num_value_heads=32, intermediate_size=12288, **_GDN),
    "qwen3.5-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        linear_num_value_heads=48, intermediate_size=17408, **_GDN),
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                               linear_num_value_heads=32, intermediate_size=5120, num_experts=512,
                               num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, **_GDN),
    # for tests and smoke runs of the benchmarks
    "tiny": dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                 linear_num_value_heads=4, **{**_GDN, "linear_num_key_heads": 2,
                                              "linear_key_head_dim": 16,
                                              "linear_value_head_dim": 16, "head_dim": 16}),
}


def preset_config(name: str) -> HybridConfig:
    try:
        raw = PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
    return HybridConfig.from_dict(raw, source=f"preset {name}")
