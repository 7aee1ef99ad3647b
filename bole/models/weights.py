"""The tensors a checkpoint must hold for a :class:`HybridConfig`, by the checkpoint's own names.

Names and shapes are those of the safetensors files that transformers writes and Qwen publishes:
``{prefix}layers.{i}.linear_attn.in_proj_qkv.weight`` and so on (a linear-attention layer's own
from its type, :mod:`bole.models.layers`), the MTP head under ``mtp.``. MoE
experts come in one of two layouts: one tensor per expert (``mlp.experts.{e}.gate_proj.weight``,
what transformers writes for Qwen3.5-MoE / Qwen3-Next) or fused (``mlp.experts.gate_up_proj``
[E, 2F, H], gate rows then up rows, and ``mlp.experts.down_proj`` [E, H, F], the layout of Qwen's
published Qwen3.5-MoE checkpoints and of the runtime's kernels). The model runtime builds its
modules from these specs; the loader checks a checkpoint against them.
"""

from __future__ import annotations

from bole.models.config import HybridConfig
from bole.models.layers.base import Shape
from bole.models.layers.registry import LINEAR_ATTENTION_TYPES, linear_attention_type

#: Kept in fp32 whatever the load dtype: each linear-attention type names its own (GDN's gates
#: are computed in fp32, as transformers does).
FP32_SUFFIXES = tuple(s for t in LINEAR_ATTENTION_TYPES.values() for s in t.fp32_suffixes)

#: the fused expert tensors of a MoE layer, under ``{layer prefix}mlp.``
FUSED_GATE_UP = "experts.gate_up_proj"
FUSED_DOWN = "experts.down_proj"

#: Checkpoint prefixes of parts Bole does not run (the vision tower of Qwen3.5 VL checkpoints).
IGNORED_PREFIXES = ("model.visual.", "visual.")

#: the projections Qwen's FP8 releases store in FP8 (the rest stays bf16: embeddings, the LM
#: head, norms, the MoE router and the shared expert's gate, the MTP head's fc; each
#: linear-attention type names its own, GDN's keep b / a, conv and gates in bf16): the random
#: ``-fp8`` presets quantize these
FP8_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                   FUSED_GATE_UP, FUSED_DOWN,
                   *(s for t in LINEAR_ATTENTION_TYPES.values() for s in t.fp8_projections))
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


def _mixer(c: HybridConfig, p: str, kind: str | None) -> dict[str, Shape]:
    """The token mixer of a layer: full attention (``kind`` None) or a linear-attention type's
    tensors."""
    if kind is None:
        return _attention(c, p)
    return linear_attention_type(kind).weight_specs(c, dict(c.linear_attention)[kind], p)


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


def _decoder_layer(c: HybridConfig, p: str, layer: int, kind: str | None,
                   fused_experts: bool = False) -> dict[str, Shape]:
    """Decoder layer ``layer``'s tensors under ``p``; ``kind`` its linear-attention type, None
    for full attention."""
    H = c.hidden_size
    specs = {f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
    specs.update(_mixer(c, p, kind))
    specs.update(_mlp(c, p, layer, fused_experts))
    return specs


def text_model_specs(c: HybridConfig, fused_experts: bool = False) -> dict[str, Shape]:
    """Every tensor of the text model (embedding, layers, final norm, lm_head unless tied), MoE
    experts per expert or fused (``fused_experts``)."""
    pre = c.weight_prefix
    specs = {f"{pre}embed_tokens.weight": (c.vocab_size, c.hidden_size),
             f"{pre}norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        kind = None if c.is_full_attention(i) else c.layer_types[i]
        specs.update(_decoder_layer(c, f"{pre}layers.{i}.", i, kind, fused_experts))
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
        specs.update(_decoder_layer(c, f"mtp.layers.{j}.", 0 if c.num_experts else j, None,
                                    fused_experts))
    return specs


def has_fused_experts(names) -> bool:
    """Whether checkpoint tensor ``names`` hold MoE experts in the fused layout."""
    return any(n.endswith("mlp." + FUSED_GATE_UP) for n in names)
