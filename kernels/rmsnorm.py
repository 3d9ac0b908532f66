"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps). Reference: computed in float64 and rounded once to x's dtype
(the official code keeps a float32 interior and rounds once).

Kernel (`fast`): the official float32 interior. One program per block of rows; a row's sum of squares runs
over column blocks of a width fixed by D, each block summed by one reduction, the blocks added in order:
nothing depends on the other rows (batch invariant). Tolerance: relative (D/2 + 4) 2^-24 of |y| from the
float32 sum, rsqrt and products, plus one rounding of x's dtype (a bfloat16 result can differ by one
bfloat16 ulp where the float32 value sits at a rounding boundary).
"""

import torch

from ._triton import (
    INTERPRET,
    dependent_launch,
    device_of,
    pdl,
    pow2,
    require,
    require_dtype,
    require_rows,
    round_out,
    tl,
    triton,
    tsum,
)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x.dtype. Bytes moved: 2 * x bytes + weight bytes."""
    x64 = x.double()
    r = torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    return (weight.double() * (x64 * r)).to(x.dtype)


@triton.jit
def _kernel(x_ptr,    # input [R, D] (float32 / bfloat16), row stride stride_x
            w_ptr,    # weight [D] (float32 / bfloat16)
            y_ptr,    # output [R, D] in x's dtype, contiguous
            R, D, stride_x,
            eps,      # float32
            OUT_BF16: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    xrow = x_ptr + rows.to(tl.int64) * stride_x
    yrow = y_ptr + rows.to(tl.int64) * D
    ss = tl.zeros((BR,), dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = rmask[:, None] & (cols[None, :] < D)
        x = tl.load(xrow[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        ss += tsum(x * x, axis=1)
    r = 1.0 / tl.sqrt_rn(ss / D + eps)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = rmask[:, None] & (cols[None, :] < D)
        x = tl.load(xrow[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = w[None, :] * (x * r[:, None])
        tl.store(yrow[:, None] + cols[None, :], round_out(y, OUT_BF16), mask=m)


def fast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel for `reference` (same signature and result)."""
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require(weight is not None and weight.dim() == 1 and weight.shape[0] == x.shape[-1], "weight.shape",
            None if weight is None else tuple(weight.shape), f"must be ({x.shape[-1]},)")
    require_dtype(weight, "weight", (torch.float32, torch.bfloat16))
    require(weight.is_contiguous(), "weight.stride", weight.stride(), "must be contiguous")
    dev = device_of(x, weight)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    require_rows(x2, "x")
    r = x2.shape[0]
    y = torch.empty((r, d), dtype=x.dtype, device=dev)
    if r and d:
        if INTERPRET:
            bd, br = min(pow2(d), 4096), min(pow2(r), max(1, 16384 // min(pow2(d), 4096)))
        else:
            bd, br = min(pow2(d), 8192), 1
        _kernel[(triton.cdiv(r, br),)](x2, weight, y, r, d, x2.stride(0), float(eps),
                                       OUT_BF16=x.dtype == torch.bfloat16, BR=br, BD=bd, **pdl(x2.device))
    return y.view(x.shape)
