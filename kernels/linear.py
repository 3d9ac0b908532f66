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
- A launch whose every product has FP8/FP4 weights and quantized rows (official numerics) multiplies in
  the checkpoint's own formats where the tensor cores take them (`staged_tile`, `_triton.native_products`).
  Each program first quantizes its rows once, STAGE_TILES K tiles a pass, into a scratch of its own
  (`stage_codes`: e4m3 codes and powers of two, the reference's; the rows' quantization inside the K loop,
  in the MMA operand's layout, cost 3-4x as many instructions), then streams the weights: on sm_100 and
  later the weight codes as stored and the rows' codes, with their E8M0 bytes, on the block-scaled MMA
  (`tl.dot_scaled`; 128 outputs a tile, its M side); on sm_89/90 on the e4m3 MMA, one product per block of
  columns that one weight scale and one row scale cover (32 for V4.1's 32x32 blocks and for FP4, whose e2m1
  codes are re-encoded as e4m3 codes of value / 64 by byte-wise shifts and masks), times the two powers of
  two and added in float32 in block order (256 outputs a tile; 8 rows a program, E4M3_MMA_ROWS: that
  epilogue is paid per row). The products are the same exact values. Nothing is dequantized in registers:
  about 1.6 instructions issued per weight element in the main loop on sm_103 (0.6 more staging the rows)
  and 2.0 to 3.4 on sm_90 (0.1-0.2 staging), where the bfloat16 path issues 9 to 69 (tests/gpu_dry_run.py
  measures it). `--numerics plain` (float32 rows, not quantized) keeps the bfloat16 path on every target.
- Batch invariance by construction: a program always holds 16 rows (8 on the e4m3 MMA: the instruction's N
  side, unused rows masked), so a row meets the same instructions in the same order whether 1 or 16 rows
  share the launch; BN, BK and the split-K boundaries are chosen from (N, K) only; split partials (float32)
  are added in split order. A verify block's rows therefore equal single-row calls bit for bit.
- A long call (a prefill chunk, inside `_triton.long_calls`) in the checkpoint's formats: programs of
  LONG_ROWS (128) rows on the block-scaled MMA, E4M3_LONG_ROWS (32) on the e4m3 MMA, so a weight tile
  streams once per 128 (32) rows; the rows are quantized once for the launch by a launch of their own
  (`stage_launch`: the same codes `stage_codes` writes, RMS-normalized first where the products fuse the
  norm), which every program reads (PRESTAGED). Every chunk of a prompt takes these programs whatever its
  size, so a prompt's rows do not depend on its chunks (bit for bit); a long call's row is not promised
  equal to the same row in a short one (a wider MMA; see `_triton.LONG_ROWS`).
  No launch of a long call splits K (its row blocks fill the device), whatever its programs' rows; on the
  block-scaled MMA its K tiles are 256 columns (`plan`), and a launch of products in the checkpoint's formats
  beside plain ones is two (`native_split`).
- `rows` (ROWS): an attention's row work on the query products it computes, in their launch
  (kernels/query_inputs.py; each program rotates the tile it stored, one more a row writes its window key).
- Offsets that multiply a row index are int64.
Tolerance against `reference`: |y - y_ref| <= K 2^-23 sum_k |x_k w_k| (float32 accumulation of exact
products, truncating adds on tensor cores) plus one rounding of out_dtype; the activation codes are the
reference's. In practice about sqrt(K) 2^-24 of the sum of magnitudes. On the e4m3 MMA of sm_89/90 the
hardware adds a block's products keeping about 14 significant bits (DeepSeek-V3's report measured it on
H800; its kernels promote each block's sum to float32, as these do): 2^-13 sum_k |x_k w_k| more.
"""

from dataclasses import dataclass, field

import torch

from ._triton import (
    INTERPRET,
    LONG_ROWS,
    NATIVE_BLOCK_SCALED,
    NATIVE_E4M3,
    bf16_value,
    counters,
    dependent_launch,
    device_function,
    device_of,
    e2m1_high_as_e4m3,
    e2m1_low_as_e4m3,
    e8m0_f32,
    in_long_calls,
    is_long,
    native_products,
    pdl,
    pow2,
    product_rows,
    require,
    require_dtype,
    require_rows,
    round_out,
    sm_count,
    tl,
    triton,
)
from .attn_inputs import QueryRows, key_row, rope_tile, row_work_args
from .formats import dequant_fp4, dequant_fp8, q8_pow2
from .rank_sum import Publish, publish_slot, rank_publish
from .rows import (
    STAGE_TILES,
    quant_tile,
    row_rms,
    row_tile,
    scratch_area,
    stage_codes,
    stage_launch,
    stage_scratch,
)


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
              groups: int = 1, publish: None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., G in] -> [..., out] in out_dtype (G = groups; each group of out/G outputs reads its own
    `in` inputs), written into `out` where given (a caller's buffer of that shape and dtype). `publish` (the
    kernel's, into symmetric memory): not here.

    Bytes moved: weight.nbytes (read once) + x.numel()*x.element_size() + out.numel()*out.element_size()."""
    require(publish is None, "publish", publish, "the reference product is not published (the fast path's is)")
    a = (q8_pow2(x, act_block) if act_block else x.float()).double().reshape(-1, x.shape[-1])
    if groups == 1:
        y = rows_matmul(a, weight.dense64())
    else:
        a = a.reshape(-1, groups, x.shape[-1] // groups)
        w = weight.grouped64(groups)
        y = torch.stack([rows_matmul(a[:, g], w[g]) for g in range(groups)], 1)
    y = y.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)
    return y if out is None else out.copy_(y)


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
def weight_codes(w_rows, s_rows, n_mask, k0, k_end,
                 FMT: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows' columns [k0, k0 + BK) as stored, for the block-scaled MMA: e4m3 codes [BN, BK] (fp8) or
    e2m1 pairs [BN, BK // 2] (fp4: two a byte, the low nibble first) and one E8M0 byte per 32 columns
    [BN, BK // 32] (an FP8 block of BI columns repeats its byte); zero codes (and scale 2^0) past k_end."""
    blocks = k0 // 32 + tl.arange(0, BK // 32)
    sc = tl.load(s_rows[:, None] + (blocks * 32 // BI)[None, :], mask=n_mask[:, None] & (blocks[None, :] * 32 < k_end),
                 other=127).to(tl.uint8, bitcast=True)
    if FMT == 1:
        offs_k = k0 + tl.arange(0, BK)
        w = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < k_end), other=0.0)
    else:
        offs_b = k0 // 2 + tl.arange(0, BK // 2)
        w = tl.load(w_rows[:, None] + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < k_end // 2),
                    other=0).to(tl.uint8, bitcast=True)
    return w, sc


@device_function
def mxf_mma(w, ws, x, xs, acc, FMT: tl.constexpr):
    """acc [BN, BM] += w . x^T on the block-scaled MMA: weight codes and bytes (`weight_codes`), the rows'
    e4m3 codes and bytes (`quant_codes`). Every product of two codes is exact; sums in float32."""
    return tl.dot_scaled(w, ws, "e4m3" if FMT == 1 else "e2m1", tl.trans(x), xs, "e4m3", acc)


@device_function
def column_half(x, HIGH: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    """x [R, W] -> its columns [0, W/2), or [W/2, W) with HIGH."""
    lo, hi = tl.split(tl.permute(tl.reshape(x, (R, 2, W // 2)), (0, 2, 1)))
    return hi if HIGH else lo


@device_function
def column_block(x, J: tl.constexpr, NB: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    """x [R, W] -> its J-th block of W / NB columns (NB a power of two, at most 16): halves of halves, no
    arithmetic."""
    if NB >= 16:
        x = column_half(x, (J >> 3) & 1, R, W)
    if NB >= 8:
        x = column_half(x, (J >> 2) & 1, R, W * 8 // NB)
    if NB >= 4:
        x = column_half(x, (J >> 1) & 1, R, W * 4 // NB)
    if NB >= 2:
        x = column_half(x, J & 1, R, W * 2 // NB)
    return x


@device_function
def e4m3_product(w_rows, s_rows, n_mask, xq, s, k0, k_end, acc, FMT: tl.constexpr, BI: tl.constexpr,
                 ACT_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BN, BM] += the weight rows' columns [k0, k0 + BK) times the rows' codes `xq` [BM, BK] and powers
    of two `s` [BM, BK / ACT_BLOCK] (`stage_codes`), on the e4m3 MMA (NATIVE_E4M3): per block of C columns that one
    weight scale and one row scale cover (FP4: 32) the product of the e4m3 codes (FP4's re-encoded:
    `e2m1_low_as_e4m3`), exact products summed by the MMA, times the weight's power of two, added in float32
    in block order; each activation block's sum times the row's power of two (and FP4's 2^6) into acc."""
    C: tl.constexpr = 32 if FMT == 2 else (BI if BI < ACT_BLOCK else ACT_BLOCK)
    NA: tl.constexpr = BK // ACT_BLOCK
    for blk in tl.static_range(NA):
        acc_b = tl.zeros((BN, BM), dtype=tl.float32)
        for j in tl.static_range(ACT_BLOCK // C):
            col = k0 + blk * ACT_BLOCK + j * C
            x = column_block(xq, blk * (ACT_BLOCK // C) + j, BK // C, BM, BK)
            sc = tl.load(s_rows + col // BI, mask=n_mask & (col + tl.arange(0, 1) < k_end), other=127)
            if FMT == 1:
                offs = col + tl.arange(0, C)
                w = tl.load(w_rows[:, None] + offs[None, :], mask=n_mask[:, None] & (offs[None, :] < k_end),
                            other=0.0)
            else:
                offs = col // 2 + tl.arange(0, 16)
                b = tl.load(w_rows[:, None] + offs[None, :], mask=n_mask[:, None] & (offs[None, :] < k_end // 2),
                            other=0).to(tl.uint8, bitcast=True)
                pairs = tl.join(e2m1_low_as_e4m3(b), e2m1_high_as_e4m3(b))  # [BN, 16, 2]: columns 2i, 2i + 1
                w = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BN, 32)).to(tl.float8e4nv, bitcast=True)
            acc_b = tl.fma(tl.dot(w, tl.trans(x)), e8m0_f32(sc)[:, None], acc_b)
        sx = tl.reshape(column_block(s, blk, NA, BM, NA), (BM,))
        acc = tl.fma(acc_b, (sx * (64.0 if FMT == 2 else 1.0))[None, :], acc)
    return acc


@device_function
def staged_tile(w_rows, s_rows, n_mask, qc, qs, qrows, c0, KQ, k0, k_end, acc, FMT: tl.constexpr, BI: tl.constexpr,
                ACT_BLOCK: tl.constexpr, NATIVE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BN, BM] += the weight rows' columns [k0, k0 + BK) times the rows' columns [c0, c0 + BK) as
    `stage_codes` wrote them (rows `qrows` [BM] of the codes at qc/qs), in the checkpoint's formats as NATIVE
    says: NATIVE_BLOCK_SCALED (1) on the block-scaled MMA (`mxf_mma`, the rows' powers of two as E8M0 bytes),
    NATIVE_E4M3 (2) `e4m3_product`."""
    NA: tl.constexpr = BK // ACT_BLOCK
    m = qrows.to(tl.int64)[:, None]
    xq = tl.load(qc + m * KQ + c0 + tl.arange(0, BK)[None, :]).to(tl.float8e4nv, bitcast=True)
    s = tl.load(qs + m * (KQ // ACT_BLOCK) + c0 // ACT_BLOCK + tl.arange(0, NA)[None, :])
    if NATIVE == 1:  # one exponent byte per 32 columns: the 32-column blocks of an ACT_BLOCK share its
        e = ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
        xs = tl.reshape(tl.broadcast_to(e[:, :, None], (BM, NA, ACT_BLOCK // 32)), (BM, BK // 32))
        w, ws = weight_codes(w_rows, s_rows, n_mask, k0, k_end, FMT, BI, BN, BK)
        acc = mxf_mma(w, ws, xq, xs, acc, FMT)
    else:
        acc = e4m3_product(w_rows, s_rows, n_mask, xq, s, k0, k_end, acc, FMT, BI, ACT_BLOCK, BM, BN, BK)
    return acc


@device_function
def staged_product(w_rows, s_rows, n_mask, qc, qs, qrows, K, KQ, acc, FMT: tl.constexpr, BI: tl.constexpr,
                   ACT_BLOCK: tl.constexpr, NATIVE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """acc [BN, BM] += the weight rows' columns [0, K) times the rows `qrows` of the codes `stage_rows` or
    `stage_launch` staged (`staged_tile`)."""
    for k0 in range(0, K, BK):
        acc = staged_tile(w_rows, s_rows, n_mask, qc, qs, qrows, k0, KQ, k0, K, acc, FMT, BI, ACT_BLOCK, NATIVE, BM,
                          BN, BK)
    return acc


@device_function
def weight_product(w_rows, s_rows, n_mask, a, k0, k_end, acc, FMT: tl.constexpr, BI: tl.constexpr,
                   ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BN, BM] += the weight rows' columns [k0, k0 + BK) times the rows' float32 tile `a` [BM, BK]
    (FP8-quantized per ACT_BLOCK here, 0: not), the weights dequantized to bfloat16 values (`weight_tile`,
    `mma_parts`). FP8/FP4 weights with quantized rows multiply in the checkpoint's formats where the device
    can (NATIVE): the rows quantized once before the K loop (`stage_rows` / `staged_product`), not here."""
    tl.static_assert(NATIVE == 0 or ACT_BLOCK < 32 or FMT == 0, "native products take staged rows")
    if ACT_BLOCK > 0:
        a = quant_tile(a, BM, BK, ACT_BLOCK)
    acc = mma_parts(weight_tile(w_rows, s_rows, n_mask, k0, k_end, FMT, BI, BN, BK), a, acc, X_PARTS, DOT_BF16)
    return acc


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


@device_function
def product_tile(x_base, w_ptr, s_ptr, rows, row_mask, offs_n, n_mask, k_lo, k_end, stride_xm, stride_wn, stride_sn,
          r, nw_ptr, qc, qs, KQ, c_base, NORM: tl.constexpr, X_BF16: tl.constexpr, FMT: tl.constexpr,
          BO: tl.constexpr, BI: tl.constexpr, ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr,
          NATIVE: tl.constexpr, PRESTAGED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """float32 [BN, BM]: outputs offs_n of rows `rows` summed over the inputs [k_lo, k_end) of x_base, K tiles
    in order (`row_tile`, `weight_product`). In the checkpoint's formats the rows are quantized once, into
    the program's scratch `qc`/`qs` (`stage_codes`), before the weights stream; PRESTAGED: the launch's
    `stage_launch` quantized them already, every column of x (input k of x_base at column c_base + k)."""
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // BO).to(tl.int64) * stride_sn
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if NATIVE > 0 and ACT_BLOCK >= 32 and FMT > 0:
        if PRESTAGED:
            shift = c_base
            qrows = rows
        else:
            shift = -k_lo
            qrows = tl.arange(0, BM)
            SW: tl.constexpr = STAGE_TILES * BK
            for k0 in range(k_lo, k_end, SW):
                a = row_tile(x_base, rows, row_mask, k0, k_end, stride_xm, r, nw_ptr, NORM, X_BF16, BM, SW)
                stage_codes(a, qc, qs, k0 - k_lo, KQ, FMT, NATIVE, ACT_BLOCK, BM, SW)
            tl.debug_barrier()  # every thread's codes are written before any thread reads them
        for k0 in range(k_lo, k_end, BK):
            acc = staged_tile(w_rows, s_rows, n_mask, qc, qs, qrows, k0 + shift, KQ, k0, k_end, acc, FMT, BI,
                              ACT_BLOCK, NATIVE, BM, BN, BK)
    else:
        for k0 in range(k_lo, k_end, BK):
            a = row_tile(x_base, rows, row_mask, k0, k_end, stride_xm, r, nw_ptr, NORM, X_BF16, BM, BK)
            acc = weight_product(w_rows, s_rows, n_mask, a, k0, k_end, acc, FMT, BI, ACT_BLOCK, X_PARTS, DOT_BF16,
                                 NATIVE, BM, BN, BK)
    return acc


@device_function
def _epilogue(acc, y_ptr, rows, row_mask, offs_n, n_mask, N, hc, X_ptr, post_ptr, comb_ptr,
              OUT_BF16: tl.constexpr, EXPAND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BHC: tl.constexpr):
    """Store acc [BN, BM] rounded to the output dtype, or (EXPAND) the mHC expand of that product:
    out[m, k, n] = post[m, k] y[m, n] + sum_j comb[m, j, k] X[m, j, n] (kernels/mhc.py's float32 arithmetic,
    the copies in order)."""
    mask = n_mask[:, None] & row_mask[None, :]
    r64 = rows.to(tl.int64)
    if EXPAND:
        y = round_out(acc, OUT_BF16).to(tl.float32)  # [BN, BM]: the product in X's dtype
        k = tl.arange(0, BHC)
        km = row_mask[None, :] & (k[:, None] < hc)  # [BHC, BM]
        post = tl.load(post_ptr + rows[None, :] * hc + k[:, None], mask=km, other=0.0)
        mixed = tl.zeros((BHC, BN, BM), dtype=tl.float32)
        for j in range(hc):
            cj = tl.load(comb_ptr + (rows[None, :] * hc + j) * hc + k[:, None], mask=km, other=0.0)
            xj = tl.load(X_ptr + (r64[None, :] * hc + j) * N + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
            mixed += cj[:, None, :] * xj[None, :, :]
        out = post[:, None, :] * y[None, :, :] + mixed
        tl.store(y_ptr + (r64[None, None, :] * hc + k[:, None, None]) * N + offs_n[None, :, None],
                 round_out(out, OUT_BF16), mask=km[:, None, :] & mask[None, :, :])
    else:
        tl.store(y_ptr + r64[None, :] * N + offs_n[:, None], round_out(acc, OUT_BF16), mask=mask)


@device_function
def _segment(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, qc, qs, q_cols, p, pid_m, M, N, K, stride_xm, stride_wn,
             stride_sn, k_per_split, n_per_group, r, nw_ptr, hc, X_ptr, post_ptr, comb_ptr, NORM: tl.constexpr,
             X_BF16: tl.constexpr, FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, ACT_BLOCK: tl.constexpr,
             X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr, PRESTAGED: tl.constexpr,
             K_ALIGN: tl.constexpr,
             SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, EXPAND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, BHC: tl.constexpr):
    """Program `p` of one segment: output tile p // SPLIT over K split p % SPLIT. With SPLIT > 1 the
    partials go to `part_ptr` [SPLIT, M, N]; the tile's last program (a counter per tile and row block) adds
    them in split order and stores the result. Returns whether this program stored the tile."""
    tile = p // SPLIT
    split = p % SPLIT
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < M
    offs_n = tile * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    c_base = ((tile * BN) // n_per_group) * K  # grouped: the tile's group of input columns
    k_lo = split * k_per_split
    k_end = tl.multiple_of(tl.minimum(K, k_lo + k_per_split), K_ALIGN)  # whole-vector loads up to it
    acc = product_tile(x_ptr + c_base, w_ptr, s_ptr, rows, row_mask, offs_n, n_mask, k_lo, k_end, stride_xm,
                       stride_wn, stride_sn, r, nw_ptr, qc, qs, q_cols, c_base, NORM, X_BF16, FMT, BO, BI, ACT_BLOCK,
                       X_PARTS, DOT_BF16, NATIVE, PRESTAGED, BM, BN, BK)
    stored = True
    if SPLIT == 1:
        _epilogue(acc, y_ptr, rows, row_mask, offs_n, n_mask, N, hc, X_ptr, post_ptr, comb_ptr, OUT_BF16, EXPAND,
                  BM, BN, BHC)
    else:
        mask = n_mask[:, None] & row_mask[None, :]
        tl.store(part_ptr + (split * M + rows[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
        tl.debug_barrier()  # every thread's partials are written before the counter's release
        counter = cnt_ptr + tile * tl.num_programs(1) + pid_m
        stored = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1
        if stored:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(SPLIT):  # split order: the same sum however the programs were scheduled
                acc += tl.load(part_ptr + (s * M + rows[None, :]).to(tl.int64) * N + offs_n[:, None], mask=mask,
                               other=0.0)
            _epilogue(acc, y_ptr, rows, row_mask, offs_n, n_mask, N, hc, X_ptr, post_ptr, comb_ptr, OUT_BF16,
                      EXPAND, BM, BN, BHC)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (a graph replays this one)
    return stored


# One launch computes up to five products of the same input (segments: each its own weight, format,
# activation quantization, split and output). Programs [end_{i-1}, end_i) of axis 0 are segment i's (tiles
# times splits); axis 1 is the block of 16 rows. Tile shapes (BN, BK) are the launch's, chosen from the
# segments' (N, K) only, so a row's sums never depend on how many rows share the launch.
@triton.jit(do_not_specialize=["M"])  # row counts vary call by call: one compile
def _kernel(x_ptr,      # activations [M, G K] (float32 / bfloat16), row stride stride_xm
            nw_ptr,     # float32 [K] RMSNorm weight of the input (NORM)
            cnt_ptr,    # int32 counters, zero between launches (split segments' last programs)
            qc_ptr, qs_ptr,  # scratch (NATIVE): per program, [BM, q_cols] code bytes, [BM, q_cols / 32] scales
            X_ptr, post_ptr, comb_ptr,  # the mHC expand's streams [M, hc, N0] and coefficients (EXPAND)
            # per segment: weight data and E8M0 scale bytes (weight_tile), output [M, N] in its dtype
            # (EXPAND: [M, hc, N0]), float32 partials [SPLIT, M, N] (split segments)
            w0, s0, y0, p0, w1, s1, y1, p1, w2, s2, y2, p2, w3, s3, y3, p3,
            w4, s4, y4, p4,
            M, K, stride_xm, norm_eps, hc, q_cols,
            pub_mine, pub_flags, pub_rank, pub_capacity,  # PUBLISH: kernels/rank_sum.py Publish.check's
            # ROWS: kernels/attn_inputs.py QueryRows' tensors (positions, cos, sin, kv, kv_norm, ring, k, iw,
            # w), the query and index head widths, ring size, index heads, eps, iw scale, the row work's first
            rows_t, r_hd, r_di, r_size, r_nh, r_eps, r_iw_scale, r_prog,
            # per segment: outputs, weight and scale row strides, K per split, outputs per group (grouped),
            # one past its last program, its first counter
            N0, swn0, ssn0, kps0, npg0, end0, cnt0,
            N1, swn1, ssn1, kps1, npg1, end1, cnt1,
            N2, swn2, ssn2, kps2, npg2, end2, cnt2,
            N3, swn3, ssn3, kps3, npg3, end3, cnt3,
            N4, swn4, ssn4, kps4, npg4, end4, cnt4,
            NSEG: tl.constexpr, NORM: tl.constexpr, X_BF16: tl.constexpr, EXPAND: tl.constexpr,
            DOT_BF16: tl.constexpr, NATIVE: tl.constexpr, PRESTAGED: tl.constexpr, K_ALIGN: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BHC: tl.constexpr, BKN: tl.constexpr,
            FMT0: tl.constexpr, BO0: tl.constexpr, BI0: tl.constexpr, ACT0: tl.constexpr,
            XP0: tl.constexpr, SPLIT0: tl.constexpr, OUT0: tl.constexpr,
            FMT1: tl.constexpr, BO1: tl.constexpr, BI1: tl.constexpr, ACT1: tl.constexpr,
            XP1: tl.constexpr, SPLIT1: tl.constexpr, OUT1: tl.constexpr,
            FMT2: tl.constexpr, BO2: tl.constexpr, BI2: tl.constexpr, ACT2: tl.constexpr,
            XP2: tl.constexpr, SPLIT2: tl.constexpr, OUT2: tl.constexpr,
            FMT3: tl.constexpr, BO3: tl.constexpr, BI3: tl.constexpr, ACT3: tl.constexpr,
            XP3: tl.constexpr, SPLIT3: tl.constexpr, OUT3: tl.constexpr,
            FMT4: tl.constexpr, BO4: tl.constexpr, BI4: tl.constexpr, ACT4: tl.constexpr,
            XP4: tl.constexpr, SPLIT4: tl.constexpr, OUT4: tl.constexpr,
            PUBLISH: tl.constexpr,  # ranks: y0 is this rank's symmetric buffer, published to them (0: not)
            ROWS: tl.constexpr,  # the attention's row work (QueryRows): y0 queries, y1 index queries (R_INDEX)
            R_HALF: tl.constexpr, R_WRITE: tl.constexpr, R_QUANT: tl.constexpr, R_INDEX: tl.constexpr,
            R_BF16: tl.constexpr, R_BHD: tl.constexpr, R_BNH: tl.constexpr,
            PDL: tl.constexpr):
    dependent_launch(PDL)
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PUBLISH:  # the product goes to the slot of this rank's next call
        c, base = publish_slot(pub_mine, pub_rank, pub_capacity)
        y0 += base
    qc, qs = qc_ptr, qs_ptr  # PRESTAGED: every row's codes, which `stage_launch` wrote
    if not PRESTAGED:
        qc, qs = scratch_area(qc_ptr, qs_ptr, pid_m * tl.num_programs(0) + pid, q_cols, BM)  # this program's
    r = tl.zeros((BM,), dtype=tl.float32)
    if NORM and not PRESTAGED:
        r = row_rms(x_ptr, pid_m * BM + tl.arange(0, BM), M, K, stride_xm, norm_eps, BM, BKN)
    rows = pid_m * BM + tl.arange(0, BM)
    if pid < end0:
        stored = _segment(x_ptr, w0, s0, y0, p0, cnt_ptr + cnt0, qc, qs, q_cols, pid, pid_m, M, N0, K, stride_xm,
                          swn0, ssn0, kps0, npg0, r, nw_ptr, hc, X_ptr, post_ptr, comb_ptr, NORM, X_BF16, FMT0, BO0,
                          BI0, ACT0, XP0, DOT_BF16, NATIVE, PRESTAGED, K_ALIGN, SPLIT0, OUT0, EXPAND, BM, BN, BK, BHC)
        if ROWS:  # the queries' RoPE, on the tile this program stored
            if stored:
                rope_tile(y0, rows, rows < M, (pid // SPLIT0) * BN + tl.arange(0, BN), N0, r_hd, rows_t[0],
                          rows_t[1], rows_t[2], R_HALF, False, R_BF16, BM, BN)
    if NSEG > 1:
        if (pid >= end0) & (pid < end1):
            stored = _segment(x_ptr, w1, s1, y1, p1, cnt_ptr + cnt1, qc, qs, q_cols, pid - end0, pid_m, M, N1, K,
                              stride_xm, swn1, ssn1, kps1, npg1, r, nw_ptr, hc, X_ptr, post_ptr, comb_ptr, NORM, X_BF16,
                              FMT1, BO1, BI1, ACT1, XP1, DOT_BF16, NATIVE, PRESTAGED, K_ALIGN, SPLIT1, OUT1, False, BM,
                              BN, BK, BHC)
            if R_INDEX:  # the index queries' RoPE and FP4 fake quantization
                if stored:
                    rope_tile(y1, rows, rows < M, ((pid - end0) // SPLIT1) * BN + tl.arange(0, BN), N1, r_di,
                              rows_t[0], rows_t[1], rows_t[2], R_HALF, R_QUANT, R_BF16, BM, BN)
    if NSEG > 2:
        if (pid >= end1) & (pid < end2):
            _segment(x_ptr, w2, s2, y2, p2, cnt_ptr + cnt2, qc, qs, q_cols, pid - end1, pid_m, M, N2, K, stride_xm,
                     swn2, ssn2, kps2, npg2, r, nw_ptr, hc, X_ptr, post_ptr, comb_ptr, NORM, X_BF16, FMT2, BO2, BI2,
                     ACT2, XP2, DOT_BF16, NATIVE, PRESTAGED, K_ALIGN, SPLIT2, OUT2, False, BM, BN, BK, BHC)
    if NSEG > 3:
        if (pid >= end2) & (pid < end3):
            _segment(x_ptr, w3, s3, y3, p3, cnt_ptr + cnt3, qc, qs, q_cols, pid - end2, pid_m, M, N3, K, stride_xm,
                     swn3, ssn3, kps3, npg3, r, nw_ptr, hc, X_ptr, post_ptr, comb_ptr, NORM, X_BF16, FMT3, BO3, BI3,
                     ACT3, XP3, DOT_BF16, NATIVE, PRESTAGED, K_ALIGN, SPLIT3, OUT3, False, BM, BN, BK, BHC)
    if NSEG > 4:
        if (pid >= end3) & (pid < end4):
            _segment(x_ptr, w4, s4, y4, p4, cnt_ptr + cnt4, qc, qs, q_cols, pid - end3, pid_m, M, N4, K, stride_xm,
                     swn4, ssn4, kps4, npg4, r, nw_ptr, hc, X_ptr, post_ptr, comb_ptr, NORM, X_BF16, FMT4, BO4, BI4,
                     ACT4, XP4, DOT_BF16, NATIVE, PRESTAGED, K_ALIGN, SPLIT4, OUT4, False, BM, BN, BK, BHC)
    if ROWS:  # after the products' programs, one a row of the block: its window key (and index head weights)
        if pid >= r_prog:
            key_row(rows_t[3], rows_t[4], rows_t[5], rows_t[6], rows_t[7], rows_t[8], rows_t[0], rows_t[1],
                    rows_t[2], (pid_m * BM + pid - r_prog).to(tl.int64), M, r_hd, r_size, r_nh, r_eps, r_iw_scale,
                    R_WRITE, R_QUANT, R_INDEX, R_BF16, R_HALF, R_BHD, R_BNH)
    if PUBLISH:
        rank_publish(pub_mine, pub_flags, pub_rank, c, tl.num_programs(0) * tl.num_programs(1), PUBLISH)


def native_kind(dev: torch.device, weights: list[PackedWeight], act_blocks: list[int]) -> int:
    """How a launch of products of `weights` with rows quantized per `act_blocks` (0: not) multiplies
    (`weight_product`'s NATIVE): in the checkpoint's formats on the tensor cores (_triton.native_products)
    when every weight is FP8/FP4 and 16-byte aligned as a device allocation is (whole-vector loads; the
    interpreter has no vectors) and every row quantized; otherwise 0, bfloat16 values."""
    ok = all(in_native_formats(w, ab) and (INTERPRET or w.data.data_ptr() % 16 == 0)
             for w, ab in zip(weights, act_blocks))
    return native_products(dev) if ok else 0


def in_native_formats(weight: PackedWeight, act_block: int | None) -> bool:
    """Whether a product can multiply in the checkpoint's formats: FP8/FP4 weights, rows quantized."""
    return weight.format in ("fp8", "fp4") and (act_block or 0) >= 32


def plan(segments: list[tuple[int, int, int]], k: int, dev: torch.device, native: int = 0,
         may_be_long: bool = False, packed_bf16: bool = False) -> tuple[int, int, int, list[tuple[int, int]]]:
    """Block sizes (BM, BN, BK) of a launch and each segment's split-K (k_per_split, splits), from the
    segments' (outputs, act_block, outputs per group), K, the device and the call's kind (`product_rows`:
    a long call's programs take LONG_ROWS where the launch `may_be_long`; no launch of a long call splits K:
    its row blocks fill the device, the float32 partials would be written and read back) only: never from
    the number of rows, so a row's summation order does not depend on how many rows are computed together
    (from registers a long call's programs take 64 outputs a tile, 64 columns deep; a plain product of FP8/FP4
    weights and bfloat16 rows, `packed_bf16`, 128 and 128 where the block-scaled MMA is). `native`: every
    segment multiplies in the checkpoint's formats (`native_kind`), 128 columns deep (a long call's on the
    block-scaled MMA 256), 128 outputs a tile (the block-scaled MMA's M side) or 256 on the e4m3 MMA (four of
    its 64: the rows' quantization and the FP4 scaling, paid once a tile, spread over twice the weights)."""
    bm = product_rows(native, may_be_long)
    ab = max(a for _, a, _ in segments)
    n_max = max(n for n, _, _ in segments)
    if INTERPRET:  # few, large programs: the interpreter pays per operation, whatever its size
        bk = max(min(pow2(k), 512), ab, 32)
        bn = min(pow2(n_max), 1024)
    else:
        bk = max(128 if native else 64, ab)
        if native == NATIVE_E4M3:
            bn = 128 if is_long(bm) else 256
        else:
            bn = 128 if native or (n_max > 4096 and bm != LONG_ROWS) else 64
        if is_long(bm) and native_products(dev) == NATIVE_BLOCK_SCALED and (native or packed_bf16):
            # the accumulator in tensor memory leaves the registers to larger tiles: 0.8x (checkpoint's formats)
            # and 0.66x (from registers) the main loop's issue a weight element (the compile check; sm_90's
            # spill from registers, as do other weights and rows from registers here)
            bn, bk = 128, max(256 if native else 128, ab)
    for n, _, ng in segments:
        if ng < n:  # grouped: a tile never straddles two groups
            bn = max(16, min(bn, ng & -ng))
    splits = []
    programs = sum(triton.cdiv(n, bn) for n, _, _ in segments)
    for _n, _, _ in segments:
        if is_long(bm) or in_long_calls():  # the row blocks fill the device: no float32 partials
            kps = k
        elif INTERPRET:
            kps = 512 if k > 512 else pow2(k, bk)
        else:
            chunks = triton.cdiv(k, bk)
            want = max(1, (2 * sm_count(dev)) // programs)
            kps = triton.cdiv(chunks, max(1, min(want, chunks // 4))) * bk
        kps = max(bk, triton.cdiv(kps, bk) * bk)
        splits.append((kps, triton.cdiv(k, kps)))
    return bm, bn, bk, splits


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


@dataclass(frozen=True)
class Product:
    """One product of a shared input: y = x W^T with `weight` (official FP8 activation quantization in
    blocks of `act_block`, or none), rounded to `out_dtype`; `groups` > 1: a grouped product (wo_a)."""

    weight: PackedWeight
    act_block: int | None
    out_dtype: torch.dtype
    groups: int = 1


MAX_PRODUCTS = 5  # the kernel's segment slots


def reference_multi(x: torch.Tensor, products: list[Product], norm: tuple[torch.Tensor, float] | None = None
                    ) -> list[torch.Tensor]:
    """Several products of one input x [..., K] (the same input columns for all; a grouped one reads its
    groups of them); `norm` (weight, eps): of RMSNorm(x) rounded to x's dtype instead. One `reference` each."""
    if norm is not None:
        from .rmsnorm import reference as rmsnorm

        x = rmsnorm(x, *norm)
    return [reference(x, p.weight, p.act_block, p.out_dtype, p.groups) for p in products]


def _check_product(x: torch.Tensor, p: Product, arg: str) -> tuple[int, int, int]:
    """(outputs, act_block, outputs per group) of a product of x, checked; `arg` names it in errors."""
    n, k = check_weight(p.weight)
    g = p.groups
    require(g >= 1 and n % g == 0, "groups", g, f"must divide {arg}'s outputs {n}")
    require(x.shape[-1] == g * k, "x.shape[-1]", x.shape[-1], f"must equal {arg}'s input size {k} times groups {g}")
    require(p.out_dtype in (torch.float32, torch.bfloat16), "out_dtype", p.out_dtype, "must be float32 or bfloat16")
    ng = n // g
    require(g == 1 or ng % 16 == 0, "weight.shape[0]", n, f"grouped: outputs per group ({ng}) must be a "
            "multiple of 16")
    return n, check_act_block(p.act_block, k), ng


def launch(x: torch.Tensor, products: list[Product], norm, expand, publish: Publish | None = None,
           out: torch.Tensor | None = None, rows: QueryRows | None = None) -> list[torch.Tensor]:
    """One launch of the products (`fast_multi`); `expand` (X, post, comb): one product, stored as the mHC
    expand of it (kernels/mhc.py's `fast_product_expand`); `publish`: one float32 product, stored into the
    slot of this rank's next call in its symmetric buffer and counted in every rank's flags (the view
    returned is the buffer's first slot: its consumers wait on `publish`); `out`: one product, stored into
    this caller's buffer (contiguous, the product's shape and dtype: no copy after); `rows`: the attention's
    row work on the query products' outputs (kernels/query_inputs.py), in this launch."""
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require(1 <= len(products) <= MAX_PRODUCTS, "products", len(products), f"must be 1..{MAX_PRODUCTS}")
    shapes = [_check_product(x, p, "the weight" if len(products) == 1 else f"products[{i}].weight")
              for i, p in enumerate(products)]
    ks = {p.weight.shape[1] for p in products}
    require(len(ks) == 1, "products", sorted(ks), "must share the input size")
    k = ks.pop()
    require(len({p.weight.bf16_exact for p in products}) == 1, "products", [p.weight.name for p in products],
            "must all be bfloat16 values or all not (one kind of dot per launch)")
    dev = device_of(x, *(p.weight.data for p in products))
    x2 = x.reshape(-1, x.shape[-1])
    require_rows(x2, "x")
    m = x2.shape[0]
    if expand is not None:
        X, post, comb = expand
        hc = X.shape[1]
        require(len(products) == 1 and X.shape == (m, hc, shapes[0][0]), "X.shape", tuple(X.shape),
                f"must be [{m}, hc, {shapes[0][0]}] (one product)")
        require(X.dtype == products[0].out_dtype, "X.dtype", X.dtype, "must be the product's out_dtype")
        require_dtype(post, "post", (torch.float32,))
        require_dtype(comb, "comb", (torch.float32,))
        X, post, comb = X.contiguous(), post.contiguous(), comb.contiguous()
        outs = [torch.empty_like(X)]
    elif out is not None:
        n = shapes[0][0]
        require(publish is None, "out", "a buffer", "cannot be given with publish (the product goes to one)")
        require(len(products) == 1 and tuple(out.shape) == (*x.shape[:-1], n), "out.shape", tuple(out.shape),
                f"must be {(*x.shape[:-1], n)} (one product)")
        require(out.dtype == products[0].out_dtype, "out.dtype", out.dtype, "must be the product's out_dtype")
        require(out.is_contiguous(), "out.stride", out.stride(), "must be contiguous")
        X = post = comb = x2
        hc = 1
        outs = [out.view(m, n)]
    elif publish is not None:
        require(len(products) == 1 and products[0].out_dtype == torch.float32 and m and k, "publish", len(products),
                "products: one float32 product of rows")
        X = post = comb = x2
        hc = 1
        pub, world = publish.check(m * shapes[0][0])
        outs = [publish.buffer[:m * shapes[0][0]].view(m, shapes[0][0])]
    else:
        X = post = comb = x2
        hc = 1
        outs = [torch.empty((m, n), dtype=p.out_dtype, device=dev) for p, (n, _, _) in zip(products, shapes)]
    if norm is not None:
        nw, eps = norm
        require(nw is not None and tuple(nw.shape) == (x.shape[-1],), "norm.weight", None if nw is None else
                tuple(nw.shape), f"must be ({x.shape[-1]},)")
        require_dtype(nw, "norm.weight", (torch.float32,))
    else:
        nw, eps = x2, 0.0
    shaped = [o.view(*x.shape[:-1], *o.shape[1:]) for o in outs]
    if m == 0 or k == 0:
        return [o.zero_() for o in shaped] if k == 0 else shaped
    native = native_kind(dev, [p.weight for p in products], [ab for _, ab, _ in shapes])
    # a long call's rows are quantized once for all its products where they take the same codes
    one_staging = len({(p.weight.format, ab) for p, (_, ab, _) in zip(products, shapes)}) == 1
    exact = products[0].weight.bf16_exact
    # long: in the checkpoint's formats where the rows take one staging; from registers where every weight is
    # bfloat16 values and every product plain, without the expand (rows quantized in the loop, or the
    # expand's epilogue, beside 128 rows spill: the compile check)
    plain = not any(ab for _, ab, _ in shapes) and expand is None
    packed_bf16 = x.dtype == torch.bfloat16 and all(p.weight.format in ("fp8", "fp4") for p in products)
    bm, bn, bk, splits = plan(shapes, k, dev, native, one_staging if native else exact and plain, packed_bf16)
    prestaged = bool(native) and is_long(bm)
    row_blocks = triton.cdiv(m, bm)
    args, rt, cx, end, used = [], [], {}, 0, 0
    for i in range(MAX_PRODUCTS):
        if i < len(products):
            p, (n, ab, ng), (kps, sp) = products[i], shapes[i], splits[i]
            data, scale, swn, ssn, fmt, bo, bi = kernel_args(p.weight)
            part = torch.empty((sp, m, n), dtype=torch.float32, device=dev) if sp > 1 else x2
            end += triton.cdiv(n, bn) * sp
            args += [data, scale, outs[i], part]
            rt += [n, swn, ssn, kps, ng, end, used]
            used += triton.cdiv(n, bn) * row_blocks if sp > 1 else 0
            x_parts = 3 if exact and not ab and x.dtype == torch.float32 else 1
            cx.update({f"FMT{i}": fmt, f"BO{i}": bo, f"BI{i}": bi, f"ACT{i}": ab, f"XP{i}": x_parts,
                       f"SPLIT{i}": sp, f"OUT{i}": p.out_dtype == torch.bfloat16})
        else:
            args += [x2, x2, x2, x2]
            rt += [0, 0, 0, 0, 1, end, 0]
            cx.update({f"FMT{i}": 0, f"BO{i}": 1, f"BI{i}": 1, f"ACT{i}": 0, f"XP{i}": 1, f"SPLIT{i}": 1,
                       f"OUT{i}": False})
    programs = end + (min(bm, m) if rows is not None else 0)  # then the row work's, one a row of a block
    if prestaged:
        qc, qs, q_cols = stage_launch(x2, nw, eps, norm is not None, cx["FMT0"], native, cx["ACT0"], row_blocks * bm,
                                      bk)
    elif native:  # each program's rows quantized (stage_codes)
        q_cols = max(kps for kps, _ in splits)
        qc, qs = stage_scratch(programs * row_blocks, bm, q_cols, dev)
    else:
        q_cols, qc, qs = 0, x2, x2
    if publish is None:
        pub, world = (x2, (x2,), 0, 0), 0
    require(rows is None or bn % 32 == 0, "rows", bn, "the query products' tiles must be a multiple of 32 outputs")
    rows_t, rows_rt, rows_cx = row_work_args(rows, x2, end)
    _kernel[(programs, row_blocks)](x2, nw, counters(dev, used), qc, qs, X, post, comb, *args, m, k, x2.stride(0),
                                    float(eps), hc, q_cols, *pub, rows_t, *rows_rt, *rt,
                                    NSEG=len(products), NORM=norm is not None, X_BF16=x.dtype == torch.bfloat16,
                                    EXPAND=expand is not None, DOT_BF16=exact and not INTERPRET, NATIVE=native,
                                    PRESTAGED=prestaged,
                                    K_ALIGN=16 if all(kps % 16 == 0 for kps, _ in splits) and k % 16 == 0 else 1,
                                    BM=bm, BN=bn, BK=bk,
                                    BHC=pow2(hc), BKN=min(pow2(x.shape[-1]), 1024), PUBLISH=world, **cx, **rows_cx,
                                    **pdl(x2.device))
    return shaped



def fast_multi(x: torch.Tensor, products: list[Product], norm: tuple[torch.Tensor, float] | None = None
               ) -> list[torch.Tensor]:
    """The kernel for `reference_multi`: every product in one launch; in a long call, products in the
    checkpoint's formats beside plain ones (`native_split`) in two, each a long call's (one launch of them all
    would quantize the rows in its loop, 16 rows a program: the issue of 8 passes where one does)."""
    native = native_split(products)
    if not native:
        return launch(x, products, norm, None)
    outs = {part: iter(launch(x, [p for p, n in zip(products, native) if n is part], norm, None))
            for part in (True, False)}  # the native products' launch first
    return [next(outs[n]) for n in native]


def native_split(products: list[Product]) -> list[bool]:
    """In a long call, which of a launch's products can multiply in the checkpoint's formats
    (`in_native_formats`; `native_kind` where the device and alignment allow), where some can and some cannot
    (`fast_multi` launches them apart); [] otherwise: one launch. By the products alone, not the device: a
    count on the meta device launches as the GPU does."""
    if not in_long_calls() or len(products) < 2:
        return []
    native = [in_native_formats(p.weight, p.act_block) for p in products]
    return native if any(native) and not all(native) else []


def fast(x: torch.Tensor, weight: PackedWeight, act_block: int | None, out_dtype: torch.dtype,
         groups: int = 1, publish: Publish | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for `reference`: x [..., G in] -> [..., out] in out_dtype (float32 or bfloat16), into `out`
    where given; with `publish` (float32), the product published to the ranks instead (`launch`): what it
    wrote, as a view of the buffer's first slot (its consumers wait on `publish`)."""
    return launch(x, [Product(weight, act_block, out_dtype, groups)], None, None, publish, out)[0]
