"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text models for serving: the layers of one tree forward.

Every forward is a tree forward over R requests x T node slots (:class:`ForwardBatch`):
    decode      = T = 1, a lone root per request
    prefill     = one request, a chain per chunk of the prompt
    verify      = the drafted trees
so the same exact operations (tree attention over the KV pool, tree conv, closed-form GDN) serve
all three. The forward only reads the committed state; it writes its nodes' keys and values into
the KV pool's scratch rows past each request's committed length, and leaves the per-layer pieces
of a commit in a :class:`ForwardOutput`. The commit itself (and input buffers, CUDA graphs) is the
runner's (:mod:`bole.engine.runner`).

Conventions of transformers' Qwen3.5 / Qwen3-Next code are matched (tests/models compare logits):
zero-centred RMSNorm (1 + w), sigmoid-gated attention output, q/k RMSNorm per head, partial rotary
on the first ``head_dim * partial_rotary_factor`` dims, GDN conv + SiLU over [q | k | v], gates
``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, q/k l2-normalised, gated RMSNorm of
the GDN output with silu(z). Projections that read the same input run as one matrix product
(their checkpoint tensors become views of the fused weight); norms, gates and the conv are single
kernels on the GPU (:mod:`bole.ops.fused`). MoE experts are stacked at load time in the
layout the fused kernels read, with the gated shared expert as one more expert
(:mod:`bole.models.moe_layer`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict

from pathlib import Path

import torch
import torch.nn.functional as F

from bole.cache import CacheShape, HybridCache
from bole.distributed import TensorParallel, TPShard
from bole.models.batch import GDN_BACKENDS, ForwardBatch, ForwardOutput
from bole.models import moe_layer
from bole.models.config import HybridConfig
from bole.models.fusion import fuse_projections
from bole.models.loader import load_checkpoint
from bole.models.sharding import check_divisible, shard_tensors
from bole.models.weights import (FP32_SUFFIXES, FUSED_GATE_UP, fp8_quantized, mtp_specs,
                                 text_model_specs)
from bole.ops import fused, rope
from bole.ops.attention import prefill_attention, tree_attention
from bole.ops.gdn.closed_form import TreeFactors
from bole.ops.gdn.common import gates_from_raw
from bole.ops.gdn.decode import gdn_decode_inplace
from bole.ops.gdn.dense import tree_gdn_closed_form_dense, tree_gdn_serial_dense
from bole.ops.fp8 import quantize_blockwise
from bole.ops.linear import linear
from bole.ops.triton_utils import check_kernel_device

__all__ = ["HybridModel", "SectionTimer", "GDN_BACKENDS", "MOE_BACKENDS"]

#: "triton": the fused grouped-GEMM kernels (CUDA graph safe); "torch": the loop over experts
MOE_BACKENDS = ("triton", "torch")


class SectionTimer:
    """Accumulates wall time per section (attention, gdn, mlp, rest) of forwards, device-synced.

    For benchmarks only: each section synchronises the device, which a serving forward must not.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def section(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.totals[name] += time.perf_counter() - t0

    def reset(self):
        self.totals.clear()


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


class HybridModel:
    """A hybrid text model held as tensors by checkpoint name (plus fused projections)."""

    def __init__(self, config: HybridConfig, tensors: dict[str, torch.Tensor],
                 gdn_backend: str = "auto", tp: TensorParallel | None = None,
                 moe_backend: str = "auto"):
        """``tensors`` by checkpoint name (this rank's slices under tensor parallelism, ``tp``:
        :mod:`bole.models.sharding`), MoE experts per expert or fused. ``moe_backend``: one of
        :data:`MOE_BACKENDS`, or "auto" (the kernels on CUDA, the torch loop elsewhere)."""
        self.config = config
        #: the checkpoint folder (None for random weights): files beside the weights, such as
        #: the draft vocabulary's token counts, are looked up there
        self.folder: Path | None = None
        self.w = dict(tensors)
        embed = self.w[f"{config.weight_prefix}embed_tokens.weight"]
        self.dtype, self.device = embed.dtype, embed.device
        self.full_index = {layer: i for i, layer in enumerate(config.full_attention_layers)}
        self.gdn_index = {layer: i for i, layer in enumerate(config.gdn_layers)}
        c = config
        self.tp = tp or TensorParallel(TPShard(0, 1))
        world = self.tp.world
        check_divisible(c, world)
        if world > 1 and c.fp8_block is not None:
            raise ValueError("tensor parallelism over FP8 weights is not supported yet: run an "
                             "FP8 model on one GPU (tp 1)")
        #: this rank's heads and channels (all of them without tensor parallelism)
        self.n_heads, self.n_kv = c.num_attention_heads // world, c.num_key_value_heads // world
        self.gdn_hk = c.linear_num_key_heads // world
        self.gdn_hv = c.linear_num_value_heads // world
        self.conv_dim = (2 * self.gdn_hk * c.linear_key_head_dim
                         + self.gdn_hv * c.linear_value_head_dim)
        self.vocab_part = c.vocab_size // world
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32)
                                      / c.rotary_dim))
        self.inv_freq = inv.to(self.device)
        if gdn_backend == "auto":
            gdn_backend = "triton" if self.device.type == "cuda" else "torch"
        if gdn_backend not in GDN_BACKENDS:
            raise ValueError(f"gdn_backend must be one of {GDN_BACKENDS} or 'auto', got {gdn_backend!r}")
        if gdn_backend.startswith("triton"):
            check_kernel_device(self.device, f"gdn_backend={gdn_backend!r}")
        #: the default backend of Bole's closed form on this device ("triton" on a GPU); an engine
        #: passes its own backend with every forward, so engines sharing a model never interfere
        self.gdn_backend = gdn_backend
        if moe_backend == "auto":
            moe_backend = "triton" if self.device.type == "cuda" else "torch"
        if moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS} or 'auto', got "
                             f"{moe_backend!r}")
        if moe_backend == "triton" and config.num_experts:
            check_kernel_device(self.device, "moe_backend='triton'")
        self.moe_backend = moe_backend
        self.timer: SectionTimer | None = None
        #: chunked chain kernel for prefill: fla's chunk_gated_delta_rule on the GPU when installed
        self.prefill_gdn = _fla_chunk() if self.device.type == "cuda" else None
        moe_layer.stack_experts(self.w, config.num_experts)
        moe_layer.merge_shared_experts(self.w)
        fuse_projections(self.w)

    # ---- construction ----
    @classmethod
    def from_pretrained(cls, folder, *, dtype=torch.bfloat16, device="cpu",
                        gdn_backend: str = "auto", tp: TensorParallel | None = None,
                        moe_backend: str = "auto") -> "HybridModel":
        """A checkpoint folder's model; under tensor parallelism each rank reads its slices."""
        config = HybridConfig.from_pretrained(folder)
        if tp is not None:
            check_divisible(config, tp.world)
        tensors, _ = load_checkpoint(folder, config, dtype=dtype, device=device,
                                     shard=tp.shard if tp is not None and tp.world > 1 else None)
        model = cls(config, tensors, gdn_backend, tp, moe_backend)
        model.folder = Path(folder)
        return model

    @classmethod
    def random(cls, config: HybridConfig, *, dtype=torch.bfloat16, device="cpu",
               seed: int = 0, gdn_backend: str = "auto", mtp: bool = False,
               tp: TensorParallel | None = None, moe_backend: str = "auto") -> "HybridModel":
        """Random weights of the right shapes (benchmarks; no checkpoint needed; a config with
        ``fp8_block``, the ``-fp8`` presets, quantizes the projections Qwen's FP8 releases
        store in FP8, :func:`bole.models.weights.fp8_quantized`); ``mtp`` adds
        a one-layer MTP head, so that drafting costs what a real checkpoint's would. Under
        tensor parallelism every rank draws the whole model and keeps its slices, so the
        weights equal the single-process ones."""
        gen = torch.Generator(device=device).manual_seed(seed)
        tensors = {}
        specs = dict(text_model_specs(config, fused_experts=True))
        if mtp:
            specs.update(mtp_specs(config, num_layers=1, fused_experts=True))
        for name, shape in specs.items():
            if name.endswith("A_log"):
                t = torch.empty(shape, device=device).uniform_(1, 16, generator=gen).log()
            elif name.endswith("dt_bias"):
                t = torch.ones(shape, device=device)
            elif len(shape) == 1:
                t = torch.zeros(shape, device=device) if "linear_attn.norm" not in name else \
                    torch.ones(shape, device=device)
            else:
                t = torch.randn(shape, device=device, generator=gen) * 0.02
            if config.fp8_block is not None and fp8_quantized(name):
                tensors[name] = quantize_blockwise(t, config.fp8_block)
            else:
                tensors[name] = t.to(torch.float32 if name.endswith(FP32_SUFFIXES) else dtype)
        if tp is not None and tp.world > 1:
            check_divisible(config, tp.world)
            tensors = shard_tensors(config, tensors, tp.shard)
        return cls(config, tensors, gdn_backend, tp, moe_backend)

    @property
    def has_mtp_head(self) -> bool:
        """Whether the checkpoint carried an MTP head (its ``mtp.*`` tensors were loaded)."""
        return "mtp.fc.weight" in self.w

    def new_cache(self, max_slots: int, max_len: int) -> HybridCache:
        """Pools for this rank's heads and channels."""
        c = self.config
        shape = CacheShape(len(c.full_attention_layers), len(c.gdn_layers), self.n_kv, c.head_dim,
                           self.gdn_hv, c.linear_key_head_dim, c.linear_value_head_dim,
                           self.conv_dim, c.linear_conv_kernel_dim)
        return HybridCache(shape, max_slots, max_len, dtype=self.dtype, device=self.device)

    def _section(self, name: str):
        return self.timer.section(name) if self.timer is not None else contextlib.nullcontext()

    def _p(self, layer: int) -> str:
        return f"{self.config.weight_prefix}layers.{layer}."

    # ---- layers ----
    def attention_qkv(self, prefix: str, x: torch.Tensor, positions: torch.Tensor, pool):
        """Projections of a gated full-attention layer: ``(q [N, H, hd], gate [N, H, hd])``, q
        normalised and rotated at ``positions``; k (normalised and rotated) and v go straight
        into the rows of ``pool = (k_pool, v_pool, slots, ctx_lens, rows)``
        (:func:`bole.ops.rope.qk_norm_rope_to_pool`). gate is a view into the projection."""
        c, w = self.config, self.w
        N, hd = x.shape[0], c.head_dim
        Hq, Hkv = self.n_heads, self.n_kv
        qkv = linear(x, w[prefix + "qkv_proj.weight"], w.get(prefix + "qkv_proj.bias"))
        q_gate, k, v = torch.split(qkv, [2 * Hq * hd, Hkv * hd, Hkv * hd], dim=-1)
        q, gate = q_gate.view(N, Hq, 2 * hd).chunk(2, dim=-1)
        q = rope.qk_norm_rope_to_pool(
            q, k.view(N, Hkv, hd), v.view(N, Hkv, hd), w[prefix + "q_norm.weight"],
            w[prefix + "k_norm.weight"], positions, self.inv_freq, c.rotary_dim, c.rms_norm_eps,
            *pool)
        return q, gate

    def attention(self, prefix: str, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  batch: ForwardBatch) -> torch.Tensor:
        """A gated attention layer over a KV pool: the nodes' keys/values go to the pool's scratch
        rows, then every node attends to its request's context and its tree ancestors."""
        c, w = self.config, self.w
        q, gate = self.attention_qkv(prefix, x, batch.positions,
                                     (k_pool, v_pool, batch.slots, batch.ctx_lens, None))
        scale = c.head_dim ** -0.5
        if batch.prefill is not None:
            slot, ctx = batch.prefill
            o = prefill_attention(q, k_pool, v_pool, slot, ctx, scale=scale, gate=gate)
        else:
            N, T = q.shape[0], batch.nodes_per_request
            o = tree_attention(q, k_pool, v_pool, batch.slots, batch.ctx_lens,
                               batch.forest.ancestors.reshape(N, T), scale=scale, gate=gate)
        return self.tp.all_reduce(linear(o.reshape(x.shape[0], -1), w[prefix + "o_proj.weight"],
                                         w.get(prefix + "o_proj.bias")))

    def _gdn_projections(self, layer: int, x: torch.Tensor, out: ForwardOutput | None = None):
        """``(mixed_qkv [N, conv_dim], z [N, H_v, d_v], b [N, H_v], a [N, H_v])``, one product
        (written into ``out.projection_store``, allocated by the first GDN layer, when ``out``
        is given and the layout is qwen3.5's)."""
        c, p, w = self.config, self._p(layer) + "linear_attn.", self.w
        N, Hk, Hv = x.shape[0], self.gdn_hk, self.gdn_hv
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        if c.family == "qwen3_next":   # grouped per key head: [q | k | v | z] and [b | a]
            r = Hv // Hk
            proj = linear(x, w[p + "in_proj_qkvzba.weight"])
            qkvz, ba = torch.split(proj, [Hk * (2 * dk + 2 * r * dv), Hk * 2 * r], dim=-1)
            q, k, v, z = torch.split(qkvz.view(N, Hk, -1), [dk, dk, r * dv, r * dv], dim=-1)
            b, a = torch.split(ba.reshape(N, Hk, 2 * r), [r, r], dim=-1)
            mixed = torch.cat([q.reshape(N, -1), k.reshape(N, -1), v.reshape(N, -1)], dim=-1)
            return mixed, z.reshape(N, Hv, dv), b.reshape(N, Hv), a.reshape(N, Hv)
        weight = w[p + "in_proj_all.weight"]
        into = None
        if out is not None:
            if out.projection_store is None:
                out.projection_store = torch.empty(len(c.gdn_layers), N, weight.shape[0],
                                                   dtype=x.dtype, device=x.device)
            into = out.projection_store[self.gdn_index[layer]]
        proj = linear(x, weight, out=into)
        mixed, z, b, a = torch.split(proj, [self.conv_dim, Hv * dv, Hv, Hv], dim=-1)
        return mixed, z.view(N, Hv, dv), b, a

    def _factor_store(self, N: int, device) -> TreeFactors:
        """Buffers for every GDN layer's u, log_decay and k_inv_norm over ``N`` nodes (``k``: an
        empty placeholder; the keys stay views of each layer's convolution output)."""
        c, L = self.config, len(self.config.gdn_layers)
        Hk, Hv = self.gdn_hk, self.gdn_hv
        return TreeFactors(
            log_decay=torch.empty(L, N, Hv, dtype=torch.float64, device=device),
            k=torch.empty(L, 0, device=device),
            u=torch.empty(L, N, Hv, c.linear_value_head_dim, dtype=torch.float32, device=device),
            k_inv_norm=torch.empty(L, N, Hk, dtype=torch.float32, device=device))

    def gdn(self, layer: int, x: torch.Tensor, cache: HybridCache, batch: ForwardBatch,
            out: ForwardOutput) -> torch.Tensor:
        c, p, w = self.config, self._p(layer) + "linear_attn.", self.w
        N, Hk, Hv = x.shape[0], self.gdn_hk, self.gdn_hv
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        gi = self.gdn_index[layer]
        mixed, z, b, a = self._gdn_projections(layer, x, out)
        out.conv_inputs.append(mixed)
        conv = fused.tree_conv1d_pool(mixed, w[p + "conv1d.weight"].reshape(self.conv_dim, -1),
                                      cache.conv_state[gi], batch.slots, batch.conv_windows)
        q, k, v = torch.split(conv, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q, k, v = q.reshape(N, Hk, dk), k.reshape(N, Hk, dk), v.reshape(N, Hv, dv)
        raw = dict(a=a, b=b, A_log=w[p + "A_log"], dt_bias=w[p + "dt_bias"])
        pool, slots = cache.gdn_state[gi], batch.slots
        if batch.prefill is not None and self.prefill_gdn is not None:
            g, beta = gates_from_raw(a[None], b[None], raw["A_log"], raw["dt_bias"])
            o, final = self.prefill_gdn(
                q[None], k[None], v[None], g=g, beta=beta,
                initial_state=pool[slots.long()].contiguous(), output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            out.final_states.append(final.float())
            o = o[0].to(v.dtype).contiguous()
        elif batch.gdn in ("triton-decode", "torch-decode"):
            if batch.nodes_per_request != 1:
                raise ValueError(f"the {batch.gdn} backend decodes one token per request, got "
                                 f"{batch.nodes_per_request} node slots")
            o = gdn_decode_inplace(q, k, v, a, b, raw["A_log"], raw["dt_bias"], pool, slots,
                                   impl=batch.gdn.split("-")[0])
        elif batch.gdn in ("triton", "triton-serial"):
            # Bole's closed-form kernel (factors) or the tree-serial kernel (a snapshot per node)
            if batch.gdn == "triton":
                from bole.ops.gdn.verify.kernel import tree_gdn_verify_triton as kernel
            else:
                from bole.ops.gdn.triton_serial import tree_gdn_serial_triton as kernel
            extra = {}
            if batch.gdn == "triton":
                if out.factor_store is None:
                    out.factor_store = self._factor_store(N, x.device)
                st = out.factor_store
                extra["factors_out"] = TreeFactors(st.log_decay[gi], st.k[gi], st.u[gi],
                                                   st.k_inv_norm[gi])
            if batch.gdn == "triton-serial" and batch.snapshot_store is not None:
                extra["snapshots"] = batch.snapshot_store[gi][:N * Hv * dk * dv].view(
                    N, Hv, dk, dv)
            o, kept = kernel(q[None], k[None], v[None], batch.meta, a=a[None], b=b[None],
                             A_log=raw["A_log"], dt_bias=raw["dt_bias"], initial_state=pool,
                             state_indices=slots, use_qk_l2norm_in_kernel=True, **extra)
            o = o[0]
            (out.factors if batch.gdn == "triton" else out.snapshots).append(kept)
        elif batch.gdn == "torch":
            o, f = tree_gdn_closed_form_dense(q, k, v, **raw, state_pool=pool, slots=slots,
                                              ancestors=batch.forest.ancestors)
            out.factors.append(f)
        else:
            f = batch.forest
            o, snaps = tree_gdn_serial_dense(q, k, v, **raw, state_pool=pool, slots=slots,
                                             parents=f.parents, depth=f.depth,
                                             max_depth=f.max_depth)
            out.snapshots.append(snaps)
        o = fused.gated_rms_norm(o.reshape(N, Hv, dv), z, w[p + "norm.weight"], c.rms_norm_eps)
        return self.tp.all_reduce(linear(o.reshape(N, Hv * dv), w[p + "out_proj.weight"]))

    def dense_mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """SwiGLU MLP under prefix ``p`` (gate and up as one product)."""
        w = self.w
        return linear(fused.silu_mul(linear(x, w[p + "gate_up_proj.weight"])),
                      w[p + "down_proj.weight"])

    def mlp(self, layer: int, x: torch.Tensor, prefix: str | None = None) -> torch.Tensor:
        """The MLP of decoder layer ``layer`` (or of the layer under ``prefix``, the MTP head's):
        a mixture of experts where the weights hold one, else dense."""
        p = (prefix or self._p(layer)) + "mlp."
        if p + FUSED_GATE_UP in self.w:
            return self.tp.all_reduce(self.moe(x, p))
        return self.tp.all_reduce(self.dense_mlp(x, p))

    def moe_routing(self, x: torch.Tensor, p: str):
        """``(topk_weights [N, k'] fp32, topk_ids [N, k'] int32, shared [N, H] or None)``: the
        routing of MoE layer ``p`` (:func:`bole.models.moe_layer.moe_routing`: with the shared
        expert merged, k' = k + 1 and its slot last)."""
        return moe_layer.moe_routing(self.w, p, x, self.config, self.moe_backend)

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """Mixture of experts (and a gated shared expert) under prefix ``p`` (``...mlp.``): the
        routing on the device, then the fused kernels (``moe_backend="triton"``: no host sync)
        or the torch loop over the experts used (``"torch"``, the reference)."""
        return moe_layer.moe_forward(self.w, p, x, self.moe_routing(x, p), self.moe_backend)

    @property
    def graph_safe(self) -> bool:
        """Whether a forward can be captured in a CUDA graph (the torch MoE loop syncs the
        host; the fused MoE kernels do not)."""
        return self.config.num_experts == 0 or self.moe_backend == "triton"

    # ---- the forward ----
    @torch.no_grad()
    def forward(self, cache: HybridCache, batch: ForwardBatch, *,
                logits: bool = True) -> ForwardOutput:
        """Run every node of ``batch`` on top of each request's committed state.

        The committed state is only read; the nodes' keys and values land in the KV pool's
        scratch rows. Returns the logits (fp32, unless ``logits=False``), the final-norm hidden
        states and per GDN layer what a commit needs."""
        c = self.config
        out = ForwardOutput()
        with self._section("rest"):
            hidden = self.embed(batch.tokens)
        residual = None
        eps = c.rms_norm_eps
        for layer in range(c.num_hidden_layers):
            p = self._p(layer)
            full = c.is_full_attention(layer)
            with self._section("attention" if full else "gdn"):
                x, residual = fused.add_rms_norm(hidden, self.w[p + "input_layernorm.weight"], eps,
                                                 residual)
                if full:
                    li = self.full_index[layer]
                    hidden = self.attention(p + "self_attn.", x, cache.k[li], cache.v[li], batch)
                else:
                    hidden = self.gdn(layer, x, cache, batch, out)
            with self._section("mlp"):
                x, residual = fused.add_rms_norm(hidden, self.w[p + "post_attention_layernorm.weight"],
                                                 eps, residual)
                hidden = self.mlp(layer, x)
        with self._section("rest"):
            out.hidden, _ = fused.add_rms_norm(hidden, self.w[f"{c.weight_prefix}norm.weight"], eps,
                                               residual)
            if logits:
                out.logits = self.lm_head(out.hidden)
        return out

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-norm hidden states (tied to the embedding when the config says
        so); each rank's vocabulary range, gathered over the ranks."""
        return self.tp.all_gather_last(linear(hidden, self.lm_head_weight).float())

    @property
    def lm_head_weight(self) -> torch.Tensor:
        c = self.config
        return self.w[f"{c.weight_prefix}embed_tokens.weight"] if c.tie_word_embeddings else \
            self.w["lm_head.weight"]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings; each rank looks up its vocabulary range (zeros outside it) and the
        ranks' rows are summed."""
        table = self.w[f"{self.config.weight_prefix}embed_tokens.weight"]
        if self.tp.world == 1:
            return F.embedding(tokens, table)
        local = tokens - self.tp.rank * self.vocab_part
        inside = (local >= 0) & (local < self.vocab_part)
        rows = F.embedding(local.clamp(0, self.vocab_part - 1), table)
        return self.tp.all_reduce(rows * inside[..., None].to(rows.dtype))
