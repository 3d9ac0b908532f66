"""What a compiled kernel's main loop issues, read from its SASS (the cubin disassembled by the nvdisasm Triton
ships): the instructions of the loop that holds the matrix-multiply instructions, and which MMA kinds those
are. The compile check (tests/gpu_dry_run.py) divides them by the weight elements one pass of that loop
consumes: instructions issued per weight element, the number a memory-bound decode kernel must keep below
what the GPU can issue while its weights stream in at full bandwidth.

Counting. nvdisasm writes one instruction a line (an address comment, an optional predicate, the opcode) and
the branch targets as labels. A loop is the instructions from a label to a branch back to it; the main
loop is the largest innermost loop that holds an MMA (an outer loop over pairs or splits holds the K loop
once, not per pass; Triton's software pipelining peels prologue and epilogue copies of the K loop, and the
steady-state body is the largest). Every warp of the program runs the loop, and an
instruction works on 32 lanes, so one pass issues `instructions x warps x 32` lane-instructions for the
`rows x K` weight elements of its tile: the unit a GPU's issue rate is quoted in (lanes x schedulers x
clock).
"""

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:\{\s*)?(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b[^`]*`?\(?(\.L_x_\d+)")
# matrix-multiply opcodes: Ampere/Hopper HMMA (mma.sync), Hopper's wgmma HGMMA (bf16/f16) and QGMMA (e4m3/e5m2,
# no block scales), Blackwell's tcgen05 UTC*MMA (UTCHMMA: bf16/f16; UTCQMMA: fp8/fp6/fp4 with or without
# block scales; UTCOMMA: mxfp4), QMMA/OMMA
_MMA = re.compile(r"^(HMMA|HGMMA|QGMMA|QMMA|OMMA|IMMA|UTC[A-Z]*MMA)")
# float32 -> e4m3 conversions (cvt.rn.satfinite.e4m3x2.f32)
_E4M3_CVT = re.compile(r"^F2FP\.SATFINITE\.E4M3")
# MMA kinds that multiply the checkpoint's own formats with their block scales (e4m3 / e2m1 and E8M0 bytes)
NATIVE_MMA = ("UTCQMMA", "UTCOMMA", "QMMA", "OMMA")


@dataclass(frozen=True)
class Loop:
    instructions: int
    mma: tuple[str, ...]  # the MMA opcodes in it (with their modifiers), sorted
    stages_codes: bool = False  # converts to e4m3 and stores to memory, without an MMA: rows' quantization

    @property
    def native(self) -> bool:
        return any(m.startswith(NATIVE_MMA) for m in self.mma)


def instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """(each instruction's opcode with modifiers, label -> index of the instruction it precedes)."""
    ops, labels = [], {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = _INSTRUCTION.match(line)
        if m:
            ops.append((m.group(1), line))
    return ops, labels


def loops(sass: str) -> list[Loop]:
    """Every innermost loop (a branch back to an earlier label, with no other loop inside), with its
    instruction count and MMA opcodes."""
    ops, labels = instructions(sass)
    spans = []
    for j, (op, line) in enumerate(ops):
        if not op.startswith("BRA"):
            continue
        b = _BRANCH.search(line)
        if b and b.group(1) in labels and labels[b.group(1)] <= j:
            spans.append((labels[b.group(1)], j))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    out = []
    for a, b in inner:
        body = [o for o, _ in ops[a: b + 1]]
        mma = tuple(sorted({o for o in body if _MMA.match(o)}))
        stages = not mma and any(_E4M3_CVT.match(o) for o in body) and any(o.startswith("STG") for o in body)
        out.append(Loop(len(body), mma, stages))
    return out


def main_loop(sass: str, native_first: bool = False) -> Loop | None:
    """The largest innermost loop holding an MMA instruction (see the module docstring), None without one;
    `native_first`: the largest on a block-scaled MMA where there is one."""
    with_mma = [lp for lp in loops(sass) if lp.mma]
    if native_first and any(lp.native for lp in with_mma):
        with_mma = [lp for lp in with_mma if lp.native]
    return max(with_mma, key=lambda lp: lp.instructions) if with_mma else None


def staging_loop(sass: str) -> Loop | None:
    """The largest innermost loop that quantizes rows to e4m3 codes in memory before the main loop takes them
    (kernels/linear.py's `stage_codes`, on the e4m3 MMA), None without one."""
    staging = [lp for lp in loops(sass) if lp.stages_codes]
    return max(staging, key=lambda lp: lp.instructions) if staging else None


@functools.cache
def _nvdisasm() -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), "nvdisasm")


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_nvdisasm(), "-c", path], capture_output=True, text=True, check=True).stdout


def per_element(loop: Loop, warps: int, rows: int, k: int) -> float:
    """Lane-instructions one pass of `loop` issues per weight element of its [rows, k] tile."""
    return loop.instructions * warps * 32 / (rows * k)
