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
from bole.spec.draft_tree import BatchExpander, Expander, top_k_per_request

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
    def batch_expander(self, slots: list[int]) -> BatchExpander:
        """Batch expander for one round over ``slots``: each root is its slot's next token, at
        position ``length[slot]``. Each call computes all new nodes of all requests in one layer
        call per tree level; a node attends to its own slot's committed MTP context, its own
        ancestors and itself (a block-structured mask over the concatenated keys)."""
        dev = self.k.device
        starts = [self.length[s] for s in slots]
        contexts = [self._context(s) for s in slots]
        ctx_k = torch.cat([c[0] for c in contexts])
        ctx_v = torch.cat([c[1] for c in contexts])
        ctx_lo = [0]
        for c in contexts:
            ctx_lo.append(ctx_lo[-1] + c[0].shape[0])
        memo: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}  # (m, k, v, logits)

        @torch.no_grad()
        def compute(nodes: list[tuple[int, tuple[int, ...]]]) -> None:
            """Compute (request, path) nodes missing from the memo, their ancestors first."""
            todo = {(i, p[:d]) for i, p in nodes for d in range(1, len(p) + 1)} - memo.keys()
            for depth in sorted({len(p) for _, p in todo}):
                level = sorted(x for x in todo if len(x[1]) == depth)
                ancestors = sorted({(i, p[:d]) for i, p in level for d in range(1, depth)})
                where = {a: j for j, a in enumerate(ancestors)}
                C, A, T = ctx_k.shape[0], len(ancestors), len(level)
                visible = torch.zeros(T, C + A + T, dtype=torch.bool)
                for j, (i, p) in enumerate(level):
                    visible[j, ctx_lo[i]:ctx_lo[i + 1]] = True
                    for d in range(1, depth):
                        visible[j, C + where[(i, p[:d])]] = True
                    visible[j, C + A + j] = True
                keys = torch.cat([ctx_k] + [memo[a][1] for a in ancestors])
                vals = torch.cat([ctx_v] + [memo[a][2] for a in ancestors])
                parent_m = torch.stack([memo[(i, p[:-1])][0] if depth > 1
                                        else self.last_hidden[slots[i]] for i, p in level])
                positions = torch.tensor([starts[i] + depth - 1 for i, _ in level])
                logits, m, k, v = self._step(
                    torch.tensor([p[-1] for _, p in level], device=dev), parent_m, positions,
                    keys, vals, visible.to(dev))
                for j, x in enumerate(level):
                    memo[x] = (m[j], k[j:j + 1], v[j:j + 1], logits[j])

        def node(i: int, path: tuple[int, ...]):
            """(m, k, v, logits) of the last node of request ``i``'s ``path``."""
            if (i, path) not in memo:
                compute([(i, path)])
            return memo[(i, path)]

        def expand_batch(paths_per_request, k):
            nodes = [(i, tuple(int(t) for t in path))
                     for i, paths in enumerate(paths_per_request) for path in paths]
            if not nodes:
                return [[] for _ in paths_per_request]
            compute(nodes)
            return top_k_per_request(torch.stack([memo[x][3] for x in nodes]), paths_per_request, k)
        expand_batch.node = node
        return expand_batch

    def expander(self, slot: int) -> Expander:
        """Expander for one slot (the batch expander over ``[slot]``)."""
        batch = self.batch_expander([slot])

        def expand(paths, k):
            return batch([paths], k)[0]
        expand.node = lambda path: batch.node(0, tuple(path))  # (m, k, v, logits), for tests
        return expand
