"""Triton for the kernel files: imported before any `@triton.jit`, so the interpreter switch takes effect.

Without a CUDA device the kernels can only run under Triton's interpreter (`TRITON_INTERPRET=1`, numpy on
the CPU); Triton reads that variable when a kernel is decorated, so it is set here, before the first
kernel file defines its kernels, unless the user set it. `ready()` says whether the fast path can run
and, if not, why (the registry refuses to resolve "fast" with that reason instead of falling back).

Also the small helpers every wrapper uses: argument checks whose message names the argument, its value
and the limit, and block-size choices that differ between the GPU and the (slow, per-program) interpreter.
"""

import contextlib
import contextvars
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No contraction of a * b + c into one FMA on the GPU: every product and sum outside a `tl.dot` rounds as
# written, as under the interpreter, so the error bounds the kernels' docstrings state hold on the device too
# (decode is bound by memory, not by these instructions).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# How FP8/FP4 weights with quantized rows (official numerics) multiply on the tensor cores: the kernels'
# NATIVE constexpr. NATIVE_BLOCK_SCALED (sm_100 and later): the codes as stored with their E8M0 bytes on the
# block-scaled MMA (`tl.dot_scaled`). NATIVE_E4M3 (sm_89, sm_90: e4m3 MMAs without block scales): one e4m3
# product per scale block, FP4's e2m1 codes re-encoded as e4m3, scaled and summed in float32. 0: the weights
# are dequantized to bfloat16 values in registers. Under the interpreter the tests choose (NATIVE_INTERPRET;
# it runs both MMAs as the same exact products in float32).
NATIVE_BLOCK_SCALED, NATIVE_E4M3 = 1, 2
NATIVE_INTERPRET = 0


def capability(dev: torch.device) -> int:
    """The device's compute capability as one number (90: H100/H200, 100: B200, 103: B300); 0 off CUDA. The
    wrappers choose tiles and paths by it (tests/gpu_dry_run.py sets it to each target it compiles for)."""
    if dev.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(dev)
    return 10 * major + minor


def native_products(dev: torch.device) -> int:
    """How FP8/FP4 weight products multiply here (the kernels' NATIVE constexpr; see NATIVE_BLOCK_SCALED)."""
    if INTERPRET:
        return NATIVE_INTERPRET
    cap = capability(dev)
    return NATIVE_BLOCK_SCALED if cap >= 100 else NATIVE_E4M3 if cap >= 89 else 0

# Rows one launch may take (a prefill chunk; a verify block has at most 9). Every offset that multiplies a
# row index is int64, so no index overflows at any size; the bound keeps a launch's float32 scratch
# (attention logits [rows, heads, keys], index scores [rows, compressed rows]) to what one device holds at
# the longest context. appliance/options.py bounds --chunk by it (tests/test_citations.py checks both
# say the same).
MAX_ROWS = 8192

# Rows of one program of the GEMV kernels (linear, MoE): the tensor-core instruction's N side, padded with
# masked rows. Fixed, so a row is computed by the same instructions however many rows share the launch.
MMA_ROWS = 16
# ... on the e4m3 MMA (NATIVE_E4M3), whose float32 epilogue per 32-column block costs a row's share of every
# output: 8 (wgmma's smallest N) halves it against 16; a verify block (at most 6 rows) still fits one program.
E4M3_MMA_ROWS = 8
# ... in a long call (a prefill chunk: `long_calls`), on the block-scaled MMA or from registers: 128 rows a
# program (the MMA's N side), so each weight tile streams (and, from registers, is dequantized) once per 128
# rows, not per 16; in the checkpoint's formats the rows are quantized once per launch before it
# (rows.stage_launch), not in every program. The mode, not the row
# count, chooses it: every chunk of a prompt, a tail of 3 rows too, takes the same tiles (a prompt's bits do
# not depend on its chunking), and a decode step or a verify block never does (a verify block equals single
# steps bit for bit). A row of a long call meets the same K tiles as in a short one, on a wider MMA and
# without split-K (linear.plan); its bits are not promised equal to a short call's (under the interpreter
# they differ: numpy orders a product's sums by its shape).
LONG_ROWS = 128
# ... on the e4m3 MMA (sm_89/90): 32, beside 128 outputs a tile (the per-32-column float32 epilogue is paid
# per row: 128 rows issued ~22 instructions a weight element and spilled, 32 beside 256 outputs spilled; 32
# beside 128 outputs issue 4.7-6.0 an element, a row's share about half 8 rows'; the compile check, 2026-12-04)
E4M3_LONG_ROWS = 32
_LONG_CALLS = contextvars.ContextVar("long_calls", default=False)


@contextlib.contextmanager
def long_calls():
    """Inside: the weight products run as a long call's (LONG_ROWS a program where they multiply in the
    checkpoint's formats). The prefill wraps each chunk in it."""
    token = _LONG_CALLS.set(True)
    try:
        yield
    finally:
        _LONG_CALLS.reset(token)


def product_rows(native: int, may_be_long: bool) -> int:
    """Rows one program of the weight products computes when they multiply as `native` says
    (`native_products`; 0: bfloat16 values from registers): inside `long_calls`, where the launch can
    (`may_be_long`: its wrapper's choice: its rows take one staging; from registers, a plain product),
    LONG_ROWS on the block-scaled MMA or from registers (there the weights' dequantization spreads over 128
    rows) and E4M3_LONG_ROWS on the e4m3 MMA; else the MMA's N side."""
    long = may_be_long and _LONG_CALLS.get()
    if native == NATIVE_E4M3:
        return E4M3_LONG_ROWS if long else E4M3_MMA_ROWS
    return LONG_ROWS if long else MMA_ROWS


def in_long_calls() -> bool:
    """Whether the launch is inside `long_calls` (a prefill chunk's: its row blocks fill the device)."""
    return _LONG_CALLS.get()


def is_long(rows: int) -> bool:
    """Whether programs of `rows` rows (`product_rows`) are a long call's."""
    return rows in (LONG_ROWS, E4M3_LONG_ROWS)


if INTERPRET:
    from . import _interpreter_speed

    _interpreter_speed.apply()
    # tl.sum/max/min/cumsum are jit functions of triton's standard library: each call re-patches the
    # language in the interpreter. The same reductions through tl.reduce / tl.associative_scan with the
    # standard combine functions run as single numpy calls.
    from triton.language.standard import _elementwise_max, _elementwise_min, _sum_combine

    def tsum(x, axis=None):
        return tl.reduce(x, axis, _sum_combine)

    def tmax(x, axis=None):
        return tl.reduce(x, axis, _elementwise_max)

    def tmin(x, axis=None):
        return tl.reduce(x, axis, _elementwise_min)

    def tcumsum(x, axis):
        return tl.associative_scan(x, axis, _sum_combine)
else:
    tsum, tmax, tmin, tcumsum = tl.sum, tl.max, tl.min, tl.cumsum


_COUNTERS: dict = {}


def counters(dev: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, at least `n`, for the fused kernels' last-program pattern (the programs of a split
    reduction count themselves in; the last one adds the partials in a fixed order and resets the count):
    zero between launches, so a captured graph replays with them as they were at capture. One buffer per
    device and power-of-two size, kept for the process (a graph may hold its address): a decode step's
    launches use the smallest, a long prefill chunk a larger one."""
    size = max(256, 1 << max(0, n - 1).bit_length())
    key = (dev.type, dev.index, size)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=dev)
    return _COUNTERS[key]


def device_function(fn):
    """Decorator for helpers called from kernels: `triton.jit` on the GPU. Under the interpreter a plain
    Python function (it runs on the same patched triton.language): the interpreter re-patches the language
    on every call of a jit function (about 0.3 ms), which made nested helpers the main cost of CPU runs."""
    return fn if INTERPRET else triton.jit(fn)


# Whether the kernels launch dependent on the one ahead (`pdl`): KERNELS_NO_PDL=1 at start turns it off,
# `dependent_launches(False)` for a while (the device check's comparison)
_DEPENDENT = contextvars.ContextVar("dependent_launches", default=os.environ.get("KERNELS_NO_PDL", "0") != "1")


@contextlib.contextmanager
def dependent_launches(on: bool):
    """Inside: kernels launch with programmatic dependent launch as `on` says (where the GPU can)."""
    token = _DEPENDENT.set(on)
    try:
        yield
    finally:
        _DEPENDENT.reset(token)


def pdl(dev: torch.device) -> dict:
    """A launch's options for programmatic dependent launch (Triton's `launch_pdl`, the kernels' PDL constexpr):
    on sm_90 and later; not under the interpreter, which has no grids to overlap (its kernels run with PDL
    off: the same code without the two instructions)."""
    on = not INTERPRET and _DEPENDENT.get() and capability(dev) >= 90
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@device_function
def dependent_launch(PDL: tl.constexpr):
    """Every kernel's first statement. With PDL the kernel was launched before the one ahead of it in the
    stream finished (`pdl`): wait until that one has completed and its writes are visible, then let the next
    kernel launch (it waits likewise before touching memory). A kernel's launch and ramp overlap its
    predecessor's tail; no load or store comes before the wait (the compile check reads it in the PTX)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def ready() -> str | None:
    """None when kernels can run here; otherwise the reason they cannot."""
    if torch.cuda.is_available() or INTERPRET:
        return None
    return ("no CUDA device and TRITON_INTERPRET is not 1: the fast path needs a GPU, or the Triton "
            "interpreter (set TRITON_INTERPRET=1 before starting, or unset it to let kernels/ set it)")


def require(ok: bool, arg: str, value, limit: str) -> None:
    """Raise ValueError("arg=value: limit") unless ok."""
    if not ok:
        raise ValueError(f"{arg}={value}: {limit}")


def require_int32_rows(rows: int, width: int, arg: str) -> None:
    """Rows of `width` values a kernel addresses in int32 (`output_row`'s pairs: int64 spills on sm_103)."""
    require(rows * width < 2**31, arg, rows, f"must hold under 2^31 values ({width} a row): int32 offsets")


def require_dtype(t: torch.Tensor, arg: str, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{arg}.dtype={str(t.dtype).removeprefix('torch.')}: must be one of {names}")


def require_rows(t: torch.Tensor, arg: str) -> None:
    """The kernels take a row stride but need unit stride along the last dim."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{arg}.stride(-1)={t.stride(-1)}: must be 1 (contiguous rows)")


def pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(1, int(n))))


def device_of(*tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; on CPU only the interpreter can run the kernels."""
    devs = {t.device for t in tensors if t is not None}
    if len(devs) > 1:
        raise ValueError(f"tensors on several devices {sorted(map(str, devs))}: must be on one")
    dev = devs.pop()
    if dev.type == "cpu" and not INTERPRET:
        raise ValueError(f"device={dev}: CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
    return dev


def sm_count(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 1


@device_function
def round_out(v, OUT_BF16: tl.constexpr):
    """float32 -> the output dtype: float32 unchanged, bfloat16 rounded to nearest even (as torch's
    `.to(bfloat16)` rounds)."""
    out = v
    if OUT_BF16:  # one return: the compiler rejects returns of different types, even under a constexpr if
        out = bf16_rne(v)
    return out


@device_function
def bf16_rne(v32):
    """float32 -> bfloat16, round half to even, on the bit pattern (the interpreter's cast truncates)."""
    bits = v32.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@device_function
def bf16_value(v32):
    """float32 -> the nearest bfloat16 value (ties to even), kept as float32."""
    bits = v32.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@device_function
def e8m0_f32(e):
    """E8M0 exponent bytes (int) -> float32 2^(e-127), exact also for e = 0 (2^-127, a float32 subnormal)."""
    e32 = e.to(tl.int32) & 0xFF
    return tl.where(e32 == 0, 0x400000, e32 << 23).to(tl.float32, bitcast=True)


@device_function
def as_int64(i):
    """A scalar index (a loop variable: a Python int under the interpreter, int32 on the GPU) as int64, for
    offsets that multiply it."""
    return tl.program_id(0).to(tl.int64) * 0 + i


@device_function
def pow2_ceil(v):
    """2^ceil(log2 v) for positive normal float32 v, from the bit pattern (formats.pow2_ceil)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@device_function
def pow2_inverse(s):
    """1 / s for float32 powers of two s in [2^-126, 2^126], exact, from the bit pattern (one integer op)."""
    return ((254 << 23) - s.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@device_function
def e4m3_sum_rne(y):
    """Round float32 y (|y| <= 448) to the nearest e4m3 value, ties to even, as float32: (y + c) - c with c
    = 1.5 2^23 times the e4m3 spacing at |y| (2^(e-3) for a normal |y| in [2^e, 2^(e+1)), 2^-9 below 2^-6),
    so the float32 sum rounds at exactly that spacing, to nearest even (c is an even multiple of it, so the
    rounding is symmetric in the sign of y), and a carry into the next power of two comes out right. The
    interpreter's rounding (its float8 cast loses that carry); on the GPU the conversion instruction
    computes the same (`e4m3_rne`)."""
    bits = y.to(tl.int32, bitcast=True)
    c_normal = (((bits & 0x7F800000) + (20 << 23)) | 0x400000).to(tl.float32, bitcast=True)
    c = tl.where(tl.abs(y) < 0.015625, 24576.0, c_normal)  # below 2^-6: spacing 2^-9, c = 1.5 2^14
    return (y + c) - c


if INTERPRET:
    @device_function
    def e4m3_codes(y):
        """float32 y (|y| <= 448) -> the nearest e4m3 codes, ties to even (float8e4nv)."""
        return e4m3_sum_rne(y).to(tl.float8e4nv)  # exact: already an e4m3 value
else:
    @device_function
    def e4m3_codes(y):
        """float32 y (|y| <= 448) -> the nearest e4m3 codes, ties to even (float8e4nv): one conversion
        instruction per pair (cvt.rn.satfinite.e4m3x2.f32 on sm_89 and later)."""
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


# FP4 weights on the e4m3 MMA (NATIVE_E4M3): an e2m1 code s e1 e0 m read as the e4m3 bits s 0 0 e1 e0 m 0 0 is
# its value times 2^-6, normal (2^(e-1) (1 + m/2) -> 2^(e-7) (1 + m/2)) and subnormal (m/2 -> 2^-6 m/2)
# alike. A byte holds two codes, the low nibble first: `e2m1_low_as_e4m3` re-encodes the low one,
# `e2m1_high_as_e4m3` the high one, four bytes to a shift-and-mask instruction sequence on the GPU.
if INTERPRET:
    @device_function
    def e2m1_low_as_e4m3(b):
        """uint8 bytes -> the e4m3 codes (uint8) of their low e2m1 codes times 2^-6."""
        return ((b & 7) << 2) | ((b & 8) << 4)

    @device_function
    def e2m1_high_as_e4m3(b):
        """uint8 bytes -> the e4m3 codes (uint8) of their high e2m1 codes times 2^-6."""
        return ((b >> 2) & 0x1C) | (b & 0x80)
else:
    @device_function
    def e2m1_low_as_e4m3(b):
        """uint8 bytes -> the e4m3 codes (uint8) of their low e2m1 codes times 2^-6 (four a 32-bit word)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u; shl.b32 t, $1, 2; shl.b32 u, $1, 4; and.b32 t, t, 0x1C1C1C1C; "
            "and.b32 u, u, 0x80808080; or.b32 $0, t, u; }", "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)

    @device_function
    def e2m1_high_as_e4m3(b):
        """uint8 bytes -> the e4m3 codes (uint8) of their high e2m1 codes times 2^-6 (four a 32-bit word)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u; shr.b32 t, $1, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 u, $1, 0x80808080; "
            "or.b32 $0, t, u; }", "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)


@device_function
def e4m3_rne(y):
    """float32 y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, as float32."""
    return e4m3_codes(y).to(tl.float32)
