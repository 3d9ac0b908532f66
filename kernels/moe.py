"""Mixture of experts for a few rows: the experts and their combination (the router: kernels/router.py).

experts: per row and selected expert e (SwiGLU with clamps):
    g = w1_e(x), u = w3_e(x)  (activation-quantized GEMMs, rounded to the activation dtype)
    h = silu(min(g, limit)) * clamp(u, -limit, limit)        (float32)
    official: o_e = w2_e(round(weight_e * h)), y = sum over experts in increasing id (float32) + shared
    plain:    o_e = w2_e(round(h)) * weight_e (transformers' order)
Each selected expert's weights are read once, however many rows chose it.

Kernels, float32 only (no float64 instruction):
- `fast_ffn`: the routing (`router.fast`: pairs (row, expert) sorted by expert on the device, no host
  sync); one program per expert group and block of outputs reads that expert's weights once for all its
  rows, in their stored format (gate and up fused with SwiGLU, then down), weights found through a device
  table of expert pointers; then the rows' expert outputs are added in increasing expert id in float32,
  plus the shared expert, as the reference does. GEMMs are the linear kernel's (tensor-core dots of exact
  bfloat16 values, float32 accumulation, 16 rows per program whatever the number of rows: batch
  invariant; in a long call in the checkpoint's formats an expert's pairs LONG_ROWS (e4m3 MMA:
  E4M3_LONG_ROWS) at a time, x's and h's rows staged once for the launch, the shared expert in launches
  of its own).
  Tolerance: each GEMM
  within the linear kernel's bound (K 2^-23 of the sum of magnitudes), which can move a rounding of g, u
  or h to x's dtype by one ulp, and through the FP8 quantization of h one e4m3 step of an element: checked
  at 2^-12 of the largest output for float32 and 2^-6 for bfloat16 (the e4m3 steps of h dominate).
Experts that are None (not held by this shard) contribute zero in the kernels.
"""

import functools
import types
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import linear, rank_sum, router
from ._triton import (
    INTERPRET,
    NATIVE_BLOCK_SCALED,
    NATIVE_E4M3,
    bf16_rne,
    counters,
    dependent_launch,
    device_function,
    device_of,
    is_long,
    native_products,
    pdl,
    pow2,
    product_rows,
    require,
    require_dtype,
    require_int32_rows,
    round_out,
    tl,
    triton,
)
from .linear import (
    PackedWeight,
    check_act_block,
    check_weight,
    kernel_args,
    staged_product,
    weight_product,
)
from .mhc import Combine, expand, expand_tile, output_row
from .phases import Phase, in_order, phase_done, phase_ticket, phase_wait, separate_phases
from .rank_sum import publish_slot, rank_arrive, rank_publish
from .router import route_program
from .rows import act_tile, scratch_area, stage_launch, stage_rows, stage_scratch


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

    Split over ranks (`reduce`): this rank computes the slots whose expert it holds (zeros elsewhere) or,
    with every expert split by its intermediate, its slice of every slot, unrounded (float64), and its slice
    of the shared expert's intermediate; `reduce(outputs, shared64)` sums them over ranks (whole experts:
    exactly, each slot comes from one rank), the slots are rounded as one rank rounds them, and every rank
    then adds the experts in the same order.
    Bytes moved: each distinct selected expert's w1, w2, w3 once + x + y."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order = indices.argsort(dim=-1)  # each row adds its experts in increasing id, like the official loop
    sorted_idx = indices.gather(-1, order)
    sorted_w = weights.gather(-1, order)
    sliced = reduce is not None and all(e is not None for e in experts)  # each expert split over the ranks
    outputs = torch.zeros(*indices.shape, x.shape[-1], dtype=torch.float64 if sliced else torch.float32,
                          device=x.device)
    for e in sorted_idx.unique().tolist():
        if experts[e] is None:  # held by another rank
            continue
        rows, slots = (sorted_idx == e).nonzero(as_tuple=True)
        w1, w2, w3 = experts[e]
        o = expert_reference(x[rows], w1, w2, w3, act_block, limit, sorted_w[rows, slots], weight_before_w2,
                             torch.float64 if sliced else None)
        outputs[rows, slots] = o.to(outputs.dtype)
    shared64 = None
    if shared is not None:
        shared64 = expert_reference(x, *shared, act_block, limit, None, weight_before_w2, torch.float64)
    if reduce is not None:
        outputs, shared64 = reduce(outputs, shared64)
        if sliced:  # each slot rounded once, as one rank rounds its expert's output
            outputs = outputs.to(x.dtype).float()
    for slot in range(indices.shape[-1]):
        y = y + outputs[:, slot]
    if shared64 is not None:
        y = y + shared64.to(x.dtype).float()
    return y.to(x.dtype)


def reference_ffn(x: torch.Tensor, gate: PackedWeight, bias: torch.Tensor | None, top_k: int, score_func: str,
                  route_scale: float, norm_eps: float, hash_idx: torch.Tensor | None, experts, shared,
                  act_block: int | None, limit: float, weight_before_w2: bool, X: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor, reduce=None, pending: bool = False):
    """The MoE sub-block: routing (`route`), the experts (`reference`) and the mHC expand of their sum into
    the residual streams X [M, hc, D] -> (X', weights, indices) (`pending` leaves the kernels' combine to the
    next site: here the streams are made whatever it says)."""
    w, idx = router.route(x, gate, bias, top_k, score_func, route_scale, norm_eps, hash_idx)
    y = reference(x, w, idx, experts, shared, act_block, limit, weight_before_w2, reduce)
    return expand(y, X, post, comb), w, idx


# --- Triton kernels ---------------------------------------------------------------------------------------
# Four launches: (1) the router product with, per block of 16 rows, the routing in its last program (scores,
# top-k, weights) and, for a decode step (one block), the (row, expert) pairs sorted by expert; (2) gate and
# up of every expert group (its leader pair walks the group's rows, 16 at a time), the shared expert one more
# group; (3) down, likewise; (4) each row's experts added in increasing id, plus the shared expert, rounded,
# and the mHC expand (kernels/mhc.py's output_row and expand_tile; a decode step's `pending` call leaves (4) to
# the launch of the site that reads the streams next). A decode step (one block of rows, its pairs sorted in
# (1)) makes (1), (2) and (3) phases of one launch (`_step_kernel`, kernels/phases.py: each phase's programs
# wait in the kernel for the phase before). Each selected expert's weights are read once, however many rows
# chose it.

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
        addresses = [[t.data_ptr() if not isinstance(t, int) else t for t in r] for r in rows]
        self.table = torch.tensor(addresses, dtype=torch.int64, device=device)
        # the weight rows' alignment the kernels may assume (16 bytes: whole-vector loads), from every address
        self.align = 16 if all(a % 16 == 0 for r in addresses for a in r) else 1
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


@device_function
def _weight_rows(base, J: tl.constexpr, offs_n, stride_wn, stride_sn, WDT: tl.constexpr, W_ALIGN: tl.constexpr,
                 BO: tl.constexpr):
    """Rows offs_n of an expert group's gate (J = 0) or up (J = 1) weight and of its scales, from the group's
    table row (in the checkpoint's formats made where each product begins: the up's held across the gate's K
    loop spill at 256-deep K tiles)."""
    w = tl.multiple_of(tl.load(base + 2 * J).to(tl.pointer_type(WDT)), W_ALIGN) + offs_n.to(tl.int64) * stride_wn
    s = tl.load(base + 2 * J + 1).to(tl.pointer_type(tl.uint8)) + (offs_n // BO).to(tl.int64) * stride_sn
    return w, s


@device_function
def _up_group(x_ptr, base, row_ptr, pw_ptr, h_ptr, qc, qs, q_cols, p, end, tile, D, I, IW, stride_x, stride_wn,
              stride_sn, limit, FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr,
              ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr,
              W_ALIGN: tl.constexpr, HAS_LIMIT: tl.constexpr, APPLY_W: tl.constexpr, X_BF16: tl.constexpr,
              PRESTAGED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Gate and up of one expert group (its table row at `base`, I intermediate outputs) for its pairs
    [p, end), BM at a time, into rows of h (IW wide). In the checkpoint's formats the rows are quantized once
    for both products, into the group's scratch `qc`/`qs` (rows.stage_rows); PRESTAGED: every row of x is,
    there, before the launch (rows.stage_launch). `tile`: the program's N tile."""
    a1 = tl.load(base)
    offs_n = tile * BN + tl.arange(0, BN)
    n_mask = offs_n < I
    if not (NATIVE > 0 and ACT_BLOCK >= 32 and FMT > 0):  # from registers: made once for every block of pairs
        w1_rows, s1_rows = _weight_rows(base, 0, offs_n, stride_wn, stride_sn, WDT, W_ALIGN, BO)
        w3_rows, s3_rows = _weight_rows(base, 1, offs_n, stride_wn, stride_sn, WDT, W_ALIGN, BO)
    for r0 in range(p, end, BM):  # BM pairs at a time, whatever the group's size
        prs = r0 + tl.arange(0, BM)
        pm = prs < end
        rows = tl.load(row_ptr + prs, mask=pm, other=0)
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        if a1 != 0:
            if NATIVE > 0 and ACT_BLOCK >= 32 and FMT > 0:
                if PRESTAGED:
                    qrows = rows
                else:
                    stage_rows(x_ptr, rows, pm, D, stride_x, qc, qs, q_cols, FMT, NATIVE, ACT_BLOCK, BM, BK)
                    qrows = tl.arange(0, BM).to(tl.int64)
                w1_rows, s1_rows = _weight_rows(base, 0, offs_n, stride_wn, stride_sn, WDT, W_ALIGN, BO)
                acc_g = staged_product(w1_rows, s1_rows, n_mask, qc, qs, qrows, D, q_cols, acc_g, FMT, BI, ACT_BLOCK,
                                       NATIVE, BM, BN, BK)
                w3_rows, s3_rows = _weight_rows(base, 1, offs_n, stride_wn, stride_sn, WDT, W_ALIGN, BO)
                acc_u = staged_product(w3_rows, s3_rows, n_mask, qc, qs, qrows, D, q_cols, acc_u, FMT, BI, ACT_BLOCK,
                                       NATIVE, BM, BN, BK)
            else:  # gate, then up: one weight tile live at a time (both at once spill at a 128-deep K tile)
                for k0 in range(0, D, BK):
                    a = act_tile(x_ptr, rows, pm, k0, D, stride_x, 0, BM, BK)
                    acc_g = weight_product(w1_rows, s1_rows, n_mask, a, k0, D, acc_g, FMT, BI, ACT_BLOCK, X_PARTS,
                                           DOT_BF16, NATIVE, BM, BN, BK)
                for k0 in range(0, D, BK):
                    a = act_tile(x_ptr, rows, pm, k0, D, stride_x, 0, BM, BK)
                    acc_u = weight_product(w3_rows, s3_rows, n_mask, a, k0, D, acc_u, FMT, BI, ACT_BLOCK, X_PARTS,
                                           DOT_BF16, NATIVE, BM, BN, BK)
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
        tl.store(h_ptr + prs[None, :].to(tl.int64) * IW + offs_n[:, None], h, mask=n_mask[:, None] & pm[None, :])


@device_function
def _group_at(p, pid, tile, tiles, e_ptr, end_ptr, qc_ptr, qs_ptr, q_cols, q_by_expert, PRESTAGED: tl.constexpr,
              BM: tl.constexpr):
    """The group whose first pair is p, in pair program `pid` at N tile `tile` (of `tiles`): its end pair, its
    expert, and where its rows' codes and scales are (staged once, or the group's own scratch area: by expert or
    program, and N tile)."""
    end = tl.load(end_ptr + p)
    e = tl.load(e_ptr + p)
    qc, qs = qc_ptr, qs_ptr
    if not PRESTAGED:
        slot = tl.where(q_by_expert != 0, e, pid) * tiles + tile
        qc, qs = scratch_area(qc_ptr, qs_ptr, slot, q_cols, BM)
    return end, e, qc, qs


@device_function
def gate_up_program(pid, tile, tiles, x_ptr, tab_ptr, stab_ptr, e_ptr, row_ptr, pw_ptr, first_ptr, end_ptr, h_ptr,
                    qc_ptr, qs_ptr, q_cols, q_by_expert, P, PAIRS, D, I, I_S, IW, E, stride_x, swn, ssn, s_swn, s_ssn,
                    limit, FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr,
                    S_FMT: tl.constexpr, S_BO: tl.constexpr, S_BI: tl.constexpr, S_WDT: tl.constexpr,
                    ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr,
                    W_ALIGN: tl.constexpr, HAS_LIMIT: tl.constexpr, APPLY_W: tl.constexpr, X_BF16: tl.constexpr,
                    HAS_SHARED: tl.constexpr, PRESTAGED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """Pair program `pid`'s groups (PAIRS pairs from pid PAIRS: the groups whose first pair it holds) at N tile
    `tile` of `tiles`: their gate and up, SwiGLU, into h (`_gate_up_kernel`'s arguments)."""
    for p in range(pid * PAIRS, tl.minimum(P, (pid + 1) * PAIRS)):
        if tl.load(first_ptr + p) == p:
            end, e, qc, qs = _group_at(p, pid, tile, tiles, e_ptr, end_ptr, qc_ptr, qs_ptr, q_cols, q_by_expert,
                                       PRESTAGED, BM)
            if e < E:
                _up_group(x_ptr, tab_ptr + e * 6, row_ptr, pw_ptr, h_ptr, qc, qs, q_cols, p, end, tile, D, I, IW,
                          stride_x, swn, ssn, limit, FMT, BO, BI, WDT, ACT_BLOCK, X_PARTS, DOT_BF16, NATIVE, W_ALIGN,
                          HAS_LIMIT, APPLY_W, X_BF16, PRESTAGED, BM, BN, BK)
            elif HAS_SHARED:  # its intermediate size may differ (a split over ranks narrower than an expert)
                if PRESTAGED:
                    qc, qs = _shared_codes(qc_ptr, qs_ptr, q_cols, q_by_expert, ACT_BLOCK)
                _up_group(x_ptr, stab_ptr, row_ptr, pw_ptr, h_ptr, qc, qs, q_cols, p, end, tile, D, I_S, IW, stride_x,
                          s_swn, s_ssn, limit, S_FMT, S_BO, S_BI, S_WDT, ACT_BLOCK, X_PARTS, DOT_BF16, NATIVE, W_ALIGN,
                          HAS_LIMIT, 0, X_BF16, PRESTAGED, BM, BN, BK)


@triton.jit(do_not_specialize=["P"])  # pair counts vary call by call: one compile
def _gate_up_kernel(x_ptr,      # activations [M, D] (float32 / bfloat16), row stride stride_x
                    tab_ptr,    # int64 [E, 6] expert weight addresses (ExpertTable)
                    stab_ptr,   # int64 [1, 6] the shared expert's (HAS_SHARED), the group of expert id E
                    e_ptr,      # int64 [P] expert of each pair, pairs sorted by (expert, row)
                    row_ptr,    # int64 [P] row of each pair
                    pw_ptr,     # float32 [P] routing weight of each pair
                    first_ptr,  # int64 [P] first pair of the pair's expert group (the group leader works)
                    end_ptr,    # int64 [P] one past the group's last pair
                    h_ptr,      # out [P, IW] in x's dtype: the rounded SwiGLU activations, per pair
                    # scratch (NATIVE): per group and N tile (_scratch); PRESTAGED: every row's codes, the shared
                    # expert's from row q_by_expert on (its own layout: _staged_once)
                    qc_ptr, qs_ptr, q_cols, q_by_expert,
                    P, PAIRS, D, I, I_S, IW, E, stride_x, swn, ssn, s_swn, s_ssn, limit,  # PAIRS: per program
                    FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr,
                    S_FMT: tl.constexpr, S_BO: tl.constexpr, S_BI: tl.constexpr, S_WDT: tl.constexpr,
                    ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr,
                    W_ALIGN: tl.constexpr,
                    HAS_LIMIT: tl.constexpr, APPLY_W: tl.constexpr, X_BF16: tl.constexpr, HAS_SHARED: tl.constexpr,
                    PRESTAGED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    gate_up_program(tl.program_id(0), tl.program_id(1), tl.num_programs(1), x_ptr, tab_ptr, stab_ptr, e_ptr, row_ptr,
                    pw_ptr, first_ptr, end_ptr, h_ptr, qc_ptr, qs_ptr, q_cols, q_by_expert, P, PAIRS, D, I, I_S, IW, E,
                    stride_x, swn, ssn, s_swn, s_ssn, limit, FMT, BO, BI, WDT, S_FMT, S_BO, S_BI, S_WDT, ACT_BLOCK,
                    X_PARTS, DOT_BF16, NATIVE, W_ALIGN, HAS_LIMIT, APPLY_W, X_BF16, HAS_SHARED, PRESTAGED, BM, BN, BK)


@device_function
def _down_group(h_ptr, base, pw_ptr, o_ptr, row0, qc, qs, q_cols, p, end, tile, I, IW, D, stride_wn, stride_sn,
                FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr, ACT_BLOCK: tl.constexpr,
                X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr, W_ALIGN: tl.constexpr,
                APPLY_W: tl.constexpr, X_BF16: tl.constexpr, PRESTAGED: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    """Down of one expert group (I intermediate inputs of rows IW wide) for its pairs [p, end): outputs per
    pair (values of x's dtype) at o's row pair - row0 (rows D apart); in the checkpoint's formats
    through the group's scratch or the launch's staged rows of h, as `_up_group`; `tile`: the N tile."""
    a2 = tl.load(base + 4)
    offs_n = tile * BN + tl.arange(0, BN)
    n_mask = offs_n < D
    w2_rows = tl.multiple_of(a2.to(tl.pointer_type(WDT)), W_ALIGN) + offs_n.to(tl.int64) * stride_wn
    s2_rows = tl.load(base + 5).to(tl.pointer_type(tl.uint8)) + (offs_n // BO).to(tl.int64) * stride_sn
    for r0 in range(p, end, BM):
        prs = r0 + tl.arange(0, BM)
        pm = prs < end
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if a2 != 0:
            if NATIVE > 0 and ACT_BLOCK >= 32 and FMT > 0:
                if PRESTAGED:
                    qrows = tl.where(pm, prs, 0).to(tl.int64)
                else:
                    stage_rows(h_ptr, prs, pm, I, IW, qc, qs, q_cols, FMT, NATIVE, ACT_BLOCK, BM, BK)
                    qrows = tl.arange(0, BM).to(tl.int64)
                acc = staged_product(w2_rows, s2_rows, n_mask, qc, qs, qrows, I, q_cols, acc, FMT, BI, ACT_BLOCK,
                                     NATIVE, BM, BN, BK)
            else:
                for k0 in range(0, I, BK):
                    a = act_tile(h_ptr, prs, pm, k0, I, IW, 0, BM, BK)
                    acc = weight_product(w2_rows, s2_rows, n_mask, a, k0, I, acc, FMT, BI, ACT_BLOCK, X_PARTS,
                                         DOT_BF16, NATIVE, BM, BN, BK)
        o = round_out(acc, X_BF16).to(tl.float32)
        if APPLY_W == 2:  # o * weight in x's dtype
            pw = tl.load(pw_ptr + prs, mask=pm, other=0.0)
            if X_BF16:
                o = bf16_rne(o * bf16_rne(pw).to(tl.float32)[None, :]).to(tl.float32)
            else:
                o = o * pw[None, :]
        tl.store(o_ptr + (prs[None, :] - row0).to(tl.int64) * D + offs_n[:, None], o,
                 mask=n_mask[:, None] & pm[None, :])


@device_function
def _shared_codes(qc_ptr, qs_ptr, KQ, first, ACT_BLOCK: tl.constexpr):
    """The staged codes and powers of two of the shared expert's rows (`_staged_once`): from row `first`."""
    first = first.to(tl.int64)
    return qc_ptr + first * KQ, qs_ptr + first * (KQ // ACT_BLOCK)


@device_function
def _row_sums(o_ptr, pos_ptr, rs_ptr, counter, M, K, D, programs, tile, BN: tl.constexpr):
    """A program's count-in for its N tile `tile` (one of `programs`); the tile's last program to count in adds
    each row m's pairs' outputs (rows pos[m] of o, in expert order: the combine's `output_row`) at the tile's
    columns into rs's row m, float32, and resets the count."""
    tl.debug_barrier()  # the program's stores precede its count-in
    if tl.atomic_add(counter, 1, sem="acq_rel") == programs - 1:
        cols = tile * BN + tl.arange(0, BN)
        cmask = cols < D
        for m in range(M):
            y = output_row((o_ptr,), 0, pos_ptr, (o_ptr,), m, K, 0, cols, cmask, D, 1, 1, True, False, False, False,
                           False)
            tl.store(rs_ptr + m * D + cols, y, mask=cmask)
        tl.atomic_xchg(counter, 0)  # ready for the next launch (a graph replays this one)


@device_function
def down_program(pid, tile, programs, tiles, h_ptr, tab_ptr, stab_ptr, e_ptr, pw_ptr, first_ptr, end_ptr, o_ptr,
                 os_ptr, OS_ROW, rs_ptr, pos_ptr, cnt_ptr, M, K, pub_mine, pub_flags, pub_rank, pub_capacity, qc_ptr,
                 qs_ptr, q_cols, q_by_expert, P, PAIRS, I, I_S, IW, D, E, swn, ssn, s_swn, s_ssn, FMT: tl.constexpr,
                 BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr, S_FMT: tl.constexpr, S_BO: tl.constexpr,
                 S_BI: tl.constexpr, S_WDT: tl.constexpr, ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr,
                 DOT_BF16: tl.constexpr, NATIVE: tl.constexpr, W_ALIGN: tl.constexpr, APPLY_W: tl.constexpr,
                 X_BF16: tl.constexpr, HAS_SHARED: tl.constexpr, S_PARTIAL: tl.constexpr, PRESTAGED: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROW_SUMS: tl.constexpr,
                 PUBLISH: tl.constexpr):
    """Pair program `pid` (of `programs`) at N tile `tile` (of `tiles`): its groups' down products, the rows'
    sums and the publish (`_down_kernel`'s arguments)."""
    if PUBLISH:  # the rows that travel go to the slot of this rank's next call
        c, base = publish_slot(pub_mine, pub_rank, pub_capacity)
        rs_ptr += base
        if S_PARTIAL:
            os_ptr += base
    for p in range(pid * PAIRS, tl.minimum(P, (pid + 1) * PAIRS)):
        if tl.load(first_ptr + p) == p:
            end, e, qc, qs = _group_at(p, pid, tile, tiles, e_ptr, end_ptr, qc_ptr, qs_ptr, q_cols, q_by_expert,
                                       PRESTAGED, BM)
            if e < E:
                _down_group(h_ptr, tab_ptr + e * 6, pw_ptr, o_ptr, 0, qc, qs, q_cols, p, end, tile, I, IW, D, swn,
                            ssn, FMT, BO, BI, WDT, ACT_BLOCK, X_PARTS, DOT_BF16, NATIVE, W_ALIGN, APPLY_W, X_BF16,
                            PRESTAGED, BM, BN, BK)
            elif HAS_SHARED:
                if PRESTAGED:
                    qc, qs = _shared_codes(qc_ptr, qs_ptr, q_cols, q_by_expert, ACT_BLOCK)
                _down_group(h_ptr, stab_ptr, pw_ptr, os_ptr, OS_ROW, qc, qs, q_cols, p, end, tile, I_S, IW, D,
                            s_swn, s_ssn, S_FMT, S_BO, S_BI, S_WDT, ACT_BLOCK, X_PARTS, DOT_BF16, NATIVE, W_ALIGN, 0,
                            X_BF16 and not S_PARTIAL, PRESTAGED, BM, BN, BK)
    if ROW_SUMS:
        _row_sums(o_ptr, pos_ptr, rs_ptr, cnt_ptr + tile, M, K, D, programs, tile, BN)
    if PUBLISH:
        rank_publish(pub_mine, pub_flags, pub_rank, c, programs * tiles, PUBLISH)


@triton.jit(do_not_specialize=["P", "M"])
def _down_kernel(h_ptr,      # [P, IW] SwiGLU activations per pair (x's dtype), contiguous
                 tab_ptr, stab_ptr, e_ptr, pw_ptr, first_ptr, end_ptr,  # as for _gate_up_kernel
                 o_ptr,      # out [P, D] float32 or (a long call) x's dtype: each pair's expert output (its values)
                 os_ptr, OS_ROW,  # out: the shared expert's rows, pair p at os's row p - OS_ROW
                 rs_ptr, pos_ptr, cnt_ptr, M, K,  # ROW_SUMS: out float32 [M, D] each row's routed pairs' sum (pairs
                                                  # pos [M, K] in expert order), counters [N tiles]
                 pub_mine, pub_flags, pub_rank, pub_capacity,  # PUBLISH: kernels/rank_sum.py Publish.check's
                 qc_ptr, qs_ptr, q_cols, q_by_expert,  # scratch, as for _gate_up_kernel (of h)
                 P, PAIRS, I, I_S, IW, D, E, swn, ssn, s_swn, s_ssn,  # PAIRS: pairs per program
                 FMT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, WDT: tl.constexpr,
                 S_FMT: tl.constexpr, S_BO: tl.constexpr, S_BI: tl.constexpr, S_WDT: tl.constexpr,
                 ACT_BLOCK: tl.constexpr, X_PARTS: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr,
                 W_ALIGN: tl.constexpr, APPLY_W: tl.constexpr, X_BF16: tl.constexpr, HAS_SHARED: tl.constexpr,
                 S_PARTIAL: tl.constexpr,  # the shared expert is this rank's slice: its sum stays float32
                 PRESTAGED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 ROW_SUMS: tl.constexpr,
                 PUBLISH: tl.constexpr,  # ranks (with ROW_SUMS): rs (and a split shared expert's os) this rank's
                 PDL: tl.constexpr):     # symmetric buffer, published to them (0: not)
    dependent_launch(PDL)
    down_program(tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1), h_ptr, tab_ptr, stab_ptr,
                 e_ptr, pw_ptr, first_ptr, end_ptr, o_ptr, os_ptr, OS_ROW, rs_ptr, pos_ptr, cnt_ptr, M, K, pub_mine,
                 pub_flags, pub_rank, pub_capacity, qc_ptr, qs_ptr, q_cols, q_by_expert, P, PAIRS, I, I_S, IW, D, E,
                 swn, ssn, s_swn, s_ssn, FMT, BO, BI, WDT, S_FMT, S_BO, S_BI, S_WDT, ACT_BLOCK, X_PARTS, DOT_BF16,
                 NATIVE, W_ALIGN, APPLY_W, X_BF16, HAS_SHARED, S_PARTIAL, PRESTAGED, BM, BN, BK, ROW_SUMS, PUBLISH)


@triton.jit
def _step_kernel(r, u, d,  # the router's, gate and up's, and down's arguments (their Phase's args)
                 cnt_ptr, cnt0,  # int32 counters: the phases' from cnt0 on (kernels/phases.py), the router's and the
                                 # rows' sums' before
                 RP, RT, UP, UT, DP, DT,  # the router's programs and tiles; gate and up's, down's pair programs, tiles
                 RC: tl.constexpr, UC: tl.constexpr, DC: tl.constexpr,  # their constexprs (`in_order`)
                 PDL: tl.constexpr):
    """A decode step's MoE in one launch (`_experts` with the router's Phase): the router's programs, then gate
    and up's, then down's, each phase waiting in the kernel for the one before (kernels/phases.py)."""
    dependent_launch(PDL)
    phased = cnt_ptr + cnt0
    t = phase_ticket(phased)
    if t < RP:
        route_program(t, 0, RT, 1, *r, *RC)
        phase_done(phased, 0, RP, 2)
    elif t < RP + UP * UT:
        phase_wait(phased, 0, RP)
        v = t - RP
        gate_up_program(v // UT, v % UT, UT, *u, *UC)
        phase_done(phased, 1, UP * UT, 2)
    else:
        phase_wait(phased, 1, UP * UT)
        v = t - RP - UP * UT
        down_program(v // DT, v % DT, DP, DT, *d, *DC)
        phase_done(phased, 2, DP * DT, 2)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(o_parts,     # [P, D] outputs per pair: WORLD float32 partials (a tuple), or one in x's dtype
                    s_parts,     # the shared expert's rows (row m's at row SH0 + m): o's where S_WORLD > 1, else
                                 # s_parts' one tensor (any float dtype)
                    pos_ptr,     # int64 [M, K]: row m's pairs, in increasing expert id
                    X_ptr, post_ptr, comb_ptr,  # the streams [M, hc, D] and the site's expand coefficients
                    y_ptr,       # out [M, hc, D] in X's dtype; PAIRS: float32 rows YS apart
                    M, D, K, hc, SH0, YS, flags, rank, capacity,  # o's Publish (rank_sum.py arrival_args; WAIT)
                    WORLD: tl.constexpr, S_WORLD: tl.constexpr,  # S_WORLD > 1: s_parts are o_parts
                    HAS_SHARED: tl.constexpr,
                    S_ROUND: tl.constexpr,  # the shared expert's row is a sum of ranks' partials: round it
                    PAIRS: tl.constexpr,  # store a row's pairs' sum as is (else the shared expert and the expand)
                    X_BF16: tl.constexpr, BHC: tl.constexpr, BD: tl.constexpr, WAIT: tl.constexpr,
                    PDL: tl.constexpr):
    dependent_launch(PDL)
    base = rank_arrive(flags, rank, capacity, WAIT, WORLD)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < D
    y = output_row(o_parts, base, pos_ptr, s_parts, m, K, SH0, cols, cmask, D, WORLD, S_WORLD, True,
                   HAS_SHARED and not PAIRS, S_ROUND, not PAIRS, X_BF16)
    if PAIRS:
        tl.store(y_ptr + m * YS + cols, y, mask=cmask)
    else:
        expand_tile(y, X_ptr, post_ptr, comb_ptr, y_ptr, m, cols, cmask, D, hc, X_BF16, BHC, BD)


def pairs_per_program(n_pairs: int) -> int:
    """Pairs each program of the expert kernels walks (their group leaders work, the others return): one on a
    device, a program per pair; all of them under the interpreter, which pays per program."""
    return n_pairs if INTERPRET else 1


def _scratch(native: int, experts: int, programs: int, tiles: int, bm: int, k: int, x: torch.Tensor):
    """(codes, scales, columns, by expert) of an expert kernel's scratch where the rows are staged
    (rows.stage_rows): an area of `bm` rows' `k` columns per N tile and per expert group (the shared
    expert's last) or per program along the pairs, whichever is fewer (each group is one expert's, worked by
    one program): a decode step's few pairs take a few areas, a prefill chunk's at most one per expert (V4.1
    over 4 ranks on the block-scaled MMA: 257 x 4 x 16 x 4096 bytes for gate and up). Dummies otherwise."""
    if not native:
        return x, x, 0, 0
    areas = min(experts + 1, programs)
    return (*stage_scratch(areas * tiles, bm, k, x.device), k, int(areas == experts + 1))


def _staged_once(t: torch.Tensor, rows: int, formats: tuple[int, int], native: int, act_block: int, bk: int):
    """(codes, powers of two, columns, the shared expert's first row): the `rows` rows of t [rows, K]
    quantized once for a long call's expert launch (rows.stage_launch) in the routed experts' format's layout,
    and again after them in the shared expert's (`formats`) where the layouts differ (FP4's re-encoded
    column order on the e4m3 MMA beside FP8); 0 where they do not."""
    qc, qs, kq = stage_launch(t, t, 0.0, False, formats[0], native, act_block, rows, bk)
    if native != NATIVE_E4M3 or (formats[0] == linear.FMT_FP4) == (formats[1] == linear.FMT_FP4):
        return qc, qs, kq, 0
    sqc, sqs, _ = stage_launch(t, t, 0.0, False, formats[1], native, act_block, rows, bk)
    return torch.cat((qc, sqc)), torch.cat((qs, sqs)), kq, qc.numel() // kq


def fast_ffn(x: torch.Tensor, gate: PackedWeight, bias: torch.Tensor | None, top_k: int, score_func: str,
             route_scale: float, norm_eps: float, hash_idx: torch.Tensor | None, experts, shared,
             act_block: int | None, limit: float, weight_before_w2: bool, X: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor, reduce=None, pending: bool = False):
    """The kernels for `reference_ffn` (same signature; results within the stated tolerances): four launches, a
    decode step's two (the router and the experts' in one: `_step_kernel`); `pending`, one where the call is a
    decode step's: its output a `Pending` (the combine left to the site
    that reads the streams next, kernels/mhc.py fast_expand_pre), otherwise the streams as without it. Expert
    parallel (`reduce`): an object with `sum_produced(shape, produce, consume)` (every rank's float32 partials of
    what `produce` makes, in rank order, given to `consume`, which adds them in that order where it loads them: the
    same bits on every rank, whatever the batch; over symmetric memory the down kernel publishes them:
    parallel/sharding.py Comm.sum_produced) and `shared_split` (this rank holds a slice of the shared expert's
    intermediate, not all of it); the reference form calls it as `reduce(outputs, shared64)`. In a decode step's
    call the down launch sums each row's routed pairs in expert order on every rank (`_row_sums_into`), and those
    rows (with a split shared expert's partial rows) are summed over ranks, one collective, as the combine loads
    them: associated by rank, within float32 rounding of one rank's (whole experts: each rank's sum over the
    pairs of its experts), two rows a token over the links where every pair's partial made seven. A long call
    (`reduce.share(rows)`: a prefill chunk) sums each row's pairs on their rank first, then the ranks' sums by
    rows (`_combined_by_shares`), as associated; it takes the shared expert whole for its rows (`_own_shared`).
    A decode step's split shared expert leaves its partial unrounded, the fixed-order sum rounded in the
    combine (within float32 rounding of one rank's)."""
    require_dtype(x, "x", (torch.float32, torch.bfloat16))
    require(x.dim() == 2, "x.dim()", x.dim(), "must be 2 ([M, D])")
    m, d = x.shape
    require(gate.format == "dense", "gate.format", gate.format, "must be dense")
    e, gd = gate.shape
    require(gd == d, "gate.shape", gate.shape, f"must be [E, {d}]")
    require(score_func in router.SCORES, "score_func", score_func, f"must be one of {', '.join(router.SCORES)}")
    require(1 <= top_k <= min(e, 64), "top_k", top_k, f"must be in 1..{min(e, 64)}")
    require(e <= 4096, "experts", e, "must be <= 4096")
    require(len(experts) == e, "experts", len(experts), f"must be one per gate row ({e})")
    if bias is not None:
        require(tuple(bias.shape) == (e,), "bias.shape", tuple(bias.shape), f"must be {(e,)}")
    if hash_idx is not None:
        require(tuple(hash_idx.shape) == (m, top_k), "hash_idx.shape", tuple(hash_idx.shape), f"must be {(m, top_k)}")
    share = reduce.share(m) if reduce is not None else None  # a long call's: X holds the share's rows
    held = m if share is None else share[2] - share[1]
    require(X.dim() == 3 and X.shape[0] == held and X.shape[2] == d and X.dtype == x.dtype, "X",
            f"{tuple(X.shape)} {X.dtype}", f"must be [{held}, hc, {d}] {x.dtype}")
    table = expert_table(experts, experts)
    require(table.d == d, "x.shape[1]", d, f"must equal the experts' input size {table.d}")
    ab = check_act_block(act_block, d)
    if ab:
        check_act_block(ab, table.i)
    st = expert_table([shared], shared) if shared is not None else None
    if st is not None:  # its intermediate size may differ: a rank's split of it
        require(st.d == table.d, "shared", (st.i, st.d), f"must take the routed experts' input size {table.d}")
        if ab:
            check_act_block(ab, st.i)
    dev = device_of(x, gate.data, table.table, X, post, comb)
    native = _native(dev, ab, min(table.align, st.align)) if st is not None and reduce is None else 0
    if native and is_long(product_rows(native, True)):  # a long call's experts' launches, one device's
        reduce, share = _ALONE, _ALONE.share(m)
    split = reduce is not None and st is not None and reduce.shared_split  # its partial: unrounded, summed
    own = shared is not None and share is not None  # a long call's rows take it whole (`_own_shared`)
    whole = (reduce.whole_shared if split else shared) if own else None
    shared, st, split = (None, None, False) if own else (shared, st, split)
    if x.stride(-1) != 1:
        x = x.contiguous()
    X, post, comb = X.contiguous(), post.contiguous(), comb.contiguous()
    weights = torch.empty((m, top_k), dtype=torch.float32, device=dev)
    idx = torch.empty((m, top_k), dtype=torch.int64, device=dev)
    if m == 0:
        return torch.empty_like(X), weights, idx
    # (1) router and routing, the pairs sorted by expert
    n_pairs = m * top_k + (m if shared is not None else 0)
    pair, pos, route = router.fast(x, gate, bias, top_k, score_func, route_scale, norm_eps, hash_idx, weights, idx,
                                   shared is not None, hold=share is None and not separate_phases())
    # (2, 3) the experts
    o, o_shared, os_row, sent = _pair_outputs(x, top_k, shared is not None, share, reduce)
    experts_into = functools.partial(_experts, x, e, table, st, pair, n_pairs, ab, limit, weight_before_w2,
                                     route=route)
    if share is not None:  # a long call: each rank sums and combines its share of the rows
        experts_into(o, o_shared, os_row, split)
        rows = _own_shared(x, share, whole, ab, limit, weight_before_w2) if own else None
        out = torch.empty_like(X)
        _combined_by_shares(o, rows, sent, pos, X, post, comb, out, reduce, share)
        return out, weights, idx
    # (4) the sum in expert order, the shared expert, the expand
    combine = functools.partial(_combine, X=X, post=post, comb=comb, out=None, pending=pending)
    if reduce is None:
        experts_into(o, o_shared, os_row, split)
        return combine([o], pos, has_shared=shared is not None, split=False), weights, idx
    # with ranks, each row's routed pairs summed on every rank by the down launch (and a split shared expert's
    # partial row after them) travel, added in rank order as the combine loads them: each row then one pair
    rows = m * (2 if split else 1)
    one = unit_rows(dev, m)
    out = reduce.sum_produced((rows, d), lambda to: _row_sums_into(experts_into, o, pos, rows, split, to),
                              lambda parts: combine(parts, one, has_shared=shared is not None, split=split,
                                                    shared=None if split or shared is None else o[m * top_k:]))
    return out, weights, idx


def _row_sums_into(experts_into, o: torch.Tensor, pos: torch.Tensor, rows: int, split: bool,
                   to: rank_sum.Publish | None) -> torch.Tensor:
    """(2, 3) of a decode step's call with ranks, its sum's producer (Comm.sum_produced): the pairs' outputs
    into o, and what travels into `rows` rows returned: each row's routed pairs summed (the down launch), then a
    split shared expert's partial rows; into this rank's symmetric buffer where `to` (a view of its first slot:
    the kernel writes the call's slot and publishes it; the consumer waits on `to`), else a new tensor. A
    replicated shared expert's rows stay in o, after the routed pairs."""
    p, d = o.shape
    sent = (torch.empty((rows, d), dtype=torch.float32, device=o.device) if to is None else
            to.buffer[:rows * d].view(rows, d))
    experts_into(o, sent if split else o, p - rows if split else 0, split, to, (sent, pos))
    return sent


def unit_rows(dev: torch.device, m: int) -> torch.Tensor:
    """int64 [m, 1] of 0..m-1 (a view: no launch in a captured cycle): the pairs of a combine whose row m is
    its only pair, row m. One tensor per device and power-of-two size, kept for the process (a graph may hold
    its address)."""
    key = (dev.type, dev.index, max(64, pow2(m)))
    if key not in _UNIT_ROWS:
        _UNIT_ROWS[key] = torch.arange(key[2], dtype=torch.int64, device=dev)
    return _UNIT_ROWS[key][:m].view(m, 1)


_UNIT_ROWS: dict = {}


def _native(dev: torch.device, ab: int, align: int) -> int:
    """How the experts' products multiply (_triton.native_products): FP8/FP4 weights (aligned: whole-vector
    loads; the interpreter has no vectors) with quantized rows in their own formats, else 0."""
    return native_products(dev) if ab >= 32 and (align == 16 or INTERPRET) else 0


# A long call on one device (fast_ffn's reduce), as a world of one whose share is every row: its shared expert
# takes launches of its own (`_own_shared`) as on each rank of a split, so no long call's gate-and-up holds an
# expert's and the shared expert's weights both (that launch spills at 256-deep K tiles on sm_103).
_ALONE = types.SimpleNamespace(world=1, shared_split=False, share=lambda rows: (rows, 0, rows),
                               exchange=lambda t: t)


def _experts(x, e, table, st, pair, n_pairs, ab, limit, weight_before_w2, o, o_shared, os_row, split,
             to: rank_sum.Publish | None = None, sums: tuple | None = None, route: Phase | None = None) -> None:
    """(2, 3) of fast_ffn, gate and up then down, of `pair` (expert, row, weight, group's first and end pair;
    sorted by group, the shared expert's, `st`, id e): outputs at o's row or (shared) o_shared's pair - os_row;
    `sums` (rs [M, D] float32, pos [M, K]): each row's routed pairs also summed into rs by the down launch;
    `to` (with `sums`): rs (and a split shared expert's o_shared) is this rank's symmetric buffer, published.
    `route`: the router's launch held (router.fast `hold`): one launch of the three (`_step_kernel`), else two."""
    (d, dev), (pe, pr, pw, first, end) = (x.shape[1], x.device), pair
    i, i_s = table.i, st.i if st is not None else table.i
    iw = max(i, i_s)
    align = min(table.align, st.align if st is not None else 16)
    native = _native(dev, ab, align)
    bm = product_rows(native, bool(native))
    prestaged = is_long(bm)  # a long call: x and h staged once (rows.stage_launch), every expert reads them
    # a long call's on the block-scaled MMA 256 deep: 0.6x the main loop's issue a weight element of 128 (the
    # compile check; 2 pipeline stages, 3 spill)
    long_block_scaled = prestaged and native == NATIVE_BLOCK_SCALED
    if INTERPRET:
        bk2 = max(min(pow2(max(d, iw)), 256), ab, 32)
        bn_up, bn_down = min(pow2(iw), 128), min(pow2(d), 128)
    else:
        bk2 = max((256 if long_block_scaled else 128) if native else 64, ab)
        if native:  # 128 outputs a tile, the block-scaled MMA's M side; 256 on the e4m3 MMA (as linear.plan),
            # there over 8 warps and 2 pipeline stages (4 warps, or 3 stages, spill)
            bn_up = bn_down = 256 if native == NATIVE_E4M3 and not prestaged else 128
        else:  # bfloat16 products from registers: a 128-deep K tile (ACT_BLOCK 128) spills at 32 outputs
            bn_up, bn_down = (32, 32) if bk2 == 64 else (16, 16)
    per_program = pairs_per_program(n_pairs)
    xb = x.dtype == torch.bfloat16
    parts = 3 if not ab and not xb else 1  # float32 activations: three exact bfloat16 parts
    dot_bf16 = not INTERPRET  # expert weights are FP8 / FP4: bfloat16 values
    s_up = st.up if st is not None else table.up
    s_down = st.down if st is not None else table.down
    common = dict(ACT_BLOCK=ab, X_PARTS=parts, DOT_BF16=dot_bf16, NATIVE=native, W_ALIGN=align, X_BF16=xb,
                  HAS_SHARED=st is not None, PRESTAGED=prestaged, BM=bm, BK=bk2)
    # a long call's gate and up (two accumulators of 128 x 128 rows) spill at 4 warps
    shape = dict(num_warps=4 if native == NATIVE_BLOCK_SCALED and not prestaged else 8,
                 num_stages=2 if native == NATIVE_E4M3 or long_block_scaled else 3)
    # staged whole (PRESTAGED), h's columns past a narrower group's I must read as zeros (none where I = I_S)
    h = (torch.zeros if prestaged and i != i_s else torch.empty)((n_pairs, iw), dtype=x.dtype, device=dev)
    stab = st.table if st is not None else table.table
    programs = triton.cdiv(n_pairs, per_program)
    q_up = (_staged_once(x, x.shape[0], (table.up[2], s_up[2]), native, ab, bk2) if prestaged else
            _scratch(native, e, programs, triton.cdiv(iw, bn_up), bm, triton.cdiv(d, bk2) * bk2, x))
    up = Phase((programs, triton.cdiv(iw, bn_up)), (
        x, table.table, stab, pe, pr, pw, first, end, h, *q_up, n_pairs, per_program, d, i, i_s, iw, e, x.stride(0),
        *table.up[:2], *s_up[:2], float(limit)), dict(
        FMT=table.up[2], BO=table.up[3], BI=table.up[4], WDT=table.wdt_up, S_FMT=s_up[2], S_BO=s_up[3], S_BI=s_up[4],
        S_WDT=st.wdt_up if st is not None else table.wdt_up, HAS_LIMIT=limit > 0, APPLY_W=1 if weight_before_w2 else 2,
        BN=bn_up, **common))
    if route is None:
        _gate_up_kernel[up.grid](*up.args, **up.constexprs, **shape, **pdl(dev))
    q_down = (_staged_once(h, n_pairs, (table.down[2], s_down[2]), native, ab, bk2) if prestaged else
              _scratch(native, e, programs, triton.cdiv(d, bn_down), bm, triton.cdiv(iw, bk2) * bk2, x))
    pub, world = to.check(sums[0].numel()) if to is not None else ((h, (h,), 0, 0), 0)
    rs, pos = sums if sums is not None else (o, pe.view(-1, 1))  # without sums: placeholders, never read
    tiles = triton.cdiv(d, bn_down)
    down = Phase((programs, tiles), (
        h, table.table, stab, pe, pw, first, end, o, o_shared, os_row, rs, pos, counters(dev, tiles), pos.shape[0],
        pos.shape[1], *pub, *q_down, n_pairs, per_program, i, i_s, iw, d, e, *table.down[:2], *s_down[:2]), dict(
        FMT=table.down[2], BO=table.down[3], BI=table.down[4], WDT=table.wdt_down, S_FMT=s_down[2], S_BO=s_down[3],
        S_BI=s_down[4], S_WDT=st.wdt_down if st is not None else table.wdt_down,
        APPLY_W=1 if weight_before_w2 else 2, S_PARTIAL=split, BN=bn_down, ROW_SUMS=sums is not None,
        PUBLISH=world, **common))
    if route is None:
        _down_kernel[down.grid](*down.args, **down.constexprs, **shape, **pdl(dev))
        return
    # a decode step's: the router, gate and up, down in one launch, each phase waiting for the one before (h
    # in scratch per program: nothing staged between the phases)
    rt = route.grid[0] // route.constexprs["SPLIT"]
    held = max(rt + 1, tiles)  # the router's and the row sums' counters, then the phases'
    _step_kernel[(sum(p.grid[0] * p.grid[1] for p in (route, up, down)),)](
        route.args, up.args, down.args, counters(dev, held + 4), held, route.grid[0], rt, *up.grid, *down.grid,
        RC=in_order(route_program, route.constexprs), UC=in_order(gate_up_program, up.constexprs),
        DC=in_order(down_program, down.constexprs), **shape, **pdl(dev))


def _own_shared(x, share, whole, ab, limit, weight_before_w2) -> torch.Tensor:
    """The shared expert, whole, of a long call's share of the rows (not a split's partial of every row):
    [rows, D] in x's dtype, one device's. Its launches are the routed experts' with its own table as their
    one expert (its formats their constexprs): its pairs one group, rows lo.., each weighing 1 (exact)."""
    (lo, hi), dev = share[1:], x.device
    rows = torch.empty((hi - lo, x.shape[1]), dtype=x.dtype, device=dev)
    if hi > lo:
        z = torch.zeros(hi - lo, dtype=torch.int64, device=dev)
        pairs = (z, torch.arange(lo, hi, device=dev), torch.ones(hi - lo, device=dev), z, z + hi - lo)
        _experts(x, 1, expert_table([whole], whole), None, pairs, hi - lo, ab, limit, weight_before_w2, rows, rows,
                 0, False)
    return rows


def _pair_outputs(x: torch.Tensor, top_k: int, has_shared: bool, share, reduce):
    """(o, the shared expert's rows, the pair of their first, what a long call sends): a decode step's pairs
    float32 (summed over ranks so), the shared rows after them; a long call's in x's dtype (their values'; its
    shared expert apart: `_own_shared`), and the float32 rows of each row's pairs' sum it sends."""
    m, d = x.shape
    if share is None:
        o = torch.empty((m * (top_k + has_shared), d), dtype=torch.float32, device=x.device)
        return o, o, 0, None
    o = torch.empty((m * top_k, d), dtype=x.dtype, device=x.device)
    sent = torch.empty((reduce.world * share[0], d), dtype=torch.float32, device=x.device)
    return o, o, m * top_k, sent


class Pending(NamedTuple):
    """A decode step's MoE output not yet combined and added to the streams (fast_ffn `pending`): the site
    that reads the streams next takes it (kernels/mhc.py fast_expand_pre(y, X, post, comb, ...))."""

    y: Combine
    X: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor

    def rows(self, sl: slice) -> "Pending":
        """The rows `sl` (consecutive) of it: the rows a head reads (a step's last, a draft's first k)."""
        start, _, step = sl.indices(self.X.shape[0])
        require(step == 1, "rows", sl, "must be consecutive")
        return Pending(self.y._replace(pos=self.y.pos[sl], sh0=self.y.sh0 + start), self.X[sl], self.post[sl],
                       self.comb[sl])


def _combine(parts: list[torch.Tensor], pos, X, post, comb, out: torch.Tensor | None, has_shared: bool, split: bool,
             shared: torch.Tensor | None = None, pending: bool = False) -> torch.Tensor | Pending:
    """(4) of fast_ffn: each row's pairs summed in expert order, its shared expert's row, the expand, into
    `out` (None: a new tensor), returned (`pending`: what it would add, for the next site's launch, and no
    output allocated: one never written would only hold memory). `parts`: the pairs' outputs
    [P, D], or every rank's float32 partials of them, added in rank order where they are loaded
    (kernels/rank_sum.py `rank_load`; `Partials`: waited for in the kernel); the shared expert's row m of
    `shared` [M, D] (any float dtype), by default row M K + m of the parts (summed over the ranks where `split`)."""
    m, hc, d = X.shape
    require_int32_rows(parts[0].shape[0], d, "pairs")
    s, sh0 = (parts, m * pos.shape[1]) if shared is None else ([shared], 0)
    if pending:
        return Pending(Combine(parts, pos, s if has_shared else None, sh0, split), X, post, comb)
    out = torch.empty_like(X) if out is None else out
    bd = min(pow2(d), 8192 if INTERPRET else 1024)
    wait, waits = rank_sum.arrival_args(parts)
    _combine_kernel[(m, triton.cdiv(d, bd))](tuple(parts), tuple(s[:1]), pos, X, post, comb, out, m, d, pos.shape[1],
                                             hc, sh0, d, *wait, WORLD=len(parts), S_WORLD=len(s), HAS_SHARED=has_shared,
                                             S_ROUND=split, PAIRS=False, X_BF16=X.dtype == torch.bfloat16,
                                             BHC=pow2(hc), BD=bd, WAIT=waits, **pdl(X.device))
    return out


def _pairs_sum(o: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
    """Each row's pairs of o [P, D] (pos [M, K]) summed in increasing expert id, in float32, into out's rows."""
    m, k = pos.shape
    d = o.shape[1]
    require_int32_rows(o.shape[0], d, "pairs")
    bd = min(pow2(d), 8192 if INTERPRET else 1024)
    if m:
        _combine_kernel[(m, triton.cdiv(d, bd))]((o,), (o,), pos, o, o, o, out, m, d, k, 1, 0, out.stride(0),
                                                 o, 0, 0, WORLD=1, S_WORLD=1, HAS_SHARED=False, S_ROUND=False,
                                                 PAIRS=True, X_BF16=False, BHC=1, BD=bd, WAIT=False, **pdl(o.device))


def _combined_by_shares(o, shared_rows, sent, pos, X, post, comb, out, reduce, share) -> None:
    """A long call's sum over ranks by rows: every rank sums each row's pairs it computed (its experts' or its
    share of every expert's; in increasing expert id, float32: `_pairs_sum`) into the rows it sends, [rows, D]:
    each rank gets its share of the rows, sums them in rank order as the combine loads them, adds its rows' shared
    expert, rounds and expands its rows' streams X (the caller holds the streams by rows and gathers the next
    sub-block's input). The routed sum is associated by rank, as the official code's all-reduce of each rank's
    experts' sum: within float32 rounding of one rank's, not its bits. A rank receives (ranks - 1) / ranks of
    one share's [rows, D], not every rank's partials of every pair. `share`: (rows a share is padded to, this
    rank's first row, its end); shared_rows: the share's rows of the shared expert, whole (`_own_shared`; None
    without one)."""
    m, (per, lo, hi), d = pos.shape[0], share, o.shape[1]
    world = reduce.world
    _pairs_sum(o, pos, sent[:m])
    if m < world * per:
        sent[m:].zero_()  # the padding rows' sums are dropped
    received = reduce.exchange(sent.view(world, per, d))  # [ranks, per, D]: every rank's sums of this rank's rows
    n = hi - lo
    if n:  # row i's pairs' sums at row i (added in rank order by the combine), its shared expert's row i of
        # shared_rows (in x's dtype)
        _combine([r[:n] for r in received], unit_rows(o.device, n), X, post, comb, out,
                 shared_rows is not None, False, shared_rows)

