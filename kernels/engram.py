"""Engram: the lookup (the row ids a step's positions hash to in every Engram layer, and those rows copied
from the tables, FP8 e4m3 [rows, d] with one E8M0 scale per 32 values, into a small device buffer) and the
layer (the looked-up rows through wkv, the gated add into the streams), one launch each on the fast path.
The tables of the released V4.1-Flash are ~100 GB each and stay in host memory; the lookup reads the few
rows a step needs straight from there (host memory registered with the device: a captured decode cycle
gathers without a host round trip) and on CPU reads an ordinary tensor, so the tests exercise the same
kernels. The rows cross the host link once a step, in the cycle's first kernel: the layer kernel's many
programs each read every row they multiply, and read them from device memory.

The lookup is exact (a copy of the rows' bytes); the layer's dequantization too (an e4m3 value times a
power of two fits float32 and bfloat16 without rounding). The layer: the kernel's product is the linear
kernel's (float32 sums of exact products) and its gates float32, the reference's float64; within one
rounding of the activation dtype of it (and, where a product sits at an FP8 boundary of the official
activation quantization, one e4m3 step of that input). A lookup moves, per token and Engram layer, n_cols
rows of d + d/32 bytes over the host link (V4.1-Flash: 24 rows of 264 B = 6.3 KB per layer, 12.7 KB per
token for its two Engram layers).
"""

import functools

import torch

from . import linear, rank_sum
from ._triton import (
    INTERPRET,
    counters,
    dependent_launch,
    device_function,
    device_of,
    is_long,
    pdl,
    pow2,
    require,
    require_dtype,
    round_out,
    tl,
    triton,
    tsum,
)
from .formats import e8m0_to_float
from .linear import PackedWeight, check_act_block, check_weight, kernel_args, staged_product, weight_product
from .rank_sum import publish_slot, rank_arrive, rank_publish
from .rows import STAGE_TILES, fp8_rows_tile, scratch_area, stage_codes, stage_launch, stage_scratch


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Looked-up rows, codes [T, C, d] e4m3 and scales [T, C, d / 32] E8M0 -> [T, C * d] in out_dtype (exact)."""
    s = e8m0_to_float(scales).repeat_interleave(32, dim=-1)
    return (codes.float() * s).reshape(codes.shape[0], -1).to(out_dtype)


def layer_reference(X: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, wkv: PackedWeight,
                    act_block: int | None, omega: torch.Tensor, eps: float) -> torch.Tensor:
    """One Engram layer on the streams X [T, hc, D]: its looked-up rows (codes [T, C, d] e4m3, scales
    [T, C, d / 32] E8M0) through `wkv` give hc keys and a value, and each copy adds the value through its gate:
        rho_j = rsqrt(mean(X_j^2) + eps) rsqrt(mean(key_j^2) + eps)
        delta_j = sum(X_j omega_j key_j) rho_j / sqrt(D),  gate_j = sigmoid(sign(delta_j) sqrt(max(|delta_j|, 1e-6)))
        X_j' = X_j + gate_j value
    in float64, rounded once to X's dtype (the official float32 interior)."""
    hc, d = X.shape[1], X.shape[2]
    kv = linear.reference(dequantize(codes, scales, X.dtype), wkv, act_block, X.dtype).double()
    keys = kv[:, : hc * d].view(-1, hc, d)
    value = kv[:, hc * d:]
    x = X.double()
    rho = torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(keys.square().mean(-1) + eps)
    delta = (x * omega.double() * keys).sum(-1) * rho * d**-0.5  # [T, hc]
    gate = torch.sigmoid(torch.sign(delta) * delta.abs().clamp(min=1e-6).sqrt())
    return (x + gate.unsqueeze(-1) * value.unsqueeze(1)).to(X.dtype)


# One launch: programs (output tile, row block) compute kv = wkv(rows) for their tile, the act tiles read from
# the looked-up rows (dequantized, then the official FP8 quantization); the row block's last program (a
# counter) computes each row's gates from the whole kv row and writes X'. float32 throughout; per row. Split
# over ranks, each rank's launch computes its columns of kv (its rows of wkv) and publishes them, and a second
# launch, a program a row block, gathers every rank's columns as it loads them and computes the gates.


@device_function
def _kv_tile(kv_parts, base, r64, c, mask, NS, WORLD: tl.constexpr):
    """kv at rows r64, columns c (broadcast together), float32: column c from rank c // NS's part, at its row
    stride NS (one part: the whole row, NS = N)."""
    if WORLD == 1:
        return tl.load(kv_parts[0] + base + r64 * NS + c, mask=mask, other=0.0).to(tl.float32)
    v = tl.zeros(c.shape, dtype=tl.float32) + tl.zeros(r64.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):  # each column is one rank's: the others' masked off (+ 0)
        v += tl.load(kv_parts[r] + base + r64 * NS + c - r * NS, mask=mask & (c // NS == r), other=0.0)
    return v


@device_function
def _gates(kv_parts, base, X_ptr, om_ptr, out_ptr, rows, row_mask, hc, D, NS, eps, WORLD: tl.constexpr,
           OUT_BF16: tl.constexpr, BD: tl.constexpr, BHC: tl.constexpr):
    """Rows `rows`' gates from their whole kv rows (hc keys, then the value) and X' = X + gate value stored."""
    r64 = rows.to(tl.int64)
    k = tl.arange(0, BHC)
    km = k < hc
    # the gates: sums over D in BD-wide blocks, in order (float32)
    xs = tl.zeros((rows.shape[0], BHC), dtype=tl.float32)
    ks = tl.zeros((rows.shape[0], BHC), dtype=tl.float32)
    dot = tl.zeros((rows.shape[0], BHC), dtype=tl.float32)
    m3 = row_mask[:, None, None] & km[None, :, None]
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cm = m3 & (cols[None, None, :] < D)
        x = tl.load(X_ptr + (r64[:, None, None] * hc + k[None, :, None]) * D + cols[None, None, :], mask=cm,
                    other=0.0).to(tl.float32)
        key = _kv_tile(kv_parts, base, r64[:, None, None], k[None, :, None] * D + cols[None, None, :], cm, NS, WORLD)
        om = tl.load(om_ptr + k[:, None] * D + cols[None, :], mask=km[:, None] & (cols[None, :] < D), other=0.0)
        xs += tsum(x * x, axis=2)
        ks += tsum(key * key, axis=2)
        dot += tsum(x * om[None, :, :] * key, axis=2)
    rho = (1.0 / tl.sqrt_rn(xs / D + eps)) * (1.0 / tl.sqrt_rn(ks / D + eps))
    delta = dot * rho * (1.0 / tl.sqrt_rn(D * 1.0))
    mag = tl.sqrt_rn(tl.maximum(tl.abs(delta), 1e-6))
    z = tl.where(delta > 0, mag, tl.where(delta < 0, -mag, 0.0))
    gate = 1.0 / (1.0 + tl.exp(-z))
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cm = m3 & (cols[None, None, :] < D)
        x = tl.load(X_ptr + (r64[:, None, None] * hc + k[None, :, None]) * D + cols[None, None, :], mask=cm,
                    other=0.0).to(tl.float32)
        v = _kv_tile(kv_parts, base, r64[:, None], hc * D + cols[None, :], row_mask[:, None] & (cols[None, :] < D),
                     NS, WORLD)
        tl.store(out_ptr + (r64[:, None, None] * hc + k[None, :, None]) * D + cols[None, None, :],
                 round_out(x + gate[:, :, None] * v[:, None, :], OUT_BF16), mask=cm)


@triton.jit(do_not_specialize=["T"])  # row counts vary call by call: one compile
def _layer_kernel(codes_ptr,  # e4m3 [T, C, HD] the looked-up rows (device memory: read by every program)
                  scale_ptr,  # E8M0 bytes [T, C, HD / 32]
                  w_ptr, s_ptr,  # wkv's (or this rank's rows of it) weight data and scale bytes [NL, C HD]
                  kv_ptr,     # out [T, NS]: the product's NL columns, in X's dtype (GATES) or float32 (its values)
                  X_ptr,      # streams [T, hc, D]
                  om_ptr,     # float32 [hc, D] omega
                  out_ptr,    # out [T, hc, D]
                  cnt_ptr,    # int32 counters (one per row block), zero between launches
                  qc_ptr, qs_ptr,  # scratch (NATIVE): per program, [BM, KQ] codes, [BM, KQ / 32] scales; PRESTAGED:
                  # every row's, which rows.stage_launch wrote
                  pub_mine, pub_flags, pub_rank, pub_capacity,  # PUBLISH: kernels/rank_sum.py Publish.check's
                  T, K, hc, D, NL, NS, stride_wn, stride_sn, eps,
                  FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, ACT_BLOCK: tl.constexpr,
                  DOT_BF16: tl.constexpr, NATIVE: tl.constexpr, PRESTAGED: tl.constexpr, OUT_BF16: tl.constexpr,
                  GATES: tl.constexpr,  # the row block's last program computes the gates (one device's launch)
                  PUBLISH: tl.constexpr,  # ranks: kv is this rank's symmetric buffer, published to them (0: not)
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BHC: tl.constexpr,
                  PDL: tl.constexpr):
    dependent_launch(PDL)
    if PUBLISH:  # this rank's columns go to the slot of its next call
        c, base = publish_slot(pub_mine, pub_rank, pub_capacity)
        kv_ptr += base
    tile = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < T
    offs_n = tile * BN + tl.arange(0, BN)
    n_mask = offs_n < NL
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // BO).to(tl.int64) * stride_sn
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if NATIVE > 0 and ACT_BLOCK >= 32 and FMT > 0:  # the rows quantized once, into the program's scratch
        KQ = tl.cdiv(K, BK) * BK
        if PRESTAGED:
            acc = staged_product(w_rows, s_rows, n_mask, qc_ptr, qs_ptr, rows, K, KQ, acc, FMT, BI, ACT_BLOCK,
                                 NATIVE, BM, BN, BK)
        else:
            qc, qs = scratch_area(qc_ptr, qs_ptr, pid_m * tl.num_programs(0) + tile, KQ, BM)
            SW: tl.constexpr = STAGE_TILES * BK
            for k0 in range(0, KQ, SW):
                stage_codes(fp8_rows_tile(codes_ptr, scale_ptr, rows, row_mask, k0, K, BM, SW), qc, qs, k0, KQ, FMT,
                            NATIVE, ACT_BLOCK, BM, SW)
            tl.debug_barrier()  # every thread's codes are written before any thread reads them
            acc = staged_product(w_rows, s_rows, n_mask, qc, qs, tl.arange(0, BM), K, KQ, acc, FMT, BI, ACT_BLOCK,
                                 NATIVE, BM, BN, BK)
    else:
        for k0 in range(0, K, BK):
            a = fp8_rows_tile(codes_ptr, scale_ptr, rows, row_mask, k0, K, BM, BK)
            acc = weight_product(w_rows, s_rows, n_mask, a, k0, K, acc, FMT, BI, ACT_BLOCK, 1, DOT_BF16, NATIVE, BM,
                                 BN, BK)
    r64 = rows.to(tl.int64)
    tl.store(kv_ptr + r64[None, :] * NS + offs_n[:, None], round_out(acc, OUT_BF16),
             mask=n_mask[:, None] & row_mask[None, :])
    if GATES:
        tl.debug_barrier()  # every thread's part of the product is written before the counter's release
        if tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            _gates((kv_ptr,), 0, X_ptr, om_ptr, out_ptr, rows, row_mask, hc, D, NS, eps, 1, OUT_BF16, BD, BHC)
            tl.atomic_xchg(cnt_ptr + pid_m, 0)  # ready for the next launch (a graph replays this one)
    if PUBLISH:
        rank_publish(pub_mine, pub_flags, pub_rank, c, tl.num_programs(0) * tl.num_programs(1), PUBLISH)


@triton.jit(do_not_specialize=["T"])
def _gates_kernel(kv_parts,  # every rank's float32 [T, NS] columns of kv (a tuple, rank order)
                  X_ptr, om_ptr, out_ptr,  # as for _layer_kernel
                  flags, rank, capacity,  # kv's Publish (kernels/rank_sum.py arrival_args; WAIT)
                  T, hc, D, NS, eps,
                  WORLD: tl.constexpr, WAIT: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr,
                  BD: tl.constexpr, BHC: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    base = rank_arrive(flags, rank, capacity, WAIT, WORLD)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    _gates(kv_parts, base, X_ptr, om_ptr, out_ptr, rows, rows < T, hc, D, NS, eps, WORLD, OUT_BF16, BD, BHC)


def fast_layer(X: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, wkv: PackedWeight,
               act_block: int | None, omega: torch.Tensor, eps: float, split=None) -> torch.Tensor:
    """The kernel for `layer_reference` (same signature; within one rounding of X's dtype of it): one launch.
    `split`, a decode step's call over ranks (parallel/sharding.py EngramSplit): `weight`, this rank's rows
    [lo, lo + n) of wkv, in every rank's stride `width` (rank r's first row r width), and `gather_produced(shape,
    produce, consume)` (every rank's float32 columns of kv in rank order given to `consume`, over symmetric
    memory published by the product's launch itself: Comm.gather_produced): two launches, this rank's columns
    of the product, then the gates, every rank's columns read as they are loaded; the same bits as one."""
    require_dtype(X, "X", (torch.float32, torch.bfloat16))
    require(X.dim() == 3, "X.dim()", X.dim(), "must be 3 ([T, hc, D])")
    t, hc, d = X.shape
    require_dtype(codes, "codes", (torch.float8_e4m3fn,))
    require_dtype(scales, "scales", (torch.float8_e8m0fnu, torch.uint8))
    require(codes.dim() == 3 and codes.shape[0] == t, "codes.shape", tuple(codes.shape), f"must be [{t}, C, d]")
    _, c, hd = codes.shape
    require(hd % 32 == 0, "codes.shape[2]", hd, "must be a multiple of 32 (one scale per 32)")
    require(tuple(scales.shape) == (t, c, hd // 32), "scales.shape", tuple(scales.shape),
            f"must be {(t, c, hd // 32)}")
    n, k = check_weight(wkv, "wkv")
    require(n == (hc + 1) * d and k == c * hd, "wkv.shape", wkv.shape, f"must be {((hc + 1) * d, c * hd)}")
    require(tuple(omega.shape) == (hc, d) and omega.dtype == torch.float32, "omega", tuple(omega.shape),
            f"must be float32 {(hc, d)}")
    ab = check_act_block(act_block, k)
    dev = device_of(X, codes, scales, wkv.data, omega)
    X, codes, scales, omega = X.contiguous(), codes.contiguous(), scales.contiguous(), omega.contiguous()
    out = torch.empty_like(X)
    if t == 0:
        return out
    native = linear.native_kind(dev, [wkv], [ab])
    bm, bn, bk, _ = linear.plan([(n, ab, n)], k, dev, native, may_be_long=bool(native))
    blocks = triton.cdiv(t, bm)
    # the gates' tiles are [BM, hc, BD] float32, several live at once: 2048 elements keep them in registers
    bd = min(pow2(d), 4096 if INTERPRET else max(16, 2048 // (bm * pow2(hc))))
    gates = dict(OUT_BF16=X.dtype == torch.bfloat16, BD=bd, BHC=pow2(hc))
    product = functools.partial(_product, codes, scales, X, omega, out, float(eps), ab, native, (bm, bn, bk), gates)
    if split is None:
        product(wkv, torch.empty((t, n), dtype=X.dtype, device=dev), None, True)
        return out
    width = split.width
    nl = check_weight(split.weight, "split.weight")[0]
    require(split.weight.shape[1] == k and 0 < nl <= width, "split.weight.shape", split.weight.shape,
            f"must be [1..{width}, {k}]")
    require(not is_long(bm), "split", t, "rows: a long call's rows take wkv whole")

    def produce(to):
        kv = (torch.empty((t, width), dtype=torch.float32, device=dev) if to is None else
              to.buffer[:t * width].view(t, width))
        product(split.weight, kv, to, False)
        return kv

    def consume(parts):
        wait, waits = rank_sum.arrival_args(parts)
        _gates_kernel[(blocks,)](tuple(parts), X, omega, out, *wait, t, hc, d, width, float(eps), WORLD=len(parts),
                                 WAIT=waits, BM=bm, **gates, **pdl(X.device))
        return out

    return split.gather_produced((t, width), produce, consume)


def _product(codes, scales, X, omega, out, eps: float, ab: int, native: int, tiles: tuple, gates: dict,
             w: PackedWeight, kv: torch.Tensor, to, fused: bool) -> None:
    """The layer's launch: kv [T, NS] = w(rows) (w wkv's rows, or a rank's of them), in X's dtype with the
    gates (`fused`: one device's call) or float32 without (`to`: kv is this rank's symmetric buffer,
    published)."""
    (t, _, d), (bm, bn, bk), dev = X.shape, tiles, X.device
    k = codes.shape[1] * codes.shape[2]
    data, sc, swn, ssn, fmt, bo, bi = kernel_args(w)
    nl = w.shape[0]
    prestaged = is_long(bm)  # a long call: the rows quantized once for every program
    blocks = triton.cdiv(t, bm)
    programs = triton.cdiv(nl, bn) * blocks
    if prestaged:
        qc, qs, _ = stage_launch(codes.view(t, k), codes, 0.0, False, fmt, native, ab, blocks * bm, bk,
                                 fp8_scales=scales.view(torch.uint8).view(t, k // 32))
    elif native:  # each program's rows quantized (rows.stage_codes)
        qc, qs = stage_scratch(programs, bm, triton.cdiv(k, bk) * bk, dev)
    else:
        qc = qs = kv
    pub, world = to.check(kv.numel()) if to is not None else ((kv, (kv,), 0, 0), 0)
    _layer_kernel[(triton.cdiv(nl, bn), blocks)](
        codes, scales.view(torch.uint8), data, sc, kv, X, omega, out, counters(dev, blocks), qc, qs, *pub, t, k,
        X.shape[1], d, nl, kv.shape[1], swn, ssn, eps, FMT=fmt, BO=bo, BI=bi, ACT_BLOCK=ab,
        DOT_BF16=w.bf16_exact and not INTERPRET, NATIVE=native, PRESTAGED=prestaged, GATES=fused, PUBLISH=world,
        BM=bm, BN=bn, BK=bk,
        **gates, **pdl(codes.device))


# --- the lookup: row ids, then the rows ---------------------------------------------------------------------


def hash_ids(taus: torch.Tensor, pad: int, mult: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
             n_heads: int) -> torch.Tensor:
    """taus [T, n] int64 (taus[:, i] the compressed id of position p - i, -1 before the sequence) -> the
    table row ids of every Engram layer [L, T, (n - 1) n_heads]: r_k = xor_{i < k} tau_i m_i (int64, wrapping)
    for n-gram sizes k = 2..n, each repeated over the heads, modulo the column's prime, plus its offset.
    mult [L, n], primes and offsets [L, (n - 1) n_heads]."""
    taus = torch.where(taus >= 0, taus, torch.full_like(taus, pad))
    out = []
    for m, p, o in zip(mult, primes, offsets):
        r = taus[:, 0] * m[0]
        cols = []
        for k in range(2, taus.shape[1] + 1):
            r = torch.bitwise_xor(r, taus[:, k - 1] * m[k - 1])
            cols.append(r)
        out.append(torch.stack(cols, dim=-1).repeat_interleave(n_heads, dim=-1) % p + o)
    return torch.stack(out)


def ids_reference(tokens: torch.Tensor, positions: torch.Tensor, token_map: torch.Tensor, pad: int,
                  mult: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The row ids of `positions` [T] from the token history `tokens` (the state's, this call's included)
    through the compressed vocabulary `token_map` -> [L, T, cols] (`hash_ids`)."""
    taus = []
    for i in range(mult.shape[1]):
        q = positions - i
        c = token_map[tokens[q.clamp(min=0)].clamp(max=len(token_map) - 1)]
        taus.append(torch.where(q >= 0, c, -1))
    return hash_ids(torch.stack(taus, dim=-1), pad, mult, primes, offsets, n_heads)


def lookup_reference(tokens: torch.Tensor, positions: torch.Tensor, token_map: torch.Tensor, pad: int,
                     mult: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, n_heads: int,
                     tables: list[torch.Tensor], scales: list[torch.Tensor]):
    """The lookup of every Engram layer for `positions` [T]: (ids [L, T, C] as `ids_reference`, codes
    [L, T, C, d] e4m3, scales [L, T, C, d / 32] E8M0), the rows of layer l's `tables[l]` [rows, d] and
    `scales[l]` [rows, d / 32] at its ids, on the ids' device. The rows are gathered where a table lives
    (a host table: a host round trip, which a CUDA graph cannot capture).

    Bytes moved: L T C (d + d / 32) read from the tables, as many written."""
    ids = ids_reference(tokens, positions, token_map, pad, mult, primes, offsets, n_heads)
    codes = torch.stack([t[i.to(t.device)].to(ids.device) for t, i in zip(tables, ids)])
    rows_scales = torch.stack([s[i.to(s.device)].to(ids.device) for s, i in zip(scales, ids)])
    return ids, codes, rows_scales


@triton.jit(do_not_specialize=["T"])  # row counts vary call by call: one compile
def _lookup_kernel(tok_ptr,    # int64 token history
                   pos_ptr,    # int64 [T]
                   map_ptr,    # int64 [V] compressed id of each token
                   mult_ptr,   # int64 [L, NG] multipliers
                   prime_ptr,  # int64 [L, COLS]
                   off_ptr,    # int64 [L, COLS]
                   tables,     # L pointers: uint8 [rows_l, HD] the e4m3 tables (host memory registered with the
                   scales,     #   device, or any tensor on CPU); L pointers: uint8 [rows_l, HD / 32] E8M0
                   ids_ptr,    # out int64 [L, T, COLS]
                   codes_ptr,  # out uint8 [L, T, COLS, HD]
                   rs_ptr,     # out uint8 [L, T, COLS, HD / 32]
                   T, V, pad, COLS, n_heads, HD,
                   L: tl.constexpr, NG: tl.constexpr, BNG: tl.constexpr, BCOLS: tl.constexpr, BHD: tl.constexpr,
                   BHS: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t)
    i = tl.arange(0, BNG)
    q = p - i
    tok = tl.load(tok_ptr + tl.maximum(q, 0), mask=i < NG, other=0)
    c = tl.load(map_ptr + tl.minimum(tok, V - 1), mask=i < NG, other=0)
    c = tl.where(q >= 0, c, pad)
    cols = tl.arange(0, BCOLS)
    cm = cols < COLS
    gram = cols // n_heads  # n-gram size gram + 2
    j = tl.arange(0, BHD)
    js = tl.arange(0, BHS)
    HS = HD // 32
    for layer in tl.static_range(L):  # unrolled: each layer's table is its own pointer
        m = tl.load(mult_ptr + layer * NG + i, mask=i < NG, other=0)
        term = c * m  # int64, wrapping like torch's
        r = tl.zeros((BCOLS,), dtype=tl.int64)
        for k in tl.static_range(NG):  # r_gram = xor of the terms i <= gram + 1
            tk = tsum(tl.where(i == k, term, 0), axis=0)
            r = tl.where(gram + 1 >= k, r ^ tk, r)
        prime = tl.load(prime_ptr + layer * COLS + cols, mask=cm, other=1)
        h = r % prime
        h = tl.where(h < 0, h + prime, h)  # torch's remainder takes the divisor's sign
        rid = h + tl.load(off_ptr + layer * COLS + cols, mask=cm, other=0)
        out_row = (layer * T + t) * COLS + cols  # int64
        tl.store(ids_ptr + out_row, rid, mask=cm)
        mc = cm[:, None] & (j[None, :] < HD)
        code = tl.load(tables[layer] + rid[:, None] * HD + j[None, :], mask=mc, other=0)
        tl.store(codes_ptr + out_row[:, None] * HD + j[None, :], code, mask=mc)
        ms = cm[:, None] & (js[None, :] < HS)
        e = tl.load(scales[layer] + rid[:, None] * HS + js[None, :], mask=ms, other=0)
        tl.store(rs_ptr + out_row[:, None] * HS + js[None, :], e, mask=ms)


def fast_lookup(tokens: torch.Tensor, positions: torch.Tensor, token_map: torch.Tensor, pad: int,
                mult: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, n_heads: int,
                tables: list[torch.Tensor], scales: list[torch.Tensor]):
    """The kernel for `lookup_reference` (same signature and result, bit for bit): one launch for every
    Engram layer, no host read (capturable); the tables are read in place wherever they live (on CUDA, host
    memory registered with the device), only at the rows looked up."""
    for name, t in (("tokens", tokens), ("positions", positions), ("token_map", token_map), ("mult", mult),
                    ("primes", primes), ("offsets", offsets)):
        require_dtype(t, name, (torch.int64,))
    layers, ng = mult.shape
    cols = (ng - 1) * n_heads
    require(primes.shape == (layers, cols) and offsets.shape == (layers, cols), "primes.shape", tuple(primes.shape),
            f"must be {(layers, cols)}, as offsets")
    require(len(tables) == layers and len(scales) == layers, "len(tables)", len(tables),
            f"must be {layers} (one table and one scale table a layer), as len(scales) ({len(scales)})")
    hd = tables[0].shape[-1]
    for n, (table, scale) in enumerate(zip(tables, scales)):
        require_dtype(table, f"tables[{n}]", (torch.float8_e4m3fn,))
        require_dtype(scale, f"scales[{n}]", (torch.float8_e8m0fnu, torch.uint8))
        require(table.dim() == 2 and table.shape[1] == hd and hd % 32 == 0, f"tables[{n}].shape", tuple(table.shape),
                f"must be [rows, {hd}], a multiple of 32 wide, as tables[0]")
        require(tuple(scale.shape) == (table.shape[0], hd // 32), f"scales[{n}].shape", tuple(scale.shape),
                f"must be {(table.shape[0], hd // 32)} (one scale per 32 of tables[{n}])")
        require(table.is_contiguous() and scale.is_contiguous(), f"tables[{n}]", "strided",
                "tables and scales must be contiguous")
    dev = device_of(tokens, positions, token_map, mult, primes, offsets)
    t = positions.numel()
    ids = torch.empty((layers, t, cols), dtype=torch.int64, device=dev)
    codes = torch.empty((layers, t, cols, hd), dtype=torch.float8_e4m3fn, device=dev)
    row_scales = torch.empty((layers, t, cols, hd // 32), dtype=scales[0].dtype, device=dev)
    if t:
        _lookup_kernel[(t,)](tokens, positions.contiguous(), token_map, mult.contiguous(), primes.contiguous(),
                             offsets.contiguous(), tuple(x.view(torch.uint8) for x in tables),
                             tuple(x.view(torch.uint8) for x in scales), ids, codes.view(torch.uint8),
                             row_scales.view(torch.uint8), t, token_map.numel(), int(pad), cols, n_heads, hd,
                             L=layers, NG=ng, BNG=pow2(ng), BCOLS=pow2(cols), BHD=pow2(hd), BHS=pow2(hd // 32),
                             **pdl(tokens.device))
    return ids, codes, row_scales
