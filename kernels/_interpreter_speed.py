"""Speed for Triton's interpreter (CPU runs of the kernels: the tests, `--path fast` without a GPU).

The interpreter runs a kernel's Python body once per program, each `tl` operation through the language's
type checks and a numpy call (~0.1 ms of Python each, ~90 thousand a tiny forward). Three of its costs do
nothing for these kernels and are removed here; what the kernels compute is unchanged (the same numpy
calls, bitwise). A change is skipped where a Triton version lacks the internal it replaces (the kernels
then run as before, slower). Never used on a GPU: compiled kernels do none of this.
"""

import dataclasses
import functools
import inspect

import triton.language as tl
from triton.runtime import interpreter


def apply() -> None:
    _no_overflow_checks()
    if hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope"):
        _patch_language_once_per_launch()
    if hasattr(interpreter, "_get_np_dtype"):
        _cached_numpy_dtypes()


def _no_overflow_checks() -> None:
    """The interpreter checks every int32 add, sub and mul for overflow with extra operations and an assert
    (a fifth of its time on these kernels). Offsets that can pass 2^31 at real sizes are int64 by
    construction, and CPU test sizes are far below 2^31; the GPU compiler never checks."""
    builder = interpreter.interpreter_builder
    if "sanitize_overflow" in {f.name for f in dataclasses.fields(builder.options)}:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _patch_language_once_per_launch() -> None:
    """A launch patches the language modules its kernel sees, for the whole launch; every call of a jit
    function inside it (tl.argmax, tl.cdiv, ... of the standard library) patches them again (~2 ms, a
    seventh of a tiny forward). A call whose modules the running launch has patched skips that."""
    patch = interpreter._patch_lang
    launch = interpreter.GridExecutor.__call__
    patched: set[int] = set()  # ids of the language modules the running launch patched

    @functools.cache
    def langs_of(fn) -> frozenset[int]:  # the language modules a function's globals hold: fixed per function
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_once(fn):
        langs = langs_of(fn)
        if patched and langs <= patched:
            return interpreter._LangPatchScope()  # nothing to restore
        patched.update(langs)
        return patch(fn)

    def launch_then_forget(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()  # the launch restored the modules

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_then_forget


def _cached_numpy_dtypes() -> None:
    """The interpreter maps a Triton dtype to numpy's by building a 19-entry dict on every call (~20 us,
    ~200 thousand calls a tiny forward); the mapping never changes, so it is looked up by the dtype's name
    (a block's by its element's)."""
    numpy_dtype_of = interpreter._get_np_dtype
    known: dict[str, object] = {}

    def numpy_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        found = known.get(tt_dtype.name)
        if found is None:
            found = known[tt_dtype.name] = numpy_dtype_of(tt_dtype)
        return found

    numpy_dtype.original = numpy_dtype_of  # for the test that compares the two
    interpreter._get_np_dtype = numpy_dtype
