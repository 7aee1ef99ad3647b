"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text models for serving: the layers of one tree forward.

Every forward is a tree forward over R requests x T node slots (:class:`ForwardBatch`):
    decode      = T = 1, a lone root per request
    prefill     = one request, a chain per chunk of the prompt
    verify      = the drafted trees
so the same exact operations (tree attention over the KV pool; for linear attention, the tree
conv and the closed form) serve all three. The forward only reads the committed state; it writes
its nodes' keys and values into the KV pool's scratch rows past each request's committed length,
and leaves the per-layer pieces of a commit in a :class:`ForwardOutput`. The commit itself (and
input buffers, CUDA graphs) is the runner's (:mod:`bole.engine.runner`).

The full-attention layers, the MLPs and the embedding are here; each linear-attention layer type
(Gated DeltaNet, ...) is its own module under :mod:`bole.models.layers`, built once per model
from the registry and called through its interface. Conventions of transformers' Qwen3.5 /
Qwen3-Next code are matched (tests/models compare logits): zero-centred RMSNorm (1 + w),
sigmoid-gated attention output, q/k RMSNorm per head, partial rotary on the first
``head_dim * partial_rotary_factor`` dims. Projections that read the same input run as one
matrix product (their checkpoint tensors become views of the fused weight); norms, gates and the
conv are single kernels on the GPU (:mod:`bole.ops.fused`). MoE experts are stacked at load time
in the layout the fused kernels read, with the gated shared expert as one more expert
(:mod:`bole.models.moe_layer`).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from pathlib import Path

import torch
import torch.nn.functional as F

from bole.cache import CacheShape, HybridCache
from bole.distributed import TensorParallel, TPShard
from bole.models.batch import BACKENDS, ForwardBatch, ForwardOutput
from bole.models import moe_layer
from bole.models.config import HybridConfig
from bole.models.fusion import fuse_projections
from bole.models.layers.base import LinearAttention
from bole.models.layers.registry import linear_attention_type
from bole.models.loader import load_checkpoint
from bole.models.sharding import check_divisible, shard_tensors
from bole.models.weights import (FP32_SUFFIXES, FUSED_GATE_UP, fp8_quantized, mtp_specs,
                                 text_model_specs)
from bole.ops import fused, rope
from bole.ops.attention import prefill_attention, tree_attention
from bole.ops.fp8 import quantize_blockwise
from bole.ops.linear import linear
from bole.ops.triton_utils import check_kernel_device

__all__ = ["HybridModel", "SectionTimer", "BACKENDS", "MOE_BACKENDS"]

#: "triton": the fused grouped-GEMM kernels (CUDA graph safe); "torch": the loop over experts
MOE_BACKENDS = ("triton", "torch")


class SectionTimer:
    """Accumulates wall time per section (attention, each linear-attention type's section
    (gdn), mlp, rest) of forwards, device-synced.

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
        c = config
        self.tp = tp or TensorParallel(TPShard(0, 1))
        world = self.tp.world
        check_divisible(c, world)
        if world > 1 and c.fp8_block is not None:
            raise ValueError("tensor parallelism over FP8 weights is not supported yet: run an "
                             "FP8 model on one GPU (tp 1)")
        #: this rank's heads and channels (all of them without tensor parallelism)
        self.n_heads, self.n_kv = c.num_attention_heads // world, c.num_key_value_heads // world
        self.vocab_part = c.vocab_size // world
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32)
                                      / c.rotary_dim))
        self.inv_freq = inv.to(self.device)
        if gdn_backend == "auto":
            gdn_backend = "triton" if self.device.type == "cuda" else "torch"
        if gdn_backend not in BACKENDS:
            raise ValueError(f"gdn_backend must be one of {BACKENDS} or 'auto', got {gdn_backend!r}")
        if gdn_backend.startswith("triton"):
            check_kernel_device(self.device, f"gdn_backend={gdn_backend!r}")
        #: the default backend of Bole's closed form (every linear-attention layer's) on this
        #: device ("triton" on a GPU); an engine
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
        #: each linear-attention layer type of the model, by its ``layer_types`` name
        self.linear: dict[str, LinearAttention] = {
            kind: linear_attention_type(kind)(config, cfg, self.w, self.tp, self.device)
            for kind, cfg in config.linear_attention}
        #: per decoder layer: its prefix, its KV pool index (full attention) or its
        #: linear-attention type (else None)
        self.layer_plan = tuple(
            (self._p(i), self.full_index.get(i), self.linear.get(c.layer_types[i]))
            for i in range(c.num_hidden_layers))
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
        kinds = [linear_attention_type(kind) for kind, _ in config.linear_attention]
        for name, shape in specs.items():
            t = next((t for t in (k.init_tensor(name, shape, device, gen) for k in kinds)
                      if t is not None), None)
            if t is None:
                t = torch.zeros(shape, device=device) if len(shape) == 1 else \
                    torch.randn(shape, device=device, generator=gen) * 0.02
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

    @property
    def chunked_prefill(self) -> bool:
        """Whether prefill chunks run chunked chain kernels (fla's on a GPU where installed) in
        every linear-attention layer: long chunks then pay off."""
        return bool(self.linear) and all(t.chunked_prefill for t in self.linear.values())

    def new_cache(self, max_slots: int, max_len: int) -> HybridCache:
        """Pools for this rank's heads and channels: KV, and each linear-attention type's state."""
        c = self.config
        shape = CacheShape(len(c.full_attention_layers), self.n_kv, c.head_dim,
                           tuple(p for t in self.linear.values() for p in t.state_pools()))
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
        states and per linear-attention layer type what a commit needs."""
        c = self.config
        out = ForwardOutput(linear={kind: t.new_output() for kind, t in self.linear.items()})
        with self._section("rest"):
            hidden = self.embed(batch.tokens)
        residual = None
        eps = c.rms_norm_eps
        for layer, (p, li, mixer) in enumerate(self.layer_plan):
            with self._section("attention" if mixer is None else mixer.section):
                x, residual = fused.add_rms_norm(hidden, self.w[p + "input_layernorm.weight"], eps,
                                                 residual)
                if mixer is None:
                    hidden = self.attention(p + "self_attn.", x, cache.k[li], cache.v[li], batch)
                else:
                    hidden = mixer.forward(layer, x, cache, batch, out.linear[mixer.name])
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
