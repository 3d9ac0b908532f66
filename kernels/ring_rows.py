"""Rows written at given rows of a buffer (a ring's slots: appliance/model/state.py PositionRing), converted to
its dtype (round to nearest even where it narrows): data[slots] = values.

Kernel (`fast_put`): one launch, a program per row and block of columns. Exact: a copy and one conversion.
The slots are in range (the ring makes them): not checked on the device.
"""

import torch

from ._triton import dependent_launch, device_of, pdl, pow2, require, require_dtype, require_rows, round_out, tl, triton


def put(data: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """data [S, W]; slots int64 [n]; values [n, W] -> data, its rows `slots` the values (in data's dtype)."""
    data[slots] = values.to(data.dtype)
    return data


@triton.jit
def _put_kernel(v_ptr,  # [n, W] values, row stride stride_v
                s_ptr,  # int64 [n] their rows in data
                d_ptr,  # [S, W] data, row stride stride_d
                W, stride_v, stride_d, OUT_BF16: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    mask = cols < W
    x = tl.load(v_ptr + t.to(tl.int64) * stride_v + cols, mask=mask).to(tl.float32)  # exact from either dtype
    tl.store(d_ptr + tl.load(s_ptr + t) * stride_d + cols, round_out(x, OUT_BF16), mask=mask)


def fast_put(data: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The kernel for `put` (same signature and result)."""
    require(data.dim() == 2, "data.dim()", data.dim(), "must be 2 ([S, W])")
    require(slots.dim() == 1 and slots.is_contiguous(), "slots.shape", tuple(slots.shape), "must be a contiguous [n]")
    require_dtype(slots, "slots", (torch.int64,))
    n, w = slots.numel(), data.shape[1]
    require(tuple(values.shape) == (n, w), "values.shape", tuple(values.shape), f"must be ({n}, {w})")
    for name, t in (("data", data), ("values", values)):
        require_dtype(t, name, (torch.float32, torch.bfloat16))
        require_rows(t, name)
    device_of(data, slots, values)
    if n and w:
        bw = min(pow2(w), 4096)
        _put_kernel[(n, triton.cdiv(w, bw))](values, slots, data, w, values.stride(0), data.stride(0),
                                             OUT_BF16=data.dtype == torch.bfloat16, BW=bw, **pdl(data.device))
    return data
