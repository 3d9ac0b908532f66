"""Engram: the row gather (the rows a step needs from an Engram table, FP8 e4m3 [rows, d] with one E8M0 scale
per 32 values, dequantized into a device tensor) and the whole layer (the gathered rows through wkv, the
gated add into the streams) in one launch on the fast path. The tables of the released V4.1-Flash are
~100 GB each and stay in host memory; the kernels read the few rows a token needs straight from there
(host memory registered with the device: a captured decode cycle gathers without a host round trip), and
on CPU they read an ordinary tensor, so the tests exercise the same kernels.

The gather's reference and kernel are exact: an e4m3 value times a power of two fits float32 and bfloat16
without rounding. The layer: the kernel's product is the linear kernel's (float32 sums of exact products)
and its gates float32, the reference's float64; within one rounding of the activation dtype of it (and,
where a product sits at an FP8 boundary of the official activation quantization, one e4m3 step of that
input). A lookup moves, per token and Engram layer, n_cols rows of d + d/32 bytes over the host link
(V4.1-Flash: 24 rows of 264 B = 6.3 KB per layer, 12.7 KB per token for its two Engram layers).
"""

import torch

from . import linear
from ._triton import (
    INTERPRET,
    counters,
    device_function,
    device_of,
    pow2,
    require,
    require_dtype,
    round_out,
    tl,
    triton,
    tsum,
)
from .formats import e8m0_to_float
from .linear import PackedWeight, check_act_block, check_weight, kernel_args, mma_parts, quant_tile, weight_tile


def reference(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """ids [T, C] (int64, rows of `table`) -> [T, C * d] in out_dtype on ids' device. The gather happens
    where the table lives (a host table: a host round trip, which a CUDA graph cannot capture).

    Bytes moved: T * C * (d + d / 32) read, T * C * d * out_dtype size written."""
    flat = ids.reshape(-1).to(table.device)
    w = table[flat].float()
    s = e8m0_to_float(scale[flat]).repeat_interleave(32, dim=-1)
    return (w * s).reshape(ids.shape[0], -1).to(device=ids.device, dtype=out_dtype)


def layer_reference(X: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor,
                    wkv: PackedWeight, act_block: int | None, omega: torch.Tensor, eps: float) -> torch.Tensor:
    """One Engram layer on the streams X [T, hc, D]: the rows of `ids` [T, C] through `wkv` give hc keys and
    a value, and each copy adds the value through its gate:
        rho_j = rsqrt(mean(X_j^2) + eps) rsqrt(mean(key_j^2) + eps)
        delta_j = sum(X_j omega_j key_j) rho_j / sqrt(D),  gate_j = sigmoid(sign(delta_j) sqrt(max(|delta_j|, 1e-6)))
        X_j' = X_j + gate_j value
    in float64, rounded once to X's dtype (the official float32 interior)."""
    hc, d = X.shape[1], X.shape[2]
    kv = linear.reference(reference(table, scale, ids, X.dtype), wkv, act_block, X.dtype).double()
    keys = kv[:, : hc * d].view(-1, hc, d)
    value = kv[:, hc * d:]
    x = X.double()
    rho = torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(keys.square().mean(-1) + eps)
    delta = (x * omega.double() * keys).sum(-1) * rho * d**-0.5  # [T, hc]
    gate = torch.sigmoid(torch.sign(delta) * delta.abs().clamp(min=1e-6).sqrt())
    return (x + gate.unsqueeze(-1) * value.unsqueeze(1)).to(X.dtype)


# One launch: programs (output tile, row block) compute kv = wkv(rows) for their tile, the act tiles gathered
# from the table by the ids (dequantized, then the official FP8 quantization); the row block's last program
# (a counter) computes each row's gates from the whole kv row and writes X'. float32 throughout; per row.


@device_function
def _gathered_tile(table_ptr, scale_ptr, ids_ptr, rows, row_mask, k0, K, C, HD,
                   ACT_BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Columns [k0, k0 + BK) of the rows' gathered table rows (column k: row ids[m, k // HD], element k mod
    HD), dequantized exactly, FP8-quantized per ACT_BLOCK, float32 [BM, BK]."""
    cols = k0 + tl.arange(0, BK)
    m2 = row_mask[:, None] & (cols[None, :] < K)
    c = cols // HD
    j = cols % HD
    rid = tl.load(ids_ptr + rows[:, None].to(tl.int64) * C + c[None, :], mask=m2, other=0)
    code = tl.load(table_ptr + rid * HD + j[None, :], mask=m2, other=0.0).to(tl.float32)
    e = tl.load(scale_ptr + rid * (HD // 32) + (j // 32)[None, :], mask=m2, other=127).to(tl.int32)
    v = code * tl.where(e > 0, (e << 23).to(tl.float32, bitcast=True), 5.877471754111438e-39)
    if ACT_BLOCK > 0:
        v = quant_tile(v, BM, BK, ACT_BLOCK)
    return v


@triton.jit(do_not_specialize=["T"])  # row counts vary call by call: one compile
def _layer_kernel(table_ptr,  # e4m3 [rows, HD] (host memory registered with the device, or any tensor on CPU)
                  scale_ptr,  # E8M0 bytes [rows, HD / 32]
                  ids_ptr,    # int64 [T, C] the table rows of each position
                  w_ptr, s_ptr,  # wkv weight data and scale bytes [(hc + 1) D, C HD] (linear.weight_tile)
                  kv_ptr,     # scratch [T, (hc + 1) D] in X's dtype: the product
                  X_ptr,      # streams [T, hc, D]
                  om_ptr,     # float32 [hc, D] omega
                  out_ptr,    # out [T, hc, D]
                  cnt_ptr,    # int32 counters (one per row block), zero between launches
                  T, C, HD, hc, D, stride_wn, stride_sn, eps,
                  FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, ACT_BLOCK: tl.constexpr,
                  DOT_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, BD: tl.constexpr, BHC: tl.constexpr):
    tile = tl.program_id(0)
    pid_m = tl.program_id(1)
    N = (hc + 1) * D
    K = C * HD
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < T
    offs_n = tile * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // BO).to(tl.int64) * stride_sn
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = weight_tile(w_rows, s_rows, n_mask, k0, K, FMT, BI, BN, BK)
        a = _gathered_tile(table_ptr, scale_ptr, ids_ptr, rows, row_mask, k0, K, C, HD, ACT_BLOCK, BM, BK)
        acc = mma_parts(w, a, acc, 1, DOT_BF16)
    r64 = rows.to(tl.int64)
    tl.store(kv_ptr + r64[None, :] * N + offs_n[:, None], round_out(acc, OUT_BF16),
             mask=n_mask[:, None] & row_mask[None, :])
    tl.debug_barrier()  # every thread's part of the product is written before the counter's release
    if tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        k = tl.arange(0, BHC)
        km = k < hc
        # the gates: sums over D in BD-wide blocks, in order (float32)
        xs = tl.zeros((BM, BHC), dtype=tl.float32)
        ks = tl.zeros((BM, BHC), dtype=tl.float32)
        dot = tl.zeros((BM, BHC), dtype=tl.float32)
        m3 = row_mask[:, None, None] & km[None, :, None]
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cm = m3 & (cols[None, None, :] < D)
            x = tl.load(X_ptr + (r64[:, None, None] * hc + k[None, :, None]) * D + cols[None, None, :], mask=cm,
                        other=0.0).to(tl.float32)
            key = tl.load(kv_ptr + r64[:, None, None] * N + k[None, :, None] * D + cols[None, None, :], mask=cm,
                          other=0.0).to(tl.float32)
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
            v = tl.load(kv_ptr + r64[:, None] * N + hc * D + cols[None, :],
                        mask=row_mask[:, None] & (cols[None, :] < D), other=0.0).to(tl.float32)
            tl.store(out_ptr + (r64[:, None, None] * hc + k[None, :, None]) * D + cols[None, None, :],
                     round_out(x + gate[:, :, None] * v[:, None, :], OUT_BF16), mask=cm)
        tl.atomic_xchg(cnt_ptr + pid_m, 0)  # ready for the next launch (a graph replays this one)


def fast_layer(X: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, wkv: PackedWeight,
               act_block: int | None, omega: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel for `layer_reference` (same signature; within one rounding of X's dtype of it): one launch,
    the table read in place wherever it lives."""
    require_dtype(X, "X", (torch.float32, torch.bfloat16))
    require(X.dim() == 3, "X.dim()", X.dim(), "must be 3 ([T, hc, D])")
    t, hc, d = X.shape
    require_dtype(table, "table", (torch.float8_e4m3fn,))
    require_dtype(scale, "scale", (torch.float8_e8m0fnu, torch.uint8))
    rows, hd = table.shape
    require(hd % 32 == 0, "table.shape[1]", hd, "must be a multiple of 32 (one scale per 32)")
    require(tuple(scale.shape) == (rows, hd // 32), "scale.shape", tuple(scale.shape), f"must be {(rows, hd // 32)}")
    require(table.is_contiguous() and scale.is_contiguous(), "table", "strided", "table and scale must be contiguous")
    require_dtype(ids, "ids", (torch.int64,))
    require(ids.dim() == 2 and ids.shape[0] == t, "ids.shape", tuple(ids.shape), f"must be [{t}, C]")
    n, k = check_weight(wkv, "wkv")
    require(n == (hc + 1) * d and k == ids.shape[1] * hd, "wkv.shape", wkv.shape,
            f"must be {((hc + 1) * d, ids.shape[1] * hd)}")
    require(tuple(omega.shape) == (hc, d) and omega.dtype == torch.float32, "omega", tuple(omega.shape),
            f"must be float32 {(hc, d)}")
    ab = check_act_block(act_block, k)
    dev = device_of(X, ids, wkv.data, omega)
    X, ids, omega = X.contiguous(), ids.contiguous(), omega.contiguous()
    out = torch.empty_like(X)
    if t == 0:
        return out
    data, sc, swn, ssn, fmt, bo, bi = kernel_args(wkv)
    bm, bn, bk, _ = linear.plan([(n, ab, n)], k, dev)
    blocks = triton.cdiv(t, bm)
    cnt = counters(dev, blocks)
    kv = torch.empty((t, n), dtype=X.dtype, device=dev)
    _layer_kernel[(triton.cdiv(n, bn), blocks)](
        table, scale.view(torch.uint8), ids, data, sc, kv, X, omega, out, cnt, t, ids.shape[1], hd, hc, d, swn, ssn,
        float(eps), FMT=fmt, BO=bo, BI=bi, ACT_BLOCK=ab, DOT_BF16=wkv.bf16_exact and not INTERPRET,
        OUT_BF16=X.dtype == torch.bfloat16, BM=bm, BN=bn, BK=bk, BD=min(pow2(d), 4096 if INTERPRET else 256),
        BHC=pow2(hc))
    return out


# --- row ids ---------------------------------------------------------------------------------------------


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


@triton.jit(do_not_specialize=["T"])  # row counts vary call by call: one compile
def _ids_kernel(tok_ptr,    # int64 token history
                pos_ptr,    # int64 [T]
                map_ptr,    # int64 [V] compressed id of each token
                mult_ptr,   # int64 [L, NG] multipliers
                prime_ptr,  # int64 [L, COLS]
                off_ptr,    # int64 [L, COLS]
                out_ptr,    # out int64 [L, T, COLS]
                T, V, L, pad, COLS, n_heads,
                NG: tl.constexpr, BNG: tl.constexpr, BCOLS: tl.constexpr):
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
    for layer in range(L):
        m = tl.load(mult_ptr + layer * NG + i, mask=i < NG, other=0)
        term = c * m  # int64, wrapping like torch's
        r = tl.zeros((BCOLS,), dtype=tl.int64)
        for k in tl.static_range(NG):  # r_gram = xor of the terms i <= gram + 1
            tk = tsum(tl.where(i == k, term, 0), axis=0)
            r = tl.where(gram + 1 >= k, r ^ tk, r)
        prime = tl.load(prime_ptr + layer * COLS + cols, mask=cm, other=1)
        h = r % prime
        h = tl.where(h < 0, h + prime, h)  # torch's remainder takes the divisor's sign
        tl.store(out_ptr + (layer * T + t) * COLS + cols, h + tl.load(off_ptr + layer * COLS + cols, mask=cm, other=0),
                 mask=cm)


def fast_ids(tokens: torch.Tensor, positions: torch.Tensor, token_map: torch.Tensor, pad: int, mult: torch.Tensor,
             primes: torch.Tensor, offsets: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The kernel for `ids_reference` (same signature and result, bit for bit): one launch for every
    Engram layer, no host read (capturable)."""
    for name, t in (("tokens", tokens), ("positions", positions), ("token_map", token_map), ("mult", mult),
                    ("primes", primes), ("offsets", offsets)):
        require_dtype(t, name, (torch.int64,))
    layers, ng = mult.shape
    cols = (ng - 1) * n_heads
    require(primes.shape == (layers, cols) and offsets.shape == (layers, cols), "primes.shape", tuple(primes.shape),
            f"must be {(layers, cols)}, as offsets")
    dev = device_of(tokens, positions, token_map, mult, primes, offsets)
    t = positions.numel()
    out = torch.empty((layers, t, cols), dtype=torch.int64, device=dev)
    if t:
        _ids_kernel[(t,)](tokens, positions.contiguous(), token_map, mult.contiguous(), primes.contiguous(),
                          offsets.contiguous(), out, t, token_map.numel(), layers, int(pad), cols, n_heads, NG=ng,
                          BNG=pow2(ng), BCOLS=pow2(cols))
    return out
