"""Token sampling on device: temperature, top-k, top-p, and exact categorical draws by the exponential race
(argmax p_v / E_v with E_v ~ Exp(1), the official sampler's Gumbel-max form), from a seeded generator so a
request's samples are reproducible. Temperature 0 is argmax (ties to the lowest id).

Kernels (`fast_distribution`, `fast_draw`, `fast_sample`), one program per row, looping over the vocab:
softmax in float64 rounded to float32; top-k and top-p thresholds by radix search on the float bit
patterns (32 counting passes each; the top-p mass sums in float64), so no sort; the draw is the same
exponential race with the same torch-generated E (same generator, same samples) and an argmax kernel.
Tolerance: probabilities within 4 float32 ulps (2^-21 relative: torch's float32 exp and sum order differ
by an ulp); the kept set is the reference's except at exact ties on the top-p boundary, where all tied
entries are kept (the reference's order among ties is its sort's, unspecified); draws equal.
"""

import torch

from . import acceptance
from ._triton import (
    INTERPRET,
    device_function,
    device_of,
    pow2,
    require,
    require_dtype,
    require_rows,
    tl,
    tmax,
    tmin,
    triton,
    tsum,
)


def distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [R, V] -> the sampling distribution [R, V] (float32, truncated by top-k / top-p, renormalized):
    the decode cycle's definition (kernels/acceptance.py), with the parameters as numbers.

    Bytes moved: logits read once, probabilities written once (a sort of V per row)."""
    params = torch.tensor([temperature, top_p, float(top_k)], device=logits.device)
    return acceptance.distribution(logits, params)


def draw(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One categorical draw per row of p [R, V] -> int64 [R]."""
    e = torch.empty_like(p).exponential_(1.0, generator=generator)
    return (p / e).argmax(-1)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    return draw(distribution(logits, temperature, top_k, top_p), generator)


# --- Triton kernels --------------------------------------------------------------------------------------


@device_function
def _key(v):
    """float32 >= 0 -> its bit pattern as int64 (same order)."""
    return v.to(tl.int32, bitcast=True).to(tl.int64)


@triton.jit
def _distribution_kernel(l_ptr,  # logits [R, V] (any float dtype), row stride stride_l
                         p_ptr,  # out float32 [R, V]: the truncated, renormalized distribution
                         V, stride_l, temperature, top_k, top_p,
                         TOP_K: tl.constexpr, TOP_P: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0)
    lrow = l_ptr + r * stride_l
    prow = p_ptr + r * V
    # softmax of logits / temperature (the division in float32, as the reference does it)
    mx = tl.full((1,), float("-inf"), dtype=tl.float64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(lrow + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        mx = tl.maximum(mx, tmax(x.to(tl.float64), axis=0))
    tot = tl.zeros((1,), dtype=tl.float64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(lrow + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        tot += tsum(tl.exp(x.to(tl.float64) - mx), axis=0)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(lrow + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        tl.store(prow + cols, (tl.exp(x.to(tl.float64) - mx) / tot).to(tl.float32), mask=cols < V)
    # top-k: keep p >= the k-th largest p (the largest T with count(p >= T) >= k)
    kth = tl.zeros((1,), dtype=tl.int64)
    if TOP_K:
        for b in range(30, -1, -1):
            cand = kth | (1 << b)
            cnt = tl.zeros((1,), dtype=tl.int64)
            for v0 in range(0, V, BV):
                cols = v0 + tl.arange(0, BV)
                p = tl.load(prow + cols, mask=cols < V, other=0.0)
                cnt += tsum(((cols < V) & (_key(p) >= cand)).to(tl.int64), axis=0)
            kth = tl.where(cnt >= top_k, cand, kth)
    # top-p: keep entries whose strictly larger mass is < top_p * total, i.e. p >= the largest T with
    # mass(p >= T) >= top_p * total
    thr = kth
    if TOP_P:
        total = tl.zeros((1,), dtype=tl.float64)
        for v0 in range(0, V, BV):
            cols = v0 + tl.arange(0, BV)
            p = tl.load(prow + cols, mask=cols < V, other=0.0)
            total += tsum(tl.where(_key(p) >= kth, p, 0.0).to(tl.float64), axis=0)
        goal = (top_p * total.to(tl.float32)).to(tl.float64)
        thr = tl.zeros((1,), dtype=tl.int64)
        for b in range(30, -1, -1):
            cand = thr | (1 << b)
            mass = tl.zeros((1,), dtype=tl.float64)
            for v0 in range(0, V, BV):
                cols = v0 + tl.arange(0, BV)
                p = tl.load(prow + cols, mask=cols < V, other=0.0)
                k = _key(p)
                mass += tsum(tl.where((k >= cand) & (k >= kth), p, 0.0).to(tl.float64), axis=0)
            thr = tl.where(mass >= goal, cand, thr)
        thr = tl.maximum(thr, kth)
    kept = tl.zeros((1,), dtype=tl.float64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        p = tl.load(prow + cols, mask=cols < V, other=0.0)
        kept += tsum(tl.where(_key(p) >= thr, p, 0.0).to(tl.float64), axis=0)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        p = tl.load(prow + cols, mask=cols < V, other=0.0)
        q = (tl.where(_key(p) >= thr, p, 0.0).to(tl.float64) / kept).to(tl.float32)
        tl.store(prow + cols, q, mask=cols < V)


def fast_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The kernel for `distribution` (same signature and result, see the tolerance above)."""
    require(logits.dim() == 2, "logits.dim()", logits.dim(), "must be 2 ([R, V])")
    require_dtype(logits, "logits", (torch.float32, torch.bfloat16, torch.float16))
    require_rows(logits, "logits")
    require(0.0 < top_p <= 1.0, "top_p", top_p, "must be in (0, 1]")
    dev = device_of(logits)
    r, v = logits.shape
    p = torch.empty((r, v), dtype=torch.float32, device=dev)
    if r and v:
        bv = min(pow2(v), 4096 if INTERPRET else 2048)
        _distribution_kernel[(r,)](logits, p, v, logits.stride(0), max(temperature, 1e-5), top_k, top_p,
                                   TOP_K=0 < top_k < v, TOP_P=top_p < 1.0, BV=bv)
    return p


@triton.jit
def _argmax_kernel(p_ptr,    # [R, V] values (probabilities or logits), row stride stride_p
                   e_ptr,    # float32 [R, V] exponential draws, contiguous (HAS_E)
                   out_ptr,  # out int64 [R]
                   V, stride_p, HAS_E: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0)
    best = tl.full((1,), float("-inf"), dtype=tl.float32)
    best_i = tl.zeros((1,), dtype=tl.int64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(p_ptr + r * stride_p + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if HAS_E:
            x = x / tl.load(e_ptr + r * V + cols, mask=cols < V, other=1.0)
        x = tl.where(cols < V, x, float("-inf"))
        cmax = tmax(x, axis=0)
        ci = tmin(tl.where(x == cmax, cols, V + BV), axis=0).to(tl.int64)
        better = cmax > best  # strictly: an equal later maximum keeps the lower index
        best_i = tl.where(better, ci, best_i)
        best = tl.where(better, cmax, best)
    tl.store(out_ptr + r + tl.arange(0, 1), best_i)


def _argmax(x: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
    r, v = x.shape
    out = torch.empty(r, dtype=torch.int64, device=x.device)
    if r and v:
        bv = min(pow2(v), 4096 if INTERPRET else 2048)
        _argmax_kernel[(r,)](x, x if e is None else e, out, v, x.stride(0), HAS_E=e is not None, BV=bv)
    return out


def fast_draw(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The kernel for `draw`: the same E from the same generator, argmax(p / E) fused."""
    require(p.dim() == 2, "p.dim()", p.dim(), "must be 2 ([R, V])")
    require_dtype(p, "p", (torch.float32,))
    require_rows(p, "p")
    device_of(p)
    e = torch.empty_like(p).exponential_(1.0, generator=generator)
    return _argmax(p, e.contiguous())


def fast_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """The kernels for `sample` (same signature and result)."""
    require(logits.dim() == 2, "logits.dim()", logits.dim(), "must be 2 ([R, V])")
    device_of(logits)
    if temperature == 0:
        require_rows(logits, "logits")
        return _argmax(logits, None)
    return fast_draw(fast_distribution(logits, temperature, top_k, top_p), generator)
