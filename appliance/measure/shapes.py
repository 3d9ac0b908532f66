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
- `live_bytes` measures what a process holds: every live tensor (the garbage collector's list), each
  storage's reachable bytes once; `warm_meta_model` uses it on the meta device after a warm-up forward, so
  that the kernels' caches (made on a first call, held outside the model) are counted too.
"""

import gc
from dataclasses import dataclass, field

import torch

from appliance.model.config import ModelConfig, V41Config
from appliance.model.engram import EngramHash
from appliance.model.families import build_drafter, build_model
from appliance.model.runtime import DTYPES, Numerics, Runtime
from appliance.model.weights import ShapeCheckpoint
from appliance.parallel.placement import HOST_TABLE_BYTES, place
from appliance.parallel.sharding import Comm, shard
from kernels import rank_sum
from kernels.linear import PackedWeight
from kernels.registry import resolve

from .recorder import Recorder, nbytes, storage_key

META = torch.device("meta")
_DTYPES = {"I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
           "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}


class MetaCheckpoint(ShapeCheckpoint):
    """A shape-only checkpoint that returns meta tensors in the official storage dtypes; `provided` holds
    the storages it handed out (the stored-format weights)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.provided: set[int] = set()

    def _meta(self, name: str) -> torch.Tensor:
        dtype, shape = self.tensors[name]
        t = torch.empty(shape, dtype=_DTYPES[dtype], device=META)
        self.provided.add(storage_key(t))
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
    the shape the real collective returns."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.group = rank, world, None

    def _record(self, op: str, t: torch.Tensor) -> None:
        rec = Recorder.active
        if rec is not None:
            rec.collective(op, t)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._record("allreduce_", t)
        return t.contiguous()

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        self._record("allgather_", t)
        shape = list(t.shape)
        shape[dim] *= self.world
        return self._received(shape, t)

    def sum(self, t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
            round_to: torch.dtype | None = None) -> torch.Tensor:
        """The fast path's fixed-order sum as `--allreduce nccl` runs it: an all-gather of the partials, then
        the adds in rank order (one launch)."""
        self._record("allgather_", t)
        return rank_sum.fast(list(self._received([self.world, *t.shape], t)), out_dtype, round_to)

    def sum_shares(self, t: torch.Tensor) -> torch.Tensor:
        """Comm.sum_shares: an all-to-all of this rank's partials of every share, then the adds."""
        self._record("alltoall_", t)
        return rank_sum.fast(list(self._received(list(t.shape), t)), torch.float32)

    @staticmethod
    def _received(shape: list[int], like: torch.Tensor) -> torch.Tensor:
        rec = Recorder.active
        if rec is None:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        with rec.pause():  # written by the collective: not a fresh allocation
            return torch.empty(shape, dtype=like.dtype, device=like.device)

    span = Comm.span  # the real split's: one rank's share


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


def meta_model(cfg: ModelConfig, dtype: str = "bfloat16", numerics: str = "official", drafter: bool = True,
               world: int = 1, rank: int = 0, experts: str = "auto") -> MetaModel:
    """`cfg`'s backbone (and drafter) on the fast path, built on the meta device, split for `rank` of
    `world` ranks (the MoE's experts as `experts` says: RunOptions.experts). Engram's token map is a
    stand-in of the right size (ids are hashed on the device; the values do not change what a step launches
    or reads)."""
    ckpt = MetaCheckpoint(cfg)
    rt = Runtime(Numerics(numerics == "official", DTYPES[dtype]), resolve("fast"), META)
    model = build_model(cfg, ckpt, rt, None)
    if isinstance(cfg, V41Config) and cfg.engram is not None:
        token_map = torch.zeros(cfg.engram.compressed_vocab_size, dtype=torch.long)
        model.engram_hash = place(EngramHash(token_map, cfg), META)
    d = build_drafter(cfg, ckpt, rt, model) if drafter else None
    blockers = []
    if world > 1:
        blockers = ["(meta build) " + b for b in shard(model, d, ShapeComm(rank, world), experts)]
    # what placement moves (RoPE tables, Engram's hash constants); host tables stay where they are and the
    # lookup kernel reads their rows in place (kernels/engram.py), so they block no capture
    place((model, d), META)
    return MetaModel(cfg, model, d, rt, ckpt, world=_World(rank, world), capture_blockers=blockers)


def warm_meta_model(cfg: ModelConfig, dtype: str = "bfloat16", world: int = 1,
                    drafter: bool = True) -> tuple[MetaModel, dict]:
    """`meta_model`, after one forward of the backbone and one draft (the first calls make the kernels'
    caches: router weights in their narrowest exact dtype, expert address tables), and what it holds:
    `resident`'s parts, with `copies` raised to every live tensor the build and the warm-up left that is
    neither a stored weight nor a host table (caches the model does not reach are counted too)."""
    baseline = live_spans("meta")
    mm = meta_model(cfg, dtype, world=world, drafter=drafter)
    from .count import DeclaredReads

    rec = Recorder(meta=True, recording=False)
    with torch.inference_mode(), rec, DeclaredReads(mm.runtime, rec, meta=True).installed():
        _warm_up(mm)
    held = resident(mm.model, mm.drafter, provided=mm.checkpoint.provided)
    everything = live_bytes("meta", baseline)
    held["copies"] = max(held["copies"], everything - held["stored"] - held["host"])
    return mm, held


def _warm_up(mm: MetaModel) -> None:
    long = dict(dtype=torch.long, device=META)
    state = mm.model.new_state(64, 16, device=META)
    start = torch.zeros((), **long)
    tokens = torch.zeros(2, **long)
    keep = mm.drafter is not None and mm.drafter.kind == "mtp"
    with state.journal.off():  # as a decode cycle runs (no host read of a position)
        mm.model.forward(tokens, state, logits="all", start=start, bound=63, keep_streams=keep)
    if mm.drafter is not None:
        d = mm.drafter
        dstate = d.new_state(64, 16, device=META)
        row = torch.zeros(d.row_shape, dtype=mm.runtime.dtype, device=META)
        params = torch.zeros(3, dtype=torch.float32, device=META)
        key = torch.zeros(2, **long)
        with dstate.journal.off():
            d.draft(dstate, start + 1, tokens[:1], row, 1, params, key)


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


def resident(*roots, provided: set[int] | None = None) -> dict:
    """Bytes of every tensor reachable from `roots` (attributes, lists, tuples, dicts), each tensor object
    once at its own size (a view costs its elements, as after placement on a device): `stored` (storages
    in `provided`: the checkpoint's tensors in their stored format), `copies` (everything else: float
    copies, transposes, tables made at load), `host` (the Engram tables placement leaves in host memory),
    and the largest copies by attribute path."""
    seen: set[int] = set()
    out = {"stored": 0, "copies": 0, "host": 0}
    copies: dict[str, int] = {}

    def visit(obj, path: str, depth: int):
        if depth > 12 or obj is None or isinstance(obj, (str, int, float, bool, torch.device, torch.dtype)):
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            n = nbytes(obj)
            if provided is not None and storage_key(obj) in provided:
                out["stored"] += n
            else:
                out["copies"] += n
                key = _shape_path(path)
                copies[key] = copies.get(key, 0) + n
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{path}[{i}]", depth + 1)
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{path}.{k}", depth + 1)
            return
        attrs = vars(obj) if hasattr(obj, "__dict__") else {}
        host = getattr(obj, "HOST_TENSORS", ())
        for name, value in attrs.items():
            if name in ("rt", "cfg", "gen", "lm", "_dense64"):  # back references; lazy caches (below)
                continue
            if name in host and isinstance(value, torch.Tensor) and nbytes(value) > HOST_TABLE_BYTES:
                if id(value) not in seen:
                    seen.add(id(value))
                    out["host"] += nbytes(value)
                continue
            visit(value, f"{path}.{name}", depth + 1)

    for i, root in enumerate(roots):
        visit(root, type(root).__name__ if root is not None else f"root{i}", 0)
    out["largest_copies"] = dict(sorted(copies.items(), key=lambda kv: -kv[1])[:8])
    return out


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
