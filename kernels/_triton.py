"""Triton for the kernel files: imported before any `@triton.jit`, so the interpreter switch takes effect.

Without a CUDA device the kernels can only run under Triton's interpreter (`TRITON_INTERPRET=1`, numpy on
the CPU); Triton reads that variable when a kernel is decorated, so it is set here, before the first
kernel file defines its kernels, unless the user set it. `ready()` says whether the fast path can run
and, if not, why (the registry refuses to resolve "fast" with that reason instead of falling back).

Also the small helpers every wrapper uses: argument checks whose message names the argument, its value
and the limit, and block-size choices that differ between the GPU and the (slow, per-program) interpreter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No contraction of a * b + c into one FMA on the GPU: every product and sum rounds as written, as under the
# interpreter and in the torch references, so the bit-identity the kernel tests check on CPU holds on the
# device too (decode is bound by memory, not by these instructions).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")



if INTERPRET:
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


def device_function(fn):
    """Decorator for helpers called from kernels: `triton.jit` on the GPU. Under the interpreter a plain
    Python function (it runs on the same patched triton.language): the interpreter re-patches the language
    on every call of a jit function (about 0.3 ms), which made nested helpers the main cost of CPU runs."""
    return fn if INTERPRET else triton.jit(fn)


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


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def const64(values: tuple[float, ...], dev: torch.device) -> torch.Tensor:
    """A float64 device tensor holding Python floats exactly (a kernel's scalar float argument is float32),
    made once per value and device: no host-to-device copy on later calls, so calls can be graph-captured
    after a warm-up."""
    key = (values, str(dev))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(values, dtype=torch.float64, device=dev)
    return t


def sm_count(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 1


@device_function
def round_out(v, OUT_BF16: tl.constexpr):
    """float64 -> the output dtype the way torch rounds (`.to(bfloat16)` from float64 goes through
    float32: two roundings, which the reference inherits)."""
    out = v.to(tl.float32)
    if OUT_BF16:  # one return: the compiler rejects returns of different types, even under a constexpr if
        out = bf16_rne(out)
    return out


@device_function
def bf16_rne(v32):
    """float32 -> bfloat16, round half to even, on the bit pattern (the interpreter's cast truncates)."""
    bits = v32.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@device_function
def e8m0_f64(e):
    """E8M0 exponent bytes (int) -> float64 2^(e-127), exact also for e = 0 (2^-127, subnormal in fp32)."""
    return ((e.to(tl.int64) + (1023 - 127)) << 52).to(tl.float64, bitcast=True)


@device_function
def pow2_ceil(v):
    """2^ceil(log2 v) for positive normal float32 v, from the bit pattern (formats.pow2_ceil)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@device_function
def e4m3_rne(y):
    """Round float32 y (|y| <= 448) to the nearest e4m3 value, ties to even, as float32. Integer arithmetic
    on the bit pattern: the same on the GPU and in the interpreter (whose float8 cast loses the carry when
    rounding up crosses a power of two)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -0x80000000
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127
    # normal e4m3 (|y| >= 2^-6): keep 3 of 23 mantissa bits, round half to even; the carry may bump the exponent
    lsb = (mag >> 20) & 1
    normal = (mag + 0x7FFFF + lsb) & -0x100000
    # subnormal e4m3 (|y| < 2^-6): multiples of 2^-9, k = rne(m24 / 2^(14 - e)), k in 0..8
    sh = tl.minimum(14 - e, 25)
    m24 = (mag & 0x7FFFFF) | 0x800000
    k = m24 >> sh
    rem = m24 - (k << sh)
    half = 1 << (sh - 1)
    k = k + ((rem > half) | ((rem == half) & ((k & 1) == 1))).to(tl.int32)
    sub = (k.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    out = tl.where(e >= -6, normal, sub)
    return (out | sign).to(tl.float32, bitcast=True)
