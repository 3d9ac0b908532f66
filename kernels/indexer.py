"""Lightning-indexer scoring and top-k selection of compressed rows.

scores: s[m, t] = sum_h w[m, h] * relu(q[m, h] . K[t]) for rows t < n_valid[m], -inf elsewhere.
`round_dtype` reproduces the official precision: the dot, the relu-weight product and the head sum are
each rounded to that dtype (bf16 on the device; the activation dtype in general). None = one rounding.
select: the k' = min(k, n_valid) largest scores, indices ascending, -1 in unused slots. Exact ties (the
ReLU makes zero scores common) go to the lower row index, whatever the length of the row: a query selects
the same rows in a prefill chunk, a verify block or a single decode step.

Kernels:
- `fast_scores`, float32 only: one program per block of keys (BN fixed by the operands' dtype, never by the
  number of keys), looping over the query rows with the same tiles for each, so each key is read once and a
  row's scores do not depend on the other rows or on how many keys there are (batch invariant). The dots
  accumulate in float32 (bfloat16 operands on tensor cores, exact products; float32 operands as FMA dots);
  relu, weights and the head sum in float32 with the reference's roundings. With the FP4-quantized
  operands of `official` numerics the dots are exact, and so are the bfloat16 products and (for a spread of
  exponents under 16 bits) the head sum: bit-identical in practice. Tolerance: float32 operands without
  rounding: 2^-22 relative to the largest score (float32 sums over dI and the heads); with a
  `round_dtype`: one rounding of it where a float32 sum differs from the float64 one.
- `fast_select`: exact top-k by radix selection on the float bit patterns (8 counting passes of 4 bits
  for the k-th largest value, then one compaction pass in row order), so the tie rule is the reference's: the
  lower index wins. Bit-identical.
- `fast_candidate_mask`: block maxima (with the forced newest block), the same top-k kernel over blocks,
  and the expansion to rows. Bit-identical.
"""

import torch

from ._triton import (
    INTERPRET,
    as_int64,
    bf16_value,
    device_function,
    device_of,
    pow2,
    require,
    require_dtype,
    require_rows,
    tcumsum,
    tl,
    tmax,
    triton,
    tsum,
)


def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
           round_dtype: torch.dtype | None, reduce=None) -> torch.Tensor:
    """q [M, nh, dI], w [M, nh] (already scaled), keys [N, dI], n_valid [M] -> float32 [M, N].
    `reduce` (tensor parallel, heads split over ranks) is applied to the float64 head sum before its
    final rounding: an all-reduce makes every rank's scores those of all heads.
    Bytes moved: keys once (N x dI) + q + w + the [M, N] scores."""
    d = torch.einsum("mhd,nd->mhn", q.double(), keys.double())
    if round_dtype is not None:
        d = d.to(round_dtype).double()
        s = (torch.relu(d) * w.double().unsqueeze(-1)).to(round_dtype).double().sum(1)
    else:
        s = (torch.relu(d) * w.double().unsqueeze(-1)).sum(1)
    if reduce is not None:
        s = reduce(s)
    s = s.to(round_dtype).float() if round_dtype is not None else s.float()
    t = torch.arange(keys.shape[0], device=keys.device)
    return s.masked_fill(t.unsqueeze(0) >= n_valid.unsqueeze(1), float("-inf"))


def select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [M, N] (-inf = not selectable) -> int64 [M, min(k, N)] ascending, -1 for -inf picks."""
    k = min(k, scores.shape[-1])
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    idx = _top(scores, k)
    val = scores.gather(-1, idx)
    idx = idx.masked_fill(val == float("-inf"), -1)
    big = torch.iinfo(torch.long).max
    idx = torch.where(idx < 0, big, idx).sort(-1).values
    return idx.masked_fill(idx == big, -1)


def candidate_mask(scores: torch.Tensor, n_valid: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """V4.1 level one: per row, keep the `top_blocks` blocks of `block` rows with the highest max score
    (the newest block, possibly partial, always kept); returns bool [M, N] over the kept blocks' rows."""
    m, n = scores.shape
    n_blocks = -(-n // block)
    padded = torch.full((m, n_blocks * block), float("-inf"), device=scores.device)
    padded[:, :n] = scores
    bs = padded.view(m, n_blocks, block).amax(-1)
    last = torch.div(n_valid - 1, block, rounding_mode="floor").clamp(min=0)
    bs = bs.scatter(1, last.unsqueeze(1), float("inf"))
    real_blocks = torch.arange(n_blocks, device=scores.device).unsqueeze(0) <= last.unsqueeze(1)
    bs = bs.masked_fill(~real_blocks | (n_valid.unsqueeze(1) == 0), float("-inf"))
    k = min(top_blocks, n_blocks)
    idx = _top(bs, k)
    val = bs.gather(-1, idx)
    keep = torch.zeros(m, n_blocks, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, idx, val > float("-inf"))
    return keep.repeat_interleave(block, dim=1)[:, :n]


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


# --- Triton kernels --------------------------------------------------------------------------------------


@device_function
def _round_to(v, RD: tl.constexpr):
    """float32 -> round_dtype (0 none, 1 float32, 2 bfloat16) -> float32."""
    if RD == 2:
        v = bf16_value(v)
    return v


@triton.jit
def _scores_kernel(q_ptr,   # q [M, nh, dI] (float32 / bfloat16), contiguous
                   w_ptr,   # head weights [M, nh] (float32 / bfloat16), contiguous
                   k_ptr,   # keys [N, dI], row stride stride_k
                   nv_ptr,  # int64 n_valid [M]
                   s_ptr,   # out float32 [M, N]
                   M, N, NH, DI, stride_k, rows_per_prog,
                   RD: tl.constexpr, DOT_BF16: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                   BDC: tl.constexpr):
    keys = tl.program_id(0) * BN + tl.arange(0, BN)
    kmask = keys < N
    heads = tl.arange(0, BH)
    hmask = heads < NH
    dcols = tl.arange(0, BD)
    dmask = dcols < DI
    if DOT_BF16:
        kt = tl.load(k_ptr + keys[:, None].to(tl.int64) * stride_k + dcols[None, :],
                     mask=kmask[:, None] & dmask[None, :], other=0.0)
    m_lo = tl.program_id(1) * rows_per_prog
    for m in range(m_lo, tl.minimum(M, m_lo + rows_per_prog)):
        m64 = as_int64(m)
        if DOT_BF16:
            q = tl.load(q_ptr + (m64 * NH + heads[:, None]) * DI + dcols[None, :],
                        mask=hmask[:, None] & dmask[None, :], other=0.0)
            d = tl.dot(q.to(tl.bfloat16), tl.trans(kt.to(tl.bfloat16)))
        else:  # float32 FMA dot ("ieee"; the interpreter's bfloat16 dot is wrong), BDC columns at a time in
            # column order: a whole [BH, BD] x [BD, BN] FMA dot spills (ptxas)
            d = tl.zeros((BH, BN), dtype=tl.float32)
            for c0 in tl.static_range(0, BD, BDC):
                cols = c0 + tl.arange(0, BDC)
                cmask = cols < DI
                q = tl.load(q_ptr + (m64 * NH + heads[:, None]) * DI + cols[None, :],
                            mask=hmask[:, None] & cmask[None, :], other=0.0)
                kc = tl.load(k_ptr + keys[:, None].to(tl.int64) * stride_k + cols[None, :],
                             mask=kmask[:, None] & cmask[None, :], other=0.0)
                d += tl.dot(q.to(tl.float32), tl.trans(kc.to(tl.float32)), input_precision="ieee")
        w = tl.load(w_ptr + m64 * NH + heads, mask=hmask, other=0.0).to(tl.float32)
        d = _round_to(d, RD)
        u = _round_to(tl.maximum(d, 0.0) * w[:, None], RD)
        s = _round_to(tsum(u, axis=0), RD)
        nv = tl.load(nv_ptr + m)
        s = tl.where(keys < nv, s, float("-inf"))
        tl.store(s_ptr + m64 * N + keys, s, mask=kmask)


_ROUND = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def fast_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
                round_dtype: torch.dtype | None, reduce=None) -> torch.Tensor:
    """The kernel for `scores` (same signature and result). With heads split over ranks (`reduce`), the
    kernel's rounded head sum cannot be reduced exactly: that case runs the reference scorer."""
    if reduce is not None:
        return scores(q, w, keys, n_valid, round_dtype, reduce)
    require_dtype(q, "q", (torch.float32, torch.bfloat16))
    require(q.dim() == 3, "q.dim()", q.dim(), "must be 3 ([M, nh, dI])")
    m, nh, di = q.shape
    require(tuple(w.shape) == (m, nh), "w.shape", tuple(w.shape), f"must be {(m, nh)}")
    require_dtype(w, "w", (torch.float32, torch.bfloat16))
    require(keys.dim() == 2 and keys.shape[1] == di, "keys.shape", tuple(keys.shape), f"must be [N, {di}]")
    require_dtype(keys, "keys", (torch.float32, torch.bfloat16))
    require_rows(keys, "keys")
    require(tuple(n_valid.shape) == (m,), "n_valid.shape", tuple(n_valid.shape), f"must be {(m,)}")
    require(round_dtype in _ROUND, "round_dtype", round_dtype, "must be None, float32 or bfloat16")
    require(di <= 1024 and nh <= 256, "q.shape", tuple(q.shape), "supports nh <= 256 heads of dI <= 1024")
    dev = device_of(q, w, keys, n_valid)
    n = keys.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=dev)
    if m == 0 or n == 0:
        return out
    q, w, nv = q.contiguous(), w.contiguous(), n_valid.to(torch.int64).contiguous()
    bf16 = q.dtype == keys.dtype == torch.bfloat16
    if INTERPRET:
        bn, rows = 128, m
    else:
        bn, rows = 64 if bf16 else 32, 8
    bd = pow2(di, 16 if not INTERPRET else 1)
    _scores_kernel[(triton.cdiv(n, bn), triton.cdiv(m, rows))](
        q, w, keys, nv, out, m, n, nh, di, keys.stride(0), rows,
        RD=_ROUND[round_dtype], DOT_BF16=bf16 and not INTERPRET, BN=bn, BH=pow2(nh, 16 if not INTERPRET else 1),
        BD=bd, BDC=bd if INTERPRET else min(bd, 32))
    return out


@device_function
def _order_key(v):
    """float32 -> int64 in [0, 2^32) with the same order (-0 counts as +0, as in comparisons)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@triton.jit
def _topk_kernel(x_ptr,    # float32 scores [R, N] (-inf = not selectable), row stride stride_x
                 out_ptr,  # int64 [R, k] out: selected indices ascending, then -1
                 R, N, k, stride_x, BR: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    xrow = x_ptr + rows.to(tl.int64) * stride_x
    orow = out_ptr + rows.to(tl.int64) * k
    # 1. the k-th largest key T: the largest T with count(key >= T) >= k, found 4 bits at a time (the
    #    count is non-increasing in T, so the next digit is how many of the 15 candidates keep count >= k)
    thr = tl.zeros((BR,), dtype=tl.int64)
    digits = tl.arange(0, 16).to(tl.int64)
    for shift in range(28, -1, -4):
        cand = thr[:, None] | (digits[None, :] << shift)  # [BR, 16]
        cnt = tl.zeros((BR, 16), dtype=tl.int64)
        for n0 in range(0, N, BN):
            cols = n0 + tl.arange(0, BN)
            m = rmask[:, None] & (cols[None, :] < N)
            key = _order_key(tl.load(xrow[:, None] + cols[None, :], mask=m, other=0.0))
            cnt += tsum((m[:, :, None] & (key[:, :, None] >= cand[:, None, :])).to(tl.int64), axis=1)
        d = tsum(((cnt >= k) & (digits[None, :] > 0)).to(tl.int64), axis=1)
        thr = thr | (d << shift)
    # 2. in row order: every key > T, and the first (k - count(> T)) keys == T; -inf picks become -1
    gt = tl.zeros((BR,), dtype=tl.int64)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        m = rmask[:, None] & (cols[None, :] < N)
        key = _order_key(tl.load(xrow[:, None] + cols[None, :], mask=m, other=0.0))
        gt += tsum((m & (key > thr[:, None])).to(tl.int64), axis=1)
    need = k - gt
    neg_inf = _order_key(tl.full((1,), float("-inf"), dtype=tl.float32))
    eq_seen = tl.zeros((BR,), dtype=tl.int64)
    written = tl.zeros((BR,), dtype=tl.int64)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        m = rmask[:, None] & (cols[None, :] < N)
        key = _order_key(tl.load(xrow[:, None] + cols[None, :], mask=m, other=0.0))
        eq = (m & (key == thr[:, None])).to(tl.int64)
        eq_rank = eq_seen[:, None] + tcumsum(eq, axis=1) - eq
        sel = m & ((key > thr[:, None]) | ((eq != 0) & (eq_rank < need[:, None]))) & (key != neg_inf)
        pos = written[:, None] + tcumsum(sel.to(tl.int64), axis=1) - 1
        tl.store(orow[:, None] + pos, cols[None, :].to(tl.int64) + pos * 0, mask=sel)
        eq_seen += tsum(eq, axis=1)
        written += tsum(sel.to(tl.int64), axis=1)
    for j0 in range(0, k, BN):
        cols = j0 + tl.arange(0, BN)
        m = rmask[:, None] & (cols[None, :] < k) & (cols[None, :] >= written[:, None])
        tl.store(orow[:, None] + cols[None, :], tl.full((BR, BN), -1, dtype=tl.int64), mask=m)


def topk_ascending(x: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [R, N] -> int64 [R, k] (k <= N): the k largest (ties to the lower index), ascending, -1
    for -inf picks. The kernel behind `fast_select`, also used by the router and the sampler."""
    r, n = x.shape
    out = torch.empty((r, k), dtype=torch.int64, device=x.device)
    if r == 0 or k == 0:
        return out
    if INTERPRET:
        bn = min(pow2(n), 1024)
        br = min(pow2(r), max(1, 4096 // bn))
    else:
        bn, br = 1024, 1
    _topk_kernel[(triton.cdiv(r, br),)](x, out, r, n, k, x.stride(0), BR=br, BN=bn)
    return out


def fast_select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel for `select` (same signature and result)."""
    require_dtype(scores, "scores", (torch.float32,))
    require(scores.dim() == 2, "scores.dim()", scores.dim(), "must be 2 ([M, N])")
    require(k >= 0, "k", k, "must be >= 0")
    require_rows(scores, "scores")
    device_of(scores)
    return topk_ascending(scores, min(k, scores.shape[-1]))


@triton.jit
def _block_max_kernel(s_ptr,   # float32 scores [M, N], contiguous
                      nv_ptr,  # int64 n_valid [M]
                      b_ptr,   # out float32 [M, NB] block scores
                      N, NB, block, BB: tl.constexpr, BL: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BB + tl.arange(0, BB)
    bmask = blocks < NB
    rows = blocks[:, None] * block + tl.arange(0, BL)[None, :]
    v = tl.load(s_ptr + m * N + rows, mask=bmask[:, None] & (tl.arange(0, BL)[None, :] < block) & (rows < N),
                other=float("-inf"))
    bs = tmax(v, axis=1)
    nv = tl.load(nv_ptr + m)
    last = tl.maximum((nv - 1) // block, 0)  # n_valid >= 0, so floor division is plain division here
    last = tl.where(nv >= 1, last, 0)
    bs = tl.where(blocks == last, float("inf"), bs)
    bs = tl.where((blocks > last) | (nv == 0), float("-inf"), bs)
    tl.store(b_ptr + m * NB + blocks, bs, mask=bmask)


@triton.jit
def _expand_kernel(keep_ptr,  # uint8 [M, NB]: 1 for kept blocks
                   out_ptr,   # out bool-as-uint8 [M, N]
                   N, NB, block, BN: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < N
    kept = tl.load(keep_ptr + m * NB + cols // block, mask=cmask, other=0)
    tl.store(out_ptr + m * N + cols, kept, mask=cmask)


def fast_candidate_mask(scores: torch.Tensor, n_valid: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """The kernels for `candidate_mask` (same signature and result)."""
    require_dtype(scores, "scores", (torch.float32,))
    require(scores.dim() == 2, "scores.dim()", scores.dim(), "must be 2 ([M, N])")
    require(block >= 1, "block", block, "must be >= 1")
    require(top_blocks >= 0, "top_blocks", top_blocks, "must be >= 0")
    m, n = scores.shape
    require(tuple(n_valid.shape) == (m,), "n_valid.shape", tuple(n_valid.shape), f"must be {(m,)}")
    dev = device_of(scores, n_valid)
    mask = torch.empty((m, n), dtype=torch.bool, device=dev)
    nb = triton.cdiv(n, block)
    if m == 0 or n == 0:
        return mask
    scores, nv = scores.contiguous(), n_valid.to(torch.int64).contiguous()
    bs = torch.empty((m, nb), dtype=torch.float32, device=dev)
    bl = pow2(block)
    bb = max(1, min(pow2(nb), (8192 if INTERPRET else 1024) // bl))
    _block_max_kernel[(m, triton.cdiv(nb, bb))](scores, nv, bs, n, nb, block, BB=bb, BL=bl)
    top = topk_ascending(bs, min(top_blocks, nb))
    keep = torch.zeros((m, nb + 1), dtype=torch.uint8, device=dev)
    keep.scatter_(1, torch.where(top < 0, nb, top), 1)  # -1 picks land in the spare column
    bn = min(pow2(n), 4096 if INTERPRET else 1024)
    _expand_kernel[(m, triton.cdiv(n, bn))](keep, mask.view(torch.uint8), n, nb + 1, block, BN=bn)
    return mask
