"""The MoE sub-block's kernels: the router (sqrt-softplus / sigmoid / softmax scores, bias, top-k, normalized
and scaled weights, hash routing), the grouped experts (SwiGLU with clamps, weight before or after w2, plus
the shared expert) and the mHC expand of their sum, against the references.

Tolerance (kernels/moe.py): router weights within 2^-20 relative (float32 score functions), indices equal;
expert outputs within 2^-12 of the largest output for float32 and 2^-6 for bfloat16 (a float32 GEMM sum can
move an FP8 code of h by one e4m3 step: in float32, one row may take bfloat16's tolerance). Rows together
equal rows one at a time, bit for bit; a row of NaN logits still selects k distinct experts in range."""

import pytest
import torch

import kernels._triton
from kernels import moe, rank_sum, router
from kernels.bench import dense_weight, fp4_weight, fp8_weight
from kernels.phases import launched_apart

from .kernel_check import DEVICE, assert_close, assert_equal, assert_rows_invariant, requires_cuda, run, seed

W_TOL = 2.0**-20
TOL = {torch.float32: 2.0**-12, torch.bfloat16: 2.0**-6}


def assert_streams_close(want, got, context):
    """Streams within TOL of the largest output, except that in float32 one row may be off by as much as
    bfloat16's: one e4m3 step of one element of its h (an FP8 rounding of h that the kernel's float32 GEMM
    sum, in another order than the reference's, puts on the other side of a rounding boundary: seen once in
    the suite's runs, every other row within 2^-24)."""
    tol, scale = TOL[want.dtype], want.abs().max()
    off = ((got - want).abs().flatten(1).amax(1) > tol * scale).nonzero().flatten()
    if want.dtype == torch.float32 and len(off) == 1:
        assert_close("streams of a row with one e4m3 step of h", want[off], got[off], 0.0,
                     TOL[torch.bfloat16] * scale.item(), context=context)
        got = got.clone()
        got[off] = want[off]  # the other rows: within float32's tolerance
    assert_close("streams", want, got, tol, context=context)


def by_expert(w, idx):
    """Route outputs in expert order (topk's order among its k picks is not part of the contract)."""
    order = idx.argsort(-1)
    return w.gather(-1, order), idx.gather(-1, order)


def experts_for(n_experts, d, inter, fmt, device, held=None):
    def one():
        if fmt == "fp4":
            return fp4_weight(inter, d, device, 2.0), fp4_weight(d, inter, device), fp4_weight(inter, d, device, 2.0)
        b = (32, 32)
        up = fp8_weight(inter, d, b, device, 2.0)
        return up, fp8_weight(d, inter, b, device), fp8_weight(inter, d, b, device, 2.0)

    return [one() if held is None or e in held else None for e in range(n_experts)]


def ffn_args(m, d, inter, n_experts, k, fmt, dt, before, with_shared, limit, score_func="sqrtsoftplus",
             gate_dtype=torch.bfloat16, hashed=False, shared_inter=None, device=DEVICE):
    gate = dense_weight(n_experts, d, gate_dtype, device)
    bias = None if hashed else torch.randn(n_experts, device=device) * 0.1
    hidx = torch.stack([torch.randperm(n_experts, device=device)[:k] for _ in range(m)]) if hashed else None
    experts = experts_for(n_experts, d, inter, fmt, device)
    shared = experts_for(1, d, shared_inter or inter, "fp8", device)[0] if with_shared else None
    x = torch.randn(m, d, device=device).to(dt)
    x[-1] = x[0]  # two rows route alike: each chosen expert's weights serve both
    X = torch.randn(m, 4, d, device=device).to(dt)
    post, comb = torch.rand(m, 4, device=device) * 2, torch.rand(m, 4, 4, device=device)
    return (x, gate, bias, k, score_func, 1.5, 1e-20, hidx, experts, shared, 32, limit, before, X, post, comb)


def check_ffn(*case, **kw):
    s = seed()
    args = ffn_args(*case, **kw)
    ctx = f"(seed {s}, {case} {kw})"
    want = moe.reference_ffn(*args)
    got = run(moe.fast_ffn, *args)
    ww, wi = by_expert(want[1], want[2])
    gw, gi = by_expert(got[1], got[2])
    assert_equal("indices", wi, gi, ctx)
    assert_close("weights", ww, gw, W_TOL, context=ctx)
    assert_streams_close(want[0], got[0], ctx)


@pytest.mark.parametrize("m,d,inter,e,k,fmt,dt,before,shared,limit", [
    (5, 96, 64, 7, 2, "fp4", torch.float32, True, True, 10.0),
    (3, 64, 96, 5, 3, "fp8", torch.bfloat16, False, True, 0.0),
    (1, 128, 32, 9, 2, "fp4", torch.bfloat16, True, False, 2.0),
    (20, 64, 64, 6, 2, "fp4", torch.bfloat16, True, True, 10.0),  # two blocks of rows: pairs sorted by torch
])
def test_the_moe_sub_block_matches_the_reference(m, d, inter, e, k, fmt, dt, before, shared, limit):
    check_ffn(m, d, inter, e, k, fmt, dt, before, shared, limit)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_the_routing_of_each_score_function_matches_the_reference(score_func):
    check_ffn(4, 64, 32, 11, 3, "fp4", torch.float32, True, True, 10.0, score_func=score_func)


def test_a_shared_expert_split_over_ranks_may_be_narrower_than_the_routed_ones():
    check_ffn(3, 64, 96, 6, 2, "fp4", torch.bfloat16, True, True, 10.0, shared_inter=32)


def test_hash_routing_follows_the_table_rows():
    check_ffn(4, 64, 32, 9, 3, "fp8", torch.float32, False, False, 10.0, gate_dtype=torch.float32, hashed=True)


def test_the_moe_sub_block_of_a_row_does_not_depend_on_the_other_rows():
    s = seed()
    args = list(ffn_args(6, 64, 64, 6, 2, "fp4", torch.bfloat16, True, True, 10.0))
    x, X, post, comb = args[0], args[13], args[14], args[15]
    ctx = f"(seed {s})"

    def call(sl, i):
        a = list(args)
        a[0], a[13], a[14], a[15] = x[sl], X[sl], post[sl], comb[sl]
        out = run(moe.fast_ffn, *a)
        return out[i] if i == 0 else by_expert(out[1], out[2])[i - 1]

    for i, name in enumerate(("streams", "route weights", "route indices")):
        assert_rows_invariant(name, lambda sl, i=i: call(sl, i), context=ctx)


@pytest.mark.parametrize("grid", ["one program walks the pairs", "a program per pair"])
@pytest.mark.parametrize("fmt,dt", [("fp4", torch.bfloat16), ("fp8", torch.float32)])
def test_experts_in_the_checkpoints_formats_match_the_reference_and_rows_stay_invariant(native, fmt, dt, grid,
                                                                                       monkeypatch):
    """The expert products in the checkpoint's formats on the tensor cores (sm_89 and later; here under the
    interpreter), with the rows staged in scratch areas per program or, where the pairs outnumber the
    experts (15 pairs of 7 experts below), per expert: the device's grid of a program per pair runs here too."""
    if grid == "a program per pair":
        monkeypatch.setattr(moe, "pairs_per_program", lambda n_pairs: 1)
    check_ffn(5, 96, 64, 7, 2, fmt, dt, True, True, 10.0)
    s = seed()
    args = list(ffn_args(6, 64, 64, 6, 2, fmt, dt, True, True, 10.0))
    x, X, post, comb = args[0], args[13], args[14], args[15]

    def streams(sl):
        a = list(args)
        a[0], a[13], a[14], a[15] = x[sl], X[sl], post[sl], comb[sl]
        return run(moe.fast_ffn, *a)[0]

    assert_rows_invariant("streams", streams, context=f"(seed {s}, {fmt} {dt})")
    assert native or not kernels._triton.INTERPRET, "no expert product multiplied in the checkpoint's formats"


@pytest.mark.parametrize("fmt,dt", [("fp4", torch.bfloat16), ("fp8", torch.float32)])
def test_a_long_call_stages_its_rows_once_and_its_chunks_give_the_same_bits(native, monkeypatch, fmt, dt):
    """Inside long_calls (a prefill chunk) every expert group walks its pairs LONG_ROWS (E4M3_LONG_ROWS on the
    e4m3 MMA) at a time, reading x's and h's rows quantized once for the launch (rows.stage_launch); the shared
    expert takes launches of its own (as on each rank of a split), with their own stagings: within the
    tolerance, and a prompt's rows give the same bits whatever its chunks."""
    staged = []
    stage = moe.stage_launch
    monkeypatch.setattr(moe, "stage_launch", lambda *a: (staged.append(a[4]), stage(*a))[1])
    s = seed()
    rows = 40
    args = list(ffn_args(rows, 96, 64, 7, 2, fmt, dt, True, True, 10.0))
    x, X, post, comb = args[0], args[13], args[14], args[15]
    ctx = f"(seed {s}, {fmt} {dt})"

    def streams(sl):
        a = list(args)
        a[0], a[13], a[14], a[15] = x[sl], X[sl], post[sl], comb[sl]
        return run(moe.fast_ffn, *a)[0]

    with kernels._triton.long_calls():
        edges = (0, 3, 29, rows)
        whole = streams(slice(0, rows))
        parts = torch.cat([streams(slice(a, b)) for a, b in zip(edges, edges[1:])])
    assert_equal("streams in chunks", whole, parts, ctx)
    assert_streams_close(moe.reference_ffn(*args)[0], whole, ctx)
    # four calls, each staging x and h for the routed experts' launches and again for the shared expert's
    assert len(staged) == 4 * 2 * 2 or not kernels._triton.INTERPRET, f"stagings {staged} {ctx}"
    assert native or not kernels._triton.INTERPRET, "no expert product multiplied in the checkpoint's formats"


class OneRank:
    """parallel/sharding.py ExpertReduce's interface on a single rank: `long`, a call's share is all its
    rows (a prefill chunk's sums by rows), else None (a decode step's sum, whole); `whole_shared`, the shared
    expert a long call takes whole for its rows where a decode step's is split (on one rank: itself)."""
    world = 1

    def __init__(self, shared_split: bool, long: bool, whole_shared=None):
        self.shared_split, self.long, self.whole_shared = shared_split, long, whole_shared

    def share(self, rows):
        return (rows, 0, rows) if self.long else None

    def sum_into(self, t, consume):
        return consume([t.clone()])

    def sum_produced(self, shape, produce, consume):  # the partial as the down kernel returns it, gathered
        return self.sum_into(produce(None), consume)

    def exchange(self, t):
        return t.clone()


class Ranks(OneRank):
    """ExpertReduce's decode-step interface over `world` made-up ranks: this rank's partials t and the
    others' (random, from `seed`: sums whose rounding depends on the order of the adds) given to the consumer
    (`summed`: added first in rank order by torch, one part)."""

    def __init__(self, shared_split: bool, world: int, summed: bool, seed: int):
        super().__init__(shared_split, long=False)
        self.world, self.summed, self.seed = world, summed, seed

    def sum_into(self, t, consume):
        g = torch.Generator(device=t.device).manual_seed(self.seed)
        parts = [t] + [torch.randn(t.shape, generator=g, device=t.device) * 3 for _ in range(self.world - 1)]
        return consume([rank_sum.reference(parts)] if self.summed else parts)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_the_combine_adds_the_ranks_partials_as_the_rank_order_sum_does(dt):
    """Expert parallel, a decode step's per-pair outputs summed over ranks inside the combine (their partials
    added in rank order as it loads them, the shared expert's too where split): the bits of the rank-order
    sum (torch's adds) and then the combine."""
    s = seed()
    args = ffn_args(6, 96, 64, 7, 2, "fp4", dt, False, True, 10.0)
    for split in (False, True):
        for world in (2, 4):
            ctx = f"(seed {s}, {dt}, shared split: {split}, {world} ranks)"
            inside = run(moe.fast_ffn, *args, reduce=Ranks(split, world, False, s))[0]
            apart = run(moe.fast_ffn, *args, reduce=Ranks(split, world, True, s))[0]
            assert_equal("streams", apart, inside, ctx)


@pytest.mark.parametrize("grid", ["one program walks the pairs", "a program per pair"])
def test_with_ranks_a_decode_step_sends_each_rows_pairs_summed_in_expert_order(monkeypatch, grid):
    """With ranks, a decode step's down launch sums each row's routed pairs (its tiles' last programs: one
    program walking every pair, or a program per pair counting in) and what travels is those rows, then a
    split shared expert's partial rows: the rows torch's float32 adds of the pairs' outputs in expert order
    give, bit for bit."""
    if grid == "a program per pair":
        monkeypatch.setattr(moe, "pairs_per_program", lambda n_pairs: 1)
    s = seed()
    m, k = int(torch.randint(1, 6, ())), 3
    args = ffn_args(m, 96, 64, 7, k, "fp4", torch.float32, False, True, 10.0)
    calls = []
    row_sums_into = moe._row_sums_into
    monkeypatch.setattr(moe, "_row_sums_into", lambda into, o, pos, *a: calls.append(
        (o, pos, row_sums_into(into, o, pos, *a))) or calls[-1][2])
    for split in (False, True):
        run(moe.fast_ffn, *args, reduce=Ranks(split, 4, False, s))
        o, pos, sent = calls.pop()
        ctx = f"(seed {s}, {m} rows, shared split: {split}, {grid})"
        assert sent.shape == (m * (1 + split), 96), f"{tuple(sent.shape)} {ctx}"
        want = torch.zeros((m, 96))
        for j in range(k):
            want = want + o[pos[:, j]].cpu()
        assert_equal("rows' pairs' sums", want, sent[:m].cpu(), ctx)
        assert (pos.cpu().diff(dim=1) > 0).all(), f"a row's pairs out of expert order {ctx}"
        if split:  # the shared expert's partial: not one of the routed pairs' sums
            assert sent[m:].abs().sum() > 0 and not torch.equal(sent[m:], sent[:m]), ctx


class Counted:
    """A kernel whose launches are noted by name in `made` (where it is subscripted with its grid)."""

    def __init__(self, kernel, name: str, made: list):
        self.kernel, self.name, self.made = kernel, name, made

    def __getitem__(self, grid):
        self.made.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_a_decode_steps_router_and_experts_take_one_launch_with_the_bits_of_three(native, monkeypatch, dt):
    """A decode step's routing, gate and up, and down are phases of one launch (kernels/phases.py), each
    waiting for the one before: the bits of the three launches they replace (kernels/phases.py
    `launched_apart`), whole and with ranks (the down phase's rows' sums; their publish over symmetric memory
    runs in the four-rank tests), a shared expert split or not, rows 1..6, the checkpoint's formats or not; a
    long call (several row blocks) keeps three."""
    s = seed()
    m = int(torch.randint(1, 7, ()))
    fmt = ("fp4", "fp8")[int(torch.randint(0, 2, ()))]
    args = ffn_args(m, 96, 64, 7, 2, fmt, dt, bool(torch.randint(0, 2, ())), True, 10.0)
    made = []
    for mod, name in ((moe, "_step_kernel"), (moe, "_gate_up_kernel"), (moe, "_down_kernel"),
                      (router, "_router_kernel")):
        monkeypatch.setattr(mod, name, Counted(getattr(mod, name), name, made))
    for reduce in (None, Ranks(False, 4, False, s), Ranks(True, 4, False, s)):
        ctx = f"(seed {s}, {m} rows, {fmt} {dt}, ranks: {reduce is not None})"
        joined = run(moe.fast_ffn, *args, reduce=reduce)
        assert made == ["_step_kernel"], f"{made} {ctx}"
        made.clear()
        with launched_apart():
            apart = run(moe.fast_ffn, *args, reduce=reduce)
        assert made == ["_router_kernel", "_gate_up_kernel", "_down_kernel"], f"{made} {ctx}"
        made.clear()
        for name, a, b in zip(("streams", "weights", "indices"), apart, joined):
            assert_equal(name, a, b, ctx)
    long = ffn_args(40, 96, 64, 7, 2, fmt, dt, False, True, 10.0)
    run(moe.fast_ffn, *long)
    assert made == ["_router_kernel", "_gate_up_kernel", "_down_kernel"], f"{made} (40 rows: three row blocks)"


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_a_long_calls_pairs_kept_in_the_activations_dtype_give_a_decode_steps_bits(monkeypatch, dt):
    """A long call sums each row's pairs on its rank (kernels/moe.py `_combined_by_shares`): their outputs are
    stored in x's dtype (bfloat16 values: lossless), the shared expert's rows apart (where a decode step's is
    split, taken whole); on one rank its streams are the decode step's whole combine's, bit for bit, the
    shared expert whole or split."""
    s = seed()
    args = ffn_args(12, 96, 64, 7, 2, "fp4", dt, False, True, 10.0)
    stored = []
    pairs_sum = moe._pairs_sum
    monkeypatch.setattr(moe, "_pairs_sum", lambda o, *a: (stored.append(o.dtype), pairs_sum(o, *a))[1])
    for split in (False, True):
        ctx = f"(seed {s}, {dt}, shared split: {split})"
        step = run(moe.fast_ffn, *args, reduce=OneRank(split, long=False))[0]
        long = run(moe.fast_ffn, *args, reduce=OneRank(split, long=True, whole_shared=args[9]))[0]
        assert_equal("streams of a long call", step, long, ctx)
    assert stored == [dt, dt], stored


def test_a_router_row_of_nans_selects_distinct_experts_in_range():
    for score_func in ("sqrtsoftplus", "sigmoid", "softmax"):
        for hashed_bias in (False, True):
            args = list(ffn_args(3, 64, 32, 23, 6, "fp4", torch.float32, True, False, 10.0, score_func=score_func))
            args[0] = args[0].clone()
            args[0][1] = float("nan")
            if hashed_bias:
                args[2] = None
            idx = run(moe.fast_ffn, *args)[2]
            assert ((idx >= 0) & (idx < 23)).all(), f"{score_func}: expert ids out of range: {idx.tolist()}"
            assert all(len(set(r)) == 6 for r in idx.tolist()), f"{score_func}: repeated expert ids: {idx.tolist()}"


def test_the_moe_sub_block_refuses_a_gate_for_other_experts():
    args = list(ffn_args(2, 64, 32, 5, 2, "fp4", torch.float32, True, False, 10.0))
    args[8] = args[8][:4]
    with pytest.raises(ValueError, match=r"experts=4: must be one per gate row \(5\)"):
        moe.fast_ffn(*args)


def test_pairs_past_int32_offsets_are_refused_naming_the_field():
    """The pairs' rows are addressed with int32 offsets (output_row): a call of 2^31 values or more is refused
    before any launch (meta tensors: nothing allocated)."""
    d = 2 ** int(torch.randint(6, 14, ()))
    rows = 2**31 // d
    pos = torch.zeros((0, 1), dtype=torch.int64, device="meta")  # no rows to sum: the check alone runs
    moe._pairs_sum(torch.empty((rows - 1, d), device="meta"), pos, torch.empty((0, d), device="meta"))
    with pytest.raises(ValueError, match=rf"pairs={rows}: must hold under 2\^31 values \({d} a row\)"):
        moe._pairs_sum(torch.empty((rows, d), device="meta"), pos, torch.empty((0, d), device="meta"))


@requires_cuda
class TestMoeAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_the_moe_sub_block_matches_the_reference_at_v41_shapes(self, m):
        check_ffn(m, 5120, 2304, 384, 6, "fp4", torch.bfloat16, True, True, 10.0, device=torch.device("cuda"))
