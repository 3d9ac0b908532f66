"""The attention-inputs kernel (kernels/attn_inputs.py: RoPE of the queries, the window key's RMSNorm, RoPE,
FP8 fake quantization and ring write, the indexer's query RoPE and FP4 fake quantization) against its
reference.

Tolerance (kernels/attn_inputs.py): without the fake quantization, one rounding of the activation dtype
(float32: a few ulps); with it, the same codes except where a float32 value sits at a code boundary the
float64 reference puts on the other side: a few elements in a thousand, each one code step away. Rows
together equal rows one at a time, bit for bit."""

import pytest
import torch

from kernels import attn_inputs

from .kernel_check import DEVICE, assert_close, assert_rows_invariant, bits, rope_tables, run, seed

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 2.0**-20, BF16: 2.0**-7}


def inputs(t, h, hd, nh, di, half, dt, start=37):
    q = torch.randn(t, h, hd, device=DEVICE).to(dt)
    kv = (torch.randn(t, hd, device=DEVICE) * 3).to(dt)
    positions = torch.arange(start, start + t, device=DEVICE)
    rope = rope_tables(start + t + 1, half)
    norm = 1 + 0.1 * torch.randn(hd, device=DEVICE)
    qi = torch.randn(t, nh, di, device=DEVICE).to(dt) if nh else None
    iw = torch.randn(t, nh, device=DEVICE).to(dt) if nh else None
    return q, kv, positions, rope, norm, qi, iw


def close_codes(name, want, got, ctx, max_share=0.02):
    """Equal but for a few elements at a quantization boundary (at most `max_share` of them), each within
    half of its row's largest magnitude (one code step of a block)."""
    diff = (got.float() - want.float()).abs()
    share = (bits(got) != bits(want)).float().mean().item()
    worst = (diff.flatten(1).amax(-1) / want.float().abs().flatten(1).amax(-1).clamp(min=1e-30)).max().item()
    print(f"{name}: {share:.2%} of the elements differ, worst {worst:.3g} of the row max {ctx}")
    assert share <= max_share and worst <= 0.5, f"{name}: {share:.2%} differ, worst {worst:.3g} {ctx}"


@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("quant,index", [(False, True), (True, True), (True, False)])
def test_attention_inputs_match_the_reference(dt, quant, index):
    s = seed()
    ctx = f"(seed {s}, {dt}, quant={quant}, index={index})"
    t, h, hd, nh, di, half, size = 5, 3, 64, 4 if index else 0, 32, 8, 20
    q, kv, positions, rope, norm, qi, iw = inputs(t, h, hd, nh, di, half, dt)
    ring_w, ring_g = torch.zeros(size, hd, dtype=dt, device=DEVICE), torch.zeros(size, hd, dtype=dt, device=DEVICE)
    want = attn_inputs.reference(q.clone(), kv, positions, rope, norm, 1e-6, ring_w, True, quant, qi, iw, 0.125)
    got = run(attn_inputs.fast, q.clone(), kv, positions, rope, norm, 1e-6, ring_g, True, quant, qi, iw, 0.125)
    assert_close("q", want[0], got[0], TOL[dt], context=ctx)
    if quant:
        close_codes("k", want[1], got[1], ctx)
        close_codes("ring", ring_w, ring_g, ctx)
    else:
        assert_close("k", want[1], got[1], TOL[dt], context=ctx)
    assert torch.equal(ring_g[positions % size], got[1]), f"the ring holds the keys at position mod size {ctx}"
    if index:
        (close_codes if quant else lambda n, w, g, c: assert_close(n, w, g, TOL[dt], context=c))("qi", want[2],
                                                                                                    got[2], ctx)
        assert_close("iw", want[3], got[3], TOL[dt], context=ctx)


def test_a_call_longer_than_the_ring_keeps_its_last_positions():
    q, kv, positions, rope, norm, _, _ = inputs(12, 2, 64, 0, 32, 8, F32, start=3)
    ring = torch.full((8, 64), -5.0, device=DEVICE)
    _, k, _, _ = attn_inputs.fast(q, kv, positions, rope, norm, 1e-6, ring, True, True)
    assert torch.equal(ring[positions[-8:] % 8], k[-8:])


def test_attention_inputs_of_a_row_do_not_depend_on_the_other_rows():
    s = seed()
    q, kv, positions, rope, norm, qi, iw = inputs(6, 3, 64, 4, 32, 8, BF16)
    ring = torch.zeros(32, 64, dtype=BF16, device=DEVICE)

    def call(sl, i):
        return attn_inputs.fast(q[sl].clone(), kv[sl], positions[sl], rope, norm, 1e-6, ring, True, True,
                                qi[sl], iw[sl], 0.125)[i]

    for i, name in enumerate(("q", "k", "qi", "iw")):
        assert_rows_invariant(name, lambda sl, i=i: call(sl, i), context=f"(seed {s})")


@pytest.mark.parametrize("dt", [F32, BF16])
def test_several_attentions_window_keys_in_one_launch_equal_each_ones_own_launch(dt):
    """window_keys (DSpark's stages: each its own key projection, kv_norm and ring, the same positions): each
    ring the same bits as the attention-inputs kernel writes it alone, and within the reference's tolerance;
    a call longer than the rings keeps its last positions."""
    s = seed()
    n, t, size, quant = torch.randint(1, 4, ()).item(), torch.randint(1, 13, ()).item(), 8, s % 2 == 0
    ctx = f"(seed {s}, {dt}, {n} attentions, {t} rows, quant={quant})"
    _, _, positions, rope, _, _, _ = inputs(t, 0, 64, 0, 32, 8, dt, start=torch.randint(0, 30, ()).item())
    kvs = [(torch.randn(t, 64, device=DEVICE) * 3).to(dt) for _ in range(n)]
    norms = [1 + 0.1 * torch.randn(64, device=DEVICE) for _ in range(n)]

    def rings():  # NaN where no key was written
        return [torch.full((size, 64), float("nan"), device=DEVICE).to(dt) for _ in range(n)]

    got, alone, want = rings(), rings(), rings()
    run(attn_inputs.fast_window_keys, kvs, positions, rope, norms, 1e-6, got, quant)
    attn_inputs.window_keys(kvs, positions, rope, norms, 1e-6, want, quant)
    kept = positions[-size:] % size  # the slots of the call's last `size` positions
    for i in range(n):
        none = kvs[i].new_empty((t, 0, 64))
        attn_inputs.fast(none, kvs[i], positions, rope, norms[i], 1e-6, alone[i], True, quant)
        assert torch.equal(bits(got[i]), bits(alone[i])), f"ring {i} differs from its own launch's {ctx}"
        assert not got[i][kept].isnan().any(), f"ring {i} lacks a key of the call's last {size} positions {ctx}"
        (close_codes if quant else lambda n_, w, g, c: assert_close(n_, w, g, TOL[dt], context=c))(
            f"ring {i}", want[i][kept], got[i][kept], ctx)
