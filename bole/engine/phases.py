"""The round's device phases: draft, verify, accept and commit, the code the round's CUDA graphs
capture (no host synchronisation). :class:`RoundPhases` is a part of
:class:`~bole.engine.round.RoundRunner`, whose buffers, drafter, policy and model runner they
use."""

from __future__ import annotations

import torch

from bole.engine.buffers import RoundBuffers
from bole.forest import DenseForest
from bole.speculative.accept_device import accept
from bole.speculative.budget.round_select import select
from bole.speculative.penalties import penalize_forest
from bole.speculative.tree_growth import TreeGrowth

__all__ = ["RoundPhases"]


class RoundPhases:
    """The device phases of a round over a bucket's buffers ``b`` (R rows x T node slots)."""

    def _draft(self, b: RoundBuffers, depth: int) -> None:
        """Grow every row's tree ``depth`` levels (a row within ``depth`` tokens of its limit:
        fewer) into the round's buffers."""
        ctx = self.cache.lengths[b.slots.long()]
        limit = torch.where(b.active, (b.remaining - 1).clamp(0, depth), 0)
        step = self.device_drafter.step_fn(b.slots, ctx, self.topk)
        key = (b.R, depth)
        if key not in self.growth:
            self.growth[key] = TreeGrowth(b.R, self.topk, depth, self.T, self.device)
        trees = self.growth[key].grow(b.roots, limit, step)
        b.tree_tokens.copy_(trees.tokens)
        b.tree_parents.copy_(trees.parents)
        b.tree_valid.copy_(trees.valid)
        b.tree_rho.copy_(trees.rho)

    def _verify(self, b: RoundBuffers, W: int, kind: str):
        """The forest of a round of ``kind`` (a select round's batch-shared selection compacted
        to width W, a whole round's every drafted node, a plain round's roots) and the target's
        forward over it; returns (batch, output, tokens, the verified nodes' rho ``[R, W]`` or
        None for plain rounds)."""
        tokens, rho = b.tree_tokens, b.tree_rho
        gdn = None
        if self.ar or kind == "plain":            # plain decoding (ar, goodput's plain rounds)
            tokens, rho = b.tree_tokens[:, :1], None
            tokens.copy_(b.roots[:, None])
            forest = DenseForest.chain(b.R, 1, self.device)
            gdn = self.runner.gdn.split("-")[0] + "-decode"    # each state updated in place
        elif kind == "select":
            sel = select(b.tree_rho, b.tree_tokens, b.tree_parents, b.tree_valid, b.budget,
                         b.active, self.spec.root_floor, W, self.D, goodput=b.goodput,
                         acceptance=self.calibrator, row_width=self.policy.row_width(b.R))
            b.kept.copy_(sel.kept)
            if sel.widen is not None:
                b.widen.copy_(sel.widen)
            tokens, forest, rho = sel.tokens, sel.forest, sel.rho
        else:
            forest = DenseForest.from_parents(b.tree_parents, b.tree_valid, self.D)
            if self.policy.shared:
                b.kept.copy_(b.tree_valid.sum(1))
        batch = self.runner.make_batch(tokens.reshape(-1), forest, b.slots, gdn)
        return batch, self.runner.forward(batch), tokens, rho

    def _accept_commit(self, b: RoundBuffers, learn: bool, batch, out, tokens,
                       rho=None) -> None:
        R, W = tokens.shape
        raw = logits = out.logits.view(R, W, -1)
        forced = None
        if self.spec.forced_acceptance and self.device_drafter is not None:
            forced = self.device_drafter.forced_targets(b.slots, batch.ctx_lens, batch.forest.depth)
        sampling = b.sampling.batch()
        if sampling.any_penalty:
            slots = b.slots.long()
            logits = penalize_forest(logits, tokens, batch.forest, self.penalties.counts[slots],
                                     self.penalties.prompt[slots], sampling.presence,
                                     sampling.frequency, sampling.repetition)
        acc = accept(logits, tokens, batch.forest, sampling, b.uniforms,
                     max_children=self.K, forced=forced)
        path_len = torch.where(b.active, acc.path_len, 0)
        if sampling.any_penalty:
            self.penalties.add(b.slots, acc.emitted, path_len)
        if b.sampling.logprobs:
            b.logprobs.write(raw, acc.path, acc.emitted)
        if learn and self.calibrator is not None and rho is not None:
            # every verified draft node of an active row: was it on the accepted path?
            on_path = torch.zeros_like(tokens, dtype=torch.bool).scatter_(1, acc.path, True)
            drafted = batch.forest.valid & (batch.forest.parents >= 0) & b.active[:, None]
            self.calibrator.observe(rho, on_path, drafted)
        ctx = batch.ctx_lens
        # a lone root's KV row is its final row; in-place GDN decoding leaves no factors
        path_global = self.runner.commit(batch, out, acc.path, path_len, kv_in_place=W == 1)
        if self.device_drafter is not None:
            self.device_drafter.observe_accepted(b.slots, tokens, acc.path, path_global, out.hidden, ctx,
                                      path_len)
        b.emitted.copy_(acc.emitted)
        b.num_emitted.copy_(path_len)
        b.roots.copy_(acc.bonus)
        b.remaining.sub_(path_len)
