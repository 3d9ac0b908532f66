"""Speed for Triton's interpreter (CPU runs of the kernels: the tests, `--path fast` without a GPU).

The interpreter runs a kernel's Python body once per program, each `tl` operation through the language's
type checks and a numpy call (~0.1 ms of Python each, ~90 thousand a tiny forward). Nine of its costs do
nothing for these kernels and are removed here; what the kernels compute is unchanged (the same numpy
calls, bitwise). A change is skipped where a Triton version lacks or has changed the internal it replaces
(the kernels then run as before, slower). Never used on a GPU: compiled kernels do none of this.
"""

import builtins
import dataclasses
import functools
import inspect
import numbers

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def apply() -> None:
    _no_overflow_checks()
    if hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "_LangPatchScope"):
        _patch_language_once_per_launch()
    if hasattr(interpreter, "_patch_builtin") and hasattr(interpreter, "_patch_attr"):
        _builtins_listed_once_and_called_directly()
    if hasattr(interpreter, "_get_np_dtype"):
        _cached_numpy_dtypes()
    if hasattr(interpreter, "_ir") and hasattr(interpreter, "_convert_float") and list(inspect.signature(
            interpreter._convert_float).parameters) == ["input", "input_dtype", "output_dtype", "rounding_mode"]:
        _float_conversions_by_table()
    _shared_block_types()
    if hasattr(interpreter, "interpreter_semantic"):
        _broadcasts_planned_once()
        _expand_dims_planned_once()
        _binary_types_planned_once()


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


def _builtins_listed_once_and_called_directly() -> None:
    """A launch patches every builtin of the language's modules, listing each module's members anew (~0.3 ms a
    launch) though the builtins never change; each patched builtin then copies its keyword arguments less
    `_semantic` and calls the builtin's wrapper, which checks that `_semantic` is given. The builtins are
    listed once per module (as `_patch_builtin` finds them: the language unpatched between launches), each
    with its patched form, made once: it calls the builtin's own function with the interpreter's semantic
    (what the wrapper calls)."""
    patch_attr, semantic = interpreter._patch_attr, interpreter.interpreter_semantic
    listed: dict[int, list] = {}  # id of a module or class of the language -> its (name, builtin, patched)s

    def direct(fn):
        def call(*args, **kwargs):
            kwargs["_semantic"] = semantic
            return fn(*args, **kwargs)
        return call

    def patch_builtin(pkg, builder, scope):
        found = listed.get(id(pkg))
        if found is None:  # functools.wraps' link to the builtin's function, where it has one
            found = listed[id(pkg)] = [(n, m, direct(m.__wrapped__) if hasattr(m, "__wrapped__") else None)
                                       for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member, patched in found:
            if patched is None:
                patch_attr(pkg, name, member, builder, scope)
            else:
                scope.set_attr(pkg, name, patched)

    interpreter._patch_builtin = patch_builtin


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


def _float_conversions_by_table() -> None:
    """The interpreter converts between float formats (bfloat16 <-> float32 in every cast, float32 -> e4m3
    and back in the activation quantization) bit by bit in ~20 numpy passes (~0.15 ms a block: a fourth of a
    prefill's CPU in the checkpoint's formats). Each element's result depends on its own bits alone, and for
    these inputs on 16 of them: an 8- or 16-bit code, or a normal or zero float32's sign, exponent and top 7
    mantissa bits where the result keeps at most 7 of them, cut-off bit included. Those results are looked
    up in a table the interpreter's own conversion makes of every such code, once per pair of formats and
    rounding (which also decides, once, whether the pair is tabled); a float32 subnormal (whose normalization
    reads its low bits) is converted as before."""
    convert, rtne = interpreter._convert_float, interpreter._ir.ROUNDING_MODE.RTNE

    @functools.cache
    def table(src, dst, rounding) -> np.ndarray | None:  # 2^16 results at most (256 KB); None: not tabled
        bits = src.primitive_bitwidth
        if bits <= 16:
            return convert(np.arange(1 << bits, dtype=f"uint{bits}"), src, dst, rounding)
        if src != tl.float32 or dst.fp_mantissa_width + (rounding == rtne) > 7:  # reads more than 16 bits
            return None
        return convert(np.arange(1 << 16, dtype=np.uint32) << 16, src, dst, rounding)

    def by_table(input, src, dst, rounding):
        bits = src.primitive_bitwidth
        found = table(src, dst, rounding) if input.dtype.itemsize * 8 == bits else None
        if found is None:
            return convert(input, src, dst, rounding)
        if bits <= 16:
            return found[input.view(f"uint{bits}")]
        codes = input.view(np.uint32)
        out = found[codes >> 16]
        subnormal = ((codes & 0x7F800000) == 0) & ((codes & 0x7FFFFF) != 0)
        if subnormal.any():
            out[subnormal] = convert(codes[subnormal], src, dst, rounding)
        return out

    by_table.original = convert  # for the test that compares the two
    interpreter._convert_float = by_table


def _shared_block_types() -> None:
    """Every tl operation makes its result's block type (the shape unwrapped, checked, wrapped in the
    language's tuple: ~30 us) and a tensor that wraps that shape again (~15 us): two fifths of a tiny
    prefill. A block type is a value (element type and shape, never changed once made), so one object serves
    every equal one and holds the tensors' wrapped shape (never changed: operations make new tensors); a
    scalar type holds its tensors' (no axes) too.
    Applied only where both constructors set what Triton 3.9's do (else they run as they are)."""
    block_type, tensor = tl.core.block_type, tl.core.tensor
    init_type, init_tensor = block_type.__init__, tensor.__init__
    if (set(init_type.__code__.co_names) != _BLOCK_TYPE_INIT_NAMES
            or set(init_tensor.__code__.co_names) != _TENSOR_INIT_NAMES):
        return
    made: dict[builtins.tuple, object] = {}  # bounded: the kernels' distinct (element type, shape) pairs

    def new(cls, element_ty=None, shape=None):  # copy.copy makes one without arguments: not shared
        if cls is not block_type or not isinstance(shape, (list, builtins.tuple, tl.core.tuple)):
            return object.__new__(cls)
        dims = builtins.tuple(s.value if isinstance(s, tl.constexpr) else s for s in shape)
        key = type(element_ty), element_ty.name, getattr(element_ty, "address_space", None), dims
        found = made.get(key)
        if found is None:
            found = object.__new__(cls)
            init_type(found, element_ty, shape)  # checked: a refused shape raises and is never kept
            found._dims = dims  # compared by the broadcast's shortcut
            made[key] = found
        return found

    def init_once(self, element_ty, shape):
        if "name" not in self.__dict__:
            init_type(self, element_ty, shape)

    def tensor_of(self, handle, type):
        shaped = type.__dict__.get("_tensor_shape")
        if shaped is None:
            init_tensor(self, handle, type)
            type._tensor_shape = (self.numel, self.shape)  # a scalar's too: numel 1, shape ()
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.numel, self.shape = shaped

    block_type.__new__, block_type.__init__, tensor.__init__ = new, init_once, tensor_of


# the names Triton 3.9's block_type.__init__ and tensor.__init__ use (what the shortcut above replaces): another
# set, another constructor
_BLOCK_TYPE_INIT_NAMES = {"TypeError", "_unwrap_shape", "element_ty", "isinstance", "list", "name", "numel",
                          "shape", "tuple", "validate_block_shape"}
_TENSOR_INIT_NAMES = {"__init__", "constexpr", "dtype", "handle", "is_block", "math", "numel", "prod", "scalar",
                      "shape", "super", "tuple", "type"}


def _scalar_key(t) -> builtins.tuple:
    """What tells scalar types apart in a plan's key: the name (a pointer's names its element and constness)
    and the address space."""
    return t.name, getattr(t, "address_space", None)


def _filled(value, shape, ty):
    """A block of type `ty` (`shape`: its dims) holding a scalar's value everywhere, as the interpreter's
    splat fills one."""
    return tl.tensor(interpreter.TensorHandle(np.full(shape, value, dtype=interpreter._get_np_dtype(ty.scalar)),
                                              ty.scalar), ty)


def _broadcasts_planned_once() -> None:
    """Most binary operations take two tensors of one shape (a block and its mask, pointers and offsets),
    which need no broadcast; the language still compares their shapes as its tuples (~25 us). Those return at
    once. A broadcast of a block with a scalar tensor or a block of another shape (a fifth of a tiny forward's
    operations) makes its result types anew each time (a type per step: ~60 us), though they depend on the
    operands' types alone: they are found once per pair of types, by the language's own broadcast (an
    incompatible pair raises there, every time), and an operand is then splat, given its leading axes and
    broadcast by the numpy calls the interpreter's builder makes. Only shared block types
    (`_shared_block_types`: one object per element type and shape, kept for the process) key a plan."""
    semantic = interpreter.interpreter_semantic
    broadcast = semantic.broadcast_impl_value
    handle = interpreter.TensorHandle
    plans: dict[builtins.tuple, builtins.tuple] = {}  # (lhs key, rhs key) -> each operand's result type or None

    def key_of(t):  # a shared block type by identity, a scalar type by its name and address space
        if t.is_block():
            return id(t) if "_dims" in t.__dict__ else None
        return _scalar_key(t)

    def made(x, ty):  # x as the block of type ty: splat (a scalar), leading axes added, then broadcast
        if ty is None:
            return x
        data = x.handle.data
        if not x.type.is_block():
            return _filled(data, ty._dims, ty)
        if data.ndim < len(ty._dims):
            data = data.reshape((1,) * (len(ty._dims) - data.ndim) + data.shape)
        return tl.tensor(handle(np.broadcast_to(data, ty._dims), ty.scalar), ty)

    def planned(lhs, rhs):
        lt, rt = lhs.type, rhs.type
        dims = lt.__dict__.get("_dims")
        if lt is rt or (dims is not None and dims == rt.__dict__.get("_dims")):
            return lhs, rhs
        lk, rk = key_of(lt), key_of(rt)
        plan = plans.get((lk, rk)) if lk is not None and rk is not None else None
        if plan is None:
            out = broadcast(lhs, rhs)  # raises for an incompatible pair
            if lk is not None and rk is not None and (lt.is_block() or rt.is_block()):
                types = [o.type if o.type is not x.type else None for o, x in ((out[0], lhs), (out[1], rhs))]
                if all(t is None or "_dims" in t.__dict__ for t in types):
                    plans[lk, rk] = builtins.tuple(types)
            return out
        return made(lhs, plan[0]), made(rhs, plan[1])

    semantic.broadcast_impl_value = planned


def _expand_dims_planned_once() -> None:
    """A new axis (`x[:, None]`, a broadcast's leading axes) makes its result type from the operand's shape
    unwrapped anew (~25 us); for a shared block type it is found once per type and axis, by the language's own
    expand_dims (a refused axis raises there, every time), and the operand then takes the numpy call the
    interpreter's builder makes."""
    semantic = interpreter.interpreter_semantic
    expand = semantic.expand_dims
    handle = interpreter.TensorHandle
    plans: dict[builtins.tuple, object] = {}  # (id of a shared block type, axis) -> the result's type

    def planned(input, axis):
        ty = input.type
        shared = "_dims" in ty.__dict__ and type(axis) is int
        ret = plans.get((id(ty), axis)) if shared else None
        if ret is None:
            out = expand(input, axis)  # raises for a refused axis
            if shared and "_dims" in out.type.__dict__:
                plans[id(ty), axis] = out.type
            return out
        return tl.tensor(handle(np.expand_dims(input.handle.data, axis), ty.scalar), ret)

    semantic.expand_dims = planned


def _binary_types_planned_once() -> None:
    """A binary operation's type checks (its pointer rules, the computation type of its operands' types) depend
    on the two types alone, yet run in full on every operation (~40 us), as does the cast of an operand already
    of the computation type and the splat of a Python number through a scalar tensor and a new block type
    (~40 us more). The computation type is found once per pair of types and flags, by the language's own
    rules (an illegal pair raises there, every time); an operand is then cast only where its type differs, and
    a number next to a block of the computation type is made a block at once (the language's checked scalar,
    filled as its splat fills it). A Python number's checked scalar is made once per value and computation
    type (a scalar tensor is never changed: operations make new ones)."""
    semantic = interpreter.interpreter_semantic
    check = semantic.binary_op_type_checking_impl
    number = numbers.Number
    plans: dict[builtins.tuple, object] = {}  # (types, flags) -> computation type (None: no arithmetic check)

    def key_of(x, is_number):
        if is_number:
            return semantic.to_tensor_type(x).name, True
        return _scalar_key(x.dtype)

    scalars: dict[builtins.tuple, object] = {}  # (number's type, value, computation type) -> its checked scalar

    def scalar_of(x, ret):  # the range checks and the value's rounding, once per Python int, float or bool
        if type(x) not in (int, float, bool):
            return semantic._cast_to_computation_type(x, ret)
        key = type(x), x.hex() if type(x) is float else x, ret.name  # hex: -0.0 and 0.0 apart
        found = scalars.get(key)
        if found is None:
            if len(scalars) >= 4096:  # offsets and counters are numbers too: bounded
                scalars.clear()
            found = scalars[key] = semantic._cast_to_computation_type(x, ret)
        return found

    def operand(x, is_number, ret, other):
        if not is_number:
            return x if x.dtype.name == ret.name else semantic.cast(x, ret)
        scalar = scalar_of(x, ret)
        if other.type.is_block() and other.dtype.name == ret.name:  # what the broadcast would splat it to
            return _filled(scalar.handle.data, other.handle.data.shape, other.type)
        return scalar

    def planned(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        lhs_number, rhs_number = isinstance(lhs, number), isinstance(rhs, number)
        if lhs_number and rhs_number:
            return check(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        key = (key_of(lhs, lhs_number), key_of(rhs, rhs_number), allow_lhs_ptr, allow_rhs_ptr, arithmetic_check,
               div_or_mod)
        ret = plans.get(key, plans)
        if ret is plans:
            out = check(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)  # raises if illegal
            l_ty = semantic.to_tensor_type(lhs) if lhs_number else lhs.dtype
            r_ty = semantic.to_tensor_type(rhs) if rhs_number else rhs.dtype
            arithmetic = arithmetic_check and not l_ty.is_ptr() and not r_ty.is_ptr()
            plans[key] = semantic.computation_type_impl(l_ty, lhs_number, r_ty, rhs_number, div_or_mod) \
                if arithmetic else None
            return out
        if ret is None:
            lhs, rhs = semantic.to_tensor(lhs), semantic.to_tensor(rhs)
        else:
            if lhs_number:  # the tensor first: the number splats to its cast
                rhs = operand(rhs, False, ret, None)
                lhs = operand(lhs, True, ret, rhs)
            else:
                lhs = operand(lhs, False, ret, None)
                rhs = operand(rhs, rhs_number, ret, lhs)
        return semantic.broadcast_impl_value(lhs, rhs)

    semantic.binary_op_type_checking_impl = planned
