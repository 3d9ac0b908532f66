"""Sparse decode attention with an attention sink, one shared KV head (K = V).

Each query row m attends to (a) the window keys `window_kv[j]` where `window_mask[m, j]`, and (b) the
compressed rows `comp_kv[comp_index[m, i]]` for valid indices (>= 0). Per head h:
    l_j = (q_h . k_j) * scale;  M = max_j l_j;  P_j = exp(l_j - M);  Z = sum_j P_j + exp(sink_h - M)
    o_h = (sum_j P_j v_j) / Z
The reference accumulates in float64 (the order of rows in the key set then does not matter) and
rounds once; `p_dtype` rounds the unnormalized P before the PV product, as the official bf16 kernel does.

Kernel (`fast`), flash-decoding style in three launches: (1) logits for blocks of keys x all heads (the
shared KV row is read once per head block), (2) per key split: the row max over all keys, P = exp(l - M)
with the global M (so `p_dtype` rounds P exactly as the reference does), partial Z and P.V, (3) the
splits added in split order, the sink term, one division and one rounding.
Accumulation: the logits in float64 for float32 operands (parity runs) and in float32 for bfloat16
operands (the official kernel's precision; the products are exact in float32); exp, Z and P.V always in
float64, so the result does not depend on the order of keys (a verify block lists its window keys
differently from a single step).
Tolerance: float32 q: within one float32 rounding (in practice bit-identical); bfloat16 q: within one
bfloat16 rounding (2^-8 relative) plus what the float32 logits change in P (they differ from float64
logits by about 2^-24 |q||k|).
"""

import torch

from ._triton import (
    INTERPRET,
    bf16_rne,
    const64,
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


def reference(q: torch.Tensor, window_kv: torch.Tensor, window_mask: torch.Tensor,
              comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
              p_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [M, H, d]; window_kv [Nw, d]; window_mask [M, Nw] bool; comp_kv [Nc, d]; comp_index [M, K] int64
    (-1 = none); sink [H] -> o [M, H, d] in q.dtype.

    Bytes moved: q + o + window_kv once + K gathered rows per query (d elements each)."""
    q64 = q.double()
    kw = window_kv.double()
    logits = torch.einsum("mhd,nd->mhn", q64, kw) * scale
    logits = logits.masked_fill(~window_mask.unsqueeze(1), float("-inf"))
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
def _gather_keys(win_ptr, comp_ptr, ci_ptr, mask_ptr, m, keys, dcols, Nw, NT, Nc, d,
                 stride_w, stride_c, stride_ci, stride_mask):
    """Key rows `keys` of query row m's key set ([BN, BD] at columns dcols, zero where invalid) and
    their validity: window key j < Nw if window_mask[m, j]; compressed key j >= Nw is comp_kv[idx] for
    idx = comp_index[m, j - Nw] >= 0."""
    in_set = keys < NT
    is_w = keys < Nw
    wvalid = tl.load(mask_ptr + m * stride_mask + keys, mask=is_w & in_set, other=0) != 0
    cidx = tl.load(ci_ptr + m * stride_ci + (keys - Nw), mask=(keys >= Nw) & in_set, other=-1)
    cvalid = (keys >= Nw) & in_set & (cidx >= 0) & (cidx < Nc)
    dmask = dcols[None, :] < d
    kw = tl.load(win_ptr + keys[:, None] * stride_w + dcols[None, :], mask=wvalid[:, None] & dmask, other=0.0)
    kc = tl.load(comp_ptr + cidx[:, None] * stride_c + dcols[None, :], mask=cvalid[:, None] & dmask, other=0.0)
    return tl.where(wvalid[:, None], kw, kc), wvalid | cvalid


@triton.jit
def _logits_kernel(q_ptr,      # q [M, H, d] (float32 / bfloat16), contiguous
                   win_ptr,    # window_kv [Nw, d], row stride stride_w
                   comp_ptr,   # comp_kv [Nc, d], row stride stride_c (window_kv when there is none)
                   ci_ptr,     # int64 comp_index [M, K], row stride stride_ci
                   mask_ptr,   # window_mask as uint8 [M, Nw], row stride stride_mask
                   scale_ptr,  # float64 [1]: the softmax scale
                   l_ptr,      # out: logits [M, H, NT] (float64, or float32 for bfloat16 operands); -inf = invalid
                   H, d, Nw, NT, Nc, stride_w, stride_c, stride_ci, stride_mask,
                   QK_F64: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0)
    keys = tl.program_id(1) * BN + tl.arange(0, BN)
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    hmask = heads < H
    if QK_F64:
        acc = tl.zeros((BH, BN), dtype=tl.float64)
    else:
        acc = tl.zeros((BH, BN), dtype=tl.float32)
    valid = keys < 0
    for d0 in range(0, d, BD):
        dcols = d0 + tl.arange(0, BD)
        q = tl.load(q_ptr + (m * H + heads[:, None]) * d + dcols[None, :], mask=hmask[:, None] & (dcols[None, :] < d),
                    other=0.0)
        k, valid = _gather_keys(win_ptr, comp_ptr, ci_ptr, mask_ptr, m, keys, dcols, Nw, NT, Nc, d,
                                stride_w, stride_c, stride_ci, stride_mask)
        if QK_F64:
            acc += tl.dot(q.to(tl.float64), tl.trans(k.to(tl.float64)))
        else:
            # float32 FMA dot ("ieee"): the interpreter's bfloat16 dot is wrong, so keep one code path
            acc += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    lg = acc.to(tl.float64) * tl.load(scale_ptr)
    lg = tl.where(valid[None, :], lg, float("-inf"))
    tl.store(l_ptr + (m * H + heads[:, None]) * NT + keys[None, :], lg.to(l_ptr.dtype.element_ty),
             mask=hmask[:, None] & (keys[None, :] < NT))


@triton.jit
def _pv_kernel(l_ptr,      # logits [M, H, NT] from _logits_kernel
               win_ptr, comp_ptr, ci_ptr, mask_ptr,  # the key set, as for _logits_kernel
               sink_ptr,   # float32 [H]
               o_ptr,      # out [M, H, d] in q's dtype (written when SPLIT == 1)
               acc_ptr,    # float64 [SPLIT, M, H, d] partial P.V (SPLIT > 1)
               z_ptr,      # float64 [SPLIT, M, H] partial Z (SPLIT > 1)
               mx_ptr,     # float64 [M, H] row max (SPLIT > 1)
               M, H, d, Nw, NT, Nc, stride_w, stride_c, stride_ci, stride_mask, keys_per_split,
               P_ROUND: tl.constexpr, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr,
               BH: tl.constexpr, BN: tl.constexpr, BDV: tl.constexpr):
    m = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    n_dchunks = (d + BDV - 1) // BDV
    split = tl.program_id(2) // n_dchunks
    dcols = (tl.program_id(2) % n_dchunks) * BDV + tl.arange(0, BDV)
    lrow = l_ptr + (m * H + heads) * NT
    mx = tl.full((BH,), float("-inf"), dtype=tl.float64)
    for n0 in range(0, NT, BN):
        keys = n0 + tl.arange(0, BN)
        lg = tl.load(lrow[:, None] + keys[None, :], mask=hmask[:, None] & (keys[None, :] < NT), other=float("-inf"))
        mx = tl.maximum(mx, tmax(lg.to(tl.float64), axis=1))
    mx = tl.maximum(mx, -1e30)
    z = tl.zeros((BH,), dtype=tl.float64)
    acc = tl.zeros((BH, BDV), dtype=tl.float64)
    k_lo = split * keys_per_split
    k_end = tl.minimum(NT, k_lo + keys_per_split)
    for n0 in range(k_lo, k_end, BN):
        keys = n0 + tl.arange(0, BN)
        lg = tl.load(lrow[:, None] + keys[None, :], mask=hmask[:, None] & (keys[None, :] < k_end),
                     other=float("-inf")).to(tl.float64)
        p = tl.exp(lg - mx[:, None])
        z += tsum(p, axis=1)
        if P_ROUND == 1:
            p = p.to(tl.float32).to(tl.float64)
        elif P_ROUND == 2:
            p = bf16_rne(p.to(tl.float32)).to(tl.float64)
        v, valid = _gather_keys(win_ptr, comp_ptr, ci_ptr, mask_ptr, m, keys, dcols, Nw, k_end, Nc, d,
                                stride_w, stride_c, stride_ci, stride_mask)
        acc += tl.dot(p, v.to(tl.float64))
    omask = hmask[:, None] & (dcols[None, :] < d)
    if SPLIT == 1:
        z += tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float64) - mx)
        tl.store(o_ptr + (m * H + heads[:, None]) * d + dcols[None, :], round_out(acc / z[:, None], OUT_BF16),
                 mask=omask)
    else:
        tl.store(acc_ptr + ((split * M + m) * H + heads[:, None]) * d + dcols[None, :], acc, mask=omask)
        if tl.program_id(2) % n_dchunks == 0:
            tl.store(z_ptr + (split * M + m) * H + heads, z, mask=hmask)
            if split == 0:
                tl.store(mx_ptr + m * H + heads, mx, mask=hmask)


@triton.jit
def _combine_kernel(acc_ptr, z_ptr, mx_ptr,  # partials from _pv_kernel
                    sink_ptr,                # float32 [H]
                    o_ptr,                   # out [M, H, d] in q's dtype
                    M, H, d, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, BH: tl.constexpr, BDV: tl.constexpr):
    m = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    dcols = tl.program_id(2) * BDV + tl.arange(0, BDV)
    omask = hmask[:, None] & (dcols[None, :] < d)
    mx = tl.load(mx_ptr + m * H + heads, mask=hmask, other=0.0)
    z = tl.zeros((BH,), dtype=tl.float64)
    acc = tl.zeros((BH, BDV), dtype=tl.float64)
    for s in range(SPLIT):  # split order: the same result however the splits were scheduled
        z += tl.load(z_ptr + (s * M + m) * H + heads, mask=hmask, other=0.0)
        acc += tl.load(acc_ptr + ((s * M + m) * H + heads[:, None]) * d + dcols[None, :], mask=omask, other=0.0)
    z += tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float64) - mx)
    tl.store(o_ptr + (m * H + heads[:, None]) * d + dcols[None, :], round_out(acc / z[:, None], OUT_BF16), mask=omask)


_P_ROUND = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def fast(q: torch.Tensor, window_kv: torch.Tensor, window_mask: torch.Tensor,
         comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
         p_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernels for `reference` (same signature and result)."""
    require_dtype(q, "q", (torch.float32, torch.bfloat16))
    require(q.dim() == 3, "q.dim()", q.dim(), "must be 3 ([M, H, d])")
    m, h, d = q.shape
    require(window_kv.dim() == 2 and window_kv.shape[1] == d, "window_kv.shape", tuple(window_kv.shape),
            f"must be [Nw, {d}]")
    require_dtype(window_kv, "window_kv", (torch.float32, torch.bfloat16))
    nw = window_kv.shape[0]
    require(tuple(window_mask.shape) == (m, nw), "window_mask.shape", tuple(window_mask.shape), f"must be {(m, nw)}")
    require_dtype(window_mask, "window_mask", (torch.bool,))
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
                    ("window_mask", window_mask)):
        require_rows(t, name)
    dev = device_of(q, window_kv, window_mask, comp_kv, comp_index, sink)
    q = q.contiguous()
    o = torch.empty_like(q)
    nt = nw + comp_index.shape[1]
    if m == 0 or h == 0 or d == 0:
        return o
    qk_f64 = not (q.dtype == window_kv.dtype == comp_kv.dtype == torch.bfloat16)
    if INTERPRET:
        bh, bn, bd, bdv = pow2(h), min(pow2(nt), 256), pow2(d), pow2(d)
        keys_per_split = 128
    else:
        # shared memory of the pipelined dot tiles (x3 stages) stays under 227 KB: float64 64x64 tiles,
        # float32 64 heads x 64 dims and 128 keys x 64 dims
        bh, bn, bd, bdv = min(64, pow2(h, 16)), 64 if qk_f64 else 128, 64, 64
        keys_per_split = 512
    splits = triton.cdiv(nt, keys_per_split)
    mask_u8 = window_mask.view(torch.uint8)
    scale64 = const64((float(scale),), dev)
    logits = torch.empty((m, h, nt), dtype=torch.float64 if qk_f64 else torch.float32, device=dev)
    strides = (window_kv.stride(0), comp_kv.stride(0), comp_index.stride(0), mask_u8.stride(0))
    _logits_kernel[(m, triton.cdiv(nt, bn), triton.cdiv(h, bh))](
        q, window_kv, comp_kv, comp_index, mask_u8, scale64, logits, h, d, nw, nt, comp_kv.shape[0], *strides,
        QK_F64=qk_f64, BH=bh, BN=bn, BD=bd)
    out_bf16 = q.dtype == torch.bfloat16
    n_dchunks = triton.cdiv(d, bdv)
    if splits > 1:
        acc = torch.empty((splits, m, h, d), dtype=torch.float64, device=dev)
        z = torch.empty((splits, m, h), dtype=torch.float64, device=dev)
        mx = torch.empty((m, h), dtype=torch.float64, device=dev)
    else:
        acc = z = mx = logits
    _pv_kernel[(m, triton.cdiv(h, bh), splits * n_dchunks)](
        logits, window_kv, comp_kv, comp_index, mask_u8, sink, o, acc, z, mx, m, h, d, nw, nt, comp_kv.shape[0],
        *strides, keys_per_split, P_ROUND=_P_ROUND[p_dtype], SPLIT=splits, OUT_BF16=out_bf16, BH=bh, BN=bn, BDV=bdv)
    if splits > 1:
        _combine_kernel[(m, triton.cdiv(h, bh), n_dchunks)](acc, z, mx, sink, o, m, h, d, SPLIT=splits,
                                                            OUT_BF16=out_bf16, BH=bh, BDV=bdv)
    return o
