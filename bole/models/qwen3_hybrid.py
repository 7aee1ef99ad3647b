"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text models for serving: one tree forward and one commit.

Everything is a tree forward over a packed forest of draft trees, one tree per request slot:
    decode      = a forest of lone roots, then commit node 0
    prefill     = a chain per chunk of the prompt, then commit its last node (chunked prefill)
    verify      = the drafted trees; commit each request's accepted node after sampling
so the same exact operations (tree attention, tree conv, closed-form GDN, factored commit) serve all
three, and greedy speculative output equals plain decoding by construction.

Conventions of transformers' Qwen3.5 / Qwen3-Next code are matched (tests/models compare logits):
zero-centred RMSNorm (1 + w), sigmoid-gated attention output, q/k RMSNorm per head, partial rotary
on the first ``head_dim * partial_rotary_factor`` dims, GDN conv + SiLU over [q | k | v], gates
``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, q/k l2-normalised, gated RMSNorm of
the GDN output with silu(z). This module is the CPU path (plain torch); kernels plug in on the GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bole.cache import CacheShape, HybridCache
from bole.models.config import HybridConfig
from bole.models.loader import load_checkpoint
from bole.models.weights import FP32_SUFFIXES, text_model_specs
from bole.ops.conv import conv_commit_rows, conv_state_commit, tree_conv1d, tree_conv_windows
from bole.ops.gdn.closed_form import TreeFactors, commit_factored, tree_gdn_closed_form
from bole.ops.gdn.common import gates_from_raw
from bole.ops.gdn.reference import tree_gdn_serial
from bole.ops.triton_utils import check_kernel_device
from bole.tree import DraftTree, PackedForest

PREFILL_CHUNK = 64

#: How GDN layers verify a tree and commit:
#:   torch         closed form + factored commit in plain torch (CPU path, oracle)
#:   triton        Bole: value-tiled closed-form kernel + one cross-layer factored-commit launch
#:   triton-serial the tree-serial baseline: node-by-node kernel, a state snapshot per node,
#:                 copy of the accepted snapshot
#:   torch-serial  the tree-serial semantics in plain torch (CPU): per-node states, copy commit
GDN_BACKENDS = ("torch", "triton", "triton-serial", "torch-serial")


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


def _fla_chunk():
    """fla's chunked GDN kernel, or None when fla is not installed (the tree path then prefills)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:               # fla absent, or failing to import on this machine
        return None
    return chunk_gated_delta_rule


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)`` in fp32, back to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: ``w * x / rms(x) * silu(z)`` (plain weight, not zero-centred)."""
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = w * h.to(dt)
    return (h * F.silu(z.float())).to(dt)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class TreeForwardOutput:
    """What one tree forward leaves for sampling, drafting and the commit.

    logits [N, V] (fp32), hidden [N, H] (final-norm input for the MTP drafter: the last layer's
    output after the final norm, what the lm_head and an MTP head read), and per layer the state
    pieces the commit needs.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    forest: PackedForest
    slots: list[int]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]          # full layer -> (k, v) [N, H_kv, hd]
    conv_inputs: dict[int, torch.Tensor]                      # GDN layer -> [N, conv_dim]
    factors: dict[int, TreeFactors]                           # GDN layer -> factors
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)  # triton-serial only
    final_states: dict[int, torch.Tensor] = field(default_factory=dict)  # chain prefill (fla)
    meta: object = None                                       # ForestMeta for the kernels
    chain_prefill: bool = False                               # GDN by the chunked chain kernel
    conv_windows: torch.Tensor | None = None                  # [N, K] built once per forward
    attention_rows: list = field(default_factory=list)        # per request: lo, hi, n_ctx, visible
    slot_index: torch.Tensor | None = None                    # [R] int32 slots on the device


class HybridModel:
    """A hybrid text model held as tensors by checkpoint name."""

    def __init__(self, config: HybridConfig, tensors: dict[str, torch.Tensor],
                 gdn_backend: str = "auto"):
        self.config = config
        self.w = tensors
        self.dtype = tensors[f"{config.weight_prefix}embed_tokens.weight"].dtype
        self.device = tensors[f"{config.weight_prefix}embed_tokens.weight"].device
        self.full_index = {layer: i for i, layer in enumerate(config.full_attention_layers)}
        self.gdn_index = {layer: i for i, layer in enumerate(config.gdn_layers)}
        c = config
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32)
                                      / c.rotary_dim))
        self.inv_freq = inv.to(self.device)
        if gdn_backend == "auto":
            gdn_backend = "triton" if self.device.type == "cuda" else "torch"
        if gdn_backend not in GDN_BACKENDS:
            raise ValueError(f"gdn_backend must be one of {GDN_BACKENDS} or 'auto', got {gdn_backend!r}")
        if gdn_backend.startswith("triton"):
            check_kernel_device(self.device, f"gdn_backend={gdn_backend!r}")
        self.gdn_backend = gdn_backend
        self.timer: SectionTimer | None = None
        #: chunked chain kernel for prefill: fla's chunk_gated_delta_rule on the GPU when installed
        self.prefill_gdn = _fla_chunk() if self.device.type == "cuda" else None

    # ---- construction ----
    @classmethod
    def from_pretrained(cls, folder, *, dtype=torch.bfloat16, device="cpu",
                        gdn_backend: str = "auto") -> "HybridModel":
        config = HybridConfig.from_pretrained(folder)
        tensors, _ = load_checkpoint(folder, config, dtype=dtype, device=device)
        return cls(config, tensors, gdn_backend)

    @classmethod
    def random(cls, config: HybridConfig, *, dtype=torch.bfloat16, device="cpu",
               seed: int = 0, gdn_backend: str = "auto") -> "HybridModel":
        """Random weights of the right shapes (benchmarks; no checkpoint needed)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        tensors = {}
        for name, shape in text_model_specs(config).items():
            if name.endswith("A_log"):
                t = torch.empty(shape, device=device).uniform_(1, 16, generator=gen).log()
            elif name.endswith("dt_bias"):
                t = torch.ones(shape, device=device)
            elif len(shape) == 1:
                t = torch.zeros(shape, device=device) if "linear_attn.norm" not in name else \
                    torch.ones(shape, device=device)
            else:
                t = torch.randn(shape, device=device, generator=gen) * 0.02
            tensors[name] = t.to(torch.float32 if name.endswith(FP32_SUFFIXES) else dtype)
        return cls(config, tensors, gdn_backend)

    @property
    def has_mtp_head(self) -> bool:
        """Whether the checkpoint carried an MTP head (its ``mtp.*`` tensors were loaded)."""
        return "mtp.fc.weight" in self.w

    def new_cache(self, max_slots: int, max_len: int) -> HybridCache:
        return HybridCache(CacheShape.from_config(self.config), max_slots, max_len,
                           dtype=self.dtype, device=self.device)

    def _slot_tensor(self, slots: list[int]) -> torch.Tensor:
        """``[R]`` int32 slots on the device, built once per forward: the kernels' state_indices
        and the index of every cache gather / scatter (a Python list as an index, or a new tensor
        per layer, is a pageable host-to-device copy, which synchronises the stream, per layer)."""
        return torch.tensor(slots, dtype=torch.int32).to(self.device)

    def _section(self, name: str):
        return self.timer.section(name) if self.timer is not None else contextlib.nullcontext()

    def _p(self, layer: int) -> str:
        return f"{self.config.weight_prefix}layers.{layer}."

    # ---- layers ----
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on the first rotary_dim dims of x [N, heads, hd] at positions [N]."""
        freqs = positions.to(self.device, torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        rd = self.config.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

    def attention_qkv(self, prefix: str, x: torch.Tensor, positions: torch.Tensor):
        """Projections of a gated full-attention layer: ``(q [N, H, hd], k, v [N, H_kv, hd],
        gate [N, H * hd])``, q and k normalised and rotated at ``positions``."""
        c, w = self.config, self.w
        N, hd = x.shape[0], c.head_dim
        q_gate = F.linear(x, w[prefix + "q_proj.weight"], w.get(prefix + "q_proj.bias"))
        q, gate = q_gate.view(N, -1, 2 * hd).chunk(2, dim=-1)
        k = F.linear(x, w[prefix + "k_proj.weight"], w.get(prefix + "k_proj.bias")).view(N, -1, hd)
        v = F.linear(x, w[prefix + "v_proj.weight"], w.get(prefix + "v_proj.bias")).view(N, -1, hd)
        q = self._rope(rms_norm(q, w[prefix + "q_norm.weight"], c.rms_norm_eps), positions)
        k = self._rope(rms_norm(k, w[prefix + "k_norm.weight"], c.rms_norm_eps), positions)
        return q, k, v, gate.reshape(N, -1)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``q [T, H, hd]`` over ``keys, vals [C, H_kv, hd]`` where
        ``visible [T, C]``; fp32 scores, GQA by repeating each KV head. Returns ``[T, H, hd]``."""
        c = self.config
        group = c.num_attention_heads // c.num_key_value_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()   # [H, C, hd]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1).float()
        scores = q.transpose(0, 1).float() @ keys.transpose(1, 2) * c.head_dim ** -0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ vals).transpose(0, 1).to(q.dtype)

    def _attention(self, layer: int, x: torch.Tensor, cache: HybridCache, out: TreeForwardOutput,
                   positions: torch.Tensor) -> torch.Tensor:
        p = self._p(layer) + "self_attn."
        q, k, v, gate = self.attention_qkv(p, x, positions)
        out.kv[layer] = (k, v)
        li = self.full_index[layer]
        o = torch.empty_like(q)
        for slot, (lo, hi, n_ctx, visible) in zip(out.slots, out.attention_rows):
            keys = torch.cat([cache.k[li, slot, :n_ctx], k[lo:hi]])
            vals = torch.cat([cache.v[li, slot, :n_ctx], v[lo:hi]])
            o[lo:hi] = self.attend(q[lo:hi], keys, vals, visible)
        o = o.reshape(x.shape[0], -1) * torch.sigmoid(gate)
        return F.linear(o, self.w[p + "o_proj.weight"], self.w.get(p + "o_proj.bias"))

    def _gdn_projections(self, layer: int, x: torch.Tensor):
        """``(mixed_qkv [N, conv_dim], z [N, H_v, d_v], b [N, H_v], a [N, H_v])``."""
        c, p, w = self.config, self._p(layer) + "linear_attn.", self.w
        N, Hk, Hv = x.shape[0], c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        if c.family == "qwen3_next":   # grouped per key head: [q | k | v | z] and [b | a]
            r = Hv // Hk
            qkvz = F.linear(x, w[p + "in_proj_qkvz.weight"]).view(N, Hk, 2 * dk + 2 * r * dv)
            q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
            ba = F.linear(x, w[p + "in_proj_ba.weight"]).view(N, Hk, 2 * r)
            b, a = torch.split(ba, [r, r], dim=-1)
            mixed = torch.cat([q.reshape(N, -1), k.reshape(N, -1), v.reshape(N, -1)], dim=-1)
            return mixed, z.reshape(N, Hv, dv), b.reshape(N, Hv), a.reshape(N, Hv)
        mixed = F.linear(x, w[p + "in_proj_qkv.weight"])
        z = F.linear(x, w[p + "in_proj_z.weight"]).view(N, Hv, dv)
        return (mixed, z, F.linear(x, w[p + "in_proj_b.weight"]),
                F.linear(x, w[p + "in_proj_a.weight"]))

    def _gdn(self, layer: int, x: torch.Tensor, cache: HybridCache,
             out: TreeForwardOutput) -> torch.Tensor:
        c, p, w = self.config, self._p(layer) + "linear_attn.", self.w
        N, Hk, Hv = x.shape[0], c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        gi = self.gdn_index[layer]
        slots = out.slot_index
        mixed, z, b, a = self._gdn_projections(layer, x)
        out.conv_inputs[layer] = mixed
        conv = tree_conv1d(mixed[None], w[p + "conv1d.weight"], cache.conv_state[gi, slots],
                           out.forest, windows=out.conv_windows)[0]
        q, k, v = torch.split(conv, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q, k, v = q.reshape(1, N, Hk, dk), k.reshape(1, N, Hk, dk), v.reshape(1, N, Hv, dv)
        gates = dict(a=a[None], b=b[None], A_log=w[p + "A_log"], dt_bias=w[p + "dt_bias"],
                     use_qk_l2norm_in_kernel=True)
        if out.chain_prefill:                       # one chain: the chunked prefill kernel
            g, beta = gates_from_raw(a[None], b[None], w[p + "A_log"], w[p + "dt_bias"])
            o, out.final_states[layer] = self.prefill_gdn(
                q, k, v, g=g, beta=beta, initial_state=cache.gdn_state[gi, slots].contiguous(),
                output_final_state=True, use_qk_l2norm_in_kernel=True)
            o = o.to(v.dtype)
        elif self.gdn_backend == "torch":
            o, out.factors[layer] = tree_gdn_closed_form(
                q, k, v, out.forest, initial_state=cache.gdn_state[gi, slots],
                check_values=False, **gates)
        elif self.gdn_backend == "triton":
            from bole.ops.gdn.triton_verify import tree_gdn_verify_triton
            o, out.factors[layer] = tree_gdn_verify_triton(
                q, k, v, out.meta, initial_state=cache.gdn_state[gi],
                state_indices=slots, **gates)
        elif self.gdn_backend == "torch-serial":
            o, _, out.snapshots[layer] = tree_gdn_serial(
                q, k, v, out.forest, initial_state=cache.gdn_state[gi, slots],
                return_states=True, check_values=False, **gates)
        else:
            from bole.ops.gdn.triton_serial import tree_gdn_serial_triton
            o, out.snapshots[layer] = tree_gdn_serial_triton(
                q, k, v, out.meta, initial_state=cache.gdn_state[gi],
                state_indices=slots, **gates)
        o = gated_rms_norm(o[0], z, w[p + "norm.weight"], c.rms_norm_eps)
        return F.linear(o.reshape(N, Hv * dv), w[p + "out_proj.weight"])

    def _dense_mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        return F.linear(F.silu(F.linear(x, w[p + "gate_proj.weight"]))
                        * F.linear(x, w[p + "up_proj.weight"]), w[p + "down_proj.weight"])

    def _mlp(self, layer: int, x: torch.Tensor, prefix: str | None = None) -> torch.Tensor:
        c = self.config
        p = (prefix or self._p(layer)) + "mlp."
        if not c.is_moe_layer(layer):
            return self._dense_mlp(x, p)
        logits = F.linear(x, self.w[p + "gate.weight"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_p, top_i = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        top_p = top_p.to(x.dtype)
        y = torch.zeros_like(x)
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            y.index_add_(0, tok, self._dense_mlp(x[tok], f"{p}experts.{e}.") * top_p[tok, slot, None])
        if c.shared_expert_intermediate_size:
            shared = self._dense_mlp(x, p + "shared_expert.")
            y = y + torch.sigmoid(F.linear(x, self.w[p + "shared_expert_gate.weight"])) * shared
        return y

    # ---- the forward and the commit ----
    @torch.no_grad()
    def forward_tree(self, cache: HybridCache, slots, forest: PackedForest,
                     tokens: torch.Tensor, *, chain_prefill: bool = False) -> TreeForwardOutput:
        """Run every node of ``forest`` (one tree per slot) on top of each slot's committed state.

        ``tokens [N]``: node tokens, node 0 of each tree the last sampled (not yet seen) token.
        Caches are only read. Returns per-node logits and what :meth:`commit` needs.
        """
        c = self.config
        slots = cache.check_slots(slots)
        if len(slots) != forest.num_requests:
            raise ValueError(f"{len(slots)} slots for a forest of {forest.num_requests} trees")
        if tokens.shape != (forest.num_nodes,):
            raise ValueError(f"tokens has shape {tuple(tokens.shape)}, expected [{forest.num_nodes}]")
        if forest.num_valid_nodes != forest.num_nodes:
            raise ValueError("padded forests are for kernels; pass the forest without padding")
        if bool(((tokens < 0) | (tokens >= c.vocab_size)).any()):
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        lengths = cache.lengths[slots]
        deepest = torch.tensor([int(forest.tree(r).max_depth) for r in range(len(slots))])
        need = lengths + deepest + 1
        if bool((need > cache.max_len).any()):
            raise ValueError(f"the tree would reach position {int(need.max()) - 1}, past the "
                             f"cache's {cache.max_len} tokens per slot")
        positions = forest.positions(lengths).to(self.device)      # once, not per layer
        out = TreeForwardOutput(None, None, forest, slots, {}, {}, {})
        out.slot_index = self._slot_tensor(slots)
        out.chain_prefill = chain_prefill and self.prefill_gdn is not None
        # per-forest structure, built once and shared by every layer
        if self.gdn_backend != "torch" and not out.chain_prefill:
            out.meta = forest.kernel_meta(self.device)
        if c.gdn_layers:
            out.conv_windows = tree_conv_windows(forest, c.linear_conv_kernel_dim).to(self.device)
        cu = forest.cu_nodes.tolist()
        for r, slot in enumerate(slots):
            lo, hi, n_ctx = cu[r], cu[r + 1], int(cache.lengths[slot])
            anc = forest.tree(r).ancestor_mask().to(self.device)
            visible = torch.cat([torch.ones(hi - lo, n_ctx, dtype=torch.bool, device=self.device),
                                 anc], dim=1)
            out.attention_rows.append((lo, hi, n_ctx, visible))
        with self._section("rest"):
            h = self.embed(tokens)
        for layer in range(c.num_hidden_layers):
            p = self._p(layer)
            full = c.is_full_attention(layer)
            with self._section("attention" if full else "gdn"):
                x = rms_norm(h, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
                if full:
                    h = h + self._attention(layer, x, cache, out, positions)
                else:
                    h = h + self._gdn(layer, x, cache, out)
            with self._section("mlp"):
                x = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
                h = h + self._mlp(layer, x)
        with self._section("rest"):
            out.hidden = rms_norm(h, self.w[f"{c.weight_prefix}norm.weight"], c.rms_norm_eps)
            out.logits = self.lm_head(out.hidden)
        return out

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-norm hidden states (tied to the embedding when the config says so)."""
        c = self.config
        head = self.w[f"{c.weight_prefix}embed_tokens.weight"] if c.tie_word_embeddings else \
            self.w["lm_head.weight"]
        return F.linear(hidden, head).float()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens.to(self.device),
                           self.w[f"{self.config.weight_prefix}embed_tokens.weight"])

    @torch.no_grad()
    def commit(self, cache: HybridCache, out: TreeForwardOutput, accepted) -> None:
        """Make each slot's accepted path (root .. accepted node, local index) its new state."""
        f, slots = out.forest, out.slot_index
        index, lengths = f.padded_paths(accepted)
        # the paths reach the device once per commit, not once per layer (each host-to-device
        # copy of a pageable tensor synchronises the stream)
        index_d = index.to(self.device)
        for layer, (k, v) in out.kv.items():
            li = self.full_index[layer]
            for r, slot in enumerate(out.slots):
                n0, n = int(cache.lengths[slot]), int(lengths[r])
                cache.k[li, slot, n0:n0 + n] = k[index_d[r, :n]]
                cache.v[li, slot, n0:n0 + n] = v[index_d[r, :n]]
        if out.chain_prefill:                       # the chain kernel's final state
            if [int(a) for a in accepted] != [n - 1 for n in f.sizes().tolist()]:
                raise ValueError("a chain prefill commits the whole chunk")
            for layer, final in out.final_states.items():
                cache.gdn_state[self.gdn_index[layer], slots] = final.float()
        elif self.gdn_backend in ("torch", "triton"):   # every GDN layer at once
            layers = sorted(out.factors, key=self.gdn_index.get)
            if [self.gdn_index[g] for g in layers] != list(range(len(self.gdn_index))):
                raise RuntimeError("the cross-layer commit needs the factors of every GDN layer")
            stacked = TreeFactors.stack([out.factors[g] for g in layers])
            if self.gdn_backend == "torch":
                cache.gdn_state[:, slots] = commit_factored(stacked, cache.gdn_state[:, slots],
                                                            f, accepted)
            else:                                       # one launch, in place
                from bole.ops.gdn.triton_commit import commit_factored_triton
                commit_factored_triton(stacked, cache.gdn_state, slots, index_d,
                                       lengths.to(self.device))
        else:                                           # copy the accepted node's snapshot
            last = index_d[:, -1].contiguous()          # rows are padded with the accepted node
            for layer, snaps in out.snapshots.items():
                gi = self.gdn_index[layer]
                if self.gdn_backend == "torch-serial":
                    cache.gdn_state[gi, slots] = snaps[last]
                else:
                    from bole.ops.gdn.triton_serial import commit_from_snapshots_triton
                    commit_from_snapshots_triton(snaps, cache.gdn_state[gi],
                                                 slots, last)
        if out.conv_inputs:
            rows = conv_commit_rows(f, accepted, self.config.linear_conv_kernel_dim,
                                    out.conv_windows).to(self.device)
        for layer, mixed in out.conv_inputs.items():
            gi = self.gdn_index[layer]
            cache.conv_state[gi, slots] = conv_state_commit(
                mixed[None], cache.conv_state[gi, slots], f, accepted, rows_index=rows)
        for r, slot in enumerate(out.slots):
            cache.lengths[slot] += int(lengths[r])

    # ---- decode and prefill as tree forwards ----
    def decode(self, cache: HybridCache, slots, tokens: torch.Tensor) -> torch.Tensor:
        """One token per slot; returns logits [B, V] and commits the token."""
        forest = PackedForest.pack([DraftTree.chain(1)] * len(tokens))
        out = self.forward_tree(cache, slots, forest, tokens)
        self.commit(cache, out, [0] * len(tokens))
        return out.logits

    def prefill(self, cache: HybridCache, slot: int, prompt: torch.Tensor,
                chunk: int = PREFILL_CHUNK, return_hidden: bool = False):
        """Commit a prompt into ``slot`` chunk by chunk; returns the logits of every prompt token
        (and, with ``return_hidden``, their final-norm hidden states as a second value)."""
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError("prompt must be a non-empty 1-D tensor of token ids")
        logits, hidden = [], []
        for lo in range(0, prompt.numel(), chunk):
            part = prompt[lo:lo + chunk]
            out = self.forward_tree(cache, [slot], PackedForest.pack([DraftTree.chain(len(part))]),
                                    part, chain_prefill=True)
            self.commit(cache, out, [len(part) - 1])
            logits.append(out.logits)
            hidden.append(out.hidden)
        if return_hidden:
            return torch.cat(logits), torch.cat(hidden)
        return torch.cat(logits)
