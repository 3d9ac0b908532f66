"""The skinny-GEMM kernel (kernels/linear.py `fast`) against its reference: FP8 (32x32 and 128x128 block
scales), FP4 and dense weights, with and without the fused FP8 activation quantization, split-K, grouped.

Tolerance (kernels/linear.py): |y - y_ref| <= K 2^-23 sum_k |x_k w_k| (float32 accumulation of exact
products; the activation codes are the reference's), plus one rounding of the output dtype, on either path:
bfloat16 values on the tensor cores, or the checkpoint's codes on the block-scaled MMA (sm_100 and later) or
the e4m3 MMA (sm_89/90), both run here under the interpreter. Batch invariance: M = 1..6 rows computed
together equal the same rows computed one at a time, bit for bit."""

import pytest
import torch

import kernels._triton
from kernels import linear, rmsnorm
from kernels.bench import dense_weight, fp4_weight, fp8_weight
from kernels.formats import q8_pow2
from kernels.linear import PackedWeight

from .kernel_check import DEVICE, assert_rows_invariant, assert_within, requires_cuda, run, seed

F32, BF16 = torch.float32, torch.bfloat16


def weight(fmt, n, k, device=DEVICE):
    if fmt == "fp4":
        return fp4_weight(n, k, device)
    if fmt == "dense":
        return dense_weight(n, k, torch.bfloat16, device)
    if fmt == "dense32":  # not bfloat16 values: the float32 FMA dot
        return PackedWeight("dense32", (n, k), "dense", torch.randn(n, k, device=device) / k**0.5)
    return fp8_weight(n, k, fmt, device)


def bound(x, w, act_block, out_dt, want, groups=1):
    """The stated bound: K 2^-23 sum|x w| per output (on an sm_89/90 device with quantized rows, whose e4m3
    MMA keeps about 14 bits of a block's sum, 2^-13 sum|x w| more), plus one rounding of out_dt: one of its
    ulps (at most 2^-7 of a bfloat16 value, 2^-23 of a float32 one), since the kernel's and the reference's
    float32 sums, each rounded, can straddle a rounding boundary."""
    a = (q8_pow2(x, act_block) if act_block else x.float()).double()
    wd = w.dequantize().double().abs()
    k = wd.shape[1]
    if groups == 1:
        mag = a.abs() @ wd.t()
    else:
        mag = torch.einsum("tgi,gri->tgr", a.abs().view(-1, groups, k), wd.view(groups, -1, k)).reshape(a.shape[0], -1)
    ulp = 2.0**-7 if out_dt == BF16 else 2.0**-23
    fixed_point = 2.0**-13 if act_block and kernels._triton.capability(DEVICE) in (89, 90) else 0.0
    return (k * 2.0**-23 + fixed_point) * mag + ulp * want.double().abs()


def assert_within_but_one_row(name, want, got, x, product, out_dt, normalized, context):
    """`bound`; where x is the reference's RMSNorm of the rows (`normalized`: the kernel normalizes in its own
    float32 order, so an element may take the e4m3 code next to the reference's), one row may be past it by
    one e4m3 step of one element (a normal code's step is at most 2^-3 of it: 2^-3 max_i |x_i w_ji|). Seen
    once in the suite's runs; every other row keeps the bound."""
    base = bound(x, product.weight, product.act_block, out_dt, want)
    rows = ((got.double() - want.double()).abs() > base).any(-1).nonzero().flatten()
    if normalized and product.act_block and len(rows) == 1:
        a = q8_pow2(x[rows], product.act_block).double().abs()
        base[rows] += 2.0**-3 * (a[:, None, :] * product.weight.dequantize().double().abs()).amax(-1)
    assert_within(name, want, got, base, context)


# (M, N, K, weight format, act_block, x dtype, out dtype): odd sizes; K=704 and 640 take the split-K path
CPU_CASES = [
    (1, 37, 96, (32, 32), 32, F32, F32),
    (3, 50, 704, (128, 128), 32, BF16, BF16),
    (6, 45, 160, "fp4", 32, F32, F32),
    (5, 33, 640, "fp4", None, F32, BF16),
    (2, 19, 72, "dense", None, F32, F32),
    (4, 21, 80, "dense32", None, BF16, F32),
    (40, 9, 64, (32, 32), 64, F32, F32),
]


def check(m, n, k, fmt, act_block, dt, out_dt, device=DEVICE):
    s = seed()
    w = weight(fmt, n, k, device)
    x = (torch.randn(m, k, device=device) * 3).to(dt)
    want = linear.reference(x, w, act_block, out_dt)
    got = run(linear.fast, x, w, act_block, out_dt)
    ctx = f"(seed {s}, M={m} N={n} K={k} {fmt} act_block={act_block} {dt}->{out_dt})"
    assert_within("y", want, got, bound(x, w, act_block, out_dt, want), ctx)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"M{c[0]}-{c[1]}x{c[2]}-{c[3]}-ab{c[4]}")
def test_linear_kernel_matches_the_reference_within_the_stated_bound(case):
    check(*case)


def test_the_grouped_product_matches_the_reference_within_the_stated_bound():
    s = seed()
    g, r, k = 4, 32, 48
    w = fp8_weight(g * r, k, (32, 32), DEVICE)
    x = torch.randn(5, g * k, device=DEVICE)
    want = linear.reference(x, w, None, F32, groups=g)
    got = run(linear.fast, x, w, None, F32, groups=g)
    assert_within("y", want, got, bound(x, w, None, F32, want, g), f"(seed {s}, G={g} r={r} K={k})")


@pytest.mark.parametrize("fmt,k,act_block,dt,groups", [
    ((32, 32), 640, 32, F32, 1),   # split-K, activation quantization
    ("fp4", 96, None, F32, 1),     # float32 activations in three bfloat16 parts
    ("dense", 72, None, BF16, 1),
    ((32, 32), 64, None, BF16, 2),
], ids=["fp8-splitK-ab32", "fp4-f32", "dense-bf16", "grouped"])
def test_a_row_does_not_depend_on_how_many_rows_are_computed_together(fmt, k, act_block, dt, groups):
    s = seed()
    n = 96 if groups > 1 else 29
    w = weight(fmt, n, k, DEVICE)
    x = (torch.randn(6, groups * k, device=DEVICE) * 2).to(dt)
    assert_rows_invariant("y", lambda sl: run(linear.fast, x[sl], w, act_block, F32, groups=groups),
                          context=f"(seed {s}, {fmt} K={k} act_block={act_block} {dt} groups={groups})")


@pytest.mark.parametrize("fmt,k,act_block,dt", [
    ("fp4", 160, 32, F32),
    ((32, 32), 704, 32, BF16),    # split-K
    ((128, 128), 256, 128, BF16),
    ("fp4", 640, 64, BF16),       # split-K, two 32-column scale blocks per activation block
], ids=["fp4-ab32", "fp8-32-splitK", "fp8-128-ab128", "fp4-ab64-splitK"])
def test_products_in_the_checkpoints_formats_are_within_the_bound_and_rows_are_invariant(native, fmt, k,
                                                                                      act_block, dt):
    s = seed()
    w = weight(fmt, 45, k)
    x = (torch.randn(6, k, device=DEVICE) * 3).to(dt)
    ctx = f"(seed {s}, {fmt} K={k} act_block={act_block} {dt})"
    want = linear.reference(x, w, act_block, F32)
    got = run(linear.fast, x, w, act_block, F32)
    assert_within("y", want, got, bound(x, w, act_block, F32, want), ctx)
    assert_rows_invariant("y", lambda sl: run(linear.fast, x[sl], w, act_block, F32), context=ctx)
    assert native or not kernels._triton.INTERPRET, f"no product multiplied in the checkpoint's formats {ctx}"


def test_a_launch_with_a_product_the_tensor_cores_cannot_take_in_its_format_multiplies_bfloat16_values(native):
    x = torch.randn(3, 96, device=DEVICE)
    for products in (_products(96), [linear.Product(fp8_weight(16, 96, (32, 32), DEVICE), None, F32)]):
        got = run(linear.fast_multi, x, products)
        for p, g, w in zip(products, got, linear.reference_multi(x, products)):
            assert_within("y", w, g, bound(x, p.weight, p.act_block, p.out_dtype, w))
    assert not native, "a launch with dense weights or plain rows multiplied in the checkpoint's formats"


def _products(k, device=DEVICE):
    """The products of one input that a V4.1 attention launches together, at odd sizes: FP8 with the
    activation quantization (wq_a, wkv), dense float32 outputs (the compressor's), a dense product rounded
    to bfloat16 (the index head weights), FP8 with a split K."""
    return [linear.Product(fp8_weight(45, k, (32, 32), device), 32, BF16),
            linear.Product(fp8_weight(19, k, (32, 32), device), 32, BF16),
            linear.Product(dense_weight(33, k, torch.bfloat16, device), None, F32),
            linear.Product(dense_weight(7, k, torch.bfloat16, device), None, BF16),
            linear.Product(fp8_weight(70, k, (32, 32), device), 32, F32)]


@pytest.mark.parametrize("k,norm", [(96, False), (640, True)], ids=["K96", "K640-splitK-norm"])
def test_several_products_of_one_input_in_one_launch_match_their_references(k, norm):
    s = seed()
    products = _products(k)
    x = (torch.randn(5, k, device=DEVICE) * 3).to(BF16)
    nw = (1 + 0.1 * torch.randn(k, device=DEVICE), 1e-6) if norm else None
    want = linear.reference_multi(x, products, nw)
    got = run(linear.fast_multi, x, products, nw)
    xin = x if nw is None else rmsnorm.reference(x, *nw)
    for i, (p, w, g) in enumerate(zip(products, want, got)):
        assert_within_but_one_row(f"y{i}", w, g, xin, p, p.out_dtype, norm, f"(seed {s}, K={k})")
    assert_rows_invariant("products", lambda sl: torch.cat([y.float() for y in linear.fast_multi(x[sl], products, nw)],
                                                            -1), context=f"(seed {s}, K={k})")


def _staged_launches(monkeypatch) -> list:
    """The rows' stagings of long calls (rows.stage_launch) made while the test runs (the list's length)."""
    made = []
    stage = linear.stage_launch
    monkeypatch.setattr(linear, "stage_launch", lambda *a: (made.append(1), stage(*a))[1])
    return made


def assert_chunks_equal(name: str, call, rows: int, cuts: tuple[int, ...], context: str) -> torch.Tensor:
    """`call(sl)` over all `rows` rows at once equals, bit for bit, the same rows in chunks cut at `cuts`;
    returns the whole."""
    whole = call(slice(0, rows))
    edges = (0, *cuts, rows)
    parts = torch.cat([call(slice(a, b)) for a, b in zip(edges, edges[1:])])
    bad = whole != parts
    assert not bad.any(), f"{name}: {int(bad.sum())} elements differ between one call and chunks {edges} {context}"
    return whole


@pytest.mark.parametrize("fmt,k,act_block,dt,rows", [
    ("fp4", 160, 32, F32, 140),        # two programs of 128 rows
    ((32, 32), 704, 32, BF16, 40),     # split-K
    ((128, 128), 256, 128, BF16, 40),
    ("fp4", 640, 64, BF16, 40),        # split-K, two 32-column scale blocks per activation block
], ids=["fp4-ab32-two-blocks", "fp8-32-splitK", "fp8-128-ab128", "fp4-ab64-splitK"])
def test_a_long_call_stages_its_rows_once_and_its_chunks_give_the_same_bits(native, monkeypatch, fmt, k, act_block,
                                                                           dt, rows):
    """Inside long_calls (a prefill chunk) the products take programs of LONG_ROWS rows on the block-scaled
    MMA (E4M3_LONG_ROWS on the e4m3 MMA), the rows quantized once by their own launch: within the stated
    bound, and a prompt's rows give the same bits whatever its chunks (a tail of 3 rows too)."""
    staged = _staged_launches(monkeypatch)
    s = seed()
    w = weight(fmt, 45, k)
    x = (torch.randn(rows, k, device=DEVICE) * 3).to(dt)
    ctx = f"(seed {s}, {fmt} K={k} act_block={act_block} {dt} M={rows})"
    with kernels._triton.long_calls():
        got = assert_chunks_equal("y", lambda sl: run(linear.fast, x[sl], w, act_block, F32), rows, (3, rows - 5),
                                  ctx)
    want = linear.reference(x, w, act_block, F32)
    assert_within("y", want, got, bound(x, w, act_block, F32, want), ctx)
    assert len(staged) == 4 or not kernels._triton.INTERPRET, f"{len(staged)} stagings for 4 long calls {ctx}"
    assert native or not kernels._triton.INTERPRET, f"no product multiplied in the checkpoint's formats {ctx}"


def test_a_long_call_of_products_of_the_normalized_input_stages_the_normalized_rows(native, monkeypatch):
    """RMSNorm fused in front (the layer's first products) and several products of one input: the staging
    launch normalizes the rows as the short call's programs do."""
    staged = _staged_launches(monkeypatch)
    s = seed()
    k, rows = 640, 37
    products = [linear.Product(fp8_weight(45, k, (32, 32), DEVICE), 32, BF16),
                linear.Product(fp8_weight(70, k, (32, 32), DEVICE), 32, F32)]
    x = (torch.randn(rows, k, device=DEVICE) * 3).to(BF16)
    nw = (1 + 0.1 * torch.randn(k, device=DEVICE), 1e-6)
    ctx = f"(seed {s}, K={k} M={rows})"
    with kernels._triton.long_calls():
        got = assert_chunks_equal("products", lambda sl: torch.cat(
            [y.float() for y in run(linear.fast_multi, x[sl], products, nw)], -1), rows, (1, 20), ctx)
    want = linear.reference_multi(x, products, nw)
    xin = rmsnorm.reference(x, *nw)
    for i, (p, w, g) in enumerate(zip(products, want, got.split([45, 70], -1))):
        assert_within_but_one_row(f"y{i}", w.float(), g.to(w.dtype).float(), xin, p, F32, True, ctx)
    assert len(staged) == 4 or not kernels._triton.INTERPRET, f"{len(staged)} stagings for 4 long calls {ctx}"


def test_no_launch_of_a_long_call_splits_k():
    """A long call's row blocks fill the device: none of its launches writes float32 partials to add back,
    the 16-row programs of a launch that quantizes its rows in the loop included; a short call splits a
    long K (the split chosen by N and K only)."""
    k = int(torch.randint(4, 9, ()).item()) * 1024
    segments = [(int(torch.randint(1, 9, ()).item()) * 64, 32, 1 << 20)]
    for native, may_be_long in ((0, False), (0, True)):
        short = linear.plan(segments, k, DEVICE, native, may_be_long)[3]
        with kernels._triton.long_calls():
            long = linear.plan(segments, k, DEVICE, native, may_be_long)[3]
        assert short[0][1] > 1 and long == [(k, 1)], (native, may_be_long, short, long)


@pytest.mark.parametrize("case", ["grouped plain fp8", "mixed formats"])
def test_a_long_calls_plain_products_from_registers_take_programs_of_long_rows(native, monkeypatch, case):
    """Inside long_calls the plain products whose weights are dequantized to bfloat16 values in registers (a
    plain FP8 product of bfloat16 rows, V4.1's wo_a) take programs of LONG_ROWS rows too; products in the
    checkpoint's formats beside plain ones (FP8 beside dense products) are two launches, each a long call's
    (one launch would quantize the rows in its loop, 16 rows a program): within the stated bound, and a
    prompt's rows give the same bits whatever its chunks."""
    tiles = []
    plan = linear.plan
    monkeypatch.setattr(linear, "plan", lambda *a, **k: (lambda r: (tiles.append(r[0]), r)[1])(plan(*a, **k)))
    s = seed()
    rows, k = 140, 96
    if case == "grouped plain fp8":
        products = [linear.Product(fp8_weight(2 * 48, k, (32, 32), DEVICE), None, F32, groups=2)]
        x = (torch.randn(rows, 2 * k, device=DEVICE) * 3).to(BF16)
    else:
        products = _products(k)
        x = (torch.randn(rows, k, device=DEVICE) * 3).to(BF16)
    ctx = f"(seed {s}, {case})"
    with kernels._triton.long_calls():
        got = assert_chunks_equal("products", lambda sl: torch.cat(
            [y.float() for y in run(linear.fast_multi, x[sl], products)], -1), rows, (3, 131), ctx)
    want_rows = {kernels._triton.LONG_ROWS}
    if case == "mixed formats":  # the FP8 products' launch multiplies in their formats
        with kernels._triton.long_calls():
            want_rows.add(kernels._triton.product_rows(kernels._triton.native_products(DEVICE), True))
    assert tiles and set(tiles) == want_rows, f"programs of {set(tiles)} rows {ctx}"
    calls = 4  # the whole and its three chunks
    assert len(tiles) == calls * (1 if case == "grouped plain fp8" else 2), f"{len(tiles)} launches {ctx}"
    want = linear.reference_multi(x, products)
    start = 0
    for i, (p, w) in enumerate(zip(products, want)):
        g = got[:, start:start + w.shape[-1]].to(w.dtype)
        start += w.shape[-1]
        assert_within(f"y{i}", w, g, bound(x, p.weight, p.act_block, p.out_dtype, w, p.groups), ctx)


@pytest.mark.parametrize("path", [linear.reference, linear.fast])
def test_a_product_written_into_a_callers_buffer_is_the_product_in_place(path):
    s = seed()
    w = weight("dense", 1, 80)  # DSpark's confidence head: one output
    x = torch.randn(3, 80, device=DEVICE)
    buf = torch.full((5,), float("nan"), device=DEVICE)
    got = run(path, x, w, None, F32, out=buf[1:4].view(3, 1))
    assert got.data_ptr() == buf[1:4].data_ptr(), f"seed {s}: the product was not written in place"
    assert torch.equal(buf[1:4].view(3, 1), run(path, x, w, None, F32)), f"seed {s}"
    assert buf[0].isnan() and buf[4].isnan(), f"seed {s}: written outside the buffer's view"


def test_linear_kernel_refuses_bad_arguments_naming_them():
    w = fp8_weight(16, 64, (32, 32), DEVICE)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=48: must equal the weight's input size 64"):
        linear.fast(torch.zeros(2, 48, device=DEVICE), w, None, F32)
    with pytest.raises(ValueError, match="act_block=48: must be a power of two"):
        linear.fast(torch.zeros(2, 64, device=DEVICE), w, 48, F32)
    with pytest.raises(TypeError, match="x.dtype=float16"):
        linear.fast(torch.zeros(2, 64, device=DEVICE, dtype=torch.float16), w, None, F32)
    with pytest.raises(ValueError, match="groups=3: must divide the weight's outputs 16"):
        linear.fast(torch.zeros(2, 192, device=DEVICE), w, None, F32, groups=3)
    with pytest.raises(ValueError, match=r"out.shape=\(2, 15\): must be \(2, 16\)"):
        linear.fast(torch.zeros(2, 64, device=DEVICE), w, None, F32, out=torch.empty(2, 15, device=DEVICE))
    with pytest.raises(ValueError, match="out.dtype=torch.bfloat16: must be the product's out_dtype"):
        linear.fast(torch.zeros(2, 64, device=DEVICE), w, None, F32, out=torch.empty(2, 16, device=DEVICE,
                                                                                    dtype=BF16))


@requires_cuda
class TestLinearAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    @pytest.mark.parametrize("n,k,fmt", [(1280, 5120, (32, 32)), (32768, 1280, (32, 32)), (512, 5120, (32, 32)),
                                         (5120, 8192, (32, 32)), (4096, 1280, (32, 32)), (2304, 5120, "fp4"),
                                         (5120, 2304, "fp4"), (2304, 5120, (128, 128))])
    def test_linear_kernel_matches_the_reference_at_v41_shapes(self, m, n, k, fmt):
        check(m, n, k, fmt, 32, BF16, BF16, torch.device("cuda"))

    def test_a_row_does_not_depend_on_how_many_rows_are_computed_together_at_v41_shapes(self):
        w = fp8_weight(1280, 5120, (32, 32), torch.device("cuda"))
        x = torch.randn(6, 5120, device="cuda").to(BF16)
        assert_rows_invariant("y", lambda sl: linear.fast(x[sl], w, 32, BF16))
