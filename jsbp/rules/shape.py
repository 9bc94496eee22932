"""Shape primitives: broadcast_in_dim, reshape, transpose, squeeze, concatenate, pad, slice, ..."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .._boxing import _device_index
from .._sbp import Split
from ._common import PMAX, PMIN, B, P
from ._registry import register_sbp_rule

_ALL_PARTIAL = ((P,), P), ((PMAX,), PMAX), ((PMIN,), PMIN)


def _out_local_shape(st, i=0):
    return st.out_layouts[i].local_shape


# -- broadcast_in_dim ------------------------------------------------------------------------
def _bcast_sigs(ctx):
    shape = ctx.params["shape"]
    bd = ctx.params["broadcast_dimensions"]
    ins = ctx.in_shapes[0]
    n_dyn = len(ctx.in_avals) - 1  # dynamic shape operands (rare)
    extra_b = (B,) * n_dyn
    for i, d in enumerate(bd):
        if ins[i] == shape[d]:
            yield (Split(i),) + extra_b, (Split(d),)
    new = [d for d in range(len(shape)) if d not in bd or ins[bd.index(d)] != shape[d]]
    for d in new:  # a broadcast copy can be produced already split: no communication
        yield (B,) + extra_b, (Split(d),)
    yield (B,) + extra_b, (B,)
    for (pi,), po in _ALL_PARTIAL:
        yield (pi,) + extra_b, (po,)


def _bcast_local(st, ins):
    params = dict(st.eqn.params)
    params["shape"] = _out_local_shape(st)
    if "sharding" in params:
        params["sharding"] = None
    # an operand dim that is broadcast (size 1) stays size 1 locally; a kept split dim is local already
    return st.eqn.primitive.bind(*ins, **params)


register_sbp_rule("broadcast_in_dim", local=_bcast_local)(_bcast_sigs)


# -- reshape -----------------------------------------------------------------------------------
def _groups(a, b):
    """Pair up contiguous dim groups of shapes a and b with equal products."""
    i = j = 0
    out = []
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = 1
        if i < len(a):
            gi.append(i)
            pa *= a[i]
            i += 1
        if j < len(b):
            gj.append(j)
            pb *= b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            elif i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                break
        out.append((gi, gj))
    return out


def _reshape_sigs(ctx):
    # ``dimensions`` (a permutation) transposes the operand before the reshape: group the
    # transposed dims and map each back to the operand dim it came from
    perm = ctx.params.get("dimensions")
    perm = tuple(range(len(ctx.in_shapes[0]))) if perm is None else tuple(perm)
    a = tuple(ctx.in_shapes[0][p] for p in perm)
    b = tuple(ctx.params["new_sizes"])
    total = math.prod(ctx.hierarchy)
    for gi, gj in _groups(a, b):
        ai = [d for d in gi if a[d] != 1]
        bj = [d for d in gj if b[d] != 1]
        if not ai or not bj:
            continue
        # the major dim of a group keeps its split when both sides divide evenly over every
        # device, or when it is the same dim on both sides (a group (7, 5, 6) -> (7, 30) splits
        # dim 0 into the same blocks, padding included, before and after: any split is exact)
        if a[ai[0]] == b[bj[0]] or (a[ai[0]] % total == 0 and b[bj[0]] % total == 0):
            yield (Split(perm[ai[0]]),) + (B,) * (len(ctx.in_avals) - 1), (Split(bj[0]),)
    yield (B,) * len(ctx.in_avals), (B,)
    for (pi,), po in _ALL_PARTIAL:
        yield (pi,) + (B,) * (len(ctx.in_avals) - 1), (po,)


def _reshape_local(st, ins):
    params = dict(st.eqn.params)
    params["new_sizes"] = tuple(_out_local_shape(st))
    if "sharding" in params:
        params["sharding"] = None
    return st.eqn.primitive.bind(*ins, **params)


register_sbp_rule("reshape", local=_reshape_local)(_reshape_sigs)


# -- transpose, squeeze, rev (jnp.expand_dims traces to broadcast_in_dim) ----------------------------------------------------------
@register_sbp_rule("transpose")
def _transpose(ctx):
    perm = ctx.params["permutation"]
    for j, d in enumerate(perm):
        yield (Split(d),), (Split(j),)
    yield (B,), (B,)
    yield from _ALL_PARTIAL


@register_sbp_rule("squeeze")
def _squeeze(ctx):
    dims = tuple(ctx.params["dimensions"])
    rank = len(ctx.in_shapes[0])
    for d in range(rank):
        if d not in dims:
            yield (Split(d),), (Split(d - sum(1 for x in dims if x < d)),)
    yield (B,), (B,)
    yield from _ALL_PARTIAL


@register_sbp_rule("rev")
def _rev(ctx):
    dims = ctx.params["dimensions"]
    for d in range(len(ctx.in_shapes[0])):
        if d not in dims:
            yield (Split(d),), (Split(d),)
    yield (B,), (B,)
    yield from _ALL_PARTIAL


# -- concatenate, pad, slice, split ----------------------------------------------------------------
@register_sbp_rule("concatenate")
def _concatenate(ctx):
    dim = ctx.params["dimension"]
    n = len(ctx.in_avals)
    for d in range(len(ctx.in_shapes[0])):
        if d != dim:
            yield (Split(d),) * n, (Split(d),)
    yield (B,) * n, (B,)
    yield (P,) * n, (P,)


@register_sbp_rule("pad")
def _pad(ctx):
    cfg = ctx.params["padding_config"]
    for d, (lo, hi, interior) in enumerate(cfg):
        if lo == 0 and hi == 0 and interior == 0:
            yield (Split(d), B), (Split(d),)
    yield (B, B), (B,)
    # pad is linear in (operand, padding value) together: the addends pad with their own values
    yield (P, P), (P,)


def _full_range(start, limit, strides, d, n):
    return start[d] == 0 and limit[d] == n and (strides is None or strides[d] == 1)


def _slice_sigs(ctx):
    p = ctx.params
    shape = ctx.in_shapes[0]
    for d in range(len(shape)):
        if _full_range(p["start_indices"], p["limit_indices"], p["strides"], d, shape[d]):
            yield (Split(d),), (Split(d),)
    yield (B,), (B,)
    yield from _ALL_PARTIAL


def _whole_split_dims(param: str):
    """A ``local`` that runs the op with ``param`` (one size per dim) set to the local block size on
    every split dim: the rules only keep a dim split when the op takes it whole."""

    def local(st, ins):
        params = dict(st.eqn.params)
        lay_in = st.in_layouts[0]
        sizes = list(params[param])
        for d, sp in enumerate(lay_in.splitters):
            if sp:
                sizes[d] = lay_in.local_shape[d]
        params[param] = tuple(sizes)
        return st.eqn.primitive.bind(*ins, **params)

    return local


register_sbp_rule("slice", local=_whole_split_dims("limit_indices"))(_slice_sigs)


@register_sbp_rule("split")
def _split(ctx):
    axis = ctx.params["axis"]
    n = len(ctx.out_avals)
    for d in range(len(ctx.in_shapes[0])):
        if d != axis:
            yield (Split(d),), (Split(d),) * n
    yield (B,), (B,) * n
    yield (P,), (P,) * n


# -- dynamic_slice / dynamic_update_slice ------------------------------------------------------------
def _dyn_slice_sigs(ctx):
    shape = ctx.in_shapes[0]
    sizes = ctx.params["slice_sizes"]
    n_idx = len(ctx.in_avals) - 1
    for d in range(len(shape)):
        if sizes[d] == shape[d]:
            yield (Split(d),) + (B,) * n_idx, (Split(d),)
    yield (B,) * (n_idx + 1), (B,)
    yield (P,) + (B,) * n_idx, (P,)


register_sbp_rule("dynamic_slice", local=_whole_split_dims("slice_sizes"))(_dyn_slice_sigs)


@register_sbp_rule("dynamic_update_slice")
def _dyn_update(ctx):
    shape, upd = ctx.in_shapes[0], ctx.in_shapes[1]
    n_idx = len(ctx.in_avals) - 2
    for d in range(len(shape)):
        if upd[d] == shape[d]:
            yield (Split(d), Split(d)) + (B,) * n_idx, (Split(d),)
    yield (B,) * (n_idx + 2), (B,)
    yield (P, P) + (B,) * n_idx, (P,)


# -- iota, sort ---------------------------------------------------------------------------------------
def _iota_sigs(ctx):
    for d in range(len(ctx.params["shape"])):
        yield (), (Split(d),)  # along the counting dim each block adds its offset
    yield (), (B,)


def _iota_local(st, ins):
    params = dict(st.eqn.params)
    params["shape"] = tuple(_out_local_shape(st))
    if "sharding" in params:
        params["sharding"] = None
    out = st.eqn.primitive.bind(**params)
    dim = params["dimension"]
    lay = st.out_layouts[0]
    if lay.splitters[dim]:
        offsets = np.array([blk[dim][0] for blk in lay.blocks], dtype=np.int64)
        off = jnp.asarray(offsets, jnp.int32)[_device_index(lay.placement)]
        out = out + off.astype(out.dtype)
    return out


register_sbp_rule("iota", local=_iota_local)(_iota_sigs)


@register_sbp_rule("sort")
def _sort(ctx):
    dim = ctx.params["dimension"]
    n = len(ctx.in_avals)
    for d in range(len(ctx.in_shapes[0])):
        if d != dim:
            yield (Split(d),) * n, (Split(d),) * len(ctx.out_avals)
    yield (B,) * n, (B,) * len(ctx.out_avals)


@register_sbp_rule("top_k")
def _top_k(ctx):
    rank = len(ctx.in_shapes[0])
    axis = ctx.params.get("axis", -1) % rank
    n_in = len(ctx.in_avals)
    for d in range(rank):
        if d != axis:
            yield (Split(d),) + (B,) * (n_in - 1), (Split(d),) * len(ctx.out_avals)
    yield (B,) * n_in, (B,) * len(ctx.out_avals)


# -- stack, unstack, tile (JAX 0.10: jnp.stack / jnp.select, jnp.unstack, jnp.tile) -----------
# Pure data movement: every element of the result is one element of an operand, so every partial
# kind is kept (``f(max a_i) = max f(a_i)`` for a permutation of elements, and likewise sums).
@register_sbp_rule("stack")
def _stack(ctx):
    axis = ctx.params["axis"]
    n = len(ctx.in_avals)
    for d in range(len(ctx.in_shapes[0])):
        yield (Split(d),) * n, (Split(d if d < axis else d + 1),)
    yield (B,) * n, (B,)
    for x in (P, PMAX, PMIN):
        yield (x,) * n, (x,)


@register_sbp_rule("unstack")
def _unstack(ctx):
    axis = ctx.params["axis"]
    n = len(ctx.out_avals)
    for d in range(len(ctx.in_shapes[0])):
        if d != axis:
            yield (Split(d),), (Split(d if d < axis else d - 1),) * n
    yield (B,), (B,) * n
    for x in (P, PMAX, PMIN):
        yield (x,), (x,) * n


@register_sbp_rule("tile")
def _tile(ctx):
    reps = ctx.params["reps"]
    for d in range(len(ctx.in_shapes[0])):
        if reps[d] == 1:  # a dim that is not repeated keeps its split
            yield (Split(d),), (Split(d),)
    yield (B,), (B,)
    yield from _ALL_PARTIAL
