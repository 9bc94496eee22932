"""Eager operators on ``GlobalTensor``: each runs through ``jsbp.jit`` (the same rules and boxing),
cached per (operation, static arguments) and then per input layout."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from ._jit import JitFunction
from ._tensor import GlobalTensor

_CACHE: dict = {}


def _freeze(v):
    if isinstance(v, slice):
        return ("__slice__", v.start, v.stop, v.step)
    if isinstance(v, tuple):
        return ("__tuple__",) + tuple(_freeze(x) for x in v)
    if isinstance(v, list):
        return ("__list__",) + tuple(_freeze(x) for x in v)
    if v is Ellipsis:
        return ("__ellipsis__",)
    if isinstance(v, np.dtype) or isinstance(v, type):
        return ("__dtype__", str(np.dtype(v)))
    return v


def _thaw(v):
    if isinstance(v, tuple) and v and isinstance(v[0], str) and v[0].startswith("__"):
        tag = v[0]
        if tag == "__slice__":
            return slice(*v[1:])
        if tag == "__tuple__":
            return tuple(_thaw(x) for x in v[1:])
        if tag == "__list__":
            return [_thaw(x) for x in v[1:]]
        if tag == "__ellipsis__":
            return Ellipsis
        if tag == "__dtype__":
            return np.dtype(v[1])
    return v


def _is_dynamic(x):
    return isinstance(x, (GlobalTensor, jax.Array, np.ndarray))


def eager(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` (a jax.numpy-level function) on global tensors, consistently."""
    dyn_pos = tuple(i for i, a in enumerate(args) if _is_dynamic(a))
    static = tuple((i, _freeze(a)) for i, a in enumerate(args) if i not in dyn_pos)
    kw = tuple(sorted((k, _freeze(v)) for k, v in kwargs.items()))
    key = (fn, dyn_pos, static, kw)
    try:
        jf = _CACHE.get(key)
    except TypeError:  # unhashable static argument: no caching of the wrapper
        jf, key = None, None
    if jf is None:
        n = len(args)
        st = {i: _thaw(v) for i, v in static}
        kwd = {k: _thaw(v) for k, v in kw}

        def call(*dyn):
            it = iter(dyn)
            full = [st[i] if i in st else next(it) for i in range(n)]
            return fn(*full, **kwd)

        jf = JitFunction(call)
        if key is not None:
            _CACHE[key] = jf
    return jf(*(args[i] for i in dyn_pos))


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
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "truediv": jnp.true_divide,
    "floordiv": jnp.floor_divide, "mod": jnp.mod, "pow": jnp.power, "matmul": jnp.matmul,
    "and": jnp.bitwise_and, "or": jnp.bitwise_or, "xor": jnp.bitwise_xor,
}
for _n, _f in _BINARY.items():
    setattr(GlobalTensor, f"__{_n}__", _binary(_f))
    setattr(GlobalTensor, f"__r{_n}__", _binary(_f, reflected=True))
for _n, _f in {"lt": jnp.less, "le": jnp.less_equal, "gt": jnp.greater, "ge": jnp.greater_equal,
               "eq": jnp.equal, "ne": jnp.not_equal}.items():
    setattr(GlobalTensor, f"__{_n}__", _binary(_f))
GlobalTensor.__hash__ = object.__hash__  # __eq__ is elementwise, identity hash stays
for _n, _f in {"neg": jnp.negative, "pos": jnp.positive, "abs": jnp.abs, "invert": jnp.invert}.items():
    setattr(GlobalTensor, f"__{_n}__", _unary(_f))


def _getitem(self, key):
    return eager(operator.getitem, self, key)


GlobalTensor.__getitem__ = _getitem


def _method(fn):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return eager(fn, self, *args, **kwargs)
    return method


for _n in ("sum", "mean", "max", "min", "prod", "argmax", "argmin", "var", "std", "cumsum",
           "exp", "log", "tanh", "sqrt", "abs", "square", "sin", "cos", "clip", "round", "squeeze",
           "expand_dims", "any", "all", "swapaxes", "ravel", "flatten" if hasattr(jnp, "flatten") else "ravel"):
    setattr(GlobalTensor, _n, _method(getattr(jnp, _n)))


def _reshape(self, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return eager(jnp.reshape, self, tuple(shape))


def _transpose(self, *axes):
    axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    return eager(jnp.transpose, self, tuple(axes) if axes else None)


def _astype(self, dtype):
    return eager(lambda x, dt: x.astype(dt), self, np.dtype(dtype))


GlobalTensor.reshape = _reshape
GlobalTensor.transpose = _transpose
GlobalTensor.T = property(lambda self: eager(jnp.transpose, self, None))
GlobalTensor.astype = _astype
GlobalTensor.matmul = _binary(jnp.matmul)
GlobalTensor.dot = _binary(jnp.dot)
