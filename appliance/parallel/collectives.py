"""Sums over ranks in a fixed order, for the fast path's fp32 partials.

A split layer's partial sums must add up to the same bits on every rank (each rank then routes, selects and
samples identically) and for every batch shape (a verify of k+1 rows must equal k+1 single steps). NCCL's
all-reduce guarantees neither: its ring and tree algorithms, chunking and protocol change the order of the
additions with the payload size. So the partials are gathered and added in rank order, ((p0 + p1) + p2) +
p3, elementwise, in one launch (kernels/rank_sum.py): the result depends only on the four partials. Two
ways to gather, chosen by `--allreduce`:

- `nccl` (gloo on CPU): an all-gather into [world, n], then the ordered adds. Captured in a CUDA graph with
  the cycle (NCCL 2.9.6+ supports graph capture).
- `symm`: symmetric memory (CUDA peer-to-peer over NVLink): each rank writes its partial into its own
  buffer, a device-side barrier, every rank reads all buffers and adds them in rank order, a second barrier
  before a buffer is written again. One kernel's worth of latency for the small per-layer payloads, and no
  NCCL launch; capturable (the barriers are device-side).
- `auto`: `symm` where every pair of the group's GPUs can reach each other, else `nccl`.
"""

import torch
import torch.distributed as dist

from kernels import rank_sum

MODES = ("nccl", "symm", "auto")
# the one-tensor all-gather: all_gather_single in newer torch, all_gather_into_tensor before it
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherSum:
    """All-gather over the process group (NCCL or gloo), then the ordered adds (one launch)."""

    kind = "nccl"

    def __init__(self, world: int, group=None):
        self.world, self.group = world, group

    def __call__(self, t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
        parts = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        _all_gather(parts, t.reshape(-1).contiguous(), group=self.group)
        return rank_sum.fast(list(parts.view(self.world, *t.shape)), out_dtype, round_to)


class SymmSum:
    """Symmetric-memory buffers of `capacity` float32 values on every rank, peers read in place."""

    kind = "symm"

    def __init__(self, world: int, rank: int, capacity: int, device: torch.device, group=None):
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        self.world, self.rank, self.capacity = world, rank, capacity
        self.buffer = symm_mem.empty(capacity, dtype=torch.float32, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.peers = [self.handle.get_buffer(r, (capacity,), torch.float32) for r in range(world)]

    def __call__(self, t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
        n = t.numel()
        if n > self.capacity:
            raise ValueError(f"symmetric all-reduce of {n} values: its buffers hold {self.capacity}")
        self.buffer[:n].copy_(t.reshape(-1).float())
        self.handle.barrier(channel=0)  # every partial is written
        out = rank_sum.fast([p[:n] for p in self.peers], out_dtype, round_to)  # read in place from every peer
        self.handle.barrier(channel=1)  # every peer has read: the buffers may be written again
        return out.view(t.shape)


def peers_reachable(world: int) -> bool:
    """Whether the GPUs of a `world`-rank group on this host can all read each other's memory."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        return False
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(world) for b in range(world) if a != b)


def make_sum(mode: str, world: int, rank: int, device: torch.device, capacity: int = 1 << 20, group=None):
    """The fixed-order sum for `--allreduce mode` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"--allreduce {mode}: must be one of {', '.join(MODES)}")
    if mode == "symm" and device.type != "cuda":
        raise ValueError("--allreduce symm needs CUDA devices (symmetric memory is GPU peer-to-peer memory)")
    if mode == "symm" or (mode == "auto" and device.type == "cuda" and peers_reachable(world)):
        return SymmSum(world, rank, capacity, device, group)
    return GatherSum(world, group)
