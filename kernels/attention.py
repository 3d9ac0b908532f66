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
splits are at fixed absolute key indices, tile shapes fixed by (H, d) and the launch's form only; a block
or split whose keys are all invalid adds exactly zero (the max is global, so nothing is rescaled), so
extra -1 entries (a longer reach) change nothing. Offsets that multiply a row index are int64.
Tolerance against `reference` (relative to the largest |o|): float32 q: 2^-18 (float32 logits, exp and
sums: a few ulps, amplified by |l| at most ~2^4 in exp); bfloat16 q: one bfloat16 rounding of o plus,
where a float32 P sits at a bfloat16 rounding boundary, one bfloat16 ulp of that P term: 2^-7.
"""

import torch

from . import rope as rope_op
from ._triton import (
    INTERPRET,
    bf16_rne,
    dependent_launch,
    device_function,
    device_of,
    pdl,
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
from .attn_inputs import check_rope


def window_mask(window_index: torch.Tensor, n_window: int) -> torch.Tensor:
    """[M, W] row indices (-1 = none) -> bool [M, n_window]: the rows each query sees, as a set."""
    m = window_index.shape[0]
    cols = torch.where(window_index >= 0, window_index, n_window)
    mask = torch.zeros((m, n_window + 1), dtype=torch.bool, device=window_index.device)
    return mask.scatter_(1, cols, True)[:, :n_window]


def reference(q: torch.Tensor, window_kv: torch.Tensor, window_index: torch.Tensor,
              comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
              p_dtype: torch.dtype | None = None, positions: torch.Tensor | None = None,
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [M, H, d]; window_kv [Nw, d]; window_index [M, W] int64 (the window rows each query sees, by
    position; -1 = none); comp_kv [Nc, d]; comp_index [M, K] int64 (-1 = none); sink [H] -> o [M, H, d]
    in q.dtype; with `rope` (cos, sin) tables [P, r/2], the inverse RoPE of o at the queries' `positions`
    [M] (each head's last r dims), as `attend_reference` rotates.

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
    if rope is None:
        return o.to(q.dtype)
    cos, sin = rope[0][positions], rope[1][positions]
    return rope_op.reference(o.to(q.dtype), cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)


def attend_reference(q: torch.Tensor, ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, window: int,
                     comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
                     p_dtype: torch.dtype | None, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A V4.1 attention over its window by position, then the inverse RoPE of the output.

    q [T, H, d] at `positions` (consecutive); the window keys of the query at p are the positions
    p - window + 1 .. p: this call's `keys` [T, d] for positions from positions[0] on, the window ring
    [S, d] (slot position mod S) before; comp_kv/comp_index as for `reference`; rope (cos, sin) tables
    [P, r/2] of the RoPE whose inverse rotates each head's last r dims of the output."""
    start = positions[0]
    kv = torch.cat((ring.to(keys.dtype), keys), dim=0)
    t = positions.unsqueeze(1) - (window - 1) + torch.arange(window, device=positions.device)
    row = torch.where(t >= start, ring.shape[0] + (t - start), torch.remainder(t, ring.shape[0]))
    return reference(q, kv, torch.where(t >= 0, row, -1), comp_kv, comp_index, sink, scale, p_dtype, positions, rope)


# --- Triton kernel ---------------------------------------------------------------------------------------
# One program per (query row, block of heads), all of the row's keys: (1) logits for blocks of keys over d in
# chunks, stored (float32 scratch [M, H, NT]), and the row max; (2) Z from the stored logits; (3) per chunk of
# d, P = exp(l - M) (rounded as `p_dtype` rounds it) times the values, over the key blocks in order, divided
# by Z plus the sink term, optionally inverse-rotated, rounded once.


@device_function
def _key_rows(m, keys, W, NT, wi_ptr, ci_ptr, stride_wi, stride_ci, pos, start, S, Nw, Nc,
              BY_POSITION: tl.constexpr):
    """For entries `keys` of query m's key list: (source, row): source 0 the ring / window_kv, 1 this call's
    keys (BY_POSITION), 2 the compressed rows; row -1 where the entry is invalid."""
    in_list = keys < NT
    is_w = keys < W
    if BY_POSITION:  # entry j is position pos - W + 1 + j
        t = pos - (W - 1) + keys
        src = tl.where(t >= start, 1, 0)
        wrow = tl.where(t >= start, t - start, t % S)
        wrow = tl.where(is_w & in_list & (t >= 0), wrow, -1)
    else:
        src = tl.zeros(keys.shape, dtype=tl.int32)
        widx = tl.load(wi_ptr + m * stride_wi + keys, mask=is_w & in_list, other=-1)
        wrow = tl.where((widx >= 0) & (widx < Nw), widx, -1)
    cidx = tl.load(ci_ptr + m * stride_ci + (keys - W), mask=(keys >= W) & in_list, other=-1)
    crow = tl.where((cidx >= 0) & (cidx < Nc), cidx, -1)
    return tl.where(is_w, src, 2), tl.where(is_w, wrow, crow)


@device_function
def _gather_keys(win_ptr, chunk_ptr, comp_ptr, src, row, dcols, d, stride_w, stride_k, stride_c):
    """Key rows [BN, BD] at columns dcols (zero where invalid)."""
    dmask = dcols[None, :] < d
    ok = (row >= 0)[:, None] & dmask
    r64 = row.to(tl.int64)[:, None]
    kw = tl.load(win_ptr + r64 * stride_w + dcols[None, :], mask=ok & (src == 0)[:, None], other=0.0)
    kk = tl.load(chunk_ptr + r64 * stride_k + dcols[None, :], mask=ok & (src == 1)[:, None], other=0.0)
    kc = tl.load(comp_ptr + r64 * stride_c + dcols[None, :], mask=ok & (src == 2)[:, None], other=0.0)
    return tl.where((src == 0)[:, None], kw, tl.where((src == 1)[:, None], kk, kc))


@device_function
def _dot(a, b, acc, DOT_BF16: tl.constexpr):
    """acc + a . b: bfloat16 operands on tensor cores (DOT_BF16: the values are bfloat16 values), else a
    float32 FMA dot."""
    if DOT_BF16:
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["NT", "Nw", "Nc"])  # key counts vary with the reach: one compile
def _kernel(q_ptr,      # q [M, H, d] (float32 / bfloat16), contiguous
            win_ptr,    # the window ring [S, d] (BY_POSITION) or window_kv [Nw, d], row stride stride_w
            chunk_ptr,  # this call's keys [M, d] (BY_POSITION), row stride stride_k
            comp_ptr,   # comp_kv [Nc, d], row stride stride_c (window_kv when there is none)
            wi_ptr,     # int64 window_index [M, W], row stride stride_wi (not BY_POSITION)
            ci_ptr,     # int64 comp_index [M, K], row stride stride_ci
            pos_ptr,    # int64 positions [M] (BY_POSITION)
            cos_ptr, sin_ptr,  # float32 [P, HALF] RoPE tables (ROPE)
            sink_ptr,   # float32 [H]
            l_ptr,      # scratch float32 [M, H, NT] logits
            o_ptr,      # out [M, H, d] in q's dtype
            H, d, W, NT, Nw, Nc, S, stride_w, stride_k, stride_c, stride_wi, stride_ci,
            scale,      # float32
            BY_POSITION: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, P_ROUND: tl.constexpr,
            QK_BF16: tl.constexpr, PV_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BH: tl.constexpr,
            BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    m = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    pos = tl.load(pos_ptr + m) if BY_POSITION else 0
    start = tl.load(pos_ptr) if BY_POSITION else 0
    lrow = l_ptr + (m * H + heads) * NT
    mx = tl.full((BH,), float("-inf"), dtype=tl.float32)
    for n0 in range(0, NT, BN):  # (1) logits
        keys = n0 + tl.arange(0, BN)
        src, row = _key_rows(m, keys, W, NT, wi_ptr, ci_ptr, stride_wi, stride_ci, pos, start, S, Nw, Nc,
                             BY_POSITION)
        acc = tl.zeros((BH, BN), dtype=tl.float32)
        for d0 in range(0, d, BD):
            dcols = d0 + tl.arange(0, BD)
            q = tl.load(q_ptr + (m * H + heads[:, None]) * d + dcols[None, :],
                        mask=hmask[:, None] & (dcols[None, :] < d), other=0.0)
            k = _gather_keys(win_ptr, chunk_ptr, comp_ptr, src, row, dcols, d, stride_w, stride_k, stride_c)
            acc = _dot(q, tl.trans(k), acc, QK_BF16)
        lg = tl.where((row >= 0)[None, :], acc * scale, float("-inf"))
        tl.store(lrow[:, None] + keys[None, :], lg, mask=hmask[:, None] & (keys[None, :] < NT))
        mx = tl.maximum(mx, tmax(lg, axis=1))
    mx = tl.maximum(mx, -1e30)
    tl.debug_barrier()  # the logits are read back by other threads below
    z = tl.zeros((BH,), dtype=tl.float32)
    for n0 in range(0, NT, BN):  # (2) Z, keys in order
        keys = n0 + tl.arange(0, BN)
        lg = tl.load(lrow[:, None] + keys[None, :], mask=hmask[:, None] & (keys[None, :] < NT), other=float("-inf"))
        z += tsum(tl.exp(lg - mx[:, None]), axis=1)
    z += tl.exp(tl.load(sink_ptr + heads, mask=hmask, other=0.0) - mx)
    for d0 in range(0, d, BDV):  # (3) P.V per chunk of d
        dcols = d0 + tl.arange(0, BDV)
        acc = tl.zeros((BH, BDV), dtype=tl.float32)
        for n0 in range(0, NT, BN):
            keys = n0 + tl.arange(0, BN)
            lg = tl.load(lrow[:, None] + keys[None, :], mask=hmask[:, None] & (keys[None, :] < NT),
                         other=float("-inf"))
            p = tl.exp(lg - mx[:, None])
            if P_ROUND == 2:
                p = bf16_rne(p).to(tl.float32)
            src, row = _key_rows(m, keys, W, NT, wi_ptr, ci_ptr, stride_wi, stride_ci, pos, start, S, Nw, Nc,
                                 BY_POSITION)
            v = _gather_keys(win_ptr, chunk_ptr, comp_ptr, src, row, dcols, d, stride_w, stride_k, stride_c)
            acc = _dot(p, v, acc, PV_BF16)
        o = acc / z[:, None]
        if ROPE:  # inverse RoPE on each head's last 2 HALF dims (interleaved pairs; a chunk holds whole pairs)
            o = round_out(o, OUT_BF16).to(tl.float32)
            j = dcols - (d - 2 * HALF)
            rot = (j >= 0) & (dcols < d)
            at = pos if BY_POSITION else tl.load(pos_ptr + m)  # loaded here: nothing held across the loops
            pair = at * HALF + tl.where(rot, j // 2, 0)
            c = tl.load(cos_ptr + pair, mask=rot, other=1.0)[None, :]
            sn = tl.load(sin_ptr + pair, mask=rot, other=0.0)[None, :]
            a, b = tl.split(tl.reshape(o, (BH, BDV // 2, 2)))
            partner = tl.reshape(tl.join(b, a), (BH, BDV))
            even = ((j % 2) == 0)[None, :]
            rotated = tl.where(even, o * c + partner * sn, o * c - partner * sn)
            o = tl.where(rot[None, :], rotated, o)
        tl.store(o_ptr + (m * H + heads[:, None]) * d + dcols[None, :], round_out(o, OUT_BF16),
                 mask=hmask[:, None] & (dcols[None, :] < d))


_P_ROUND = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def blocks(h: int, qk_bf16: bool) -> tuple[int, int, int, int]:
    """(BH, BN, BD, BDV): fixed by the head count and the operands' dtype, never by the number of rows or
    keys."""
    if INTERPRET:
        return pow2(h), 128, 64, 64
    if qk_bf16:
        return min(16, pow2(h, 16)), 32, 64, 32
    return min(16, pow2(h, 16)), 32, 16, 32


def _check_comp(q, comp_kv, comp_index, d, m):
    if comp_index is None or comp_index.shape[-1] == 0:
        return None, torch.empty((m, 0), dtype=torch.int64, device=q.device)
    require(comp_kv is not None, "comp_kv", None, "must be given with comp_index")
    require(comp_kv.dim() == 2 and comp_kv.shape[1] == d, "comp_kv.shape", tuple(comp_kv.shape), f"must be [Nc, {d}]")
    require_dtype(comp_kv, "comp_kv", (torch.float32, torch.bfloat16))
    require(comp_index.dim() == 2 and comp_index.shape[0] == m, "comp_index.shape", tuple(comp_index.shape),
            f"must be [{m}, K]")
    require_dtype(comp_index, "comp_index", (torch.int64,))
    require_rows(comp_kv, "comp_kv")
    require_rows(comp_index, "comp_index")
    return comp_kv, comp_index


def _launch(q, win, chunk, comp_kv, window_index, comp_index, positions, rope, sink, scale, p_dtype, w,
            by_position):
    m, h, d = q.shape
    require(tuple(sink.shape) == (h,), "sink.shape", tuple(sink.shape), f"must be {(h,)}")
    require_dtype(sink, "sink", (torch.float32,))
    require(p_dtype in _P_ROUND, "p_dtype", p_dtype, "must be None, float32 or bfloat16")
    q = q.contiguous()
    o = torch.empty_like(q)
    nt = w + comp_index.shape[1]
    if m == 0 or h == 0 or d == 0:
        return o
    comp = win if comp_kv is None else comp_kv
    qk_bf16 = q.dtype == win.dtype == comp.dtype == torch.bfloat16
    bh, bn, bd, bdv = blocks(h, qk_bf16)
    if rope is not None and not by_position:  # the window's index loads and the rotation together spilled at
        bdv //= 2                                # the full P.V tile on sm_90 and sm_103: half of it
    if rope is not None:
        require(bdv % 2 == 0 and (d - 2 * rope[0].shape[1]) % 2 == 0, "rope", tuple(rope[0].shape),
                "must rotate whole pairs")
    logits = torch.empty((m, h, nt), dtype=torch.float32, device=q.device)
    wi = window_index if window_index is not None else comp_index
    pos = positions if positions is not None else comp_index
    _kernel[(m, triton.cdiv(h, bh))](
        q, win, chunk, comp, wi, comp_index, pos, *(rope if rope is not None else (sink, sink)), sink, logits, o,
        h, d, w, nt, win.shape[0], comp.shape[0], win.shape[0], win.stride(0), chunk.stride(0), comp.stride(0),
        wi.stride(0), comp_index.stride(0), float(scale), BY_POSITION=by_position, ROPE=rope is not None,
        HALF=rope[0].shape[1] if rope is not None else 1, P_ROUND=_P_ROUND[p_dtype],
        QK_BF16=qk_bf16 and not INTERPRET,
        PV_BF16=p_dtype == torch.bfloat16 and win.dtype == comp.dtype == torch.bfloat16 and not INTERPRET,
        OUT_BF16=q.dtype == torch.bfloat16, BH=bh, BN=bn, BD=bd, BDV=bdv, **pdl(q.device))
    return o


def fast(q: torch.Tensor, window_kv: torch.Tensor, window_index: torch.Tensor,
         comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
         p_dtype: torch.dtype | None = None, positions: torch.Tensor | None = None,
         rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The kernel for `reference` (same signature; results within the stated tolerance, with `rope` that of
    `fast_attend`): one launch."""
    require_dtype(q, "q", (torch.float32, torch.bfloat16))
    require(q.dim() == 3, "q.dim()", q.dim(), "must be 3 ([M, H, d])")
    m, h, d = q.shape
    require(window_kv.dim() == 2 and window_kv.shape[1] == d, "window_kv.shape", tuple(window_kv.shape),
            f"must be [Nw, {d}]")
    require_dtype(window_kv, "window_kv", (torch.float32, torch.bfloat16))
    require(window_index.dim() == 2 and window_index.shape[0] == m, "window_index.shape",
            tuple(window_index.shape), f"must be [{m}, W]")
    require_dtype(window_index, "window_index", (torch.int64,))
    require_rows(window_kv, "window_kv")
    require_rows(window_index, "window_index")
    comp_kv, comp_index = _check_comp(q, comp_kv, comp_index, d, m)
    if rope is not None:
        check_rope(rope, d)
        require(positions is not None and tuple(positions.shape) == (m,) and positions.dtype == torch.int64,
                "positions", None if positions is None else f"{tuple(positions.shape)} {positions.dtype}",
                f"must be [{m}] int64 with rope")
    device_of(q, window_kv, window_index, comp_kv, comp_index, sink, positions, *(rope or ()))
    return _launch(q, window_kv, window_kv, comp_kv, window_index, comp_index, positions if rope else None, rope,
                   sink, scale, p_dtype, window_index.shape[1], False)


def fast_attend(q: torch.Tensor, ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, window: int,
                comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
                p_dtype: torch.dtype | None, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The kernel for `attend_reference` (same signature; results within the stated tolerance of `fast`
    plus one rounding of the rotation): one launch, the window keys read where they are (ring or this
    call's keys), nothing concatenated."""
    require_dtype(q, "q", (torch.float32, torch.bfloat16))
    require(q.dim() == 3, "q.dim()", q.dim(), "must be 3 ([T, H, d])")
    m, h, d = q.shape
    require(ring.dim() == 2 and ring.shape[1] == d and ring.dtype == q.dtype, "ring", f"{tuple(ring.shape)} "
            f"{ring.dtype}", f"must be [S, {d}] {q.dtype}")
    require(tuple(keys.shape) == (m, d) and keys.dtype == q.dtype, "keys", f"{tuple(keys.shape)} {keys.dtype}",
            f"must be [{m}, {d}] {q.dtype}")
    require(tuple(positions.shape) == (m,) and positions.dtype == torch.int64, "positions",
            f"{tuple(positions.shape)} {positions.dtype}", f"must be [{m}] int64")
    require(window >= 1, "window", window, "must be >= 1")
    check_rope(rope, d)
    for name, t in (("ring", ring), ("keys", keys)):
        require_rows(t, name)
    comp_kv, comp_index = _check_comp(q, comp_kv, comp_index, d, m)
    device_of(q, ring, keys, positions, comp_kv, comp_index, sink, *rope)
    return _launch(q, ring, keys, comp_kv, None, comp_index, positions, rope, sink, scale, p_dtype, window, True)
