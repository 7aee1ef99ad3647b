"""Gated DeltaNet, the ``linear_attention`` layers of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next.

Everything GDN-specific above its kernels (:mod:`bole.ops.gdn`) lives here: its config fields,
its checkpoint tensors and their tensor-parallel slices, its state in the cache, its forward
for decode, prefill and tree verification, and its commit.

Conventions of transformers' code are matched (tests/models compare logits): conv + SiLU over
[q | k | v], gates ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, q/k
l2-normalised, gated RMSNorm of the output with silu(z). The input projections read as one
product (:data:`GatedDeltaNet.fused_groups`); Qwen3-Next groups them per key head.

Tensor parallelism splits heads: the [q | k | v] rows of in_proj_qkv (and the conv channels) by
key / value head, z / b / a rows, A_log and dt_bias by value head, out_proj columns; value heads
stay with their key head (GVA groups stay whole); Qwen3-Next's grouped in_proj_qkvz / in_proj_ba
by key head.

How a tree is verified follows the forward batch's backend (:data:`bole.models.batch.BACKENDS`):
the closed form leaves factors for one cross-layer factored commit, the serial kernels a state
snapshot per node for a copy commit, the decode kernels update each state in place, and fla's
chunk kernel (prefill on a GPU) leaves each layer's final state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from bole.cache import StatePool
from bole.config import GDNShape
from bole.models.layers.base import LinearAttention, Plan, Shape
from bole.ops import fused
from bole.ops.commit_rows import commit_conv_state
from bole.ops.gdn.closed_form import TreeFactors
from bole.ops.gdn.common import gates_from_raw
from bole.ops.gdn.decode import gdn_decode_inplace
from bole.ops.gdn.dense import (commit_factored_paths, commit_snapshots,
                                tree_gdn_closed_form_dense, tree_gdn_serial_dense)
from bole.ops.linear import linear

__all__ = ["GatedDeltaNet", "GDNConfig", "GDNInputs", "GDNOutput", "FLA_REQUIREMENT"]

FLA_REQUIREMENT = "fla-core==0.6.0"
_fla_missing_said = False


def _fla_chunk():
    """fla's chunked GDN kernel, or None when fla is missing or fails to import (prefill then runs
    the closed form over each chunk, many times slower on long prompts: said once a process)."""
    global _fla_missing_said
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:           # fla absent, or failing to import on this machine
        if not _fla_missing_said:
            _fla_missing_said = True
            logging.getLogger("bole").warning(
                "fla is not importable (%s: %s): prefill on this GPU runs Bole's closed form over "
                "chunks, about 10x slower on long prompts. Install it with: pip install '%s'",
                type(e).__name__, e, FLA_REQUIREMENT)
        return None
    return chunk_gated_delta_rule


@dataclass(frozen=True)
class GDNConfig:
    """The GDN part of a config (transformers' field names); ``layers`` the decoder layers."""

    layers: tuple[int, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return self.layers

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v]."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def gdn_shape(self, name: str = "") -> GDNShape:
        return GDNShape(name, len(self.layers), self.linear_num_key_heads,
                        self.linear_num_value_heads, self.linear_key_head_dim,
                        self.linear_value_head_dim, self.linear_conv_kernel_dim)

    def validate(self) -> None:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}")


@dataclass
class GDNInputs:
    """A forward batch's GDN inputs: ``conv_windows [N, K]`` conv window codes
    (:func:`bole.ops.fused.conv_windows_from_parents`); ``snapshot_store`` per GDN layer a flat
    fp32 buffer the ``triton-serial`` kernel writes its per-node snapshots into (its front
    ``N x H_v x d_k x d_v``), so that the captured forwards of every batch bucket share one
    store rather than each holding its own; None allocates per forward."""

    conv_windows: torch.Tensor
    snapshot_store: list[torch.Tensor] | None = None


@dataclass
class GDNOutput:
    """What a forward leaves for the commit, per GDN layer in GDN-layer order."""

    conv_inputs: list[torch.Tensor] = field(default_factory=list)       # [N, conv_dim]
    factors: list[TreeFactors] = field(default_factory=list)            # closed-form backends
    snapshots: list[torch.Tensor] = field(default_factory=list)         # serial backends
    final_states: list[torch.Tensor] = field(default_factory=list)      # fla chunk prefill
    #: the closed-form kernel's u, log_decay and k_inv_norm of every GDN layer, written in place
    #: (``[L, N, ...]``; ``factors[i]`` holds views of slice i), so the commit stacks only keys
    factor_store: TreeFactors | None = None
    #: every GDN layer's input projection ``[L, N, P]`` (qwen3.5 layout), written in place by
    #: the projections; ``conv_inputs[i]`` are views of slice i, so the commit reads the conv
    #: inputs of all layers without stacking them
    projection_store: torch.Tensor | None = None


class GatedDeltaNet(LinearAttention):
    """Gated DeltaNet layers (the module's docstring)."""

    name = "linear_attention"
    section = "gdn"
    #: the cache's pools (and attributes) of the recurrent states and the conv windows
    state_pool, conv_pool = "gdn_state", "conv_state"
    #: the gates are computed in fp32, as transformers does
    fp32_suffixes = ("linear_attn.A_log", "linear_attn.dt_bias")
    #: Qwen's FP8 releases keep b / a, the conv and the gates in bf16
    fp8_projections = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_qkvz.weight",
                       "out_proj.weight")
    fused_groups = {
        "linear_attn.in_proj_all.weight": ("linear_attn.in_proj_qkv.weight",
                                           "linear_attn.in_proj_z.weight",
                                           "linear_attn.in_proj_b.weight",
                                           "linear_attn.in_proj_a.weight"),
        "linear_attn.in_proj_qkvzba.weight": ("linear_attn.in_proj_qkvz.weight",
                                              "linear_attn.in_proj_ba.weight"),
    }

    # ---- the checkpoint ----
    @classmethod
    def parse_config(cls, text: dict, layers: tuple[int, ...]) -> GDNConfig:
        return GDNConfig(layers=layers,
                         linear_num_key_heads=int(text["linear_num_key_heads"]),
                         linear_num_value_heads=int(text["linear_num_value_heads"]),
                         linear_key_head_dim=int(text["linear_key_head_dim"]),
                         linear_value_head_dim=int(text["linear_value_head_dim"]),
                         linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)))

    @classmethod
    def weight_specs(cls, config, cfg: GDNConfig, prefix: str) -> dict[str, Shape]:
        H = config.hidden_size
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        Hv = cfg.linear_num_value_heads
        a = f"{prefix}linear_attn."
        specs = {
            f"{a}conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
            f"{a}dt_bias": (Hv,),
            f"{a}A_log": (Hv,),
            f"{a}norm.weight": (cfg.linear_value_head_dim,),
            f"{a}out_proj.weight": (H, value),
        }
        if config.family == "qwen3_next":
            specs[f"{a}in_proj_qkvz.weight"] = (2 * key + 2 * value, H)
            specs[f"{a}in_proj_ba.weight"] = (2 * Hv, H)
        else:
            specs[f"{a}in_proj_qkv.weight"] = (2 * key + value, H)
            specs[f"{a}in_proj_z.weight"] = (value, H)
            specs[f"{a}in_proj_b.weight"] = (Hv, H)
            specs[f"{a}in_proj_a.weight"] = (Hv, H)
        return specs

    @classmethod
    def shard_plan(cls, config, cfg: GDNConfig, name: str, shard) -> Plan | None:
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
            q, k, v = shard.part(Hk, dk), shard.part(Hk, dk), shard.part(Hv, dv)
            return 0, (q, (Hk * dk + k[0], Hk * dk + k[1]),
                       (2 * Hk * dk + v[0], 2 * Hk * dk + v[1]))
        if name.endswith("linear_attn.in_proj_z.weight"):
            return 0, (shard.part(Hv, dv),)
        if name.endswith(("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                          "linear_attn.A_log", "linear_attn.dt_bias")):
            return 0, (shard.part(Hv),)
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            return 0, (shard.part(Hk, 2 * dk + 2 * (Hv // Hk) * dv),)
        if name.endswith("linear_attn.in_proj_ba.weight"):
            return 0, (shard.part(Hk, 2 * (Hv // Hk)),)
        if name.endswith("linear_attn.out_proj.weight"):
            return 1, (shard.part(Hv, dv),)
        return None

    @classmethod
    def divisible_counts(cls, cfg: GDNConfig) -> dict[str, int]:
        return {"GDN key heads": cfg.linear_num_key_heads,
                "GDN value heads": cfg.linear_num_value_heads}

    @classmethod
    def init_tensor(cls, name: str, shape: Shape, device, gen) -> torch.Tensor | None:
        if name.endswith("A_log"):
            return torch.empty(shape, device=device).uniform_(1, 16, generator=gen).log()
        if name.endswith("dt_bias") or (len(shape) == 1 and "linear_attn.norm" in name):
            return torch.ones(shape, device=device)
        return None

    # ---- the runtime ----
    def __init__(self, config, cfg: GDNConfig, weights: dict, tp, device: torch.device):
        super().__init__(config, cfg, weights, tp, device)
        world = tp.world
        #: this rank's heads and conv channels (all of them without tensor parallelism)
        self.hk = cfg.linear_num_key_heads // world
        self.hv = cfg.linear_num_value_heads // world
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.K = cfg.linear_conv_kernel_dim
        #: chunked chain kernel for prefill: fla's chunk_gated_delta_rule on the GPU when
        #: installed (None: prefill chunks run the closed form)
        self.prefill_kernel = _fla_chunk() if device.type == "cuda" else None

    @property
    def chunked_prefill(self) -> bool:
        return self.prefill_kernel is not None

    def state_pools(self) -> tuple[StatePool, ...]:
        L = len(self.cfg.layers)
        return (StatePool(self.state_pool, L, (self.hv, self.dk, self.dv), torch.float32),
                StatePool(self.conv_pool, L, (self.conv_dim, self.K - 1)))

    def reserve(self, backend: str, max_nodes: int):
        """One snapshot store of ``max_nodes`` nodes per GDN layer for the ``triton-serial``
        backend (tree-serial and chain), shared by every forward and so by every captured
        batch bucket: without it each bucket's graph keeps its own snapshots alive, and a
        batch that fits alone runs out of memory beside its smaller buckets."""
        if backend != "triton-serial":
            return None
        per_node = self.hv * self.dk * self.dv                     # this rank's
        return [torch.empty(max_nodes * per_node, dtype=torch.float32, device=self.device)
                for _ in self.cfg.layers], max_nodes

    def batch_inputs(self, forest, backend: str, reserved) -> GDNInputs:
        windows = fused.conv_windows_from_parents(forest.parents, forest.depth, self.K)
        store = None
        if backend == "triton-serial" and reserved is not None:
            store, nodes = reserved
            if forest.num_nodes > nodes:
                store = None                     # larger than reserved: its own, per forward
        return GDNInputs(windows, store)

    def new_output(self) -> GDNOutput:
        return GDNOutput()

    def _projections(self, p: str, gi: int, x: torch.Tensor, out: GDNOutput):
        """``(mixed_qkv [N, conv_dim], z [N, H_v, d_v], b [N, H_v], a [N, H_v])``, one product
        (written into ``out.projection_store``, allocated by the first GDN layer, when the
        layout is qwen3.5's)."""
        w = self.w
        N, Hk, Hv, dk, dv = x.shape[0], self.hk, self.hv, self.dk, self.dv
        if self.config.family == "qwen3_next":   # grouped per key head: [q | k | v | z], [b | a]
            r = Hv // Hk
            proj = linear(x, w[p + "in_proj_qkvzba.weight"])
            qkvz, ba = torch.split(proj, [Hk * (2 * dk + 2 * r * dv), Hk * 2 * r], dim=-1)
            q, k, v, z = torch.split(qkvz.view(N, Hk, -1), [dk, dk, r * dv, r * dv], dim=-1)
            b, a = torch.split(ba.reshape(N, Hk, 2 * r), [r, r], dim=-1)
            mixed = torch.cat([q.reshape(N, -1), k.reshape(N, -1), v.reshape(N, -1)], dim=-1)
            return mixed, z.reshape(N, Hv, dv), b.reshape(N, Hv), a.reshape(N, Hv)
        weight = w[p + "in_proj_all.weight"]
        if out.projection_store is None:
            out.projection_store = torch.empty(len(self.cfg.layers), N, weight.shape[0],
                                               dtype=x.dtype, device=x.device)
        proj = linear(x, weight, out=out.projection_store[gi])
        mixed, z, b, a = torch.split(proj, [self.conv_dim, Hv * dv, Hv, Hv], dim=-1)
        return mixed, z.view(N, Hv, dv), b, a

    def _factor_store(self, N: int, device) -> TreeFactors:
        """Buffers for every GDN layer's u, log_decay and k_inv_norm over ``N`` nodes (``k``: an
        empty placeholder; the keys stay views of each layer's convolution output)."""
        L = len(self.cfg.layers)
        return TreeFactors(
            log_decay=torch.empty(L, N, self.hv, dtype=torch.float64, device=device),
            k=torch.empty(L, 0, device=device),
            u=torch.empty(L, N, self.hv, self.dv, dtype=torch.float32, device=device),
            k_inv_norm=torch.empty(L, N, self.hk, dtype=torch.float32, device=device))

    def forward(self, layer: int, x: torch.Tensor, cache, batch, out: GDNOutput) -> torch.Tensor:
        p = f"{self.config.weight_prefix}layers.{layer}.linear_attn."
        w = self.w
        N, Hk, Hv, dk, dv = x.shape[0], self.hk, self.hv, self.dk, self.dv
        gi = self.index[layer]
        mixed, z, b, a = self._projections(p, gi, x, out)
        out.conv_inputs.append(mixed)
        conv = fused.tree_conv1d_pool(mixed, w[p + "conv1d.weight"].reshape(self.conv_dim, -1),
                                      cache.pools[self.conv_pool][gi], batch.slots,
                                      batch.linear[self.name].conv_windows)
        q, k, v = torch.split(conv, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q, k, v = q.reshape(N, Hk, dk), k.reshape(N, Hk, dk), v.reshape(N, Hv, dv)
        o = self._recurrence(gi, q, k, v, a, b, w[p + "A_log"], w[p + "dt_bias"], cache, batch,
                             out)
        o = fused.gated_rms_norm(o.reshape(N, Hv, dv), z, w[p + "norm.weight"],
                                 self.config.rms_norm_eps)
        return self.tp.all_reduce(linear(o.reshape(N, Hv * dv), w[p + "out_proj.weight"]))

    def _recurrence(self, gi, q, k, v, a, b, A_log, dt_bias, cache, batch,
                    out: GDNOutput) -> torch.Tensor:
        """The gated delta rule over the batch's nodes by the batch's backend: ``o [N, H_v,
        d_v]``; the commit's pieces land in ``out``."""
        N, backend = q.shape[0], batch.backend
        pool, slots = cache.pools[self.state_pool][gi], batch.slots
        if batch.prefill is not None and self.prefill_kernel is not None:
            g, beta = gates_from_raw(a[None], b[None], A_log, dt_bias)
            o, final = self.prefill_kernel(
                q[None], k[None], v[None], g=g, beta=beta,
                initial_state=pool[slots.long()].contiguous(), output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            out.final_states.append(final.float())
            return o[0].to(v.dtype).contiguous()
        if backend in ("triton-decode", "torch-decode"):
            if batch.nodes_per_request != 1:
                raise ValueError(f"the {backend} backend decodes one token per request, got "
                                 f"{batch.nodes_per_request} node slots")
            return gdn_decode_inplace(q, k, v, a, b, A_log, dt_bias, pool, slots,
                                      impl=backend.split("-")[0])
        if backend in ("triton", "triton-serial"):
            # Bole's closed-form kernel (factors) or the tree-serial kernel (a snapshot per node)
            if backend == "triton":
                from bole.ops.gdn.verify.kernel import tree_gdn_verify_triton as kernel
            else:
                from bole.ops.gdn.triton_serial import tree_gdn_serial_triton as kernel
            extra = {}
            if backend == "triton":
                if out.factor_store is None:
                    out.factor_store = self._factor_store(N, q.device)
                st = out.factor_store
                extra["factors_out"] = TreeFactors(st.log_decay[gi], st.k[gi], st.u[gi],
                                                   st.k_inv_norm[gi])
            store = batch.linear[self.name].snapshot_store
            if backend == "triton-serial" and store is not None:
                extra["snapshots"] = store[gi][:N * self.hv * self.dk * self.dv].view(
                    N, self.hv, self.dk, self.dv)
            o, kept = kernel(q[None], k[None], v[None], batch.meta, a=a[None], b=b[None],
                             A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                             state_indices=slots, use_qk_l2norm_in_kernel=True, **extra)
            (out.factors if backend == "triton" else out.snapshots).append(kept)
            return o[0]
        raw = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
        if backend == "torch":
            o, f = tree_gdn_closed_form_dense(q, k, v, **raw, state_pool=pool, slots=slots,
                                              ancestors=batch.forest.ancestors)
            out.factors.append(f)
            return o
        f = batch.forest
        o, snaps = tree_gdn_serial_dense(q, k, v, **raw, state_pool=pool, slots=slots,
                                         parents=f.parents, depth=f.depth, max_depth=f.max_depth)
        out.snapshots.append(snaps)
        return o

    def commit(self, cache, batch, out: GDNOutput, slots: torch.Tensor, path_global: torch.Tensor,
               path_len: torch.Tensor, last: torch.Tensor) -> None:
        """GDN states by the factored or the copy commit (or fla's final states), then conv
        windows: the accepted node's window, less the node itself."""
        states = cache.pools[self.state_pool]
        if out.final_states:                                      # fla's chunked prefill
            for gi, final in enumerate(out.final_states):
                states[gi, slots] = final
        elif out.factors:
            self._commit_factored(states, batch, out, slots, path_global, path_len)
        elif out.snapshots:
            keep = path_len > 0                                   # padding rows: dummy slot
            target = torch.where(keep, slots, cache.dummy_slot)
            if batch.backend == "triton-serial":
                from bole.ops.gdn.triton_serial import commit_from_snapshots_triton
                for gi, snaps in enumerate(out.snapshots):
                    commit_from_snapshots_triton(snaps, states[gi], target.to(torch.int32), last)
            else:
                commit_snapshots(out.snapshots, states, target, last)
        if out.conv_inputs:
            store = out.projection_store
            if store is not None and len(out.conv_inputs) == store.shape[0]:
                inputs = store[..., :out.conv_inputs[0].shape[-1]]    # every layer, no copy
            else:
                inputs = torch.stack(out.conv_inputs)
            commit_conv_state(cache.pools[self.conv_pool], inputs,
                              batch.linear[self.name].conv_windows[last][:, 1:], slots, path_len)

    @staticmethod
    def _commit_factored(states, batch, out: GDNOutput, slots, path_global, path_len) -> None:
        store = out.factor_store
        if store is not None and len(out.factors) == store.u.shape[0]:
            # written in place by every layer's verify: only the keys are gathered
            stacked = TreeFactors(store.log_decay, torch.stack([f.k for f in out.factors]),
                                  store.u, store.k_inv_norm)
        else:
            stacked = TreeFactors.stack(out.factors)
        if batch.backend == "triton":
            from bole.ops.gdn.triton_commit import commit_factored_triton
            commit_factored_triton(stacked, states, batch.slots, path_global, path_len)
        else:
            commit_factored_paths(stacked, states, slots, path_global, path_len)
