"""The query products with the attention's row work in their launch (kernels/query_inputs.py) against the two
launches it replaces (kernels/linear.py's products, then kernels/attn_inputs.py's row work): the same bits,
queries, window keys, ring, index queries and head weights, with the FP4/FP8 weights of the checkpoint,
split-K and not; against the torch reference within attn_inputs' tolerance. Rows together equal rows one at a
time, bit for bit."""

import pytest
import torch

from kernels import attn_inputs, linear, query_inputs
from kernels.linear import Product

from .conftest import use_native_products
from .kernel_check import DEVICE, assert_close, assert_rows_invariant, bits, rope_tables, run, seed
from .test_kernel_attn_inputs import close_codes
from .test_kernel_linear import weight

F32, BF16 = torch.float32, torch.bfloat16


def case(t, dt, index, fmt="fp4", k=256, heads=3, hd=64, nh=4, di=64, half=8, start=29):
    x = torch.randn(t, k, device=DEVICE).to(dt)
    norm = (1 + 0.1 * torch.randn(k, device=DEVICE), 1e-6)
    act = 32 if fmt == "fp4" else 128  # the checkpoint's activation blocks
    products = [Product(weight(fmt, heads * hd, k), act, dt)]
    if index:
        products.append(Product(weight(fmt, nh * di, k), act, dt))
    kv = (torch.randn(t, hd, device=DEVICE) * 3).to(dt)
    positions = torch.arange(start, start + t, device=DEVICE)
    rope = rope_tables(start + t + 1, half)
    kv_norm = 1 + 0.1 * torch.randn(hd, device=DEVICE)
    iw = torch.randn(t, nh, device=DEVICE).to(dt) if index else None
    return x, products, norm, kv, positions, rope, kv_norm, (nh if index else 0), iw


def apart(x, products, norm, kv, positions, rope, kv_norm, ring, quant, index_heads, iw):
    """The two launches the fused one replaces."""
    ys = linear.fast_multi(x, products, norm)
    t, hd = kv.shape
    qi = ys[1].view(t, index_heads, -1) if index_heads else None
    return attn_inputs.fast(ys[0].view(t, -1, hd), kv, positions, rope, kv_norm, 1e-5, ring, True, quant, qi, iw,
                            0.25)


@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("quant,index,fmt,products,t", [(True, True, "fp4", "bfloat16", 4),
                                                        (False, True, (128, 128), "bfloat16", 4),
                                                        (True, False, "fp4", "bfloat16", 4),
                                                        (True, True, "fp4", "block-scaled", 4),
                                                        (True, True, (128, 128), "e4m3", 11)])
def test_one_launch_equals_the_two_it_replaces(dt, quant, index, fmt, products, t, monkeypatch):
    """With the products on bfloat16 values or in the checkpoint's formats (each program's rows quantized
    into its scratch: the row work's programs have one too); 11 rows on the e4m3 MMA are two blocks of 8."""
    s = seed()
    ctx = f"(seed {s}, {dt}, quant={quant}, index={index}, {fmt}, {products}, {t} rows)"
    made = use_native_products(monkeypatch, products) if products != "bfloat16" else None
    x, products, norm, kv, positions, rope, kv_norm, nh, iw = case(t, dt, index, fmt, k=256 if fmt == "fp4" else 640)
    rings = [torch.zeros(16, kv.shape[1], dtype=dt, device=DEVICE) for _ in range(3)]
    want = apart(x, products, norm, kv, positions, rope, kv_norm, rings[0], quant, nh, iw)
    got = run(query_inputs.fast, x, products, norm, kv, positions, rope, kv_norm, 1e-5, rings[1], True, quant, nh,
              iw, 0.25)
    assert made is None or made, f"the products took the {products} path {ctx}"
    for name, w, g in zip(("q", "k", "qi", "w"), want, got, strict=True):
        assert (w is None) == (g is None) and (w is None or torch.equal(bits(w), bits(g))), f"{name} differs {ctx}"
    assert torch.equal(bits(rings[0]), bits(rings[1])), f"the ring differs {ctx}"
    ref = query_inputs.reference(x, products, norm, kv, positions, rope, kv_norm, 1e-5, rings[2], True, quant, nh,
                                 iw, 0.25)
    tol = 2.0**-20 if dt == F32 else 2.0**-7
    assert_close("q", ref[0], got[0], 2.0**-6 if fmt == "fp4" else tol, context=ctx)  # the products' bound
    (close_codes if quant else lambda n, w, g, c: assert_close(n, w, g, tol, context=c))("k", ref[1], got[1], ctx)


def test_rows_together_equal_rows_alone():
    s = seed()
    x, products, norm, kv, positions, rope, kv_norm, nh, iw = case(5, BF16, True)
    ring = torch.zeros(11, kv.shape[1], dtype=BF16, device=DEVICE)

    def rows(sl):
        q, k, qi, w = query_inputs.fast(x[sl], products, norm, kv[sl], positions[sl], rope, kv_norm, 1e-5, ring,
                                        True, True, nh, iw[sl], 0.25)
        return torch.cat([q.flatten(1), k, qi.flatten(1), w], dim=1)

    assert_rows_invariant("query inputs", rows, 5, f"(seed {s})")


def test_a_bad_argument_is_named():
    x, products, norm, kv, positions, rope, kv_norm, nh, iw = case(2, BF16, True)
    ring = torch.zeros(11, kv.shape[1], dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="iw"):
        query_inputs.fast(x, products, norm, kv, positions, rope, kv_norm, 1e-5, ring, True, True, nh, None)
    with pytest.raises(ValueError, match="products"):
        query_inputs.fast(x, products[:1], norm, kv, positions, rope, kv_norm, 1e-5, ring, True, True, nh, iw)
