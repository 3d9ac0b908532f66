"""The RoPE kernel against its reference, forward and inverse, with cos/sin broadcast per token (queries,
[T, 1, r/2]) or per row (keys, [T, r/2]). Tolerance: bit-identical (float64 products of float32 values
are exact, so every rotated value is rounded as the reference rounds it)."""

import pytest
import torch

from kernels import rope

from .kernel_check import DEVICE, assert_equal, requires_cuda, run, seed


def check(shape, cos_shape, dt, inverse, device=DEVICE):
    s = seed()
    x = torch.randn(*shape, device=device).to(dt)
    ang = torch.rand(*cos_shape, device=device) * 6.3
    cos, sin = ang.cos(), ang.sin()
    assert_equal("y", rope.reference(x, cos, sin, inverse), run(rope.fast, x, cos, sin, inverse),
                 f"(seed {s}, x {tuple(shape)} cos {tuple(cos_shape)} {dt} inverse={inverse})")


@pytest.mark.parametrize("shape,cos_shape,dt,inverse", [
    ((5, 3, 72), (5, 1, 8), torch.float32, False),
    ((5, 3, 72), (5, 1, 8), torch.bfloat16, True),
    ((7, 40), (7, 20), torch.float32, True),
    ((2, 3, 2, 24), (2, 1, 1, 12), torch.float32, False),
])
def test_rope_kernel_matches_the_reference_bit_for_bit(shape, cos_shape, dt, inverse):
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
