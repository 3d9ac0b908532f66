"""The RMSNorm kernel against its reference. Tolerance (kernels/rmsnorm.py): (D/2 + 4) 2^-24 of |y| from the
float32 interior, plus one rounding of x's dtype; rows together equal rows one at a time, bit for bit."""

import pytest
import torch

from kernels import rmsnorm

from .kernel_check import DEVICE, assert_rows_invariant, assert_within, requires_cuda, run, seed

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}


def check(shape, dt, device=DEVICE):
    s = seed()
    x = (torch.randn(*shape, device=device) * 5).to(dt)
    w = 1 + 0.1 * torch.randn(shape[-1], device=device)
    want = rmsnorm.reference(x, w, 1e-20)
    bound = ((shape[-1] / 2 + 4) * 2.0**-24 + ULP[dt]) * want.double().abs()
    ctx = f"(seed {s}, {tuple(shape)} {dt})"
    assert_within("y", want, run(rmsnorm.fast, x, w, 1e-20), bound, ctx)
    x2 = x.reshape(-1, shape[-1])
    assert_rows_invariant("y", lambda sl: run(rmsnorm.fast, x2[sl], w, 1e-20), rows=min(6, x2.shape[0]), context=ctx)


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
