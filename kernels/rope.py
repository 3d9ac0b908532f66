"""Rotary embedding on the last `2 * cos.shape[-1]` dims of a vector, as interleaved pairs
(x[2i], x[2i+1]) rotated by angle phi_i; the inverse rotation uses the conjugate. Reference: computed in
float64 from float32 cos/sin tables and rounded once to x's dtype.

Kernel (`fast`): one pass over the rows, nope dims copied, each pair rotated in float32 (a * c - b * s: two
rounded products and a rounded difference; elementwise, so batch invariant). Tolerance: |y - y_ref| <=
2^-23 (|a c| + |b s|) before the final rounding, so within one rounding of x's dtype plus 2^-23 of the
pair's magnitude (a bfloat16 value at a rounding boundary can move by one bfloat16 ulp).
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
)


def table(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [...], freqs float32 [r/2] -> cos, sin float32 [..., r/2] of fl32(position * f_i), as
    the official code builds them (the fused kernels compute the same angles themselves)."""
    phi = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device)
    return torch.cos(phi), torch.sin(phi)


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., d]; cos, sin broadcastable to x[..., :r/2] -> [..., d] in x.dtype (nope dims untouched).

    Bytes moved: 2 * x bytes + the cos/sin rows used (2 * r/2 float32 per distinct row)."""
    r = 2 * cos.shape[-1]
    rope = x[..., -r:].double().unflatten(-1, (r // 2, 2))
    c, s = cos.double(), sin.double()
    if inverse:
        s = -s
    a, b = rope[..., 0], rope[..., 1]
    rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], rotated), dim=-1)


@triton.jit
def _kernel(x_ptr,    # input [R, d] (float32 / bfloat16), row stride stride_x
            cos_ptr,  # cos table, float32; row index of x row -> (i0, i1, i2) dotted with (c0, c1, c2)
            sin_ptr,  # sin table, float32, same strides as cos
            y_ptr,    # output [R, d], contiguous
            R, d, half,  # rows, row width, rotated pairs (r/2)
            L1, L2,      # x's leading dims are [L0, L1, L2] (padded with 1s), R = L0 * L1 * L2
            c0, c1, c2,  # cos/sin strides along those dims (0 where broadcast)
            stride_x, SIGN: tl.constexpr, OUT_BF16: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
            BH: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    nope = d - 2 * half
    # nope dims: copy
    for d0 in range(0, nope, BD):
        cols = d0 + tl.arange(0, BD)
        m = rmask[:, None] & (cols[None, :] < nope)
        v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=m)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * d + cols[None, :], v, mask=m)
    # rotated pairs
    i2 = rows % L2
    i1 = (rows // L2) % L1
    i0 = rows // (L1 * L2)
    crow = i0.to(tl.int64) * c0 + i1.to(tl.int64) * c1 + i2.to(tl.int64) * c2
    pairs = tl.arange(0, BH)
    pm = rmask[:, None] & (pairs[None, :] < half)
    c = tl.load(cos_ptr + crow[:, None] + pairs[None, :], mask=pm, other=0.0)
    s = tl.load(sin_ptr + crow[:, None] + pairs[None, :], mask=pm, other=0.0) * SIGN
    ea = rows[:, None].to(tl.int64) * stride_x + nope + 2 * pairs[None, :]
    a = tl.load(x_ptr + ea, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + ea + 1, mask=pm, other=0.0).to(tl.float32)
    oa = rows[:, None].to(tl.int64) * d + nope + 2 * pairs[None, :]
    tl.store(y_ptr + oa, round_out(a * c - b * s, OUT_BF16), mask=pm)
    tl.store(y_ptr + oa + 1, round_out(a * s + b * c, OUT_BF16), mask=pm)


def fast(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The kernel for `reference` (same signature and result)."""
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require_dtype(cos, "cos", (torch.float32,))
    require_dtype(sin, "sin", (torch.float32,))
    require(cos.shape == sin.shape, "sin.shape", tuple(sin.shape), f"must equal cos.shape {tuple(cos.shape)}")
    d, half = x.shape[-1], cos.shape[-1]
    require(2 * half <= d, "cos.shape[-1]", half, f"must be <= x.shape[-1] / 2 = {d // 2}")
    lead = tuple(x.shape[:-1])
    require(len(lead) <= 3, "x.dim()", x.dim(), "must be <= 4")
    require(cos.dim() - 1 <= len(lead), "cos.dim()", cos.dim(), f"must be <= x.dim() = {x.dim()}")
    dev = device_of(x, cos, sin)
    try:
        cb = torch.broadcast_to(cos, lead + (half,))
        sb = torch.broadcast_to(sin, lead + (half,))
    except RuntimeError:
        raise ValueError(f"cos.shape={tuple(cos.shape)}: must broadcast to {lead + (half,)}") from None
    if cb.stride(-1) != 1 or sb.stride() != cb.stride():
        cb, sb = cb.contiguous(), sb.contiguous()
    pad = (1,) * (3 - len(lead))
    dims = pad + lead
    strides = (0,) * len(pad) + tuple(cb.stride()[:-1])
    x2 = x.reshape(-1, d)
    require_rows(x2, "x")
    r = x2.shape[0]
    y = torch.empty((r, d), dtype=x.dtype, device=dev)
    if r and d:
        bh = pow2(half)
        bd = min(pow2(d), 1024)
        br = min(pow2(r), 64) if INTERPRET else max(1, min(pow2(r), 4096 // pow2(d)))
        _kernel[(triton.cdiv(r, br),)](x2, cb, sb, y, r, d, half, dims[1], dims[2], *strides, x2.stride(0),
                                       SIGN=-1.0 if inverse else 1.0, OUT_BF16=x.dtype == torch.bfloat16,
                                       BR=br, BD=bd, BH=bh, **pdl(x2.device))
    return y.view(x.shape)
