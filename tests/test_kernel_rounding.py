"""The kernels' e4m3 encodings against torch's float8: the rounding (`kernels._triton.e4m3_codes`: the
conversion instruction on the GPU, float32 sums under the interpreter; every value within e4m3's range, ties
to even, carries into the next power of two and subnormals among them, rounds to the cast's code) and FP4's
e2m1 codes re-encoded as e4m3 (`e2m1_low_as_e4m3`: byte-wise shifts and masks on the GPU)."""

import torch
import triton
import triton.language as tl

from kernels._triton import e2m1_high_as_e4m3, e2m1_low_as_e4m3, e4m3_codes
from kernels.formats import E2M1_VALUES

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


@triton.jit
def _e2m1_kernel(b_ptr, y_ptr, BLOCK: tl.constexpr):
    b = tl.load(b_ptr + tl.arange(0, BLOCK))
    codes = tl.join(e2m1_low_as_e4m3(b), e2m1_high_as_e4m3(b))  # [BLOCK, 2]: the low code, the high code
    tl.store(y_ptr + tl.arange(0, 2 * BLOCK), tl.reshape(codes, (2 * BLOCK,)).to(tl.float8e4nv, bitcast=True)
             .to(tl.float32))


def test_fp4_codes_reencoded_as_e4m3_are_their_values_over_64_under_the_interpreter_and_on_cuda():
    """Every byte (two e2m1 codes, the low nibble first) -> two e4m3 codes whose values are the e2m1 values
    (formats.E2M1_VALUES, signed zeros included) times 2^-6, exactly: what the sm_89/90 products rely on."""
    b = torch.arange(256, dtype=torch.uint8).to(DEVICE)
    y = torch.empty(512, device=DEVICE)
    run(_e2m1_kernel[(1,)], b, y, BLOCK=256)
    codes = torch.stack((b.cpu() & 15, b.cpu() >> 4), -1).flatten().long()
    want = E2M1_VALUES[codes] / 64
    got = y.cpu()
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), \
        f"bytes {(got != want).view(256, 2).any(-1).nonzero().flatten()[:8].tolist()} re-encode wrongly"
