"""Linear layers with quantized weights: y = x W^T for FP8 (e4m3 + E8M0 block scales), FP4 (packed e2m1
+ E8M0 per 32 inputs) or dense weights, with the official FP8 activation quantization of x in front.

Reference numerics: the activation is rounded to power-of-two-scaled e4m3 per `act_block` elements
(none in `plain` numerics), the product is accumulated in float64 and rounded once to `out_dtype`. With
quantized operands the float64 sum is exact in practice, so the result does not depend on how many rows
are computed together (batch invariance, which lossless speculative decoding needs).

Kernel (`fast`): the same function. Weights are read packed and dequantized in registers, the activation
quantization is fused in front, products are accumulated in float64 in a per-row order fixed by (N, K),
split-K for long K with float64 partials added in split order. Tolerance: bit-identical to `reference`
with quantized operands (the float64 sum is exact); otherwise within one rounding of out_dtype
(float32: 2^-23 relative, bfloat16: 2^-8 relative), from the different float64 summation order.
"""

from dataclasses import dataclass, field

import torch

from ._triton import (
    INTERPRET,
    device_function,
    device_of,
    e4m3_rne,
    e8m0_f64,
    pow2,
    pow2_ceil,
    require,
    require_dtype,
    require_rows,
    round_out,
    sm_count,
    tl,
    tmax,
    triton,
    tsum,
)
from .formats import dequant_fp4, dequant_fp8, q8_pow2


@dataclass
class PackedWeight:
    """A linear weight [out, in] as stored in the checkpoint (memory-mapped; the kernels read it packed).

    format: "fp8" (data e4m3 [out, in], scale E8M0 [ceil(out/bo), ceil(in/bi)]),
            "fp4" (data int8 [out, in/2], scale E8M0 [out, in/32]),
            "dense" (data bf16/f32 [out, in])."""

    name: str
    shape: tuple[int, int]
    format: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None
    _dense64: torch.Tensor | None = field(default=None, repr=False)

    def rows(self, start: int, end: int) -> "PackedWeight":
        """Output rows [start, end) (a column-parallel shard); FP8 block rows must stay whole."""
        bo = self.block[0] if self.format == "fp8" else 1
        if start % bo or (end % bo and end != self.shape[0]):
            raise ValueError(f"{self.name}: rows {start}:{end} split FP8 blocks of {bo}")
        scale = None if self.scale is None else self.scale[start // bo: -(-end // bo)]
        return PackedWeight(self.name, (end - start, self.shape[1]), self.format, self.data[start:end], scale,
                            self.block)

    def cols(self, start: int, end: int) -> "PackedWeight":
        """Input columns [start, end) (a row-parallel shard); FP8/FP4 scale blocks must stay whole."""
        bi = {"fp8": self.block[1] if self.block else 1, "fp4": 32}.get(self.format, 1)
        if start % bi or (end % bi and end != self.shape[1]):
            raise ValueError(f"{self.name}: columns {start}:{end} split scale blocks of {bi}")
        if self.format == "fp4":
            data = self.data[:, start // 2: end // 2]
        else:
            data = self.data[:, start:end]
        scale = None if self.scale is None else self.scale[:, start // bi: -(-end // bi)]
        return PackedWeight(self.name, (self.shape[0], end - start), self.format, data, scale, self.block)

    def dequantize(self) -> torch.Tensor:
        """Exact float32 values [out, in]."""
        if self.format == "fp8":
            return dequant_fp8(self.data, self.scale, self.block)
        if self.format == "fp4":
            return dequant_fp4(self.data, self.scale, self.block[1])
        return self.data.float()

    def dense64(self) -> torch.Tensor:
        """float64 [in, out] copy for the reference GEMM, made once."""
        if self._dense64 is None:
            self._dense64 = self.dequantize().double().t().contiguous()
        return self._dense64

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())


def reference(x: torch.Tensor, weight: PackedWeight, act_block: int | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., in] -> [..., out] in out_dtype.

    Bytes moved: weight.nbytes (read once) + x.numel()*x.element_size() + out.numel()*out.element_size()."""
    a = q8_pow2(x, act_block) if act_block else x.float()
    return torch.matmul(a.double(), weight.dense64()).to(out_dtype)


def dense_reference(x: torch.Tensor, weight64: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A plain (unquantized) product with a float64 [in, out] weight: one rounding to out_dtype."""
    return torch.matmul(x.double(), weight64).to(out_dtype)


# --- Triton kernel ---------------------------------------------------------------------------------------
# One program computes a [BM rows, BN outputs] tile over one K range (split-K). Per row the sum runs over
# K in BK chunks in a fixed order chosen from (N, K) only, never from M, and in float64: products of the
# dequantized operands are exact in float64 and their sum is exact in practice, so the result equals the
# reference bit for bit with quantized operands and is within one rounding of out_dtype otherwise
# (dense weights or `plain` activations). Split-K partial sums are float64, added in split order.

FMT_DENSE, FMT_FP8, FMT_FP4 = 0, 1, 2
_FORMATS = {"dense": FMT_DENSE, "fp8": FMT_FP8, "fp4": FMT_FP4}


@device_function
def act_tile(x_ptr, rows, row_mask, k0, k_end, stride_xm,
             ACT_BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Rows `rows` of x, columns [k0, k0 + BK) (zero past k_end), FP8-quantized per ACT_BLOCK (0 = not),
    as float64 [BM, BK]. A tile never splits an activation block (BK % ACT_BLOCK == 0)."""
    offs_k = k0 + tl.arange(0, BK)
    mask = row_mask[:, None] & (offs_k[None, :] < k_end)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT_BLOCK > 0:
        xb = tl.reshape(x, (BM, BK // ACT_BLOCK, ACT_BLOCK))
        amax = tl.maximum(tmax(tl.abs(xb), axis=2), 1e-4)
        s = pow2_ceil(amax * (1.0 / 448.0))[:, :, None]
        q = e4m3_rne(tl.minimum(tl.maximum(xb / s, -448.0), 448.0))
        x = tl.reshape(q * s, (BM, BK))
    return x.to(tl.float64)


@device_function
def weight_tile(w_ptr, s_ptr, offs_n, n_mask, k0, k_end, stride_wn, stride_sn,
                FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows `offs_n`, columns [k0, k0 + BK) (zero past k_end), dequantized exactly, float64 [BN, BK].
    dense: w_ptr -> [N, K] floats. fp8: w_ptr -> e4m3 [N, K], s_ptr -> E8M0 bytes [ceil(N/BO), ceil(K/BI)].
    fp4: w_ptr -> int8 [N, K/2] (element 2c in the low nibble of byte c), s_ptr -> E8M0 bytes [N, K/32]."""
    offs_k = k0 + tl.arange(0, BK)
    mask = n_mask[:, None] & (offs_k[None, :] < k_end)
    if FMT == 0:
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float64)
    elif FMT == 1:
        c = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        e = tl.load(s_ptr + (offs_n // BO)[:, None] * stride_sn + (offs_k // BI)[None, :], mask=mask, other=127)
        w = c.to(tl.float64) * e8m0_f64(e)
    else:
        offs_b = k0 // 2 + tl.arange(0, BK // 2)
        bmask = n_mask[:, None] & (offs_b[None, :] < k_end // 2)
        byte = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=bmask, other=0).to(tl.int32)
        code = tl.reshape(tl.join(byte & 0xF, (byte >> 4) & 0xF), (BN, BK))
        e = (code >> 1) & 3
        m = code & 1
        # e2m1 -> float32 bits: e = 0 is 0 or 0.5 (m), otherwise (1 + m/2) 2^(e-1); bit 3 is the sign
        bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)) | ((code >> 3) << 31)
        v = bits.to(tl.float32, bitcast=True)
        sc = tl.load(s_ptr + offs_n[:, None] * stride_sn + (offs_k // 32)[None, :], mask=mask, other=127)
        w = v.to(tl.float64) * e8m0_f64(sc)
    return w


@triton.jit
def _kernel(x_ptr,      # activations [M, K] (float32 / bfloat16), row stride stride_xm
            w_ptr,      # weight data (see weight_tile), row stride stride_wn
            s_ptr,      # E8M0 scale bytes (fp8 / fp4), row stride stride_sn; unused for dense
            y_ptr,      # output [M, N] out_dtype, contiguous (written when SPLIT == 1)
            part_ptr,   # float64 [SPLIT, M, N] partial sums (written when SPLIT > 1)
            M, N, K,
            stride_xm, stride_wn, stride_sn,
            k_per_split,  # K columns per split, a multiple of BK
            FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, ACT_BLOCK: tl.constexpr,
            SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < M
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    k_lo = pid_s * k_per_split
    k_end = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BM, BN), dtype=tl.float64)
    for k0 in range(k_lo, k_end, BK):
        a = act_tile(x_ptr, rows, row_mask, k0, k_end, stride_xm, ACT_BLOCK, BM, BK)
        w = weight_tile(w_ptr, s_ptr, offs_n, n_mask, k0, k_end, stride_wn, stride_sn, FMT, BO, BI, BN, BK)
        acc += tsum(a[:, None, :] * w[None, :, :], axis=2)
    mask = row_mask[:, None] & n_mask[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], round_out(acc, OUT_BF16), mask=mask)
    else:
        tl.store(part_ptr + (pid_s * M + rows[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr,  # float64 [SPLIT, MN] partial sums
                y_ptr,     # output [MN] out_dtype
                MN, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    mask = offs < MN
    acc = tl.zeros((B,), dtype=tl.float64)
    for s in range(SPLIT):  # fixed order: the result does not depend on scheduling
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, round_out(acc, OUT_BF16), mask=mask)


def plan(m: int, n: int, k: int, act_block: int, dev: torch.device) -> tuple[int, int, int, int, int]:
    """Block sizes (BM, BN, BK) and split-K (k_per_split, splits). BK and the split depend on (N, K) only,
    so a row's summation order does not depend on how many rows are computed together."""
    if INTERPRET:  # few, large programs: the interpreter pays per program
        bk = max(min(pow2(k), 256), act_block, 32)
        bm, bn = min(pow2(m), 32), min(pow2(n), 128)
        k_per_split = 256 if k > 512 else pow2(k, bk)
    else:
        bk = max(64, act_block)
        bm = min(pow2(m), 8)
        bn = max(16, 8192 // (bm * bk))
        programs = triton.cdiv(n, 64)
        want = max(1, (2 * sm_count(dev)) // programs)
        chunks = triton.cdiv(k, bk)
        splits = max(1, min(want, chunks // 4))
        k_per_split = triton.cdiv(chunks, splits) * bk
    k_per_split = max(bk, triton.cdiv(k_per_split, bk) * bk)
    return bm, bn, bk, k_per_split, triton.cdiv(k, k_per_split)


def check_weight(weight: PackedWeight, arg: str = "weight") -> tuple[int, int]:
    """Shape/format checks shared with the MoE kernels; returns (out, in)."""
    require(weight.format in _FORMATS, f"{arg}.format", weight.format, "must be fp8, fp4 or dense")
    n, k = weight.shape
    if weight.format == "dense":
        require_dtype(weight.data, f"{arg}.data", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        require(tuple(weight.data.shape) == (n, k), f"{arg}.data.shape", tuple(weight.data.shape), f"must be {(n, k)}")
    elif weight.format == "fp8":
        require_dtype(weight.data, f"{arg}.data", (torch.float8_e4m3fn,))
        bo, bi = weight.block
        require(bo > 0 and bi > 0, f"{arg}.block", weight.block, "must be positive")
        require(tuple(weight.data.shape) == (n, k), f"{arg}.data.shape", tuple(weight.data.shape), f"must be {(n, k)}")
        want = (triton.cdiv(n, bo), triton.cdiv(k, bi))
        require(tuple(weight.scale.shape) == want, f"{arg}.scale.shape", tuple(weight.scale.shape), f"must be {want}")
    else:
        require_dtype(weight.data, f"{arg}.data", (torch.int8, torch.uint8))
        require(k % 32 == 0, f"{arg}.shape[1]", k, "FP4 needs a multiple of 32 inputs (one scale per 32)")
        require(tuple(weight.data.shape) == (n, k // 2), f"{arg}.data.shape", tuple(weight.data.shape),
                f"must be {(n, k // 2)} (two e2m1 per byte)")
        require(tuple(weight.scale.shape) == (n, k // 32), f"{arg}.scale.shape", tuple(weight.scale.shape),
                f"must be {(n, k // 32)}")
    require_rows(weight.data, f"{arg}.data")
    if weight.scale is not None:
        require_dtype(weight.scale, f"{arg}.scale", (torch.float8_e8m0fnu, torch.uint8))
        require_rows(weight.scale, f"{arg}.scale")
    return n, k


def kernel_args(weight: PackedWeight):
    """(data, scale bytes, stride_wn, stride_sn, FMT, BO, BI) for weight_tile."""
    fmt = _FORMATS[weight.format]
    data = weight.data.view(torch.int8) if fmt == FMT_FP4 else weight.data
    scale = data if weight.scale is None else weight.scale.view(torch.uint8)
    bo, bi = weight.block if fmt == FMT_FP8 else (1, 32)
    return data, scale, data.stride(0), scale.stride(0) if weight.scale is not None else 0, fmt, bo, bi


def check_act_block(act_block: int | None, k: int) -> int:
    if not act_block:
        return 0
    require(act_block & (act_block - 1) == 0 and act_block <= 256, "act_block", act_block,
            "must be a power of two <= 256")
    require(k % act_block == 0, "act_block", act_block, f"must divide the input size {k}")
    return act_block


def fast(x: torch.Tensor, weight: PackedWeight, act_block: int | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel for `reference`: x [..., in] -> [..., out] in out_dtype (float32 or bfloat16)."""
    n, k = check_weight(weight)
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require(x.shape[-1] == k, "x.shape[-1]", x.shape[-1], f"must equal the weight's input size {k}")
    require(out_dtype in (torch.float32, torch.bfloat16), "out_dtype", out_dtype, "must be float32 or bfloat16")
    ab = check_act_block(act_block, k)
    dev = device_of(x, weight.data)
    x2 = x.reshape(-1, k)
    require_rows(x2, "x")
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    if k == 0:
        return y.zero_().view(*x.shape[:-1], n)
    data, scale, swn, ssn, fmt, bo, bi = kernel_args(weight)
    bm, bn, bk, kps, splits = plan(m, n, k, ab, dev)
    part = torch.empty((splits, m, n), dtype=torch.float64, device=dev) if splits > 1 else y
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), splits)
    _kernel[grid](x2, data, scale, y, part, m, n, k, x2.stride(0), swn, ssn, kps,
                  FMT=fmt, BO=bo, BI=bi, ACT_BLOCK=ab, SPLIT=splits, OUT_BF16=out_dtype == torch.bfloat16,
                  BM=bm, BN=bn, BK=bk)
    if splits > 1:
        b = 1024 if INTERPRET else 256
        _sum_splits[(triton.cdiv(m * n, b),)](part, y, m * n, SPLIT=splits, OUT_BF16=out_dtype == torch.bfloat16,
                                              B=b)
    return y.view(*x.shape[:-1], n)
