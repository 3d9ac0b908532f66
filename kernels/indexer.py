"""Lightning-indexer scoring and top-k selection of compressed rows.

scores: s[m, t] = sum_h w[m, h] * relu(q[m, h] . K[t]) for rows t < n_valid[m] = (p_m + 1) // ratio (the
groups a query at position p_m has completed), -inf elsewhere (`inside`: only its candidate blocks' rows).
`round_dtype` reproduces the official precision: the dot, the relu-weight product and the head sum are
each rounded to that dtype (bf16 on the device; the activation dtype in general). None = one rounding.
select: the k' = min(k, n_valid) largest scores, indices ascending, -1 in unused slots. Exact ties (the
ReLU makes zero scores common) go to the lower row index, whatever the length of the row: a query selects
the same rows in a prefill chunk, a verify block or a single decode step. V4.1's two levels: the candidate
source also returns the `top_blocks` blocks of rows with the highest max score (the newest always kept),
ascending; a later re-indexing layer scores and selects only their rows (16,384 in V4.1, whatever the
context): ascending as the blocks, so ties pick what a selection over all rows with the rest masked would.

Kernels:
- `fast_scores`, float32 only: one program per block of keys (BN fixed by the operands' dtype, never by the
  number of keys), looping over the query rows with the same tiles for each, so each key is read once and a
  row's scores do not depend on the other rows or on how many keys there are (batch invariant; `inside`,
  each row loads its own keys into the same tiles: the same bits as over all rows; `maxima`, each block's
  largest of those scores, stored instead of them). The dots accumulate in float32
  (bfloat16 operands on tensor cores, exact products; float32 operands as FMA dots); relu, weights and the
  head sum in float32 with the reference's roundings. With the FP4-quantized operands of `official`
  numerics the dots are exact, and so are the bfloat16 products and (for a spread of exponents under 16
  bits) the head sum: bit-identical in practice. Tolerance: float32 operands without rounding: 2^-22
  relative to the largest score (float32 sums over dI and the heads); with a `round_dtype`: one rounding of
  it where a float32 sum differs from the float64 one.
- `fast_select`, one launch, one program per query: exact top-k by radix selection on the float bit
  patterns (8 counting passes of 4 bits for the k-th largest value, then one compaction pass in row order),
  so the tie rule is the reference's: the lower index wins; at the candidate source the same selection over
  block maxima first (the newest forced); inside candidate blocks the picks written as rows. Bit-identical.
"""

import torch

from ._triton import (
    INTERPRET,
    as_int64,
    bf16_value,
    dependent_launch,
    device_function,
    device_of,
    pdl,
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
           round_dtype: torch.dtype | None, inside: torch.Tensor | None = None, block: int = 1,
           maxima: int = 0) -> torch.Tensor:
    """q [M, nh, dI], w [M, nh] (already scaled), keys [N, dI], the queries' positions [M] -> float32 [M, N]
    (a query at p sees the rows of its completed groups: n_valid = (p + 1) // ratio). Every head on every
    rank (appliance/parallel/sharding.py keeps the indexer whole). With `inside` (int64 [M, B], a query's
    candidate blocks of `block` rows, ascending, -1 unused: `select`'s at the source) only their rows:
    float32 [M, B * block], entry j the row `inside_rows(inside, block)[m, j]` (-inf where there is none).
    With `maxima` (a power of two, not with `inside`) only each block of that many rows' largest score:
    float32 [M, ceil(N / maxima)] (-inf where a block has no valid row), what a long call selects its
    candidate blocks by before it scores their rows (the scores themselves never stored).
    Bytes moved: keys once (N x dI; inside, the rows of the candidate blocks) + q + w + the scores."""
    n_valid = (positions + 1) // ratio
    if inside is None:
        d = torch.einsum("mhd,nd->mhn", q.double(), keys.double())
        rows = torch.arange(keys.shape[0], device=keys.device).unsqueeze(0)
    else:
        rows = inside_rows(inside, block)
        rows = torch.where(rows < keys.shape[0], rows, -1)
        d = torch.einsum("mhd,msd->mhs", q.double(), keys[rows.clamp(min=0)].double())
    if round_dtype is not None:
        d = d.to(round_dtype).double()
        s = (torch.relu(d) * w.double().unsqueeze(-1)).to(round_dtype).double().sum(1)
    else:
        s = (torch.relu(d) * w.double().unsqueeze(-1)).sum(1)
    s = s.to(round_dtype).float() if round_dtype is not None else s.float()
    s = s.masked_fill((rows < 0) | (rows >= n_valid.unsqueeze(1)), float("-inf"))
    if maxima:
        s = torch.nn.functional.pad(s, (0, -s.shape[1] % maxima), value=float("-inf"))
        return s.view(s.shape[0], -1, maxima).amax(-1)
    return s


def inside_rows(inside: torch.Tensor, block: int) -> torch.Tensor:
    """Candidate blocks [M, B] (-1 unused) -> their rows [M, B * block], in block order (-1 unused)."""
    rows = inside.unsqueeze(-1) * block + torch.arange(block, device=inside.device)
    return torch.where(inside.unsqueeze(-1) >= 0, rows, -1).flatten(1)


def select(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None, ratio: int = 1,
           block: int = 0, top_blocks: int = 0, inside: torch.Tensor | None = None):
    """scores [M, N] (-inf = not selectable) -> (int64 [M, min(k, N)] ascending, -1 for -inf picks; the
    kept candidate blocks or None). V4.1's two levels: with `top_blocks` (the candidate source) the
    candidate blocks of `block` rows are chosen too (`candidate_blocks`, the queries' `positions` and
    `ratio` giving their valid rows) and returned; with `inside` (a later re-indexing layer: the scores of
    those blocks' rows, `scores(..., inside, block)`) the picks are returned as rows, k of them (-1 past
    the blocks' rows: the caller, who knows N, crops to min(k, N))."""
    made = None
    if top_blocks:
        made = candidate_blocks(scores, (positions + 1) // ratio, block, top_blocks)
    if inside is None:
        return _select(scores, k), made
    picked = _select(scores, k)
    picked = torch.where(picked >= 0, inside_rows(inside, block).gather(1, picked.clamp(min=0)), -1)
    return torch.cat((picked, picked.new_full((picked.shape[0], k - picked.shape[1]), -1)), 1), made


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


def candidate_blocks(scores: torch.Tensor, n_valid: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """V4.1 level one: per row, the `top_blocks` blocks of `block` rows with the highest max score (the
    newest block, possibly partial, always kept) -> int64 [M, min(top_blocks, blocks)], ascending, -1 unused."""
    m, n = scores.shape
    n_blocks = -(-n // block)
    padded = torch.full((m, n_blocks * block), float("-inf"), device=scores.device)
    padded[:, :n] = scores
    bs = padded.view(m, n_blocks, block).amax(-1)
    last = torch.div(n_valid - 1, block, rounding_mode="floor").clamp(min=0)
    bs = bs.scatter(1, last.unsqueeze(1), float("inf"))
    real_blocks = torch.arange(n_blocks, device=scores.device).unsqueeze(0) <= last.unsqueeze(1)
    bs = bs.masked_fill(~real_blocks | (n_valid.unsqueeze(1) == 0), float("-inf"))
    return _select(bs, top_blocks)


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
                   in_ptr,  # INSIDE: int64 candidate blocks [M, NI] (-1 unused), contiguous
                   s_ptr,   # out float32 [M, S]: S = N, NI * block inside, or N / MAXB block maxima
                   M, N, S, NH, DI, stride_k, NI, block, rows_per_prog, ratio,
                   RD: tl.constexpr, INSIDE: tl.constexpr, MAXB: tl.constexpr,
                   DOT_BF16: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                   BDC: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)  # output columns: keys, or slots of the candidate blocks
    heads = tl.arange(0, BH)
    hmask = heads < NH
    dcols = tl.arange(0, BD)
    dmask = dcols < DI
    if DOT_BF16 and not INSIDE:  # the same keys for every row: loaded once
        kt = tl.load(k_ptr + cols[:, None].to(tl.int64) * stride_k + dcols[None, :],
                     mask=(cols < N)[:, None] & dmask[None, :], other=0.0)
    m_lo = tl.program_id(1) * rows_per_prog
    for m in range(m_lo, tl.minimum(M, m_lo + rows_per_prog)):
        m64 = as_int64(m)
        if INSIDE:  # this row's own keys: its blocks' rows (N, out of range, where a block is unused)
            b = tl.load(in_ptr + m64 * NI + cols // block, mask=cols < S, other=-1)
            keys = tl.where(b >= 0, b * block + cols % block, N)
        else:
            keys = cols.to(tl.int64)
        kmask = keys < N
        if DOT_BF16:
            if INSIDE:
                kt = tl.load(k_ptr + keys[:, None].to(tl.int64) * stride_k + dcols[None, :],
                             mask=kmask[:, None] & dmask[None, :], other=0.0)
            q = tl.load(q_ptr + (m64 * NH + heads[:, None]) * DI + dcols[None, :],
                        mask=hmask[:, None] & dmask[None, :], other=0.0)
            d = tl.dot(q.to(tl.bfloat16), tl.trans(kt.to(tl.bfloat16)))
        else:  # float32 FMA dot ("ieee"; the interpreter's bfloat16 dot is wrong), BDC columns at a time in
            # column order: a whole [BH, BD] x [BD, BN] FMA dot spills (ptxas)
            d = tl.zeros((BH, BN), dtype=tl.float32)
            for c0 in tl.static_range(0, BD, BDC):
                dc = c0 + tl.arange(0, BDC)
                dcm = dc < DI
                q = tl.load(q_ptr + (m64 * NH + heads[:, None]) * DI + dc[None, :],
                            mask=hmask[:, None] & dcm[None, :], other=0.0)
                kc = tl.load(k_ptr + keys[:, None].to(tl.int64) * stride_k + dc[None, :],
                             mask=kmask[:, None] & dcm[None, :], other=0.0)
                d += tl.dot(q.to(tl.float32), tl.trans(kc.to(tl.float32)), input_precision="ieee")
        w = tl.load(w_ptr + m64 * NH + heads, mask=hmask, other=0.0).to(tl.float32)
        d = _round_to(d, RD)
        u = _round_to(tl.maximum(d, 0.0) * w[:, None], RD)
        s = _round_to(tsum(u, axis=0), RD)
        nv = (tl.load(pos_ptr + m) + 1) // ratio
        s = tl.where(kmask & (keys < nv), s, float("-inf"))
        if MAXB:  # each block of MAXB columns' largest score, stored alone
            b = tl.program_id(0) * (BN // MAXB) + tl.arange(0, BN // MAXB)
            tl.store(s_ptr + m64 * S + b, tmax(tl.reshape(s, (BN // MAXB, MAXB)), axis=1), mask=b < S)
        else:
            tl.store(s_ptr + m64 * S + cols, s, mask=cols < S)


_ROUND = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def fast_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int,
                round_dtype: torch.dtype | None, inside: torch.Tensor | None = None, block: int = 1,
                maxima: int = 0) -> torch.Tensor:
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
    if inside is not None:
        require(inside.dim() == 2 and inside.shape[0] == m and inside.dtype == torch.int64, "inside",
                f"{tuple(inside.shape)} {inside.dtype}", f"must be int64 [{m}, B]")
        require(block >= 1, "block", block, "must be >= 1")
    require(maxima in (0, 1, 2, 4, 8, 16, 32) and not (maxima and inside is not None), "maxima", maxima,
            "must be 0 or a power of two up to 32, without inside")
    dev = device_of(q, w, keys, positions, inside)
    n = keys.shape[0]
    cols = n if inside is None else inside.shape[1] * block
    out = torch.empty((m, triton.cdiv(cols, maxima) if maxima else cols), dtype=torch.float32, device=dev)
    if m == 0 or cols == 0:
        return out
    q, w, pos = q.contiguous(), w.contiguous(), positions.to(torch.int64).contiguous()
    within = inside is not None
    blocks = inside.contiguous() if within else pos  # without INSIDE a placeholder, never read
    bf16 = q.dtype == keys.dtype == torch.bfloat16
    if INTERPRET:
        bn, rows = 128, m
    else:
        bn, rows = 64 if bf16 else 32, 8
    bd = pow2(di, 16 if not INTERPRET else 1)
    _scores_kernel[(triton.cdiv(cols, bn), triton.cdiv(m, rows))](
        q, w, keys, pos, blocks, out, m, n, out.shape[1], nh, di, keys.stride(0), blocks.shape[-1], block, rows,
        ratio, RD=_ROUND[round_dtype], INSIDE=within, MAXB=maxima, DOT_BF16=bf16 and not INTERPRET, BN=bn,
        BH=pow2(nh, 16 if not INTERPRET else 1), BD=bd, BDC=bd if INTERPRET else min(bd, 32), **pdl(q.device))
    return out


@device_function
def _order_key(v):
    """float32 -> int64 in [0, 2^32) with the same order (-0 counts as +0, as in comparisons)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@device_function
def _values(s_ptr, m, cols, N, NS, nv, block, MAXIMA: tl.constexpr, BL: tl.constexpr):
    """Entries `cols` of row m (-inf past N): its scores, or (MAXIMA) the maxima of its candidate blocks
    `cols` of `block` rows of the NS scores (the newest block, possibly partial, forced to +inf; blocks past
    it and all of a row with nv = 0: -inf)."""
    valid = cols < N
    if MAXIMA:
        r = cols[:, None] * block + tl.arange(0, BL)[None, :]
        v = tl.load(s_ptr + m * NS + r, mask=valid[:, None] & (tl.arange(0, BL)[None, :] < block) & (r < NS),
                    other=float("-inf"))
        v = tmax(v, axis=1)
        last = tl.maximum((nv - 1) // block, 0)
        v = tl.where(cols == last, float("inf"), v)
        v = tl.where((cols > last) | (nv == 0), float("-inf"), v)
    else:
        v = tl.load(s_ptr + m * NS + cols, mask=valid, other=float("-inf"))
    return v, valid


# the passes `_top_k_row` makes over a row: eight counting 4 bits each, the count above the k-th, the compaction
SELECT_PASSES = 10


@device_function
def _top_k_row(s_ptr, in_ptr, out_ptr, m, N, NS, NI, nv, block, k, MAXIMA: tl.constexpr, INSIDE: tl.constexpr,
               BN: tl.constexpr, BL: tl.constexpr):
    """Row m's k largest entries (`_values`), ties to the lower index, -inf never picked, their indices
    ascending at out_ptr [k] (then -1); INSIDE, written as the rows of the candidate blocks [NI] at in_ptr.
    By radix selection on the float bit patterns: the k-th largest key T (the largest T with
    count(key >= T) >= k, 4 bits at a time), then in index order every key > T and the first
    k - count(> T) keys == T."""
    thr = tl.zeros((1,), dtype=tl.int64)
    digits = tl.arange(0, 16).to(tl.int64)
    for shift in range(28, -1, -4):
        cand = thr | (digits << shift)  # [16]
        cnt = tl.zeros((16,), dtype=tl.int64)
        for n0 in range(0, N, BN):
            v, valid = _values(s_ptr, m, n0 + tl.arange(0, BN), N, NS, nv, block, MAXIMA, BL)
            key = _order_key(v)
            cnt += tsum((valid[:, None] & (key[:, None] >= cand[None, :])).to(tl.int64), axis=0)
        d = tsum(((cnt >= k) & (digits > 0)).to(tl.int64), axis=0)
        thr = thr | (d << shift)
    gt = tl.zeros((1,), dtype=tl.int64)
    for n0 in range(0, N, BN):
        v, valid = _values(s_ptr, m, n0 + tl.arange(0, BN), N, NS, nv, block, MAXIMA, BL)
        gt += tsum((valid & (_order_key(v) > thr)).to(tl.int64), axis=0)
    need = k - gt
    neg_inf = _order_key(tl.full((1,), float("-inf"), dtype=tl.float32))
    eq_seen = tl.zeros((1,), dtype=tl.int64)
    written = tl.zeros((1,), dtype=tl.int64)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        v, valid = _values(s_ptr, m, cols, N, NS, nv, block, MAXIMA, BL)
        key = _order_key(v)
        eq = (valid & (key == thr)).to(tl.int64)
        eq_rank = eq_seen + tcumsum(eq, axis=0) - eq
        sel = valid & ((key > thr) | ((eq != 0) & (eq_rank < need))) & (key != neg_inf)
        pos = written + tcumsum(sel.to(tl.int64), axis=0) - 1
        picked = cols.to(tl.int64) + pos * 0
        if INSIDE:  # slot -> row (a picked slot's block is in use: its score is finite)
            picked = tl.load(in_ptr + m * NI + cols // block, mask=sel, other=0) * block + cols % block
        tl.store(out_ptr + pos, picked, mask=sel)
        eq_seen += tsum(eq, axis=0)
        written += tsum(sel.to(tl.int64), axis=0)
    for j0 in range(0, k, BN):
        cols = j0 + tl.arange(0, BN)
        tl.store(out_ptr + cols, tl.full((BN,), -1, dtype=tl.int64), mask=(cols < k) & (cols >= written))


@triton.jit
def _select_kernel(s_ptr,     # float32 scores [M, N], contiguous
                   in_ptr,    # INSIDE: int64 candidate blocks [M, NI] the scores are of, contiguous
                   pos_ptr,   # int64 positions [M] (SOURCE): a query at p has (p + 1) // ratio valid rows
                   made_ptr,  # out int64 [M, KB] (SOURCE): the kept candidate blocks, ascending, -1 unused
                   out_ptr,   # out int64 [M, k]
                   N, k, ratio, block, KB, NB, NI,
                   SOURCE: tl.constexpr, INSIDE: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    m = tl.program_id(0).to(tl.int64)
    if SOURCE:  # the candidate blocks: the top KB of the NB block maxima
        nv = (tl.load(pos_ptr + m) + 1) // ratio
        _top_k_row(s_ptr, in_ptr, made_ptr + m * KB, m, NB, N, NI, nv, block, KB, 1, 0, BN, BL)
    if k > 0:
        _top_k_row(s_ptr, in_ptr, out_ptr + m * k, m, N, N, NI, 0, block, k, 0, INSIDE, BN, BL)


def fast_select(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None, ratio: int = 1,
                block: int = 0, top_blocks: int = 0, inside: torch.Tensor | None = None):
    """The kernel for `select` (same signature and result, bit for bit): one launch."""
    require_dtype(scores, "scores", (torch.float32,))
    require(scores.dim() == 2, "scores.dim()", scores.dim(), "must be 2 ([M, N])")
    require(k >= 0, "k", k, "must be >= 0")
    require_rows(scores, "scores")
    m, n = scores.shape
    k = min(k, n) if inside is None else k
    source = top_blocks > 0
    if source or inside is not None:
        require(block >= 1, "block", block, "must be >= 1 with top_blocks or inside")
    if source:
        require(positions is not None and tuple(positions.shape) == (m,), "positions", None if positions is None
                else tuple(positions.shape), f"must be given, [{m}], with top_blocks")
        require(ratio >= 1, "ratio", ratio, "must be >= 1")
    if inside is not None:
        require(inside.dim() == 2 and inside.shape[0] == m and inside.shape[1] * block == n
                and inside.dtype == torch.int64, "inside", f"{tuple(inside.shape)} {inside.dtype}",
                f"must be int64 [{m}, {n} / block]")
    dev = device_of(scores, positions, inside)
    scores = scores.contiguous()
    out = torch.empty((m, k), dtype=torch.int64, device=dev)
    nb = triton.cdiv(n, block) if source else 1
    kb = min(top_blocks, nb)
    made = torch.empty((m, kb), dtype=torch.int64, device=dev) if source else None
    if m == 0:
        return out, made
    blocks = inside.contiguous() if inside is not None else out  # placeholders where unused, never read
    bn = min(pow2(max(n, nb)), 1024 if INTERPRET else 128)  # [BN, 16] digit counts in registers
    _select_kernel[(m,)](scores, blocks, positions if source else out, made if source else out, out, n, k, ratio,
                         max(block, 1), kb, nb, blocks.shape[1], SOURCE=source, INSIDE=inside is not None, BN=bn,
                         BL=pow2(max(block, 1)), **pdl(scores.device))
    return out, made
