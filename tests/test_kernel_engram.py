"""The Engram layer kernel (kernels/engram.py: the rows a step needs, gathered from the table where it lives,
through wkv, and the gated add into the streams) against the reference, on odd sizes, for float32 and
bfloat16; rows together equal rows one at a time; on CUDA (skipped without one) it reads a table in
registered host memory in place, leaving the table where it is.

Tolerance: one rounding of the activation dtype (the float32 product and gates against float64)."""

import pytest
import torch

from kernels import engram
from kernels.bench import fp8_weight
from kernels.formats import encode_fp8

from .kernel_check import DEVICE, assert_close, assert_rows_invariant, requires_cuda, run, seed

TOL = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-7}


def table(rows: int, d: int, device="cpu"):
    data, scale = encode_fp8(torch.randn(rows, d, device=device) * torch.rand(rows, 1, device=device) * 8, (1, 32))
    return data, scale


def layer(t, hc, d, rows, hd, cols, dt, act_block, device=DEVICE, table_device="cpu"):
    data, scale = table(rows, hd, table_device)
    ids = torch.randint(0, rows, (t, cols), device=device)
    ids[0, 0] = rows - 1  # the last row
    X = torch.randn(t, hc, d, device=device).to(dt)
    wkv = fp8_weight((hc + 1) * d, cols * hd, (32, 32), device)
    omega = torch.randn(hc, d, device=device)
    return X, data, scale, ids, wkv, act_block, omega, 1e-20


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hc,d,rows,hd,cols,act_block", [(3, 4, 64, 97, 64, 5, 32), (1, 2, 96, 1000, 32, 3, None),
                                                            (7, 3, 32, 13, 32, 2, 32)])
def test_the_engram_layer_matches_the_reference(t, hc, d, rows, hd, cols, act_block, dt):
    s = seed()
    X, data, scale, *rest = layer(t, hc, d, rows, hd, cols, dt, act_block)
    want = engram.layer_reference(X, data, scale, *rest)
    got = run(engram.fast_layer, X, data.to(DEVICE), scale.to(DEVICE), *rest)
    assert_close("streams", want, got, TOL[dt], context=f"(seed {s}, {dt}, T={t} hc={hc} D={d})")


def test_an_engram_row_does_not_depend_on_the_other_rows():
    s = seed()
    X, data, scale, ids, *rest = layer(6, 4, 64, 50, 32, 4, torch.bfloat16, 32)
    assert_rows_invariant("streams", lambda sl: run(engram.fast_layer, X[sl], data, scale, ids[sl], *rest),
                          context=f"(seed {s})")


def test_the_engram_layer_refuses_a_table_without_whole_scale_blocks():
    X, data, scale, *rest = layer(1, 2, 32, 4, 64, 1, torch.float32, None)
    with pytest.raises(ValueError, match="scale.shape"):
        engram.fast_layer(X, data, scale[:, :1].contiguous(), *rest)


@requires_cuda
class TestEngramFromHostMemoryOnCuda:
    def test_the_kernel_reads_a_registered_host_table_in_place(self):
        from appliance.parallel.placement import map_to_device

        X, data, scale, *rest = layer(2, 4, 5120, 5000, 256, 24, torch.bfloat16, 32, torch.device("cuda"))
        where = (data.data_ptr(), scale.data_ptr())
        map_to_device(data)
        map_to_device(scale)
        got = engram.fast_layer(X, data, scale, *rest)
        assert got.device.type == "cuda" and data.device.type == "cpu" and (data.data_ptr(), scale.data_ptr()) == where
        want = engram.layer_reference(X, data, scale, *rest)  # the reference gathers on the host
        assert_close("streams", want, got, TOL[torch.bfloat16])


def test_the_row_ids_kernel_equals_the_reference_hash_bit_for_bit():
    """Multipliers near 2^62 (the products wrap, some hashes are negative before the prime's remainder),
    positions at the start of the sequence (the pad id) and past it, every layer at once."""
    s = seed()
    g = torch.Generator().manual_seed(s)
    tokens = torch.randint(0, 700, (64,), generator=g).to(DEVICE)
    token_map = torch.randint(0, 300, (600,), generator=g).to(DEVICE)  # tokens past it clamp to its last
    mult = (torch.randint(0, 2**61, (3, 4), generator=g) * 2 + 1).to(DEVICE)
    primes = torch.tensor([[7, 11, 13, 17, 19, 23], [29, 31, 37, 41, 43, 47], [53, 59, 61, 67, 71, 73]], device=DEVICE)
    offsets = torch.cumsum(primes, 1) - primes
    positions = torch.tensor([0, 1, 2, 3, 40, 41, 63], device=DEVICE)
    want = engram.ids_reference(tokens, positions, token_map, 5, mult, primes, offsets, 2)
    got = run(engram.fast_ids, tokens, positions, token_map, 5, mult, primes, offsets, 2)
    assert torch.equal(want, got), f"(seed {s}) {(want != got).nonzero()[:5].tolist()}"
    assert (got >= offsets[:, None, :]).all() and (got < (offsets + primes)[:, None, :]).all()
