"""The MoE's router for a few rows: which experts each row takes, with what weights, and the (row, expert)
pairs sorted by expert that the experts' kernels walk (kernels/moe.py).

route: logits = x . W_gate (float32 from a float64 product; the gate is a dense PackedWeight [E, D]);
    scores = sqrt(softplus) | sigmoid | softmax;
    indices = top-k of (scores + bias) (or the hash table's row), weights = scores[idx] / (sum + eps) * scale.

Kernel (`fast`), float32 only (no float64 instruction): the router product by the linear kernel (float32
accumulation, float32 logits), then one program per row: score function in float32, top-k by repeated argmax
over the experts not yet taken (ties to the lower expert id; a NaN score ranks lowest, so a row of NaNs still
yields k distinct ids in range), weights normalized in float32. Tolerance: logits within the linear kernel's
bound; weights within 2^-20 relative (float32 softplus/sqrt/sigmoid/softmax: a few ulps); indices equal
unless two biased scores are within that.
"""

import torch
import torch.nn.functional as F

from . import linear
from ._triton import INTERPRET, counters, dependent_launch, device_function, pdl, pow2, tl, tmax, tmin, triton, tsum
from .linear import PackedWeight, product_tile
from .phases import Phase


def route(x: torch.Tensor, gate: PackedWeight, bias: torch.Tensor | None, top_k: int, score_func: str,
          route_scale: float, norm_eps: float, hash_idx: torch.Tensor | None = None):
    """x [M, D]; gate [E, D] (dense) -> (weights float32 [M, k], indices int64 [M, k])."""
    return select(linear.reference(x, gate, None, torch.float32), bias, top_k, score_func, route_scale, norm_eps,
                  hash_idx)


def select(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, score_func: str, route_scale: float,
           norm_eps: float, hash_idx: torch.Tensor | None = None):
    """Router logits float32 [M, E] -> (weights float32 [M, k], indices int64 [M, k])."""
    # the nonlinearity in float64, rounded once: torch's float32 softplus/sigmoid on the CPU take a vector or a
    # scalar path by where an element falls in the tensor, which differ in the last bit (a row's scores would
    # depend on the batch)
    if score_func == "sqrtsoftplus":
        s = F.softplus(logits.double()).float().sqrt()
    elif score_func == "sigmoid":
        s = torch.sigmoid(logits.double()).float()
    else:
        s = torch.softmax(logits.double(), dim=-1).float()
    if hash_idx is not None:
        idx = hash_idx
    else:
        biased = s if bias is None else s + bias.float()
        idx = biased.topk(top_k, dim=-1).indices
    w = s.gather(-1, idx)
    w = w / (w.sum(-1, keepdim=True) + norm_eps) * route_scale
    return w, idx


SCORES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@device_function
def _log1p(y):
    """log(1 + y) for y >= 0, accurate for small y (the log of the rounded 1 + y, corrected)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * y / (u - 1.0))


@device_function
def _route_row(l_ptr, bias_ptr, hash_ptr, w_ptr, i_ptr, row, E, route_scale, norm_eps, SCORE: tl.constexpr,
               HAS_BIAS: tl.constexpr, HASH: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """The routing of one row from its logits: scores (float32), top-k by repeated argmax over the experts not
    yet taken (ties to the lower id; a NaN ranks lowest, so a row of NaNs still yields k distinct ids in
    range), weights normalized; stored as the row's K ids and weights. One row at a time: a [BE] vector of
    each kind stays in registers (a block of rows at once, [BM, 512] of several kinds, spills)."""
    cols = tl.arange(0, BE)
    cmask = cols < E
    r64 = row + tl.zeros((), dtype=tl.int64)  # (an int under the interpreter)
    lg = tl.load(l_ptr + r64 * E + cols, mask=cmask, other=0.0)
    if SCORE == 0:  # sqrt(softplus), softplus with torch's threshold 20
        s = tl.sqrt_rn(tl.where(lg > 20.0, lg, _log1p(tl.exp(tl.minimum(lg, 20.0)))))
    elif SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-lg))
    else:
        ex = tl.where(cmask, tl.exp(lg - tmax(tl.where(cmask, lg, float("-inf")), axis=0)), 0.0)
        s = ex / tsum(ex, axis=0)
    slots = tl.arange(0, BK)
    smask = slots < K
    idx = tl.zeros((BK,), dtype=tl.int64)
    w = tl.zeros((BK,), dtype=tl.float32)
    if HASH:
        idx = tl.load(hash_ptr + r64 * K + slots, mask=smask, other=0)
        for j in tl.static_range(K):
            e = tsum(tl.where(slots == j, idx, 0), axis=0)
            w = tl.where(slots == j, tsum(tl.where(cols == e, s, 0.0), axis=0), w)
    else:
        b = s
        if HAS_BIAS:
            b = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0)
        b = tl.where(b == b, b, float("-inf"))  # a NaN ranks lowest
        free = cmask  # experts not taken: at least K, so each pick is real
        for j in tl.static_range(K):
            best = tmax(tl.where(free, b, float("-inf")), axis=0)
            e = tmin(tl.where(free & (b == best), cols, BE), axis=0)
            idx = tl.where(slots == j, e.to(tl.int64), idx)
            w = tl.where(slots == j, tsum(tl.where(cols == e, s, 0.0), axis=0), w)
            free = free & (cols != e)
    w = w / (tsum(w, axis=0) + norm_eps) * route_scale
    tl.store(w_ptr + r64 * K + slots, w, mask=smask)
    tl.store(i_ptr + r64 * K + slots, idx, mask=smask)


@device_function
def _sort_pairs(i_ptr, w_ptr, M, E, pe_ptr, pr_ptr, pw_ptr, pf_ptr, pend_ptr, pos_ptr, K: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, HAS_SHARED: tl.constexpr):
    """The M K (row, expert) pairs of rows [0, M) (their routing as stored) sorted by (expert, row): expert,
    row, weight, the first and one past the last pair of the expert's group, per sorted pair; pos [M, K]:
    each row's pairs in increasing expert id. The shared expert follows as one group (expert E) of the M
    rows in order. Each pair's rank counts the pairs before it, one other pair per step (comparing all
    pairs at once is a [BM BK, BM BK] tile)."""
    p = tl.arange(0, BM * BK)
    r = p // BK
    j = p % BK
    valid = (r < M) & (j < K)
    e = tl.load(i_ptr + r * K + j, mask=valid, other=0)
    wf = tl.load(w_ptr + r * K + j, mask=valid, other=0.0)
    key = e * M + r
    rank = tl.zeros((BM * BK,), dtype=tl.int64)
    first = tl.zeros((BM * BK,), dtype=tl.int64)
    end = tl.zeros((BM * BK,), dtype=tl.int64)
    in_row = tl.zeros((BM * BK,), dtype=tl.int64)
    for rq in range(0, M):
        for jq in tl.static_range(K):
            eq = tl.load(i_ptr + rq * K + jq)
            rank += (eq * M + rq < key).to(tl.int64)
            first += (eq < e).to(tl.int64)
            end += (eq <= e).to(tl.int64)
            in_row += ((eq < e) & (rq == r)).to(tl.int64)
    tl.store(pe_ptr + rank, e, mask=valid)
    tl.store(pr_ptr + rank, r.to(tl.int64), mask=valid)
    tl.store(pw_ptr + rank, wf, mask=valid)
    tl.store(pf_ptr + rank, first, mask=valid)
    tl.store(pend_ptr + rank, end, mask=valid)
    tl.store(pos_ptr + r * K + in_row, rank, mask=valid)
    if HAS_SHARED:
        rows = tl.arange(0, BM)
        sm = rows < M
        n = M * K
        tl.store(pe_ptr + n + rows, tl.full((BM,), E, dtype=tl.int64), mask=sm)
        tl.store(pr_ptr + n + rows, rows.to(tl.int64), mask=sm)
        tl.store(pw_ptr + n + rows, tl.zeros((BM,), dtype=tl.float32), mask=sm)
        tl.store(pf_ptr + n + rows, tl.full((BM,), n, dtype=tl.int64), mask=sm)
        tl.store(pend_ptr + n + rows, tl.full((BM,), n + M, dtype=tl.int64), mask=sm)


@device_function
def route_program(pid, pid_m, tiles, blocks, x_ptr, g_ptr, part_ptr, l_ptr, cnt_ptr, bias_ptr, hash_ptr, w_ptr,
                  i_ptr, pe_ptr, pr_ptr, pw_ptr, pf_ptr, pend_ptr, pos_ptr, M, E, D, stride_x, stride_g, k_per_split,
                  route_scale, norm_eps, FMT: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr,
                  SPLIT: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
                  K: tl.constexpr, PAIRS: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, BE: tl.constexpr, BKK: tl.constexpr):
    """Program `pid` of row block `pid_m` (of `tiles` tiles of experts times SPLIT, `blocks` blocks of rows):
    its tile of the logits over its split of D; a tile's last split adds the partials in split order, and the
    block's last tile routes the block's rows (and sorts the pairs: PAIRS)."""
    tile = pid // SPLIT
    split = pid % SPLIT
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    offs_n = tile * BN + tl.arange(0, BN)
    n_mask = offs_n < E
    k_lo = split * k_per_split
    k_end = tl.minimum(D, k_lo + k_per_split)
    acc = product_tile(x_ptr, g_ptr, g_ptr, rows, rmask, offs_n, n_mask, k_lo, k_end, stride_x, stride_g, 0, 0.0,
                       g_ptr, g_ptr, g_ptr, 0, 0, False, False, FMT, 1, 1, 0, X_PARTS, DOT_BF16, False, False, BM, BN,
                       BK)
    mask = n_mask[:, None] & rmask[None, :]
    out = l_ptr + rows[None, :].to(tl.int64) * E + offs_n[:, None]
    done = True
    if SPLIT == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.store(part_ptr + (split * M + rows[None, :]).to(tl.int64) * E + offs_n[:, None], acc, mask=mask)
        tl.debug_barrier()
        counter = cnt_ptr + tile * blocks + pid_m
        done = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1
        if done:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(SPLIT):  # split order
                acc += tl.load(part_ptr + (s * M + rows[None, :]).to(tl.int64) * E + offs_n[:, None], mask=mask,
                               other=0.0)
            tl.store(out, acc, mask=mask)
            tl.atomic_xchg(counter, 0)
    if done:  # this tile's logits are stored; the block's last tile routes its rows
        tl.debug_barrier()
        counter = cnt_ptr + tiles * blocks + pid_m
        if tl.atomic_add(counter, 1, sem="acq_rel") == tiles - 1:
            for row in range(pid_m * BM, tl.minimum(M, pid_m * BM + BM)):
                _route_row(l_ptr, bias_ptr, hash_ptr, w_ptr, i_ptr, row, E, route_scale, norm_eps, SCORE, HAS_BIAS,
                           HASH, K, BE, BKK)
            if PAIRS:
                tl.debug_barrier()  # the block's routing is stored: every thread reads it back
                _sort_pairs(i_ptr, w_ptr, M, E, pe_ptr, pr_ptr, pw_ptr, pf_ptr, pend_ptr, pos_ptr, K, BM, BKK,
                            HAS_SHARED)
            tl.atomic_xchg(counter, 0)


@triton.jit(do_not_specialize=["M"])  # row counts vary call by call: one compile
def _router_kernel(x_ptr,      # activations [M, D], row stride stride_x
                   g_ptr,      # the gate's weight data [E, D] (dense), row stride stride_g
                   part_ptr,   # float32 [SPLIT, M, E] partials (SPLIT > 1)
                   l_ptr,      # float32 [M, E] logits out
                   cnt_ptr,    # int32 counters: [tiles * blocks] per tile, then [blocks] per row block
                   bias_ptr, hash_ptr,
                   w_ptr, i_ptr,  # out float32 / int64 [M, K] routing
                   pe_ptr, pr_ptr, pw_ptr, pf_ptr, pend_ptr, pos_ptr,  # out: the sorted pairs (PAIRS)
                   M, E, D, stride_x, stride_g, k_per_split, route_scale, norm_eps,
                   FMT: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, SPLIT: tl.constexpr,
                   SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, K: tl.constexpr,
                   PAIRS: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, BE: tl.constexpr, BKK: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    route_program(tl.program_id(0), tl.program_id(1), tl.num_programs(0) // SPLIT, tl.num_programs(1), x_ptr, g_ptr,
                  part_ptr, l_ptr, cnt_ptr, bias_ptr, hash_ptr, w_ptr, i_ptr, pe_ptr, pr_ptr, pw_ptr, pf_ptr, pend_ptr,
                  pos_ptr, M, E, D, stride_x, stride_g, k_per_split, route_scale, norm_eps, FMT, X_PARTS, DOT_BF16,
                  SPLIT, SCORE, HAS_BIAS, HASH, K, PAIRS, HAS_SHARED, BM, BN, BK, BE, BKK)


def _pairs_on_host_order(idx: torch.Tensor, weights: torch.Tensor, n_experts: int, shared: bool):
    """The sorted pairs of `_sort_pairs` made with torch (a prefill chunk of several row blocks: no one
    program sees every row)."""
    m, k = idx.shape
    dev = idx.device
    flat_e = idx.reshape(-1)
    rows = torch.arange(m, device=dev).repeat_interleave(k)
    order = torch.argsort(flat_e * m + rows, stable=True)
    e, r, pw = flat_e[order], rows[order], weights.reshape(-1)[order]
    first = torch.searchsorted(e, e)
    end = torch.searchsorted(e, e, right=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=dev)
    pos = inv.view(m, k).gather(1, idx.argsort(dim=-1, stable=True)).contiguous()
    if shared:
        n = m * k
        e = torch.cat((e, torch.full((m,), n_experts, dtype=torch.int64, device=dev)))
        r = torch.cat((r, torch.arange(m, device=dev)))
        pw = torch.cat((pw, torch.zeros(m, device=dev)))
        first = torch.cat((first, torch.full((m,), n, dtype=torch.int64, device=dev)))
        end = torch.cat((end, torch.full((m,), n + m, dtype=torch.int64, device=dev)))
    return e.contiguous(), r.contiguous(), pw.contiguous(), first.contiguous(), end.contiguous(), pos


def fast(x: torch.Tensor, gate: PackedWeight, bias: torch.Tensor | None, top_k: int, score_func: str,
         route_scale: float, norm_eps: float, hash_idx: torch.Tensor | None, weights: torch.Tensor,
         idx: torch.Tensor, shared: bool, hold: bool = False) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                          Phase | None]:
    """The routing of x [M, D] into `weights` [M, k] and `idx` [M, k] (one launch), and the pairs sorted by
    expert (expert, row, weight, the group's first and end pair; the shared expert's group of every row after
    them where `shared`) with each row's pairs' positions [M, k]: sorted in the launch for a decode step (one
    block of rows), with torch for a prefill chunk's several blocks. Returns (pairs, positions, the launch held):
    `hold` (a decode step's) and one block of rows: the launch not made but returned as a Phase, which the
    experts' launch runs first (kernels/moe.py `_step_kernel`); otherwise made, and None."""
    m, d = x.shape
    e = gate.shape[0]
    dev = x.device
    bm, bn, bk, ((kps, splits),) = linear.plan([(e, 0, e)], d, dev)
    tiles = triton.cdiv(e, bn)
    blocks = triton.cdiv(m, bm)
    n_pairs = m * top_k + (m if shared else 0)
    pairs_in_kernel = blocks == 1
    pair = [torch.empty(n_pairs, dtype=dt, device=dev) for dt in (torch.int64, torch.int64, torch.float32,
                                                                     torch.int64, torch.int64)]
    pos = torch.empty((m, top_k), dtype=torch.int64, device=dev)
    logits = torch.empty((m, e), dtype=torch.float32, device=dev)
    part = torch.empty((splits, m, e), dtype=torch.float32, device=dev) if splits > 1 else logits
    gdata = gate.data
    exact = gate.bf16_exact
    phase = Phase((tiles * splits, blocks), (
        x, gdata, part, logits, counters(dev, tiles * blocks + blocks), bias.float().contiguous() if bias is not None
        else logits, hash_idx.to(torch.int64).contiguous() if hash_idx is not None else idx, weights, idx, *pair, pos,
        m, e, d, x.stride(0), gdata.stride(0), kps, float(route_scale), float(norm_eps)), dict(
        FMT=0, X_PARTS=3 if exact and x.dtype == torch.float32 else 1, DOT_BF16=exact and not INTERPRET,
        SPLIT=splits, SCORE=SCORES[score_func], HAS_BIAS=bias is not None, HASH=hash_idx is not None, K=top_k,
        PAIRS=pairs_in_kernel, HAS_SHARED=shared, BM=bm, BN=bn, BK=bk, BE=pow2(e), BKK=pow2(top_k)))
    if hold and pairs_in_kernel:
        return pair, pos, phase
    _router_kernel[phase.grid](*phase.args, **phase.constexprs, **pdl(x.device))
    if not pairs_in_kernel:
        *pair, pos = _pairs_on_host_order(idx, weights, e, shared)
    return pair, pos, None
