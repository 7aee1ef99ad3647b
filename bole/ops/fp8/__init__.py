"""FP8 weights with block scales, as Qwen publishes its FP8 checkpoints.

    Fp8Weight(q [..., N, K] float8_e4m3fn, scale [..., ceil(N/bn), ceil(K/bk)] fp32, (bn, bk))
        w[i, j] = q[i, j] * scale[i // bn, j // bk]
    quantize_blockwise(w, block) -> Fp8Weight     the published recipe: amax / 448 per block
    fp8_linear(x [M, K], w: Fp8Weight) -> [M, N]  x @ dequantize(w).T, the weight read as FP8
    StackedWeight(parts)                           projections of one input in several dtypes

Weights only: activations stay in the model's dtype (bf16), so a product equals the product
with the dequantized weight up to the order of its sums, and a FP8 model's output is its
dequantized twin's.
"""

from bole.ops.fp8.blockwise import (FP8_DTYPE, FP8_MAX, Fp8Weight, StackedWeight,
                                    quantize_blockwise)
from bole.ops.fp8.linear import fp8_linear, stacked_linear

__all__ = ["Fp8Weight", "StackedWeight", "quantize_blockwise", "fp8_linear", "stacked_linear",
           "FP8_DTYPE", "FP8_MAX"]
