"""What can be checked of the GPU path on a machine without a GPU, in its own process
(`python -m tests.gpu_dry_run --arch 90,103`).

1. Every Triton kernel compiles for the CUDA targets. The CPU tests run the kernels under Triton's
   interpreter, which accepts programs the GPU compiler rejects (a helper returning different types from two
   branches) and has no shared-memory limit. Here the interpreter is off and each kernel launch becomes a
   compilation for every target (ptxas ships with Triton; no driver is needed), with the specializations
   that the kernel benchmark's cases at real V4.1 shapes (bf16 and float32 activations, M = 1 and 6), a
   rank of four's split MoE and indexer at those shapes, and the tiny models' fast path launch. The wrappers
   choose tiles and paths by the device (`kernels._triton.capability`: on sm_100 and later the weight
   products take the block-scaled MMA), so the cases run once per target, as that target chooses; a rank of
   four's launches for the last target only (the four-GPU box's B300: the device check's one H100/H200 runs
   none of them; their kernels' code, less the sums over ranks, compiles for every target). The tiny
   models' specializations of a kernel the benchmark cases reach compile for the last target only (the
   B300's sm_103: the same code at smaller blocks; every target saw it at the real shapes), and only where
   their constexprs, block sizes aside (a launch of phases': each phase's), take a path no compiled
   specialization took; those of the kernels only the cycles reach (the fused layer-input kernels) for
   every target. Nothing is executed: outputs are zero-filled allocations, enough to keep the host code
   going (a verify's result says one token was produced).
2. Every decode-cycle step of every tiny family and drafter mode is capturable in a CUDA graph: after the
   warm-up calls a capture would do, a step runs under the product's cycle recorder
   (appliance/measure/recorder.py), which records each operation a capture refuses (a host read of a
   device value, an output whose shape depends on values, a tensor made from host data) with where it
   happened.

3. The fast path's numerics contract and register budget, read from what the compiler produced: no float64
   instruction in any kernel's PTX (an `.f64` opcode: a B300 runs float64 at 1/60 of its float32 rate), and
   ptxas' register and spill counts for every specialization (`ptxas -v` on the PTX, with the flags Triton
   uses), none of which may spill.
   Every kernel launched with programmatic dependent launch (its PDL constexpr, `kernels._triton.pdl`: every
   launch on these targets) waits for the kernel ahead of it (`griddepcontrol.wait`) before its first
   instruction that reads or writes global memory, in the PTX's order, and lets the next one launch.
4. What the weight products issue (tests/sass.py): for every specialization of a kernel that streams FP8 or
   FP4 weights (WEIGHT_LOOPS), the lane-instructions its main loop issues per weight element and the MMA
   kinds it uses, per target; the worst of each kernel, format, numerics and target is reported (`issue`),
   and one over ISSUE_BUDGET (without a block-scaled MMA on sm_100/103) fails. Where the rows are quantized
   into memory before the main loop (the e4m3 MMA's `stage_codes`), that loop's issue per weight element is
   reported beside it (and priced by the cost model), not budgeted: the budget is the main loop's.

It prints one JSON object (compilations per target, per kernel and target its specializations, most
registers, most spilled bytes and float64 instructions, kernels never launched, failures, capture
violations); exit status 1 when anything failed.
"""

import os

os.environ["TRITON_INTERPRET"] = "0"  # before Triton is imported: kernels are compiled, not interpreted

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import inspect  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime import jit  # noqa: E402

from kernels._triton import is_long  # noqa: E402
from kernels.rows import STAGE_TILES  # noqa: E402
from tests import sass  # noqa: E402
from tests.ptx import pdl_order  # noqa: E402

SHARED_LIMIT = 227 * 1024  # per block, opt-in maximum on sm_90 and sm_100/103

# Spills allowed, with their bound (bytes, any specialization and target): none; a kernel that spills fails
KNOWN_SPILLS: dict[str, int] = {}
# A kernel that streams FP8/FP4 weights: the constexprs naming the weight tile its main loop consumes (rows,
# K), its weight format, its activation block (0: --numerics plain, no quantized rows), and what says its
# weight rows are 16-byte aligned (an argument Triton found aligned, or a constexpr of 16), and how many weight
# products one staging of the rows' codes serves (the e4m3 MMA's `stage_codes`: gate and up share theirs)
WeightLoop = collections.namedtuple("WeightLoop", "rows depth fmt act aligned shares")
WEIGHT_LOOPS = {"kernels.linear._kernel": WeightLoop("BN", "BK", "FMT0", "ACT0", "w0", 1),
                "kernels.moe._gate_up_kernel": WeightLoop("BN", "BK", "FMT", "ACT_BLOCK", "W_ALIGN", 2),
                "kernels.moe._down_kernel": WeightLoop("BN", "BK", "FMT", "ACT_BLOCK", "W_ALIGN", 1),
                "kernels.engram._layer_kernel": WeightLoop("BN", "BK", "FMT", "ACT_BLOCK", "w_ptr", 1)}
# A launch of phases (kernels/phases.py) takes each phase's constexprs as a tuple in its program's parameter
# order (`in_order`): each such argument's program, whose parameter names read the tuple back
PHASES = {"kernels.moe._step_kernel": {"RC": "kernels.router.route_program", "UC": "kernels.moe.gate_up_program",
                                       "DC": "kernels.moe.down_program"}}
# Its weight loops are read with those of the phase named (a decode step's MoE: gate and up's, whose tile and
# format the down phase shares), its main loop the largest on the weights' MMA where one multiplies in the
# checkpoint's formats (the router's bfloat16 product of float32 rows, three MMAs a step, can be larger)
PHASED_LOOPS = {"kernels.moe._step_kernel": ("UC", WeightLoop("BN", "BK", "FMT", "ACT_BLOCK", "W_ALIGN", 2))}
WEIGHT_FORMATS = {1: "fp8", 2: "fp4"}  # kernels/linear.py's FMT codes (0: dense weights, not budgeted)
# Lane-instructions per FP8/FP4 weight element the main loop may issue with the served numerics (official:
# quantized rows): what the GPU issues while the weights stream in at its full bandwidth (B300: 148 SMs x 4
# schedulers x 32 lanes x ~1.9 GHz over 8 TB/s of 0.5-byte FP4 elements, about 2.4; an H200 issues 132 x 4 x
# 32 x 1.98 GHz over 4.8 TB/s of 1-byte FP8 elements, about 7, of which half is left for the product). On
# sm_100/103 a block-scaled MMA (the checkpoint's formats on the tensor cores) meets it as well.
# --numerics plain (exact products of float32 rows, the transformers oracle's configuration) is reported,
# not budgeted.
ISSUE_BUDGET = {90: 3.5, 100: 2.5, 103: 2.5}
# On sm_90 (no block-scaled MMA) the e4m3 MMA takes one product per 32 columns (V4.1's 32x32 scale blocks,
# FP4's 32) and scales each in float32 (2 instructions per output and block at 8 rows: 0.5 an element); FP4's
# re-encoding costs 0.9; the rows' quantization, staged once per program before the main loop, 0.1-0.25.
_F64 = re.compile(r"^\s*(@!?%\w+\s+)?[a-z][\w.]*\.f64\b")  # an instruction (not a .reg declaration) on float64
# a kernel's block sizes (BM, BN, BHC, BLOCK, ...; not flags such as BY_POSITION): the tiny models' cycles
# compile a kernel again only for other constexprs than these (the code paths the device check's tiny runs take)
BLOCK_SIZE = re.compile(r"B[A-Z0-9]*$")
_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def phase_constexprs(name: str, key: str, values: tuple) -> dict:
    """A launch of phases' constexpr argument `key` (one phase's tuple) by its program's parameter names."""
    module, _, fn = PHASES[name][key].rpartition(".")
    params = [p.name for p in getattr(sys.modules[module], fn).params if p.is_constexpr]
    return dict(zip(params, values, strict=True))


def path_constexprs(name: str, named: dict) -> list[tuple]:
    """A launch's constexprs less its block sizes (a phase's, inside its tuple, too): its code path."""
    pairs = []
    for key, value in named.items():
        if key in PHASES.get(name, {}):
            pairs += [(f"{key}.{p}", v) for p, v in phase_constexprs(name, key, value).items()
                      if not BLOCK_SIZE.match(p)]
        elif not BLOCK_SIZE.match(key):
            pairs.append((key, value))
    return sorted(pairs)


def f64_instructions(ptx: str) -> int:
    """PTX instructions whose opcode names the .f64 type (arithmetic, conversions, loads and moves of it)."""
    return sum(1 for line in ptx.splitlines() if _F64.match(line))


class Ptxas:
    """ptxas -v's (registers, spilled bytes) of a kernel's PTX, cached by the PTX's hash: read from the log of
    Triton's own ptxas run when it compiled the kernel (`learn`), or from ptxas -v run here with Triton's
    flags for a kernel that came from Triton's cache without a log."""

    def __init__(self):
        self.path = os.path.join(triton.knobs.cache.dir, "ptxas-v.json")
        try:
            with open(self.path) as f:
                self.cache = json.load(f)
        except (OSError, ValueError):
            self.cache = {}

    def __call__(self, ptx: str, arch: int, fp_fusion: bool) -> tuple[int, int]:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        key = self._key(ptx, arch, fp_fusion)
        if key not in self.cache:
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "k.ptx")
                with open(src, "w") as f:
                    f.write(ptx)
                cmd = [get_ptxas(arch).path, "-v", *([] if fp_fusion else ["--fmad=false"]), "--regAllocOptLevel=2",
                       f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.cubin")]
                log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
            self.learn(ptx, arch, fp_fusion, log)
        return tuple(self.cache[key])

    def learn(self, ptx: str, arch: int, fp_fusion: bool, log: str) -> None:
        regs = max((int(r) for r in _REGS.findall(log)), default=0)
        spill = max((int(a) + int(b) for a, b in _SPILLS.findall(log)), default=0)
        self.cache[self._key(ptx, arch, fp_fusion)] = [regs, spill]

    @staticmethod
    def _key(ptx: str, arch: int, fp_fusion: bool) -> str:
        return hashlib.sha256(f"{arch} {fp_fusion}\n{ptx}".encode()).hexdigest()

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.cache, f)


class Compiler:
    """Stands in for JITFunction.run: compiles each new specialization for every target, launches nothing;
    reads each compiled kernel's float64 instructions, registers and spills."""

    def __init__(self, archs: list[int]):
        self.targets = [GPUTarget("cuda", a, 32) for a in archs]
        self.done: dict[tuple, float] = {}  # (kernel, arch, signature, constexprs) -> seconds
        self.seen: set[tuple] = set()  # (kernel, arch, Triton's specialization key) of every launch so far
        # (kernel, arch) -> (backend, binder, key cache): Triton makes its binder with exec, once per kernel
        # and device; made per launch it costs more than the tiny models' cycles themselves
        self.binders: dict[tuple, tuple] = {}
        # kernels whose further specializations compile for the last target only (set after the benchmark
        # cases: their real shapes were compiled for every target; the tiny models' smaller blocks of the
        # same code need compiling once, for the B300), and then only where they take code paths no compiled
        # specialization took: (kernel, arch, signature, constexprs less block sizes) of every compilation
        self.last_target_only: set[str] = set()
        self.paths: set[tuple] = set()
        self.failures: list[dict] = []
        self.shared = 0  # the most shared memory any compiled kernel asks for, in bytes
        self.ptxas = Ptxas()
        # arch -> kernel -> {"specializations", "registers" (most), "spill_bytes" (most), "f64_instructions"}
        self.resources: dict[int, dict[str, dict]] = {a: {} for a in archs}
        # arch -> "kernel format" -> the worst main loop: lane-instructions per weight element, its MMA kinds
        self.issue: dict[int, dict[str, dict]] = {a: {} for a in archs}
        self.unaligned = {a: 0 for a in archs}  # weight-streaming specializations with unaligned weights

    def __call__(self, fn: jit.JITFunction, *args, grid, warmup, **kwargs):
        name = f"{fn.fn.__module__}.{fn.fn.__name__}"
        for target in self.targets[-1:] if name in self.last_target_only else self.targets:
            if (name, target.arch) not in self.binders:
                backend = make_backend(target)
                binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
                self.binders[name, target.arch] = backend, binder, {}
            backend, binder, key_cache = self.binders[name, target.arch]
            bound, spec, options = binder(*args, **kwargs)
            seen = (name, target.arch, jit.compute_cache_key(key_cache, spec, options))  # JITFunction.run's key
            if seen in self.seen:
                continue
            self.seen.add(seen)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            # one compilation per signature and constexprs: launches that differ only in a pointer's or
            # stride's alignment compile to the same arithmetic and registers, give or take a vector width;
            # that width is what a weight-streaming kernel's issue is about, so there alignments count too
            aligned = {fn.arg_names[a[0]] for a, v in attrs.items() if ["tt.divisibility", 16] in v}
            key = (name, target.arch, repr(signature), repr(sorted(constexprs.items())),
                   repr(sorted(aligned)) if name in WEIGHT_LOOPS else "")
            named = {fn.arg_names[c[0]] if isinstance(c, tuple) else c: v for c, v in constexprs.items()}
            path = (name, target.arch, repr(signature), repr(path_constexprs(name, named)))
            if key in self.done or (name in self.last_target_only and path in self.paths):
                continue
            self.paths.add(path)
            t = time.perf_counter()
            try:
                log = io.StringIO()  # Triton prints its ptxas -v log: one ptxas run per compilation, not two
                with contextlib.redirect_stdout(log):
                    k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                       options=options.__dict__)
                if _REGS.search(log.getvalue()):
                    self.ptxas.learn(k.asm["ptx"], target.arch, options.enable_fp_fusion, log.getvalue())
                if k.metadata.shared > SHARED_LIMIT:  # a launch would fail with OutOfResources
                    self.failures.append({"kernel": name, "arch": target.arch, "error":
                                          f"{k.metadata.shared} bytes of shared memory > {SHARED_LIMIT} "
                                          f"(constexprs {sorted(constexprs.items())})"})
                self.shared = max(self.shared, k.metadata.shared)
                self.check_resources(name, target.arch, k, options, named)
                self.measure_issue(name, target.arch, k, named, aligned)
            except Exception as e:  # the compiler's message is the finding
                self.failures.append({"kernel": name, "arch": target.arch, "error": str(e)[-2000:]})
            self.done[key] = time.perf_counter() - t
            r = self.resources[target.arch].get(name)
            if r is not None:
                r["seconds"] = round(r.get("seconds", 0) + self.done[key], 1)

    def check_resources(self, name: str, arch: int, k, options, constexprs) -> None:
        ptx = k.asm["ptx"]
        f64 = f64_instructions(ptx)
        regs, spill = self.ptxas(ptx, arch, options.enable_fp_fusion)
        r = self.resources[arch].setdefault(name, {"specializations": 0, "registers": 0, "spill_bytes": 0,
                                                   "f64_instructions": 0})
        r["specializations"] += 1
        r["registers"] = max(r["registers"], regs)
        r["spill_bytes"] = max(r["spill_bytes"], spill)
        r["f64_instructions"] += f64
        where = f"(constexprs {sorted((n, v) for n, v in constexprs.items() if not isinstance(v, int) or v < 1 << 20)})"
        if f64:
            self.failures.append({"kernel": name, "arch": arch, "error": f"{f64} float64 instructions in the PTX "
                                  f"{where}: the fast path accumulates in float32"})
        order = "launched without programmatic dependent launch" if not constexprs.get("PDL") else (
            pdl_order(ptx) if getattr(k.metadata, "launch_pdl", False) else "PDL without Triton's launch_pdl")
        r["pdl"] = r.get("pdl", 0) + (order is None)
        if order is not None:
            self.failures.append({"kernel": name, "arch": arch, "error": f"{order} {where}"})
        if spill > KNOWN_SPILLS.get(name, 0):
            self.failures.append({"kernel": name, "arch": arch, "error": f"ptxas spills {spill} bytes ({regs} "
                                  f"registers) {where}: choose smaller blocks"})


    def measure_issue(self, name: str, arch: int, k, constexprs: dict, aligned: set[str]) -> None:
        """The main loop's lane-instructions per weight element of a weight-streaming kernel (tests/sass.py),
        for weights 16-byte aligned as a device allocation is (an unaligned view, as the CPU's memory-mapped
        tiny checkpoints give, loads byte by byte: a different program, counted apart); the worst of each
        kernel, format, numerics and target is kept (with its staging loop's, `sass.staging_loop`), and one over
        its budget (official numerics) is a failure unless it multiplies on a block-scaled MMA."""
        if name in PHASED_LOOPS:
            key, spec = PHASED_LOOPS[name]
            constexprs = phase_constexprs(name, key, constexprs[key])
        elif name in WEIGHT_LOOPS:
            spec = WEIGHT_LOOPS[name]
        else:
            return
        rows, depth, fmt, act = (constexprs[c] for c in (spec.rows, spec.depth, spec.fmt, spec.act))
        if fmt not in WEIGHT_FORMATS:
            return
        if spec.aligned not in aligned and constexprs.get(spec.aligned) != 16:
            self.unaligned[arch] += 1
            return
        code = sass.disassemble(k.asm["cubin"])
        loop = sass.main_loop(code, native_first=name in PHASED_LOOPS)
        if loop is None:
            self.failures.append({"kernel": name, "arch": arch, "error": "no main loop with an MMA in its SASS"})
            return
        ipe = round(sass.per_element(loop, k.metadata.num_warps, rows, depth), 2)
        staging = sass.staging_loop(code)  # one pass quantizes STAGE_TILES K tiles for `shares` products
        staged = 0.0 if staging is None else round(sass.per_element(
            staging, k.metadata.num_warps, rows, depth * STAGE_TILES.value * spec.shares), 2)
        kernel = f"{name.removeprefix('kernels.')} {WEIGHT_FORMATS[fmt]}"
        long = is_long(constexprs.get("BM", 0))
        key = f"{kernel} {'official' if act else 'plain'}{' long' if long else ''}"
        worst = self.issue[arch].get(key)
        if worst is None or ipe > worst["per_element"]:
            self.issue[arch][key] = {"per_element": ipe, "staging_per_element": staged,
                                     "instructions": loop.instructions,
                                     "warps": k.metadata.num_warps, "tile": [rows, depth], "mma": list(loop.mma),
                                     "native_mma": loop.native}
        budget = ISSUE_BUDGET.get(arch)
        # a long call's loop serves 32-128 rows a pass: priced per pass, not held to the streaming budget
        if not act or long or budget is None or ipe <= budget or (arch >= 100 and loop.native):
            return
        shown = sorted((n, v) for n, v in constexprs.items() if not isinstance(v, int) or v < 1 << 20)
        self.failures.append({"kernel": name, "arch": arch, "error": (
            f"{ipe} lane-instructions per {WEIGHT_FORMATS[fmt]} weight element in the main loop "
            f"({loop.instructions} instructions x {k.metadata.num_warps} warps over a {rows}x{depth} tile, MMA "
            f"{list(loop.mma)}) > the budget {budget} (constexprs {shown})")})


def kernel_names() -> set[str]:
    """Every kernel of kernels/: the functions decorated `@triton.jit` (helpers called from kernels are
    `@device_function`s and compile as part of them)."""
    names = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("kernels."):
            continue
        for v in vars(mod).values():
            if (isinstance(v, jit.JITFunction) and v.fn.__module__ == name
                    and inspect.getsource(v.fn).lstrip().startswith("@triton.jit")):
                names.add(f"{name}.{v.fn.__name__}")
    return names


def drive_benchmark_cases(failures: list):
    from kernels import bench

    shapes = dataclasses.replace(bench.V41, experts=8, index_rows=8192, engram_rows=4096)
    for dt in (torch.bfloat16, torch.float32):
        for m in (1, 6):
            for case in bench.BENCHES:
                try:
                    case(shapes, m, torch.device("cpu"), dt, 1, False)
                except Exception:
                    failures.append({"case": f"{case.__name__} {dt} M={m}", "error": traceback.format_exc()[-2000:]})


def drive_long_calls(failures: list):
    """A prefill chunk's weight products (kernels._triton.long_calls: programs of LONG_ROWS rows on the rows
    staged once, rows.stage_launch) at V4.1 shapes: the linear, MoE and Engram benchmark cases at 256 rows."""
    import kernels._triton as kt
    from kernels import bench

    shapes = dataclasses.replace(bench.V41, experts=8)
    with kt.long_calls():
        for case in (bench._bench_linear, bench._bench_moe, bench._bench_engram):
            try:
                case(shapes, 256, torch.device("cpu"), torch.bfloat16, 1, False)
            except Exception:
                failures.append({"case": f"{case.__name__} long call", "error": traceback.format_exc()[-2000:]})
    # wo_a: a plain FP8 product (no activation quantization) of bfloat16 rows, from registers, a rank's two
    # groups of V4.1's eight, short and long
    from kernels import linear

    w = bench.fp8_weight(2 * 1024, 4096, (shapes.block,) * 2, torch.device("cpu"))
    for m, long in ((1, False), (6, False), (256, True)):
        try:
            with kt.long_calls() if long else contextlib.nullcontext():
                linear.fast(torch.randn(m, 2 * 4096).to(torch.bfloat16), w, None, torch.bfloat16, groups=2)
        except Exception:
            failures.append({"case": f"wo_a M={m}", "error": traceback.format_exc()[-2000:]})


def drive_split_specializations(failures: list):
    """What a rank of four launches that one device does not, at V4.1 shapes: the MoE with a quarter of
    the experts and of the shared expert's intermediate (its partial left unrounded, rounded in the combine),
    its four ranks' rows added by the combine, the attention's by the mHC expand; an Engram layer's product
    of a quarter of wkv's rows and its gates over four ranks' columns; the one-launch sum over four ranks (a
    symmetric sum's pieces, `bench collectives`); the samplers of a cycle's logits held by columns; each
    gathered and over symmetric memory (the publish launch, the consumers' in-kernel waits). The gathers are
    stand-ins: nothing runs."""
    import kernels._triton as kt
    from kernels import bench, engram, linear, mhc, moe, rank_sum, sampling

    s = dataclasses.replace(bench.V41, experts=8)
    quarter = s.inter // 4
    experts = [None] * 6 + [(bench.fp4_weight(s.inter, s.dim), bench.fp4_weight(s.dim, s.inter),
                             bench.fp4_weight(s.inter, s.dim))] * 2
    shared = (bench.fp8_weight(quarter, s.dim, (s.block,) * 2), bench.fp8_weight(s.dim, quarter, (s.block,) * 2),
              bench.fp8_weight(quarter, s.dim, (s.block,) * 2))
    gate = bench.dense_weight(s.experts, s.dim)
    def four(t, consume):  # four ranks' partials, added in the consumer
        return consume([t] * 4)

    def to(n: int) -> rank_sum.Publish:  # rank 1 of 4's symmetric buffer and every rank's flags
        return rank_sum.Publish(torch.empty(rank_sum.SLOTS * n), [torch.zeros(5, dtype=torch.long)] * 4, 1)

    def published(t, consume):  # ... over symmetric memory: rank 1's publish, the consumer waits in its kernel
        into = to(t.numel())
        rank_sum.publish(t, into)
        return consume(rank_sum.Partials([t] * 4, into))

    def four_produced(shape, produce, consume):
        return four(produce(None), consume)

    def produced(shape, produce, consume):  # ... the producer's kernel publishing its partial itself
        into = to(math.prod(shape))
        produce(into)
        return consume(rank_sum.Partials([torch.empty(shape)] * 4, into))

    # appliance/parallel/sharding.py's ExpertReduce, for decode steps' calls (a long call's sum by rows is
    # torch and the same combine kernel)
    split = types.SimpleNamespace(sum_produced=four_produced, shared_split=True, share=lambda rows: None)
    split_symm = types.SimpleNamespace(sum_produced=produced, shared_split=True, share=lambda rows: None)
    # a long call's (a prefill chunk's) sums by rows: its pairs kept in x's dtype, the shared partials apart
    # (a rank holds its share's streams)
    whole = (bench.fp8_weight(s.inter, s.dim, (s.block,) * 2), bench.fp8_weight(s.dim, s.inter, (s.block,) * 2),
             bench.fp8_weight(s.inter, s.dim, (s.block,) * 2))  # the shared expert whole, for the share's rows
    shares = types.SimpleNamespace(shared_split=True, world=4,
                                   share=lambda rows: (rows // 4, 0, rows // 4), exchange=lambda t: t,
                                   whole_shared=whole)
    try:
        with kt.long_calls():
            m = 256
            moe.fast_ffn(torch.randn(m, s.dim).bfloat16(), gate, torch.zeros(s.experts), s.top_k, "sqrtsoftplus", 1.5,
                         1e-20, None, experts, shared, s.block, 10.0, True, torch.randn(m // 4, 4, s.dim).bfloat16(),
                         torch.rand(m // 4, 4), torch.rand(m // 4, 4, 4), reduce=shares)
    except Exception:
        failures.append({"case": "a long call's sums by rows", "error": traceback.format_exc()[-2000:]})
    site = (torch.randn(24, 4 * s.dim), torch.randn(24), torch.rand(3))  # an mHC site's fn, base, scale (hc 4)
    # an Engram layer's wkv split by outputs (parallel/sharding.py EngramSplit, rank 1 of 4): its columns of
    # the product gathered, or published by the product's launch and waited for by the gates'
    cols = (s.engram_ngram - 1) * s.engram_heads
    wkv = bench.fp8_weight(5 * s.dim, cols * s.engram_dim, (s.block,) * 2)
    width = -(-5 * s.dim // s.block // 4) * s.block
    rows = wkv.rows(width, 2 * width)
    engram_splits = [types.SimpleNamespace(width=width, weight=rows, gather_produced=g) for g in (four_produced,
                                                                                                  produced)]
    for dt in (torch.bfloat16, torch.float32):
        for m in (1, 6):
            try:
                codes = torch.randint(0, 120, (m, cols, s.engram_dim), dtype=torch.uint8).view(torch.float8_e4m3fn)
                scales = torch.randint(120, 130, (m, cols, s.engram_dim // 32), dtype=torch.uint8)
                for es in engram_splits:
                    engram.fast_layer(torch.randn(m, 4, s.dim).to(dt), codes, scales, wkv, s.block,
                                      torch.randn(4, s.dim), 1e-20, split=es)
            except Exception:
                failures.append({"case": f"Engram split over four ranks {dt} M={m}",
                                 "error": traceback.format_exc()[-2000:]})
            try:
                x, X = torch.randn(m, s.dim).to(dt), torch.randn(m, 4, s.dim).to(dt)
                for reduce, sum_into in ((split, four), (split_symm, published)):
                    moe.fast_ffn(x, gate, torch.zeros(s.experts), s.top_k, "sqrtsoftplus", 1.5, 1e-20, None, experts,
                                 shared, s.block, 10.0, True, X, torch.rand(m, 4), torch.rand(m, 4, 4), reduce=reduce)
                    y = torch.randn(m, s.dim)
                    post, comb = torch.rand(m, 4), torch.rand(m, 4, 4)
                    # a product published as the attention's output product is (RowParallel.into)
                    linear.fast(x, shared[0], s.block, torch.float32, publish=to(m * quarter))
                    sum_into(y, lambda parts, X=X, post=post, comb=comb: mhc.fast_expand_pre(
                        parts, X, post, comb, None, *site, 1e-20, 1e-6, 20, torch.rand(s.dim), 1e-6))
                    sum_into(y, lambda parts, dt=dt: rank_sum.fast(parts, dt))
            except Exception:
                failures.append({"case": f"split over four ranks {dt} M={m}", "error": traceback.format_exc()[-2000:]})
    # a cycle's logits left where the ranks hold them (kernels/sampling.py SplitLogits, rank 1 of 4): gathered,
    # or published by the head's product and waited for in the samplers' launches (sample, the Markov step
    # with its base gathered or published through an exchange of its own, accept),
    # at V4.1's vocabulary and the tiny models'
    params, key, f = torch.rand(3), torch.zeros(2, dtype=torch.long), torch.tensor(-1)
    for vocab in (s.vocab, 512):
        cols = vocab // 4
        for m in (2, 4):
            gathered = sampling.SplitLogits([torch.randn(m, cols)] * 4)
            into, later = to(m * cols), to(m * cols)
            for buffer in (into, later):
                linear.fast(torch.randn(m, s.dim).bfloat16(), bench.dense_weight(cols, s.dim), None, torch.float32,
                            publish=buffer)
            published = sampling.SplitLogits(rank_sum.Partials([torch.empty(m, cols)] * 4, into))
            base = sampling.SplitLogits(rank_sum.Partials([torch.empty(m, cols)] * 4, later))
            for logits in (gathered, published):
                try:
                    sampling.fast_sample(logits[-1:], params, key)
                    sampling.fast_sample_sum(base[:1] if logits is published else gathered[:1], logits[-1:],
                                             params, key, torch.empty(1, dtype=torch.long), torch.empty(1, vocab))
                    sampling.fast_accept(logits, torch.zeros(m - 1, dtype=torch.long), torch.randn(m - 1, vocab),
                                         params, key, f)
                except Exception:
                    failures.append({"case": f"samplers of logits over four ranks V={vocab} M={m}",
                                     "error": traceback.format_exc()[-2000:]})


def drive_cycles(failures: list, violations: list):
    """Generate with every family and drafter mode on the fast path, each cycle step run as a capture
    would: twice to warm up, then under the guard (and under it again for every later replay)."""
    import graphs.runner
    from appliance.api import Request
    from appliance.cli.tiny_checkpoint import write_tiny
    from appliance.decode.loop import RequestLoop
    from appliance.decode.session import DecodeSession
    from appliance.decode.speculator import Speculator
    from appliance.loader import load_model
    from appliance.measure.recorder import Recorder
    from appliance.options import RunOptions

    class CheckedRunner:
        def __init__(self, step, device, graphs=True, pool=None, check_inputs=False):
            self.step, self.name = step, type(step).__name__
            step()
            step()
            self.run()

        def run(self):
            with Recorder(label=self.name) as rec:
                out = self.step()
            violations.extend(rec.violations)
            return out

    graphs.runner.make_runner = CheckedRunner
    # --draft adaptive times each verify width at load: once per width reaches every specialization (the
    # timings mean nothing here)
    calibrate = Speculator.calibrate
    Speculator.calibrate = lambda self, model, repeats=5: calibrate(self, model, repeats=1)
    root = tempfile.mkdtemp()
    for family, draft in (("deepseek_v41", "none"), ("deepseek_v41", "dspark"), ("deepseek_v41", "adaptive"),
                          ("deepseek_v4", "mtp"), ("deepseek_v4_0731", "dspark")):
        try:
            model_dir = write_tiny(os.path.join(root, family), family)
            options = RunOptions(model_dir=model_dir, dtype="bfloat16", path="fast", draft=draft, draft_tokens=3)
            lm = load_model(options, notice=None)
            session = DecodeSession(lm, options, capacity=512, reach_floor=128)  # makes every step now
            gen = RequestLoop(session, lm.tokenizer)
            for _ in gen.run(Request(input_ids=list(range(3, 43)), max_tokens=8, ignore_eos=True)):
                pass
        except Exception:
            failures.append({"case": f"{family} --draft {draft}", "error": traceback.format_exc()[-2000:]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90,103", help="compute capabilities, e.g. 90 (H100/H200), 103 (B300); "
                    "the last is the one the tiny models' further specializations compile for")
    archs = [int(a) for a in ap.parse_args().arch.split(",")]
    compiler = Compiler(archs)
    triton.knobs.nvidia.dump_ptxas_log = True  # read by Compiler: each compilation's registers and spills

    def run(fn, *a, grid, warmup, **k):
        compiler(fn, *a, grid=grid, warmup=warmup, **k)
        if fn.fn.__name__ == "_accept_kernel":  # the one output the host reads to go on: a verify's result,
            a[fn.arg_names.index("out_ptr")][0] = 1  # whose count of tokens produced is at least one (zeros
            # elsewhere: `torch.empty` below)

    jit.JITFunction.run = run

    import kernels._triton as kt
    import kernels.registry  # noqa: F401  (every kernel module, bound to the helpers patched below)
    from appliance.measure.recorder import unique_violations

    kt.ready = lambda: None  # the fast path resolves although nothing can run here
    from kernels import bench
    bench._copies = lambda nbytes, tiny: 1  # no rotation: nothing is timed
    # nothing reads a weight's values here: one weight of a shape serves every case and target (8 experts
    # share 3; made anew, the random weights took a tenth of the check)
    for name in ("fp4_weight", "fp8_weight", "dense_weight"):
        setattr(bench, name, functools.lru_cache(maxsize=None)(getattr(bench, name)))
    for mod in [m for n, m in sys.modules.items() if n.startswith("kernels.")]:
        if hasattr(mod, "device_of"):  # CPU tensors are fine: nothing is launched
            mod.device_of = lambda *ts: next(t.device for t in ts if t is not None)
    torch.empty = torch.zeros  # kernel outputs stay as allocated: zeros keep indices in range
    failures = compiler.failures
    t = time.perf_counter()
    targets = compiler.targets
    for target in targets:  # the wrappers choose tiles and paths by the device: each target's own choices
        compiler.targets = [target]
        kt.capability = lambda dev, arch=target.arch: arch
        drive_benchmark_cases(failures)
        if target is targets[-1]:  # the four-GPU box's (B300's): the device check's one GPU runs none of them
            drive_split_specializations(failures)
        drive_long_calls(failures)
    compiler.targets = targets
    phases = {"benchmark cases": [len(compiler.done), round(time.perf_counter() - t, 1)]}
    compiler.last_target_only = {k[0] for k in compiler.done}
    t = time.perf_counter()
    violations: list[dict] = []
    drive_cycles(failures, violations)  # as the last target chooses
    phases["tiny models' cycles"] = [len(compiler.done) - phases["benchmark cases"][0],
                                     round(time.perf_counter() - t, 1)]
    compiler.ptxas.save()
    missing = sorted(kernel_names() - {k[0] for k in compiler.done})
    print(json.dumps({"archs": archs, "compilations": len(compiler.done),
                      "seconds": round(sum(compiler.done.values()), 1),
                      "max_shared_bytes": compiler.shared, "phases (compilations, s)": phases,
                      "kernels": {a: dict(sorted(r.items())) for a, r in compiler.resources.items()},
                      "issue": {a: dict(sorted(r.items())) for a, r in compiler.issue.items()},
                      "issue_unaligned_specializations": compiler.unaligned,
                      "never_launched": missing, "failures": failures,
                      "capture_violations": unique_violations(violations)}, indent=1))
    print(table(compiler.resources), file=sys.stderr)
    print(issue_table(compiler.issue), file=sys.stderr)
    return 1 if failures or missing or violations else 0


def table(resources: dict[int, dict[str, dict]]) -> str:
    """Per kernel and target: specializations compiled, most registers, most spilled bytes, float64
    instructions."""
    archs = sorted(resources)
    names = sorted({n for r in resources.values() for n in r})
    head = f"{'kernel':<34}" + "".join(f" | sm_{a}: spec regs spill f64" for a in archs)
    lines = [head, "-" * len(head)]
    for n in names:
        cells = []
        for a in archs:
            r = resources[a].get(n)
            cells.append(" | " + (f"{'':6}{r['specializations']:4d} {r['registers']:4d} {r['spill_bytes']:5d} "
                                  f"{r['f64_instructions']:3d}" if r else f"{'-':>29}"))
        lines.append(f"{n.removeprefix('kernels.'):<34}" + "".join(cells))
    return "\n".join(lines)


def _staging(cell: dict) -> str:
    return f"(+{cell['staging_per_element']:.2f})" if cell["staging_per_element"] else ""


def issue_table(issue: dict[int, dict[str, dict]]) -> str:
    """Per weight-streaming kernel, format and numerics: the worst main loop's lane-instructions per weight
    element (and the rows' staging before it, where there is one) and MMA kinds, per target, against the budget
    (official numerics)."""
    head = "".join(f" | sm_{a} (budget {ISSUE_BUDGET.get(a)}): per element (+staging), MMA" for a in sorted(issue))
    lines = [f"{'kernel, weights, numerics':<36}{head}"]
    for key in sorted({k for r in issue.values() for k in r}):
        cells = [issue[a].get(key) for a in sorted(issue)]
        lines.append(f"{key:<36}" + "".join(f" | {c['per_element']:>6.2f} {_staging(c):7} {','.join(c['mma']):<26}"
                                            if c else " | -" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
