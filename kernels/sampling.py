"""Sampling and draft acceptance on the device, with every parameter a tensor: nothing reads the host, so a
whole decode cycle (draft, verify, accept) can be captured in one CUDA graph and replayed. The decode cycle
and the drafters reach these through the op registry (`ops.sample`, `ops.sample_sum`, `ops.accept`): one sampler.

Randomness comes from a counter-based generator: uniform(key, i) = splitmix64(seed, counter, i) in 53
bits. The key tensor [seed, counter] lives on the device; each call consumes a block of counter values and
advances the counter in place, so replays draw fresh numbers and a seed reproduces a request exactly, on
CPU and GPU alike (the arithmetic is integer, identical everywhere).

Reference (plain torch): temperature 0 is argmax; otherwise p = softmax(logits / T), truncated by top-k
(k = 0: off) and top-p (p = 1: off), renormalized; draws by the exponential race argmax(p / E),
E = -log(1 - U). Speculative acceptance (Leviathan et al.): accept draft i with probability
min(1, p_i(d_i) / r_i(d_i)); at the first rejection draw from normalize(max(0, p_i - r_i)); if all pass,
draw from p_{k+1}. Greedy: the longest prefix equal to the target's argmax, then its argmax.

Kernels (`fast_distribution`, `fast_sample`, `fast_sample_sum`, `fast_accept`), float32 only (no float64 in a
kernel or a torch operation), one program per row, looping over the vocab in blocks of a fixed width (each
block one reduction, blocks added in order: a row's sums do not depend on the other rows): softmax in
float32; top-k and top-p thresholds by radix search on the float bit patterns (32 counting passes each; the
top-p mass sums in float32), so no sort. `fast_sample` is one launch: the distribution kernel races over
each block of the row as its last pass stores it, drawing the generator's values itself (integer mixing
per entry, the exponential in float32), takes the greedy argmax of the logits beside it (ties to the lowest
id), selects one by the temperature, and advances the counter (the last of its programs, once every
program has read it). `fast_sample_sum` is that launch with DSpark's Markov step around it: each program
first stores its row's logits as the float32 sum of two rows, last its drawn token's row of a table.
`fast_accept` is one launch a verify: one program per verify row makes its row's distributions (the
target's, its logits' argmax beside it, and the drafter's: the distribution kernel's code) and draws that
row's candidate next token (the residual max(0, p - r) renormalized, or p for the last row) as the race does,
and the last program to finish makes the acceptance tests u * r < p in float32 over the generator's values,
picks the first miss, and writes the cycle's result and the advanced counter (the forced count too, for
benchmarks). Logits a vocabulary-parallel head leaves split by columns over the ranks (`SplitLogits`) are read
where they lie: a launch's program first stores its row from every rank's columns (waiting for them inside
the launch where they are in symmetric memory), then runs as above, on the same bits. Tolerance:
probabilities within 2^-20 of the largest (float32 exp and sums over V in a different order than torch's: a
few ulps); the kept set is the reference's except at exact ties on the
top-p boundary, where all tied entries are kept (the reference's order among ties is its sort's,
unspecified), or where a partial mass is within those ulps of top_p times the total; a draw is the
reference's except where the reference's race values p / E of the two entries are within 2^-18 of each
other (relative: p's 2^-20 plus E's float32 uniform and logarithm, a few ulps); an acceptance is the
reference's except where u * r and p are that close.
"""

import torch

from . import rank_sum
from ._triton import (
    INTERPRET,
    counters,
    dependent_launch,
    device_function,
    device_of,
    pdl,
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
from .rank_sum import rank_arrive

_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
_M2 = -7723592293110705685  # 0x94d049bb133111eb
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15
# the same constants as kernel globals (a jit function reads only constexpr globals)
_M1_K, _M2_K, _GOLDEN_K = tl.constexpr(_M1), tl.constexpr(_M2), tl.constexpr(_GOLDEN)


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
    """n float64 uniforms in [0, 1) from key = [seed, counter] (int64, device): the top 53 bits of the mix
    times 2^-53 (exact: the 53-bit integer is exact in float64); advances the counter."""
    i = torch.arange(n, device=key.device, dtype=torch.int64)
    x = _mix(key[0] * _GOLDEN + _mix((key[1] + i) * _GOLDEN))
    key[1] += n
    return _shr(x, 11).to(torch.float64) * 2.0**-53


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


class SplitLogits:
    """Logits [R, V] as the ranks hold them, split by columns (a vocabulary-parallel head:
    appliance/parallel/sharding.py VocabParallel): `parts`, float32 [R, V / world] each in rank order, in
    symmetric memory (a `rank_sum.Partials`: the sampler's kernel waits for them and reads every rank's
    columns where they lie, so the logits are never gathered) or gathered (plain tensors). Rows slice as a
    tensor's do."""

    def __init__(self, parts):
        widths = {tuple(p.shape) for p in parts}
        require(len(widths) == 1 and len(next(iter(widths))) == 2, "parts", sorted(widths),
                "must be one [R, V / world] shape")
        for r, p in enumerate(parts):
            require_dtype(p, f"parts[{r}]", (torch.float32,))
            require(p.is_contiguous(), f"parts[{r}].is_contiguous()", False, "must be contiguous")
        self.parts = parts
        self.width = parts[0].shape[1]
        self.shape = torch.Size((parts[0].shape[0], len(parts) * self.width))

    def __getitem__(self, rows: slice) -> "SplitLogits":
        published = getattr(self.parts, "published", None)
        sliced = [p[rows] for p in self.parts]
        return SplitLogits(sliced if published is None else rank_sum.Partials(sliced, published))

    def whole(self) -> torch.Tensor:
        """[R, V] in one tensor (a torch consumer's: gathered parts only, `rank_sum.plain`)."""
        rank_sum.plain(self.parts, "logits")
        return torch.cat(list(self.parts), dim=1)


def _whole(logits):
    return logits.whole() if isinstance(logits, SplitLogits) else logits


def sample(logits: torch.Tensor, params: torch.Tensor, key: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Greedy when params[0] (temperature) is 0, else a draw: both computed, one selected (no branch on a
    device value). -> int64 [R], written into `out` where given (a caller's buffer: no copy after).
    `logits` may be a `SplitLogits` (gathered: the reference reads a tensor)."""
    logits = _whole(logits)
    greedy = logits.argmax(-1)
    drawn = draw(distribution(logits, params), key)
    return _into(out, torch.where(params[0] == 0, greedy, drawn))


def sample_sum(base: torch.Tensor, addend: torch.Tensor, params: torch.Tensor, key: torch.Tensor, out: torch.Tensor,
               total: torch.Tensor, table: torch.Tensor | None = None, next_row: torch.Tensor | None = None
               ) -> torch.Tensor:
    """DSpark's Markov step: sample from base + addend (float32 [R, V]: the head's logits and the Markov
    head's; either may be a `SplitLogits`), the sum kept in `total` (the draft's logits), the ids in
    `out`; where `table` is given, its row of each drawn id into `next_row` [R, W] (the next step's Markov
    input). -> out."""
    torch.add(_whole(base), _whole(addend), out=total)
    sample(total, params, key, out)
    if table is not None:
        torch.index_select(table, 0, out, out=next_row)
    return out


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """`result`, or `out` holding it where a caller gave its buffer (the fast ops write theirs in place)."""
    if out is None:
        return result
    require(out.shape == result.shape, "out.shape", tuple(out.shape), f"must be {tuple(result.shape)}")
    return out.copy_(result)


def accept(target: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, params: torch.Tensor,
           key: torch.Tensor, force: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """target logits [k+1, V], drafts [k], draft_logits [k, V], force [] int64 (benchmarks: accept exactly
    min(force, k) drafts, then the target's argmax; -1: off) -> int64 [k+3]: the tokens produced j+1, the
    accepted drafts j, then k+1 ids (the j accepted drafts, the next token b, zeros): the decode cycle's result,
    written into `out` where given. `target` may be a `SplitLogits`."""
    target = _whole(target)
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
    j, b = torch.where(sampled, j_sampled, j_greedy), torch.where(sampled, b_sampled, b_greedy)
    forced = force.clamp(max=k)
    j = torch.where(force >= 0, forced, j)
    b = torch.where(force >= 0, best.gather(0, forced.clamp(min=0).view(1))[0], b)
    idx = torch.arange(k + 1, device=drafts.device)
    padded = torch.cat((drafts, torch.zeros(1, dtype=drafts.dtype, device=drafts.device)))
    ids = torch.where(idx < j, padded, torch.where(idx == j, b, torch.zeros_like(b)))
    return _into(out, torch.cat(((j + 1).view(1), j.view(1), ids)))


# --- Triton kernels --------------------------------------------------------------------------------------


@device_function
def _key(v):
    """float32 >= 0 -> its bit pattern as int64 (same order)."""
    return v.to(tl.int32, bitcast=True).to(tl.int64)


@device_function
def _row_distribution(lrow, prow, params_ptr, V, seed, base, TOP: tl.constexpr, DRAW: tl.constexpr,
                      BV: tl.constexpr):
    """One row's truncated, renormalized distribution: the logits at `lrow` (any float dtype) -> float32 [V]
    stored at `prow`. Returns (the argmax of the logits themselves (TOP), the exponential race's draw over
    the row as its last pass stores it (DRAW: the generator's values at counters base.., `seed`))."""
    temperature = tl.maximum(tl.load(params_ptr), 1e-5)
    top_p = tl.load(params_ptr + 1)
    top_k = tl.load(params_ptr + 2).to(tl.int64)
    # softmax of logits / temperature (the division in float32, as the reference does it)
    mx = tl.full((1,), float("-inf"), dtype=tl.float32)
    top = tl.full((1,), float("-inf"), dtype=tl.float32)
    top_i = tl.zeros((1,), dtype=tl.int64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        raw = tl.load(lrow + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = raw / temperature
        mx = tl.maximum(mx, tmax(x, axis=0))
        if TOP:  # of the logits themselves: a division can round two of them to one value
            top, top_i = _block_argmax(raw, cols, V, BV, top, top_i)
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
    # the kept entries renormalized; DRAW: the exponential race argmax(p / E) over them as they are stored
    best = tl.full((1,), float("-inf"), dtype=tl.float32)
    best_i = tl.zeros((1,), dtype=tl.int64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        p = tl.load(prow + cols, mask=cols < V, other=0.0)
        p = tl.where(_key(p) >= thr, p, 0.0) / kept
        tl.store(prow + cols, p, mask=cols < V)
        if DRAW:
            best, best_i = _block_argmax(p / _exponential(seed, base + cols), cols, V, BV, best, best_i)
    return top_i, best_i


@device_function
def _fill_row(a_parts, width, stride_a, flags, rank, capacity, r, l_row, b_parts, stride_b, b_flags, b_rank,
              b_capacity, SUM: tl.constexpr, WAIT: tl.constexpr, WORLD: tl.constexpr, WORLD_B: tl.constexpr,
              B_WAIT: tl.constexpr, BV: tl.constexpr):
    """Store row r of the rows held by columns at `a_parts` (WORLD ranks' `width` columns each, waited for over
    symmetric memory: WAIT; one whole row: WORLD 1) into `l_row`, added to row r of `b_parts`' first (SUM:
    the float32 add as torch makes it, b + a; b whole, WORLD_B 1, or held as a is, gathered or waited for
    over its own exchange: B_WAIT), a rank's columns at a time."""
    base = rank_arrive(flags, rank, capacity, WAIT, WORLD)
    b_base = rank_arrive(b_flags, b_rank, b_capacity, B_WAIT, WORLD_B)
    for q in tl.static_range(WORLD):
        for c0 in range(0, width, BV):
            cols = c0 + tl.arange(0, BV)
            mine = cols < width
            x = tl.load(a_parts[q] + base + r * stride_a + cols, mask=mine, other=0.0)
            if SUM:
                if WORLD_B == 1:
                    x = tl.load(b_parts[0] + r * stride_b + q * width + cols, mask=mine) + x
                else:
                    x = tl.load(b_parts[q] + b_base + r * stride_b + cols, mask=mine) + x
            tl.store(l_row + q * width + cols, x, mask=mine)
    tl.debug_barrier()  # stored before this program reads the row back


@triton.jit
def _distribution_kernel(a_parts,  # FILL: WORLD pointers, rows held by columns (`width` each, row stride
                         width, stride_a,  # stride_a; one whole row: WORLD 1), stored into l's rows first
                         flags, rank, capacity,  # ... waited for over symmetric memory (WAIT: arrival_args)
                         l_ptr,  # logits [R, V] (any float dtype), row stride stride_l
                         p_ptr,  # out float32 [R, V]: the truncated, renormalized distribution
                         params_ptr,  # float32 [3]: temperature, top_p, top_k (read on the device)
                         key_ptr,  # int64 [2]: seed, counter (DRAW: advanced by R * V, by the last program)
                         cnt_ptr,  # int32 counter of finished programs, zero between launches (DRAW)
                         out_ptr,  # out int64 [R]: each row's token (DRAW)
                         b_parts, stride_b,  # SUM: rows whole (WORLD_B 1) or held as a's, added to a's
                         b_flags, b_rank, b_capacity,  # ... waited for over their own exchange (B_WAIT)
                         tab_ptr,  # GATHER: float32 [V, W] table whose row of each drawn token ...
                         row_ptr,  # ... is stored into row r of [R, W] (row stride stride_row)
                         W, stride_row,
                         V, stride_l, DRAW: tl.constexpr, BV: tl.constexpr, FILL: tl.constexpr, SUM: tl.constexpr,
                         WORLD: tl.constexpr, WORLD_B: tl.constexpr, WAIT: tl.constexpr, B_WAIT: tl.constexpr,
                         GATHER: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    r = tl.program_id(0).to(tl.int64)
    seed = tl.zeros((1,), dtype=tl.int64)
    base = seed
    if DRAW:  # the counter as every program reads it, before the last one advances it
        seed = tl.load(key_ptr + tl.arange(0, 1))
        base = tl.load(key_ptr + 1 + tl.arange(0, 1)) + r * V
    if FILL:  # the row the passes below read: the split logits, or the float32 sum as torch adds it
        _fill_row(a_parts, width, stride_a, flags, rank, capacity, r, l_ptr + r * stride_l, b_parts, stride_b,
                  b_flags, b_rank, b_capacity, SUM, WAIT, WORLD, WORLD_B, B_WAIT, BV)
    top_i, best_i = _row_distribution(l_ptr + r * stride_l, p_ptr + r * V, params_ptr, V, seed, base,
                                      DRAW, DRAW, BV)
    if DRAW:  # the greedy token where the temperature is 0
        best_i = tl.where(tl.load(params_ptr + tl.arange(0, 1)) == 0, top_i, best_i)
        tl.store(out_ptr + r + tl.arange(0, 1), best_i)
        if GATHER:
            w = tl.arange(0, BW)
            tl.store(row_ptr + r * stride_row + w, tl.load(tab_ptr + best_i * W + w, mask=w < W), mask=w < W)
        # the counter moves once every program has read it
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.store(key_ptr + 1 + tl.arange(0, 1), tl.load(key_ptr + 1 + tl.arange(0, 1)) + tl.num_programs(0) * V)
            tl.atomic_xchg(cnt_ptr, 0)  # ready for the next launch (a graph replays this one)


def fast_distribution(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The kernel for `distribution` (same signature and result, see the tolerance above)."""
    return _distribution(logits, params)


def _check_logits(logits: torch.Tensor, name: str, params: torch.Tensor) -> None:
    require(logits.dim() == 2, f"{name}.dim()", logits.dim(), "must be 2 ([R, V])")
    require_dtype(logits, name, (torch.float32, torch.bfloat16, torch.float16))
    require_rows(logits, name)
    require_dtype(params, "params", (torch.float32,))
    require(tuple(params.shape) == (3,), "params.shape", tuple(params.shape), "must be (3,): temperature, top_p, top_k")


def _fill_args(fill) -> tuple:
    """The distribution and gathering kernels' FILL arguments for rows held by columns (a `SplitLogits`, or a
    plain float32 [R, V] tensor: one rank's whole rows): (pointers, width, row stride, the wait's) and their
    WORLD and WAIT."""
    parts = fill.parts if isinstance(fill, SplitLogits) else [fill]
    require(len(parts) <= rank_sum.MAX_WORLD, "len(parts)", len(parts), f"must be at most {rank_sum.MAX_WORLD}")
    wait, waits = rank_sum.arrival_args(parts)
    return (tuple(parts), parts[0].shape[1], parts[0].stride(0), *wait), len(parts), waits


def _distribution(logits: torch.Tensor, params: torch.Tensor, key: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, fill=None, base=None,
                  gather: tuple | None = None) -> torch.Tensor:
    """fast_distribution's launch; with `key`, each row's token drawn in it too (fast_sample) into `out`;
    `fill` (a float32 [R, V] tensor or a `SplitLogits`): the rows stored into `logits` first, added to
    `base`'s where given (a tensor, or held as `fill` is, never waited for: fast_sample_sum's sum); `gather` (table,
    next_row): each drawn token's table row stored (fast_sample_sum)."""
    _check_logits(logits, "logits", params)
    dev = device_of(logits, params, key)
    r, v = logits.shape
    p = torch.empty((r, v), dtype=torch.float32, device=dev)
    if r and v:
        bv = min(pow2(v), 4096 if INTERPRET else 2048)
        draw = key is not None
        table, row = gather or (p, p)  # placeholders where unused (and p for fill and base): never read
        a_args, world, waits = _fill_args(p if fill is None else fill)
        b_parts = base.parts if isinstance(base, SplitLogits) else [p if base is None else base]
        b_wait, b_waits = rank_sum.arrival_args(b_parts)
        _distribution_kernel[(r,)](*a_args, logits, p, params, key if draw else p, counters(dev, 1) if draw else p,
                                   out if draw else p, tuple(b_parts), b_parts[0].stride(0), *b_wait, table, row,
                                   table.shape[1], row.stride(0), v, logits.stride(0), DRAW=draw, BV=bv,
                                   FILL=fill is not None, SUM=base is not None, WORLD=world, WORLD_B=len(b_parts),
                                   WAIT=waits, B_WAIT=b_waits, GATHER=gather is not None,
                                   BW=pow2(table.shape[1]) if gather else 1, **pdl(logits.device))
    return p


@device_function
def _uniform(seed, counter):
    """float32 uniforms for the int64 counters `counter` (a block): the reference's splitmix64 bits, the
    uniform u = (top 53 bits) * 2^-53 rounded once to float32 (relative precision 2^-24 at every magnitude,
    so the small draws that win a race keep their digits)."""
    x = counter * _GOLDEN_K
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * _M1_K
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * _M2_K
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    x = seed * _GOLDEN_K + x
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * _M1_K
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * _M2_K
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return ((x >> 11) & 0x1FFFFFFFFFFFFF).to(tl.float32) * 1.1102230246251565e-16  # 2^-53


@device_function
def _exponential(seed, counter):
    """float32 Exp(1) draws for the int64 counters `counter` (a block): E = -log1p(-u) of `_uniform`'s u by
    log(w) * u / (1 - w) with w = 1 - u (where w rounds to 1, E = u), a few ulps of the float64 value."""
    u = _uniform(seed, counter)
    w = tl.maximum(1.0 - u, 1e-30)  # u rounded up to 1: a large finite E (that entry cannot win)
    exact = w == 1.0
    return tl.where(exact, u, -tl.log(w) * (u / tl.where(exact, 1.0, 1.0 - w)))


@device_function
def _block_argmax(x, cols, V, BV: tl.constexpr, best, best_i):
    """The running (max, lowest index of it) over blocks taken in order, updated by block x at cols."""
    x = tl.where(cols < V, x, float("-inf"))
    cmax = tmax(x, axis=0)
    ci = tmin(tl.where(x == cmax, cols, V + BV), axis=0).to(tl.int64)
    better = cmax > best  # strictly: an equal later maximum keeps the lower index
    return tl.where(better, cmax, best), tl.where(better, ci, best_i)


def fast_sample(logits, params: torch.Tensor, key: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for `sample` (same signature): one launch, the distribution kernel drawing from each row as
    it stores it (the race in float32 over the reference's counter values: the same draws except where two
    entries' p / E are within a few float32 ulps, the tolerance above), the greedy argmax of the logits
    beside it, one selected by the temperature on the device; the ids written into `out` where given. A
    `SplitLogits`' rows are read where the ranks hold them, into a row of the launch's own first."""
    fill = logits if isinstance(logits, SplitLogits) else None
    if fill is not None:
        logits = torch.empty(fill.shape, dtype=torch.float32, device=fill.parts[0].device)
    _check_logits(logits, "logits", params)
    r, v = logits.shape
    if out is None:
        out = (torch.empty if v else torch.zeros)(r, dtype=torch.int64, device=logits.device)  # every row stored
    else:
        _check_out(out, r, logits.device)
        if not v:
            out.zero_()
    _distribution(logits, params, key, out, fill=fill)
    return out


def fast_sample_sum(base, addend, params: torch.Tensor, key: torch.Tensor, out: torch.Tensor, total: torch.Tensor,
                    table: torch.Tensor | None = None, next_row: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for `sample_sum` (same signature): fast_sample's launch, whose programs first store their
    row's sum (the float32 add, torch's bits; `SplitLogits` read where the ranks hold them: a base gathered or
    in symmetric memory of its own, an addend in symmetric memory too, each waited for) and last the drawn
    token's table row; one launch, not four."""
    r, v = total.shape
    given = [("total", total, (r, v))]
    for name, rows in (("base", base), ("addend", addend)):
        if isinstance(rows, SplitLogits):
            require(tuple(rows.shape) == (r, v), f"{name}.shape", tuple(rows.shape), f"must be {(r, v)}")
        else:
            given.append((name, rows, (r, v)))
    if isinstance(base, SplitLogits):
        require(isinstance(addend, SplitLogits) and len(addend.parts) == len(base.parts), "base", "split logits",
                "need an addend split over as many ranks")
        require(not _one_exchange(base, addend), "base", "published logits",
                "must be gathered or published through an exchange of their own (not the addend's slots)")
    if table is not None:  # a row for each token, W wide
        given += [("table", table, (v, table.shape[-1])), ("next_row", next_row, (r, table.shape[-1]))]
        require(table.is_contiguous(), "table.stride", table.stride(), "must be contiguous")
    for name, t, shape in given:
        require(t is not None and tuple(t.shape) == shape, f"{name}.shape", t if t is None else tuple(t.shape),
                f"must be {shape}")
        require_dtype(t, name, (torch.float32,))
        require_rows(t, name)
    _check_out(out, r, total.device)
    if not v:
        out.zero_()
    _distribution(total, params, key, out, addend, base, None if table is None else (table, next_row))
    return out


def _one_exchange(a: SplitLogits, b: SplitLogits) -> bool:
    """Whether both are published through the same symmetric buffer (a kernel finds one call's slot there)."""
    pa, pb = getattr(a.parts, "published", None), getattr(b.parts, "published", None)
    return pa is not None and pb is not None and pa.buffer is pb.buffer


def _check_out(out: torch.Tensor, n: int, device: torch.device) -> None:
    """A caller's buffer for n ids, where the kernel can store them."""
    require(tuple(out.shape) == (n,), "out.shape", tuple(out.shape), f"must be ({n},)")
    require_dtype(out, "out", (torch.int64,))
    require(out.is_contiguous(), "out.stride", out.stride(), "must be contiguous")
    require(out.device == device, "out.device", str(out.device), f"must be {device}")


ACCEPT_REGISTERS = 128  # the acceptance launch's register cap (ptxas' maxnreg; fast_accept)


@triton.jit
def _accept_kernel(a_parts, width, stride_a,  # FILL: the target rows held by columns (`_fill_args`) ...
                   flags, rank, capacity,  # ... waited for over symmetric memory (WAIT), stored into t's rows
                   t_ptr,       # [K+1, V] the target rows' logits (any float dtype), row stride stride_t
                   dl_ptr,      # [K, V] the drafter's, row stride stride_d
                   p_ptr,       # float32 [K+1, V] scratch: the target rows' distributions
                   r_ptr,       # float32 [K, V] scratch: the drafter's
                   best_ptr,    # int64 [K+1] scratch: the argmax of each target row's logits
                   d_ptr,       # int64 [K]: the drafts
                   key_ptr,     # int64 [2]: seed, counter (advanced by K + (K+1) V, by the last program)
                   params_ptr,  # float32 [3]: temperature first (0: greedy)
                   force_ptr,   # int64 []: accept exactly min(force, K) drafts (-1: off)
                   draws_ptr,   # int64 [K+1] scratch: row i's draw, the next token if i is the first miss
                   cnt_ptr,     # int32 counter of finished programs (zero between launches)
                   out_ptr,     # out int64 [K+3]: j+1, j, the K+1 ids (accept's result)
                   K, V, stride_t, stride_d, KB: tl.constexpr, BV: tl.constexpr, FILL: tl.constexpr,
                   WORLD: tl.constexpr, WAIT: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    i = tl.program_id(0).to(tl.int64)
    if FILL:  # this program's target row gathered first (no program reads another's)
        _fill_row(a_parts, width, stride_a, flags, rank, capacity, i, t_ptr + i * stride_t, a_parts, 0, flags, rank,
                  capacity, False, WAIT, WORLD, 1, False, BV)
    seed = tl.load(key_ptr + tl.arange(0, 1))
    counter = tl.load(key_ptr + 1 + tl.arange(0, 1))
    base = counter + K + i * V  # the acceptance tests take the first K values, the rows' races the next
    prow, rrow = p_ptr + i * V, r_ptr + i * V
    residual = i < K  # rows below K draw from normalize(max(0, p - r)) (p where that is all zero)
    # this row's distributions first: the target's (its logits' argmax beside it), the drafter's below K
    top_i, _ = _row_distribution(t_ptr + i * stride_t, prow, params_ptr, V, seed, base, True, False, BV)
    tl.store(best_ptr + i + tl.arange(0, 1), top_i)
    if residual:
        _row_distribution(dl_ptr + i * stride_d, rrow, params_ptr, V, seed, base, False, False, BV)
    tl.debug_barrier()  # the rows are stored before this program reads them back
    total = tl.zeros((1,), dtype=tl.float32)
    if residual:
        for v0 in range(0, V, BV):
            cols = v0 + tl.arange(0, BV)
            p = tl.load(prow + cols, mask=cols < V, other=0.0)
            q = tl.load(rrow + cols, mask=cols < V, other=0.0)
            total += tsum(tl.maximum(p - q, 0.0), axis=0)
    best = tl.full((1,), float("-inf"), dtype=tl.float32)
    best_i = tl.zeros((1,), dtype=tl.int64)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = tl.load(prow + cols, mask=cols < V, other=0.0)
        if residual:
            q = tl.load(rrow + cols, mask=cols < V, other=0.0)
            x = tl.where(total > 0, tl.maximum(x - q, 0.0) / tl.where(total > 0, total, 1.0), x)
        best, best_i = _block_argmax(x / _exponential(seed, base + cols), cols, V, BV, best, best_i)
    tl.store(draws_ptr + i + tl.arange(0, 1), best_i)
    tl.debug_barrier()  # the draw is stored before the counter's release
    # the last program to finish sees every row's draw (the count's acquire-release orders them)
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        idx = tl.arange(0, KB).to(tl.int64)
        draft = idx < K
        d = tl.load(d_ptr + idx, mask=draft, other=0)
        top = tl.load(best_ptr + idx, mask=idx <= K, other=0)
        j_greedy = tmin(tl.where(draft & (d == top), KB, idx), axis=0)  # the first draft off the argmax
        pd = tl.load(p_ptr + idx * V + d, mask=draft, other=0.0)
        rd = tl.load(r_ptr + idx * V + d, mask=draft, other=0.0)
        ok = draft & (_uniform(seed, counter + idx) * rd < pd)
        j_sampled = tmin(tl.where(ok, KB, idx), axis=0)  # the first rejected draft
        draws = tl.load(draws_ptr + idx, mask=idx <= K, other=0, volatile=True)
        b_greedy = tsum(tl.where(idx == j_greedy, top, 0), axis=0)
        b_sampled = tsum(tl.where(idx == j_sampled, draws, 0), axis=0)
        sampled = tl.load(params_ptr) > 0
        j = tl.where(sampled, j_sampled, j_greedy)
        b = tl.where(sampled, b_sampled, b_greedy)
        force = tl.load(force_ptr)
        forced = tl.minimum(force, K)
        j = tl.where(force >= 0, forced, j)
        b = tl.where(force >= 0, tsum(tl.where(idx == forced, top, 0), axis=0), b)
        ids = tl.where(idx < j, d, tl.where(idx == j, b, 0))
        tl.store(out_ptr + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, j + 1, j))
        tl.store(out_ptr + 2 + idx, ids, mask=idx <= K)
        tl.store(key_ptr + 1 + tl.arange(0, 1), counter + K + (K + 1) * V)
        tl.atomic_xchg(cnt_ptr, 0)  # ready for the next launch (a graph replays this one)


def fast_accept(target, drafts: torch.Tensor, draft_logits: torch.Tensor, params: torch.Tensor,
                key: torch.Tensor, force: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for `accept` (same signature and result), one launch: each program makes its row's
    distributions (the target's, with its logits' argmax, and the drafter's) and draws from them; the last to
    finish accepts (writing `out` where given). A `SplitLogits` target's programs first gather their rows
    where the ranks hold them (waiting for them in symmetric memory)."""
    fill = target if isinstance(target, SplitLogits) else None
    if fill is not None:
        require(len(fill.shape) == 2, "target.shape", tuple(fill.shape), "must be [k+1, V]")
        target = torch.empty(tuple(fill.shape), dtype=torch.float32, device=fill.parts[0].device)
    require(target.dim() == 2, "target.dim()", target.dim(), "must be 2 ([k+1, V])")
    k, v = drafts.numel(), target.shape[1]
    require(tuple(target.shape) == (k + 1, v), "target.shape", tuple(target.shape), f"must be ({k + 1}, V): k+1 rows")
    require(tuple(draft_logits.shape) == (k, v), "draft_logits.shape", tuple(draft_logits.shape),
            f"must be ({k}, {v}): a row per draft")
    require_dtype(drafts, "drafts", (torch.int64,))
    require_dtype(force, "force", (torch.int64,))
    _check_logits(target, "target", params)
    _check_logits(draft_logits, "draft_logits", params)
    dev = device_of(target, drafts, draft_logits, params, key, force)
    best = torch.empty(k + 1, dtype=torch.int64, device=dev)
    p = torch.empty((k + 1, v), dtype=torch.float32, device=dev)
    r = torch.empty((k, v), dtype=torch.float32, device=dev)
    draws = torch.empty(k + 1, dtype=torch.int64, device=dev)
    if out is None:
        out = torch.empty(k + 3, dtype=torch.int64, device=dev)
    else:
        _check_out(out, k + 3, dev)
    bv = min(pow2(v), 4096 if INTERPRET else 2048)
    # k + 1 programs: occupancy is moot, registers are not. ptxas' own choice for this launch on sm_103 with
    # PDL was 64 registers and 8 bytes spilled at V4.1's vocabulary (passes of 1,024 or eight warps moved the
    # spill); allowed 128 it takes 96 on sm_90, 88 on sm_103 and spills none (the compile check, 2026-12-06)
    a_args, world, waits = _fill_args(target if fill is None else fill)
    _accept_kernel[(k + 1,)](*a_args, target, draft_logits, p, r, best, drafts, key, params, force, draws,
                             counters(dev, 1), out, k, v, target.stride(0), draft_logits.stride(0) if k else v,
                             KB=pow2(k + 1), BV=bv, FILL=fill is not None, WORLD=world, WAIT=waits,
                             maxnreg=ACCEPT_REGISTERS, **pdl(dev))
    return out
