"""The sparse decode attention kernel (window keys listed by position + gathered compressed rows, one shared
KV head, sink, one launch) against the reference; and V4.1's form of it, whose window is read by position
from the ring and the call's keys, with the inverse RoPE of the output.

Tolerance (relative to the largest output, kernels/attention.py): float32 q: 2^-18 (float32 logits, exp and
sums); bfloat16 q: one bfloat16 rounding of o plus a bfloat16 ulp of a P term at a rounding boundary, 2^-7."""

import pytest
import torch

from kernels import attention
from kernels import rope as rope_op

from .kernel_check import DEVICE, assert_close, assert_rows_invariant, bits, requires_cuda, rope_tables, run, seed

TOL = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-7}


def window_rows(m, nw, w, device):
    """Per query, w window rows in some order (a permutation of the rows, each kept with probability 0.7)."""
    rows = torch.stack([torch.randperm(nw, device=device)[:w] for _ in range(m)])
    return torch.where(torch.rand(m, w, device=device) < 0.7, rows, -1)


def check(m, h, d, nw, nc, k, dt, p_dtype, device=DEVICE, empty_row=True):
    s = seed()
    q = torch.randn(m, h, d, device=device).to(dt)
    win = torch.randn(nw, d, device=device).to(dt)
    wrows = window_rows(m, nw, min(nw, 16), device)
    comp = torch.randn(nc, d, device=device).to(dt) if nc else None
    idx = torch.randint(-1, nc, (m, k), device=device) if nc else None
    if empty_row:  # a query that sees nothing: only the sink, output 0
        wrows[0] = -1
        if idx is not None:
            idx[0] = -1
    sink = torch.randn(h, device=device)
    want = attention.reference(q, win, wrows, comp, idx, sink, d**-0.5, p_dtype)
    got = run(attention.fast, q, win, wrows, comp, idx, sink, d**-0.5, p_dtype)
    assert_close("o", want, got, TOL[dt], context=f"(seed {s}, M={m} H={h} d={d} Nw={nw} Nc={nc} K={k} {dt} "
                                                   f"p_dtype={p_dtype})")


# (M, H, d, Nw, Nc, K, dtype, p_dtype); 100 + 150 keys: several key blocks (128 per block here)
@pytest.mark.parametrize("case", [
    (3, 4, 64, 20, 30, 7, torch.float32, None),
    (2, 5, 72, 19, 0, 0, torch.float32, None),
    (2, 3, 64, 100, 400, 150, torch.float32, None),
    (3, 4, 64, 21, 33, 9, torch.bfloat16, torch.bfloat16),
    (2, 3, 48, 100, 300, 150, torch.bfloat16, torch.bfloat16),
], ids=lambda c: f"M{c[0]}-H{c[1]}-d{c[2]}-keys{c[3]}+{c[5]}-{str(c[6])[6:]}")
def test_attention_kernel_matches_the_reference_on_odd_shapes(case):
    check(*case)


@pytest.mark.parametrize("dt,p_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_a_query_does_not_depend_on_the_other_queries_or_on_how_its_keys_are_stored(dt, p_dtype):
    """Rows 1..6 together equal one at a time; a longer reach (more -1 entries after a query's compressed
    rows, here enough for more key splits) changes nothing; and the same window keys stored at other rows
    (a verify block's keys sit after the ring, a single step finds them in the ring) give the same bits."""
    s = seed()
    m, h, d, nw, nc = 6, 4, 64, 40, 300
    q = torch.randn(m, h, d, device=DEVICE).to(dt)
    win = torch.randn(nw, d, device=DEVICE).to(dt)
    wrows = window_rows(m, nw, 16, DEVICE)
    comp = torch.randn(nc, d, device=DEVICE).to(dt)
    idx = torch.randint(0, nc, (m, 9), device=DEVICE).sort(-1).values
    sink = torch.randn(h, device=DEVICE)
    ctx = f"(seed {s}, {dt})"

    def attend(win, wrows, idx, sl=slice(None)):
        return run(attention.fast, q[sl], win, wrows[sl].contiguous(), comp, idx[sl].contiguous(), sink, d**-0.5,
                   p_dtype)

    assert_rows_invariant("o", lambda sl: attend(win, wrows, idx, sl), context=ctx)
    base = attend(win, wrows, idx)
    longer = torch.cat((idx, torch.full((m, 300), -1, device=DEVICE)), dim=1)  # 16 + 309 keys: 3 blocks of 128
    assert torch.equal(bits(attend(win, wrows, longer)), bits(base)), f"a longer reach changed the output {ctx}"
    perm = torch.randperm(nw, device=DEVICE)
    moved = torch.empty_like(win)
    moved[perm] = win  # row r now lives at perm[r]
    wmoved = torch.where(wrows >= 0, perm[wrows.clamp(min=0)], -1)
    assert torch.equal(bits(attend(moved, wmoved, idx)), bits(base)), f"moving the window keys changed the output {ctx}"


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_keys_listed_second_equal_the_same_keys_listed_last_in_the_window(dt):
    """A DSpark block's form: every query sees the ring's window and every block row. The block rows listed
    as the second list (comp_kv, comp_index; the views of one row for all queries, stride 0) give the bits of
    the ring and the block concatenated with the block rows listed after the window, kernel and reference."""
    s = seed()
    b, h, d, size, w = int(torch.randint(2, 7, ())), 4, 64, 24, 16
    q = torch.randn(b, h, d, device=DEVICE).to(dt)
    ring, block = (torch.randn(n, d, device=DEVICE).to(dt) for n in (size, b))
    t = int(torch.randint(0, 3 * size, ())) - (w - 1) + torch.arange(w, device=DEVICE)
    slots = torch.where(t >= 0, t % size, -1)
    sink = torch.randn(h, device=DEVICE)
    joined = torch.cat((slots, size + torch.arange(b, device=DEVICE))).expand(b, -1).contiguous()
    every = torch.arange(b, device=DEVICE).expand(b, -1)
    for op in (attention.reference, attention.fast):
        one = run(op, q, torch.cat((ring, block)), joined, None, None, sink, d**-0.5, None)
        two = run(op, q, ring, slots.expand(b, -1), block, every, sink, d**-0.5, None)
        assert torch.equal(bits(one), bits(two)), f"{op.__name__} (seed {s}, {dt}, B={b})"


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_attention_with_the_inverse_rope_by_position_matches_the_reference(dt):
    """The plain form with the output's inverse RoPE (a DSpark stage's): the kernel within `fast_attend`'s
    tolerance, fresh positions each run; the reference rotates its rounded output as the RoPE op would."""
    s = seed()
    m, h, d, nw = int(torch.randint(1, 7, ())), 4, 64, 40
    q = torch.randn(m, h, d, device=DEVICE).to(dt)
    win = torch.randn(nw, d, device=DEVICE).to(dt)
    wrows = window_rows(m, nw, 16, DEVICE)
    positions = torch.randint(0, 100, (m,), device=DEVICE)
    rope = rope_tables(101, 8, device=DEVICE)
    sink = torch.randn(h, device=DEVICE)
    p_dtype = torch.bfloat16 if dt == torch.bfloat16 else None
    want = attention.reference(q, win, wrows, None, None, sink, d**-0.5, p_dtype, positions, rope)
    plain = attention.reference(q, win, wrows, None, None, sink, d**-0.5, p_dtype)
    cos, sin = rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1)
    assert torch.equal(want, rope_op.reference(plain, cos, sin, inverse=True))
    got = run(attention.fast, q, win, wrows, None, None, sink, d**-0.5, p_dtype, positions, rope)
    assert_close("o", want, got, TOL[dt], context=f"(seed {s}, M={m} {dt})")


def by_position(t, start, h, d, size, window, nc, k, dt, device=DEVICE):
    q = torch.randn(t, h, d, device=device).to(dt)
    ring = torch.randn(size, d, device=device).to(dt)
    keys = torch.randn(t, d, device=device).to(dt)
    positions = torch.arange(start, start + t, device=device)
    comp = torch.randn(nc, d, device=device).to(dt)
    idx = torch.randint(-1, nc, (t, k), device=device)
    return q, ring, keys, positions, window, comp, idx, torch.randn(h, device=device), d**-0.5, \
        torch.bfloat16 if dt == torch.bfloat16 else None, rope_tables(start + t + 1, 8, device=device)


@pytest.mark.parametrize("t,start,dt", [(1, 40, torch.float32), (5, 3, torch.bfloat16), (4, 100, torch.bfloat16)])
def test_attention_by_position_with_the_inverse_rope_matches_the_reference(t, start, dt):
    s = seed()
    args = by_position(t, start, 4, 64, 20, 16, 30, 7, dt)
    want = attention.attend_reference(*args)
    got = run(attention.fast_attend, *args)
    assert_close("o", want, got, TOL[dt], context=f"(seed {s}, T={t} at {start}, {dt})")


def test_a_query_by_position_reads_a_key_alike_from_the_ring_or_from_its_call():
    """A verify block finds its own keys among the call's keys; single steps find the earlier ones in the
    ring (written by the steps before): the same outputs bit for bit."""
    s = seed()
    q, ring, keys, positions, *rest = by_position(6, 30, 4, 64, 32, 16, 30, 7, torch.bfloat16)
    block = attention.fast_attend(q, ring, keys, positions, *rest)
    ring = ring.clone()
    for i in range(6):
        ring[positions[i] % 32] = keys[i]
        one = attention.fast_attend(q[i:i + 1], ring, keys[i:i + 1], positions[i:i + 1], rest[0], rest[1],
                                    rest[2][i:i + 1], *rest[3:])
        assert torch.equal(bits(one), bits(block[i:i + 1])), f"row {i} (seed {s})"


def test_attention_kernel_refuses_a_window_index_for_other_rows():
    q = torch.zeros(2, 4, 64, device=DEVICE)
    win = torch.zeros(10, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"window_index.shape=\(3, 9\): must be \[2, W\]"):
        attention.fast(q, win, torch.zeros(3, 9, dtype=torch.int64, device=DEVICE), None, None,
                       torch.zeros(4, device=DEVICE), 0.125)


def dspark_stage(device, b=5, h=64, d=512, half=32, w=128):
    """A DSpark stage's attention (V4.1 shapes by default) against the reference: the ring's window as one row
    of slots for every query, the block rows as the second list, the output rotated back by position."""
    s = seed()
    size = w + 16
    q = torch.randn(b, h, d, device=device).bfloat16()
    ring, block = (torch.randn(n, d, device=device).bfloat16() for n in (size, b))
    last = int(torch.randint(0, 4 * size, ()))
    t = last - (w - 1) + torch.arange(w, device=device)
    slots = torch.where(t >= 0, t % size, -1).expand(b, -1)
    every = torch.arange(b, device=device).expand(b, -1)
    positions = last + 1 + torch.arange(b, device=device)
    args = (q, ring, slots, block, every, torch.randn(h, device=device), d**-0.5, torch.bfloat16, positions,
            rope_tables(last + b + 1, half, device=device))
    assert_close("o", attention.reference(*args), run(attention.fast, *args), TOL[torch.bfloat16],
                 context=f"(seed {s}, last {last})")


def test_a_dspark_stages_attention_matches_the_reference():
    dspark_stage(DEVICE, b=3, h=4, d=64, half=8, w=16)


@requires_cuda
class TestAttentionAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_attention_kernel_matches_the_reference_at_v41_shapes(self, m):
        check(m, 64, 512, 128 + m, 8192, 512, torch.bfloat16, torch.bfloat16, torch.device("cuda"), False)
        check(m, 64, 512, 128 + m, 20000, 2048, torch.float32, None, torch.device("cuda"), False)

    def test_a_dspark_stages_attention_matches_the_reference_at_v41_shapes(self):
        dspark_stage(torch.device("cuda"))
