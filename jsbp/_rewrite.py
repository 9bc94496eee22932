"""Local implementations that communicate: ops whose operand may stay split along the dim they
scan or reduce, run as a small program of their own instead of gathering the operand.

* ``argmax`` / ``argmin`` over a split dim: the extremum (a partial max / min, one all-reduce of
  the result's size), then the least index that holds it (another).
* ``cumsum`` / ``cumprod`` / ``cummax`` / ``cummin`` along a dim split evenly into ``k`` blocks:
  each block scans its own elements, the ``k`` block totals are scanned, and each block combines
  its offset in. Only the totals move.
* ``reduce_prod`` / ``reduce_and`` / ``reduce_or`` / ``reduce_xor`` over a dim split evenly into
  ``k`` blocks: each block reduces its own elements, then the ``k`` per-block results.

``rewrites(eqn, placement)`` lists, per operand layout that keeps the dim split, the layout of
the result and the jaxpr that computes it. The planner (``_problem.build``) offers each as one
more candidate signature of the equation, priced as that jaxpr's own plan with the two layouts
fixed, and runs the jaxpr's plan where the candidate is chosen (``_lower``).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax import lax

from . import _sbp

ARG_EXTREMA = {"argmax": "max", "argmin": "min"}
SCANS = frozenset({"cumsum", "cumprod", "cummax", "cummin"})
BLOCK_REDUCTIONS = frozenset({"reduce_prod", "reduce_and", "reduce_or", "reduce_xor"})
REWRITTEN = frozenset(ARG_EXTREMA) | SCANS | BLOCK_REDUCTIONS


def rewrites(eqn, placement) -> list[tuple[tuple, tuple, object, list]]:
    """[(operand nd-sbp, result nd-sbp, jaxpr, consts)] for the layouts where ``eqn`` runs as its
    own small program (see the module doc); [] for another primitive."""
    name = eqn.primitive.name
    if name not in REWRITTEN:
        return []
    (x,) = eqn.invars
    shape = tuple(x.aval.shape)
    hier = placement.hierarchy
    dims = tuple(eqn.params["axes"]) if name not in SCANS else (eqn.params["axis"],)
    per_axis = [_sbp.split(d) for d in range(len(shape))] + [_sbp.broadcast]
    out = []
    for nd in itertools.product(per_axis, repeat=placement.ndim):
        ways = {d: 1 for d in dims}
        for a, s in enumerate(nd):
            if s.is_split and s.dim in ways:
                ways[s.dim] *= hier[a]
        split = [d for d in dims if ways[d] > 1]
        if not split:
            continue
        if name in ARG_EXTREMA:
            jx = _arg_extremum_jaxpr(eqn)
        else:
            d, k = split[0], ways[split[0]]
            if len(split) > 1 or shape[d] % k or shape[d] // k < 2:
                continue  # blocks of one dim, even and longer than one element
            jx = _blocked_scan_jaxpr(eqn, k) if name in SCANS else _blocked_reduce_jaxpr(eqn, d, k)
        out.append((nd, _result_nd(nd, name, dims), *jx))
    return out


def _result_nd(nd, name, dims):
    """The result's layout: a scan keeps the operand's; a reduction drops the reduced dims (B on
    the axes that split them, other splits renumbered)."""
    if name in SCANS:
        return tuple(nd)
    out = []
    for s in nd:
        if not s.is_split:
            out.append(s)
        elif s.dim in dims:
            out.append(_sbp.broadcast)
        else:
            out.append(_sbp.split(s.dim - sum(1 for d in dims if d < s.dim)))
    return tuple(out)


def _traced(fn, aval):
    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return closed.jaxpr, list(closed.consts)


def _arg_extremum_jaxpr(eqn):
    """``argmax`` / ``argmin`` with reductions that have partial layouts. Exactly JAX's answer:
    NaN counts as the extremum and the first of equal values wins (-0.0 and 0.0 are equal)."""
    (d,) = eqn.params["axes"]
    index_dtype = eqn.params["index_dtype"]
    find = jnp.max if ARG_EXTREMA[eqn.primitive.name] == "max" else jnp.min

    def arg_extremum(x):
        m = find(x, axis=d, keepdims=True)
        hit = x == m
        if jnp.issubdtype(x.dtype, jnp.inexact):
            hit = hit | (jnp.isnan(x) & jnp.isnan(m))
        idx = lax.broadcasted_iota(index_dtype, x.shape, d)
        return jnp.min(jnp.where(hit, idx, jnp.asarray(x.shape[d], index_dtype)), axis=d)

    return _traced(arg_extremum, eqn.invars[0].aval)


def _blocked_scan_jaxpr(eqn, k: int):
    """A cumulative op along a dim split evenly into ``k`` blocks (see the module doc)."""
    d, reverse = eqn.params["axis"], eqn.params["reverse"]
    name = eqn.primitive.name
    op = {"cumsum": lax.cumsum, "cumprod": lax.cumprod, "cummax": lax.cummax, "cummin": lax.cummin}[
        name
    ]
    combine = {"cumsum": lax.add, "cumprod": lax.mul, "cummax": lax.max, "cummin": lax.min}[name]

    def blocked(x):
        shape = x.shape
        y = x.reshape(shape[:d] + (k, shape[d] // k) + shape[d + 1 :])
        c = op(y, axis=d + 1, reverse=reverse)
        tot = lax.index_in_dim(c, 0 if reverse else c.shape[d + 1] - 1, axis=d + 1, keepdims=False)
        incl = op(tot, axis=d, reverse=reverse)
        # exclusive: the combination of the blocks before this one (identity for the first)
        first = lax.full_like(lax.index_in_dim(incl, 0, axis=d), _scan_identity(name, x.dtype))
        if reverse:
            excl = lax.concatenate([lax.slice_in_dim(incl, 1, k, axis=d), first], d)
        else:
            excl = lax.concatenate([first, lax.slice_in_dim(incl, 0, k - 1, axis=d)], d)
        return combine(c, lax.expand_dims(excl, (d + 1,))).reshape(shape)

    return _traced(blocked, eqn.invars[0].aval)


def _scan_identity(name, dtype):
    from .rules._common import identity_of

    if name == "cumprod":
        return 1
    return identity_of({"cumsum": "sum", "cummax": "max", "cummin": "min"}[name], dtype)


def _blocked_reduce_jaxpr(eqn, d: int, k: int):
    """A product / logical reduction over dim ``d`` split evenly into ``k`` blocks: each block
    reduces its own elements (and the other reduced dims), then the ``k`` per-block results."""
    axes = tuple(eqn.params["axes"])
    prim, params = eqn.primitive, dict(eqn.params)

    def blocked(x):
        shape = x.shape
        y = x.reshape(shape[:d] + (k, shape[d] // k) + shape[d + 1 :])
        inner = tuple(a + 1 if a > d else a for a in axes if a != d) + (d + 1,)
        per_block = prim.bind(y, **dict(params, axes=tuple(sorted(inner))))
        # the block dim ``d`` is now at ``d`` minus the reduced dims before it
        at = d - sum(1 for a in axes if a < d)
        return prim.bind(per_block, **dict(params, axes=(at,)))

    return _traced(blocked, eqn.invars[0].aval)
