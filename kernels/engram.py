"""Engram row gather: the rows a step needs from an Engram table (FP8 e4m3 [rows, d] with one E8M0 scale per
32 values), dequantized into a device tensor. The tables of the released V4.1-Flash are ~100 GB each and stay
in host memory; the kernel reads the few rows a token needs straight from there (host memory registered
with the device: a captured decode cycle gathers without a host round trip), and on CPU it reads an
ordinary tensor, so the tests exercise the same kernel.

Reference and kernel are exact: an e4m3 value times a power of two fits float32 and bfloat16 without
rounding. A lookup moves, per token and Engram layer, n_cols rows of d + d/32 bytes over the host link
(V4.1-Flash: 24 rows of 264 B = 6.3 KB per layer, 12.7 KB per token for its two Engram layers).
"""

import torch

from ._triton import device_of, pow2, require, require_dtype, tl, triton
from .formats import e8m0_to_float


def reference(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """ids [T, C] (int64, rows of `table`) -> [T, C * d] in out_dtype on ids' device. The gather happens
    where the table lives (a host table: a host round trip, which a CUDA graph cannot capture).

    Bytes moved: T * C * (d + d / 32) read, T * C * d * out_dtype size written."""
    flat = ids.reshape(-1).to(table.device)
    w = table[flat].float()
    s = e8m0_to_float(scale[flat]).repeat_interleave(32, dim=-1)
    return (w * s).reshape(ids.shape[0], -1).to(device=ids.device, dtype=out_dtype)


@triton.jit
def _kernel(table_ptr,  # e4m3 [rows, D] (host memory registered with the device, or any tensor on CPU)
            scale_ptr,  # E8M0 bytes [rows, D / 32]
            ids_ptr,    # int64 [N]: the table row of each output row
            out_ptr,    # [N, D] out dtype, contiguous
            D, OUT_BF16: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0)
    row = tl.load(ids_ptr + n)  # int64: the released tables have 384M rows, row * D passes 2^31
    cols = tl.arange(0, BD)
    m = cols < D
    code = tl.load(table_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    e = tl.load(scale_ptr + row * (D // 32) + cols // 32, mask=m, other=127).to(tl.int32)
    # 2^(e - 127): the E8M0 byte as a float32 exponent; e = 0 is 2^-127, a float32 subnormal
    v = code * tl.where(e > 0, (e << 23).to(tl.float32, bitcast=True), 5.877471754111438e-39)
    v = v.to(tl.bfloat16) if OUT_BF16 else v
    tl.store(out_ptr + n * D + cols, v, mask=m)


def fast(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel for `reference` (same signature and result, bit for bit). `table` and `scale` may live
    in host memory while `ids` and the output are on the device: nothing is copied."""
    require_dtype(table, "table", (torch.float8_e4m3fn,))
    require_dtype(scale, "scale", (torch.float8_e8m0fnu, torch.uint8))
    require_dtype(ids, "ids", (torch.int64,))
    require(out_dtype in (torch.float32, torch.bfloat16), "out_dtype", out_dtype, "must be float32 or bfloat16")
    rows, d = table.shape
    require(d % 32 == 0, "table.shape[1]", d, "must be a multiple of 32 (one scale per 32)")
    require(tuple(scale.shape) == (rows, d // 32), "scale.shape", tuple(scale.shape), f"must be {(rows, d // 32)}")
    require(table.is_contiguous() and scale.is_contiguous(), "table", "strided", "table and scale must be contiguous")
    dev = device_of(ids)
    flat = ids.reshape(-1).contiguous()
    out = torch.empty((flat.numel(), d), dtype=out_dtype, device=dev)
    if flat.numel():
        _kernel[(flat.numel(),)](table, scale.view(torch.uint8), flat, out, d,
                                 OUT_BF16=out_dtype == torch.bfloat16, BD=pow2(d))
    return out.view(ids.shape[0], -1)
