"""``jsbp.numpy``: jax.numpy functions lifted to global tensors.

``jsbp.numpy.exp(x)`` on a GlobalTensor runs through the SBP rules (eager, cached per layout);
on plain arrays (e.g. inside ``jsbp.jit``, where values are logical arrays) it is ``jnp.exp``.
"""

from __future__ import annotations

import functools

import jax.numpy as _jnp


def _lift(fn):
    from ._ops import eager
    from ._tensor import GlobalTensor

    @functools.wraps(fn)
    def lifted(*args, **kwargs):
        def has_global(a):
            if isinstance(a, GlobalTensor):
                return True
            if isinstance(a, (list, tuple)):
                return any(has_global(x) for x in a)
            return False

        if any(has_global(a) for a in args) or any(has_global(v) for v in kwargs.values()):
            return eager(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return lifted


@functools.cache
def _lifted(name):
    fn = getattr(_jnp, name)
    return _lift(fn) if callable(fn) else fn


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return _lifted(name)
    except AttributeError:
        raise AttributeError(f"jsbp.numpy has no {name!r} (jax.numpy has none either)") from None
