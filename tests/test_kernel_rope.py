"""The RoPE kernel against its reference, forward and inverse, with cos/sin broadcast per token (queries,
[T, 1, r/2]) or per row (keys, [T, r/2]). Tolerance (kernels/rope.py): 2^-23 (|a c| + |b s|) before the final
rounding: 2^-21 of the largest output for float32, one bfloat16 ulp (2^-7) for bfloat16. Elementwise, so
batch invariant (checked too)."""

import pytest
import torch

from kernels import rope

from .kernel_check import DEVICE, assert_close, assert_rows_invariant, requires_cuda, run, seed

TOL = {torch.float32: 2.0**-21, torch.bfloat16: 2.0**-7}


def check(shape, cos_shape, dt, inverse, device=DEVICE):
    s = seed()
    x = torch.randn(*shape, device=device).to(dt)
    ang = torch.rand(*cos_shape, device=device) * 6.3
    cos, sin = ang.cos(), ang.sin()
    ctx = f"(seed {s}, x {tuple(shape)} cos {tuple(cos_shape)} {dt} inverse={inverse})"
    assert_close("y", rope.reference(x, cos, sin, inverse), run(rope.fast, x, cos, sin, inverse), TOL[dt], context=ctx)
    assert_rows_invariant("y", lambda sl: run(rope.fast, x[sl], cos[sl], sin[sl], inverse), rows=min(6, shape[0]),
                          context=ctx)


@pytest.mark.parametrize("shape,cos_shape,dt,inverse", [
    ((5, 3, 72), (5, 1, 8), torch.float32, False),
    ((5, 3, 72), (5, 1, 8), torch.bfloat16, True),
    ((7, 40), (7, 20), torch.float32, True),
    ((2, 3, 2, 24), (2, 1, 1, 12), torch.float32, False),
])
def test_rope_kernel_matches_the_reference_within_one_rounding(shape, cos_shape, dt, inverse):
    check(shape, cos_shape, dt, inverse)


def test_rope_kernel_refuses_tables_wider_than_the_vector():
    with pytest.raises(ValueError, match=r"cos.shape\[-1\]=40: must be <= x.shape\[-1\] / 2 = 32"):
        table = torch.zeros(2, 40, device=DEVICE)
        rope.fast(torch.zeros(2, 64, device=DEVICE), table, table)


@requires_cuda
class TestRopeAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_rope_kernel_matches_the_reference_at_v41_shapes(self, m):
        for shape, cos_shape in (((m, 64, 512), (m, 1, 32)), ((m, 512), (m, 32)), ((m, 32, 128), (m, 1, 32))):
            for inverse in (False, True):
                check(shape, cos_shape, torch.bfloat16, inverse, torch.device("cuda"))
