"""The tensor-parallel group over torch.distributed: NCCL on GPUs, gloo on the CPU.

Every rank runs the same engine on the same requests: the model's row-parallel layers sum their
partial outputs over the group (one all-reduce after attention, GDN and the MLP of each layer),
the vocabulary-parallel embedding sums its ranks' lookups and the lm_head gathers its ranks'
logits, so every rank sees the same logits and takes the same drafting, acceptance and sampling
decisions (its generators seeded alike). NVLink multicast stays off in every process
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


#: environment every tensor-parallel process starts with (multicast can take a host's GPUs down)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class TPShard:
    """This process's place in the tensor-parallel group."""

    rank: int
    world: int

    def part(self, n: int, size: int = 1) -> tuple[int, int]:
        """This rank's contiguous range of ``n`` items of ``size`` elements each."""
        per = n // self.world
        return self.rank * per * size, (self.rank + 1) * per * size


@dataclass
class TensorParallel:
    """This rank's shard and the collectives the model calls (no-ops for one rank)."""

    shard: TPShard
    group: object = None

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world(self) -> int:
        return self.shard.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim (rank order)."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (a seed, say)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64,
                         device="cuda" if dist.get_backend(self.group) == "nccl" else "cpu")
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int, device: str = "cpu") -> TensorParallel:
    """Join the group of ``world`` processes on 127.0.0.1:``port`` (gloo on the CPU, each rank
    with its share of the intra-op threads; NCCL on GPUs, one GPU per rank)."""
    os.environ.update(SAFE_ENV)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:                                 # the ranks share the CPU: no oversubscribed cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return TensorParallel(TPShard(rank, world), dist.group.WORLD)


def shutdown(meet: bool = False) -> None:
    """Leave the process group. ``meet``: every rank calls this at the same point of the same
    work (not serve's followers, which rank 0 outlives): on a clean exit they first meet at a
    barrier, so that none tears its connections down while another still uses them (gloo's
    threads then abort that process). While an exception unwinds the others may never arrive:
    no barrier then (a rank that died leaves the others at theirs until the launcher, mp.spawn,
    ends them)."""
    if dist.is_initialized():
        if meet and sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


def quiet_unless_rank0(rank: int) -> contextlib.ExitStack:
    """A context in which a rank other than 0 prints nothing (stdout and stderr swallowed), so
    that a command run by every rank reports once."""
    quiet = contextlib.ExitStack()
    if rank:
        quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
        quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return quiet


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a no-op elsewhere)."""
    import ctypes
    import signal
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
