"""The checkpoint's MTP head as an EAGLE-style tree drafter, with its own KV cache per slot.

MTP step at position p (vLLM's Qwen3-Next / Qwen3.5 convention):
    x = fc([ norm_e(embed(token_p)) | norm_h(h_{p-1}) ]);  m_p = norm(decoder_layer(x))
    logits_p = lm_head(m_p)  (predicts token p + 1)
where h_{p-1} is the target's final-norm hidden state at p - 1 for committed positions, and the
MTP's own output m of the parent for deeper draft nodes (EAGLE-style). The layer's attention sees
the MTP KV of committed positions 1..n-1 (position 0 has no previous hidden) plus the draft path.

Bookkeeping per slot: after the prefill, :meth:`observe` writes the MTP KV of the prompt; after every
commit it writes the accepted path's entries with the *target* hidden states, so drafting always
starts from exactly the KV a full re-computation would give (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bole.models.qwen3_hybrid import HybridModel, rms_norm
from bole.spec.draft_tree import Expander

MTP_LAYER = "mtp.layers.0."


class MTPDrafter:
    def __init__(self, model: HybridModel, max_slots: int, max_len: int):
        missing = [n for n in ("mtp.fc.weight", MTP_LAYER + "self_attn.q_proj.weight")
                   if n not in model.w]
        if missing:
            raise ValueError("this checkpoint has no MTP head (no mtp.* tensors); "
                             "use the ngram drafter")
        c = model.config
        self.model = model
        self.k = torch.zeros(max_slots, max_len, c.num_key_value_heads, c.head_dim,
                             dtype=model.dtype, device=model.device)
        self.v = torch.zeros_like(self.k)
        self.length = [0] * max_slots             # MTP positions written: 1 .. length - 1
        self.last_hidden: list[torch.Tensor | None] = [None] * max_slots

    # ---- the MTP layer ----
    def _step(self, tokens, hiddens, positions, ctx_k, ctx_v, visible):
        """MTP layer on ``T`` nodes: returns (logits [T, V], m [T, H], k, v [T, H_kv, hd])."""
        m, w, c = self.model, self.model.w, self.model.config
        e = rms_norm(m.embed(tokens), w["mtp.pre_fc_norm_embedding.weight"], c.rms_norm_eps)
        h = rms_norm(hiddens.to(e.dtype), w["mtp.pre_fc_norm_hidden.weight"], c.rms_norm_eps)
        x = F.linear(torch.cat([e, h], dim=-1), w["mtp.fc.weight"])
        a = rms_norm(x, w[MTP_LAYER + "input_layernorm.weight"], c.rms_norm_eps)
        q, k, v, gate = m.attention_qkv(MTP_LAYER + "self_attn.", a, positions)
        o = m.attend(q, torch.cat([ctx_k, k]), torch.cat([ctx_v, v]), visible)
        o = F.linear(o.reshape(len(tokens), -1) * torch.sigmoid(gate),
                     w[MTP_LAYER + "self_attn.o_proj.weight"], w.get(MTP_LAYER + "self_attn.o_proj.bias"))
        x = x + o
        x = x + m._mlp(0, rms_norm(x, w[MTP_LAYER + "post_attention_layernorm.weight"],
                                   c.rms_norm_eps), prefix=MTP_LAYER)
        out = rms_norm(x, w["mtp.norm.weight"], c.rms_norm_eps)
        return m.lm_head(out), out, k, v

    def _context(self, slot: int):
        n = self.length[slot]
        lo = 1 if n > 0 else 0
        return self.k[slot, lo:n], self.v[slot, lo:n]

    # ---- keeping the MTP cache in step with the target ----
    def reset(self, slot: int) -> None:
        self.length[slot] = 0
        self.last_hidden[slot] = None

    @torch.no_grad()
    def observe(self, slot: int, tokens: list[int], hiddens: torch.Tensor, start: int) -> None:
        """The target committed ``tokens`` at positions ``start ..`` with final-norm ``hiddens``
        (one per token). Writes the MTP entries at those positions (position 0 has none)."""
        if start != self.length[slot] and not (start == 0 and self.length[slot] == 0):
            raise RuntimeError(f"MTP cache of slot {slot} is at {self.length[slot]}, target at {start}")
        prev = [self.last_hidden[slot]] + list(hiddens[:-1])
        pos = [start + i for i in range(len(tokens))]
        keep = [i for i, p in enumerate(pos) if p >= 1 and prev[i] is not None]
        if keep:
            ctx_k, ctx_v = self._context(slot)
            C, T = ctx_k.shape[0], len(keep)
            causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=self.k.device))
            visible = torch.cat([torch.ones(T, C, dtype=torch.bool, device=self.k.device), causal], 1)
            toks = torch.tensor([tokens[i] for i in keep], device=self.k.device)
            hs = torch.stack([prev[i] for i in keep])
            ps = torch.tensor([pos[i] for i in keep])
            _, _, k, v = self._step(toks, hs, ps, ctx_k, ctx_v, visible)
            self.k[slot, pos[keep[0]]: pos[keep[-1]] + 1] = k
            self.v[slot, pos[keep[0]]: pos[keep[-1]] + 1] = v
        self.length[slot] = start + len(tokens)
        self.last_hidden[slot] = hiddens[-1]

    # ---- drafting ----
    def expander(self, slot: int) -> Expander:
        """Expander for one round: the root is the next token, at position ``length[slot]``.

        Each call computes the MTP step of all its new nodes in one batched layer call (a tree
        level), each node attending to the committed context, its own ancestors and itself."""
        n = self.length[slot]
        memo: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}   # path -> (m, k, v, logits)
        ctx_k, ctx_v = self._context(slot)
        dev = self.k.device

        @torch.no_grad()
        def compute(paths: list[tuple[int, ...]]) -> None:
            todo = {p[:i] for p in paths for i in range(1, len(p) + 1)} - memo.keys()
            for depth in sorted({len(p) for p in todo}):
                level = sorted(p for p in todo if len(p) == depth)
                ancestors = sorted({p[:i] for p in level for i in range(1, depth)})
                where = {a: i for i, a in enumerate(ancestors)}
                C, A, T = ctx_k.shape[0], len(ancestors), len(level)
                visible = torch.zeros(T, C + A + T, dtype=torch.bool)
                visible[:, :C] = True
                for j, p in enumerate(level):
                    for i in range(1, depth):
                        visible[j, C + where[p[:i]]] = True
                    visible[j, C + A + j] = True
                keys = torch.cat([ctx_k] + [memo[a][1] for a in ancestors])
                vals = torch.cat([ctx_v] + [memo[a][2] for a in ancestors])
                parent_m = torch.stack([memo[p[:-1]][0] if depth > 1 else self.last_hidden[slot]
                                        for p in level])
                logits, m, k, v = self._step(
                    torch.tensor([p[-1] for p in level], device=dev), parent_m,
                    torch.full((T,), n + depth - 1), keys, vals, visible.to(dev))
                for j, p in enumerate(level):
                    memo[p] = (m[j], k[j:j + 1], v[j:j + 1], logits[j])

        def node(path: tuple[int, ...]):
            """(m, k, v, logits) of the last node of ``path``, computing ancestors first."""
            if path not in memo:
                compute([path])
            return memo[path]

        def expand(paths, k):
            paths = [tuple(int(t) for t in path) for path in paths]
            compute(paths)
            probs = torch.softmax(torch.stack([memo[p][3] for p in paths]).float(), -1)
            top = torch.topk(probs, k)
            return [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        expand.node = node          # (m, k, v, logits) of a path's last node, for tests
        return expand
