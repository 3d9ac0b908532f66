"""Mixture of experts for a few rows: router and expert combination.

route: logits = x . W_gate (float32 from a float64 product; the gate is a dense PackedWeight [E, D]);
    scores = sqrt(softplus) | sigmoid | softmax;
    indices = top-k of (scores + bias) (or the hash table's row), weights = scores[idx] / (sum + eps) * scale.
experts: per row and selected expert e (SwiGLU with clamps):
    g = w1_e(x), u = w3_e(x)  (activation-quantized GEMMs, rounded to the activation dtype)
    h = silu(min(g, limit)) * clamp(u, -limit, limit)        (float32)
    official: o_e = w2_e(round(weight_e * h)), y = sum over experts in increasing id (float32) + shared
    plain:    o_e = w2_e(round(h)) * weight_e (transformers' order)
Each selected expert's weights are read once, however many rows chose it.

Kernels, float32 only (no float64 instruction):
- `fast_route`: the router product by the linear kernel (float32 accumulation, float32 logits), then one
  program per row: score function in float32, top-k by repeated argmax over the experts not yet taken
  (ties to the lower expert id; a NaN score ranks lowest, so a row of NaNs still yields k distinct ids in
  range), weights normalized in float32. Tolerance: logits within the linear kernel's bound; weights within
  2^-20 relative (float32 softplus/sqrt/sigmoid/softmax: a few ulps); indices equal unless two biased
  scores are within that.
- `fast`: pairs (row, expert) sorted by expert on the device (no host sync); one program per expert group
  and block of outputs reads that expert's weights once for all its rows, in their stored format (gate and
  up fused with SwiGLU, then down), weights found through a device table of expert pointers; then the
  rows' expert outputs are added in increasing expert id in float32, plus the shared expert, as the
  reference does. GEMMs are the linear kernel's (tensor-core dots of exact bfloat16 values, float32
  accumulation, 16 rows per program whatever the number of rows: batch invariant). Tolerance: each GEMM
  within the linear kernel's bound (K 2^-23 of the sum of magnitudes), which can move a rounding of g, u
  or h to x's dtype by one ulp, and through the FP8 quantization of h one e4m3 step of an element: checked
  at 2^-12 of the largest output for float32 and 2^-6 for bfloat16 (the e4m3 steps of h dominate).
Experts that are None (not held by this shard) contribute zero in the kernels.
"""

import weakref

import torch
import torch.nn.functional as F

from . import linear
from ._triton import (
    INTERPRET,
    MMA_ROWS,
    bf16_rne,
    device_function,
    device_of,
    pow2,
    require,
    require_dtype,
    round_out,
    tl,
    tmax,
    tmin,
    triton,
    tsum,
)
from .linear import PackedWeight, act_tile, check_act_block, check_weight, kernel_args, mma_parts, weight_tile


def route(x: torch.Tensor, gate: PackedWeight, bias: torch.Tensor | None, top_k: int, score_func: str,
          route_scale: float, norm_eps: float, hash_idx: torch.Tensor | None = None):
    """x [M, D]; gate [E, D] (dense) -> (weights float32 [M, k], indices int64 [M, k])."""
    logits = linear.rows_matmul(x.double(), gate.dense64()).float()
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


def _swiglu(x, w1, w3, act_block, limit, dtype):
    g = linear.reference(x, w1, act_block, dtype).float()
    u = linear.reference(x, w3, act_block, dtype).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


def expert_reference(x: torch.Tensor, w1, w2, w3, act_block: int | None, limit: float,
                     weight: torch.Tensor | None, weight_before_w2: bool, out_dtype=None) -> torch.Tensor:
    """One SwiGLU expert on rows x [n, D] (PackedWeight w1, w3 [I, D], w2 [D, I]) -> [n, D] in out_dtype
    (default x.dtype; float64 leaves w2's sum unrounded, for a sum over ranks holding slices of I)."""
    h = _swiglu(x, w1, w3, act_block, limit, x.dtype)
    if weight is not None and weight_before_w2:
        h = weight.unsqueeze(-1) * h
    o = linear.reference(h.to(x.dtype), w2, act_block, out_dtype or x.dtype)
    if weight is not None and not weight_before_w2:
        o = o * weight.unsqueeze(-1).to(o.dtype)
    return o


def reference(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts, shared,
              act_block: int | None, limit: float, weight_before_w2: bool, reduce=None) -> torch.Tensor:
    """x [M, D]; weights/indices [M, k]; experts: list of (w1, w2, w3) (None for experts not held);
    shared: (w1, w2, w3) or None -> y [M, D] in x.dtype.

    Expert parallel (`reduce`): this rank computes the slots whose expert it holds (zeros elsewhere) and
    its slice of the shared expert's intermediate, unrounded; `reduce(outputs, shared64)` sums them over
    ranks (exactly: each slot comes from one rank), and every rank then adds the experts in the same order.
    Bytes moved: each distinct selected expert's w1, w2, w3 once + x + y."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order = indices.argsort(dim=-1)  # each row adds its experts in increasing id, like the official loop
    sorted_idx = indices.gather(-1, order)
    sorted_w = weights.gather(-1, order)
    outputs = torch.zeros(*indices.shape, x.shape[-1], dtype=torch.float32, device=x.device)
    for e in sorted_idx.unique().tolist():
        if experts[e] is None:  # held by another rank
            continue
        rows, slots = (sorted_idx == e).nonzero(as_tuple=True)
        w1, w2, w3 = experts[e]
        o = expert_reference(x[rows], w1, w2, w3, act_block, limit, sorted_w[rows, slots], weight_before_w2)
        outputs[rows, slots] = o.float()
    shared64 = None
    if shared is not None:
        shared64 = expert_reference(x, *shared, act_block, limit, None, weight_before_w2, torch.float64)
    if reduce is not None:
        outputs, shared64 = reduce(outputs, shared64)
    for slot in range(indices.shape[-1]):
        y = y + outputs[:, slot]
    if shared64 is not None:
        y = y + shared64.to(x.dtype).float()
    return y.to(x.dtype)


# --- Triton kernels: router ------------------------------------------------------------------------------

_SCORES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@device_function
def _log1p(y):
    """log(1 + y) for y >= 0, accurate for small y (the log of the rounded 1 + y, corrected)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * y / (u - 1.0))


@triton.jit
def _route_kernel(l_ptr,     # float32 router logits [M, E], contiguous
                  bias_ptr,  # float32 [E] selection bias (HAS_BIAS)
                  hash_ptr,  # int64 [M, K] hash-routing table rows (HASH)
                  w_ptr,     # out float32 [M, K] weights
                  i_ptr,     # out int64 [M, K] expert ids (descending biased score, ties to the lower id)
                  E, route_scale, norm_eps,
                  SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, K: tl.constexpr,
                  BE: tl.constexpr, BK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BE)
    cmask = cols < E
    lg = tl.load(l_ptr + m * E + cols, mask=cmask, other=0.0)
    if SCORE == 0:  # sqrt(softplus), softplus with torch's threshold 20
        s = tl.sqrt_rn(tl.where(lg > 20.0, lg, _log1p(tl.exp(tl.minimum(lg, 20.0)))))
    elif SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-lg))
    else:
        ex = tl.where(cmask, tl.exp(lg - tmax(tl.where(cmask, lg, float("-inf")), axis=0)), 0.0)
        s = ex / tsum(ex, axis=0)
    slots = tl.arange(0, BK)
    idx = tl.zeros((BK,), dtype=tl.int64)
    w = tl.zeros((BK,), dtype=tl.float32)
    if HASH:
        idx = tl.load(hash_ptr + m * K + slots, mask=slots < K, other=0)
        for j in tl.static_range(K):
            e = tsum(tl.where(slots == j, idx, 0))
            w = tl.where(slots == j, tsum(tl.where(cols == e, s, 0.0)), w)
    else:
        b = s
        if HAS_BIAS:
            b = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0)
        b = tl.where(b == b, b, float("-inf"))  # a NaN ranks lowest
        free = cmask  # experts not taken yet: at least K of them, so every pick is a real expert
        for j in tl.static_range(K):
            best = tmax(tl.where(free, b, float("-inf")), axis=0)
            e = tmin(tl.where(free & (b == best), cols, BE), axis=0)
            idx = tl.where(slots == j, e.to(tl.int64), idx)
            w = tl.where(slots == j, tsum(tl.where(cols == e, s, 0.0)), w)
            free = free & (cols != e)
    w = w / (tsum(w, axis=0) + norm_eps) * route_scale
    tl.store(w_ptr + m * K + slots, w, mask=slots < K)
    tl.store(i_ptr + m * K + slots, idx, mask=slots < K)


def fast_route(x: torch.Tensor, gate: PackedWeight, bias: torch.Tensor | None, top_k: int, score_func: str,
               route_scale: float, norm_eps: float, hash_idx: torch.Tensor | None = None):
    """The kernels for `route` (same signature; results within the stated tolerance)."""
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require(x.dim() == 2, "x.dim()", x.dim(), "must be 2 ([M, D])")
    m, d = x.shape
    require(gate.format == "dense", "gate.format", gate.format, "must be dense")
    e, gd = gate.shape
    require(gd == d, "gate.shape", gate.shape, f"must be [E, {d}]")
    require(score_func in _SCORES, "score_func", score_func, f"must be one of {', '.join(_SCORES)}")
    require(1 <= top_k <= min(e, 64), "top_k", top_k, f"must be in 1..{min(e, 64)}")
    require(e <= 4096, "experts", e, "must be <= 4096")
    if bias is not None:
        require(tuple(bias.shape) == (e,), "bias.shape", tuple(bias.shape), f"must be {(e,)}")
    if hash_idx is not None:
        require(tuple(hash_idx.shape) == (m, top_k), "hash_idx.shape", tuple(hash_idx.shape), f"must be {(m, top_k)}")
    dev = device_of(x, gate.data)
    logits = linear.fast(x, gate, None, torch.float32)
    w = torch.empty((m, top_k), dtype=torch.float32, device=dev)
    idx = torch.empty((m, top_k), dtype=torch.int64, device=dev)
    if m:
        b = logits if bias is None else bias.float().contiguous()
        h = idx if hash_idx is None else hash_idx.to(torch.int64).contiguous()
        _route_kernel[(m,)](logits, b, h, w, idx, e, route_scale, norm_eps, SCORE=_SCORES[score_func],
                            HAS_BIAS=bias is not None, HASH=hash_idx is not None, K=top_k, BE=pow2(e), BK=pow2(top_k))
    return w, idx


# --- Triton kernels: experts -----------------------------------------------------------------------------

_W_DTYPES = {torch.float8_e4m3fn: tl.float8e4nv, torch.int8: tl.int8, torch.uint8: tl.int8,
             torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float16: tl.float16}


class ExpertTable:
    """Device table of the experts' weight addresses, int64 [E, 6]: w1, w1 scale, w3, w3 scale, w2, w2
    scale (0 for experts not held), with the layout every expert shares (checked once)."""

    def __init__(self, experts, device):
        held = [e for e in experts if e is not None]
        require(len(held) > 0, "experts", "all None", "at least one expert must be held")
        w1, w2, w3 = held[0]
        self.i, self.d = check_weight(w1, "w1")
        require(check_weight(w3, "w3") == (self.i, self.d), "w3.shape", w3.shape, f"must equal w1.shape {w1.shape}")
        require(check_weight(w2, "w2") == (self.d, self.i), "w2.shape", w2.shape, f"must be {(self.d, self.i)}")
        self.up = kernel_args(w1)[2:]   # stride_wn, stride_sn, FMT, BO, BI (w1 and w3)
        self.down = kernel_args(w2)[2:]
        self.wdt_up, self.wdt_down = _W_DTYPES[w1.data.dtype], _W_DTYPES[w2.data.dtype]
        rows = []
        for n, ex in enumerate(experts):
            if ex is None:
                rows.append([0] * 6)
                continue
            a1, a2, a3 = ex
            for name, w, want in (("w1", a1, self.up), ("w3", a3, self.up), ("w2", a2, self.down)):
                check_weight(w, f"experts[{n}].{name}")
                require(kernel_args(w)[2:] == want and w.shape == (a1.shape if name != "w2" else w2.shape),
                        f"experts[{n}].{name}", f"{w.format} {w.shape}", "must match expert 0's format and layout")
            rows.append([t for w in (a1, a3, a2) for t in kernel_args(w)[:2]])
        self.table = torch.tensor([[t.data_ptr() if not isinstance(t, int) else t for t in r] for r in rows],
                                  dtype=torch.int64, device=device)
        self.refs = [t for r in rows for t in r if not isinstance(t, int)]  # keep the storage alive


_tables: dict[int, tuple[weakref.ref, ExpertTable]] = {}


def expert_table(experts, key) -> ExpertTable:
    """One table per `key` (the model's expert list or shared-expert tuple), made on first use (before
    graph capture) and dropped with the weights."""
    first = next((e for e in experts if e is not None), (None,))[0]
    hit = _tables.get(id(key))
    if hit is not None and hit[0]() is first:
        return hit[1]
    require(first is not None, "experts", "all None", "at least one expert must be held")
    t = ExpertTable(experts, first.data.device)
    _tables[id(key)] = (weakref.ref(first), t)
    weakref.finalize(first, _tables.pop, id(key), None)
    return t


@triton.jit
def _gate_up_kernel(x_ptr,      # activations [M, D] (float32 / bfloat16), row stride stride_x
                    tab_ptr,    # int64 [E, 6] expert weight addresses (ExpertTable)
                    e_ptr,      # int64 [P] expert of each pair, pairs sorted by (expert, row)
                    row_ptr,    # int64 [P] row of each pair
                    pw_ptr,     # float32 [P] routing weight of each pair (APPLY_W == 1)
                    first_ptr,  # int64 [P] first pair of the pair's expert group (the group leader works)
                    end_ptr,    # int64 [P] one past the group's last pair
                    h_ptr,      # out [P, I] in x's dtype: the rounded SwiGLU activations, per pair
                    P, PAIRS, D, I, stride_x, stride_wn, stride_sn, limit,  # PAIRS: pairs per program
                    FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr,
                    ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr,
                    HAS_LIMIT: tl.constexpr, APPLY_W: tl.constexpr, X_BF16: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    for p in range(tl.program_id(0) * PAIRS, tl.minimum(P, (tl.program_id(0) + 1) * PAIRS)):
        if tl.load(first_ptr + p) == p:
            end = tl.load(end_ptr + p)
            base = tab_ptr + tl.load(e_ptr + p) * 6
            a1 = tl.load(base)
            offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
            n_mask = offs_n < I
            w1_rows = a1.to(tl.pointer_type(WDT)) + offs_n.to(tl.int64) * stride_wn
            s1_rows = tl.load(base + 1).to(tl.pointer_type(tl.uint8)) + (offs_n // BO).to(tl.int64) * stride_sn
            w3_rows = tl.load(base + 2).to(tl.pointer_type(WDT)) + offs_n.to(tl.int64) * stride_wn
            s3_rows = tl.load(base + 3).to(tl.pointer_type(tl.uint8)) + (offs_n // BO).to(tl.int64) * stride_sn
            for r0 in range(p, end, BM):  # 16 pairs at a time, whatever the group's size
                prs = r0 + tl.arange(0, BM)
                pm = prs < end
                rows = tl.load(row_ptr + prs, mask=pm, other=0)
                acc_g = tl.zeros((BN, BM), dtype=tl.float32)
                acc_u = tl.zeros((BN, BM), dtype=tl.float32)
                if a1 != 0:
                    for k0 in range(0, D, BK):
                        a = act_tile(x_ptr, rows, pm, k0, D, stride_x, ACT_BLOCK, BM, BK)
                        wg = weight_tile(w1_rows, s1_rows, n_mask, k0, D, FMT, BI, BN, BK)
                        acc_g = mma_parts(wg, a, acc_g, X_PARTS, DOT_BF16)
                        wu = weight_tile(w3_rows, s3_rows, n_mask, k0, D, FMT, BI, BN, BK)
                        acc_u = mma_parts(wu, a, acc_u, X_PARTS, DOT_BF16)
                g = round_out(acc_g, X_BF16).to(tl.float32)
                u = round_out(acc_u, X_BF16).to(tl.float32)
                if HAS_LIMIT:
                    u = tl.minimum(tl.maximum(u, -limit), limit)
                    g = tl.minimum(g, limit)
                h = g / (1.0 + tl.exp(-g)) * u
                if APPLY_W == 1:
                    h = tl.load(pw_ptr + prs, mask=pm, other=0.0)[None, :] * h
                if X_BF16:
                    h = bf16_rne(h)
                tl.store(h_ptr + prs[None, :].to(tl.int64) * I + offs_n[:, None], h, mask=n_mask[:, None] & pm[None, :])


@triton.jit
def _down_kernel(h_ptr,      # [P, I] SwiGLU activations per pair (x's dtype), contiguous
                 tab_ptr, e_ptr, pw_ptr, first_ptr, end_ptr,  # as for _gate_up_kernel
                 o_ptr,      # out float32 [P, D]: each pair's expert output (values of x's dtype)
                 P, PAIRS, I, D, stride_wn, stride_sn,  # PAIRS: pairs per program
                 FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr,
                 ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr,
                 APPLY_W: tl.constexpr, X_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    for p in range(tl.program_id(0) * PAIRS, tl.minimum(P, (tl.program_id(0) + 1) * PAIRS)):
        if tl.load(first_ptr + p) == p:
            end = tl.load(end_ptr + p)
            base = tab_ptr + tl.load(e_ptr + p) * 6
            a2 = tl.load(base + 4)
            offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
            n_mask = offs_n < D
            w2_rows = a2.to(tl.pointer_type(WDT)) + offs_n.to(tl.int64) * stride_wn
            s2_rows = tl.load(base + 5).to(tl.pointer_type(tl.uint8)) + (offs_n // BO).to(tl.int64) * stride_sn
            for r0 in range(p, end, BM):
                prs = r0 + tl.arange(0, BM)
                pm = prs < end
                acc = tl.zeros((BN, BM), dtype=tl.float32)
                if a2 != 0:
                    for k0 in range(0, I, BK):
                        a = act_tile(h_ptr, prs, pm, k0, I, I, ACT_BLOCK, BM, BK)
                        w = weight_tile(w2_rows, s2_rows, n_mask, k0, I, FMT, BI, BN, BK)
                        acc = mma_parts(w, a, acc, X_PARTS, DOT_BF16)
                o = round_out(acc, X_BF16).to(tl.float32)
                if APPLY_W == 2:  # o * weight in x's dtype
                    pw = tl.load(pw_ptr + prs, mask=pm, other=0.0)
                    if X_BF16:
                        o = bf16_rne(o * bf16_rne(pw).to(tl.float32)[None, :]).to(tl.float32)
                    else:
                        o = o * pw[None, :]
                tl.store(o_ptr + prs[None, :].to(tl.int64) * D + offs_n[:, None], o, mask=n_mask[:, None] & pm[None, :])


@triton.jit
def _combine_kernel(o_ptr,       # float32 [P, D] routed outputs per pair
                    pos_ptr,     # int64 [M, K]: row m's pairs, in increasing expert id
                    shared_ptr,  # float32 [M, D] shared expert output (HAS_SHARED)
                    y_ptr,       # out [M, D] in x's dtype
                    D, K, HAS_SHARED: tl.constexpr, X_BF16: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < D
    y = tl.zeros((BD,), dtype=tl.float32)
    for j in range(K):
        y += tl.load(o_ptr + tl.load(pos_ptr + m * K + j) * D + cols, mask=cmask, other=0.0)
    if HAS_SHARED:
        y += tl.load(shared_ptr + m * D + cols, mask=cmask, other=0.0)
    if X_BF16:
        tl.store(y_ptr + m * D + cols, bf16_rne(y), mask=cmask)
    else:
        tl.store(y_ptr + m * D + cols, y, mask=cmask)


def _experts(x, table: ExpertTable, e, rows, pw, act_block, limit, apply_w):
    """Run the pairs (sorted by expert) through their experts -> float32 [P, D] outputs."""
    p, dev = e.numel(), x.device
    first = torch.searchsorted(e, e)
    end = torch.searchsorted(e, e, right=True)
    d, i = table.d, table.i
    bm = MMA_ROWS  # 16 pairs per block of a group, whatever the number of rows: batch invariant
    if INTERPRET:
        bk = max(min(pow2(max(d, i)), 256), act_block, 32)
        bn_up, bn_down = min(pow2(i), 128), min(pow2(d), 128)
    else:
        bk = max(64, act_block)
        bn_up, bn_down = (64, 32) if bk == 64 else (16, 16)  # a 128-deep K tile (ACT_BLOCK 128): narrower
    pairs = p if INTERPRET else 1  # the interpreter pays per program: one program walks all groups
    # (ptxas) with 4 warps the gate and up tiles and their bfloat16 parts do not fit 255 registers, nor does a
    # 64-wide down tile
    warps = 8
    xb = x.dtype == torch.bfloat16
    parts = 3 if not act_block and not xb else 1  # float32 activations: three exact bfloat16 parts
    dot_bf16 = not INTERPRET  # expert weights are FP8 / FP4: bfloat16 values
    h = torch.empty((p, i), dtype=x.dtype, device=dev)
    swn, ssn, fmt, bo, bi = table.up
    _gate_up_kernel[(triton.cdiv(p, pairs), triton.cdiv(i, bn_up))](
        x, table.table, e, rows, pw, first, end, h, p, pairs, d, i, x.stride(0), swn, ssn, float(limit),
        FMT=fmt, BO=bo, BI=bi, WDT=table.wdt_up, ACT_BLOCK=act_block, X_PARTS=parts, DOT_BF16=dot_bf16,
        HAS_LIMIT=limit > 0, APPLY_W=apply_w, X_BF16=xb, BM=bm, BN=bn_up, BK=bk, num_warps=warps)
    o = torch.empty((p, d), dtype=torch.float32, device=dev)
    swn, ssn, fmt, bo, bi = table.down
    _down_kernel[(triton.cdiv(p, pairs), triton.cdiv(d, bn_down))](
        h, table.table, e, pw, first, end, o, p, pairs, i, d, swn, ssn, FMT=fmt, BO=bo, BI=bi, WDT=table.wdt_down,
        ACT_BLOCK=act_block, X_PARTS=parts, DOT_BF16=dot_bf16, APPLY_W=apply_w, X_BF16=xb, BM=bm, BN=bn_down,
        BK=bk)
    return o


def fast(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts, shared,
         act_block: int | None, limit: float, weight_before_w2: bool, reduce=None) -> torch.Tensor:
    """The kernels for `reference` (same signature and result). Expert parallel (`reduce`) needs the
    per-slot outputs and the shared expert's unrounded partial sum, which the fused kernels do not expose:
    that case runs the reference."""
    if reduce is not None:
        return reference(x, weights, indices, experts, shared, act_block, limit, weight_before_w2, reduce)
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require(x.dim() == 2, "x.dim()", x.dim(), "must be 2 ([M, D])")
    m, d = x.shape
    require(indices.dim() == 2 and indices.shape[0] == m, "indices.shape", tuple(indices.shape), f"must be [{m}, k]")
    require(tuple(weights.shape) == tuple(indices.shape), "weights.shape", tuple(weights.shape),
            f"must equal indices.shape {tuple(indices.shape)}")
    require_dtype(weights, "weights", (torch.float32,))
    require_dtype(indices, "indices", (torch.int64, torch.int32))
    table = expert_table(experts, experts)
    require(table.d == d, "x.shape[1]", d, f"must equal the experts' input size {table.d}")
    ab = check_act_block(act_block, d)
    if ab:
        check_act_block(ab, table.i)
    dev = device_of(x, weights, indices, table.table)
    if x.stride(-1) != 1:
        x = x.contiguous()
    k = indices.shape[1]
    y = torch.empty((m, d), dtype=x.dtype, device=dev)
    if m == 0:
        return y
    flat_e = indices.reshape(-1).to(torch.int64)
    rows = torch.arange(m, device=dev).repeat_interleave(k)
    order = torch.argsort(flat_e * m + rows, stable=True)
    e, r, pw = flat_e[order].contiguous(), rows[order].contiguous(), weights.reshape(-1)[order].contiguous()
    routed = _experts(x, table, e, r, pw, ab, limit, 1 if weight_before_w2 else 2)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=dev)
    pos = inv.view(m, k).gather(1, indices.to(torch.int64).argsort(dim=-1, stable=True)).contiguous()
    out_shared = routed
    if shared is not None:
        st = expert_table([shared], shared)
        zeros = torch.zeros(m, dtype=torch.int64, device=dev)
        out_shared = _experts(x, st, zeros, torch.arange(m, device=dev), pw, ab, limit, 0)
    bd = min(pow2(d), 8192 if INTERPRET else 1024)
    _combine_kernel[(m, triton.cdiv(d, bd))](routed, pos, out_shared, y, d, k, HAS_SHARED=shared is not None,
                                            X_BF16=x.dtype == torch.bfloat16, BD=bd)
    return y
