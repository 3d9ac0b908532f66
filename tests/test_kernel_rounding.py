"""The kernels' e4m3 rounding (`kernels._triton.e4m3_codes`: the conversion instruction on the GPU, float32
sums under the interpreter) against torch's float8 cast: every value within e4m3's range, ties to even,
carries into the next power of two and subnormals among them, rounds to the same code."""

import torch
import triton
import triton.language as tl

from kernels._triton import e4m3_codes

from .kernel_check import DEVICE, run, seed


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, e4m3_codes(x).to(tl.float32), mask=offs < n)


def test_e4m3_codes_round_as_the_float8_cast_does_under_the_interpreter_and_on_cuda():
    s = seed()
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid.abs() <= 448)].unique()
    ties = (grid[1:] + grid[:-1]) / 2  # halfway between neighbours: to the even code, carries included
    x = torch.cat([grid, ties, torch.nextafter(ties, grid[1:]), torch.nextafter(ties, grid[:-1]),
                   (torch.rand(4096) * 2 - 1) * 448, torch.randn(4096) * 2.0**-7]).clamp(-448, 448).to(DEVICE)
    y = torch.empty_like(x)
    run(_round_kernel[(triton.cdiv(x.numel(), 1024),)], x, y, x.numel(), BLOCK=1024)
    want = x.cpu().to(torch.float8_e4m3fn).float()
    bad = y.cpu() != want
    assert not bad.any(), (f"(seed {s}) {int(bad.sum())} values round differently, e.g. {x[bad][:4].tolist()} -> "
                           f"{y.cpu()[bad][:4].tolist()}, the cast gives {want[bad][:4].tolist()}")
