"""Helpers shared by the rule files: padding masks on local shards."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._boxing import _device_index
from .._layout import Layout
from .._sbp import Sbp, broadcast, partial_max, partial_min, partial_sum

B = broadcast
P = partial_sum
PMAX = partial_max
PMIN = partial_min


def uneven_dims(lay: Layout, dims) -> list[int]:
    """Dims among ``dims`` whose blocks are padded somewhere."""
    out = []
    for d in dims:
        k = lay.ways(d)
        if k > 1 and lay.shape[d] % k != 0:
            out.append(d)
    return out


def valid_mask(lay: Layout, dims, ndim: int):
    """Boolean mask (broadcastable to the local block) that is False on padding along ``dims``."""
    mask = None
    dev = None
    for d in uneven_dims(lay, dims):
        sizes = lay.valid_sizes(d)
        if dev is None:
            dev = _device_index(lay.placement)
        n = jnp.asarray(sizes, jnp.int32)[dev]
        shape = [1] * ndim
        shape[d] = lay.local_shape[d]
        m = lax.broadcasted_iota(jnp.int32, tuple(shape), d) < n
        mask = m if mask is None else (mask & m)
    return mask


def mask_padding(x, lay: Layout, dims, fill):
    m = valid_mask(lay, dims, x.ndim)
    if m is None:
        return x
    return jnp.where(m, x, jnp.asarray(fill, x.dtype))


def identity_of(kind: str, dtype):
    """The identity of reduction ``kind`` ("sum", "max", "min") in ``dtype``: what padding is
    replaced by before reducing over a split dim. ``jnp``'s dtype tests, not numpy's: numpy does
    not know bfloat16 or the float8 types as floating. Complex values order lexicographically
    (real part first), so their extremes are infinite in both parts."""
    dt = np.dtype(dtype)
    if kind == "sum":
        return 0
    if dt == np.bool_:
        return kind != "max"
    if jnp.issubdtype(dt, jnp.complexfloating):
        inf = -np.inf if kind == "max" else np.inf
        return complex(inf, inf)
    if jnp.issubdtype(dt, jnp.floating):
        return -np.inf if kind == "max" else np.inf
    info = jnp.iinfo(dt)
    return info.min if kind == "max" else info.max


def splits(ndim: int) -> list[Sbp]:
    from .._sbp import Split

    return [Split(d) for d in range(ndim)]
