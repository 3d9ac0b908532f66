"""The sparse decode attention kernels (window keys + gathered compressed rows, one shared KV head, sink,
split over keys) against the reference.

Tolerance (relative to the largest output): float32 q, logits in float64: one float32 rounding;
bfloat16 q, logits in float32: one bfloat16 rounding plus the float32 logits' effect on the rounded P."""

import pytest
import torch

from kernels import attention

from .kernel_check import DEVICE, assert_close, requires_cuda, run, seed

TOL = {torch.float32: 2.0**-21, torch.bfloat16: 2.0**-6}


def check(m, h, d, nw, nc, k, dt, p_dtype, device=DEVICE, empty_row=True):
    s = seed()
    q = torch.randn(m, h, d, device=device).to(dt)
    win = torch.randn(nw, d, device=device).to(dt)
    mask = torch.rand(m, nw, device=device) < 0.7
    comp = torch.randn(nc, d, device=device).to(dt) if nc else None
    idx = torch.randint(-1, nc, (m, k), device=device) if nc else None
    if empty_row:  # a query that sees nothing: only the sink, output 0
        mask[0] = False
        if idx is not None:
            idx[0] = -1
    sink = torch.randn(h, device=device)
    want = attention.reference(q, win, mask, comp, idx, sink, d**-0.5, p_dtype)
    got = run(attention.fast, q, win, mask, comp, idx, sink, d**-0.5, p_dtype)
    assert_close("o", want, got, TOL[dt], context=f"(seed {s}, M={m} H={h} d={d} Nw={nw} Nc={nc} K={k} {dt} "
                                                   f"p_dtype={p_dtype})")


# (M, H, d, Nw, Nc, K, dtype, p_dtype); 100 + 150 keys take the split path (128 keys per split here)
@pytest.mark.parametrize("case", [
    (3, 4, 64, 20, 30, 7, torch.float32, None),
    (2, 5, 72, 19, 0, 0, torch.float32, None),
    (2, 3, 64, 100, 400, 150, torch.float32, None),
    (3, 4, 64, 21, 33, 9, torch.bfloat16, torch.bfloat16),
    (2, 3, 48, 100, 300, 150, torch.bfloat16, torch.bfloat16),
], ids=lambda c: f"M{c[0]}-H{c[1]}-d{c[2]}-keys{c[3]}+{c[5]}-{str(c[6])[6:]}")
def test_attention_kernel_matches_the_reference_on_odd_shapes(case):
    check(*case)


def test_attention_kernel_refuses_a_mask_of_the_wrong_shape():
    q = torch.zeros(2, 4, 64, device=DEVICE)
    win = torch.zeros(10, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"window_mask.shape=\(2, 9\): must be \(2, 10\)"):
        attention.fast(q, win, torch.ones(2, 9, dtype=torch.bool, device=DEVICE), None, None,
                       torch.zeros(4, device=DEVICE), 0.125)


@requires_cuda
class TestAttentionAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_attention_kernel_matches_the_reference_at_v41_shapes(self, m):
        check(m, 64, 512, 128 + m, 8192, 512, torch.bfloat16, torch.bfloat16, torch.device("cuda"), False)
        check(m, 64, 512, 128 + m, 20000, 2048, torch.float32, None, torch.device("cuda"), False)
