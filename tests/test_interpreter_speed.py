"""The interpreter's shortcuts (kernels/_interpreter_speed.py) change no result: a kernel that calls the
standard library's jit functions inside a launch computes what torch does, the language is as it was after
the launch, every dtype maps to the numpy dtype the interpreter's own table gives, a float conversion looked
up in a table gives the interpreter's own conversion's bits (float32 subnormals, infinities and NaN
included), and a kernel whose operations broadcast in every way (with block types shared, equal shapes not
broadcast and each pair of types' broadcast planned once) computes what torch does, and an incompatible pair
is refused every time."""

import copy

import pytest
import torch

from kernels._triton import INTERPRET, tl, triton

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the shortcuts apply under the interpreter only")


@triton.jit
def _argmax_rows(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n + cols, mask=cols < n, other=float("-inf"))
    # two standard-library jit calls inside the launch: argmax and cdiv
    tl.store(out_ptr + row, tl.argmax(x, 0) + tl.cdiv(n, BLOCK) - 1)


def test_a_kernel_calling_standard_library_jit_functions_matches_torch_and_leaves_the_language_restored():
    load = tl.load
    for _ in range(3):  # the shortcut's state is per launch: several launches in a row
        rows, n = torch.randint(1, 9, ()).item(), torch.randint(1, 100, ()).item()
        x = torch.randn(rows, n)
        out = torch.empty(rows, dtype=torch.int32)
        _argmax_rows[(rows,)](x, out, n, BLOCK=triton.next_power_of_2(n))
        assert torch.equal(out.long(), x.argmax(-1)), (rows, n)
    assert tl.load is load and tl.core.is_builtin(tl.load)  # restored: the launch's patch undone


def test_the_cached_dtype_lookup_gives_the_interpreters_own_mapping_for_every_dtype():
    from triton.runtime import interpreter

    numpy_dtype_of = getattr(interpreter._get_np_dtype, "original", None)  # the interpreter's own
    assert numpy_dtype_of, "the dtype shortcut is not applied with this Triton"
    for name in ("int1", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                 "bfloat16", "float32", "float64", "float8e4nv", "float8e5"):
        ty = getattr(tl, name)
        assert interpreter._get_np_dtype(ty) == numpy_dtype_of(ty), name
        block = tl.block_type(ty, [4, 8])
        assert interpreter._get_np_dtype(block) == numpy_dtype_of(block), name
    pointer = tl.pointer_type(tl.float32)
    assert interpreter._get_np_dtype(pointer) == numpy_dtype_of(pointer)


@pytest.mark.parametrize("src,dst,rounding", [
    ("float32", "bfloat16", None), ("bfloat16", "float32", None), ("float32", "float8e4nv", "RTNE"),
    ("float8e4nv", "float32", None), ("float8e4nv", "float16", "RTNE"), ("float32", "float8e5", "RTNE"),
    ("bfloat16", "float8e4nv", "RTNE"), ("float32", "float16", "RTNE"),  # the last keeps 11 bits: not by table
])
def test_float_conversions_by_table_give_the_interpreters_own_bits(src, dst, rounding):
    import numpy as np
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    assert hasattr(convert, "original"), "the conversion shortcut is not applied with this Triton"
    src, dst = getattr(tl, src), getattr(tl, dst)
    rounding = rounding and getattr(interpreter._ir.ROUNDING_MODE, rounding)
    bits = src.primitive_bitwidth
    codes = torch.randint(0, 1 << bits, (4096,), dtype=torch.int64).numpy().astype(f"uint{bits}")
    if bits == 32:  # every kind of float32: zeros, subnormals (read whole), infinities and NaN
        codes[:64] = np.array([0, 1 << 31, 1, 0x7FFFFF, 0x80400001, 0x7F800000, 0xFF800000, 0x7FC00001] * 8,
                              dtype=np.uint32)
        codes[64:1024] &= np.uint32(0x807FFFFF)  # exponent 0: zeros and subnormals
    shape = (64, 64) if torch.rand(()) < 0.5 else (4096,)
    x = codes.view(np.float32) if bits == 32 else codes
    got, want = convert(x.reshape(shape), src, dst, rounding), convert.original(x.reshape(shape), src, dst, rounding)
    assert got.dtype == want.dtype and got.shape == want.shape
    differ = np.flatnonzero(got.ravel() != want.ravel())
    assert not len(differ), [(hex(codes[i]), hex(got.ravel()[i]), hex(want.ravel()[i])) for i in differ[:8]]


@triton.jit
def _broadcasts(a_ptr, b_ptr, out_ptr, n, m, BN: tl.constexpr, BM: tl.constexpr):
    r = tl.arange(0, BN)
    c = tl.arange(0, BM)
    a = tl.load(a_ptr + r, mask=r < n, other=0.0)
    b = tl.load(b_ptr + c, mask=c < m, other=0)
    # [BN, 1] with [1, BM], a block with a scalar, int32 with float32, equal shapes of two dtypes
    out = a[:, None] * 2.0 + b[None, :] + (a * a + r)[:, None]
    tl.store(out_ptr + r[:, None] * m + c[None, :], out, mask=(r[:, None] < n) & (c[None, :] < m))


def test_block_types_are_shared_by_value_and_a_broadcasting_kernel_matches_torch():
    for _ in range(3):
        n, m = torch.randint(1, 40, (2,)).tolist()
        a, b = torch.randn(n), torch.randint(-50, 50, (m,), dtype=torch.int32)
        out = torch.empty(n, m)
        _broadcasts[(1,)](a, b, out, n, m, BN=triton.next_power_of_2(n), BM=triton.next_power_of_2(m))
        want = a[:, None] * 2.0 + b[None, :] + (a * a + torch.arange(n))[:, None]
        assert torch.equal(out, want), (n, m)
    for _ in range(2):  # a refused shape is refused each time (never kept)
        with pytest.raises(ValueError, match="power of 2"):
            tl.block_type(tl.float32, [3])
    f32 = tl.block_type(tl.float32, [4, 8])
    shared = tl.block_type(tl.float32, [tl.constexpr(4), 8]) is f32
    if not triton.__version__.startswith("3.9."):  # written for 3.9's constructors: elsewhere it may not apply
        return
    assert shared, "the block type is not shared"
    assert tl.block_type(tl.float32, (4, 8)) is f32 and f32.with_element_ty(tl.float32) is f32
    for other in (tl.block_type(tl.float32, [8, 4]), tl.block_type(tl.int32, [4, 8]), f32.with_element_ty(tl.int32)):
        assert other is not f32 and other != f32
    pointer, const = tl.pointer_type(tl.float32), tl.pointer_type(tl.float32, const=True)
    assert tl.block_type(pointer, [4]) is not tl.block_type(const, [4])
    copied = copy.copy(f32)  # made without arguments, then given f32's attributes (Triton's own types cannot
    assert copied == f32 and copied is not f32  # be deep-copied or pickled: their shape tuple recurses)


@triton.jit
def _mixed_types(f_ptr, i_ptr, j_ptr, out_ptr, n, k, BN: tl.constexpr):
    r = tl.arange(0, BN)
    f = tl.load(f_ptr + r, mask=r < n, other=1.0)
    i = tl.load(i_ptr + r, mask=r < n, other=1)
    j = tl.load(j_ptr + r, mask=r < n, other=1)  # int64
    # a block with a Python float and int (either side), int32 with int64 and a scalar int32, a division of two
    # ints (float32), a comparison, a pointer offset by a scalar: each pair of types planned once, taken again
    for _ in range(2):
        out = (2.5 * f - 1) + (i + 3) * j + (7 - i) / (i * i + 1) + (f > 0.25) + k * i + f * k
        out = out + tl.load(f_ptr + k - k + r, mask=r < n, other=0.0)
        out = out + (1.0 / (f * 0.0) > 0) + 2 * (1.0 / (f * -0.0) > 0)  # zeros of either sign: infinities
    tl.store(out_ptr + r, out, mask=r < n)


@triton.jit
def _pointer_plus_float(f_ptr, BN: tl.constexpr):
    tl.store(f_ptr + tl.arange(0, BN), tl.load(f_ptr + 0.5 + tl.arange(0, BN)))


def test_binary_types_planned_once_give_torchs_values_and_an_illegal_pair_is_refused_every_time():
    for _ in range(3):
        n, k = torch.randint(1, 40, ()).item(), torch.randint(-9, 9, ()).item()
        f, i = torch.randn(n), torch.randint(-50, 50, (n,), dtype=torch.int32)
        j = torch.randint(-(1 << 40), 1 << 40, (n,), dtype=torch.int64)
        out = torch.empty(n)
        _mixed_types[(1,)](f, i, j, out, n, k, BN=triton.next_power_of_2(n))
        want = (2.5 * f - 1) + (i + 3) * j + (7 - i) / (i * i + 1) + (f > 0.25) + k * i + f * k + f
        want = want + (1.0 / (f * 0.0) > 0) + 2 * (1.0 / (f * -0.0) > 0)
        assert torch.equal(out, want), (n, k)
    for _ in range(2):  # the language's refusal each time: an illegal pair is never planned
        with pytest.raises(Exception, match="invalid operands of type pointer<fp32> and "):
            _pointer_plus_float[(1,)](torch.zeros(4), BN=4)


@triton.jit
def _planned_broadcasts(a_ptr, b_ptr, s_ptr, out_ptr, n, m, BN: tl.constexpr, BM: tl.constexpr):
    r = tl.arange(0, BN)
    c = tl.arange(0, BM)
    s = tl.load(s_ptr)  # a scalar tensor
    a = tl.load(a_ptr + r, mask=r < n, other=0.0)
    rows = r[:, None] < n
    for _ in range(2):  # each pair of types planned on its first broadcast, taken on the second
        # a scalar pointer with a block of offsets, a scalar tensor with a block (either side), a block with a
        # block of fewer axes (leading axes added), [BN, 1] with [1, BM] (either side)
        b = tl.load(b_ptr + r[:, None] * m + c[None, :], mask=rows & (c[None, :] < m), other=0.0)
        out = s * b + (a * s)[:, None] + (c * 1.0 + b) + c[None, :] * a[:, None] - b / s
    tl.store(out_ptr + r[:, None] * m + c[None, :], out, mask=rows & (c[None, :] < m))


@triton.jit
def _incompatible_broadcast(out_ptr, BN: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BN), tl.arange(0, BN)[:, None] + tl.arange(0, 2 * BN)[:, None])


def test_planned_broadcasts_give_torchs_values_and_an_incompatible_pair_is_refused_every_time():
    for _ in range(3):
        n, m = torch.randint(1, 40, (2,)).tolist()
        a, b, s = torch.randn(n), torch.randn(n, m), torch.randn(1)
        out = torch.empty(n, m)
        _planned_broadcasts[(1,)](a, b, s, out, n, m, BN=triton.next_power_of_2(n), BM=triton.next_power_of_2(m))
        c = torch.arange(m)
        want = s * b + (a * s)[:, None] + (c * 1.0 + b) + c[None, :] * a[:, None] - b / s
        assert torch.equal(out, want), (n, m)
    for _ in range(2):  # the language's refusal each time: an incompatible pair is never planned
        with pytest.raises(Exception, match="incompatible dimensions"):
            _incompatible_broadcast[(1,)](torch.zeros(4, dtype=torch.int32), BN=4)
