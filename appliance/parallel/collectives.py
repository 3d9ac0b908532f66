"""Sums over ranks in a fixed order, for the fast path's fp32 partials.

A split layer's partial sums must add up to the same bits on every rank (each rank then routes, selects and
samples identically) and for every batch shape (a verify of k+1 rows must equal k+1 single steps). NCCL's
all-reduce guarantees neither: its ring and tree algorithms, chunking and protocol change the order of the
additions with the payload size. So the partials are gathered and added in rank order, ((p0 + p1) + p2) +
p3, elementwise, in one launch (kernels/rank_sum.py), or by the kernel that uses the sum as it loads the
partials (`into`: the attention's output and the MoE's rows, kernels/rank_sum.py `rank_load`): the result
depends only on the four partials. Two ways to gather, chosen by `--allreduce`:

- `nccl` (gloo on CPU): an all-gather into [world, n], then the ordered adds. Captured in a CUDA graph with
  the cycle (NCCL 2.9.6+ supports graph capture).
- `symm`: symmetric memory (CUDA peer-to-peer over NVLink): each rank's partial is written into its own
  buffer and the call counted in every rank's flags, by its producer's kernel (`produced_into`: the
  attention's output product) or a launch of its own; the consumer's kernel waits on the flags and reads
  every rank's buffer in place, adding in rank order (`SymmSum`). No NCCL, no barrier;
  capturable (everything is device-side). On CPU ranks the same kernels run, under the interpreter, over
  buffers and flags in shared memory (the tests' stand-in).
- `auto`: `symm` where every pair of the group's GPUs can reach each other, else `nccl`.

With --check-ranks every collective is preceded by `CallCheck`: the ranks compare the call they are about
to make, and a difference is named on every rank instead of aborting in the transport.
"""

import math
import os
import tempfile
import uuid
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from appliance.errors import RankDivergence
from kernels import rank_sum

MODES = ("nccl", "symm", "auto")
# the one-tensor all-gather: all_gather_single in newer torch, all_gather_into_tensor before it
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherSum:
    """All-gather over the process group (NCCL or gloo), then the ordered adds (one launch)."""

    kind = "nccl"

    def __init__(self, world: int, group=None):
        self.world, self.group = world, group

    def __call__(self, t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
        return self.into(t, lambda parts: rank_sum.fast(parts, out_dtype, round_to))

    def into(self, t: torch.Tensor, consume):
        """Every rank's partial of `t`, in rank order, given to `consume` (a kernel that adds them as it loads
        them, kernels/rank_sum.py `rank_load`): what it returns."""
        parts = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        all_gather(parts, t.reshape(-1).contiguous(), group=self.group)
        return consume(list(parts.view(self.world, *t.shape)))

    def produced_into(self, shape: tuple[int, ...], produce, consume):
        """`into` of the partial of `shape` that `produce(to)` makes: `to` a kernels/rank_sum.py Publish (the
        producer writes it into symmetric memory and publishes it; SymmSum) or None (it returns the partial,
        as here)."""
        return self.into(produce(None), consume)

    gathered_into = produced_into  # every rank's part to a consumer that reads them where they lie


class SymmSum:
    """Buffers every rank can read, peers read in place: symmetric memory (GPU peer-to-peer, `PeerMemory`) on
    CUDA, shared memory between the rank processes (`HostMemory`, the CPU stand-in that runs this class's code
    in the tests) elsewhere. A rank's buffer holds kernels/rank_sum.py's SLOTS slots of `capacity` float32
    values and its flags (int64 [world + 1]). A call's partial goes into its slot and the call is counted in
    every rank's flags by its producer's kernel (`produced_into`) or by a launch of its own
    (`rank_sum.publish`); its consumer's kernel waits for every rank's count and adds the peers' slots in rank
    order as it loads them: no barrier, no launch between. A call of more values than the capacity goes in
    capacity-sized pieces, each summed in rank order: the same bits as one piece (the sum is elementwise).
    The loader sizes the capacity for the largest call of a decode step (parallel/sharding.py `largest_sum`),
    so a captured cycle sums in one piece and only a prefill chunk's calls are cut."""

    kind = "symm"

    def __init__(self, world: int, rank: int, capacity: int, device: torch.device, group=None, memory=None):
        self.world, self.rank, self.capacity, self.group = world, rank, capacity, group
        memory = memory or (PeerMemory if device.type == "cuda" else HostMemory)
        self.buffers = memory(world, rank, rank_sum.SLOTS * capacity, torch.float32, device, group)
        self.flags = memory(world, rank, world + 1, torch.int64, device, group)

    def __call__(self, t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
        flat = t.reshape(-1)
        n = flat.numel()
        out = torch.empty(n, dtype=out_dtype, device=t.device)
        for a in range(0, n, self.capacity):
            b = min(a + self.capacity, n)
            self._piece(flat[a:b], lambda parts, piece=out[a:b]: rank_sum.fast(parts, out_dtype, round_to, out=piece))
        return out.view(t.shape)

    def into(self, t: torch.Tensor, consume):
        """GatherSum.into: `consume` (a kernel) is given `rank_sum.Partials`, the peers' slots and the publish
        it waits on. A call larger than the capacity is summed in pieces first (unrounded float32: the same
        adds), its one part given."""
        if t.numel() > self.capacity:
            return consume([self(t)])
        return self._piece(t, consume)

    def produced_into(self, shape: tuple[int, ...], produce, consume):
        """GatherSum.produced_into: the producer writes its partial into this rank's slot itself and counts the
        call in (no publish launch), where the partial fits a slot."""
        n = math.prod(shape)
        if not 0 < n <= self.capacity:
            return self.into(produce(None), consume)
        return self._published(shape, produce, consume)

    def gathered_into(self, shape: tuple[int, ...], produce, consume):
        """`produced_into` for a consumer that reads every rank's part where it lies (a product split by its
        outputs): a part larger than a slot (a short prefill chunk's) is all-gathered, never cut into pieces
        (pieces are summed)."""
        if not 0 < math.prod(shape) <= self.capacity:
            return GatherSum(self.world, self.group).into(produce(None), consume)
        return self._published(shape, produce, consume)

    def _piece(self, t: torch.Tensor, consume):
        """One piece of at most `capacity` values: published (a launch of its own)."""
        return self._published(t.shape, lambda to: rank_sum.publish(t.reshape(-1), to), consume)

    def _published(self, shape, produce, consume):
        """`produce(to)` publishes this rank's partial of `shape` (`to`: this rank's buffer, every rank's
        flags); every rank's slot is given to `consume` in rank order (views in `shape` of their first slot:
        the kernel adds the call's) with the publish it waits on."""
        to = rank_sum.Publish(self.buffers.peers[self.rank], self.flags.peers, self.rank)
        produce(to)
        n = math.prod(shape)
        return consume(rank_sum.Partials([p[:n].view(shape) for p in self.buffers.peers], to))


class PeerMemory:
    """CUDA symmetric memory: `n` values of `dtype` on every rank, zeroed, every peer's mapped (NVLink):
    `peers`, rank order."""

    def __init__(self, world: int, rank: int, n: int, dtype: torch.dtype, device: torch.device, group):
        import torch.distributed._symmetric_memory as symm_mem

        mine = symm_mem.empty(n, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(mine, group or dist.group.WORLD)
        mine.zero_()
        handle.barrier(channel=0)  # every rank's is zeroed before any is written
        self.peers = [handle.get_buffer(r, (n,), dtype) for r in range(world)]


class HostMemory:
    """The CPU stand-in of `PeerMemory`: each rank's values are a file in shared memory that every rank's
    process maps (zeroed before any rank maps it). The files are unlinked once every rank has mapped them
    (the mappings live on), so nothing is left behind, whatever ends the processes."""

    def __init__(self, world: int, rank: int, n: int, dtype: torch.dtype, device: torch.device, group):
        group = group or dist.group.WORLD
        box = [f"appliance-symm-{os.getpid()}-{uuid.uuid4().hex[:12]}" if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        paths = self.paths = [root / f"{box[0]}-rank{r}" for r in range(world)]
        torch.from_file(str(paths[rank]), shared=True, size=n, dtype=dtype).zero_()
        dist.barrier(group=group)  # every rank's file exists, zeroed
        self.peers = [torch.from_file(str(paths[r]), shared=True, size=n, dtype=dtype) for r in range(world)]
        dist.barrier(group=group)  # every rank has mapped every file
        paths[rank].unlink()


class CallCheck:
    """--check-ranks: before each collective every rank's call (its number in this process's sequence, the
    operation, dtype and shape) is gathered and compared with rank 0's. A difference raises RankDivergence
    on every rank, naming both calls, where the transport would abort (sizes that differ) or hang (a call
    one rank never makes: the others then meet it at its next check, whose number differs). A gather of two
    ints and a host read per collective: a debugging mode for tests and diagnosis, skipped inside a CUDA
    graph capture."""

    def __init__(self, world: int, device: torch.device, group=None):
        self.world, self.device, self.group = world, device, group
        self.calls = 0

    def __call__(self, op: str, t: torch.Tensor | None = None) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self.calls += 1
        call = f"#{self.calls} {op}" + ("" if t is None else f" {str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
        mine = torch.tensor([self.calls, zlib.crc32(call.encode())], dtype=torch.long, device=self.device)
        every = torch.empty(self.world * 2, dtype=torch.long, device=self.device)
        all_gather(every, mine, group=self.group)
        rows = every.view(self.world, 2).tolist()
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        if differ:
            said = [None] * self.world
            dist.all_gather_object(said, call, group=self.group)
            self.calls = max(row[0] for row in rows)  # counting on together from here
            r = differ[0]
            raise RankDivergence(f"ranks diverged at a collective: rank 0 makes {said[0]}; rank {r} makes {said[r]}",
                                 field="collective", value=r)


class CheckedSum:
    """A fixed-order sum whose every call `check` compares across ranks first (--check-ranks)."""

    def __init__(self, sum, check: CallCheck):
        self.sum, self.check, self.kind = sum, check, sum.kind

    def __call__(self, t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
        self.check(f"{self.kind} sum", t)
        return self.sum(t, out_dtype, round_to)

    def into(self, t: torch.Tensor, consume):
        self.check(f"{self.kind} sum", t)
        return self.sum.into(t, consume)

    def produced_into(self, shape: tuple[int, ...], produce, consume):
        self.check(f"{self.kind} sum", torch.empty(shape, device="meta"))  # the call's dtype and shape
        return self.sum.produced_into(shape, produce, consume)

    def gathered_into(self, shape: tuple[int, ...], produce, consume):
        self.check(f"{self.kind} gather", torch.empty(shape, device="meta"))
        return self.sum.gathered_into(shape, produce, consume)


def peers_reachable(world: int) -> bool:
    """Whether the GPUs of a `world`-rank group on this host can all read each other's memory."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        return False
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(world) for b in range(world) if a != b)


def make_sum(mode: str, world: int, rank: int, device: torch.device, capacity: int = 1 << 20, group=None,
             check: CallCheck | None = None):
    """The fixed-order sum for `--allreduce mode` (see the module docstring); `capacity`: values a symmetric
    sum takes in one piece; `check`: compare every call across ranks first."""
    if mode not in MODES:
        raise ValueError(f"--allreduce {mode}: must be one of {', '.join(MODES)}")
    if mode == "symm" or (mode == "auto" and device.type == "cuda" and peers_reachable(world)):
        sum = SymmSum(world, rank, capacity, device, group)
    else:
        sum = GatherSum(world, group)
    return sum if check is None else CheckedSum(sum, check)
