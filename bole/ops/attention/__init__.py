"""Tree attention of a fixed-shape batch over a pooled KV cache, and the pool's writes.

A batch is R requests x Tq query nodes (``N = R * Tq``; request r owns rows ``r*Tq .. r*Tq+Tq-1``,
some of them padding). Each full-attention layer keeps a pool ``k_pool, v_pool [S, M, Hkv, D]``:
request r lives in slot ``slots[r]`` with ``ctx_lens[r]`` committed positions, visible to all its
nodes, followed by a scratch region of ``Tk`` positions holding the new nodes' keys (scratch key j
at ``ctx_lens[r] + j``). Node n sees scratch key j of its own request iff ``tree_mask[n, j]``.

``slots``, ``ctx_lens`` and ``tree_mask`` are device tensors that are never read on the host, so
that :func:`write_kv` and :func:`tree_attention` can be captured in a CUDA graph and replayed with
new values. Callers guarantee ``0 <= slots[r] < S`` and ``0 <= ctx_lens[r] <= M - Tk`` (the engine
reserves the scratch positions); :func:`tree_attention` clamps lengths into that range so that no
read leaves the slot, and :func:`write_kv` relies on torch's index bounds check.

Scores are fp32 (``scale * q.k``), GQA query head h reads kv head ``h // (Hq // Hkv)``, and a row
that sees no key at all yields zeros. The optional ``gate [N, Hq * D]`` (or ``[N, Hq, D]``, any
row and head strides: a view into the q projection) is the model's sigmoid output gate:
``(o.to(q.dtype).reshape(N, -1) * sigmoid(gate)).view(N, Hq, D)``.

kernel.py holds the Triton kernels, their launch and prefill attention; reference.py the torch
paths; pool.py the KV writes; checks.py the input checks.
"""

from bole.ops.attention.kernel import (MIN_SPLIT_KEYS, TARGET_PROGRAMS, default_num_splits,
                                       prefill_attention, tree_attention)
from bole.ops.attention.pool import write_kv
from bole.ops.attention.reference import tree_attention_reference

__all__ = ["MIN_SPLIT_KEYS", "TARGET_PROGRAMS", "default_num_splits", "prefill_attention",
           "tree_attention", "tree_attention_reference", "write_kv"]
