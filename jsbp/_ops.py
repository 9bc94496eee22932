"""Eager operators on ``GlobalTensor``: each runs through ``jsbp.jit`` (the same rules and boxing),
cached per (operation, static arguments) and then per input layout."""

from __future__ import annotations

import collections
import copy
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import PlacementError, SbpError
from ._jit import JitFunction
from ._statickey import static_key
from ._tensor import GlobalTensor, _canonical_dtype
from ._trace import current_tracer

EAGER_CACHE_SIZE = 1024
"""Most eager programs kept, one per operation and static arguments (``x.reshape(4, 8)`` and
``x.reshape(8, 4)`` are two); past it the least recently used is dropped (and compiled again if
called again), so a loop whose static arguments change every step does not grow memory."""

_CACHE: collections.OrderedDict = collections.OrderedDict()


def _is_dynamic(x):
    return isinstance(x, (GlobalTensor, jax.Array, np.ndarray))


# functions whose positional arguments are all array operands: a Python scalar among them is a
# weakly typed traced operand (as ``jnp`` makes it), not part of the program, so ``x * lr`` with a
# new ``lr`` every step runs one compiled program (``jnp.ufunc`` instances count too)
_OPERAND_FNS = {
    jnp.add,
    jnp.subtract,
    jnp.multiply,
    jnp.true_divide,
    jnp.divide,
    jnp.floor_divide,
    jnp.mod,
    jnp.remainder,
    jnp.power,
    jnp.float_power,
    jnp.bitwise_and,
    jnp.bitwise_or,
    jnp.bitwise_xor,
    jnp.less,
    jnp.less_equal,
    jnp.greater,
    jnp.greater_equal,
    jnp.equal,
    jnp.not_equal,
    jnp.maximum,
    jnp.minimum,
    jnp.fmax,
    jnp.fmin,
    jnp.fmod,
    jnp.arctan2,
    jnp.hypot,
    jnp.copysign,
    jnp.logaddexp,
    jnp.clip,
    jnp.where,
}
_SCALARS = (bool, int, float, complex)


def _int_fits(v: int) -> bool:
    """A Python int operand is traced as JAX's default int (weakly typed, as ``jnp``'s jitted
    functions take it: ``uint8 + 300`` wraps there too) where it fits one; a bigger one stays
    part of the program, where ``jnp`` raises its overflow error."""
    info = np.iinfo(np.int64 if jax.config.jax_enable_x64 else np.int32)
    return info.min <= v <= info.max


def _scalar_operand(fn, i, a) -> bool:
    """Whether argument ``i`` (``a``) of a call of ``fn`` is a scalar that runs as a traced operand."""
    t = type(a)
    if t not in _SCALARS and not (
        isinstance(a, np.generic) and (isinstance(a, np.number) or t is np.bool_)
    ):
        return False
    if not (fn in _OPERAND_FNS or isinstance(fn, jnp.ufunc)):
        return False
    if fn is jnp.power and i == 1 and (t is int or t is bool or isinstance(a, np.integer)):
        return False  # ``x ** 2`` is ``lax.integer_pow`` for a concrete integer, as on a jax.Array
    return t is not int or _int_fits(a)


def eager(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` (a jax.numpy-level function) on global tensors, consistently.

    Arrays and the scalar operands of elementwise functions (``_scalar_operand``) are the
    program's arguments; the other arguments are part of the program and key its cache by type
    and value (``_statickey``). The program's own cache keys its arguments by types and layouts:
    ``x * 0.1`` and ``x * 0.2`` run one compiled program."""
    dyn_pos = tuple(i for i, a in enumerate(args) if _is_dynamic(a) or _scalar_operand(fn, i, a))
    try:  # typed keys: 1, 1.0, True and -0.0 are different programs (``_statickey``)
        # the scalar operands' types: a bool or numpy scalar (a strong 0-d array, which the
        # program's fast path does not take) gets a wrapper of its own, leaving the weakly typed
        # Python numbers' on it
        key = (
            fn,
            dyn_pos,
            static_key(tuple(a for i, a in enumerate(args) if i not in dyn_pos)),
            static_key(kwargs),
            tuple(type(args[i]) for i in dyn_pos if not _is_dynamic(args[i])),
        )
        jf = _CACHE.get(key)
        if jf is not None:
            _CACHE.move_to_end(key)
    except TypeError:  # unhashable static argument: no caching of the wrapper
        jf, key = None, None
    except KeyError:  # another thread dropped it meanwhile
        pass
    if jf is None:
        n = len(args)
        # copies: the wrapper is cached under these values, a list mutated later must not change it
        st = copy.deepcopy({i: a for i, a in enumerate(args) if i not in dyn_pos})
        kwd = copy.deepcopy(kwargs)

        def call(*dyn):
            it = iter(dyn)
            full = [st[i] if i in st else next(it) for i in range(n)]
            return fn(*full, **kwd)

        jf = JitFunction(call)
        if key is not None:
            _CACHE[key] = jf
            while len(_CACHE) > EAGER_CACHE_SIZE:
                try:
                    _CACHE.popitem(last=False)
                except KeyError:  # emptied by another thread
                    break
    try:
        return jf(*(args[i] for i in dyn_pos))
    except (SbpError, PlacementError):
        raise
    except (TypeError, ValueError) as e:  # JAX rejected the operands (shapes, dtypes, arguments)
        name = getattr(fn, "__name__", None) or repr(fn)
        name = "astype" if name == "<lambda>" else name
        ops = "; ".join(
            f"operand {i}: {a._layout.describe()}"
            for i, a in enumerate(args)
            if isinstance(a, GlobalTensor)
        )
        raise SbpError(
            f"{name} on global tensors ({ops}) failed: {type(e).__name__}: {e} Change the operands' "
            "shapes or the arguments so that the operation is valid on the logical (global) shapes."
        ) from e


def _binary(fn, reflected=False):
    if reflected:

        def method(self, other):
            return eager(fn, other, self)
    else:

        def method(self, other):
            return eager(fn, self, other)

    return method


def _unary(fn):
    def method(self):
        return eager(fn, self)

    return method


_BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "truediv": jnp.true_divide,
    "floordiv": jnp.floor_divide,
    "mod": jnp.mod,
    "pow": jnp.power,
    "matmul": jnp.matmul,
    "and": jnp.bitwise_and,
    "or": jnp.bitwise_or,
    "xor": jnp.bitwise_xor,
}
for _n, _f in _BINARY.items():
    setattr(GlobalTensor, f"__{_n}__", _binary(_f))
    setattr(GlobalTensor, f"__r{_n}__", _binary(_f, reflected=True))
for _n, _f in {
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
}.items():
    setattr(GlobalTensor, f"__{_n}__", _binary(_f))
GlobalTensor.__hash__ = object.__hash__  # __eq__ is elementwise, identity hash stays
for _n, _f in {
    "neg": jnp.negative,
    "pos": jnp.positive,
    "abs": jnp.abs,
    "invert": jnp.invert,
}.items():
    setattr(GlobalTensor, f"__{_n}__", _unary(_f))


def _check_bounds(shape, key):
    """``IndexError`` for a static integer index out of range (JAX would clamp it: ``x[5]`` of a
    length-3 tensor would read ``x[2]``, and ``list(x)`` would never end)."""
    key = key if isinstance(key, tuple) else (key,)

    def width(k):  # dims an index entry consumes
        if k is None:
            return 0
        if isinstance(k, (bool, np.bool_)):
            return 0
        if getattr(k, "dtype", None) is not None and np.dtype(k.dtype) == np.bool_:
            return len(np.shape(k))
        return 1

    n_used = sum(width(k) for k in key if k is not Ellipsis)
    dim = 0
    for k in key:
        if k is Ellipsis:
            dim += max(len(shape) - n_used, 0)
            continue
        if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
            if dim >= len(shape):
                raise IndexError(f"too many indices for a global tensor of shape {shape}")
            n = shape[dim]
            if not -n <= int(k) < n:
                raise IndexError(f"index {int(k)} is out of bounds for dim {dim} with size {n}")
        dim += width(k)


def _getitem(self, key):
    _check_bounds(self.shape, key)
    return eager(operator.getitem, self, key)


GlobalTensor.__getitem__ = _getitem


def _method(fn):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return eager(fn, self, *args, **kwargs)

    return method


for _n in (
    "sum",
    "mean",
    "max",
    "min",
    "prod",
    "argmax",
    "argmin",
    "var",
    "std",
    "cumsum",
    "exp",
    "log",
    "tanh",
    "sqrt",
    "abs",
    "square",
    "sin",
    "cos",
    "clip",
    "round",
    "squeeze",
    "expand_dims",
    "any",
    "all",
    "swapaxes",
    "ravel",
    "flatten" if hasattr(jnp, "flatten") else "ravel",
):
    setattr(GlobalTensor, _n, _method(getattr(jnp, _n)))


def _reshape(self, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return eager(jnp.reshape, self, tuple(shape))


def _transpose(self, *axes):
    axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    return eager(jnp.transpose, self, tuple(axes) if axes else None)


def _astype(self, dtype):
    _canonical_dtype(dtype)  # an SbpError for what is no numeric dtype
    return eager(lambda x, dt: x.astype(dt), self, np.dtype(dtype))


GlobalTensor.reshape = _reshape
GlobalTensor.transpose = _transpose
GlobalTensor.T = property(lambda self: eager(jnp.transpose, self, None))
GlobalTensor.astype = _astype
GlobalTensor.matmul = _binary(jnp.matmul)
GlobalTensor.dot = _binary(jnp.dot)


def _jax_array(self):
    """``jax.numpy`` functions called on a GlobalTensor outside ``jsbp.jit`` would silently drop the
    layout (or fail with a bare TypeError): say what to use instead."""
    if current_tracer() is not None:
        raise SbpError(
            f"a GlobalTensor ({self._layout.describe()}) is closed over (captured from outside) by a "
            "function being traced under jsbp.jit. Pass it as an argument of the jitted "
            "function instead: inside jsbp.jit every global tensor must come in as an argument, where "
            "it becomes a logical array."
        )
    raise SbpError(
        f"a jax.numpy / jax.lax function was called on a GlobalTensor ({self._layout.describe()}) outside "
        "jsbp.jit. Use jsbp.numpy.<fn> (e.g. jsbp.numpy.sin(x)) or run the code under jsbp.jit, where "
        "values are logical arrays; for a plain array use x.to_jax() (jax) or x.numpy() (numpy)."
    )


GlobalTensor.__jax_array__ = _jax_array
