"""Sampling and draft acceptance on the device, with every parameter a tensor: nothing reads the host, so a
whole decode cycle (draft, verify, accept) can be captured in one CUDA graph and replayed. The decode cycle
and the drafters reach these through the op registry (`ops.sample`, `ops.accept`): one sampler.

Randomness comes from a counter-based generator: uniform(key, i) = splitmix64(seed, counter, i) in 53
bits. The key tensor [seed, counter] lives on the device; each call consumes a block of counter values and
advances the counter in place, so replays draw fresh numbers and a seed reproduces a request exactly, on
CPU and GPU alike (the arithmetic is integer, identical everywhere).

Reference (plain torch): temperature 0 is argmax; otherwise p = softmax(logits / T), truncated by top-k
(k = 0: off) and top-p (p = 1: off), renormalized; draws by the exponential race argmax(p / E),
E = -log(1 - U). Speculative acceptance (Leviathan et al.): accept draft i with probability
min(1, p_i(d_i) / r_i(d_i)); at the first rejection draw from normalize(max(0, p_i - r_i)); if all pass,
draw from p_{k+1}. Greedy: the longest prefix equal to the target's argmax, then its argmax.

Kernels (`fast_distribution`, `fast_sample`, `fast_accept`), float32 only, one program per row, looping
over the vocab in blocks of a fixed width (each block one reduction, blocks added in order: a row's sums do
not depend on the other rows): softmax in float32; top-k and top-p thresholds by radix search on the float
bit patterns (32 counting passes each; the top-p mass sums in float32), so no sort; greedy by an argmax
kernel (ties to the lowest id); draws by the reference race over the kernel's p. Tolerance: probabilities
within 2^-20 of the largest (float32 exp and sums over V in a different order than torch's: a few ulps);
the kept set is the reference's except at exact ties on the top-p boundary, where all tied entries are kept
(the reference's order among ties is its sort's, unspecified), or where a partial mass is within those
ulps of top_p times the total.
"""

import torch

from ._triton import (
    INTERPRET,
    device_function,
    device_of,
    pow2,
    require,
    require_dtype,
    require_rows,
    tl,
    tmax,
    tmin,
    triton,
    tsum,
)

_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
_M2 = -7723592293110705685  # 0x94d049bb133111eb
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def uniform(key: torch.Tensor, n: int) -> torch.Tensor:
    """n uniforms in [0, 1) (float64) from key = [seed, counter] (int64, device); advances the counter."""
    i = torch.arange(n, device=key.device, dtype=torch.int64)
    x = _mix(key[0] * _GOLDEN + _mix((key[1] + i) * _GOLDEN))
    key[1] += n
    return _shr(x, 11).double() * 2.0**-53


def distribution(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; params = [temperature, top_p, top_k] (float tensor) -> p [R, V] float32."""
    temperature, top_p, top_k = params[0], params[1], params[2]
    p = torch.softmax(logits.float() / temperature.clamp(min=1e-5), dim=-1)
    sp, order = p.sort(dim=-1, descending=True)
    rank = torch.arange(p.shape[-1], device=p.device)
    keep = (top_k <= 0) | (rank < top_k)  # top-k on the sorted order
    kth = sp.gather(-1, (top_k.long().clamp(1, p.shape[-1]) - 1).expand(p.shape[0], 1))
    keep = keep | (sp >= kth)  # ties with the k-th value stay
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    before = sp.cumsum(-1) - sp  # mass strictly above each entry
    keep = (top_p >= 1.0) | (before < top_p * sp.sum(-1, keepdim=True))
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    p = torch.zeros_like(p).scatter(-1, order, sp)
    return p / p.sum(-1, keepdim=True)


def draw(p: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row of p [R, V] -> int64 [R] (exponential race)."""
    e = -torch.log1p(-uniform(key, p.numel()).view(p.shape))
    return (p.double() / e).argmax(-1)


def sample(logits: torch.Tensor, params: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Greedy when params[0] (temperature) is 0, else a draw: both computed, one selected (no branch on a
    device value)."""
    greedy = logits.argmax(-1)
    drawn = draw(distribution(logits, params), key)
    return torch.where(params[0] == 0, greedy, drawn)


def accept(target: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, params: torch.Tensor,
           key: torch.Tensor, distribution=distribution) -> tuple[torch.Tensor, torch.Tensor]:
    """target logits [k+1, V], drafts [k], draft_logits [k, V] -> (j, b): accepted drafts and the next token
    (both int64 scalars on the device). `distribution`: this reference's, or the kernel's (fast_accept)."""
    k = drafts.numel()
    # greedy
    best = target.argmax(-1)
    match = torch.cat((drafts == best[:k], torch.zeros(1, dtype=torch.bool, device=drafts.device)))
    j_greedy = torch.cumprod(match.long(), 0).sum()
    b_greedy = best.gather(0, j_greedy.view(1))[0]
    # sampling: p for every verify row, r for every draft row
    p = distribution(target, params)
    r = distribution(draft_logits, params)
    pd = p[:k].gather(1, drafts.view(-1, 1))[:, 0]
    rd = r.gather(1, drafts.view(-1, 1))[:, 0]
    u = uniform(key, k)
    ok = torch.cat((u * rd < pd, torch.zeros(1, dtype=torch.bool, device=drafts.device)))
    j_sampled = torch.cumprod(ok.long(), 0).sum()
    residual = (p[:k] - r).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p[:k])
    rows = torch.cat((residual, p[k:]), 0)  # row i: where the next token comes from if i is the first miss
    b_sampled = draw(rows, key).gather(0, j_sampled.view(1))[0]
    sampled = params[0] > 0
    return torch.where(sampled, j_sampled, j_greedy), torch.where(sampled, b_sampled, b_greedy)


# --- Triton kernels --------------------------------------------------------------------------------------


@device_function
def _key(v):
    """float32 >= 0 -> its bit pattern as int64 (same order)."""
    return v.to(tl.int32, bitcast=True).to(tl.int64)


@triton.jit
def _distribution_kernel(l_ptr,  # logits [R, V] (any float dtype), row stride stride_l
                         p_ptr,  # out float32 [R, V]: the truncated, renormalized distribution
                         params_ptr,  # float32 [3]: temperature, top_p, top_k (read on the device)
                         V, stride_l, BV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    temperature = tl.maximum(tl.load(params_ptr), 1e-5)
    top_p = tl.load(params_ptr + 1)
    top_k = tl.load(params_ptr + 2).to(tl.int64)
    lrow = l_ptr + r * stride_l
    prow = p_ptr + r * V
    # softmax of logits / temperature (the division in float32, as the reference does it)
    mx = tl.full((1,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(lrow + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        mx = tl.maximum(mx, tmax(x, axis=0))
    tot = tl.zeros((1,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(lrow + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        tot += tsum(tl.exp(x - mx), axis=0)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(lrow + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        tl.store(prow + cols, tl.exp(x - mx) / tot, mask=cols < V)
    # top-k: keep p >= the k-th largest p (the largest T with count(p >= T) >= k)
    kth = tl.zeros((1,), dtype=tl.int64)
    if (top_k > 0) & (top_k < V):
        for b in range(30, -1, -1):
            cand = kth | (1 << b)
            cnt = tl.zeros((1,), dtype=tl.int64)
            for v0 in range(0, V, BV):
                cols = v0 + tl.arange(0, BV)
                p = tl.load(prow + cols, mask=cols < V, other=0.0)
                cnt += tsum(((cols < V) & (_key(p) >= cand)).to(tl.int64), axis=0)
            kth = tl.where(cnt >= top_k, cand, kth)
    # top-p: keep entries whose strictly larger mass is < top_p * total, i.e. p >= the largest T with
    # mass(p >= T) >= top_p * total
    thr = kth
    if top_p < 1.0:
        total = tl.zeros((1,), dtype=tl.float32)
        for v0 in range(0, V, BV):
            cols = v0 + tl.arange(0, BV)
            p = tl.load(prow + cols, mask=cols < V, other=0.0)
            total += tsum(tl.where(_key(p) >= kth, p, 0.0), axis=0)
        goal = top_p * total
        thr = tl.zeros((1,), dtype=tl.int64)
        for b in range(30, -1, -1):
            cand = thr | (1 << b)
            mass = tl.zeros((1,), dtype=tl.float32)
            for v0 in range(0, V, BV):
                cols = v0 + tl.arange(0, BV)
                p = tl.load(prow + cols, mask=cols < V, other=0.0)
                k = _key(p)
                mass += tsum(tl.where((k >= cand) & (k >= kth), p, 0.0), axis=0)
            thr = tl.where(mass >= goal, cand, thr)
        thr = tl.maximum(thr, kth)
    kept = tl.zeros((1,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        p = tl.load(prow + cols, mask=cols < V, other=0.0)
        kept += tsum(tl.where(_key(p) >= thr, p, 0.0), axis=0)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        p = tl.load(prow + cols, mask=cols < V, other=0.0)
        tl.store(prow + cols, tl.where(_key(p) >= thr, p, 0.0) / kept, mask=cols < V)


def fast_distribution(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The kernel for `distribution` (same signature and result, see the tolerance above)."""
    require(logits.dim() == 2, "logits.dim()", logits.dim(), "must be 2 ([R, V])")
    require_dtype(logits, "logits", (torch.float32, torch.bfloat16, torch.float16))
    require_rows(logits, "logits")
    require_dtype(params, "params", (torch.float32,))
    require(tuple(params.shape) == (3,), "params.shape", tuple(params.shape), "must be (3,): temperature, top_p, top_k")
    dev = device_of(logits, params)
    r, v = logits.shape
    p = torch.empty((r, v), dtype=torch.float32, device=dev)
    if r and v:
        bv = min(pow2(v), 4096 if INTERPRET else 2048)
        _distribution_kernel[(r,)](logits, p, params, v, logits.stride(0), BV=bv)
    return p


@triton.jit
def _argmax_kernel(p_ptr,    # [R, V] values (probabilities or logits), row stride stride_p
                   e_ptr,    # float32 [R, V] exponential draws, contiguous (HAS_E)
                   out_ptr,  # out int64 [R]
                   V, stride_p, HAS_E: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    best = tl.full((1,), float("-inf"), dtype=tl.float32)
    best_i = tl.zeros((1,), dtype=tl.int64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(p_ptr + r * stride_p + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if HAS_E:
            x = x / tl.load(e_ptr + r * V + cols, mask=cols < V, other=1.0)
        x = tl.where(cols < V, x, float("-inf"))
        cmax = tmax(x, axis=0)
        ci = tmin(tl.where(x == cmax, cols, V + BV), axis=0).to(tl.int64)
        better = cmax > best  # strictly: an equal later maximum keeps the lower index
        best_i = tl.where(better, ci, best_i)
        best = tl.where(better, cmax, best)
    tl.store(out_ptr + r + tl.arange(0, 1), best_i)


def _argmax(x: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
    """argmax over the last dim of x [R, V] (of x / e when e is given), ties to the lowest index."""
    r, v = x.shape
    out = torch.empty(r, dtype=torch.int64, device=x.device)
    if r and v:
        bv = min(pow2(v), 4096 if INTERPRET else 2048)
        _argmax_kernel[(r,)](x, x if e is None else e, out, v, x.stride(0), HAS_E=e is not None, BV=bv)
    return out


def fast_sample(logits: torch.Tensor, params: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The kernels for `sample` (same signature): greedy by the argmax kernel, a draw from the distribution
    kernel's p by the reference race (the same counter values, so the same draws where p agrees)."""
    require(logits.dim() == 2, "logits.dim()", logits.dim(), "must be 2 ([R, V])")
    require_rows(logits, "logits")
    device_of(logits, params, key)
    greedy = _argmax(logits, None)
    drawn = draw(fast_distribution(logits, params), key)
    return torch.where(params[0] == 0, greedy, drawn)


def fast_accept(target: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, params: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels for `accept` (same signature): its distributions from the distribution kernel."""
    return accept(target, drafts, draft_logits, params, key, distribution=fast_distribution)
