"""GDN layer shapes of the supported hybrid models (docs/design.md section 4): the one table that
demos, memory accounting, benchmarks and the random-weight presets read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GDNShape:
    """The Gated DeltaNet part of a hybrid model: what one GDN layer's state and factors weigh."""

    name: str
    num_gdn_layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v]."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def state_elems(self) -> int:
        """Elements of one layer's recurrent state for one request: H_v * d_k * d_v."""
        return self.num_v_heads * self.head_k_dim * self.head_v_dim


GDN_SHAPES: dict[str, GDNShape] = {
    "qwen3.5-4b": GDNShape("Qwen3.5-4B", num_gdn_layers=24, num_k_heads=16, num_v_heads=32),
    "qwen3.5-9b": GDNShape("Qwen3.5-9B", num_gdn_layers=24, num_k_heads=16, num_v_heads=32),
    "qwen3.5-27b": GDNShape("Qwen3.5-27B", num_gdn_layers=48, num_k_heads=16, num_v_heads=48),
    "qwen3.5-122b-a10b": GDNShape("Qwen3.5-122B-A10B", num_gdn_layers=36, num_k_heads=16,
                                  num_v_heads=64),
    "qwen3-next-80b-a3b": GDNShape("Qwen3-Next-80B-A3B", num_gdn_layers=36, num_k_heads=16,
                                   num_v_heads=32),
}


def gdn_shape(name: str) -> GDNShape:
    try:
        return GDN_SHAPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r}; known shapes: {', '.join(GDN_SHAPES)}") from None
