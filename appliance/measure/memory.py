"""Memory plans: does a model, its decode state for a context length, the graph buffers and headroom fit a
device? The plan names every part in bytes; a plan that does not fit names the largest part and the
shortfall. The engine's maximum context is the config's, capped by what the plan lets fit.

`fast_path_plan` is the truthful plan: the fast path built on the meta device from the config (shapes.py)
and warmed up by one cycle (`warm_meta_model`), then every tensor it holds counted once: the weights in
their stored format, the copies the load and the first cycle make (float copies of dense weights, caches
of the kernels), the decode states of the target and the drafter as allocated for the context, and the
RoPE tables (cos and sin of every position of the context, which V4.1's fused kernels read). `live_bytes`
measures what a process really holds (every live tensor, each storage's reachable bytes once), to check the plan against
a real load (tests/test_memory_plan.py).
"""

import os
from dataclasses import dataclass

import torch

from appliance.errors import MemoryPlanError
from appliance.parallel.sharding import largest_sum, verify_rows
from kernels import rank_sum

from .count import DeclaredReads, count_prefill, last_chunk_start
from .recorder import Recorder
from .shapes import META, MetaModel, live_bytes, live_spans, meta_model, resident

GRAPH_BUFFERS = 64 << 20  # static inputs/outputs and scratch of the captured decode cycle (upper estimate)
HEADROOM = 0.08  # of device memory, for the allocator, NCCL and the CUDA context


@dataclass
class MemoryPlan:
    context: int
    parts: dict[str, int]  # name -> bytes
    capacity: int  # device bytes
    details: dict | None = None  # what the parts are made of (fast_path_plan)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def check(self) -> None:
        if not self.fits:
            part, size = max(self.parts.items(), key=lambda kv: kv[1])
            raise MemoryPlanError(
                f"memory plan for a {self.context}-token context does not fit: needs {self.total} bytes, "
                f"the device has {self.capacity}; short by {self.total - self.capacity} bytes "
                f"(largest part: {part}, {size} bytes)", field=part, value=self.total - self.capacity)


def parse_bytes(text: str) -> int:
    """"288GB", "141GiB", "80e9" -> bytes."""
    t = text.strip().upper().replace(" ", "")
    for suffix, scale in (("GIB", 1 << 30), ("GB", 10**9), ("TIB", 1 << 40), ("TB", 10**12), ("MIB", 1 << 20),
                          ("MB", 10**6)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * scale)
    return int(float(t))


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def state_cost(lm, spare: int = 16) -> tuple[float, int]:
    """(bytes per position, constant bytes) of the decode state as this process allocates it: the target's
    and the drafter's states built on the meta device (sizes without memory) at two capacities."""
    def nbytes(capacity: int) -> int:
        n = lm.model.new_state(capacity, spare, device="meta").nbytes
        if lm.drafter is not None:
            n += lm.drafter.new_state(capacity, spare, device="meta").nbytes
        return n

    small, large = 1 << 12, 1 << 13
    per_token = (nbytes(large) - nbytes(small)) / (large - small)
    return per_token, int(nbytes(small) - per_token * small)


def memory_budget(device) -> int:
    """Bytes the decode state may take on `device` now that the weights are loaded: the free device memory
    less graph buffers and headroom on CUDA; half the host memory on the CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, free - GRAPH_BUFFERS - int(total * HEADROOM))
    return int(host_memory_bytes() * 0.5)


def plan_context(lm, requested: int | None = None, budget: int | None = None) -> int:
    """The engine's context limit: the config's maximum (or `requested`), capped by what the decode state
    as allocated (`state_cost`) leaves room for in `budget` bytes (default: `memory_budget` of the model's
    device). A `requested` context that does not fit raises MemoryPlanError; an unrequested one is capped."""
    cfg = lm.cfg
    limit = cfg.max_context if requested is None else requested
    if requested is not None and requested > cfg.max_context:
        raise MemoryPlanError(f"context {requested} exceeds the model's maximum {cfg.max_context}",
                              field="context", value=requested)
    per_token, constant = state_cost(lm)
    capacity = budget if budget is not None else memory_budget(lm.runtime.device)
    need = int(per_token * limit + constant)
    if need > capacity:
        if requested is not None:
            raise MemoryPlanError(
                f"decode state for a {requested}-token context needs {need} bytes, the budget is {capacity}; "
                f"short by {need - capacity} bytes (part: decode_state)", field="decode_state", value=need - capacity)
        limit = int(max(0, capacity - constant) // per_token)
    return limit


def fast_path_plan(cfg, context: int, device_bytes: int | None = None, world: int = 1, dtype: str = "bfloat16",
                   drafter: bool = True, graphs: bool = True, chunk: int | None = None) -> "MemoryPlan":
    """One rank's plan for the fast path as it allocates: weights (stored format), float copies and the
    first cycle's caches, the target's and drafter's decode state for `context` positions, graph buffers
    and headroom (`graphs`: on a GPU; both 0 for a CPU plan); with `chunk`, the scratch a prefill in chunks
    of that size needs at its last chunk, the largest (`prefill_scratch`)."""
    mm, held = warm_meta_model(cfg, dtype, world, drafter)
    tables = rope_tables(mm.model)
    warm_tables = sum(t.tables[0].shape[0] * t.bytes_per_position for t in tables)  # before state_cost grows them
    per_token, constant = state_cost(mm)
    scratch = prefill_scratch(mm, context, chunk) if chunk else 0  # after: it grows the RoPE tables
    capacity = device_bytes if device_bytes is not None else 0
    parts = {
        "weights": held["stored"],
        # less the warm-up's RoPE tables (64 positions), counted with the context below
        "float_copies_and_caches": held["copies"] - warm_tables,
        "decode_state": int(per_token * context + constant),
        "rope_tables": context * sum(t.bytes_per_position for t in tables),
        "graph_buffers": GRAPH_BUFFERS if graphs else 0,
        # several GPUs: a rank's symmetric-memory buffers, one for each of its two exchanges (parallel/sharding.py
        # Comm `later`), a slot per call in flight (kernels/rank_sum.py SLOTS) of one decode step's largest sum
        # (a CPU rank's stand-in is in host memory)
        "symmetric_sum": 2 * 4 * rank_sum.SLOTS * largest_sum(cfg, verify_rows(cfg, drafter), context)
        if graphs and world > 1 else 0,
        "prefill_scratch": scratch,
        "headroom": int(capacity * HEADROOM) if graphs else 0,
    }
    plan = MemoryPlan(context, parts, capacity)
    plan.details = {"state_bytes_per_token": per_token, "state_constant": constant, "host_tables": held["host"],
                    "largest_copies": held["largest_copies"]}
    return plan


def warm_meta_model(cfg, dtype: str = "bfloat16", world: int = 1,
                    drafter: bool = True) -> tuple[MetaModel, dict]:
    """`meta_model`, after one forward of the backbone and one draft (the first calls make the kernels'
    caches: router weights in their narrowest exact dtype, expert address tables), and what it holds:
    `resident`'s parts, with `copies` raised to every live tensor the build and the warm-up left that is
    neither a stored weight nor a host table (caches the model does not reach are counted too)."""
    baseline = live_spans("meta")
    mm = meta_model(cfg, dtype, world=world, drafter=drafter)
    rec = Recorder(meta=True, recording=False)
    with torch.inference_mode(), rec, DeclaredReads(mm.runtime, rec, meta=True).installed():
        _warm_up(mm)
    held = resident(mm.model, mm.drafter, provided=mm.checkpoint.provided)
    everything = live_bytes("meta", baseline) - (mm.comm.symmetric_bytes() if mm.comm is not None else 0)
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


def prefill_scratch(mm, context: int, chunk: int) -> int:
    """The most bytes a prefill chunk's own tensors hold at once (count.count_prefill's `scratch_bytes`) at
    the last chunk of a `context`-token prompt, where the indexer's scores are widest, on the meta build."""
    chunk = min(chunk, context)
    start = last_chunk_start(context, chunk)
    state = mm.model.new_state(start + chunk, device="meta")
    return count_prefill(mm.model, state, start, chunk)["scratch_bytes"]


def rope_tables(model) -> list:
    """The model's RoPE tables the fused kernels read (appliance/model/rope.py: cos and sin of every position
    of the longest state), one per distinct table; none for a model whose kernels compute their own."""
    return [rope for rope in getattr(model, "ropes", []) if rope.tables is not None]
