"""The tensors a checkpoint must hold for a :class:`HybridConfig`, by the checkpoint's own names.

Names and shapes are those of the safetensors files that transformers writes and Qwen publishes:
``{prefix}layers.{i}.linear_attn.in_proj_qkv.weight`` and so on, the MTP head under ``mtp.``. MoE
experts come in one of two layouts: one tensor per expert (``mlp.experts.{e}.gate_proj.weight``,
what transformers writes for Qwen3.5-MoE / Qwen3-Next) or fused (``mlp.experts.gate_up_proj``
[E, 2F, H], gate rows then up rows, and ``mlp.experts.down_proj`` [E, H, F], the layout of Qwen's
published Qwen3.5-MoE checkpoints and of the runtime's kernels). The model runtime builds its
modules from these specs; the loader checks a checkpoint against them.
"""

from __future__ import annotations

from bole.models.config import HybridConfig

Shape = tuple[int, ...]

#: Kept in fp32 whatever the load dtype (the gates are computed in fp32, as transformers does).
FP32_SUFFIXES = ("linear_attn.A_log", "linear_attn.dt_bias")

#: the fused expert tensors of a MoE layer, under ``{layer prefix}mlp.``
FUSED_GATE_UP = "experts.gate_up_proj"
FUSED_DOWN = "experts.down_proj"

#: Checkpoint prefixes of parts Bole does not run (the vision tower of Qwen3.5 VL checkpoints).
IGNORED_PREFIXES = ("model.visual.", "visual.")

#: the projections Qwen's FP8 releases store in FP8 (the rest stays bf16: embeddings, the LM
#: head, norms, the GDN's b / a projections, conv and gates, the MoE router and the shared
#: expert's gate, the MTP head's fc): the random ``-fp8`` presets quantize these
FP8_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_qkvz.weight",
                   "out_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                   FUSED_GATE_UP, FUSED_DOWN)
#: the checkpoint's scale tensor of FP8 weight ``name`` is ``name + SCALE_SUFFIX``
SCALE_SUFFIX = "_scale_inv"


def fp8_quantized(name: str) -> bool:
    """Whether a published FP8 checkpoint holds tensor ``name`` in FP8."""
    return name.endswith(FP8_PROJECTIONS) and not name.startswith("mtp.fc")


def _attention(c: HybridConfig, p: str) -> dict[str, Shape]:
    H, hd = c.hidden_size, c.head_dim
    q_out, kv_out = c.num_attention_heads * hd * 2, c.num_key_value_heads * hd   # query + gate
    specs = {
        f"{p}self_attn.q_proj.weight": (q_out, H),
        f"{p}self_attn.k_proj.weight": (kv_out, H),
        f"{p}self_attn.v_proj.weight": (kv_out, H),
        f"{p}self_attn.o_proj.weight": (H, c.num_attention_heads * hd),
        f"{p}self_attn.q_norm.weight": (hd,),
        f"{p}self_attn.k_norm.weight": (hd,),
    }
    if c.attention_bias:
        specs.update({f"{p}self_attn.q_proj.bias": (q_out,), f"{p}self_attn.k_proj.bias": (kv_out,),
                      f"{p}self_attn.v_proj.bias": (kv_out,), f"{p}self_attn.o_proj.bias": (H,)})
    return specs


def _gdn(c: HybridConfig, p: str) -> dict[str, Shape]:
    H = c.hidden_size
    key = c.linear_num_key_heads * c.linear_key_head_dim
    value = c.linear_num_value_heads * c.linear_value_head_dim
    Hv = c.linear_num_value_heads
    a = f"{p}linear_attn."
    specs = {
        f"{a}conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim),
        f"{a}dt_bias": (Hv,),
        f"{a}A_log": (Hv,),
        f"{a}norm.weight": (c.linear_value_head_dim,),
        f"{a}out_proj.weight": (H, value),
    }
    if c.family == "qwen3_next":
        specs[f"{a}in_proj_qkvz.weight"] = (2 * key + 2 * value, H)
        specs[f"{a}in_proj_ba.weight"] = (2 * Hv, H)
    else:
        specs[f"{a}in_proj_qkv.weight"] = (2 * key + value, H)
        specs[f"{a}in_proj_z.weight"] = (value, H)
        specs[f"{a}in_proj_b.weight"] = (Hv, H)
        specs[f"{a}in_proj_a.weight"] = (Hv, H)
    return specs


def _dense_mlp(H: int, inter: int, p: str) -> dict[str, Shape]:
    return {f"{p}gate_proj.weight": (inter, H), f"{p}up_proj.weight": (inter, H),
            f"{p}down_proj.weight": (H, inter)}


def _mlp(c: HybridConfig, p: str, layer: int, fused_experts: bool) -> dict[str, Shape]:
    H, E, F = c.hidden_size, c.num_experts, c.moe_intermediate_size
    if not c.is_moe_layer(layer):
        return _dense_mlp(H, c.intermediate_size, f"{p}mlp.")
    specs = {f"{p}mlp.gate.weight": (E, H)}
    if fused_experts:
        specs[f"{p}mlp.{FUSED_GATE_UP}"] = (E, 2 * F, H)
        specs[f"{p}mlp.{FUSED_DOWN}"] = (E, H, F)
    else:
        for e in range(E):
            specs.update(_dense_mlp(H, F, f"{p}mlp.experts.{e}."))
    if c.shared_expert_intermediate_size:
        specs.update(_dense_mlp(H, c.shared_expert_intermediate_size, f"{p}mlp.shared_expert."))
        specs[f"{p}mlp.shared_expert_gate.weight"] = (1, H)
    return specs


def _decoder_layer(c: HybridConfig, p: str, layer: int, full_attention: bool,
                   fused_experts: bool = False) -> dict[str, Shape]:
    H = c.hidden_size
    specs = {f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
    specs.update(_attention(c, p) if full_attention else _gdn(c, p))
    specs.update(_mlp(c, p, layer, fused_experts))
    return specs


def text_model_specs(c: HybridConfig, fused_experts: bool = False) -> dict[str, Shape]:
    """Every tensor of the text model (embedding, layers, final norm, lm_head unless tied), MoE
    experts per expert or fused (``fused_experts``)."""
    pre = c.weight_prefix
    specs = {f"{pre}embed_tokens.weight": (c.vocab_size, c.hidden_size),
             f"{pre}norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        specs.update(_decoder_layer(c, f"{pre}layers.{i}.", i, c.is_full_attention(i),
                                    fused_experts))
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return specs


def mtp_specs(c: HybridConfig, num_layers: int | None = None,
              fused_experts: bool = False) -> dict[str, Shape]:
    """The MTP head: embedding/hidden norms, fc (2H -> H), full-attention layers, final norm."""
    H = c.hidden_size
    n = c.mtp_num_hidden_layers if num_layers is None else num_layers
    specs = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
             "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    for j in range(n):
        # the MTP layer's MLP follows the model's: MoE for MoE models (layer index 0 is sparse)
        specs.update(_decoder_layer(c, f"mtp.layers.{j}.", 0 if c.num_experts else j, True,
                                    fused_experts))
    return specs


def has_fused_experts(names) -> bool:
    """Whether checkpoint tensor ``names`` hold MoE experts in the fused layout."""
    return any(n.endswith("mlp." + FUSED_GATE_UP) for n in names)
