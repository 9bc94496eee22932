"""``ragged_dot_general`` (``jax.lax.ragged_dot``): the grouped matmul of a mixture of experts.

The lhs rows (or contracting rows) are cut into consecutive groups by ``group_sizes``; group ``g``
multiplies with slice ``g`` of the rhs's group dim (``jnp.argsort`` by expert, then one matmul
per expert). Two modes have rules, with no batch dims and one-dimensional ``group_sizes``:

* **ragged rows** (the forward matmul and the lhs cotangent): lhs ``[m, k]`` (the ragged dim
  ``m`` a free dim), rhs ``[g, k, n]`` -> ``[m, n]``;
* **ragged contraction** (the rhs cotangent): lhs ``[m, k]``, rhs ``[m, n]``, ``m`` contracted
  group by group -> ``[g, k, n]``.

Expert parallelism is the rhs's **group dim split**: each device multiplies only the rows of the
groups it holds (its groups' rows found from the global ``group_sizes``), zeros elsewhere, so the
ragged-rows result is a partial sum ``P`` and the ragged-contraction result is produced split on
its group dim. Splitting the ragged rows themselves runs each block with the group sizes cut to
the block's rows (the experts replicated). Every local function runs on the global row numbering:
no communication.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from .._boxing import _device_index
from .._sbp import Split
from ._common import B, P, mask_padding
from ._registry import LocalCost, register_sbp_rule


def _dims(params, lhs_rank):
    """(mode, ragged dim, lhs contracting, rhs contracting, lhs batch, rhs group dims)."""
    rdn = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, _) = rdn.dot_dimension_numbers
    (r,) = rdn.lhs_ragged_dimensions
    if r in lb:
        mode = "batch"
    elif r in lc:
        mode = "contracting"
    else:
        mode = "rows"
    return mode, r, tuple(lc), tuple(rc), tuple(lb), tuple(rdn.rhs_group_dimensions)


def _supported(ctx_params, shapes):
    mode, r, lc, rc, lb, gd = _dims(ctx_params, len(shapes[0]))
    return mode in ("rows", "contracting") and not lb and len(shapes[2]) == 1


def _ragged_sigs(ctx):
    ls, rs, _ = ctx.in_shapes
    mode, r, lc, rc, _, gd = _dims(ctx.params, len(ls))
    if _supported(ctx.params, ctx.in_shapes):
        lfree = [d for d in range(len(ls)) if d not in lc]
        rfree = [d for d in range(len(rs)) if d not in rc and d not in gd]
        off = 1 if mode == "contracting" else 0  # the group dim leads the result
        for j, d in enumerate(lfree):
            # a free lhs dim (in rows mode the ragged rows too: group sizes cut to each block)
            yield (Split(d), B, B), (Split(off + j),)
        for j, d in enumerate(rfree):
            yield (B, Split(d), B), (Split(off + len(lfree) + j),)
        for a, b in zip(lc, rc):
            # contracting dims split together (the ragged one: group sizes cut to each block)
            yield (Split(a), Split(b), B), (P,)
        if mode == "rows":
            (g,) = gd
            yield (B, Split(g), B), (P,)  # expert parallel: each device its groups' rows
        else:
            yield (B, B, B), (Split(0),)  # each device the groups of its result block
        yield (P, B, B), (P,)
        yield (B, P, B), (P,)
    yield (B, B, B), (B,)


def _block(lay, d):
    """(offset, valid size) of this device's block of dim ``d`` (traced scalars)."""
    offs = jnp.asarray([blk[d][0] for blk in lay.blocks], jnp.int32)
    sizes = jnp.asarray(lay.valid_sizes(d), jnp.int32)
    dev = _device_index(lay.placement)
    return offs[dev], sizes[dev]


def _cut(sizes, lo, hi):
    """Group sizes of the rows ``[lo, hi)``: each group's rows intersected with the window."""
    sizes = sizes.astype(jnp.int32)
    end = jnp.cumsum(sizes)
    start = end - sizes
    return jnp.maximum(jnp.minimum(end, hi) - jnp.maximum(start, lo), 0)


def _window_sizes(sizes, g0, gn, m):
    """Group sizes that run only groups ``[g0, g0 + gn)`` of a ``[m, ...]`` operand: one group for
    the rows before them, the groups (``gn`` of them; groups past the last are empty), one group
    for the rows after. Returns the sizes and the rows ``[lo, hi)`` the groups cover."""
    sizes = sizes.astype(jnp.int32)
    n = sizes.shape[0]
    idx = g0 + jnp.arange(gn, dtype=jnp.int32)
    local = jnp.where(idx < n, sizes[jnp.minimum(idx, n - 1)], 0)
    lo = jnp.sum(jnp.where(jnp.arange(n) < g0, sizes, 0))
    hi = lo + jnp.sum(local)
    return jnp.concatenate([lo[None], local, (m - hi)[None]]), lo, hi


def _rows_mask(m, lo, hi, ndim, d):
    shape = [1] * ndim
    shape[d] = m
    i = lax.broadcasted_iota(jnp.int32, tuple(shape), d)
    return (i >= lo) & (i < hi)


def _ragged_local(st, ins):
    x, w, gs = ins
    params = dict(st.eqn.params)
    mode, r, lc, rc, _, gd = _dims(params, x.ndim)
    lx, lw, _ = st.in_layouts
    bind = st.eqn.primitive.bind
    x = mask_padding(x, lx, lc, 0)
    w = mask_padding(w, lw, rc, 0)
    if lx.ways(r) > 1:  # the ragged rows split: group sizes cut to this block's rows
        lo, n = _block(lx, r)
        gs = _cut(gs, lo, lo + n)
    m = x.shape[r]
    if mode == "rows":
        (g,) = gd
        if lw.ways(g) == 1:
            return bind(x, w, gs, **params)
        # expert parallel: this device's groups, zero rows elsewhere
        g0, _ = _block(lw, g)
        w = mask_padding(w, lw, [g], 0)  # a padded group may hold garbage: no rows use it
        sizes, lo, hi = _window_sizes(gs, g0, w.shape[g], m)
        pad = [(0, 0)] * w.ndim
        pad[g] = (1, 1)
        out = bind(x, jnp.pad(w, pad), sizes, **params)
        out_r = r - sum(1 for d in lc if d < r)  # the ragged dim's place in the result
        return jnp.where(_rows_mask(m, lo, hi, out.ndim, out_r), out, 0)
    # ragged contraction: [m, k] x [m, n] -> [g, k, n]
    lay_out = st.out_layouts[0]
    if lay_out.ways(0) == 1:
        return bind(x, w, gs, **params)
    # the result's groups split: this block's groups only
    ri = rc[lc.index(r)]
    g0, _ = _block(lay_out, 0)
    gn = lay_out.local_shape[0]
    sizes, lo, hi = _window_sizes(gs, g0, gn, m)
    x = jnp.where(_rows_mask(m, lo, hi, x.ndim, r), x, 0)
    w = jnp.where(_rows_mask(m, lo, hi, w.ndim, ri), w, 0)
    return bind(x, w, sizes, **params)[1 : 1 + gn]


def _ragged_cost(ctx, in_nd, out_nd):
    """A matmul's FLOPs (``2 m k n``), divided by the axes that split rows, contraction or
    features; a split of the groups divides nothing (each device runs every row, the rows of
    other devices' groups against zeros)."""
    ls, rs, _ = ctx.in_shapes
    mode, r, lc, rc, _, gd = _dims(ctx.params, len(ls))
    if mode == "contracting":
        total = 2.0 * math.prod(ls) * math.prod(d for i, d in enumerate(rs) if i not in rc)
    else:
        total = 2.0 * math.prod(ls) * math.prod(d for i, d in enumerate(rs) if i not in rc + gd)
    ways = 1
    for a, size in enumerate(ctx.hierarchy):
        x, w, _ = (nd[a] for nd in in_nd)
        expert = mode == "rows" and w.is_split and w.dim in gd
        grouped_out = mode == "contracting" and out_nd[0][a].is_split and out_nd[0][a].dim == 0
        if (x.is_split or w.is_split or out_nd[0][a].is_split) and not expert and not grouped_out:
            ways *= size
    return LocalCost(flops=total / ways)


register_sbp_rule("ragged_dot_general", local=_ragged_local, cost=_ragged_cost)(_ragged_sigs)
