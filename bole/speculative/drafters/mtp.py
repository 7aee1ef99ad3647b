"""The checkpoint's MTP head as an EAGLE-style tree drafter, on the device.

MTP step at position p (vLLM's Qwen3-Next / Qwen3.5 convention):
    x = fc([ norm_e(embed(token_p)) | norm_h(h_{p-1}) ]);  m_p = norm(decoder_layer(x))
    logits_p = lm_head(m_p)  (predicts token p + 1)
where h_{p-1} is the target's final-norm hidden state at p - 1 for committed positions, and the
MTP's own output m of the parent for deeper draft nodes. The layer's attention sees the MTP KV of
committed positions 1..n-1 plus the draft node's own ancestors.

The MTP KV pool keeps position p's entry at row p - 1 (position 0 has none), so a slot whose
target has n committed tokens has n - 1 committed rows; a round's draft nodes write theirs into
the scratch rows after them (created node c at row n - 1 + c), and after the commit
:meth:`MTPDrafter.observe` rewrites the accepted path's rows with the *target*'s hidden states, so
that drafting always starts from exactly the KV a full re-computation would give (tested).
Everything is fixed-shape tensor code without host synchronisation (captured in CUDA graphs).
"""

from __future__ import annotations

import torch

from bole.models.qwen3_hybrid import HybridModel
from bole.ops import fused
from bole.ops.attention import tree_attention
from bole.ops.linear import linear
from bole.ops.topk_softmax import topk_softmax
from bole.ops.inputs.frontier import frontier_inputs
from bole.ops.inputs.observe import observe_inputs
from bole.speculative.drafters.base import DrafterInfo, DrafterSetup
from bole.speculative.drafters.draft_vocab import draft_vocab_ids
from bole.speculative.tree_growth import node_capacity, step_slots

MTP_LAYER = "mtp.layers.0."


class MTPDrafter:
    """MTP KV pool and last target hidden state per slot; the drafting step and the observe."""

    on_device = True

    def __init__(self, model: HybridModel, max_slots: int, max_len: int, scratch: int,
                 vocab_ids: torch.Tensor | None = None):
        """``vocab_ids [V_d]``: the tokens the head drafts over (a reduced draft vocabulary,
        :mod:`bole.speculative.drafters.draft_vocab`); None for the whole vocabulary."""
        missing = [n for n in ("mtp.fc.weight", MTP_LAYER + "self_attn.qkv_proj.weight")
                   if n not in model.w]
        if missing:
            raise ValueError("this checkpoint has no MTP head (no mtp.* tensors); "
                             "use the ngram drafter")
        c = model.config
        self.model = model
        #: rows per slot: committed entries (max_len - 1) plus a round's draft nodes and one junk
        #: row that padding frontier entries write to
        self.rows = max_len + scratch + 1
        self.junk_row = self.rows - 1
        shape = (max_slots + 1, self.rows, model.n_kv, c.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros_like(self.k)
        self.last_hidden = torch.zeros(max_slots + 1, c.hidden_size, dtype=model.dtype,
                                       device=model.device)
        self.vocab_ids = vocab_ids
        #: the LM head's rows of the draft vocabulary (a copy: one contiguous read per step)
        self.head = None if vocab_ids is None else model.lm_head_weight[vocab_ids].contiguous()

    def reset(self, slot: int) -> None:
        self.last_hidden[slot].zero_()

    def start(self, slot: int, prompt: torch.Tensor, continuation=None) -> None:
        """Nothing: the prompt's rows come with its prefill (:meth:`observe_prompts`)."""

    def finish(self, slot: int) -> None:
        self.reset(slot)

    # ---- the MTP layer ----
    def _input(self, tokens: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the normalised embedding and hidden state: ``[n, H]``."""
        m, w, eps = self.model, self.model.w, self.model.config.rms_norm_eps
        H = m.config.hidden_size
        if m.tp.world == 1:          # the gather and both norms in one launch
            table = w[f"{m.config.weight_prefix}embed_tokens.weight"]
            both = fused.embed_norm_pair(tokens, table, prev_hidden.to(m.dtype),
                                         w["mtp.pre_fc_norm_embedding.weight"],
                                         w["mtp.pre_fc_norm_hidden.weight"], eps)
            return linear(both, w["mtp.fc.weight"])
        # both norms write their halves of fc's input (no concatenation)
        both = torch.empty(tokens.shape[0], 2 * H, dtype=m.dtype, device=tokens.device)
        fused.add_rms_norm(m.embed(tokens), w["mtp.pre_fc_norm_embedding.weight"], eps,
                           out=both[:, :H])
        fused.add_rms_norm(prev_hidden.to(m.dtype), w["mtp.pre_fc_norm_hidden.weight"], eps,
                           out=both[:, H:])
        return linear(both, w["mtp.fc.weight"])

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             rows: torch.Tensor):
        """The layer's query and gate ``[n, H_q, hd]``; its keys and values go to pool rows
        ``rows [R, P]`` of ``slots [R]`` (n = R * P)."""
        m, eps = self.model, self.model.config.rms_norm_eps
        a = fused.add_rms_norm(x, m.w[MTP_LAYER + "input_layernorm.weight"], eps)[0]
        return m.attention_qkv(MTP_LAYER + "self_attn.", a, positions,
                               (self.k, self.v, slots, None, rows))

    def _finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Attention output ``o [n, H_q * hd]`` (gated) -> the layer's normalised output m."""
        m, w, eps = self.model, self.model.w, self.model.config.rms_norm_eps
        attn = m.tp.all_reduce(linear(o, w[MTP_LAYER + "self_attn.o_proj.weight"],
                                      w.get(MTP_LAYER + "self_attn.o_proj.bias")))
        # the residual add inside the norm's kernel
        a, x = fused.add_rms_norm(attn, w[MTP_LAYER + "post_attention_layernorm.weight"], eps, x)
        return fused.add_rms_norm(m.mlp(0, a, prefix=MTP_LAYER), w["mtp.norm.weight"], eps, x)[0]

    # ---- keeping the MTP pool in step with the target ----
    @torch.no_grad()
    def observe(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
                start: torch.Tensor, count: torch.Tensor) -> None:
        """The target committed ``tokens [R, P]`` (the first ``count[r]`` of each row) at
        positions ``start[r] ..`` with final-norm ``hidden [R, P, H]``: write their MTP rows and
        remember each row's last hidden state. A row of ``count == 0`` changes nothing but
        scratch rows. Position 0 has no MTP entry (the caller passes ``start >= 1``)."""
        R, P = tokens.shape
        node = torch.arange(P, device=tokens.device)
        self.observe_accepted(slots, tokens, node.expand(R, P),
                              node + P * torch.arange(R, device=tokens.device)[:, None],
                              hidden.reshape(R * P, -1), start, count)

    @torch.no_grad()
    def observe_accepted(self, slots: torch.Tensor, tree_tokens: torch.Tensor, path: torch.Tensor,
                         path_global: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor,
                         count: torch.Tensor) -> None:
        """:meth:`observe` of each request's accepted path straight from the verify forward:
        node p of ``path [R, P]`` is token ``tree_tokens[r, path[r, p]]`` with hidden state
        ``hidden[path_global[r, p]]`` (``hidden [N, H]``); the inputs in one launch on CUDA
        (:mod:`bole.ops.inputs.observe`)."""
        inp = observe_inputs(tree_tokens, path, path_global, hidden, self.last_hidden, slots,
                             start, count, self.junk_row)
        self._qkv(self._input(inp.tokens, inp.prev), inp.positions, slots, inp.rows)

    @torch.no_grad()
    def observe_prompt(self, slot: int, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """After a prefill of ``tokens [P]`` (hidden ``[P, H]``) into a fresh slot."""
        self.observe_prompts([slot], [tokens], [hidden])

    @torch.no_grad()
    def observe_prompts(self, slots: list[int], prompts: list[torch.Tensor],
                        hidden: list[torch.Tensor]) -> None:
        """:meth:`observe_prompt` of several fresh slots in one layer call (prompts ``[P_r]``,
        hidden ``[P_r, H]``; rows padded to the longest, the padding written to the junk row)."""
        R, dev = len(slots), self.k.device
        lengths = [int(p.numel()) for p in prompts]
        T = max(lengths)
        tokens = torch.zeros(R, T, dtype=torch.int64, device=dev)
        states = torch.zeros(R, T, hidden[0].shape[-1], dtype=hidden[0].dtype, device=dev)
        for r, (p, h) in enumerate(zip(prompts, hidden)):
            tokens[r, :lengths[r]] = p.to(dev)
            states[r, :lengths[r]] = h
        self.observe_prompt_rows(torch.tensor(slots, dtype=torch.int32, device=dev), tokens,
                                 states, torch.tensor(lengths, device=dev))

    @torch.no_grad()
    def observe_prompt_rows(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
                            lengths: torch.Tensor) -> None:
        """:meth:`observe_prompts` from device rows (capturable): ``tokens [R, T]`` and
        ``hidden [R, T, H]`` hold each fresh slot's prompt in its first ``lengths[r]`` entries;
        a row of length 0 (padding) writes only the slot's remembered state and junk rows."""
        self.last_hidden[slots.long()] = hidden[:, 0].to(self.last_hidden.dtype)
        if tokens.shape[1] < 2:
            return
        R = tokens.shape[0]
        self.observe(slots, tokens[:, 1:], hidden[:, 1:],
                     torch.ones(R, dtype=torch.int64, device=tokens.device),
                     (lengths.to(torch.int64) - 1).clamp(min=0))

    # ---- drafting ----
    def step_fn(self, slots: torch.Tensor, ctx: torch.Tensor, topk: int):
        """The tree growth's drafter step for one round over ``slots [R]`` whose targets hold
        ``ctx [R]`` committed tokens (each root is its request's next token, at position ctx).

        Each call computes the frontier's MTP outputs in one batched layer call: a node attends to
        its slot's committed MTP rows and its own created ancestors (scratch rows)."""
        m = self.model
        # the previous step's outputs in its frontier's order, and the first slot it created
        state: dict[str, object] = {"out": None, "lo": 0}
        pool_ctx = ctx - 1                     # committed MTP rows: position p sits at p - 1

        def step(step_index: int, frontier: torch.Tensor, table) -> tuple[torch.Tensor, torch.Tensor]:
            R, K = frontier.shape
            # tokens, positions, pool rows, masks and parent hidden states: one launch on CUDA
            inp = frontier_inputs(frontier, table, state["out"], state["lo"], topk,
                                  self.last_hidden, slots, ctx, self.junk_row)
            x = self._input(inp.tokens, inp.prev)
            q, gate = self._qkv(x, inp.positions, slots, inp.rows)
            o = tree_attention(q, self.k, self.v, slots, pool_ctx, inp.mask,
                               scale=m.config.head_dim ** -0.5, gate=gate)
            out = self._finish(x, o.reshape(R * K, -1))
            state["out"], state["lo"] = out, step_slots(topk, step_index)[0]
            if self.head is None:
                probs, tokens = topk_softmax(m.lm_head(out), topk)
            else:
                probs, tokens = topk_softmax(linear(out, self.head), topk, ids=self.vocab_ids)
            return tokens.view(R, K, topk), probs.view(R, K, topk)
        return step


def build(setup: DrafterSetup) -> MTPDrafter:
    """The checkpoint's head, with scratch rows for a whole grown tree."""
    return MTPDrafter(setup.model, setup.max_slots, setup.max_len,
                      node_capacity(setup.topk, setup.depth),
                      vocab_ids=draft_vocab_ids(setup.model, setup.draft_vocab))


INFO = DrafterInfo("mtp", build, on_device=True, takes_draft_vocab=True,
                   help="the checkpoint's MTP head (on the device)")
