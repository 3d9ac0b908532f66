"""The skinny-GEMM kernel (kernels/linear.py `fast`) against its reference: FP8 (32x32 and 128x128 block
scales), FP4 and dense weights, with and without the fused FP8 activation quantization, split-K.

Tolerance (relative to the largest reference output): one rounding of the output dtype. With quantized
operands the float64 sum is exact, so those results must be bit-identical."""

import pytest
import torch

from kernels import linear
from kernels.bench import dense_weight, fp4_weight, fp8_weight

from .kernel_check import DEVICE, assert_close, assert_equal, requires_cuda, run, seed

TOL = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7}
F32, BF16 = torch.float32, torch.bfloat16


def weight(fmt, n, k, device=DEVICE):
    if fmt == "fp4":
        return fp4_weight(n, k, device)
    if fmt == "dense":
        return dense_weight(n, k, torch.bfloat16, device)
    return fp8_weight(n, k, fmt, device)


# (M, N, K, weight format, act_block, x dtype, out dtype): odd sizes; K=704 and 640 take the split-K path
CPU_CASES = [
    (1, 37, 96, (32, 32), 32, F32, F32),
    (3, 50, 704, (128, 128), 32, BF16, BF16),
    (6, 45, 160, "fp4", 32, F32, F32),
    (5, 33, 640, "fp4", None, F32, BF16),
    (2, 19, 72, "dense", None, F32, F32),
    (40, 9, 64, (32, 32), 64, F32, F32),
]


def check(m, n, k, fmt, act_block, dt, out_dt, device=DEVICE):
    s = seed()
    w = weight(fmt, n, k, device)
    x = (torch.randn(m, k, device=device) * 3).to(dt)
    want = linear.reference(x, w, act_block, out_dt)
    got = run(linear.fast, x, w, act_block, out_dt)
    ctx = f"(seed {s}, M={m} N={n} K={k} {fmt} act_block={act_block} {dt}->{out_dt})"
    assert_close("y", want, got, TOL[out_dt], context=ctx)
    if fmt != "dense" and act_block:
        assert_equal("y (quantized operands: exact)", want, got, ctx)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"M{c[0]}-{c[1]}x{c[2]}-{c[3]}-ab{c[4]}")
def test_linear_kernel_matches_the_reference_on_odd_shapes(case):
    check(*case)


def test_a_row_does_not_depend_on_how_many_rows_are_computed_together():
    s = seed()
    w = fp8_weight(29, 96, (32, 32), DEVICE)
    x = torch.randn(6, 96, device=DEVICE)
    together = run(linear.fast, x, w, None, F32)  # no activation quantization: products are not exact
    alone = torch.cat([run(linear.fast, x[i: i + 1], w, None, F32) for i in range(6)])
    assert_equal("rows alone vs together", together, alone, f"(seed {s})")


def test_linear_kernel_refuses_bad_arguments_naming_them():
    w = fp8_weight(16, 64, (32, 32), DEVICE)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=48: must equal the weight's input size 64"):
        linear.fast(torch.zeros(2, 48, device=DEVICE), w, None, F32)
    with pytest.raises(ValueError, match="act_block=48: must be a power of two"):
        linear.fast(torch.zeros(2, 64, device=DEVICE), w, 48, F32)
    with pytest.raises(TypeError, match="x.dtype=float16"):
        linear.fast(torch.zeros(2, 64, device=DEVICE, dtype=torch.float16), w, None, F32)


@requires_cuda
class TestLinearAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    @pytest.mark.parametrize("n,k,fmt", [(1280, 5120, (32, 32)), (32768, 1280, (32, 32)), (512, 5120, (32, 32)),
                                         (5120, 8192, (32, 32)), (4096, 1280, (32, 32)), (2304, 5120, "fp4"),
                                         (5120, 2304, "fp4"), (2304, 5120, (128, 128))])
    def test_linear_kernel_matches_the_reference_at_v41_shapes(self, m, n, k, fmt):
        check(m, n, k, fmt, 32, BF16, BF16, torch.device("cuda"))
