"""Lightning-indexer scoring and top-k selection of compressed rows.

scores: s[m, t] = sum_h w[m, h] * relu(q[m, h] . K[t]) for rows t < n_valid[m] = (p_m + 1) // ratio (the
groups a query at position p_m has completed), -inf elsewhere.
`round_dtype` reproduces the official precision: the dot, the relu-weight product and the head sum are
each rounded to that dtype (bf16 on the device; the activation dtype in general). None = one rounding.
select: the k' = min(k, n_valid) largest scores, indices ascending, -1 in unused slots. Exact ties (the
ReLU makes zero scores common) go to the lower row index, whatever the length of the row: a query selects
the same rows in a prefill chunk, a verify block or a single decode step. V4.1's two levels in the same
call: the candidate source also chooses the `top_blocks` blocks of rows with the highest max score (the
newest block always kept) and returns their mask; a later re-indexing layer selects inside that mask.

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
- `fast_select`, one launch, one program per query: exact top-k by radix selection on the float bit
  patterns (8 counting passes of 4 bits for the k-th largest value, then one compaction pass in row order),
  so the tie rule is the reference's: the lower index wins; at the candidate source the same selection over
  block maxima first (with the forced newest block), and the mask of the kept blocks' rows. Bit-identical.
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


def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int,
           round_dtype: torch.dtype | None) -> torch.Tensor:
    """q [M, nh, dI], w [M, nh] (already scaled), keys [N, dI], the queries' positions [M] -> float32 [M, N]
    (a query at p sees the rows of its completed groups: n_valid = (p + 1) // ratio). Every head on every
    rank (appliance/parallel/sharding.py keeps the indexer whole).
    Bytes moved: keys once (N x dI) + q + w + the [M, N] scores."""
    n_valid = (positions + 1) // ratio
    d = torch.einsum("mhd,nd->mhn", q.double(), keys.double())
    if round_dtype is not None:
        d = d.to(round_dtype).double()
        s = (torch.relu(d) * w.double().unsqueeze(-1)).to(round_dtype).double().sum(1)
    else:
        s = (torch.relu(d) * w.double().unsqueeze(-1)).sum(1)
    s = s.to(round_dtype).float() if round_dtype is not None else s.float()
    t = torch.arange(keys.shape[0], device=keys.device)
    return s.masked_fill(t.unsqueeze(0) >= n_valid.unsqueeze(1), float("-inf"))


def select(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None, ratio: int = 1,
           candidates: torch.Tensor | None = None, block: int = 0, top_blocks: int = 0):
    """scores [M, N] (-inf = not selectable) -> (int64 [M, min(k, N)] ascending, -1 for -inf picks; the
    candidate mask or None). V4.1's two levels: with `block` (the candidate source) the candidate blocks of
    the scores are chosen too (`candidate_mask`, the queries' `positions` and `ratio` giving their valid
    rows) and returned; with `candidates` (a later re-indexing layer) only rows inside them are selectable."""
    made = None
    if block:
        made = candidate_mask(scores, (positions + 1) // ratio, block, top_blocks)
    elif candidates is not None:
        scores = scores.masked_fill(~candidates[:, : scores.shape[1]], float("-inf"))
    return _select(scores, k), made


def _select(scores: torch.Tensor, k: int) -> torch.Tensor:
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


@triton.jit(do_not_specialize=["M"])  # row counts vary call by call: one compile
def _scores_kernel(q_ptr,   # q [M, nh, dI] (float32 / bfloat16), contiguous
                   w_ptr,   # head weights [M, nh] (float32 / bfloat16), contiguous
                   k_ptr,   # keys [N, dI], row stride stride_k
                   pos_ptr,  # int64 positions [M]: a query at p sees (p + 1) // ratio rows
                   s_ptr,   # out float32 [M, N]
                   M, N, NH, DI, stride_k, rows_per_prog, ratio,
                   RD: tl.constexpr,
                   DOT_BF16: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
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
        nv = (tl.load(pos_ptr + m) + 1) // ratio
        s = tl.where(keys < nv, s, float("-inf"))
        tl.store(s_ptr + m64 * N + keys, s, mask=kmask)


_ROUND = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def fast_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int,
                round_dtype: torch.dtype | None) -> torch.Tensor:
    """The kernel for `scores` (same signature and result)."""
    require_dtype(q, "q", (torch.float32, torch.bfloat16))
    require(q.dim() == 3, "q.dim()", q.dim(), "must be 3 ([M, nh, dI])")
    m, nh, di = q.shape
    require(tuple(w.shape) == (m, nh), "w.shape", tuple(w.shape), f"must be {(m, nh)}")
    require_dtype(w, "w", (torch.float32, torch.bfloat16))
    require(keys.dim() == 2 and keys.shape[1] == di, "keys.shape", tuple(keys.shape), f"must be [N, {di}]")
    require_dtype(keys, "keys", (torch.float32, torch.bfloat16))
    require_rows(keys, "keys")
    require(tuple(positions.shape) == (m,), "positions.shape", tuple(positions.shape), f"must be {(m,)}")
    require(ratio >= 1, "ratio", ratio, "must be >= 1")
    require(round_dtype in _ROUND, "round_dtype", round_dtype, "must be None, float32 or bfloat16")
    require(di <= 1024 and nh <= 256, "q.shape", tuple(q.shape), "supports nh <= 256 heads of dI <= 1024")
    dev = device_of(q, w, keys, positions)
    n = keys.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=dev)
    if m == 0 or n == 0:
        return out
    q, w, pos = q.contiguous(), w.contiguous(), positions.to(torch.int64).contiguous()
    bf16 = q.dtype == keys.dtype == torch.bfloat16
    if INTERPRET:
        bn, rows = 128, m
    else:
        bn, rows = 64 if bf16 else 32, 8
    bd = pow2(di, 16 if not INTERPRET else 1)
    _scores_kernel[(triton.cdiv(n, bn), triton.cdiv(m, rows))](
        q, w, keys, pos, out, m, n, nh, di, keys.stride(0), rows, ratio,
        RD=_ROUND[round_dtype], DOT_BF16=bf16 and not INTERPRET, BN=bn,
        BH=pow2(nh, 16 if not INTERPRET else 1), BD=bd, BDC=bd if INTERPRET else min(bd, 32))
    return out


@device_function
def _order_key(v):
    """float32 -> int64 in [0, 2^32) with the same order (-0 counts as +0, as in comparisons)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@device_function
def _values(s_ptr, c_ptr, m, cols, N, NS, nv, block, MODE: tl.constexpr, BL: tl.constexpr):
    """Entries `cols` of row m (-inf past N): MODE 0 its scores; 1 its scores where the candidate mask
    (bool [M, NS]) holds, -inf elsewhere; 2 the maxima of its candidate blocks `cols` of `block` rows (the
    newest block, possibly partial, forced to +inf; blocks past it and all of a row with nv = 0: -inf)."""
    valid = cols < N
    if MODE == 2:
        r = cols[:, None] * block + tl.arange(0, BL)[None, :]
        v = tl.load(s_ptr + m * NS + r, mask=valid[:, None] & (tl.arange(0, BL)[None, :] < block) & (r < NS),
                    other=float("-inf"))
        v = tmax(v, axis=1)
        last = tl.maximum((nv - 1) // block, 0)
        v = tl.where(cols == last, float("inf"), v)
        v = tl.where((cols > last) | (nv == 0), float("-inf"), v)
    else:
        v = tl.load(s_ptr + m * N + cols, mask=valid, other=float("-inf"))
        if MODE == 1:
            keep = tl.load(c_ptr + m * NS + cols, mask=valid & (cols < NS), other=0)
            v = tl.where(keep != 0, v, float("-inf"))
    return v, valid


@device_function
def _top_k_row(s_ptr, c_ptr, out_ptr, m, N, NS, nv, block, k, MODE: tl.constexpr, FLAGS: tl.constexpr,
         BN: tl.constexpr, BL: tl.constexpr):
    """Row m's k largest entries (`_values`), ties to the lower index, -inf never picked: FLAGS 0 their
    indices ascending at out_ptr [k] (then -1), FLAGS 1 a flag per entry at out_ptr [N] (1: picked).
    By radix selection on the float bit patterns: the k-th largest key T (the largest T with
    count(key >= T) >= k, 4 bits at a time), then in index order every key > T and the first
    k - count(> T) keys == T."""
    thr = tl.zeros((1,), dtype=tl.int64)
    digits = tl.arange(0, 16).to(tl.int64)
    for shift in range(28, -1, -4):
        cand = thr | (digits << shift)  # [16]
        cnt = tl.zeros((16,), dtype=tl.int64)
        for n0 in range(0, N, BN):
            v, valid = _values(s_ptr, c_ptr, m, n0 + tl.arange(0, BN), N, NS, nv, block, MODE, BL)
            key = _order_key(v)
            cnt += tsum((valid[:, None] & (key[:, None] >= cand[None, :])).to(tl.int64), axis=0)
        d = tsum(((cnt >= k) & (digits > 0)).to(tl.int64), axis=0)
        thr = thr | (d << shift)
    gt = tl.zeros((1,), dtype=tl.int64)
    for n0 in range(0, N, BN):
        v, valid = _values(s_ptr, c_ptr, m, n0 + tl.arange(0, BN), N, NS, nv, block, MODE, BL)
        gt += tsum((valid & (_order_key(v) > thr)).to(tl.int64), axis=0)
    need = k - gt
    neg_inf = _order_key(tl.full((1,), float("-inf"), dtype=tl.float32))
    eq_seen = tl.zeros((1,), dtype=tl.int64)
    written = tl.zeros((1,), dtype=tl.int64)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        v, valid = _values(s_ptr, c_ptr, m, cols, N, NS, nv, block, MODE, BL)
        key = _order_key(v)
        eq = (valid & (key == thr)).to(tl.int64)
        eq_rank = eq_seen + tcumsum(eq, axis=0) - eq
        sel = valid & ((key > thr) | ((eq != 0) & (eq_rank < need))) & (key != neg_inf)
        if FLAGS:
            tl.store(out_ptr + cols, sel.to(tl.uint8), mask=valid)
        else:
            pos = written + tcumsum(sel.to(tl.int64), axis=0) - 1
            tl.store(out_ptr + pos, cols.to(tl.int64) + pos * 0, mask=sel)
        eq_seen += tsum(eq, axis=0)
        written += tsum(sel.to(tl.int64), axis=0)
    if not FLAGS:
        for j0 in range(0, k, BN):
            cols = j0 + tl.arange(0, BN)
            tl.store(out_ptr + cols, tl.full((BN,), -1, dtype=tl.int64), mask=(cols < k) & (cols >= written))


@triton.jit
def _select_kernel(s_ptr,     # float32 scores [M, N], contiguous
                   c_ptr,     # bool-as-uint8 candidate mask [M, NS] (MASKED: read; SOURCE: written)
                   keep_ptr,  # uint8 [M, NB] scratch: the kept candidate blocks (SOURCE)
                   pos_ptr,   # int64 positions [M] (SOURCE): a query at p has (p + 1) // ratio valid rows
                   out_ptr,   # out int64 [M, k]
                   N, NS, k, ratio, block, top_blocks, NB,
                   MASKED: tl.constexpr, SOURCE: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    if SOURCE:  # the candidate blocks, then the mask of their rows
        nv = (tl.load(pos_ptr + m) + 1) // ratio
        _top_k_row(s_ptr, c_ptr, keep_ptr + m * NB, m, NB, N, nv, block, top_blocks, 2, 1, BN, BL)
        tl.debug_barrier()  # the kept blocks are read back below
        for n0 in range(0, N, BN):
            cols = n0 + tl.arange(0, BN)
            kept = tl.load(keep_ptr + m * NB + cols // block, mask=cols < N, other=0)
            tl.store(c_ptr + m * N + cols, kept, mask=cols < N)
    _top_k_row(s_ptr, c_ptr, out_ptr + m * k, m, N, NS, 0, 1, k, 1 if MASKED else 0, 0, BN, BL)


def fast_select(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None, ratio: int = 1,
                candidates: torch.Tensor | None = None, block: int = 0, top_blocks: int = 0):
    """The kernel for `select` (same signature and result, bit for bit): one launch."""
    require_dtype(scores, "scores", (torch.float32,))
    require(scores.dim() == 2, "scores.dim()", scores.dim(), "must be 2 ([M, N])")
    require(k >= 0, "k", k, "must be >= 0")
    require_rows(scores, "scores")
    m, n = scores.shape
    k = min(k, n)
    source = block > 0
    if source:
        require(top_blocks >= 0, "top_blocks", top_blocks, "must be >= 0")
        require(positions is not None and tuple(positions.shape) == (m,), "positions", None if positions is None
                else tuple(positions.shape), f"must be given, [{m}], with block")
        require(ratio >= 1, "ratio", ratio, "must be >= 1")
    if candidates is not None and not source:
        require(candidates.dim() == 2 and candidates.shape[0] == m and candidates.shape[1] >= n
                and candidates.dtype == torch.bool, "candidates", f"{tuple(candidates.shape)} {candidates.dtype}",
                f"must be bool [{m}, >= {n}]")
    dev = device_of(scores, positions, candidates)
    scores = scores.contiguous()
    out = torch.empty((m, k), dtype=torch.int64, device=dev)
    made = torch.empty((m, n), dtype=torch.bool, device=dev) if source else None
    if m == 0:
        return out, made
    nb = triton.cdiv(n, block) if source else 1
    keep = torch.empty((m, nb), dtype=torch.uint8, device=dev) if source else out
    if source:
        c = made.view(torch.uint8)
    elif candidates is not None:
        c = candidates.contiguous().view(torch.uint8)
    else:
        c = out
    bn = min(pow2(max(n, nb)), 1024 if INTERPRET else 128)  # [BN, 16] digit counts in registers
    _select_kernel[(m,)](scores, c, keep, positions if source else out, out, n, c.shape[1] if candidates is not None
                         and not source else n, k, ratio, max(block, 1), min(top_blocks, nb), nb,
                         MASKED=candidates is not None and not source, SOURCE=source, BN=bn,
                         BL=pow2(max(block, 1)))
    return out, made
