"""Cache keys for static (non-array) arguments: equal only when the program would be the same.

Python calls ``1 == 1.0 == True`` and ``0.0 == -0.0`` equal and hashes them alike, but a program
traced with one is not the program of the other: ``x[False]`` adds a dim where ``x[0]`` indexes,
``xi + 1.0`` is a float where ``xi + 1`` stays an integer, ``h * np.float32(2)`` promotes a
float16 where ``h * 2`` does not, and ``1 / (x * -0.0)`` is ``-inf``. So a key holds the *type*
of every scalar beside it, and a float by its bits (``-0.0`` is not ``0.0``; a NaN is itself).
Containers (tuples, lists, dicts, slices) are keyed element by element, so an unhashable list of
ints still caches.
"""

from __future__ import annotations

import struct

import numpy as np


def static_key(v):
    """A hashable key for ``v`` that tells apart every two values a trace could tell apart.

    Raises ``TypeError`` for a value that cannot be keyed (an unhashable object)."""
    t = type(v)
    if t is bool or t is int or v is None or t is str or t is bytes:
        return (t, v)
    if t is float:
        return (t, struct.pack("<d", v))
    if t is complex:
        return (t, struct.pack("<dd", v.real, v.imag))
    if isinstance(v, np.generic):  # numpy scalars: dtype and bytes
        return (t, v.dtype.str, v.tobytes())
    if t is tuple or t is list:
        return (t,) + tuple(static_key(x) for x in v)
    if t is slice:
        return (t, static_key(v.start), static_key(v.stop), static_key(v.step))
    if t is dict:
        return (t, frozenset((static_key(k), static_key(x)) for k, x in v.items()))
    if isinstance(v, np.dtype):
        return (np.dtype, v.str, v.name)
    if isinstance(v, float):  # a float subclass
        return (t, struct.pack("<d", v))
    hash(v)  # anything else keys by itself (types, Ellipsis, functions, enums ...)
    return (t, v)
