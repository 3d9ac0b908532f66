"""A model built from its config alone, on the meta device (shapes and dtypes, no data), and what a built
model holds.

- `MetaCheckpoint` hands the model meta tensors in the official storage formats (FP8 + E8M0 scales, FP4
  experts, BF16 elsewhere), as a loaded checkpoint would, so building the model makes the same float
  copies and views the real load makes, at no memory cost. The released V4.1-Flash (~307 GB) builds in
  seconds.
- `meta_model` builds the backbone and its drafter on the fast path, split for one of `world` ranks by the
  same transformation the real split uses (appliance/parallel/sharding.py) with a stand-in for the process
  group (`ShapeComm`): its collectives are recorded by the active `Recorder` and return tensors of the
  right shape.
- `resident` lists every tensor a built model holds, once each, as the device would hold it after
  placement (appliance/parallel/placement.py moves each tensor object separately, so a view costs its own
  elements): stored-format weights (what the checkpoint provided), copies made from them (float copies,
  transposes), tables left in host memory.
- `weights` reads off a build what it holds of each checkpoint tensor, and where; `rank_shares`, the share
  of each one rank of a split build holds.
- `live_bytes` measures what a process holds: every live tensor (the garbage collector's list), each
  storage's reachable bytes once (memory.py's `warm_meta_model` uses it on the meta device after a warm-up
  forward, so that the kernels' caches, made on a first call and held outside the model, are counted too).
"""

import gc
import math
from dataclasses import dataclass, field

import torch

from appliance.model.config import ModelConfig, V41Config
from appliance.model.engram import EngramHash
from appliance.model.families import build_drafter, build_model
from appliance.model.runtime import DTYPES, Numerics, Runtime
from appliance.model.weights import ShapeCheckpoint
from appliance.parallel.collectives import SymmSum
from appliance.parallel.placement import LEAVES, place, stays_on_host
from appliance.parallel.sharding import Comm, largest_sum, shard, verify_rows
from kernels import rank_sum
from kernels.linear import PackedWeight
from kernels.registry import resolve

from .recorder import Recorder, nbytes, storage_key

META = torch.device("meta")
_DTYPES = {"I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
           "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}


class MetaCheckpoint(ShapeCheckpoint):
    """A shape-only checkpoint that returns meta tensors in the official storage dtypes; `provided` maps
    the storages it handed out (the stored-format weights) to their checkpoint names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.provided: dict[int, str] = {}
        # the storages themselves (not tensors: live_spans counts none of them): a storage the model drops
        # (a norm weight it keeps as a float32 copy) must not free its key for a copy made later to reuse
        self._storages: list = []

    def _meta(self, name: str) -> torch.Tensor:
        dtype, shape = self.tensors[name]
        t = torch.empty(shape, dtype=_DTYPES[dtype], device=META)
        self.provided[storage_key(t)] = name
        self._storages.append(t.untyped_storage())
        return t

    def tensor(self, name, shape, dtypes=(torch.bfloat16,)):
        super().tensor(name, shape, dtypes)
        return self._meta(name)

    def linear(self, name, out_features, in_features, block, kind="fp8"):
        super().linear(name, out_features, in_features, block, kind)
        dtype = self.tensors[name][0]
        data = self._meta(name)
        if dtype == "BF16":
            return PackedWeight(name, (out_features, in_features), "dense", data)
        scale = self._meta(name.replace(".weight", ".scale"))
        if dtype == "I8":
            return PackedWeight(name, (out_features, in_features), "fp4", data, scale, (1, 32))
        return PackedWeight(name, (out_features, in_features), "fp8", data, scale, block or self.cfg.weight_block)


class ShapeComm:
    """The collectives of appliance/parallel/sharding.py's `Comm` for one rank of a split model built on
    the meta device: each is recorded (op, payload bytes) by the active Recorder and returns a tensor of
    the shape the real collective returns. The fast path's sums over ranks as `--allreduce` runs them
    (`allreduce`): "symm", the symmetric-memory sum's own code (parallel/collectives.py SymmSum, its buffers
    on the meta device, `capacity` values a piece: its producers' and publish launches, and consumers that wait
    inside their kernels, each recorded as a "symm_" collective), or "nccl", an all-gather of the partials."""

    def __init__(self, rank: int, world: int, allreduce: str = "symm", capacity: int = 1 << 20):
        self.rank, self.world, self.group = rank, world, None
        if allreduce not in ("symm", "nccl"):
            raise ValueError(f"allreduce={allreduce!r}: must be symm or nccl")
        self.symm = SymmSum(world, rank, capacity, META, memory=MetaMemory) if allreduce == "symm" else None
        self.later = SymmSum(world, rank, capacity, META, memory=MetaMemory) if allreduce == "symm" else None

    def _record(self, op: str, t: torch.Tensor) -> None:
        rec = Recorder.active
        if rec is not None:
            rec.collective(op, t)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._record("allreduce_", t)
        return t.contiguous()

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Comm.all_gather: received along dim 0, then concatenated along another `dim` (a launch)."""
        self._record("allgather_", t)
        parts = self._received([self.world, *t.shape], t)
        if dim % t.dim() == 0:
            return parts.view(self.world * t.shape[0], *t.shape[1:])
        return torch.cat(list(parts), dim=dim)

    def sum(self, t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
            round_to: torch.dtype | None = None) -> torch.Tensor:
        """The fast path's fixed-order sum: the rank-order adds (one launch) of the partials the sum gives."""
        return self.sum_into(t, lambda parts: rank_sum.fast(parts, out_dtype, round_to))

    def sum_into(self, t: torch.Tensor, consume):
        """Every rank's partial of t given to `consume`, from symmetric memory (a publish launch) or an
        all-gather."""
        if self.symm is not None:
            return self.symm.into(t, consume)
        self._record("allgather_", t)
        return consume(list(self._received([self.world, *t.shape], t)))

    def sum_produced(self, shape: tuple[int, ...], produce, consume):
        """Comm.sum_produced: the producer publishes its partial itself over symmetric memory, where the
        active Recorder counts the slot it fills as written, not read (as a gathered partial's fresh output)."""
        return self._produced(self.symm, shape, produce, consume)

    gather_produced = sum_produced  # Comm.gather_produced: the same exchange (a decode step's part fits a slot)

    def gather_later(self, shape: tuple[int, ...], produce, consume):
        """Comm.gather_later: through the second exchange's buffers, or an all-gather."""
        return self._produced(self.later, shape, produce, consume)

    def _produced(self, symm, shape: tuple[int, ...], produce, consume):
        if symm is None:
            return self.sum_into(produce(None), consume)

        def publishing(to):
            rec = Recorder.active
            if to is None or rec is None:
                return produce(to)
            with rec.writes(to.buffer, math.prod(shape) * to.buffer.element_size()):
                return produce(to)

        return symm.produced_into(shape, publishing, consume)

    def exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Comm.exchange: an all-to-all of this rank's part for each rank."""
        self._record("alltoall_", t)
        return self._received(list(t.shape), t)

    @staticmethod
    def _received(shape: list[int], like: torch.Tensor) -> torch.Tensor:
        rec = Recorder.active
        if rec is None:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        with rec.pause():  # written by the collective: not a fresh allocation
            return torch.empty(shape, dtype=like.dtype, device=like.device)

    span = Comm.span  # the real split's: one rank's share

    def symmetric_bytes(self) -> int:
        """Bytes of its symmetric-memory exchanges' buffers and flags (meta tensors): the memory plan's
        "symmetric_sum", not the model's copies."""
        return sum(nbytes(t) for symm in (self.symm, self.later) if symm is not None
                   for memory in (symm.buffers, symm.flags) for t in memory.peers)


class MetaMemory:
    """parallel/collectives.py's memory (PeerMemory, HostMemory) on the meta device: every rank's `n` values."""

    def __init__(self, world: int, rank: int, n: int, dtype: torch.dtype, device: torch.device, group):
        self.peers = [torch.empty(n, dtype=dtype, device=META) for _ in range(world)]


@dataclass
class MetaModel:
    """What a decode session needs of a loaded model (appliance.loader.LoadedModel), built on the meta
    device from a config."""

    cfg: ModelConfig
    model: object
    drafter: object
    runtime: Runtime
    checkpoint: MetaCheckpoint
    world: object = None
    capture_blockers: list[str] = field(default_factory=list)
    tokenizer: object = None
    model_dir: object = None
    comm: object = None  # a split build's ShapeComm


def meta_model(cfg: ModelConfig, dtype: str = "bfloat16", numerics: str = "official", drafter: bool = True,
               world: int = 1, rank: int = 0, experts: str = "auto", allreduce: str = "symm") -> MetaModel:
    """`cfg`'s backbone (and drafter) on the fast path, built on the meta device, split for `rank` of
    `world` ranks (the MoE's experts as `experts` says: RunOptions.experts; the sums over ranks as
    `--allreduce` says, "symm" or "nccl": ShapeComm). Engram's token map is a
    stand-in of the right size (ids are hashed on the device; the values do not change what a step launches
    or reads)."""
    ckpt = MetaCheckpoint(cfg)
    rt = Runtime(Numerics(numerics == "official", DTYPES[dtype]), resolve("fast"), META)
    model = build_model(cfg, ckpt, rt, None)
    if isinstance(cfg, V41Config) and cfg.engram is not None:
        token_map = torch.zeros(cfg.engram.compressed_vocab_size, dtype=torch.long)
        model.engram_hash = place(EngramHash(token_map, cfg), META)
    d = build_drafter(cfg, ckpt, rt, model) if drafter else None
    blockers, comm = [], None
    if world > 1:
        comm = ShapeComm(rank, world, allreduce, largest_sum(cfg, verify_rows(cfg, drafter), cfg.max_context))
        blockers = ["(meta build) " + b for b in shard(model, d, comm, experts)]
    # what placement moves (RoPE tables, Engram's hash constants); host tables stay where they are and the
    # lookup kernel reads their rows in place (kernels/engram.py), so they block no capture
    place((model, d), META)
    return MetaModel(cfg, model, d, rt, ckpt, world=_World(rank, world), capture_blockers=blockers, comm=comm)


@dataclass
class _World:
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def resident(*roots, provided: dict[int, str] | None = None) -> dict:
    """Bytes of every tensor reachable from `roots` (attributes, lists, tuples, dicts), each tensor object
    once at its own size (a view costs its elements, as after placement on a device): `stored` (storages
    in `provided`: the checkpoint's tensors in their stored format), `copies` (everything else: float
    copies, transposes, tables made at load), `host` (the Engram tables placement leaves in host memory),
    the largest copies by attribute path, and `by_name`: of each checkpoint tensor in `provided` the roots
    hold, the bytes they hold (a split model's rank: its slices) and where (placement.py: "device" or
    "host")."""
    seen: set[int] = set()
    out = {"stored": 0, "copies": 0, "host": 0}
    copies: dict[str, int] = {}
    by_name: dict[str, tuple[int, str]] = {}

    def hold(t: torch.Tensor, where: str) -> None:
        name = (provided or {}).get(storage_key(t))
        if name is not None:
            by_name[name] = (by_name.get(name, (0, where))[0] + nbytes(t), where)

    def visit(obj, path: str, depth: int):
        if depth > 12 or isinstance(obj, LEAVES) or id(obj) in seen or isinstance(obj, SymmSum):
            return  # a SymmSum's buffers: the plan's "symmetric_sum", apart
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            n = nbytes(obj)
            if provided is not None and storage_key(obj) in provided:
                out["stored"] += n
                hold(obj, "device")
            else:
                out["copies"] += n
                key = _shape_path(path)
                copies[key] = copies.get(key, 0) + n
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                if not isinstance(v, LEAVES):  # a shape's ints: no call, no path
                    visit(v, f"{path}[{i}]", depth + 1)
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{path}.{k}", depth + 1)
            return
        attrs = vars(obj) if hasattr(obj, "__dict__") else {}
        for name, value in attrs.items():
            if isinstance(value, LEAVES) or name in ("rt", "cfg", "gen", "lm", "_dense64"):
                continue  # back references; lazy caches (below)
            if stays_on_host(obj, name, value):
                if id(value) not in seen:
                    seen.add(id(value))
                    out["host"] += nbytes(value)
                    hold(value, "host")
                continue
            visit(value, f"{path}.{name}", depth + 1)

    for i, root in enumerate(roots):
        visit(root, type(root).__name__ if root is not None else f"root{i}", 0)
    out["largest_copies"] = dict(sorted(copies.items(), key=lambda kv: -kv[1])[:8])
    out["by_name"] = by_name
    return out


@dataclass
class Weight:
    """One checkpoint tensor, and what one rank of a built model holds of it."""

    dtype: str  # the stored dtype (safetensors name)
    whole: int  # bytes in the checkpoint
    # bytes of it the rank holds in the stored format: its slice of a split tensor; 0 where the model keeps
    # only a copy made at load (norm weights in float32) or, with whole experts, another rank's expert
    held: int
    where: str  # "device", or "host" for a table placement leaves memory-mapped in host memory


def weights(mm: MetaModel) -> dict[str, Weight]:
    """Every tensor the model (and its drafter) reads, by checkpoint name, as `mm` holds it."""
    held = resident(mm.model, mm.drafter, provided=mm.checkpoint.provided)["by_name"]
    ckpt = mm.checkpoint
    return {name: Weight(dtype, ckpt.nbytes(name), *held.get(name, (0, "device")))
            for name, (dtype, _) in ckpt.tensors.items()}


def rank_shares(mm: MetaModel, world: int) -> dict[str, float]:
    """The share of each checkpoint tensor one of `world` ranks holds, as the split (sharding.py) of a meta
    build leaves it against the single-device build `mm`: 1/world of what it divides, 1 of what it
    replicates. A tensor the model keeps only as a copy made at load (norm weights) counts as replicated:
    the split slices the checkpoint's tensors, never those copies."""
    whole = weights(mm)
    split = weights(meta_model(mm.cfg, world=world)) if world > 1 else whole
    return {name: split[name].held / w.held if w.held else 1.0 for name, w in whole.items()}


def _shape_path(path: str) -> str:
    """layers[3].attn.out.wo_a64 -> layers[*].attn.out.wo_a64 (copies summed over layers and experts)."""
    import re

    return re.sub(r"\[\d+\]", "[*]", path)


def live_spans(device_type: str) -> dict:
    """Byte ranges of every live tensor on `device_type`, by storage, as placement on a device would hold
    them (placement.py moves each tensor object on its own): a contiguous tensor covers its own range of its
    storage; any other view counts its own elements apart (a column slice becomes a tensor of its own); a
    tensor alive only as the base of a view (the whole weight a shard was sliced from) is not counted."""
    gc.collect()
    live = [o for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and o.device.type == device_type and o.numel() > 0]
    bases = {id(o._base) for o in live if o._base is not None}
    spans: dict = {}
    for obj in live:
        if id(obj) in bases:
            continue
        n = nbytes(obj)
        if obj.is_contiguous():
            start = obj.storage_offset() * obj.element_size()
            spans.setdefault(storage_key(obj), []).append((start, start + n))
        else:  # the same elements seen through another view of the same shape (a dtype view) count once
            key = ("view", storage_key(obj), obj.storage_offset() * obj.element_size(), tuple(obj.shape),
                   tuple(obj.stride()), obj.element_size())
            spans[key] = [(0, n)]
    return spans


def live_bytes(device_type: str = "cpu", baseline: dict | None = None) -> int:
    """Bytes the live tensors on `device_type` reach (the union of their ranges in each storage), leaving
    out the storages already live in `baseline` (a `live_spans` taken before)."""
    gc.collect()
    total = 0
    for key, ranges in live_spans(device_type).items():
        if baseline is not None and key in baseline:
            continue
        end = -1
        for a, b in sorted(ranges):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
    return total
