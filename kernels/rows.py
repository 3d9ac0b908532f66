"""The rows' side of the weight products (kernels/linear.py, moe.py, engram.py): a tile of the rows read
(RMS-normalized where a product fuses the norm, or dequantized from FP8 table rows: Engram's), their
official FP8 quantization (formats.q8_pow2's codes and powers of two, float32 only), and their staging for
the products in the checkpoint's formats: quantized once per program into a scratch area of its own
(`stage_rows`, `stage_codes`), or, in a long call (a prefill chunk), once for the whole launch by a launch
of their own (`stage_launch`), which every program of the product reads."""

import torch

from ._triton import (
    MMA_ROWS,
    dependent_launch,
    device_function,
    e4m3_codes,
    e8m0_f32,
    pdl,
    pow2,
    pow2_ceil,
    pow2_inverse,
    round_out,
    tl,
    tmax,
    triton,
    tsum,
)


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
        x = quant_tile(x, BM, BK, ACT_BLOCK)
    return x


@device_function
def act_codes(x, BM: tl.constexpr, BK: tl.constexpr, ACT_BLOCK: tl.constexpr):
    """float32 [BM, BK] -> its official FP8 quantization per ACT_BLOCK columns (formats.q8_pow2): e4m3 codes
    [BM, BK // ACT_BLOCK, ACT_BLOCK] and the power of two each block's codes scale by [BM, BK // ACT_BLOCK]."""
    xb = tl.reshape(x, (BM, BK // ACT_BLOCK, ACT_BLOCK))
    s = pow2_ceil(tl.maximum(tmax(tl.abs(xb), axis=2), 1e-4) * (1.0 / 448.0))
    # |x| / s <= amax / s <= 448: within e4m3's range without a clamp
    return e4m3_codes(xb * pow2_inverse(s)[:, :, None]), s


@device_function
def quant_tile(x, BM: tl.constexpr, BK: tl.constexpr, ACT_BLOCK: tl.constexpr):
    """float32 [BM, BK] -> its official FP8 quantization per ACT_BLOCK columns (`act_codes`), as float32."""
    codes, s = act_codes(x, BM, BK, ACT_BLOCK)
    return tl.reshape(codes.to(tl.float32) * s[:, :, None], (BM, BK))


# K tiles the rows' quantization (`stage_codes`) takes a pass: its per-pass costs (addresses, the loop) spread
# over four of the main loop's tiles; 4 x 128 columns of 8 rows is 32 float32 registers a thread at 4 warps
STAGE_TILES = tl.constexpr(4)


@device_function
def scratch_area(qc_ptr, qs_ptr, area, KQ, BM: tl.constexpr):
    """Area `area` of a launch's staging scratch (`stage_scratch`): its codes [BM, KQ] and its powers of two
    [BM, KQ / 32] (an activation block is at least 32 columns)."""
    area = area.to(tl.int64)
    return qc_ptr + area * (BM * KQ), qs_ptr + area * (BM * KQ // 32)


def stage_scratch(areas: int, rows: int, cols: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A launch's scratch for its rows staged (`stage_codes`, `scratch_area`): `areas` areas of `rows` rows'
    e4m3 codes for `cols` columns (uint8) and their powers of two, one per 32 columns at most (float32)."""
    n = areas * rows * cols
    return torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n // 32, dtype=torch.float32, device=dev)


@device_function
def stage_codes(a, qc, qs, c0, KQ, FMT: tl.constexpr, NATIVE: tl.constexpr, ACT_BLOCK: tl.constexpr,
                BM: tl.constexpr, SW: tl.constexpr):
    """Writes the rows' columns [c0, c0 + SW) of a program's span (`a` [BM, SW] float32) quantized
    (`act_codes`) into its scratch for `staged_tile`: e4m3 codes at qc [BM, KQ] (FP4 on the e4m3 MMA: each
    32 columns' even ones, then their odd ones, the order of the re-encoded FP4 codes) and the powers of two
    at qs [BM, KQ / ACT_BLOCK]; columns from KQ on are not stored."""
    codes, s = act_codes(a, BM, SW, ACT_BLOCK)
    xq = tl.reshape(codes, (BM, SW))
    if NATIVE == 2 and FMT == 2:
        xq = tl.reshape(tl.permute(tl.reshape(xq, (BM, SW // 32, 16, 2)), (0, 1, 3, 2)), (BM, SW))
    m = tl.arange(0, BM)[:, None]
    cols = c0 + tl.arange(0, SW)[None, :]
    tl.store(qc + m * KQ + cols, xq.to(tl.uint8, bitcast=True), mask=cols < KQ)
    blocks = c0 // ACT_BLOCK + tl.arange(0, SW // ACT_BLOCK)[None, :]
    tl.store(qs + m * (KQ // ACT_BLOCK) + blocks, s, mask=blocks < KQ // ACT_BLOCK)


@device_function
def stage_rows(x_ptr, rows, row_mask, K, stride_xm, qc, qs, KQ, FMT: tl.constexpr, NATIVE: tl.constexpr,
               ACT_BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Rows `rows` of x, columns [0, K) (zeros up to KQ, a multiple of BK), quantized into a program's scratch
    (`stage_codes`, STAGE_TILES K tiles a pass) for `staged_product`; between barriers: the codes staged before
    are no longer read, and these are all written before they are."""
    tl.debug_barrier()
    SW: tl.constexpr = STAGE_TILES * BK
    for k0 in range(0, KQ, SW):
        stage_codes(act_tile(x_ptr, rows, row_mask, k0, K, stride_xm, 0, BM, SW), qc, qs, k0, KQ, FMT, NATIVE,
                    ACT_BLOCK, BM, SW)
    tl.debug_barrier()


@device_function
def fp8_rows_tile(codes_ptr, scale_ptr, rows, row_mask, k0, K, BM: tl.constexpr, BK: tl.constexpr):
    """Columns [k0, k0 + BK) of rows of e4m3 codes [., K] with one E8M0 byte per 32 columns [., K / 32]
    (Engram's looked-up table rows), dequantized exactly, float32 [BM, BK]; zeros past K."""
    cols = k0 + tl.arange(0, BK)
    r64 = rows[:, None].to(tl.int64)
    code = tl.load(codes_ptr + r64 * K + cols[None, :], mask=row_mask[:, None] & (cols[None, :] < K), other=0.0)
    blocks = k0 // 32 + tl.arange(0, BK // 32)  # BK is a multiple of 32: the tile holds whole scale blocks
    e = tl.load(scale_ptr + r64 * (K // 32) + blocks[None, :], mask=row_mask[:, None] & (blocks[None, :] * 32 < K),
                other=127)
    return tl.reshape(tl.reshape(code.to(tl.float32), (BM, BK // 32, 32)) * e8m0_f32(e)[:, :, None], (BM, BK))


@device_function
def row_rms(x_ptr, rows, M, K, stride_xm, eps, BM: tl.constexpr, BKN: tl.constexpr):
    """The rows' reciprocal RMS over their K inputs, BKN-wide blocks added in order (RMSNorm's float32)."""
    ss = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BKN):
        offs_k = k0 + tl.arange(0, BKN)
        xv = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                     mask=(rows[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        ss += tsum(xv * xv, axis=1)
    return 1.0 / tl.sqrt_rn(ss / K + eps)


@device_function
def row_tile(x_base, rows, row_mask, k0, k_end, stride_xm, r, nw_ptr, NORM: tl.constexpr, X_BF16: tl.constexpr,
             BM: tl.constexpr, BK: tl.constexpr):
    """The rows' float32 tile [BM, BK] at k0. NORM: RMS-normalized first (`r` their reciprocal RMS, `nw_ptr`
    the weight) and rounded to x's dtype, as the RMSNorm kernel computes them."""
    if NORM:
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < k_end
        xv = tl.load(x_base + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                     mask=row_mask[:, None] & km[None, :], other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
        a = round_out(nw[None, :] * (xv * r[:, None]), X_BF16).to(tl.float32)
    else:
        a = act_tile(x_base, rows, row_mask, k0, k_end, stride_xm, 0, BM, BK)
    return a


# A long call's rows quantized once for every program of its products (PRESTAGED, `stage_launch`): program j
# writes rows [j 16, (j + 1) 16) of x (zeros past M), RMS-normalized first with NORM (FP8_ROWS: x's e4m3
# codes dequantized by their E8M0 bytes at nw_ptr), as `stage_codes` lays them out: row r's codes at
# qc + r KQ, its powers of two at qs + r KQ / ACT_BLOCK. 16 rows a program: a short call's staging tile.
@triton.jit(do_not_specialize=["M"])  # row counts vary call by call: one compile
def _stage_kernel(x_ptr, nw_ptr, qc_ptr, qs_ptr, M, K, KQ, stride_xm, norm_eps, NORM: tl.constexpr,
                  FP8_ROWS: tl.constexpr, X_BF16: tl.constexpr, FMT: tl.constexpr, NATIVE: tl.constexpr,
                  ACT_BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BKN: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    first = tl.program_id(0).to(tl.int64) * BM
    rows = first + tl.arange(0, BM)
    r = tl.zeros((BM,), dtype=tl.float32)
    if NORM:
        r = row_rms(x_ptr, rows, M, K, stride_xm, norm_eps, BM, BKN)
    SW: tl.constexpr = STAGE_TILES * BK
    for k0 in range(0, KQ, SW):
        if FP8_ROWS:
            a = fp8_rows_tile(x_ptr, nw_ptr, rows, rows < M, k0, K, BM, SW)
        else:
            a = row_tile(x_ptr, rows, rows < M, k0, K, stride_xm, r, nw_ptr, NORM, X_BF16, BM, SW)
        stage_codes(a, qc_ptr + first * KQ, qs_ptr + first * (KQ // ACT_BLOCK), k0, KQ, FMT, NATIVE, ACT_BLOCK,
                    BM, SW)


def stage_launch(x2: torch.Tensor, nw: torch.Tensor, eps: float, norm: bool, fmt: int, native: int, act_block: int,
                 rows: int, bk: int, fp8_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x2 [M, W]'s rows quantized once (`_stage_kernel`), `rows` of them (M and zero rows after it, as many
    as the products' programs read): (codes, powers of two, KQ: the codes' row width, W rounded up to bk).
    `fp8_scales`: x2 is e4m3 codes with these E8M0 bytes [M, W / 32] (dequantized first)."""
    m, w = x2.shape
    kq = triton.cdiv(w, bk) * bk
    qc, qs = stage_scratch(1, triton.cdiv(rows, MMA_ROWS) * MMA_ROWS, kq, x2.device)
    _stage_kernel[(triton.cdiv(rows, MMA_ROWS),)](
        x2, nw if fp8_scales is None else fp8_scales, qc, qs, m, w, kq, x2.stride(0), float(eps), NORM=norm,
        FP8_ROWS=fp8_scales is not None, X_BF16=x2.dtype == torch.bfloat16, FMT=fmt, NATIVE=native,
        ACT_BLOCK=act_block, BM=MMA_ROWS, BK=bk, BKN=min(pow2(w), 1024), **pdl(x2.device))
    return qc, qs, kq
