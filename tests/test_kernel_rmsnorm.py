"""The RMSNorm kernel against its reference. Tolerance: one rounding of x's dtype (relative to the largest
output); the float64 interior makes it bit-identical in practice."""

import pytest
import torch

from kernels import rmsnorm

from .kernel_check import DEVICE, assert_close, requires_cuda, run, seed

TOL = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7}


def check(shape, dt, device=DEVICE):
    s = seed()
    x = (torch.randn(*shape, device=device) * 5).to(dt)
    w = 1 + 0.1 * torch.randn(shape[-1], device=device)
    assert_close("y", rmsnorm.reference(x, w, 1e-20), run(rmsnorm.fast, x, w, 1e-20), TOL[dt],
                 context=f"(seed {s}, {tuple(shape)} {dt})")


@pytest.mark.parametrize("shape,dt", [((3, 5, 77), torch.float32), ((1, 1000), torch.bfloat16),
                                      ((13, 33), torch.float32)])
def test_rmsnorm_kernel_matches_the_reference_on_odd_shapes(shape, dt):
    check(shape, dt)


def test_rmsnorm_kernel_refuses_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"weight.shape=\(7,\): must be \(8,\)"):
        rmsnorm.fast(torch.zeros(2, 8, device=DEVICE), torch.ones(7, device=DEVICE), 1e-6)


@requires_cuda
class TestRmsnormAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    @pytest.mark.parametrize("d", [5120, 1280, 512, 128])
    def test_rmsnorm_kernel_matches_the_reference_at_v41_shapes(self, m, d):
        check((m, d), torch.bfloat16, torch.device("cuda"))
