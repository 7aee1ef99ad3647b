"""Model configuration read from a checkpoint folder's config.json (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

One dataclass, :class:`HybridConfig`, describes the text model of every supported checkpoint:
full-attention and linear-attention layers, dense or mixture-of-experts MLPs, and the optional MTP
head. Field names follow transformers' configs so that a reader can map them one to one. Each
linear-attention layer type parses its own fields (:mod:`bole.models.layers`); they read as the
config's own (``config.linear_num_key_heads``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bole.models.layers.registry import (FULL_ATTENTION, INTERVAL_LINEAR_TYPE,
                                         LINEAR_ATTENTION_TYPES, linear_attention_type)

#: config.json model_type -> (canonical family, where the text config lives)
SUPPORTED_MODEL_TYPES: dict[str, tuple[str, str | None]] = {
    "qwen3_5_text": ("qwen3_5", None),
    "qwen3_5": ("qwen3_5", "text_config"),
    "qwen3_5_moe_text": ("qwen3_5_moe", None),
    "qwen3_5_moe": ("qwen3_5_moe", "text_config"),
    "qwen3_next": ("qwen3_next", None),
}


def fp8_block(quant: dict | None) -> tuple[int, int] | None:
    """The weight block of a ``quantization_config`` Bole can load (None without one): FP8 e4m3
    with block scales and dynamic activations, as Qwen's FP8 releases are. Anything else is a
    ValueError that says what is supported."""
    if quant is None:
        return None
    supported = ("Bole loads unquantized checkpoints and FP8 ones with block scales "
                 "(quant_method 'fp8', fmt 'e4m3', weight_block_size [rows, columns], "
                 "activation_scheme 'dynamic'), as Qwen publishes them")
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be an object; {supported}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported: "
                         f"{supported}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {quant.get('fmt')!r} is not supported: "
                         f"{supported}")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme "
                         f"{quant.get('activation_scheme')!r} (static activation scales) is not "
                         f"supported: {supported}")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size is {block!r}; per-tensor FP8 "
                         f"is not supported: {supported}")
    return int(block[0]), int(block[1])


class _ReadOrder(dict):
    """A config section that remembers the field read last: the one a failed conversion of
    ``int(t["field"])`` was reading."""

    last: str | None = None

    def __getitem__(self, key):
        self.last = key
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.last = key
        return super().get(key, default)


@dataclass(frozen=True)
class HybridConfig:
    """The text model of a hybrid checkpoint.

    ``family`` is ``qwen3_5`` (dense MLP, separate GDN projections), ``qwen3_5_moe`` (MoE MLP,
    separate projections) or ``qwen3_next`` (MoE MLP, grouped ``in_proj_qkvz`` / ``in_proj_ba``).
    ``weight_prefix`` is where the text model's tensors sit in the checkpoint (``model.`` for a
    text-only checkpoint, ``model.language_model.`` for Qwen3.5's vision-language ones).
    ``linear_attention``: ``(layer type name, its config)`` for each linear-attention type the
    layers use, in order of first use; a type's config fields read as this config's own.
    """

    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    attention_bias: bool
    rms_norm_eps: float
    # MLP: dense when num_experts == 0
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    weight_prefix: str = "model."
    eos_token_id: tuple[int, ...] = field(default=())
    #: FP8 weights with one scale per (rows, columns) block (``quantization_config`` with
    #: ``quant_method: fp8``, ``weight_block_size``); None: unquantized
    fp8_block: tuple[int, int] | None = None
    #: the linear-attention layer types' configs (:mod:`bole.models.layers`)
    linear_attention: tuple[tuple[str, Any], ...] = ()

    def __getattr__(self, name: str):
        """A linear-attention type's config field (``linear_num_key_heads``, ``conv_dim``, ...)
        as the config's own: the first type that has it."""
        if not name.startswith("__"):
            for _, cfg in self.__dict__.get("linear_attention", ()):
                if hasattr(cfg, name):
                    return getattr(cfg, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- derived ----
    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL_ATTENTION

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers of every linear-attention type."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != FULL_ATTENTION)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` has a mixture-of-experts MLP (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    # ---- construction ----
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "HybridConfig":
        """Parse a transformers config dict; refuses unknown model types with the supported list."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; Bole supports "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
        family, nested = SUPPORTED_MODEL_TYPES[model_type]
        text = raw
        prefix = "model."
        if nested is not None:
            text = raw.get(nested)
            if not isinstance(text, dict):
                raise ValueError(f"{source}: model_type {model_type!r} needs a {nested!r} section")
            prefix = "model.language_model."
        text = _ReadOrder(text)
        try:
            return cls._from_text(text, raw, model_type, family, prefix)
        except KeyError as exc:
            raise ValueError(f"{source}: missing field {exc.args[0]!r} for {model_type}") from None
        except (TypeError, ValueError) as exc:         # int("four"), float(None), ...
            field = text.last
            if field is None or not any(m in str(exc) for m in (
                    "invalid literal", "could not convert", "argument must be")):
                raise
            raise ValueError(f"{source}: field {field!r} is {text[field]!r}, not a number "
                             f"({exc})") from None

    @classmethod
    def _from_text(cls, t: dict, outer: dict, model_type: str, family: str,
                   prefix: str) -> "HybridConfig":
        n = int(t["num_hidden_layers"])
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = int(t.get("full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else INTERVAL_LINEAR_TYPE
                           for i in range(n)]
        layer_types = tuple(layer_types)
        known = (FULL_ATTENTION, *LINEAR_ATTENTION_TYPES)
        if len(layer_types) != n or any(lt not in known for lt in layer_types):
            raise ValueError(
                f"layer_types must list {n} entries from {known}, got {list(layer_types)}")
        linear = tuple((kind, linear_attention_type(kind).parse_config(
                           t, tuple(i for i, k in enumerate(layer_types) if k == kind)))
                       for kind in dict.fromkeys(layer_types) if kind != FULL_ATTENTION)
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
        head_dim = int(t.get("head_dim") or int(t["hidden_size"]) // int(t["num_attention_heads"]))
        eos = outer.get("eos_token_id", t.get("eos_token_id"))
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        moe = family != "qwen3_5"
        cfg = cls(
            model_type=model_type, family=family,
            vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
            num_hidden_layers=n, layer_types=layer_types,
            num_attention_heads=int(t["num_attention_heads"]),
            num_key_value_heads=int(t["num_key_value_heads"]), head_dim=head_dim,
            rope_theta=rope_theta, partial_rotary_factor=partial,
            max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
            attention_bias=bool(t.get("attention_bias", False)),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            intermediate_size=int(t.get("intermediate_size") or 0),
            num_experts=int(t["num_experts"]) if moe else 0,
            num_experts_per_tok=int(t["num_experts_per_tok"]) if moe else 0,
            moe_intermediate_size=int(t["moe_intermediate_size"]) if moe else 0,
            shared_expert_intermediate_size=int(t.get("shared_expert_intermediate_size") or 0)
            if moe else 0,
            # transformers' Qwen3.5-MoE router always renormalises (its config has no such field)
            norm_topk_prob=family == "qwen3_5_moe" or bool(t.get("norm_topk_prob", True)),
            decoder_sparse_step=int(t.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(t.get("mlp_only_layers") or ()),
            hidden_act=str(t.get("hidden_act", "silu")),
            tie_word_embeddings=bool(outer.get("tie_word_embeddings",
                                               t.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=int(t.get("mtp_num_hidden_layers", 0)),
            weight_prefix=prefix, eos_token_id=eos,
            fp8_block=fp8_block(outer.get("quantization_config", t.get("quantization_config"))),
            linear_attention=linear)
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "HybridConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a checkpoint folder needs its config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw, source=str(path))

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        for _, cfg in self.linear_attention:
            cfg.validate()
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim head_dim * partial_rotary_factor = {self.rotary_dim} "
                             "must be even")
        if self.family == "qwen3_5" and self.intermediate_size <= 0:
            raise ValueError("a dense Qwen3.5 config needs intermediate_size > 0")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")
