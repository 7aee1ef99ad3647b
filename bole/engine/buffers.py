"""The static device buffers of rounds and admissions, one set per batch bucket (what the
captured graphs read and write), and the pinned host copies of what a round emits."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from bole.speculative.accept_device import SamplingBatch
from bole.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["StaticSampling", "RoundBuffers", "RoundLogprobs", "PrefillBuffers"]


class StaticSampling:
    """Per-row sampling parameters in static device tensors, and the host flags that choose the
    acceptance variant (a graph per variant): padding rows are greedy."""

    GREEDY = SamplingParams(temperature=0)

    def __init__(self, R: int, device):
        self.R = R
        template = SamplingBatch.from_params([self.GREEDY] * R, device)
        self.tensors = {f.name: getattr(template, f.name) for f in fields(template)
                        if isinstance(getattr(template, f.name), torch.Tensor)}
        self.flags = self.flags_for([])

    @staticmethod
    def flags_for(params, logprobs: bool = False) -> tuple:
        """The acceptance variant of a batch: one for every mix of greedy and sampled rows;
        top-k widths by powers of two; whether any row is penalised; whether any row returns
        logprobs (``logprobs``). A batch without penalties or logprobs does no work for them."""
        sampled = [p for p in params if not p.greedy]
        k = max([p.top_k for p in sampled], default=0)
        return (not sampled, True, any(p.top_k > 0 for p in sampled),
                any(p.top_p < 1 for p in sampled), 1 << (k - 1).bit_length() if k else 0,
                any(p.penalized for p in params), bool(logprobs))

    def write(self, params, logprobs: bool = False) -> None:
        host = SamplingBatch.from_params(list(params) + [self.GREEDY] * (self.R - len(params)))
        for name, dev in self.tensors.items():
            src = getattr(host, name)
            dev.copy_(src.pin_memory() if dev.is_cuda else src, non_blocking=True)
        self.flags = self.flags_for(params, logprobs)

    @property
    def all_greedy(self) -> bool:
        return self.flags[0]

    @property
    def logprobs(self) -> bool:
        return self.flags[6]

    def batch(self) -> SamplingBatch:
        all_greedy, any_greedy, any_top_k, any_top_p, max_top_k, penalized = self.flags[:6]
        return SamplingBatch(**self.tensors, all_greedy=all_greedy, any_greedy=any_greedy,
                             any_top_k=any_top_k, any_top_p=any_top_p, max_top_k=max_top_k,
                             any_penalty=penalized)


class RoundBuffers:
    """Static inputs and outputs of a round for a bucket of R rows x T node slots."""

    def __init__(self, R: int, T: int, D: int, K: int, device, dummy_slot: int):
        i64, dev = torch.int64, device
        self.R, self.T = R, T
        self.slots = torch.full((R,), dummy_slot, dtype=torch.int32, device=dev)
        self.active = torch.zeros(R, dtype=torch.bool, device=dev)
        self.roots = torch.zeros(R, dtype=i64, device=dev)
        self.remaining = torch.zeros(R, dtype=i64, device=dev)
        self.sampling = StaticSampling(R, dev)
        self.uniforms = torch.zeros(R, D + 1, K + 1, device=dev)
        self.tree_tokens = torch.zeros(R, T, dtype=i64, device=dev)
        self.tree_parents = torch.full((R, T), -1, dtype=i64, device=dev)
        self.tree_valid = torch.zeros(R, T, dtype=torch.bool, device=dev)
        self.tree_valid[:, 0] = True
        self.tree_rho = torch.zeros(R, T, dtype=torch.float64, device=dev)
        self.tree_rho[:, 0] = 1.0
        self.budget = torch.zeros((), dtype=i64, device=dev)   # draft nodes of the batch
        self.kept = torch.zeros(R, dtype=i64, device=dev)      # per row, before compaction
        self.emitted = torch.zeros(R, D + 1, dtype=i64, device=dev)
        self.num_emitted = torch.zeros(R, dtype=i64, device=dev)
        pin = dev.type == "cuda"
        self.emitted_host = torch.zeros(R, D + 1, dtype=i64, pin_memory=pin)
        self.num_host = torch.zeros(R, dtype=i64, pin_memory=pin)
        self.kept_host = torch.zeros(R, dtype=i64, pin_memory=pin)
        # goodput: whether the last choice could still change (Selected.widen)
        self.widen = torch.ones((), dtype=torch.bool, device=dev)
        self.widen_host = torch.ones((), dtype=torch.bool, pin_memory=pin)
        self.goodput = None                         # the goodput policy's inputs (round_select.py)
        self.rows: tuple = ()                      # (request index, slot) of the rows last written
        self.logprobs: RoundLogprobs | None = None  # made by the first round that returns them


@dataclass
class RoundLogprobs:
    """A round's log-probabilities at each emitted token (device, then pinned host copies):
    ``token [R, D + 1]`` the emitted token's, ``top_ids``/``top [R, D + 1, L]`` the L =
    min(:data:`MAX_LOGPROBS`, V) most likely tokens' (descending)."""

    token: torch.Tensor
    top_ids: torch.Tensor
    top: torch.Tensor
    host: tuple

    @classmethod
    def empty(cls, R: int, D: int, vocab: int, device) -> "RoundLogprobs":
        L = min(MAX_LOGPROBS, vocab)
        dev = (torch.zeros(R, D + 1, device=device),
               torch.zeros(R, D + 1, L, dtype=torch.int64, device=device),
               torch.zeros(R, D + 1, L, device=device))
        pin = torch.device(device).type == "cuda"
        return cls(*dev, tuple(torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin) for t in dev))

    def write(self, logits: torch.Tensor, path: torch.Tensor, emitted: torch.Tensor) -> None:
        """From the raw ``logits [R, W, V]`` at the accepted ``path [R, D + 1]`` (node j's
        logits gave emitted token j): log_softmax in fp32, the emitted tokens' entries and the
        top L."""
        R, W, V = logits.shape
        rows = torch.gather(logits, 1, path[:, :, None].expand(R, path.shape[1], V))
        lp = torch.log_softmax(rows.float(), dim=-1)
        self.token.copy_(torch.gather(lp, 2, emitted.clamp(min=0)[:, :, None])[:, :, 0])
        top = torch.topk(lp, self.top.shape[-1], dim=-1)
        self.top.copy_(top.values)
        self.top_ids.copy_(top.indices)

    def to_host(self) -> None:
        for host, dev in zip(self.host, (self.token, self.top_ids, self.top)):
            host.copy_(dev, non_blocking=True)

    def rows(self, counts: list[int], wanted: list[int | None]) -> list[list | None]:
        """Host reading after the round's synchronisation: per request (``wanted``: its top
        count, None for none), one ``(logprob, [(token, logprob), ...])`` per emitted token."""
        token, ids, top = (t.tolist() for t in self.host)
        return [None if k is None else
                [(token[i][j], list(zip(ids[i][j][:k], top[i][j][:k]))) for j in range(n)]
                for i, (n, k) in enumerate(zip(counts, wanted))]


class PrefillBuffers:
    """Static inputs of a batched admission prefill: R rows of T tokens, then each row's length
    and slot, in one ``[R, T + 2]`` int64 buffer (padding rows: the cache's dummy slot, length
    0), filled by one upload from pinned memory."""

    def __init__(self, R: int, T: int, device, dummy_slot: int):
        self.R, self.T, self.dummy_slot = R, T, dummy_slot
        self.packed = torch.zeros(R, T + 2, dtype=torch.int64, device=device)
        self.packed[:, T + 1] = dummy_slot
        self.host = torch.zeros(R, T + 2, dtype=torch.int64,
                                pin_memory=torch.device(device).type == "cuda")
        self.tokens, self.lengths = self.packed[:, :T], self.packed[:, T]

    @property
    def slots(self) -> torch.Tensor:
        """``[R]`` int32 (a conversion on the device: inside the captured forward)."""
        return self.packed[:, self.T + 1].to(torch.int32)

    def write(self, slots: list[int], tokens: torch.Tensor, lengths: list[int]) -> None:
        """The rows of one admission (``tokens [n, T]`` on the host) in one upload. The previous
        upload from the pinned buffer is done: its admission read its first tokens."""
        n = len(slots)
        self.host.zero_()
        self.host[:n, :self.T] = tokens
        self.host[:n, self.T] = torch.tensor(lengths)
        self.host[:, self.T + 1] = self.dummy_slot
        self.host[:n, self.T + 1] = torch.tensor(slots)
        self.packed.copy_(self.host, non_blocking=True)
