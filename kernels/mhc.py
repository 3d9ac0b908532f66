"""Manifold-constrained hyper-connections (mHC): the residual is `hc` copies X [M, hc, D].

coeffs: from one site's parameters (fn [hc*(2+hc), hc*D], base, scale [3]) compute
    m = (fn . flatten(X)) * rsqrt(mean(X^2) + norm_eps)
    pre  = sigmoid(m[:hc] * scale0 + base[:hc]) + hc_eps
    post = 2 * sigmoid(m[hc:2hc] * scale1 + base[hc:2hc])
    comb = Sinkhorn(m[2hc:] * scale2 + base[2hc:] as hc x hc): row softmax + eps, column normalization,
           then (iters - 1) x (row, column) normalizations.
collapse: x = sum_j pre_j X_j.   expand: X'_k = post_k y + sum_j comb[j, k] X_j (comb transposed).
Reference: all interior arithmetic in float64, coefficients returned as float32, streams rounded once.

Kernels (`fast_coeffs`, `fast_head_pre`, `fast_collapse`, `fast_pre`, `fast_expand_pre`), float32 throughout
(the official code's float32 interior):
- coeffs / head pre: the projection fn . X and the sum of squares in fixed column chunks (from hc*D only),
  each chunk one program that walks the rows one at a time with the same tile shapes (a row's sums never
  share a reduction with another row), partials added in chunk order; then per row sigmoid, softmax and
  the Sinkhorn normalizations in float32. Tolerance: coefficients within 2^-16 of the largest (the
  projection's float32 sum over hc*D inputs, 2^-24 sqrt(hc*D) typical, through sigmoid and 20 Sinkhorn
  normalizations, which contract errors rather than grow them).
- collapse / expand: elementwise float32 accumulation over the hc copies in copy order (a few roundings:
  within hc 2^-23 of the largest term, plus one rounding of X's dtype).
- a sub-block's input (`fast_pre`): the coefficients, the collapse and the RMSNorm in one launch, each
  program a chunk of the columns of every copy; with the previous sub-block's expand in front
  (`fast_expand_pre`: each program expands the columns it projects, the ranks' partials added in rank order
  as it loads them, a MoE's pairs and shared expert as its combine adds them (`Combine`), and stores them
  for the collapse). A product's expand alone is its product's epilogue (`fast_product_expand`), the MoE's
  its combine's (kernels/moe.py; the same device functions) where no site takes it.
All batch invariant: no reduction mixes rows.
"""

from typing import NamedTuple

import torch

from . import linear, rank_sum
from ._triton import (
    INTERPRET,
    as_int64,
    counters,
    dependent_launch,
    device_function,
    device_of,
    pdl,
    pow2,
    require,
    require_dtype,
    require_int32_rows,
    require_rows,
    round_out,
    tl,
    tmax,
    triton,
    tsum,
)
from .linear import rows_matmul
from .rank_sum import rank_arrive, rank_load


class Combine(NamedTuple):
    """A MoE call's output before its combine (kernels/moe.py fast_ffn `pending`), as an expand's y: row m is
    its pairs' outputs (rows pos[m] of `parts`, every rank's float32 partials added in rank order, or one
    tensor) added in expert order, then its shared expert's row (row sh0 + m of `shared`, the rank-order sum
    of its partials, rounded to X's dtype where `s_round`), rounded to X's dtype."""

    parts: list
    pos: torch.Tensor  # int64 [M, K]
    shared: list | None
    sh0: int
    s_round: bool

    def reference(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows [M, D] in `dtype` with torch's float32 adds, in the kernels' order."""
        rank_sum.plain(self.parts, "Combine.parts")
        o = rank_sum.reference(list(self.parts))
        y = torch.zeros((self.pos.shape[0], o.shape[1]), dtype=torch.float32, device=o.device)
        for j in range(self.pos.shape[1]):
            y = y + o[self.pos[:, j]]
        if self.shared is not None:
            s = rank_sum.reference(list(self.shared), round_to=dtype if self.s_round else None)
            y = y + s[self.sh0:self.sh0 + y.shape[0]].float()
        return y.to(dtype)


def coeffs(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [M, hc, D] -> pre [M, hc], post [M, hc], comb [M, hc, hc] (float32).
    Bytes moved: X once + fn (hc*(2+hc) x hc*D float32)."""
    hc = X.shape[-2]
    v = X.flatten(-2).double()
    rho = torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    m = _project(v, fn) * rho
    m = m.float().double()  # the projection is an fp32 tensor in the official code
    s = scale.double()
    b = base.double()
    pre = torch.sigmoid(m[..., :hc] * s[0] + b[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
    c = (m[..., 2 * hc:] * s[2] + b[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.softmax(c, dim=-1).add_(hc_eps)
    c.div_(c.sum(-2, keepdim=True).add_(hc_eps))
    for _ in range(iters - 1):  # in place: a decode step runs this 20-iteration loop twice per layer
        c.div_(c.sum(-1, keepdim=True).add_(hc_eps))
        c.div_(c.sum(-2, keepdim=True).add_(hc_eps))
    return pre.float(), post.float(), c.float()


def head_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
             hc_eps: float) -> torch.Tensor:
    """V4's final `hc_head` collapse weights: pre = sigmoid(m * scale + base) + eps, no Sinkhorn."""
    v = X.flatten(-2).double()
    rho = torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    m = (_project(v, fn) * rho).float().double()
    return (torch.sigmoid(m * scale.double()[0] + base.double()) + hc_eps).float()


def _project(v: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """v [..., K] float64 @ fn [N, K]^T, each row summed the same way whatever the batch (rows_matmul)."""
    return rows_matmul(v.reshape(-1, v.shape[-1]), fn.double().t()).reshape(*v.shape[:-1], fn.shape[0])


def collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """X [M, hc, D], pre [M, hc] -> [M, D] in X.dtype."""
    return (pre.double().unsqueeze(-1) * X.double()).sum(-2).to(X.dtype)


def expand(y: torch.Tensor | list[torch.Tensor], X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
           ) -> torch.Tensor:
    """y [M, D] (sub-block output; or a list of the ranks' float32 partials of it, their rank-order sum rounded
    to X.dtype: kernels/rank_sum.py; or a MoE's `Combine`), X [M, hc, D] -> [M, hc, D] in X.dtype."""
    if isinstance(y, Combine):
        y = y.reference(X.dtype)
    elif isinstance(y, list):
        y = rank_sum.reference(y, X.dtype)
    mixed = torch.matmul(comb.double().transpose(-1, -2), X.double())
    return (post.double().unsqueeze(-1) * y.double().unsqueeze(-2) + mixed).to(X.dtype)


def expand_pre(y: torch.Tensor | list[torch.Tensor] | Combine, X: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor, weights: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor,
               scale: torch.Tensor, norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor,
               rms_eps: float, capture: bool | torch.Tensor = False, collapsed: torch.Tensor | None = None):
    """A sub-block's output expanded into the streams, then the next site's `pre` of them: X' = expand(y, X,
    post, comb) -> (X', x, pre, post', comb', the copies' mean if `capture`) (`pre`'s results after X'; no
    site, fn None: the collapse by `weights`, `pre`'s)."""
    Xn = expand(y, X, post, comb)
    return (Xn, *pre(Xn, weights, fn, base, scale, norm_eps, hc_eps, iters, norm_weight, rms_eps, capture,
                     collapsed))


# --- Triton kernels --------------------------------------------------------------------------------------


@triton.jit
def _project_kernel(x_ptr,     # streams X viewed [M, n] (n = hc*D; float32 / bfloat16), row stride stride_x
                    fn_ptr,    # float32 [J, n] projection, contiguous
                    part_ptr,  # float32 [S, M, J + 1]: per chunk, the J partial dots and the sum of squares
                    M, n, J, stride_x, chunk,  # chunk: inputs per program (a multiple of BC)
                    BJ: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    pid_s = tl.program_id(0)
    js = tl.arange(0, BJ)
    jmask = js < J
    c_lo = pid_s * chunk
    c_end = tl.minimum(n, c_lo + chunk)
    for m in range(M):  # one row at a time: the same tiles and reductions for every row
        dots = tl.zeros((BJ,), dtype=tl.float32)
        ss = tl.zeros((1,), dtype=tl.float32)
        for c0 in range(c_lo, c_end, BC):
            cols = c0 + tl.arange(0, BC)
            cmask = cols < c_end
            v = tl.load(x_ptr + as_int64(m) * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
            f = tl.load(fn_ptr + js[:, None] * n + cols[None, :], mask=jmask[:, None] & cmask[None, :], other=0.0)
            dots += tsum(f * v[None, :], axis=1)
            ss += tsum(v * v, axis=0)
        base = part_ptr + (pid_s * M + m).to(tl.int64) * (J + 1)
        tl.store(base + js, dots, mask=jmask)
        tl.store(base + J + tl.arange(0, 1), ss)


@device_function
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _coeffs_kernel(part_ptr,   # float32 [S, M, J + 1] from _project_kernel
                   base_ptr,   # float32 [J] base
                   scale_ptr,  # float32 [3] (coeffs) or [1] (head) scales
                   pre_ptr,    # float32 [M, hc] out
                   post_ptr,   # float32 [M, hc] out (coeffs only)
                   comb_ptr,   # float32 [M, hc, hc] out (coeffs only)
                   M, n, hc, iters,
                   norm_eps, hc_eps,  # float32
                   SPLITS: tl.constexpr, HEAD: tl.constexpr, BM: tl.constexpr, BHC: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    _site_coeffs(part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, rows, rows < M, M, n, hc, iters,
                 norm_eps, hc_eps, SPLITS, HEAD, BM, BHC)


def _coeffs(X, fn, base, scale, norm_eps, hc_eps, iters, head):
    require_dtype(X, "X", (torch.float32, torch.bfloat16))
    require(X.dim() == 3, "X.dim()", X.dim(), "must be 3 ([M, hc, D])")
    m, hc, d = X.shape
    n = hc * d
    j = hc if head else hc * (2 + hc)
    require(tuple(fn.shape) == (j, n), "fn.shape", tuple(fn.shape), f"must be {(j, n)}")
    require(tuple(base.shape) == (j,), "base.shape", tuple(base.shape), f"must be {(j,)}")
    require(scale.numel() >= (1 if head else 3), "scale.numel()", scale.numel(), "must be >= 3 (1 for the head)")
    for name, t in (("fn", fn), ("base", base), ("scale", scale)):
        require_dtype(t, name, (torch.float32,))
        require(t.is_contiguous(), f"{name}.stride", t.stride(), "must be contiguous")
    dev = device_of(X, fn, base, scale)
    x2 = X.reshape(m, n)
    require_rows(x2, "X")
    pre = torch.empty((m, hc), dtype=torch.float32, device=dev)
    post = torch.empty((m, hc), dtype=torch.float32, device=dev)
    comb = torch.empty((m, hc, hc), dtype=torch.float32, device=dev)
    if m == 0:
        return pre, post, comb
    bj = pow2(j)
    if INTERPRET:
        bc = min(pow2(n), 512)
        chunk = max(bc, pow2(n))
    else:  # ~2 programs per SM, each a contiguous slice of the hc*D inputs; depends on n only
        bc = 64
        chunk = triton.cdiv(triton.cdiv(n, 256), bc) * bc
    splits = triton.cdiv(n, chunk)
    part = torch.empty((splits, m, j + 1), dtype=torch.float32, device=dev)
    _project_kernel[(splits,)](x2, fn, part, m, n, j, x2.stride(0), chunk, BJ=bj, BC=bc, **pdl(x2.device))
    # one row per program on the GPU; the interpreter's reductions are numpy's, per element along one axis,
    # so several rows per program give each row the same sums there
    bm2 = min(pow2(m), 64) if INTERPRET else 1
    _coeffs_kernel[(triton.cdiv(m, bm2),)](part, base, scale, pre, post, comb, m, n, hc, iters, float(norm_eps),
                                           float(hc_eps), SPLITS=splits, HEAD=head, BM=bm2, BHC=pow2(hc),
                                           **pdl(part.device))
    return pre, post, comb


def fast_coeffs(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels for `coeffs` (same signature and result)."""
    require(iters >= 1, "iters", iters, "must be >= 1")
    return _coeffs(X, fn, base, scale, norm_eps, hc_eps, iters, head=False)


def fast_head_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                  hc_eps: float) -> torch.Tensor:
    """The kernels for `head_pre` (same signature and result)."""
    return _coeffs(X, fn, base, scale, norm_eps, hc_eps, 1, head=True)[0]


@triton.jit
def _collapse_kernel(x_ptr,    # X [M, hc, D] (float32 / bfloat16), contiguous
                     pre_ptr,  # float32 [M, hc]
                     y_ptr,    # out [M, D] in X's dtype
                     M, hc, D, OUT_BF16: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = rmask[:, None] & (cols[None, :] < D)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    for j in range(hc):
        p = tl.load(pre_ptr + rows * hc + j, mask=rmask, other=0.0)
        acc += p[:, None] * tl.load(x_ptr + (rows[:, None].to(tl.int64) * hc + j) * D + cols[None, :], mask=mask,
                                    other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], round_out(acc, OUT_BF16), mask=mask)


def fast_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The kernel for `collapse` (same signature and result)."""
    require_dtype(X, "X", (torch.float32, torch.bfloat16))
    require(X.dim() == 3, "X.dim()", X.dim(), "must be 3 ([M, hc, D])")
    m, hc, d = X.shape
    require(tuple(pre.shape) == (m, hc), "pre.shape", tuple(pre.shape), f"must be {(m, hc)}")
    require_dtype(pre, "pre", (torch.float32,))
    dev = device_of(X, pre)
    X, pre = X.contiguous(), pre.contiguous()
    y = torch.empty((m, d), dtype=X.dtype, device=dev)
    if m and d:
        bd = min(pow2(d), 8192 if INTERPRET else 1024)
        bm = max(1, min(pow2(m), 16384 // bd)) if INTERPRET else 1
        _collapse_kernel[(triton.cdiv(m, bm), triton.cdiv(d, bd))](X, pre, y, m, hc, d,
                                                                   OUT_BF16=X.dtype == torch.bfloat16, BM=bm, BD=bd,
                                                                   **pdl(X.device))
    return y


class _Front(NamedTuple):
    """An expand's inputs as its kernels take them: y's parts (a tuple), the wait for published partials
    (kernels/rank_sum.py arrival_args) and whether y is a sum to round, X, post, comb (contiguous); a
    `Combine`'s pairs (pos, K), its shared expert's parts and first row."""

    parts: tuple
    wait: tuple
    waits: bool
    y_round: bool
    X: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    pos: torch.Tensor | None = None
    k: int = 0
    shared: tuple | None = None
    sh0: int = 0
    s_round: bool = False


def _front(y: torch.Tensor | list[torch.Tensor] | Combine, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
           ) -> _Front:
    """`expand`'s arguments checked (fast_expand_pre)."""
    require_dtype(X, "X", (torch.float32, torch.bfloat16))
    require(X.dim() == 3, "X.dim()", X.dim(), "must be 3 ([M, hc, D])")
    m, hc, d = X.shape
    pairs = isinstance(y, Combine)
    parts = y.parts if pairs else y if isinstance(y, list) else [y]
    require(1 <= len(parts) <= rank_sum.MAX_WORLD, "len(y)", len(parts), f"must be 1..{rank_sum.MAX_WORLD} (ranks)")
    if pairs:
        require(y.pos.dim() == 2 and y.pos.shape[0] == m and y.pos.dtype == torch.int64, "y.pos",
                f"{tuple(y.pos.shape)} {y.pos.dtype}", f"must be [{m}, K] int64")
    rows = parts[0].shape[0] if pairs else m
    require_int32_rows(rows, d, "y rows")
    for r, p in enumerate(parts):
        require(tuple(p.shape) == (rows, d), f"y[{r}].shape", tuple(p.shape), f"must be {(rows, d)}")
        require_dtype(p, f"y[{r}]", (torch.float32,) if isinstance(y, list) or pairs else (torch.float32,
                                                                                            torch.bfloat16))
    require(tuple(post.shape) == (m, hc), "post.shape", tuple(post.shape), f"must be {(m, hc)}")
    require(tuple(comb.shape) == (m, hc, hc), "comb.shape", tuple(comb.shape), f"must be {(m, hc, hc)}")
    require_dtype(post, "post", (torch.float32,))
    require_dtype(comb, "comb", (torch.float32,))
    device_of(*parts, X, post, comb)
    wait, waits = rank_sum.arrival_args(parts)
    front = _Front(tuple(p.contiguous() for p in parts), wait, waits, isinstance(y, list) or pairs, X.contiguous(),
                   post.contiguous(), comb.contiguous())
    if not pairs:
        return front
    for r, p in enumerate(y.shared or ()):
        require(p.dim() == 2 and p.shape[0] >= y.sh0 + m and p.shape[1] == d, f"y.shared[{r}].shape", tuple(p.shape),
                f"must hold rows {y.sh0}..{y.sh0 + m - 1} of {d}")
    shared = None if y.shared is None else tuple(p.contiguous() for p in y.shared)
    return front._replace(pos=y.pos.contiguous(), k=y.pos.shape[1], shared=shared, sh0=y.sh0, s_round=y.s_round)


def product_expand(x: torch.Tensor, weight, act_block: int | None, X: torch.Tensor, post: torch.Tensor,
                   comb: torch.Tensor) -> torch.Tensor:
    """A sub-block's output projection added to the streams: expand(x W^T in X's dtype, X, post, comb)."""
    return expand(linear.reference(x, weight, act_block, X.dtype), X, post, comb)


def fast_product_expand(x: torch.Tensor, weight, act_block: int | None, X: torch.Tensor, post: torch.Tensor,
                        comb: torch.Tensor) -> torch.Tensor:
    """The kernel for `product_expand`: one launch of the linear kernel, the expand its output tiles'
    epilogue."""
    return linear.launch(x, [linear.Product(weight, act_block, X.dtype)], None, (X, post, comb))[0]


# --- a sub-block's input, fused ---------------------------------------------------------------------------


def pre(X: torch.Tensor, weights: torch.Tensor | None, fn: torch.Tensor | None, base: torch.Tensor | None,
        scale: torch.Tensor | None, norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor,
        rms_eps: float, capture: bool | torch.Tensor = False, collapsed: torch.Tensor | None = None):
    """What a sub-block reads from the streams X [M, hc, D]: the site's coefficients and its normed input.

    Coefficients: `coeffs` (iters >= 1), V4's `head_pre` (iters == 0: post and comb are None), or none (fn
    None: the final collapse of V4.1 by given weights). Input: rmsnorm(collapse(X, w)) in X.dtype, w =
    `weights` (V4.1's staggered sites collapse by the previous site's pre) or the site's own pre. `capture`:
    also the streams' mean over the copies (a DSpark input: float64, rounded once to X.dtype), returned, or
    written into the [M, D] view given (rows of any stride: the call's columns of DSpark's input). `collapsed`:
    a float32 [M, D] view (rows of any stride) the collapse is also written into, before the norm (DSpark's
    head: its confidence head's input).
    Returns (x [M, D], pre [M, hc] | None, post [M, hc] | None, comb [M, hc, hc] | None, mean [M, D] | None)."""
    from .rmsnorm import reference as rmsnorm

    mean = None
    if capture is not False:
        mean = X.double().mean(1).to(X.dtype)
        mean = mean if capture is True else capture.copy_(mean)
    p = post = comb = None
    if fn is not None and iters >= 1:
        p, post, comb = coeffs(X, fn, base, scale, norm_eps, hc_eps, iters)
    elif fn is not None:
        p = head_pre(X, fn, base, scale, norm_eps, hc_eps)
    x = collapse(X, p if weights is None else weights)
    if collapsed is not None:
        collapsed.copy_(x)
    return rmsnorm(x, norm_weight, rms_eps), p, post, comb, mean


# One launch: programs (split s, row block b). Each computes its columns' projection partials (a chunk of the
# columns d of every copy, the copies in order) for the block's rows, one row at a time (EXPAND: it first
# makes and stores those columns of the streams from the previous sub-block's output, whose row it loads
# once for every copy; without a site, COEFFS off, that is all it does); the last program of a row block to
# finish (a counter per block, reset by that program) adds the partials in split order and computes the
# block's coefficients, then the collapse and the RMSNorm of each row. Without a site and an expand, one
# program a row block. Nothing mixes rows: batch invariant.


@device_function
def _site_coeffs(part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, rows, rmask, M, n, hc, iters,
                 norm_eps, hc_eps, S, HEAD: tl.constexpr, BM: tl.constexpr, BHC: tl.constexpr):
    """The coefficients of rows `rows` from the split partials (added in split order), stored; returns pre.
    Shared by the fused site (_pre_kernel) and the coefficients alone (_coeffs_kernel)."""
    J = hc if HEAD else hc * (2 + hc)
    i = tl.arange(0, BHC)
    imask = i < hc
    vm = rmask[:, None] & imask[None, :]
    cm = rmask[:, None, None] & imask[None, :, None] & imask[None, None, :]
    cidx = 2 * hc + i[:, None] * hc + i[None, :]
    d_pre = tl.zeros((BM, BHC), dtype=tl.float32)
    d_post = tl.zeros((BM, BHC), dtype=tl.float32)
    d_comb = tl.zeros((BM, BHC, BHC), dtype=tl.float32)
    ss = tl.zeros((BM,), dtype=tl.float32)
    for s in range(S):
        row = part_ptr + (s * M + rows).to(tl.int64) * (J + 1)
        d_pre += tl.load(row[:, None] + i[None, :], mask=vm, other=0.0)
        if not HEAD:
            d_post += tl.load(row[:, None] + hc + i[None, :], mask=vm, other=0.0)
            d_comb += tl.load(row[:, None, None] + cidx[None, :, :], mask=cm, other=0.0)
        ss += tl.load(row + J, mask=rmask, other=0.0)
    rho = (1.0 / tl.sqrt_rn(ss / n + norm_eps))[:, None]
    s0 = tl.load(scale_ptr)
    b_pre = tl.load(base_ptr + i, mask=imask, other=0.0)[None, :]
    p = _sigmoid(d_pre * rho * s0 + b_pre) + hc_eps
    tl.store(pre_ptr + rows[:, None] * hc + i[None, :], p, mask=vm)
    if not HEAD:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        b_post = tl.load(base_ptr + hc + i, mask=imask, other=0.0)[None, :]
        tl.store(post_ptr + rows[:, None] * hc + i[None, :], 2.0 * _sigmoid(d_post * rho * s1 + b_post), mask=vm)
        b_comb = tl.load(base_ptr + cidx, mask=imask[:, None] & imask[None, :], other=0.0)
        c = tl.where(cm, d_comb * rho[:, :, None] * s2 + b_comb[None, :, :], float("-inf"))
        mx = tmax(c, axis=2)
        e = tl.where(cm, tl.exp(c - tl.where(mx == float("-inf"), 0.0, mx)[:, :, None]), 0.0)
        z = tsum(e, axis=2)
        c = tl.where(cm, e / tl.where(z == 0.0, 1.0, z)[:, :, None] + hc_eps, 0.0)  # (padding rows: no 0/0)
        c = c / (tsum(c, axis=1)[:, None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tsum(c, axis=2)[:, :, None] + hc_eps)
            c = c / (tsum(c, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + rows[:, None, None] * hc * hc + cidx[None, :, :] - 2 * hc, c, mask=cm)
    return p


@device_function
def output_row(parts, base, pos_ptr, s_parts, m, K, SH0, d, dmask, D, WORLD: tl.constexpr, S_WORLD: tl.constexpr,
               PAIRS: tl.constexpr, HAS_SHARED: tl.constexpr, S_ROUND: tl.constexpr, ROUND: tl.constexpr,
               OUT_BF16: tl.constexpr):
    """Row m of a sub-block's output y at columns d, float32: row m of the ranks' partials added in rank order
    (`rank_load`; one tensor: its values) or, a MoE's (PAIRS: `Combine`), its pairs' rows pos[m] so summed and
    added in expert order, then its shared expert's row SH0 + m (of the parts where S_WORLD > 1, else of
    s_parts' one tensor; S_ROUND: a sum over ranks, rounded to X's dtype); rounded to X's dtype where ROUND.
    Shared by the MoE's combine and the site that takes it (_pre_kernel)."""
    if PAIRS:
        y = tl.zeros(d.shape, dtype=tl.float32)
        for j in range(K):  # each pair's output summed over the ranks in rank order, then added in expert order
            # (the pair's row offset in int32: held under 2^31 by the callers; in int64 the sm_103 compile spills)
            y += rank_load(parts, base + tl.load(pos_ptr + m * K + j).to(tl.int32) * D + d, dmask, WORLD)
        if HAS_SHARED:  # S_WORLD > 1: the ranks' partials of it travel with the pairs' (parts), else s_parts[0]
            if S_WORLD > 1:
                s = rank_load(parts, base + (SH0 + m) * D + d, dmask, WORLD)
            else:
                s = tl.load(s_parts[0] + (SH0 + m) * D + d, mask=dmask, other=0.0).to(tl.float32)
            if S_ROUND:
                s = round_out(s, OUT_BF16).to(tl.float32)
            y += s
    else:
        y = rank_load(parts, base + as_int64(m) * D + d, dmask, WORLD)
    if ROUND:
        y = round_out(y, OUT_BF16).to(tl.float32)
    return y


@device_function
def expand_tile(y, x_ptr, post_ptr, comb_ptr, out_ptr, m, d, dmask, D, hc, OUT_BF16: tl.constexpr,
                BHC: tl.constexpr, BD: tl.constexpr):
    """Row m's expanded streams at columns d (BD of them) stored into out [M, hc, D]: out_k = post_k y +
    sum_j comb[j, k] X_j over the copies in order, float32, rounded to X's dtype."""
    k = tl.arange(0, BHC)
    km = k < hc
    m64 = as_int64(m)
    post = tl.load(post_ptr + m64 * hc + k, mask=km, other=0.0)
    mixed = tl.zeros((BHC, BD), dtype=tl.float32)
    for j in tl.static_range(BHC):  # unrolled (the loop over hc spills on sm_90), copies past hc masked: + 0
        cj = tl.load(comb_ptr + (m64 * hc + j) * hc + k, mask=km & (k * 0 + j < hc), other=0.0)
        xj = tl.load(x_ptr + (m64 * hc + j) * D + d, mask=dmask & (d * 0 + j < hc), other=0.0).to(tl.float32)
        mixed += cj[:, None] * xj[None, :]
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + (m64 * hc + k[:, None]) * D + d[None, :], round_out(out, OUT_BF16),
             mask=km[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["M"])  # row counts vary call by call: one compile
def _pre_kernel(y_parts,    # EXPAND: the sub-block output [M, D], WORLD float32 partials (a tuple) or one tensor;
                            # PAIRS: a MoE's outputs per pair [P, D] so (`Combine`)
                pos_ptr, K, s_parts, SH0,  # PAIRS: row m's pairs (int64 [M, K]); its shared expert's row SH0 + m
                                           # (of the parts where S_WORLD > 1, else of s_parts' one tensor)
                x_ptr,      # streams X [M, hc, D] (float32 / bfloat16), contiguous
                w_ptr,      # float32 [M, hc] collapse weights (OWN == 0)
                fn_ptr,     # float32 [J, hc*D] projection (COEFFS)
                base_ptr, scale_ptr,
                nw_ptr,     # float32 [D] RMSNorm weight
                part_ptr,   # float32 [S, M, J + 1] scratch: split partials
                cnt_ptr,    # int32 [row blocks] counters, zero between launches
                pre_ptr, post_ptr, comb_ptr,  # float32 coefficients out (COEFFS)
                y_ptr,      # out [M, D] in X's dtype: the normed collapse
                mean_ptr,   # out [M, D] in X's dtype, row stride STRIDE_MEAN: the copies' mean (MEAN)
                col_ptr,    # out float32 [M, D], row stride STRIDE_COL: the collapse (COLLAPSED)
                xo_ptr,     # EXPAND: the streams before the expand [M, hc, D]; X (x_ptr) is written from them
                xpost_ptr, xcomb_ptr,  # EXPAND: float32 [M, hc], [M, hc, hc], the expand's coefficients
                flags, rank, capacity,  # y's partials' Publish (kernels/rank_sum.py arrival_args; WAIT)
                M, hc, D, iters, chunk, RB,  # chunk: columns d of every copy per split; RB: rows per block
                norm_eps, hc_eps, rms_eps,
                COEFFS: tl.constexpr, HEAD: tl.constexpr, OWN: tl.constexpr, MEAN: tl.constexpr,
                STRIDE_MEAN: tl.constexpr, COLLAPSED: tl.constexpr, STRIDE_COL: tl.constexpr, OUT_BF16: tl.constexpr,
                EXPAND: tl.constexpr, WORLD: tl.constexpr,
                Y_ROUND: tl.constexpr,
                WAIT: tl.constexpr, PAIRS: tl.constexpr, HAS_SHARED: tl.constexpr, S_WORLD: tl.constexpr,
                S_ROUND: tl.constexpr,
                BJ: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BHC: tl.constexpr, BD: tl.constexpr,
                PDL: tl.constexpr):
    dependent_launch(PDL)
    pid_s = tl.program_id(0)
    pid_b = tl.program_id(1)
    S = tl.num_programs(0)
    n = hc * D
    r_lo = pid_b * RB
    r_hi = tl.minimum(M, r_lo + RB)
    last = True
    if COEFFS or EXPAND:  # the split's columns: expanded, projected; the block's last program goes on
        d_lo = pid_s * chunk
        d_end = tl.minimum(D, d_lo + chunk)
        if EXPAND:  # these columns of every copy of X made here first (y loaded once for all copies), stored:
            # read back below and by the collapse
            ybase = rank_arrive(flags, rank, capacity, WAIT, WORLD)
            steps = tl.cdiv(d_end - d_lo, BC)
            for t in range((r_hi - r_lo) * steps):  # the block's rows, each over the split's columns
                m = r_lo + t // steps
                d = d_lo + (t % steps) * BC + tl.arange(0, BC)
                dmask = d < d_end
                y = output_row(y_parts, ybase, pos_ptr, s_parts, m, K, SH0, d, dmask, D, WORLD, S_WORLD, PAIRS,
                               HAS_SHARED, S_ROUND, Y_ROUND, OUT_BF16)
                expand_tile(y, xo_ptr, xpost_ptr, xcomb_ptr, x_ptr, m, d, dmask, D, hc, OUT_BF16, BHC, BC)
            tl.debug_barrier()  # the block's stores are visible to all its threads before they read them
        if COEFFS:
            J = hc if HEAD else hc * (2 + hc)
            js = tl.arange(0, BJ)
            jmask = js < J
            for m in range(r_lo, r_hi):
                dots = tl.zeros((BJ,), dtype=tl.float32)
                ss = tl.zeros((1,), dtype=tl.float32)
                for d0 in range(d_lo, d_end, BC):
                    d = d0 + tl.arange(0, BC)
                    for c in tl.static_range(BHC):  # the copies in order (past hc masked: + 0)
                        cmask = (d < d_end) & (d * 0 + c < hc)
                        cols = c * D + d
                        v = tl.load(x_ptr + as_int64(m) * n + cols, mask=cmask, other=0.0).to(tl.float32)
                        f = tl.load(fn_ptr + js[:, None] * n + cols[None, :], mask=jmask[:, None] & cmask[None, :],
                                    other=0.0)
                        dots += tsum(f * v[None, :], axis=1)
                        ss += tsum(v * v, axis=0)
                base = part_ptr + (pid_s * M + m).to(tl.int64) * (J + 1)
                tl.store(base + js, dots, mask=jmask)
                tl.store(base + J + tl.arange(0, 1), ss)
        tl.debug_barrier()  # every thread's stores are written before the counter's release
        last = tl.atomic_add(cnt_ptr + pid_b, 1, sem="acq_rel") == S - 1
    if last:
        rows = r_lo + tl.arange(0, BM)
        rmask = rows < r_hi
        i = tl.arange(0, BHC)
        vm = rmask[:, None] & (i[None, :] < hc)
        if COEFFS:
            p = _site_coeffs(part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, rows, rmask, M, n, hc,
                             iters, norm_eps, hc_eps, S, HEAD, BM, BHC)
        if COEFFS or EXPAND:
            tl.atomic_xchg(cnt_ptr + pid_b, 0)  # ready for the next launch (a graph replays this one)
        if OWN:
            wts = p
        else:
            wts = tl.load(w_ptr + rows[:, None] * hc + i[None, :], mask=vm, other=0.0)
        r64 = rows.to(tl.int64)
        # collapse (float32 over the copies in order, rounded to X's dtype), then RMSNorm of the rounded row:
        # the sum of squares first, then the collapse again for the output (no read of what was just written)
        ss = tl.zeros((BM,), dtype=tl.float32)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cm = rmask[:, None] & (cols[None, :] < D)
            acc = tl.zeros((BM, BD), dtype=tl.float32)
            for j in range(hc):
                wj = tsum(tl.where(i[None, :] == j, wts, 0.0), axis=1)
                acc += wj[:, None] * tl.load(x_ptr + (r64[:, None] * hc + j) * D + cols[None, :], mask=cm,
                                             other=0.0).to(tl.float32)
            c = round_out(acc, OUT_BF16).to(tl.float32)
            ss += tsum(c * c, axis=1)
        r = 1.0 / tl.sqrt_rn(ss / D + rms_eps)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cm = rmask[:, None] & (cols[None, :] < D)
            acc = tl.zeros((BM, BD), dtype=tl.float32)
            total = tl.zeros((BM, BD), dtype=tl.float32)
            for j in range(hc):
                wj = tsum(tl.where(i[None, :] == j, wts, 0.0), axis=1)
                xj = tl.load(x_ptr + (r64[:, None] * hc + j) * D + cols[None, :], mask=cm, other=0.0).to(tl.float32)
                acc += wj[:, None] * xj
                total += xj
            if MEAN:  # the copies' sum in order, one correctly rounded division
                tl.store(mean_ptr + r64[:, None] * STRIDE_MEAN + cols[None, :],
                         round_out(tl.math.div_rn(total, hc * 1.0), OUT_BF16), mask=cm)
            c = round_out(acc, OUT_BF16).to(tl.float32)
            if COLLAPSED:
                tl.store(col_ptr + r64[:, None] * STRIDE_COL + cols[None, :], c, mask=cm)
            nw = tl.load(nw_ptr + cols, mask=cols < D, other=0.0)
            tl.store(y_ptr + r64[:, None] * D + cols[None, :], round_out(nw[None, :] * (c * r[:, None]), OUT_BF16),
                     mask=cm)


def fast_pre(X: torch.Tensor, weights: torch.Tensor | None, fn: torch.Tensor | None, base: torch.Tensor | None,
             scale: torch.Tensor | None, norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor,
             rms_eps: float, capture: bool | torch.Tensor = False, collapsed: torch.Tensor | None = None):
    """The kernel for `pre` (same signature; results within the stated tolerances of `coeffs`, `collapse`
    and RMSNorm): one launch."""
    return _pre(X, weights, fn, base, scale, norm_eps, hc_eps, iters, norm_weight, rms_eps, capture,
                collapsed=collapsed)


def fast_expand_pre(y: torch.Tensor | list[torch.Tensor] | Combine, X: torch.Tensor, post: torch.Tensor,
                    comb: torch.Tensor, weights: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor,
                    scale: torch.Tensor, norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor,
                    rms_eps: float, capture: bool | torch.Tensor = False, collapsed: torch.Tensor | None = None):
    """The kernel for `expand_pre` (same signature; the site's results the same bits as fast_pre's of the X' it
    returns; X' within the expand's tolerance, a `Combine`'s the bits of the MoE's combine): one launch, the
    pre kernel's, each program expanding the columns it projects (y's row loaded once for every copy: the
    ranks' partials added in rank order as it loads them, waited for inside it; a MoE's pairs and shared
    expert added as its combine adds them) and storing them for the collapse."""
    require(fn is None or iters >= 1, "iters", iters, "must be >= 1: the expanded streams feed a site's "
            "coefficients (or none: fn None, a collapse by given weights)")
    front = _front(y, X, post, comb)
    Xn = torch.empty_like(front.X)
    return (Xn, *_pre(Xn, weights, fn, base, scale, norm_eps, hc_eps, iters, norm_weight, rms_eps, capture,
                      front, collapsed))


def _pre(X: torch.Tensor, weights, fn, base, scale, norm_eps: float, hc_eps: float, iters: int,
         norm_weight: torch.Tensor, rms_eps: float, capture: bool | torch.Tensor, front: _Front | None = None,
         collapsed: torch.Tensor | None = None):
    """fast_pre's launch; with `front`, X is written by the launch itself: the expand of `front` (_Front)."""
    require_dtype(X, "X", (torch.float32, torch.bfloat16))
    require(X.dim() == 3, "X.dim()", X.dim(), "must be 3 ([M, hc, D])")
    m, hc, d = X.shape
    n = hc * d
    require(fn is not None or weights is not None, "weights", None, "must be given when there is no site (fn)")
    require(iters >= 0, "iters", iters, "must be >= 0")
    head = iters == 0
    j = hc if head else hc * (2 + hc)
    if fn is not None:
        require(tuple(fn.shape) == (j, n), "fn.shape", tuple(fn.shape), f"must be {(j, n)}")
        require(tuple(base.shape) == (j,), "base.shape", tuple(base.shape), f"must be {(j,)}")
        require(scale.numel() >= (1 if head else 3), "scale.numel()", scale.numel(), "must be >= 3 (1 for the head)")
        for name, t in (("fn", fn), ("base", base), ("scale", scale)):
            require_dtype(t, name, (torch.float32,))
            require(t.is_contiguous(), f"{name}.stride", t.stride(), "must be contiguous")
    if weights is not None:
        require(tuple(weights.shape) == (m, hc), "weights.shape", tuple(weights.shape), f"must be {(m, hc)}")
        require_dtype(weights, "weights", (torch.float32,))
    require(norm_weight is not None and tuple(norm_weight.shape) == (d,), "norm_weight.shape",
            None if norm_weight is None else tuple(norm_weight.shape), f"must be ({d},)")
    require_dtype(norm_weight, "norm_weight", (torch.float32,))
    if collapsed is not None:
        require(tuple(collapsed.shape) == (m, d) and collapsed.stride(1) == 1, "collapsed.shape",
                tuple(collapsed.shape), f"must be ({m}, {d}) with contiguous rows")
        require_dtype(collapsed, "collapsed", (torch.float32,))
    dev = device_of(X, norm_weight, fn, weights, collapsed)
    X = X.contiguous()
    y = torch.empty((m, d), dtype=X.dtype, device=dev)
    coeff = fn is not None
    p = torch.empty((m, hc), dtype=torch.float32, device=dev) if coeff else None
    post = torch.empty((m, hc), dtype=torch.float32, device=dev) if coeff and not head else None
    comb = torch.empty((m, hc, hc), dtype=torch.float32, device=dev) if coeff and not head else None
    mean = None
    if capture is True:
        mean = torch.empty((m, d), dtype=X.dtype, device=dev)
    elif capture is not False:
        require(tuple(capture.shape) == (m, d) and capture.stride(1) == 1 and capture.dtype == X.dtype, "capture",
                (tuple(capture.shape), capture.dtype), f"must be ({m}, {d}) {X.dtype} with contiguous rows")
        mean = capture
    if m == 0:
        return y, p, post, comb, mean
    if INTERPRET:
        bc = min(pow2(d), 512)
        chunk = max(bc, pow2(d))
        rb, bd = min(pow2(m), 64), min(pow2(d), 4096)
    else:  # ~1 program per SM over the columns d (from D only; each takes them in every copy); 16 rows per
        # block (a decode step: one)
        bc = 32
        chunk = triton.cdiv(triton.cdiv(d, 128), bc) * bc
        rb, bd = 16, 128
    splits = triton.cdiv(d, chunk) if coeff or front is not None else 1
    blocks = triton.cdiv(m, rb)
    cnt = counters(dev, blocks)
    part = torch.empty((splits, m, j + 1), dtype=torch.float32, device=dev) if coeff else y
    w = weights if weights is not None else y
    f = front or _Front((y,), (y, 0, 0), False, False, X, y, y)  # no expand: placeholders, never read
    pairs = f.pos is not None
    s_parts = f.shared if f.shared is not None else f.parts
    _pre_kernel[(splits, blocks)](
        f.parts, f.pos if pairs else y, f.k, s_parts[:1], f.sh0, X, w, fn if coeff else y, base if coeff else y,
        scale if coeff else y, norm_weight, part, cnt,
        p if coeff else y, post if post is not None else y, comb if comb is not None else y, y,
        mean if mean is not None else y, collapsed if collapsed is not None else y, f.X, f.post, f.comb, *f.wait,
        m, hc, d, max(iters, 1), chunk, rb, float(norm_eps), float(hc_eps), float(rms_eps),
        COEFFS=coeff, HEAD=head, OWN=weights is None, MEAN=mean is not None,
        STRIDE_MEAN=mean.stride(0) if mean is not None else 0, COLLAPSED=collapsed is not None,
        STRIDE_COL=collapsed.stride(0) if collapsed is not None else 0, OUT_BF16=X.dtype == torch.bfloat16,
        EXPAND=front is not None, WORLD=len(f.parts), Y_ROUND=f.y_round, WAIT=f.waits, PAIRS=pairs,
        HAS_SHARED=f.shared is not None, S_WORLD=len(s_parts), S_ROUND=f.s_round,
        BJ=pow2(j), BC=bc, BM=rb, BHC=pow2(hc), BD=bd, **pdl(X.device))
    return y, p, post, comb, mean
