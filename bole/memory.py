"""Transient speculative GDN state: per-node snapshots (tree-serial, chain) versus Bole's factors.

Per request, per GDN layer and per tree node:
    snapshot  H_v * d_k * d_v * 4 bytes            (one fp32 state per node)
    factors   H_v * 8 + H_k * d_k * key_bytes + H_v * d_v * 4 bytes
              (fp64 path log-decay L, key k, fp32 correction u; k is per *key* head under GVA)
The committed state S_pre exists in both designs and is not transient, so it is not counted; nor
are conv windows (tree-serial engines also snapshot those, which would only widen the gap).
"""

from __future__ import annotations

from dataclasses import dataclass

from bole.config import GDNShape


@dataclass(frozen=True)
class SpecStateBytes:
    """Transient speculative GDN state for ``batch`` requests of ``nodes`` tree nodes each."""

    shape: GDNShape
    nodes: int
    batch: int
    snapshot_bytes: int
    factor_bytes: int

    @property
    def ratio(self) -> float:
        return self.snapshot_bytes / self.factor_bytes


def snapshot_bytes_per_node(shape: GDNShape) -> int:
    """One fp32 state snapshot of one layer: H_v * d_k * d_v * 4."""
    return shape.state_elems * 4


def factor_bytes_per_node(shape: GDNShape, key_bytes: int = 4) -> int:
    """One node's factors in one layer: L (fp64 per value head), k (per key head), u (fp32)."""
    return (shape.num_v_heads * 8
            + shape.num_k_heads * shape.head_k_dim * key_bytes
            + shape.num_v_heads * shape.head_v_dim * 4)


def speculative_state_bytes(shape: GDNShape, nodes: int, batch: int = 1,
                            key_bytes: int = 4) -> SpecStateBytes:
    """Bytes of transient GDN state over all GDN layers: snapshots vs factors.

    ``key_bytes`` is the stored key's element size (4 for fp32 keys, 2 when the bf16 projection
    output is kept as the factor).
    """
    if nodes < 1 or batch < 1:
        raise ValueError(f"nodes and batch must be >= 1, got nodes={nodes}, batch={batch}")
    per = nodes * batch * shape.num_gdn_layers
    return SpecStateBytes(shape, nodes, batch,
                          snapshot_bytes=per * snapshot_bytes_per_node(shape),
                          factor_bytes=per * factor_bytes_per_node(shape, key_bytes))
