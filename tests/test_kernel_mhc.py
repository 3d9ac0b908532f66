"""The mHC kernels (coeffs with Sinkhorn, V4's head pre, collapse, a sub-block's input with the expand before
it) against their references.

Tolerance (kernels/mhc.py): coefficients within 2^-16 of the largest (float32 projection and Sinkhorn);
streams within 2^-20 of the largest for float32 and one bfloat16 rounding for bfloat16. Rows together equal
rows one at a time, bit for bit."""

import pytest
import torch

from kernels import mhc, moe, rank_sum
from kernels.bench import fp8_weight

from .kernel_check import DEVICE, assert_close, assert_equal, assert_rows_invariant, requires_cuda, run, seed

COEFF_TOL = 2.0**-16
TOL = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7}


def params(hc, d, device, head=False):
    j = hc if head else hc * (2 + hc)
    fn = torch.randn(j, hc * d, device=device) / (hc * d) ** 0.5
    return fn, torch.randn(j, device=device), 0.5 + torch.rand(3 if not head else 1, device=device)


def check(m, hc, d, dt, device=DEVICE):
    s = seed()
    ctx = f"(seed {s}, M={m} hc={hc} D={d} {dt})"
    X = (torch.randn(m, hc, d, device=device) * 2).to(dt)
    fn, base, scale = params(hc, d, device)
    want = mhc.coeffs(X, fn, base, scale, 1e-20, 1e-6, 20)
    got = run(mhc.fast_coeffs, X, fn, base, scale, 1e-20, 1e-6, 20)
    for name, w, g in zip(("pre", "post", "comb"), want, got):
        assert_close(name, w, g, COEFF_TOL, context=ctx)
    hfn, hbase, hscale = params(hc, d, device, head=True)
    assert_close("head pre", mhc.head_pre(X, hfn, hbase, hscale, 1e-20, 1e-6),
                 run(mhc.fast_head_pre, X, hfn, hbase, hscale, 1e-20, 1e-6), COEFF_TOL, context=ctx)
    assert_close("collapse", mhc.collapse(X, want[0]), run(mhc.fast_collapse, X, want[0]), TOL[dt], context=ctx)


@pytest.mark.parametrize("m,hc,d,dt", [(1, 4, 48, torch.float32), (7, 4, 100, torch.bfloat16),
                                       (3, 3, 37, torch.float32)])
def test_mhc_kernels_match_the_references_on_odd_shapes(m, hc, d, dt):
    check(m, hc, d, dt)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_mhc_rows_do_not_depend_on_the_other_rows(dt):
    s = seed()
    ctx = f"(seed {s}, {dt})"
    X = (torch.randn(6, 4, 40, device=DEVICE) * 2).to(dt)
    fn, base, scale = params(4, 40, DEVICE)
    for i, name in enumerate(("pre", "post", "comb")):
        assert_rows_invariant(name, lambda sl, i=i: run(mhc.fast_coeffs, X[sl], fn, base, scale, 1e-20, 1e-6, 20)[i],
                              context=ctx)
    hfn, hbase, hscale = params(4, 40, DEVICE, head=True)
    assert_rows_invariant("head pre", lambda sl: run(mhc.fast_head_pre, X[sl], hfn, hbase, hscale, 1e-20, 1e-6),
                          context=ctx)
    pre, post, comb = mhc.coeffs(X, fn, base, scale, 1e-20, 1e-6, 20)
    y = torch.randn(6, 40, device=DEVICE).to(dt)
    assert_rows_invariant("collapse", lambda sl: run(mhc.fast_collapse, X[sl], pre[sl]), context=ctx)
    norm = torch.rand(40, device=DEVICE)
    for i, name in enumerate(("expanded X", "x", "pre", "post", "comb")):
        assert_rows_invariant(name, lambda sl, i=i: run(mhc.fast_expand_pre, y[sl], X[sl], post[sl], comb[sl], pre[sl],
                                                        fn, base, scale, 1e-20, 1e-6, 20, norm, 1e-6)[i], context=ctx)


def test_mhc_coeffs_refuse_a_projection_of_the_wrong_shape():
    X = torch.zeros(2, 4, 8, device=DEVICE)
    fn, base, scale = params(4, 8, DEVICE)
    with pytest.raises(ValueError, match=r"fn.shape=\(24, 31\): must be \(24, 32\)"):
        mhc.fast_coeffs(X, fn[:, :31].contiguous(), base, scale, 1e-20, 1e-6, 20)


def test_a_product_and_the_mhc_expand_in_one_launch_match_the_two_references():
    s = seed()
    k, n, hc = 640, 40, 4
    w = fp8_weight(n, k, (32, 32), DEVICE)
    x = torch.randn(6, k, device=DEVICE).to(torch.bfloat16)
    X = torch.randn(6, hc, n, device=DEVICE).to(torch.bfloat16)
    post, comb = torch.rand(6, hc, device=DEVICE) * 2, torch.rand(6, hc, hc, device=DEVICE)
    want = mhc.product_expand(x, w, 32, X, post, comb)
    got = run(mhc.fast_product_expand, x, w, 32, X, post, comb)
    ctx = f"(seed {s})"
    assert_close("expand", want, got, 2.0**-7, context=ctx)
    assert_rows_invariant("expand", lambda sl: mhc.fast_product_expand(x[sl], w, 32, X[sl], post[sl], comb[sl]),
                          context=ctx)


def check_expand_pre(m, hc, d, dt, world, device=DEVICE):
    """fast_expand_pre: its streams X' near the reference's expand; the site's results the bits of fast_pre's of
    X' and near the reference's `pre` of X'; given the ranks' partials (world > 1), the bits it gives their
    rank-order sum (torch's adds) rounded to X's dtype."""
    s = seed()
    kind = "staggered" if torch.rand(()) < 0.5 else "site"
    ctx = f"(seed {s}, M={m} hc={hc} D={d} {dt} {kind}, {world} ranks)"
    X, weights, *site = pre_args(m, hc, d, dt, kind, device)
    post, comb = torch.rand(m, hc, device=device) * 2, torch.rand(m, hc, hc, device=device)
    y = ([torch.randn(m, d, device=device) * 3 for _ in range(world)] if world > 1
         else torch.randn(m, d, device=device).to(dt))
    got = run(mhc.fast_expand_pre, y, X, post, comb, weights, *site)
    if world > 1:
        summed = run(mhc.fast_expand_pre, rank_sum.reference(y, dt), X, post, comb, weights, *site)
        for name, w, g in zip(("X'", "x", "pre", "post", "comb"), summed, got):
            assert_equal(f"{name} of the partials", w, g, ctx)
    assert_close("X'", mhc.expand(y, X, post, comb), got[0], TOL[dt], context=ctx)
    for name, w, g in zip(("x", "pre", "post", "comb"), run(mhc.fast_pre, got[0], weights, *site), got[1:]):
        assert_equal(f"{name} of X'", w, g, ctx)
    want = mhc.pre(got[0], weights, *site)
    assert_close("x", want[0], got[1], TOL[dt], context=ctx)
    for name, w, g in zip(("pre", "post", "comb"), want[1:4], got[2:]):
        assert_close(name, w, g, COEFF_TOL, context=ctx)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_an_expand_inside_the_next_sites_launch_matches_the_expand_and_the_site(dt):
    """hc_expand_pre: a sub-block's output (one tensor, or the ranks' partials) expanded by the next site's own
    launch as it reads the streams, fresh shapes."""
    for world in (1, 2, 4):
        check_expand_pre(int(torch.randint(1, 8, ())), int(torch.randint(2, 5, ())), int(torch.randint(20, 140, ())),
                         dt, world)


def check_combine_pre(m, hc, d, k, dt, world, form, kind, device=DEVICE):
    """fast_expand_pre of a MoE's pairs not yet combined (mhc.Combine: moe.fast_ffn `pending`): X' the bits of
    the MoE's own combine launch, the site's results the bits of fast_pre's of X', X' within the expand's
    tolerance of the reference. `form`: the shared expert's row summed over the ranks with the pairs
    ("split"), whole on every rank ("whole"), or "none"."""
    s = seed()
    ctx = f"(seed {s}, M={m} hc={hc} D={d} K={k} {dt}, {world} ranks, shared {form}, {kind})"
    X, weights, *site = pre_args(m, hc, d, dt, kind, device)
    post, comb = torch.rand(m, hc, device=device) * 2, torch.rand(m, hc, hc, device=device)
    parts = [torch.randn(m * k + (m if form == "split" else 0), d, device=device) * 3 for _ in range(world)]
    pos = torch.randperm(m * k, device=device).view(m, k)
    whole = torch.randn(m, d, device=device) if form == "whole" else None
    shared = {"split": parts, "whole": [whole], "none": None}[form]
    y = mhc.Combine(parts, pos, shared, m * k if form == "split" else 0, form == "split")
    got = run(mhc.fast_expand_pre, y, X, post, comb, weights, *site)
    combined = moe._combine(parts, pos, X, post, comb, torch.empty_like(X), form != "none", form == "split", whole)
    assert_equal("X' against the combine's", combined, got[0], ctx)
    for name, w, g in zip(("x", "pre", "post", "comb"), run(mhc.fast_pre, got[0], weights, *site), got[1:]):
        assert (w is None) == (g is None), f"{name} {ctx}"
        if w is not None:
            assert_equal(f"{name} of X'", w, g, ctx)
    assert_close("X'", mhc.expand(y, X, post, comb), got[0], TOL[dt], context=ctx)
    assert_close("x", mhc.expand_pre(y, X, post, comb, weights, *site)[1], got[1], TOL[dt], context=ctx)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_a_moes_combine_inside_the_next_sites_launch_gives_the_combines_streams(dt):
    """check_combine_pre at fresh shapes, ranks and forms of the shared expert's row, into a site, or into
    the final collapse by given weights ("none": the model's and DSpark's heads take their last MoE so)."""
    m, hc, d, k = (int(torch.randint(lo, hi, ())) for lo, hi in ((1, 7), (2, 5), (20, 140), (1, 8)))
    r = int(torch.randint(0, 27, ()))
    check_combine_pre(m, hc, d, k, dt, (1, 2, 4)[r % 3], ("split", "whole", "none")[r // 3 % 3],
                      ("staggered", "site", "none")[r // 9], DEVICE)


@requires_cuda
class TestMhcAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_mhc_kernels_match_the_references_at_v41_shapes(self, m):
        check(m, 4, 5120, torch.bfloat16, torch.device("cuda"))

    @pytest.mark.parametrize("m", [1, 6])
    def test_an_expand_inside_the_next_sites_launch_at_v41_shapes(self, m):
        check_expand_pre(m, 4, 5120, torch.bfloat16, 4, torch.device("cuda"))

    @pytest.mark.parametrize("m", [1, 4])
    def test_a_moes_combine_inside_the_next_sites_launch_at_v41_shapes(self, m):
        check_combine_pre(m, 4, 5120, 6, torch.bfloat16, 4, "split", "staggered", torch.device("cuda"))


PRE_CASES = [(1, 4, 48, torch.float32, "site"), (7, 4, 100, torch.bfloat16, "staggered"),
             (3, 3, 37, torch.float32, "head"), (5, 4, 64, torch.bfloat16, "none")]


def pre_args(m, hc, d, dt, kind, device=DEVICE):
    X = (torch.randn(m, hc, d, device=device) * 2).to(dt)
    fn, base, scale = params(hc, d, device, head=kind == "head") if kind != "none" else (None, None, None)
    weights = torch.rand(m, hc, device=device) if kind in ("staggered", "none") else None
    norm = 1 + 0.1 * torch.randn(d, device=device)
    return X, weights, fn, base, scale, 1e-20, 1e-6, 0 if kind == "head" else 20, norm, 1e-6


@pytest.mark.parametrize("m,hc,d,dt,kind", PRE_CASES)
def test_a_sub_blocks_input_in_one_launch_matches_the_reference(m, hc, d, dt, kind):
    s = seed()
    ctx = f"(seed {s}, M={m} hc={hc} D={d} {dt} {kind})"
    args = pre_args(m, hc, d, dt, kind)
    capture = kind == "staggered"  # a DSpark target layer: the copies' mean too
    want = mhc.pre(*args, capture)
    got = run(mhc.fast_pre, *args, capture)
    assert_close("x", want[0], got[0], TOL[dt], context=ctx)
    if capture:
        assert_close("mean", want[4], got[4], TOL[dt], context=ctx)
    for name, w, g in zip(("pre", "post", "comb"), want[1:], got[1:]):
        assert (w is None) == (g is None), f"{name} {ctx}"
        if w is not None:
            assert_close(name, w, g, COEFF_TOL, context=ctx)


@pytest.mark.parametrize("path", [mhc.pre, mhc.fast_pre])
@pytest.mark.parametrize("kind", ["staggered", "none"])
def test_a_sites_mean_and_collapse_go_into_the_callers_views_of_wider_rows(path, kind):
    """DSpark's inputs: a target layer's mean into its columns of the step's `hidden`, the head's collapse
    into the confidence head's features (float32), each a view whose rows are wider than D."""
    s = seed()
    ctx = f"(seed {s}, {kind})"
    m, hc, d, dt = 5, 4, 64, torch.bfloat16
    args = pre_args(m, hc, d, dt, kind)
    hidden = torch.full((m, 3 * d), float("nan"), dtype=dt, device=DEVICE)
    features = torch.full((m, d + 7), float("nan"), device=DEVICE)
    got = run(path, *args, hidden[:, d:2 * d], features[:, :d])
    want = mhc.pre(*args, True)
    assert got[4].data_ptr() == hidden[:, d:].data_ptr(), ctx
    assert_close("mean", want[4], hidden[:, d:2 * d], TOL[dt], context=ctx)
    collapse = mhc.collapse(args[0], want[1] if args[1] is None else args[1])
    assert_close("collapsed", collapse.float(), features[:, :d], TOL[dt], context=ctx)
    assert torch.equal(features[:, :d], features[:, :d].to(dt).float()), f"the collapse rounded to X's dtype {ctx}"
    assert hidden[:, :d].isnan().all() and hidden[:, 2 * d:].isnan().all(), f"written outside the view {ctx}"
    assert features[:, d:].isnan().all(), f"written outside the view {ctx}"
    assert_close("x", want[0], got[0], TOL[dt], context=ctx)


@pytest.mark.parametrize("kind", ["site", "staggered", "head"])
def test_a_sub_blocks_input_does_not_depend_on_the_other_rows(kind):
    s = seed()
    ctx = f"(seed {s}, {kind})"
    X, weights, *rest = pre_args(6, 4, 40, torch.bfloat16, kind)
    for i, name in enumerate(("x", "pre") + (("post", "comb") if kind != "head" else ())):
        assert_rows_invariant(name, lambda sl, i=i: run(mhc.fast_pre, X[sl], None if weights is None else weights[sl],
                                                        *rest)[i], context=ctx)
