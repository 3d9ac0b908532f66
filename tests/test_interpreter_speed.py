"""The interpreter's shortcuts (kernels/_interpreter_speed.py) change no result: a kernel that calls the
standard library's jit functions inside a launch computes what torch does, the language is as it was after
the launch, and every dtype maps to the numpy dtype the interpreter's own table gives."""

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
