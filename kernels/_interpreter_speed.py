"""Speed for Triton's interpreter (CPU runs of the kernels: the tests, `--path fast` without a GPU).

The interpreter runs a kernel's Python body once per program, each `tl` operation through the language's
type checks and a numpy call (~0.1 ms of Python each, ~90 thousand a tiny forward). Five of its costs do
nothing for these kernels and are removed here; what the kernels compute is unchanged (the same numpy
calls, bitwise). A change is skipped where a Triton version lacks the internal it replaces (the kernels
then run as before, slower). Never used on a GPU: compiled kernels do none of this.
"""

import builtins
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
    if _has_fields(tl.core.block_type, "element_ty", "shape", "numel", "name"):
        _shared_block_types()
    if _has_fields(tl.core.tensor, "handle", "type", "dtype", "numel", "shape"):
        _tensor_shapes_per_type()
    if hasattr(interpreter, "interpreter_semantic"):
        _no_broadcast_of_equal_types()


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


def _has_fields(cls, *names: str) -> bool:
    """Whether `cls.__init__` sets exactly what the shortcut for it sets (else the Triton version differs)."""
    code = cls.__init__.__code__
    return all(name in code.co_names for name in names)


def _shared_block_types() -> None:
    """Every tl operation makes the block type of its result: the shape unwrapped, checked and wrapped in
    the language's own tuple (~30 us; a fifth of a tiny prefill). A block type is a value (its element type
    and shape, never changed after it is made), so one object serves every equal one: made once per
    (element type, shape). Unusual shapes (not a list or tuple of ints) are made as before."""
    block_type = tl.core.block_type
    init = block_type.__init__
    made: dict[builtins.tuple, object] = {}  # bounded: the kernels' distinct (dtype, block shape) pairs

    def key_of(element_ty, shape):
        if not isinstance(shape, (list, builtins.tuple, tl.core.tuple)):
            return None
        dims = builtins.tuple(s.value if isinstance(s, tl.constexpr) else s for s in shape)
        if not all(type(d) is int for d in dims):
            return None
        return type(element_ty), element_ty.name, getattr(element_ty, "address_space", None), dims

    def new(cls, element_ty, shape):
        key = key_of(element_ty, shape) if cls is block_type else None
        if key is None:
            return object.__new__(cls)
        found = made.get(key)
        if found is None:
            found = object.__new__(cls)
            init(found, element_ty, shape)
            found._dims = key[-1]  # the shape as ints: compared by the broadcast's shortcut
            made[key] = found
        return found

    def init_once(self, element_ty, shape):
        if "name" not in self.__dict__:  # a shared one is made (and checked) once
            init(self, element_ty, shape)

    block_type.__new__ = new
    block_type.__init__ = init_once


def _tensor_shapes_per_type() -> None:
    """A tensor wraps its block type's shape in a new tuple of constexprs each time it is made (~15 us, the
    next fifth); with block types shared, a type's wrapped shape is made once and every tensor of that type
    holds it (never changed: operations make new tensors)."""
    tensor = tl.core.tensor
    init = tensor.__init__

    def init_from_type(self, handle, type):
        shaped = type.__dict__.get("_tensor_shape")
        if shaped is None:
            init(self, handle, type)
            if type.is_block():
                type._tensor_shape = (self.numel, self.shape)
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.numel, self.shape = shaped

    tensor.__init__ = init_from_type


def _no_broadcast_of_equal_types() -> None:
    """Most binary operations take two tensors of one shape (a pointer block and its offsets; with block types
    shared, often the same type object), which need no broadcast; the language still compares their shapes
    as its tuples (~25 us). Those return at once, as they would after the comparison."""
    semantic = interpreter.interpreter_semantic
    broadcast = semantic.broadcast_impl_value

    def broadcast_unless_equal(lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if lt is rt:
            return lhs, rhs
        dims = getattr(lt, "_dims", None)
        if dims is not None and dims == getattr(rt, "_dims", None):
            return lhs, rhs
        return broadcast(lhs, rhs)

    semantic.broadcast_impl_value = broadcast_unless_equal
