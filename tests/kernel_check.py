"""Shared pieces of the kernel tests (tests/test_kernel_*.py): fresh random seeds, NaN-poisoned outputs,
named comparisons that print their errors, and the device the kernels run on.

Every test draws a new seed (printed on failure, so a failure can be replayed with KERNEL_SEED=...).
The kernels allocate their outputs themselves; `poisoned()` makes every `torch.empty*` allocation inside
the call come back filled with NaN (floats), a sentinel (integers) or True (bool), so an element the kernel
forgets to write shows up as NaN or a wrong value, never as a lucky zero."""

import contextlib
import os
import random

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
INT_SENTINEL = -7777


def seed() -> int:
    """A fresh seed per test (or KERNEL_SEED to replay one), already applied to torch."""
    s = int(os.environ.get("KERNEL_SEED", random.randrange(1 << 31)))
    torch.manual_seed(s)
    return s


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    if t.dtype in (torch.int8, torch.uint8):
        return t.fill_(0x55)
    return t.fill_(INT_SENTINEL)


@contextlib.contextmanager
def poisoned():
    """Within the block, torch.empty / empty_like / empty_strided return poisoned memory."""
    saved = torch.empty, torch.empty_like, torch.empty_strided

    def empty(*a, **k):
        return _poison(saved[0](*a, **k))

    def empty_like(*a, **k):
        return _poison(saved[1](*a, **k))

    def empty_strided(*a, **k):
        return _poison(saved[2](*a, **k))

    torch.empty, torch.empty_like, torch.empty_strided = empty, empty_like, empty_strided
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.empty_strided = saved


def run(fn, *args, **kwargs):
    """Call a kernel wrapper with poisoned allocations."""
    with poisoned():
        return fn(*args, **kwargs)


def assert_close(name: str, want: torch.Tensor, got: torch.Tensor, rtol: float, atol: float = 0.0,
                 context: str = "") -> None:
    """|got - want| <= atol + rtol * max|want| elementwise, same shape and dtype, no NaN anywhere.
    Prints max-abs and relative (to max|want|) error, so passing runs show their margin under -s."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)} {context}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype} {context}"
    g, w = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(g).any(), f"{name}: NaN in the kernel output ({int(torch.isnan(g).sum())}) {context}"
    assert not torch.isnan(w).any(), f"{name}: NaN in the reference output {context}"
    same_inf = (g == w) | (torch.isfinite(g) & torch.isfinite(w))
    assert same_inf.all(), f"{name}: infinities differ {context}"
    fin = torch.isfinite(w)
    diff = (g - w).where(fin, torch.zeros_like(g)).abs()
    scale = w[fin].abs().max().item() if fin.any() else 0.0
    err = diff.max().item() if diff.numel() else 0.0
    rel = err / scale if scale else err
    print(f"{name}: max-abs {err:.3g}, relative {rel:.3g} (rtol {rtol:.3g}, atol {atol:.3g}) {context}")
    assert err <= atol + rtol * scale, f"{name}: max-abs {err:.3g} relative {rel:.3g} > rtol {rtol:.3g} {context}"


def assert_equal(name: str, want: torch.Tensor, got: torch.Tensor, context: str = "") -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)} {context}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype} {context}"
    bad = (got.cpu() != want.cpu())
    if got.dtype.is_floating_point:
        assert not torch.isnan(got).any(), f"{name}: NaN in the kernel output {context}"
    n = int(bad.sum())
    print(f"{name}: {n} of {bad.numel()} differ {context}")
    assert n == 0, f"{name}: {n} of {bad.numel()} elements differ, first at {bad.nonzero()[0].tolist()} {context}"


def assert_within(name: str, want: torch.Tensor, got: torch.Tensor, bound: torch.Tensor, context: str = "") -> None:
    """|got - want| <= bound elementwise (a stated error bound, e.g. K 2^-23 sum|x w| for a float32 sum),
    same shape and dtype, no NaN. Prints the worst ratio of error to bound."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)} {context}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype} {context}"
    g, w, b = got.double().cpu(), want.double().cpu(), bound.double().cpu().expand_as(want)
    assert not torch.isnan(g).any(), f"{name}: NaN in the kernel output {context}"
    err = (g - w).abs()
    ratio = (err / b.clamp(min=1e-300)).max().item() if err.numel() else 0.0
    print(f"{name}: max-abs {err.max().item() if err.numel() else 0:.3g}, worst error/bound {ratio:.3g} {context}")
    bad = err > b
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements over the bound, first at {bad.nonzero()[0].tolist()}: "
                           f"error {err[bad][0].item():.3g} > bound {b[bad][0].item():.3g} {context}")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (so -0 and +0, or two NaNs, compare as what they are)."""
    if not t.dtype.is_floating_point:
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_rows_invariant(name: str, call, rows: int = 6, context: str = "") -> None:
    """Batch invariance: `call(sl)` computes the outputs of rows `sl` (a slice of the test's rows, with
    whatever per-row inputs go with them). For every M in 1..rows, the first M rows computed in one call
    equal, bit for bit, the same rows computed one per call."""
    singles = [call(slice(i, i + 1)) for i in range(rows)]
    for m in range(1, rows + 1):
        together = call(slice(0, m))
        alone = torch.cat(singles[:m])
        assert together.shape == alone.shape, f"{name} M={m}: shape {tuple(together.shape)} != {tuple(alone.shape)}"
        bad = bits(together.cpu()) != bits(alone.cpu())
        assert not bad.any(), (f"{name}: rows computed {m} together differ from one at a time in {int(bad.sum())} "
                               f"of {bad.numel()} elements, first at {bad.nonzero()[0].tolist()} {context}")
    print(f"{name}: rows 1..{rows} together equal one at a time, bit for bit {context}")


def rope_tables(positions: int, half: int, theta: float = 1e4, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) tables [positions, half] as the model builds them (kernels.rope.table)."""
    from kernels.rope import table

    freqs = 1.0 / (theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32, device=device) / (2 * half)))
    return table(torch.arange(positions, device=device), freqs)
