"""Block-scaled FP8 weights: the tensor pair of a published FP8 checkpoint as one object.

A checkpoint stores ``name.weight`` (float8 e4m3, [N, K]) and ``name.weight_scale_inv`` ([ceil(N /
bn), ceil(K / bk)], bf16 or fp32) for ``quantization_config.weight_block_size = [bn, bk]``; the
weight is ``q * scale`` blockwise (the "inverse" scale multiplies). Stacked MoE experts carry a
leading expert dimension on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Fp8Weight", "StackedWeight", "quantize_blockwise", "FP8_DTYPE", "FP8_MAX"]

FP8_DTYPE = torch.float8_e4m3fn
#: the largest finite e4m3fn value
FP8_MAX = 448.0


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


@dataclass
class Fp8Weight:
    """``q [..., N, K]`` float8_e4m3fn, ``scale [..., ceil(N/bn), ceil(K/bk)]`` fp32 and the
    block ``(bn, bk)``: ``w[..., i, j] = q[..., i, j] * scale[..., i // bn, j // bk]``."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self):
        bn, bk = self.block
        if self.q.dtype != FP8_DTYPE:
            raise ValueError(f"Fp8Weight.q must be {FP8_DTYPE}, got {self.q.dtype}")
        want = (*self.q.shape[:-2], _blocks(self.q.shape[-2], bn), _blocks(self.q.shape[-1], bk))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"Fp8Weight: a weight of shape {list(self.q.shape)} in {bn} x {bk} "
                             f"blocks has scales of shape {list(want)}, got "
                             f"{list(self.scale.shape)}")
        self.scale = self.scale.float()

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return FP8_DTYPE

    def dim(self) -> int:
        return self.q.dim()

    def nbytes(self) -> int:
        """Bytes a product reads: the FP8 values and their scales."""
        return self.q.numel() + self.scale.numel() * 4

    def to(self, device) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight, ``q * scale`` per block, in ``dtype`` (computed in fp32, rounded once)."""
        bn, bk = self.block
        N, K = self.q.shape[-2:]
        s = self.scale.repeat_interleave(bn, -2)[..., :N, :].repeat_interleave(bk, -1)[..., :K]
        return (self.q.float() * s).to(dtype)

    def rows(self, start: int, stop: int) -> Fp8Weight:
        """Rows ``start:stop`` as a view; ``start`` on a block boundary, ``stop`` too or the
        last row (a view cannot split a block's scale)."""
        bn = self.block[0]
        N = self.q.shape[-2]
        if start % bn or (stop % bn and stop != N):
            raise ValueError(f"Fp8Weight.rows({start}, {stop}): rows of {bn}-row blocks must "
                             f"start and end on a block boundary")
        return Fp8Weight(self.q[..., start:stop, :], self.scale[..., start // bn:_blocks(stop, bn), :],
                         self.block)

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """Row-wise concatenation; every part but the last must fill whole blocks."""
        bn = parts[0].block[0]
        if any(p.block != parts[0].block for p in parts) or any(
                p.q.shape[-2] % bn for p in parts[:-1]):
            raise ValueError("Fp8Weight.cat needs one block size and whole row blocks")
        return Fp8Weight(torch.cat([p.q for p in parts], -2),
                         torch.cat([p.scale for p in parts], -2), parts[0].block)


@dataclass
class StackedWeight:
    """Projections of one input kept apart (their dtypes or blocks differ, so no single tensor
    holds them): ``y = [x @ p.T for p in parts]`` along the last dimension."""

    parts: list

    @property
    def shape(self) -> torch.Size:
        return torch.Size([sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]])

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def dim(self) -> int:
        return 2


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                       scale_dtype: torch.dtype = torch.bfloat16) -> Fp8Weight:
    """Quantize ``w [..., N, K]`` the way the published FP8 checkpoints are made: per block the
    scale is amax / 448 (rounded to ``scale_dtype``, the checkpoint's), the values ``w /
    scale`` rounded to e4m3 (an all-zero block gets scale 1)."""
    bn, bk = block
    N, K = w.shape[-2:]
    lead = w.shape[:-2]
    pn, pk = _blocks(N, bn) * bn, _blocks(K, bk) * bk
    padded = torch.zeros(*lead, pn, pk, dtype=torch.float32, device=w.device)
    padded[..., :N, :K] = w.float()
    tiles = padded.view(*lead, pn // bn, bn, pk // bk, bk)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype).float()
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(*lead, pn, pk)
    return Fp8Weight(q[..., :N, :K].to(FP8_DTYPE).contiguous(), scale, (bn, bk))
