"""Linear layers with quantized weights: y = x W^T for FP8 (e4m3 + E8M0 block scales), FP4 (packed e2m1
+ E8M0 per 32 inputs) or dense weights, with the official FP8 activation quantization of x in front.
`groups` > 1: a grouped product (V4's `wo_a`): output rows [g N/G, (g+1) N/G) read input columns
[g K, (g+1) K) of x [..., G K].

Reference numerics: the activation is rounded to power-of-two-scaled e4m3 per `act_block` elements
(none in `plain` numerics), the product is accumulated in float64 and rounded once to `out_dtype`.

Kernel (`fast`), float32 only (no float64 instruction; checked on the compiled PTX):
- Weights are read in their stored format and dequantized in registers to exact values: an e4m3 or e2m1
  code times its E8M0 power of two has at most 4 significant bits, so every FP8/FP4 weight value (and
  every bfloat16 weight) is a bfloat16 value. No dequantized copy is ever made.
- Activations: with `act_block`, quantized in the kernel with the reference's float32 operations (the same
  e4m3 codes and scales), which makes them bfloat16 values; bfloat16 activations are; float32 activations
  are split exactly into three bfloat16 parts, x = hi + mid + lo (8 significant bits each).
- Products: per K tile and activation part one `tl.dot` of the weight tile [BN, BK] with the rows' tile
  transposed [BK, 16]: on the GPU a bfloat16 tensor-core product (each product exact, sums in float32),
  under the interpreter a float32 matmul. Dense float32/float16 weights (no checkpoint stores them) take a
  float32 FMA dot instead.
- Batch invariance by construction: a program always holds 16 rows (the instruction's N side, unused rows
  masked), so a row meets the same instructions in the same order whether 1 or 16 rows share the launch;
  BN, BK and the split-K boundaries are chosen from (N, K) only; split partials (float32) are added in
  split order. A verify block's rows therefore equal single-row calls bit for bit.
- Offsets that multiply a row index are int64.
Tolerance against `reference`: |y - y_ref| <= K 2^-23 sum_k |x_k w_k| (float32 accumulation of exact
products, truncating adds on tensor cores) plus one rounding of out_dtype; the activation codes are the
reference's. In practice about sqrt(K) 2^-24 of the sum of magnitudes.
"""

from dataclasses import dataclass, field

import torch

from ._triton import (
    INTERPRET,
    MMA_ROWS,
    bf16_value,
    device_function,
    device_of,
    e4m3_rne,
    e8m0_f32,
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
    _grouped64: torch.Tensor | None = field(default=None, repr=False)

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
        """float64 [in, out] copy for the reference GEMM, made once (the reference path only)."""
        if self._dense64 is None:
            self._dense64 = self.dequantize().double().t().contiguous()
        return self._dense64

    def grouped64(self, groups: int) -> torch.Tensor:
        """float64 [G, in, out/G] copy for the reference grouped product, made once (the reference path only)."""
        if self._grouped64 is None:
            n, k = self.shape
            self._grouped64 = self.dequantize().view(groups, n // groups, k).transpose(1, 2).double()
        return self._grouped64

    @property
    def bf16_exact(self) -> bool:
        """Whether every weight value is a bfloat16 value (FP8, FP4 and bfloat16 data are)."""
        return self.format != "dense" or self.data.dtype == torch.bfloat16

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())


def reference(x: torch.Tensor, weight: PackedWeight, act_block: int | None, out_dtype: torch.dtype,
              groups: int = 1) -> torch.Tensor:
    """x [..., G in] -> [..., out] in out_dtype (G = groups; each group of out/G outputs reads its own
    `in` inputs).

    Bytes moved: weight.nbytes (read once) + x.numel()*x.element_size() + out.numel()*out.element_size()."""
    a = (q8_pow2(x, act_block) if act_block else x.float()).double().reshape(-1, x.shape[-1])
    if groups == 1:
        y = rows_matmul(a, weight.dense64())
    else:
        a = a.reshape(-1, groups, x.shape[-1] // groups)
        w = weight.grouped64(groups)
        y = torch.stack([rows_matmul(a[:, g], w[g]) for g in range(groups)], 1)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)


def rows_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ w [K, N] in float64, one row per call. A BLAS chooses its blocking, and so the order of a
    row's float64 sum, from the call's shape: with every call one row, a row's sum does not depend on how
    many rows came with it, so a verify block on the reference path equals single steps bit for bit (one
    M-dependent last bit in ~10^7 products, rounded across an FP8 or bfloat16 boundary, otherwise changes a
    logit). A decode row costs one vector-matrix product (a padded block of rows cost 16)."""
    if a.shape[0] == 1:
        return a @ w
    return torch.cat([a[i:i + 1] @ w for i in range(a.shape[0])])


# --- Triton kernel ---------------------------------------------------------------------------------------
# One program computes a [BN outputs, 16 rows] tile over one K range (split-K): weight tile [BN, BK] times
# the rows' activation tile transposed, K tiles in order, one float32 accumulator. See the module docstring
# for why each row's result does not depend on the other rows.

FMT_DENSE, FMT_FP8, FMT_FP4 = 0, 1, 2
_FORMATS = {"dense": FMT_DENSE, "fp8": FMT_FP8, "fp4": FMT_FP4}


@device_function
def act_tile(x_ptr, rows, row_mask, k0, k_end, stride_xm,
             ACT_BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Rows `rows` of x, columns [k0, k0 + BK) (zero past k_end), FP8-quantized per ACT_BLOCK (0 = not),
    as float32 [BM, BK]. A tile never splits an activation block (BK % ACT_BLOCK == 0)."""
    offs_k = k0 + tl.arange(0, BK)
    mask = row_mask[:, None] & (offs_k[None, :] < k_end)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if ACT_BLOCK > 0:
        xb = tl.reshape(x, (BM, BK // ACT_BLOCK, ACT_BLOCK))
        amax = tl.maximum(tmax(tl.abs(xb), axis=2), 1e-4)
        s = pow2_ceil(amax * (1.0 / 448.0))[:, :, None]
        q = e4m3_rne(tl.minimum(tl.maximum(xb / s, -448.0), 448.0))
        x = tl.reshape(q * s, (BM, BK))
    return x


@device_function
def weight_tile(w_rows, s_rows, n_mask, k0, k_end,
                FMT: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows (`w_rows`: a pointer per row), columns [k0, k0 + BK) (zero past k_end), dequantized
    exactly, float32 [BN, BK]. dense: rows of floats. fp8: rows of e4m3 codes; `s_rows` points at each row's
    row of E8M0 bytes (one per BI inputs). fp4: rows of int8 (element 2c in the low nibble of byte c);
    `s_rows` at each row's E8M0 bytes, one per 32 inputs (BI = 32). k0 is a multiple of BK, and BK of BI
    or BI of BK, so a tile holds whole scale blocks or lies in one."""
    offs_k = k0 + tl.arange(0, BK)
    mask = n_mask[:, None] & (offs_k[None, :] < k_end)
    if FMT == 0:
        w = tl.load(w_rows[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        if FMT == 1:
            v = tl.load(w_rows[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            offs_b = k0 // 2 + tl.arange(0, BK // 2)
            bmask = n_mask[:, None] & (offs_b[None, :] < k_end // 2)
            byte = tl.load(w_rows[:, None] + offs_b[None, :], mask=bmask, other=0).to(tl.int32)
            code = tl.reshape(tl.join(byte & 0xF, (byte >> 4) & 0xF), (BN, BK))
            e = (code >> 1) & 3
            m = code & 1
            # e2m1 -> float32 bits: e = 0 is 0 or 0.5 (m), otherwise (1 + m/2) 2^(e-1); bit 3 is the sign
            bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)) | ((code >> 3) << 31)
            v = bits.to(tl.float32, bitcast=True)
        if BK >= BI:  # BK // BI scale blocks per row of the tile
            blocks = k0 // BI + tl.arange(0, BK // BI)
            sc = tl.load(s_rows[:, None] + blocks[None, :], mask=n_mask[:, None] & (blocks[None, :] * BI < k_end),
                         other=127)
            w = tl.reshape(tl.reshape(v, (BN, BK // BI, BI)) * e8m0_f32(sc)[:, :, None], (BN, BK))
        else:  # the tile lies in one scale block
            sc = tl.load(s_rows + k0 // BI, mask=n_mask, other=127)
            w = v * e8m0_f32(sc)[:, None]
    return w


@device_function
def mma(w, x, acc, DOT_BF16: tl.constexpr):
    """acc [BN, BM] += w [BN, BK] . x [BM, BK]^T (see dot_operand)."""
    if DOT_BF16:
        acc = tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)), acc)
    else:
        acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return acc


@device_function
def mma_parts(w, x, acc, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr):
    """acc += w . x^T with x in X_PARTS exact bfloat16 parts (1: x is bfloat16 values; 3: hi + mid + lo)."""
    if X_PARTS == 1:
        acc = mma(w, x, acc, DOT_BF16)
    else:
        hi = bf16_value(x)
        r = x - hi  # exact: hi is x rounded to 8 significant bits
        mid = bf16_value(r)
        acc = mma(w, hi, acc, DOT_BF16)
        acc = mma(w, mid, acc, DOT_BF16)
        acc = mma(w, r - mid, acc, DOT_BF16)
    return acc


@triton.jit
def _kernel(x_ptr,      # activations [M, G K] (float32 / bfloat16), row stride stride_xm
            w_ptr,      # weight data (see weight_tile) [N, K], row stride stride_wn
            s_ptr,      # E8M0 scale bytes (fp8 / fp4), row stride stride_sn; unused for dense
            y_ptr,      # output [M, N] out_dtype, contiguous (written when SPLIT == 1)
            part_ptr,   # float32 [SPLIT, M, N] partial sums (written when SPLIT > 1)
            M, N, K,
            stride_xm, stride_wn, stride_sn,
            k_per_split,  # K columns per split, a multiple of BK
            n_per_group,  # outputs per group (N when not grouped); a multiple of BN
            FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, ACT_BLOCK: tl.constexpr,
            X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < M
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    x_base = x_ptr + ((pid_n * BN) // n_per_group) * K  # the program's group of input columns
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // BO).to(tl.int64) * stride_sn
    k_lo = pid_s * k_per_split
    k_end = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_lo, k_end, BK):
        w = weight_tile(w_rows, s_rows, n_mask, k0, k_end, FMT, BI, BN, BK)
        a = act_tile(x_base, rows, row_mask, k0, k_end, stride_xm, ACT_BLOCK, BM, BK)
        acc = mma_parts(w, a, acc, X_PARTS, DOT_BF16)
    mask = n_mask[:, None] & row_mask[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None], round_out(acc, OUT_BF16), mask=mask)
    else:
        tl.store(part_ptr + (pid_s * M + rows[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr,  # float32 [SPLIT, MN] partial sums
                y_ptr,     # output [MN] out_dtype
                MN, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, B: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    mask = offs < MN
    acc = tl.zeros((B,), dtype=tl.float32)
    for s in range(SPLIT):  # fixed order: the result does not depend on scheduling
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, round_out(acc, OUT_BF16), mask=mask)


def plan(n: int, k: int, act_block: int, n_per_group: int, dev: torch.device) -> tuple[int, int, int, int, int]:
    """Block sizes (BM, BN, BK) and split-K (k_per_split, splits), from (N, K) only: never from the number
    of rows, so a row's summation order does not depend on how many rows are computed together."""
    bm = MMA_ROWS
    if INTERPRET:  # few, large programs: the interpreter pays per operation, whatever its size
        bk = max(min(pow2(k), 512), act_block, 32)
        bn = min(pow2(n), 1024)
        k_per_split = 512 if k > 512 else pow2(k, bk)
    else:
        bk = max(64, act_block)
        bn = 64 if n <= 4096 else 128
        programs = triton.cdiv(n, bn)
        want = max(1, (2 * sm_count(dev)) // programs)
        chunks = triton.cdiv(k, bk)
        splits = max(1, min(want, chunks // 4))
        k_per_split = triton.cdiv(chunks, splits) * bk
    if n_per_group < n:  # grouped: a tile never straddles two groups
        bn = max(16, min(bn, n_per_group & -n_per_group))
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
        require(bo > 0 and bi > 0 and bi & (bi - 1) == 0, f"{arg}.block", weight.block,
                "must be positive, the input block a power of two")
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


def fast(x: torch.Tensor, weight: PackedWeight, act_block: int | None, out_dtype: torch.dtype,
         groups: int = 1) -> torch.Tensor:
    """The kernel for `reference`: x [..., G in] -> [..., out] in out_dtype (float32 or bfloat16)."""
    n, k = check_weight(weight)
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require(groups >= 1 and n % groups == 0, "groups", groups, f"must divide the weight's outputs {n}")
    require(x.shape[-1] == groups * k, "x.shape[-1]", x.shape[-1],
            f"must equal the weight's input size {k} times groups {groups}")
    require(out_dtype in (torch.float32, torch.bfloat16), "out_dtype", out_dtype, "must be float32 or bfloat16")
    ng = n // groups
    require(groups == 1 or ng % 16 == 0, "weight.shape[0]", n, f"grouped: outputs per group ({ng}) must be a "
            "multiple of 16")
    ab = check_act_block(act_block, k)
    dev = device_of(x, weight.data)
    x2 = x.reshape(-1, groups * k)
    require_rows(x2, "x")
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    if k == 0:
        return y.zero_().view(*x.shape[:-1], n)
    data, scale, swn, ssn, fmt, bo, bi = kernel_args(weight)
    bm, bn, bk, kps, splits = plan(n, k, ab, ng, dev)
    exact = weight.bf16_exact
    x_parts = 3 if exact and not ab and x.dtype == torch.float32 else 1
    part = torch.empty((splits, m, n), dtype=torch.float32, device=dev) if splits > 1 else y
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), splits)
    _kernel[grid](x2, data, scale, y, part, m, n, k, x2.stride(0), swn, ssn, kps, ng,
                  FMT=fmt, BO=bo, BI=bi, ACT_BLOCK=ab, X_PARTS=x_parts, DOT_BF16=exact and not INTERPRET,
                  SPLIT=splits, OUT_BF16=out_dtype == torch.bfloat16, BM=bm, BN=bn, BK=bk)
    if splits > 1:
        b = 1024 if INTERPRET else 256
        _sum_splits[(triton.cdiv(m * n, b),)](part, y, m * n, SPLIT=splits, OUT_BF16=out_dtype == torch.bfloat16,
                                              B=b)
    return y.view(*x.shape[:-1], n)
