"""What one decode cycle does on the device, counted on any machine: a dispatch mode that records every
kernel launch (torch operations that run a kernel, and Triton launches), every host read of a device
value, every collective, every operation a CUDA-graph capture refuses, and the bytes each launch reads.

How an operation is classified (the CPU sees the same operations a GPU would, only their device differs):
- a **launch**: a torch operation that computes (or fills, or copies) on the device, or a Triton kernel
  launch. Not launches: views and metadata (an output that shares its input's storage, `detach`, `set_`),
  allocations (`empty*`: inside a captured graph they are the pool's), arithmetic on host scalars (a 0-dim
  tensor made from a Python number, `torch.tensor(0.5)`, which a GPU kernel takes as an argument), and the
  work a Triton kernel does under the interpreter. A torch operation is counted once, although a few
  (sort, topk, cumsum over long rows) launch two or three kernels on a GPU: the count is a lower bound
  for those;
- a **host sync**: a read of a device value by the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`,
  `.cpu()`, `.numpy()`), or an operation whose output shape depends on values (`nonzero`, `unique`,
  boolean-mask indexing, `repeat_interleave` by a tensor): each stalls the host until the device catches
  up, and none can be captured in a CUDA graph;
- a **collective**: a `c10d` operation (all-reduce, all-gather, broadcast), with its payload in bytes; not
  counted among the launches (the cost model prices it by its own latency);
- a **capture violation**: a host sync, or a tensor made from host data of several values (a
  host-to-device copy a replay would not redo);
- a **float64 launch**: a launch that reads or writes a float64 tensor (the fast path's numerics allow
  none: a B300 runs float64 at ~1/60 of its float32 rate), with where it happened.

Bytes written by a launch: a Triton kernel's outputs the first time anything writes them (storage allocated
inside and not yet written: a kernel does not read what nothing wrote), a torch operation's results and
overwritten arguments (an indexed write, `index_put_`, `index_copy_`, `scatter_`: its values), and the writes
the model declares through `writes()` (the state rows a chunk writes into its rings and caches). Not counted:
a Triton kernel's writes into storage written before in the step (in-place updates, a buffer zeroed first).

Bytes read by a launch: every tensor it receives, once (views count their own elements, not their whole
storage), except (a) outputs: tensors freshly allocated (`empty*`) and not yet written, and the written
argument of an overwriting operation (`copy_`, `fill_`, `index_put_`...); (b) gathers: `t[index]`,
`index_select`, `gather`, `embedding` read the gathered elements, not the whole source; (c) reads the
model declares through `gather()`/`read_through()` (`count.py` does this around the registry's
`attention` and `moe`): a compressed-row cache read at the rows an index selects, experts read through a
table of their addresses.

With `memory` set (a `LiveBytes`), the storages the code inside makes are followed until no tensor holds
them: the most live at once is the scratch the counted code needs (count.py's prefill chunks).

Launches, syncs, collectives and bytes are attributed to the block running when they happen (`tag()`):
the backbone's layers and the drafter's stages, or outside both (embedding, head, sampling, acceptance,
commit).

`Recorder(meta=True)` runs a step built on the meta device (shapes without data, `shapes.py`): Triton
launches are recorded and not run, and the few setup questions a meta tensor cannot answer get a fixed
answer (`equal` is True, a scalar read is 0). Used to count the released models from their config.
"""

import os
import traceback
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import _triton  # noqa: F401  (before Triton: it chooses the interpreter without a GPU)

aten = torch.ops.aten
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# host syncs that are operations (the reads through Tensor methods are patched, below)
HOST_SYNCS = {aten._local_scalar_dense.default: "a host read of a device value (int(t), float(t), .item())",
              aten.item.default: "a host read of a device value (.item())",
              aten.is_nonzero.default: "a host read of a device value (bool(t), if t:)",
              aten.equal.default: "a host read of a device value (torch.equal)",
              aten.nonzero.default: "nonzero (shape depends on values)",
              aten.masked_select.default: "masked_select (shape depends on values)",
              aten._unique2.default: "unique (shape depends on values)",
              aten.unique_dim.default: "unique (shape depends on values)",
              aten.unique_consecutive.default: "unique (shape depends on values)",
              aten.repeat_interleave.Tensor: "repeat_interleave by a tensor (shape depends on values)"}
HOST_COPIES = ("tolist", "numpy", "cpu")  # Tensor methods that copy to the host (no operation on a CPU tensor)

# operations that allocate or change metadata only: no kernel
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default}
_METADATA = {aten.detach.default, aten.alias.default, aten.set_.source_Storage,
             aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.set_.default,
             aten.resize_.default, aten.as_strided_.default, aten.lift_fresh.default}
# copies that may cross between host and device
_COPIES = {aten._to_copy.default, aten.to.device, aten.to.dtype_layout, aten.to.other, aten.copy_.default}
# gathers: the source (argument 0) is read at the gathered elements only
_GATHERS = {aten.index.Tensor, aten.index_select.default, aten.index_select.out, aten.gather.default,
            aten.embedding.default, aten.take.default}
# overwriting operations: argument 0 (or `out`) is written, not read
_OVERWRITES = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
               aten.index_put_.default, aten._index_put_impl_.default, aten.index_copy_.default,
               aten.scatter_.src, aten.scatter_.value, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor}
# overwriting operations that write at an index: the argument holding what they write (values, or the index)
_INDEXED_WRITES = {aten.index_put_.default: 2, aten._index_put_impl_.default: 2, aten.index_copy_.default: 3,
                   aten.scatter_.src: 3, aten.scatter_.value: 2}


def tensor_args(*groups) -> list[torch.Tensor]:
    """The tensors among arguments (one level of lists and tuples, as operation arguments nest)."""
    out = []
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (distinct on the meta device too, where every address is 0)."""
    return t.untyped_storage()._cdata


def _view_key(t: torch.Tensor) -> tuple:
    return storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class LiveBytes:
    """The bytes of the storages made inside (allocations and operations' results; not views of what was
    there before, nor what an in-place operation writes), from when an operation returns the first tensor on
    one until no tensor holds it, and the most live at once: the scratch a step needs beyond its weights and
    state (a meta build's too: its storages have sizes, not memory)."""

    def __init__(self):
        self.refs: dict[int, int] = {}  # storage -> tensors holding it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def track(self, outs: list, inputs: set[int]) -> None:
        for o in outs:
            key = storage_key(o)
            if key not in self.refs:
                if key in inputs:  # a view or an in-place result of a storage made before
                    continue
                self.refs[key] = 0
                self.sizes[key] = o.untyped_storage().nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(o, self._release, key)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


@dataclass
class Launch:
    kind: str  # "torch" | "triton"
    name: str
    block: str  # "layer 3", "stage 0", "outside"
    bytes_read: int
    # bytes it writes: the outputs a Triton kernel writes first (storage allocated and not written before),
    # a torch operation's results (an indexed write's values), what the model declares (`writes()`); not the
    # rewrites of storage written before in the step (a Triton kernel's in-place updates)
    bytes_written: int = 0
    # quantized weight elements streamed whole, by format: "fp8" (float8_e4m3fn tensors), "fp4" (int8 tensors,
    # two a byte); what the products' instruction issue is priced by (costmodel.py)
    weights: dict[str, int] = field(default_factory=dict)
    # of those, what routed experts read (declared by the MoE's counting wrapper): the part that grows on the
    # rank holding the most selected experts
    routed_bytes: int = 0
    routed_weights: dict[str, int] = field(default_factory=dict)
    routing: tuple[int, int, int] | None = None  # (experts, top-k, rows) of the MoE call it serves
    whole_experts: bool = False  # the ranks hold whole experts (expert parallel): one may hold more picks
    host_bytes: int = 0  # of bytes_read, what it reads from host memory (declared: the Engram lookup)
    # tensor-core FLOPs, declared by count.py's wrappers: "products" (the weight products: 2 x rows padded to
    # the MMA's 16 x weight elements), "attention" (scores and values of the attention and the indexer)
    flops: dict[str, float] = field(default_factory=dict)
    # a long call's weight products (a prefill chunk, kernels/_triton.py LONG_ROWS) on a GPU that multiplies in
    # the checkpoint's formats: the bytes the launch staging its rows once moves (rows read, codes written);
    # declared by count.py's wrappers for the launches whose products can run long, 0 for the others
    staged_bytes: int = 0
    # how its weight products multiply (declared by count.py's wrappers): "native" (in the checkpoint's formats:
    # FP8/FP4 weights, quantized rows), "registers" (weights dequantized to bfloat16 values in registers: a
    # plain product, or a launch mixing formats); "" for a launch without weight products
    path: str = ""
    # waits inside it for the phase before (kernels/phases.py: dependent steps as phases of one launch),
    # declared by count.py's wrappers: each priced as costmodel.PHASE_WAIT_S
    phase_waits: int = 0


# "collectives" that are reads of the peers' parts with no wait of their own (count.py's DSpark base)
PEER_READS = ("symm_read",)
WEIGHT_DTYPES = {torch.float8_e4m3fn: ("fp8", 1), torch.int8: ("fp4", 2)}  # format, elements a stored element


class Recorder(TorchDispatchMode):
    """Counts launches, host syncs, collectives, capture violations and bytes read; see the module
    docstring. Use as a context manager around the code to count; `recording` can be turned off for
    warm-up calls (meta runs need the recorder's answers during warm-up too). `label` names the step in
    capture violations."""

    active: "Recorder | None" = None  # the innermost recorder in use (ShapeComm records its collectives here)

    def __init__(self, meta: bool = False, label: str = "", recording: bool = True):
        super().__init__()
        self.meta, self.label, self.recording = meta, label, recording
        self.launches: list[Launch] = []
        self.syncs: list[dict] = []
        self.violations: list[dict] = []
        self.collectives: list[dict] = []
        self.float64: list[dict] = []  # launches touching a float64 tensor: name, block, where
        self.extra_reads: dict[str, int] = defaultdict(int)  # block -> bytes read through address tables
        self.block = "outside"
        self.paused = 0
        self.fresh: set[int] = set()  # storages allocated and not written yet
        self.host_scalars: set[int] = set()  # 0-dim tensors made from Python numbers
        self.gathered: dict[int, int] = {}  # storage -> bytes a launch reads of it (declared gathers)
        self.through: dict[int, tuple[int, str]] = {}  # table storage -> (bytes read through it, what)
        self.written: dict[int, int] = {}  # storage -> bytes a launch writes of it, not reading it (declared)
        self.memory: LiveBytes | None = None  # set: the storages made inside are tracked (LiveBytes)
        self.triton_launches = 0
        self._saved: dict = {}

    # --- context -------------------------------------------------------------------------------------

    def __enter__(self):
        for name in HOST_COPIES:
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._host_copy(name, original))
        self._patch_triton()
        self._outer, Recorder.active = Recorder.active, self
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            if name in HOST_COPIES:
                setattr(torch.Tensor, name, original)
        for cls, original in self._saved.get("triton", []):
            cls.run = original
        self._saved.clear()
        Recorder.active = self._outer
        return super().__exit__(*exc)

    def _patch_triton(self) -> None:
        classes = []
        from triton.runtime import jit

        classes.append(jit.JITFunction)
        try:
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        except ImportError:
            pass
        saved = []
        for cls in classes:
            original = cls.run
            saved.append((cls, original))
            cls.run = self._triton_launch(original)
        self._saved["triton"] = saved

    @contextmanager
    def pause(self):
        """Work of the measurement itself (counting the distinct rows an index selects): not the step's."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    @contextmanager
    def tag(self, block: str):
        """Attribute what happens inside to `block`."""
        previous, self.block = self.block, block
        try:
            yield
        finally:
            self.block = previous

    # --- what the model declares ---------------------------------------------------------------------

    def gather(self, t: torch.Tensor, bytes_read: int):
        """Inside, a launch that receives `t` (or a view of it) reads `bytes_read` of it, not all of it."""
        return _declared(self.gathered, t, bytes_read)

    def writes(self, t: torch.Tensor, bytes_written: int):
        """Inside, a launch that receives `t` (or a view of it) writes `bytes_written` of it and reads none."""
        return _declared(self.written, t, bytes_written)

    def read_through(self, table: torch.Tensor, bytes_read: int, what: str) -> None:
        """The next launch that receives `table` reads `bytes_read` through the addresses it holds."""
        self.through[storage_key(table)] = (bytes_read, what)

    def collective(self, op: str, t: torch.Tensor) -> None:
        """A collective over `t` (its payload) issued outside the dispatcher (a stand-in process group), or a
        read of the peers' parts another collective's wait covered (PEER_READS: priced, not counted as one)."""
        if self.recording and not self.paused:
            self.collectives.append({"op": op, "bytes": nbytes(t), "block": self.block})

    # --- recording -----------------------------------------------------------------------------------

    def _where(self) -> list[str]:
        frames = [f"{f.filename[len(ROOT) + 1:]}:{f.lineno}" for f in traceback.extract_stack()
                  if f.filename.startswith(ROOT) and "/.venv/" not in f.filename
                  and not f.filename.endswith(("recorder.py", "gpu_dry_run.py"))]
        return frames[-4:]

    def _sync(self, why: str) -> None:
        if self.recording:
            entry = {"step": self.label, "why": why, "where": self._where(), "block": self.block}
            self.syncs.append(entry)
            self.violations.append(entry)

    def _host_copy(self, name: str, original):
        recorder = self

        def call(t, *args, **kwargs):
            if recorder.paused:
                return original(t, *args, **kwargs)
            recorder._sync(f"a copy to the host (.{name}())")
            if recorder.meta and t.device.type == "meta":
                zeros = torch.zeros(t.shape, dtype=t.dtype)
                return zeros.tolist() if name == "tolist" else zeros.numpy() if name == "numpy" else zeros
            with recorder.pause():
                return original(t, *args, **kwargs)

        return call

    def _triton_launch(self, original):
        recorder = self

        def run(fn, *args, **kwargs):
            if recorder.paused:
                return original(fn, *args, **kwargs)
            tensors = tensor_args(args, kwargs.values())
            name = getattr(getattr(fn, "fn", None), "__qualname__", type(fn).__name__)
            module = getattr(getattr(fn, "fn", None), "__module__", "")
            recorder._launch("triton", f"{module}.{name}", tensors, (), overwritten=())
            if kwargs.get("WAIT"):  # a sum over symmetric memory (parallel/collectives.py SymmSum): this
                # consumer waits for the peers' partials (its first argument) inside the kernel and reads them;
                # a collective, "symm_" of the rank's payload (the cost model prices that exchange)
                recorder.collective("symm_", tensors[0])
            recorder._note_float64(f"{module}.{name}", tensors)
            recorder.triton_launches += 1
            if recorder.meta:
                return None
            with recorder.pause():
                return original(fn, *args, **kwargs)

        return run

    def _launch(self, kind: str, name: str, inputs: list, gathers: tuple, overwritten: tuple,
                results: int = 0) -> None:
        """One launch reading `inputs` (tensors), of which `gathers` (source, elements) are gathers and
        `overwritten` are written, not read; a torch operation writes `results` bytes (its results and
        overwritten arguments)."""
        if not self.recording:
            for t in inputs:
                self.fresh.discard(storage_key(t))
            return
        seen = set()
        total, wrote = 0, results
        weights: dict[str, int] = defaultdict(int)
        skip = {id(t) for t in overwritten}
        gather_src = {id(src): elems for src, elems in gathers}
        for t in inputs:
            key = storage_key(t)
            vk = _view_key(t)
            if vk in seen or key in self.host_scalars:
                continue
            seen.add(vk)
            if id(t) in skip:
                self.fresh.discard(key)
                continue
            if key in self.written:
                wrote += self.written[key]
                self.fresh.discard(key)
                continue
            if key in self.fresh:  # an output: allocated, not written yet
                if kind == "triton":
                    self.fresh.discard(key)
                    wrote += nbytes(t)
                continue
            if key in self.through:
                extra, _ = self.through.pop(key)
                self.extra_reads[self.block] += extra
                total += extra
            if key in self.gathered:
                total += self.gathered[key]
            elif id(t) in gather_src:
                total += gather_src[id(t)] * t.element_size()
            else:
                total += nbytes(t)
                if t.dtype in WEIGHT_DTYPES:
                    fmt, per = WEIGHT_DTYPES[t.dtype]
                    weights[fmt] += t.numel() * per
        self.launches.append(Launch(kind, name, self.block, total, wrote, dict(weights)))

    def _note_float64(self, name: str, tensors: list) -> None:
        if self.recording and any(t.dtype == torch.float64 and storage_key(t) not in self.host_scalars
                                  for t in tensors):
            self.float64.append({"name": name, "block": self.block, "where": self._where()})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.meta:
            if func is aten.equal.default:
                self._sync(HOST_SYNCS[func])
                return True
            if func is aten._local_scalar_dense.default and args[0].device.type == "meta":
                self._sync(HOST_SYNCS[func])
                return 0
        out = func(*args, **kwargs)
        if self.memory is not None:
            self.memory.track(tensor_args((out,)), {storage_key(t) for t in tensor_args(args, kwargs.values())})
        if self.paused or not self.recording:
            return out
        self._classify(func, args, kwargs, out)
        return out

    def _classify(self, func, args, kwargs, out) -> None:
        ins = tensor_args(args, kwargs.values())
        outs = tensor_args((out,))
        if func.namespace in ("c10d", "_c10d_functional"):
            for t in ins:  # outputs of a collective are written by it
                self.fresh.discard(storage_key(t))
            if self.recording:
                self.collectives.append({"op": func.name(), "bytes": sum(nbytes(t) for t in ins[:1]) if ins else 0,
                                         "block": self.block})
            return
        why = HOST_SYNCS.get(func)
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            why = "boolean-mask indexing (shape depends on values)"
        if why:
            self._sync(why)
        if func is aten.lift_fresh.default:
            if args[0].dim() > 0:  # a host-to-device copy of several values: a replay would not redo it
                if self.recording:
                    self.violations.append({"step": self.label, "block": self.block, "where": self._where(),
                                            "why": "a tensor made from host data (torch.tensor(...) of several "
                                                   "values)"})
                self._launch("torch", "host-to-device copy", [], (), (), nbytes(args[0]))
            else:
                self.host_scalars.add(storage_key(args[0]))
            return
        if func in _COPIES and ins and outs:
            src, dst = ins[0].device.type, outs[0].device.type
            if src == "cpu" and dst != "cpu" and ins[0].dim() > 0 and self.recording:
                self.violations.append({"step": self.label, "block": self.block, "where": self._where(),
                                        "why": "a copy from host memory to the device (a CPU tensor moved inside "
                                               "the step)"})
            elif src != "cpu" and dst == "cpu":
                self._sync("a copy to the host (.to('cpu'))")
        if func in _ALLOCATIONS:
            self.fresh.update(storage_key(o) for o in outs)
            return
        if func in _METADATA or func in (aten._local_scalar_dense.default, aten.item.default,
                                         aten.is_nonzero.default, aten.equal.default):
            return
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        in_keys = {storage_key(t) for t in ins}
        if not writes and outs and all(storage_key(o) in in_keys for o in outs):
            return  # a view
        if ins and all(storage_key(t) in self.host_scalars for t in ins) and all(o.dim() == 0 for o in outs):
            self.host_scalars.update(storage_key(o) for o in outs)  # arithmetic on host scalars
            return
        overwritten = ()
        if func in _OVERWRITES and ins:
            overwritten = (args[0],)
        elif "out" in kwargs and isinstance(kwargs["out"], torch.Tensor):
            overwritten = (kwargs["out"],)
        results = sum(nbytes(o) for o in outs if storage_key(o) not in self.written)  # declared: as declared
        if func in _INDEXED_WRITES:  # the values written, not the whole destination
            values = args[_INDEXED_WRITES[func]]
            results = values.numel() * outs[0].element_size() if isinstance(values, torch.Tensor) else 0
        gathers = ()
        if func in _GATHERS and outs:
            src = args[1] if func is aten.embedding.default else args[0]
            gathers = ((src, outs[0].numel()),)
        self._launch("torch", func.name().removeprefix("aten::"), ins, gathers, overwritten, results)
        self._note_float64(func.name().removeprefix("aten::"), ins + outs)
        for o in outs:
            self.fresh.discard(storage_key(o))

    # --- results -------------------------------------------------------------------------------------

    def summary(self) -> dict:
        """Launches, syncs, collectives and bytes, in total and per block (a block's share of what ran)."""
        by_block: dict[str, dict] = defaultdict(lambda: {"launches": 0, "torch": 0, "triton": 0, "bytes_read": 0,
                                                          "bytes_written": 0, "host_syncs": 0, "collectives": 0})
        for la in self.launches:
            b = by_block[la.block]
            b["launches"] += 1
            b[la.kind] += 1
            b["bytes_read"] += la.bytes_read
            b["bytes_written"] += la.bytes_written
        for s in self.syncs:
            by_block[s["block"]]["host_syncs"] += 1
        exchanges = [c for c in self.collectives if c["op"] not in PEER_READS]
        for c in exchanges:
            by_block[c["block"]]["collectives"] += 1
        torch_ops = Counter(la.name for la in self.launches if la.kind == "torch")
        triton = Counter(la.name.rpartition(".")[2] for la in self.launches if la.kind == "triton")
        return {"launches": len(self.launches), "torch_launches": sum(torch_ops.values()),
                "triton_launches": sum(triton.values()), "host_syncs": len(self.syncs),
                "collectives": len(exchanges), "float64_launches": len(self.float64),
                "bytes_read": sum(la.bytes_read for la in self.launches),
                "bytes_written": sum(la.bytes_written for la in self.launches),
                "by_block": dict(by_block), "torch_ops": dict(torch_ops.most_common()),
                "triton_kernels": dict(triton.most_common())}


@contextmanager
def _declared(table: dict[int, int], t: torch.Tensor, n: int):
    """`t`'s storage in `table` with `n` (bytes) while inside."""
    key = storage_key(t)
    table[key] = n
    try:
        yield
    finally:
        table.pop(key, None)


def unique_violations(violations: list[dict]) -> list[dict]:
    """One entry per (step, reason, place), with how often it happened."""
    out: dict[tuple, dict] = {}
    for v in violations:
        key = (v["step"], v["why"], tuple(v["where"]))
        entry = out.setdefault(key, {"step": v["step"], "why": v["why"], "where": v["where"], "count": 0})
        entry["count"] += 1
    return list(out.values())
