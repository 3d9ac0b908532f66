"""The V4.1 compressor kernel (kernels/compress.py: pooling with its ring, the compressed row and index key
with their fake quantization, the state writes) against its reference.

Tolerance (kernels/compress.py): without the fake quantization, one rounding of the activation dtype per
output; with it, the same codes but for a few elements at a code boundary, one step away. The rows a call
writes, the trash row it sends incomplete groups to and the ring are checked; rows together equal rows one
at a time, bit for bit."""

import pytest
import torch

from kernels import compress
from kernels.bench import dense_weight

from .kernel_check import DEVICE, assert_close, bits, rope_tables, run, seed
from .test_kernel_attn_inputs import close_codes

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 2.0**-18, BF16: 2.0**-7}


def state(ratio, w, di, dt, capacity=64, spare=4):
    ring = torch.randn(ratio + spare, 2 * w, device=DEVICE)
    rows = capacity // ratio + 1
    return ring, torch.zeros(rows, w, dtype=dt, device=DEVICE), torch.zeros(rows, di, dtype=dt, device=DEVICE)


def args(t, start, ratio, w, di, dt, gate=True):
    kappa = torch.randn(t, w, device=DEVICE) * 2
    zeta = torch.randn(t, w, device=DEVICE) if gate else None
    positions = torch.arange(start, start + t, device=DEVICE)
    norm = 1 + 0.1 * torch.randn(w, device=DEVICE)
    wk = dense_weight(di, w, torch.bfloat16, DEVICE)
    k_norm = 1 + 0.1 * torch.randn(di, device=DEVICE)
    rope = rope_tables(start + t + 1, 8, 1.6e5)
    return kappa, zeta, positions, ratio, norm, 1e-6, wk, k_norm, rope


@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("ratio,t,start", [(2, 5, 9), (1, 3, 20), (4, 2, 6)])
def test_the_compressor_matches_the_reference(dt, quant, ratio, t, start):
    s = seed()
    ctx = f"(seed {s}, {dt}, quant={quant}, ratio={ratio}, T={t} at {start})"
    w, di = 64, 32
    a = args(t, start, ratio, w, di, dt, gate=ratio > 1)
    ring_w, kv_w, key_w = state(ratio, w, di, dt)
    ring_g, kv_g, key_g = ring_w.clone(), kv_w.clone(), key_w.clone()
    want = compress.reference(*a[:3], ring_w, *a[3:], kv_w, key_w, True, quant, dt)
    got = run(compress.fast, *a[:3], ring_g, *a[3:], kv_g, key_g, True, quant, dt)
    assert torch.equal(want, got), f"row indices {want.tolist()} != {got.tolist()} {ctx}"
    assert torch.equal(ring_w, ring_g), f"the ring {ctx}"
    written = want[want < kv_w.shape[0] - 1]
    assert written.numel() == ((a[2] + 1) % ratio == 0).sum()
    for name, wr, gr in (("rows", kv_w[written], kv_g[written]), ("keys", key_w[written], key_g[written])):
        if quant:
            close_codes(name, wr, gr, ctx, max_share=0.05)
        else:
            assert_close(name, wr, gr, TOL[dt], context=ctx)
    untouched = torch.ones(kv_w.shape[0] - 1, dtype=torch.bool)
    untouched[written] = False
    assert not kv_g[:-1][untouched].any() and not key_g[:-1][untouched].any(), f"rows no group completed {ctx}"


def test_a_verify_block_of_rows_equals_the_rows_one_step_at_a_time():
    """M = 1..6 rows from one state: one call of M rows, and M calls of one row each (each writing the ring
    as a decode step does), write the same compressed rows and keys, bit for bit."""
    s = seed()
    kappa, zeta, positions, *rest = args(6, 10, 2, 64, 32, BF16)
    ring0, kv0, key0 = state(2, 64, 32, BF16)
    for m in range(1, 7):
        outs = []
        for calls in ([slice(0, m)], [slice(i, i + 1) for i in range(m)]):
            ring, kv, key = ring0.clone(), kv0.clone(), key0.clone()
            for sl in calls:
                compress.fast(kappa[sl], zeta[sl], positions[sl], ring, *rest, kv, key, True, True, BF16)
            outs.append((ring, kv[:-1], key[:-1]))
        for name, a, b in zip(("ring", "rows", "keys"), *outs):
            assert torch.equal(bits(a), bits(b)), f"{name}: {m} rows together differ from one at a time (seed {s})"
