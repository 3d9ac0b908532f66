"""Sparse decode attention with an attention sink, one shared KV head (K = V).

Each query row m attends to its key list: (a) the window keys `window_kv[window_index[m, j]]`, listed in
position order (oldest first), and (b) the compressed rows `comp_kv[comp_index[m, i]]`, ascending; -1
entries are none. Per head h:
    l_j = (q_h . k_j) * scale;  M = max_j l_j;  P_j = exp(l_j - M);  Z = sum_j P_j + exp(sink_h - M)
    o_h = (sum_j P_j v_j) / Z
The reference accumulates in float64 over the window rows masked as a set (the order of rows does not
matter to it) and rounds once; `p_dtype` rounds the unnormalized P before the PV product, as the official
bf16 kernel does.

Kernel (`fast`), float32 only, flash-decoding style in three launches: (1) logits for blocks of keys x all
heads, (2) per key split: the row max over all keys, P = exp(l - M) with that global max (so `p_dtype`
rounds P as the reference does), partial Z and P.V, (3) the splits added in split order, the sink term, one
division and one rounding. Dots accumulate in float32: bfloat16 operands on tensor cores (exact products),
float32 ones as float32 FMA dots (exact products are not needed: the logits of float32 runs are float32
sums, as in the official code).
Batch invariance by construction: one program per query row; a query's keys are reduced in the order of
its key list, whose window part is canonical (by position: a key reads the same whether it came from the
ring or from the same call, so a verify block of k+1 rows equals k+1 single steps); key blocks (BN) and
splits are at fixed absolute key indices, tile shapes fixed by (H, d) only; a block or split whose keys are
all invalid adds exactly zero (the max is global, so nothing is rescaled), so extra -1 entries (a longer
reach) change nothing. Offsets that multiply a row index are int64.
Tolerance against `reference` (relative to the largest |o|): float32 q: 2^-18 (float32 logits, exp and
sums: a few ulps, amplified by |l| at most ~2^4 in exp); bfloat16 q: one bfloat16 rounding of o plus,
where a float32 P sits at a bfloat16 rounding boundary, one bfloat16 ulp of that P term: 2^-7.
"""

import torch

from ._triton import (
    INTERPRET,
    bf16_rne,
    device_function,
    device_of,
    pow2,
    require,
    require_dtype,
    require_rows,
    round_out,
    tl,
    tmax,
    triton,
    tsum,
)


def window_mask(window_index: torch.Tensor, n_window: int) -> torch.Tensor:
    """[M, W] row indices (-1 = none) -> bool [M, n_window]: the rows each query sees, as a set."""
    m = window_index.shape[0]
    cols = torch.where(window_index >= 0, window_index, n_window)
    mask = torch.zeros((m, n_window + 1), dtype=torch.bool, device=window_index.device)
    return mask.scatter_(1, cols, True)[:, :n_window]


def reference(q: torch.Tensor, window_kv: torch.Tensor, window_index: torch.Tensor,
              comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
              p_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [M, H, d]; window_kv [Nw, d]; window_index [M, W] int64 (the window rows each query sees, by
    position; -1 = none); comp_kv [Nc, d]; comp_index [M, K] int64 (-1 = none); sink [H] -> o [M, H, d]
    in q.dtype.

    Bytes moved: q + o + window_kv once + K gathered rows per query (d elements each)."""
    mask = window_mask(window_index, window_kv.shape[0])
    q64 = q.double()
    kw = window_kv.double()
    logits = torch.einsum("mhd,nd->mhn", q64, kw) * scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    values = [kw.expand(q.shape[0], -1, -1)]
    if comp_index is not None and comp_index.shape[-1] > 0:
        valid = comp_index >= 0
        rows = comp_kv.double()[comp_index.clamp(min=0)]  # [M, K, d]
        lc = torch.einsum("mhd,mkd->mhk", q64, rows) * scale
        logits = torch.cat((logits, lc.masked_fill(~valid.unsqueeze(1), float("-inf"))), dim=-1)
        values.append(rows)
    v = torch.cat(values, dim=1)  # [M, Nw + K, d]
    mx = logits.amax(-1, keepdim=True).clamp(min=-1e30)
    p = torch.exp(logits - mx)
    z = p.sum(-1, keepdim=True) + torch.exp(sink.double().view(1, -1, 1) - mx)
    if p_dtype is not None:
        p = p.to(p_dtype).double()
    o = torch.einsum("mhn,mnd->mhd", p, v) / z
    return o.to(q.dtype)


# --- Triton kernels --------------------------------------------------------------------------------------


@device_function
def _gather_keys(win_ptr, comp_ptr, wi_ptr, ci_ptr, m, keys, dcols, W, NT, Nw, Nc, d,
                 stride_w, stride_c, stride_wi, stride_ci):
    """Entries `keys` of query row m's key list ([BN, BD] at columns dcols, zero where invalid) and their
    validity: entry j < W is window_kv[window_index[m, j]], entry j >= W is comp_kv[comp_index[m, j - W]],
    each valid where the index is in range."""
    in_list = keys < NT
    is_w = keys < W
    widx = tl.load(wi_ptr + m * stride_wi + keys, mask=is_w & in_list, other=-1)
    cidx = tl.load(ci_ptr + m * stride_ci + (keys - W), mask=(keys >= W) & in_list, other=-1)
    wvalid = is_w & in_list & (widx >= 0) & (widx < Nw)
    cvalid = (keys >= W) & in_list & (cidx >= 0) & (cidx < Nc)
    dmask = dcols[None, :] < d
    kw = tl.load(win_ptr + widx[:, None] * stride_w + dcols[None, :], mask=wvalid[:, None] & dmask, other=0.0)
    kc = tl.load(comp_ptr + cidx[:, None] * stride_c + dcols[None, :], mask=cvalid[:, None] & dmask, other=0.0)
    return tl.where(wvalid[:, None], kw, kc), wvalid | cvalid


@device_function
def _dot(a, b, acc, DOT_BF16: tl.constexpr):
    """acc + a . b: bfloat16 operands on tensor cores (DOT_BF16: the values are bfloat16 values), else a
    float32 FMA dot."""
    if DOT_BF16:
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _logits_kernel(q_ptr,      # q [M, H, d] (float32 / bfloat16), contiguous
                   win_ptr,    # window_kv [Nw, d], row stride stride_w
                   comp_ptr,   # comp_kv [Nc, d], row stride stride_c (window_kv when there is none)
                   wi_ptr,     # int64 window_index [M, W], row stride stride_wi
                   ci_ptr,     # int64 comp_index [M, K], row stride stride_ci
                   l_ptr,      # out: float32 logits [M, H, NT] (NT = W + K); -inf = invalid
                   H, d, W, NT, Nw, Nc, stride_w, stride_c, stride_wi, stride_ci,
                   scale,      # float32
                   DOT_BF16: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    keys = tl.program_id(1) * BN + tl.arange(0, BN)
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    hmask = heads < H
    acc = tl.zeros((BH, BN), dtype=tl.float32)
    valid = keys < 0
    for d0 in range(0, d, BD):
        dcols = d0 + tl.arange(0, BD)
        q = tl.load(q_ptr + (m * H + heads[:, None]) * d + dcols[None, :], mask=hmask[:, None] & (dcols[None, :] < d),
                    other=0.0)
        k, valid = _gather_keys(win_ptr, comp_ptr, wi_ptr, ci_ptr, m, keys, dcols, W, NT, Nw, Nc, d,
                                stride_w, stride_c, stride_wi, stride_ci)
        acc = _dot(q, tl.trans(k), acc, DOT_BF16)
    lg = tl.where(valid[None, :], acc * scale, float("-inf"))
    tl.store(l_ptr + (m * H + heads[:, None]) * NT + keys[None, :], lg, mask=hmask[:, None] & (keys[None, :] < NT))


@triton.jit
def _pv_kernel(l_ptr,      # float32 logits [M, H, NT] from _logits_kernel
               win_ptr, comp_ptr, wi_ptr, ci_ptr,  # the key lists, as for _logits_kernel
               sink_ptr,   # float32 [H]
               o_ptr,      # out [M, H, d] in q's dtype (written when SPLIT == 1)
               acc_ptr,    # float32 [SPLIT, M, H, d] partial P.V (SPLIT > 1)
               z_ptr,      # float32 [SPLIT, M, H] partial Z (SPLIT > 1)
               mx_ptr,     # float32 [M, H] row max (SPLIT > 1)
               M, H, d, W, NT, Nw, Nc, stride_w, stride_c, stride_wi, stride_ci, keys_per_split,
               P_ROUND: tl.constexpr, DOT_BF16: tl.constexpr, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr,
               BH: tl.constexpr, BN: tl.constexpr, BDV: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    n_dchunks = (d + BDV - 1) // BDV
    split = tl.program_id(2) // n_dchunks
    dcols = (tl.program_id(2) % n_dchunks) * BDV + tl.arange(0, BDV)
    lrow = l_ptr + (m * H + heads) * NT
    mx = tl.full((BH,), float("-inf"), dtype=tl.float32)
    for n0 in range(0, NT, BN):
        keys = n0 + tl.arange(0, BN)
        lg = tl.load(lrow[:, None] + keys[None, :], mask=hmask[:, None] & (keys[None, :] < NT), other=float("-inf"))
        mx = tl.maximum(mx, tmax(lg, axis=1))
    mx = tl.maximum(mx, -1e30)
    z = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BDV), dtype=tl.float32)
    k_lo = split * keys_per_split
    k_end = tl.minimum(NT, k_lo + keys_per_split)
    for n0 in range(k_lo, k_end, BN):
        keys = n0 + tl.arange(0, BN)
        lg = tl.load(lrow[:, None] + keys[None, :], mask=hmask[:, None] & (keys[None, :] < k_end),
                     other=float("-inf"))
        p = tl.exp(lg - mx[:, None])
        z += tsum(p, axis=1)
        if P_ROUND == 2:
            p = bf16_rne(p).to(tl.float32)
        v, valid = _gather_keys(win_ptr, comp_ptr, wi_ptr, ci_ptr, m, keys, dcols, W, k_end, Nw, Nc, d,
                                stride_w, stride_c, stride_wi, stride_ci)
        acc = _dot(p, v, acc, DOT_BF16)
    omask = hmask[:, None] & (dcols[None, :] < d)
    if SPLIT == 1:
        z += tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0) - mx)
        tl.store(o_ptr + (m * H + heads[:, None]) * d + dcols[None, :], round_out(acc / z[:, None], OUT_BF16),
                 mask=omask)
    else:
        tl.store(acc_ptr + ((split * M + m) * H + heads[:, None]) * d + dcols[None, :], acc, mask=omask)
        if tl.program_id(2) % n_dchunks == 0:
            tl.store(z_ptr + (split * M + m) * H + heads, z, mask=hmask)
            if split == 0:
                tl.store(mx_ptr + m * H + heads, mx, mask=hmask)


@triton.jit
def _combine_kernel(acc_ptr, z_ptr, mx_ptr,  # float32 partials from _pv_kernel
                    sink_ptr,                # float32 [H]
                    o_ptr,                   # out [M, H, d] in q's dtype
                    M, H, d, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    dcols = tl.program_id(2) * BDV + tl.arange(0, BDV)
    omask = hmask[:, None] & (dcols[None, :] < d)
    mx = tl.load(mx_ptr + m * H + heads, mask=hmask, other=0.0)
    z = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BDV), dtype=tl.float32)
    for s in range(SPLIT):  # split order: the same result however the splits were scheduled
        z += tl.load(z_ptr + (s * M + m) * H + heads, mask=hmask, other=0.0)
        acc += tl.load(acc_ptr + ((s * M + m) * H + heads[:, None]) * d + dcols[None, :], mask=omask, other=0.0)
    z += tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0) - mx)
    tl.store(o_ptr + (m * H + heads[:, None]) * d + dcols[None, :], round_out(acc / z[:, None], OUT_BF16), mask=omask)


_P_ROUND = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def blocks(h: int, qk_bf16: bool) -> tuple[int, int, int, int, int]:
    """(BH, BN, BD, BDV, keys per split): fixed by the head count and the operands' dtype, never by the
    number of rows or keys."""
    if INTERPRET:
        return pow2(h), 128, 64, 64, 128
    if qk_bf16:
        return min(64, pow2(h, 16)), 64, 64, 64, 512
    return min(64, pow2(h, 16)), 32, 16, 32, 512


def fast(q: torch.Tensor, window_kv: torch.Tensor, window_index: torch.Tensor,
         comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
         p_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernels for `reference` (same signature; results within the stated tolerance)."""
    require_dtype(q, "q", (torch.float32, torch.bfloat16))
    require(q.dim() == 3, "q.dim()", q.dim(), "must be 3 ([M, H, d])")
    m, h, d = q.shape
    require(window_kv.dim() == 2 and window_kv.shape[1] == d, "window_kv.shape", tuple(window_kv.shape),
            f"must be [Nw, {d}]")
    require_dtype(window_kv, "window_kv", (torch.float32, torch.bfloat16))
    nw = window_kv.shape[0]
    require(window_index.dim() == 2 and window_index.shape[0] == m, "window_index.shape",
            tuple(window_index.shape), f"must be [{m}, W]")
    require_dtype(window_index, "window_index", (torch.int64,))
    require(tuple(sink.shape) == (h,), "sink.shape", tuple(sink.shape), f"must be {(h,)}")
    require_dtype(sink, "sink", (torch.float32,))
    require(p_dtype in _P_ROUND, "p_dtype", p_dtype, "must be None, float32 or bfloat16")
    if comp_index is None or comp_index.shape[-1] == 0:
        comp_kv, comp_index = window_kv, torch.empty((m, 0), dtype=torch.int64, device=q.device)
    require(comp_kv is not None, "comp_kv", None, "must be given with comp_index")
    require(comp_kv.dim() == 2 and comp_kv.shape[1] == d, "comp_kv.shape", tuple(comp_kv.shape), f"must be [Nc, {d}]")
    require_dtype(comp_kv, "comp_kv", (torch.float32, torch.bfloat16))
    require(comp_index.dim() == 2 and comp_index.shape[0] == m, "comp_index.shape", tuple(comp_index.shape),
            f"must be [{m}, K]")
    require_dtype(comp_index, "comp_index", (torch.int64,))
    for name, t in (("window_kv", window_kv), ("comp_kv", comp_kv), ("comp_index", comp_index),
                    ("window_index", window_index)):
        require_rows(t, name)
    dev = device_of(q, window_kv, window_index, comp_kv, comp_index, sink)
    q = q.contiguous()
    o = torch.empty_like(q)
    w = window_index.shape[1]
    nt = w + comp_index.shape[1]
    if m == 0 or h == 0 or d == 0:
        return o
    qk_bf16 = q.dtype == window_kv.dtype == comp_kv.dtype == torch.bfloat16
    bh, bn, bd, bdv, keys_per_split = blocks(h, qk_bf16)
    splits = triton.cdiv(nt, keys_per_split)
    logits = torch.empty((m, h, nt), dtype=torch.float32, device=dev)
    sizes = (w, nt, nw, comp_kv.shape[0])
    strides = (window_kv.stride(0), comp_kv.stride(0), window_index.stride(0), comp_index.stride(0))
    _logits_kernel[(m, triton.cdiv(nt, bn), triton.cdiv(h, bh))](
        q, window_kv, comp_kv, window_index, comp_index, logits, h, d, *sizes, *strides, float(scale),
        DOT_BF16=qk_bf16 and not INTERPRET, BH=bh, BN=bn, BD=bd)
    out_bf16 = q.dtype == torch.bfloat16
    n_dchunks = triton.cdiv(d, bdv)
    if splits > 1:
        acc = torch.empty((splits, m, h, d), dtype=torch.float32, device=dev)
        z = torch.empty((splits, m, h), dtype=torch.float32, device=dev)
        mx = torch.empty((m, h), dtype=torch.float32, device=dev)
    else:
        acc = z = mx = logits
    pv_bf16 = p_dtype == torch.bfloat16 and window_kv.dtype == comp_kv.dtype == torch.bfloat16 and not INTERPRET
    _pv_kernel[(m, triton.cdiv(h, bh), splits * n_dchunks)](
        logits, window_kv, comp_kv, window_index, comp_index, sink, o, acc, z, mx, m, h, d, *sizes, *strides,
        keys_per_split, P_ROUND=_P_ROUND[p_dtype], DOT_BF16=pv_bf16, SPLIT=splits, OUT_BF16=out_bf16, BH=bh,
        BN=bn, BDV=bdv)
    if splits > 1:
        _combine_kernel[(m, triton.cdiv(h, bh), n_dchunks)](acc, z, mx, sink, o, m, h, d, SPLIT=splits,
                                                            OUT_BF16=out_bf16, BH=bh, BDV=bdv)
    return o
